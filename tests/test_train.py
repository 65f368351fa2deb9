"""Training: loss and schedule values, a run that learns, exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from ranmt.config import load_config
from ranmt.training.train import inverse_sqrt_lr, label_smoothed_loss, train


def test_inverse_sqrt_schedule_values():
    assert inverse_sqrt_lr(1, 1e-3, 100, 0.0) == pytest.approx(1e-5)
    assert inverse_sqrt_lr(50, 1e-3, 100, 0.0) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(100, 1e-3, 100) == pytest.approx(1e-3)
    assert inverse_sqrt_lr(400, 1e-3, 100) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(1234, 2e-3, 0) == 2e-3


def test_label_smoothing_value_matches_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    target = torch.tensor([[4, 5, 0], [6, 0, 0]])  # 0 = padding, ignored
    eps = 0.1
    loss, nll = label_smoothed_loss(logits, target, eps)
    logp = torch.log_softmax(logits, -1)
    expected = expected_nll = 0.0
    for b in range(2):
        for t in range(3):
            y = int(target[b, t])
            if y == 0:
                continue
            expected += (1 - eps) * -logp[b, t, y] + eps * -logp[b, t].mean()
            expected_nll += -logp[b, t, y]
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert float(nll) == pytest.approx(float(expected_nll), rel=1e-5)


def _cfg(**extra):
    values = {"model.preset": "tiny", "train.lr": 0.003, "train.warmup_steps": 20,
              "train.validate_every": 1000, "train.log_every": 1000, "train.progress": "false",
              "train.tensorboard": "false", "train.validate_bleu": "false",
              "data.max_tokens": 400}
    values.update({k: str(v) for k, v in extra.items()})
    return load_config(None, values)


def test_resume_is_exact(reverse_data, tmp_path):
    """Train 16 steps at once == train 8, stop, resume to 16 (bit for bit on CPU)."""
    train(_cfg(**{"train.max_steps": 16}), reverse_data, tmp_path / "straight")
    first = train(_cfg(**{"train.max_steps": 8}), reverse_data, tmp_path / "split")
    summary = train(_cfg(**{"train.max_steps": 16}), reverse_data, tmp_path / "split")
    assert summary["steps"] == 16
    # the second process started from the checkpoint (a run that silently started over
    # would reach the same bits: training is deterministic)
    assert (first["resumed_from_step"], first["steps_this_run"]) == (None, 8)
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (8, 8)
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000016/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000016/model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_training_keeps_last_k_and_best(reverse_data, tmp_path):
    cfg = _cfg(**{"train.max_steps": 30, "train.validate_every": 10, "train.keep_last": 2,
                  "train.validate_bleu": "true", "train.valid_max_sentences": 20})
    summary = train(cfg, reverse_data, tmp_path / "run")
    steps = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert steps == ["step_00000020", "step_00000030"]
    best = json.loads((tmp_path / "run/best/checkpoint.json").read_text())
    assert best["trainer"]["step"] == summary["best_step"]
    assert math.isfinite(summary["train_tokens_per_s"]) and summary["train_tokens_per_s"] > 0


def test_max_epochs_stops(reverse_data, tmp_path):
    summary = train(_cfg(**{"train.max_epochs": 1, "data.max_tokens": 4000}), reverse_data,
                    tmp_path / "run")
    assert summary["epochs_completed"] == 1
    assert "max_epochs" in summary["stop_reason"]


def test_average_checkpoints(reverse_data, tmp_path):
    from ranmt.checkpoint import average_checkpoints, load_checkpoint

    cfg = _cfg(**{"train.max_steps": 9, "train.validate_every": 3, "train.keep_last": 3})
    train(cfg, reverse_data, tmp_path / "run")
    out = average_checkpoints(tmp_path / "run", 2, tmp_path / "avg")
    averaged, _, meta, _ = load_checkpoint(out)
    assert meta["trainer"]["averaged"] == ["step_00000006", "step_00000009"]
    a = load_file(str(tmp_path / "run/checkpoints/step_00000006/model.safetensors"))
    b = load_file(str(tmp_path / "run/checkpoints/step_00000009/model.safetensors"))
    state = averaged.state_dict()
    for key in a:
        torch.testing.assert_close(state[key], (a[key] + b[key]) / 2)
    with pytest.raises(RuntimeError, match="fewer than"):
        average_checkpoints(tmp_path / "run", 5, tmp_path / "avg5")


def test_early_stopping_after_patience(reverse_data, tmp_path):
    # lr 0: the validation loss never improves after the first validation
    cfg = _cfg(**{"train.lr": 0.0, "train.warmup_init_lr": 0.0, "train.max_steps": 50,
                  "train.validate_every": 5, "train.patience": 2})
    summary = train(cfg, reverse_data, tmp_path / "run")
    assert summary["steps"] == 15 and "early stopping" in summary["stop_reason"]
    assert summary["best_step"] == 5


def test_progress_bar_on_a_terminal_only(reverse_data, tmp_path, monkeypatch):
    """Redirected stderr (a log file) gets the log lines but no carriage-return frames."""
    import sys

    from ranmt.training.train import TrainingRun

    cfg = _cfg(**{"train.max_steps": 1, "train.progress": "true"})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert TrainingRun(cfg, reverse_data, tmp_path / "a").progress.disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not TrainingRun(cfg, reverse_data, tmp_path / "b").progress.disable
