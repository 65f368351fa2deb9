"""Training: loss and schedule values, a run that learns, exact resume."""

from __future__ import annotations

import json
import math
import time

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


def test_resume_with_another_model_config_goes_on_with_the_stored_one(reverse_data, tmp_path):
    """A run resumed with a changed model config (here its dropout) continues the model it
    saved, says so in train.log, and ends where the uninterrupted run ends."""
    from ranmt.checkpoint import load_checkpoint

    started = time.monotonic()
    big = {"data.max_tokens": 12000}  # a few steps an epoch: the split falls in epoch 1
    train(_cfg(**{"train.max_steps": 12, "model.dropout": 0.2, **big}), reverse_data,
          tmp_path / "straight")
    train(_cfg(**{"train.max_steps": 6, "model.dropout": 0.2, **big}), reverse_data,
          tmp_path / "split")
    summary = train(_cfg(**{"train.max_steps": 12, "model.dropout": 0.0, **big}), reverse_data,
                    tmp_path / "split")
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (6, 6)
    states = {name: load_checkpoint(tmp_path / name / "checkpoints/step_00000012")[2]["trainer"]
              for name in ("straight", "split")}
    middle = load_checkpoint(tmp_path / "split/checkpoints/step_00000006")[2]["trainer"]
    assert middle["epoch"] >= 1  # the position in the data is what a resume must restore
    for key in ("step", "epoch", "batch_in_epoch"):
        assert states["split"][key] == states["straight"][key], key
    # time spent is carried over: the resumed run's clock starts where the first one stopped
    assert 0 < middle["elapsed"] < states["split"]["elapsed"] < time.monotonic() - started
    log = (tmp_path / "split/train.log").read_text()
    assert f"note: resuming {tmp_path / 'split'} with the model config stored in its checkpoint" \
        in log
    _, cfg, _, _ = load_checkpoint(tmp_path / "split/checkpoints/step_00000012")
    assert cfg.model.dropout == 0.2
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000012/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000012/model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    same = train(_cfg(**{"train.max_steps": 14, "model.dropout": 0.2}), reverse_data,
                 tmp_path / "straight")
    assert same["resumed_from_step"] == 12
    assert "model config stored" not in (tmp_path / "straight/train.log").read_text()


def test_training_keeps_last_k_and_best(reverse_data, tmp_path):
    cfg = _cfg(**{"train.max_steps": 30, "train.validate_every": 10, "train.keep_last": 2,
                  "train.validate_bleu": "true", "train.valid_max_sentences": 20})
    summary = train(cfg, reverse_data, tmp_path / "run")
    steps = sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir())
    assert steps == ["step_00000020", "step_00000030"]
    best = json.loads((tmp_path / "run/best/checkpoint.json").read_text())
    assert best["trainer"]["step"] == summary["best_step"]
    train(_cfg(**{"train.max_steps": 4, "train.validate_every": 2, "train.keep_last": 1}),
          reverse_data, tmp_path / "one")
    assert [p.name for p in (tmp_path / "one/checkpoints").iterdir()] == ["step_00000004"]
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
    best = json.loads((tmp_path / "run/best/checkpoint.json").read_text())["trainer"]
    assert best["step"] == 5  # written at the best validation only, not at the later ones
    assert math.isfinite(best["valid"]["valid_loss"])


def test_the_validation_metric_picks_the_best_checkpoint_and_a_resume_keeps_it(
        reverse_data, tmp_path):
    """train.valid_metric: the greedy decode scored with chrF (not BLEU) chooses the best
    step; a resumed run with another metric goes on with the one it started with; switching
    to the loss is refused."""
    from ranmt.config import ConfigError

    chrf = {"train.validate_bleu": "true", "train.valid_metric": "chrf",
            "train.validate_every": 4, "train.max_steps": 8}
    first = train(_cfg(**chrf), reverse_data, tmp_path / "run")
    scores = {v["step"]: v["valid_chrf"] for v in first["validations"]}
    assert sorted(scores) == [4, 8] and not any("valid_bleu" in v
                                                for v in first["validations"])
    assert first["valid_metric"] == "chrf" and first["best_valid_bleu"] is None
    assert first["best_valid_score"] == max(scores.values())
    assert first["best_step"] == max(scores, key=lambda step: (scores[step], -step))
    again = train(_cfg(**{**chrf, "train.valid_metric": "bleu", "train.max_steps": 12}),
                  reverse_data, tmp_path / "run")
    assert again["valid_metric"] == "chrf" and "valid_chrf" in again["validations"][-1]
    assert "train.valid_metric=chrf (as the run started" in \
        (tmp_path / "run/train.log").read_text()
    with pytest.raises(ConfigError, match="chosen by chrf, not loss"):
        train(_cfg(**{**chrf, "train.validate_bleu": "false", "train.max_steps": 16}),
              reverse_data, tmp_path / "run")


def test_progress_bar_on_a_terminal_only(reverse_data, tmp_path, monkeypatch):
    """Redirected stderr (a log file) gets the log lines but no carriage-return frames."""
    import sys

    from ranmt.training.train import TrainingRun

    cfg = _cfg(**{"train.max_steps": 1, "train.progress": "true"})
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert TrainingRun(cfg, reverse_data, tmp_path / "a").progress.disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert not TrainingRun(cfg, reverse_data, tmp_path / "b").progress.disable
