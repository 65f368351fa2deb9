"""``train.host_reads=log`` (ranmt.training.deferred): training steps that leave their results
on the device, read on the host at log steps only — the CUDA default, selectable on the CPU
so that it is checked here.

What must hold: the same losses as reading every step; no host read inside the steps
between log steps (counted with SyncCounter, as the sync-free search is); a non-finite loss
still skips its update (on the device, through fused Adam's ``found_inf``), is counted, and
too many in a row stop the run at the next read.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import logged_losses
from ranmt.checkpoint import load_training_state
from ranmt.runtime.host_syncs import SyncCounter
from ranmt.training.train import train
from test_robustness import _cfg  # the tiny reverse-task training config


def test_deferred_reads_log_the_losses_of_per_step_reads(reverse_data, tmp_path):
    runs = {}
    for mode in ("step", "log"):
        runs[mode] = train(_cfg(**{"train.max_steps": 30, "train.log_every": 10,
                                   "train.host_reads": mode}), reverse_data, tmp_path / mode)
    step_losses, log_losses = logged_losses(tmp_path / "step"), logged_losses(tmp_path / "log")
    assert len(step_losses) == len(log_losses) == 3
    # fused Adam (deferred reads need it) and foreach Adam round differently
    assert log_losses == pytest.approx(step_losses, rel=2e-3)
    assert runs["log"]["steps"] == 30 and runs["log"]["nonfinite_skipped"] == 0
    assert runs["log"]["train_tokens_per_s"] > 0
    assert "host reads losses every 10 steps" in (tmp_path / "log/train.log").read_text()


def _syncs(reverse_data, run, mode: str, steps: int) -> int:
    with SyncCounter() as counter:
        train(_cfg(**{"train.max_steps": steps, "train.host_reads": mode}), reverse_data, run)
    return counter.total


@pytest.mark.parametrize("mode", ["step", "log"])
def test_deferred_steps_read_nothing_on_the_host(reverse_data, tmp_path, mode):
    """Host reads per step: the difference between a 10- and a 20-step run (what a run does
    once cancels), divided by 10: at least two with per-step reads, none deferred."""
    short = _syncs(reverse_data, tmp_path / "a", mode, 10)
    long = _syncs(reverse_data, tmp_path / "b", mode, 20)
    per_step = (long - short) / 10
    if mode == "step":
        assert per_step >= 2
    else:
        assert per_step == 0, (short, long)


def _nan_at(monkeypatch, calls: set[int] | None):
    """Make the training loss NaN at the given calls (all calls when None)."""
    import ranmt.training.loss as train_module  # the training step's loss

    real = train_module.label_smoothed_loss
    count = {"n": 0}

    def sometimes_nan(logits, target, smoothing):
        count["n"] += 1
        loss, nll = real(logits, target, smoothing)
        if calls is None or count["n"] in calls:
            return loss * float("nan"), nll
        return loss, nll

    monkeypatch.setattr(train_module, "label_smoothed_loss", sometimes_nan)


def test_deferred_nonfinite_losses_are_skipped_on_the_device(reverse_data, tmp_path,
                                                             monkeypatch):
    _nan_at(monkeypatch, {3, 4})
    summary = train(_cfg(**{"train.max_steps": 8, "train.host_reads": "log"}), reverse_data,
                    tmp_path / "a")
    # the skipped steps count as steps here (the host learns of them at the read)
    assert summary["nonfinite_skipped"] == 2 and summary["steps"] == 8
    checkpoint = tmp_path / "a/checkpoints/step_00000008"
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    optimizer, _ = load_training_state(checkpoint)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {6.0}  # 8 - 2 skipped
    assert "2 non-finite loss(es) since the last read" in (tmp_path / "a/train.log").read_text()


def test_deferred_nonfinite_losses_in_a_row_stop_at_the_next_read(reverse_data, tmp_path,
                                                                  monkeypatch):
    _nan_at(monkeypatch, None)
    summary = train(_cfg(**{"train.max_steps": 50, "train.max_nonfinite": 3,
                            "train.log_every": 2, "train.host_reads": "log"}),
                    reverse_data, tmp_path / "b")
    assert summary["steps"] == 4  # read at 2 (2 in a row), at 4 (4 >= 3): stop
    assert "non-finite losses in a row" in summary["stop_reason"]
    assert summary["nonfinite_skipped"] == 4
    optimizer, _ = load_training_state(tmp_path / "b/checkpoints/step_00000004")
    assert all(float(s["step"]) == 0 for s in optimizer["state"].values())  # no update ran
    assert not any(math.isnan(x) for x in logged_losses(tmp_path / "b")), "NaN in the log"


def test_fp16_keeps_per_step_reads(tmp_path):
    """fp16's loss scaler checks every step: host_reads=log falls back, with a note (fp16
    needs CUDA, so only the choice is checked here)."""
    from ranmt.training import train as train_module

    run = object.__new__(train_module.TrainingRun)
    run.t = _cfg(**{"train.host_reads": "log"}).train
    run.device = torch.device("cpu")
    run.notes = []
    run.policy = train_module.PrecisionPolicy("fp16", "cuda")
    assert run._reads_deferred() is False and "fp16" in run.notes[0]
    run.policy = train_module.PrecisionPolicy("bf16", "cuda")
    assert run._reads_deferred() is True
    run.t.host_reads = "auto"
    assert run._reads_deferred() is False  # auto: deferred on CUDA only
    run.device = torch.device("cuda")
    assert run._reads_deferred() is True
