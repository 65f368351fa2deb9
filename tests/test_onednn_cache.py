"""oneDNN's primitive cache on a CPU: ``ranmt train``, ``ranmt experiment`` and the trainer keep
16 compiled bf16 products instead of 1,024 (ranmt.runtime.memory), a value in the environment
wins, and the value set from Python reaches oneDNN."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ranmt.cli import main
from ranmt.config import load_config
from ranmt.runtime import memory
from ranmt.runtime.memory import ONEDNN_CACHE_VARIABLES, cap_onednn_primitive_cache
from ranmt.training.train import train

NEW, OLD = ONEDNN_CACHE_VARIABLES


@pytest.fixture()
def no_cache_variable(monkeypatch):
    """Neither variable set; whatever the test sets is undone after it."""
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores the original
        monkeypatch.delenv(name)


def test_the_cap_is_set_only_where_the_environment_names_none(no_cache_variable, monkeypatch):
    assert cap_onednn_primitive_cache() is True
    assert os.environ[NEW] == "16"
    monkeypatch.setenv(NEW, "1024")
    assert cap_onednn_primitive_cache() is False
    assert os.environ[NEW] == "1024"
    monkeypatch.delenv(NEW)
    monkeypatch.setenv(OLD, "300")  # oneDNN's old name counts too
    assert cap_onednn_primitive_cache() is False
    assert NEW not in os.environ


@pytest.mark.parametrize("preset", [None, "1024"], ids=["unset", "user-value"])
def test_train_and_experiment_commands_cap_the_cache_before_they_run(
        no_cache_variable, monkeypatch, tmp_path, preset):
    """What the command's library call sees: 16 when nothing was set, else the user's value."""
    import ranmt.experiment
    import ranmt.training.train

    if preset is not None:
        monkeypatch.setenv(NEW, preset)
    seen = {}

    def fake_train(cfg, data_dir, run_dir):
        seen["train"] = os.environ.get(NEW)
        return {}

    def fake_experiment(*args, **kwargs):
        seen["experiment"] = os.environ.get(NEW)

    monkeypatch.setattr(ranmt.training.train, "train", fake_train)
    monkeypatch.setattr(ranmt.experiment, "run_experiment", fake_experiment)
    main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")])
    monkeypatch.delenv(NEW, raising=False)
    if preset is not None:
        monkeypatch.setenv(NEW, preset)
    main(["experiment", str(tmp_path / "grid.yaml")])
    expected = preset or "16"
    assert seen == {"train": expected, "experiment": expected}


def test_a_cpu_training_run_caps_the_cache(no_cache_variable, reverse_data, tmp_path):
    """The library's train() on a CPU sets it too (a run started from Python, a cluster job)."""
    cfg = load_config(None, {"model.preset": "tiny", "train.max_steps": "2",
                             "train.device": "cpu", "train.progress": "false",
                             "train.tensorboard": "false", "train.validate_bleu": "false",
                             "train.validate_every": "1000", "data.max_tokens": "400"})
    train(cfg, reverse_data, tmp_path / "run")
    assert os.environ[NEW] == str(memory.TRAINING_PRIMITIVE_CACHE)


_PROBE = """
import sys
import torch
from ranmt.runtime.memory import cap_onednn_primitive_cache
cap_onednn_primitive_cache()
if sys.argv[1] == "bf16-linear":
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    def product(rows):
        torch.nn.functional.linear(torch.randn(rows, 32, dtype=torch.bfloat16), weight)
else:  # an fp32 convolution: oneDNN's on every x86 CPU, AVX2 alone included
    kernel = torch.randn(8, 4, 3, 3)
    def product(rows):
        torch.nn.functional.conv2d(torch.randn(2, 4, rows, 16), kernel)
product(7)
for rows in range(10, 30):
    product(rows)
print("AGAIN", flush=True)
product(7)
"""
PRIMITIVES = {"bf16-linear": "", "fp32-conv": ",convolution,"}
"""The probe's products, and what names the product's own primitive in oneDNN's log ("":
the first primitive the product creates)."""


def _second_creation(env_value: str | None, probe: str) -> str | None:
    """oneDNN's verbose verdict on re-creating the first product of ``probe`` after 20 other
    shapes (None: the product does not go through oneDNN on this CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["ONEDNN_VERBOSE"] = "all"
    if env_value is not None:
        env[NEW] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE, probe], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    after = out.split("AGAIN", 1)[1]
    for line in after.splitlines():
        if PRIMITIVES[probe] not in line:
            continue
        for field in line.split(","):
            if field.startswith("create:cache_"):
                return field.removeprefix("create:")
    return None


def test_the_capacity_set_after_import_torch_reaches_onednn():
    """Capped (the probe calls cap_onednn_primitive_cache after `import torch`): the first
    shape was evicted by 20 others and is built again; with 1,024 in the environment (which
    the call leaves alone) it is still cached. An fp32 convolution on every CPU, and the
    bf16 products that training runs where this CPU computes them with oneDNN (not on an
    AVX2-only CPU)."""
    assert _second_creation(None, "fp32-conv") == "cache_miss"
    assert _second_creation("1024", "fp32-conv") == "cache_hit"
    capped = _second_creation(None, "bf16-linear")
    if capped is not None:
        assert capped == "cache_miss"
        assert _second_creation("1024", "bf16-linear") == "cache_hit"
