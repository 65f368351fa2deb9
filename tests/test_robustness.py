"""Robustness: bad input gets a clear error and leaves no partial output; killed runs lose
nothing; checkpoints cannot run code; non-finite losses are skipped and counted."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from conftest import tiny_config, write_parallel
from ranmt.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ranmt.cli import main
from ranmt.config import load_config
from ranmt.inference.translator import Translator
from ranmt.model import build_model
from ranmt.training.train import train


def run_cli(argv, capsys) -> tuple[int, str]:
    """Run the CLI; return (exit code, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as err:
        code = err.code
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(reverse_data, tmp_path_factory):
    from ranmt.data.corpus import load_meta

    meta = load_meta(reverse_data)
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    path = tmp_path_factory.mktemp("ckpt") / "best"
    torch.manual_seed(0)
    save_checkpoint(path, build_model(cfg.model), cfg,
                    {"src": reverse_data / "spm.src.model", "tgt": reverse_data / "spm.tgt.model"})
    return path


def prepare_argv(root: Path, out: Path) -> list[str]:
    return ["prepare", "--src", "src", "--tgt", "tgt", "--train", str(root / "train"),
            "--valid", str(root / "valid"), "--vocab-size", "30", "--out", str(out)]


# ---------------------------------------------------------------- bad input: prepare


def test_parallel_files_with_different_line_counts(tmp_path, capsys):
    write_parallel(tmp_path / "train", ["a b", "c d", "e"], ["b a", "d c"])
    write_parallel(tmp_path / "valid", ["a"], ["a"])
    code, err = run_cli(prepare_argv(tmp_path, tmp_path / "data"), capsys)
    assert code == 2 and "train.src has 3 lines" in err and "train.tgt has 2" in err
    assert not (tmp_path / "data").exists() and not (tmp_path / "data.tmp").exists()


def test_empty_files(tmp_path, capsys):
    write_parallel(tmp_path / "train", [], [])
    write_parallel(tmp_path / "valid", ["a"], ["a"])
    code, err = run_cli(prepare_argv(tmp_path, tmp_path / "data"), capsys)
    assert code == 2 and "are empty" in err
    assert not (tmp_path / "data").exists()


def test_invalid_utf8_is_an_error_with_byte_offset_or_replaced(tmp_path, capsys):
    write_parallel(tmp_path / "train", ["a b c"] * 20, ["c b a"] * 20)
    write_parallel(tmp_path / "valid", ["a"], ["a"])
    (tmp_path / "train.src").write_bytes(b"a b c\n" * 5 + b"a \xfe c\n" + b"a b c\n" * 14)
    code, err = run_cli(prepare_argv(tmp_path, tmp_path / "data"), capsys)
    assert code == 2 and "invalid UTF-8 at byte 32 (line 6)" in err and "--errors replace" in err
    assert not (tmp_path / "data").exists()
    code, _ = run_cli(prepare_argv(tmp_path, tmp_path / "data") + ["--errors", "replace"], capsys)
    assert code == 0 and (tmp_path / "data" / "meta.json").is_file()


def test_windows_line_endings_bom_and_whitespace_lines(tmp_path, capsys):
    (tmp_path / "train.src").write_bytes("\ufeff".encode() + b"a b\r\n  \r\nc d\r\n" * 10)
    (tmp_path / "train.tgt").write_bytes(b"b a\r\nx\r\nd c\r\n" * 10)
    write_parallel(tmp_path / "valid", ["a"], ["a"])
    code, err = run_cli(prepare_argv(tmp_path, tmp_path / "data"), capsys)
    assert code == 0
    assert "dropped 10 pair(s) with an empty side" in err  # whitespace-only lines
    text = (tmp_path / "data" / "train.src.txt").read_text()
    assert "\r" not in text and "\ufeff" not in text


# ---------------------------------------------------------------- bad input: translate


def test_translate_keeps_empty_and_whitespace_lines_one_to_one(checkpoint, tmp_path, capsys):
    (tmp_path / "in").write_bytes("\ufeffa b\r\n\r\n   \r\nc\u00e9\u4e2d d\r\n".encode())
    code, _ = run_cli(["translate", "--checkpoint", str(checkpoint), "--input",
                       str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                       "--device", "cpu"], capsys)
    assert code == 0
    out = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    assert len(out) == 5 and out[1] == "" and out[2] == "" and out[4] == ""


def test_characters_outside_the_vocabulary_map_to_unk(checkpoint):
    translator = Translator.load(checkpoint, device="cpu", beam=2)
    ids = translator.src_vocab.encode(["\u4e2d\u6587 \U0001f600"])[0]
    assert 1 in ids  # unk
    assert len(translator.translate(["\u4e2d\u6587 \U0001f600", "a b"])) == 2


def test_too_long_line_fails_and_leaves_no_output(checkpoint, tmp_path, capsys):
    (tmp_path / "in").write_text("a b\n" + "a " * 200 + "\n")
    code, err = run_cli(["translate", "--checkpoint", str(checkpoint), "--input",
                         str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                         "--device", "cpu"], capsys)
    assert code == 2 and "input line 2: 200 subwords" in err and "--truncate-long" in err
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_in_translate_input(checkpoint, tmp_path, capsys):
    (tmp_path / "in").write_bytes(b"ok\n\xff\n")
    code, err = run_cli(["translate", "--checkpoint", str(checkpoint), "--input",
                         str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                         "--device", "cpu"], capsys)
    assert code == 2 and "invalid UTF-8 at byte 3 (line 2)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,message", [
    (["--beam", "0"], "--beam must be >= 1"),
    (["--beam", "2", "--nbest", "3"],
     "decode.nbest must be between 1 and the beam size (decode.beam = 2)"),
    (["--max-len-a", "-1"], "--max-len-a must be >= 0, not -1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_impossible_options(checkpoint, argv, message, capsys):
    code, err = run_cli(["translate", "--checkpoint", str(checkpoint), "--device", "cpu", *argv],
                        capsys)
    assert code == 2 and message in err


def test_prepare_impossible_options(tmp_path, capsys):
    code, err = run_cli(prepare_argv(tmp_path, tmp_path / "d")[:-4] + ["--vocab-size", "0",
                                                                      "--out", "x"], capsys)
    assert code == 2 and "--vocab-size must be at least 8" in err


# ---------------------------------------------------------------- bad input: config


def test_unknown_key_and_wrong_type(capsys):
    code, err = run_cli(["info", "train.max_step=5"], capsys)
    assert code == 2 and "unknown config key 'train.max_step'" in err
    assert "did you mean train.max_steps" in err
    code, err = run_cli(["info", "train.max_steps=five"], capsys)
    assert code == 2 and "cannot use 'five' as int" in err


# ---------------------------------------------------------------- bad checkpoints


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_incompatible_version(checkpoint, tmp_path):
    import json

    bad = _copy(checkpoint, tmp_path / "old")
    meta = json.loads((bad / "checkpoint.json").read_text())
    meta["format_version"] = 99
    (bad / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(bad)


def test_truncated_and_corrupted_checkpoint(checkpoint, tmp_path, capsys):
    bad = _copy(checkpoint, tmp_path / "cut")
    weights = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    code, err = run_cli(["translate", "--checkpoint", str(bad), "--device", "cpu"], capsys)
    assert code == 2 and "model.safetensors cannot be loaded" in err
    bad2 = _copy(checkpoint, tmp_path / "json")
    (bad2 / "checkpoint.json").write_text("{not json")
    code, err = run_cli(["translate", "--checkpoint", str(bad2), "--device", "cpu"], capsys)
    assert code == 2 and "checkpoint.json is unreadable or corrupted" in err


def test_missing_sentencepiece_model(checkpoint, tmp_path, capsys):
    bad = _copy(checkpoint, tmp_path / "nospm")
    (bad / "spm.src.model").unlink()
    code, err = run_cli(["translate", "--checkpoint", str(bad), "--device", "cpu"], capsys)
    assert code == 2 and "spm.src.model does not exist" in err


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['RANMT_PWNED']}",))


@pytest.mark.parametrize("target", ["model.safetensors", "checkpoint.json"])
def test_pickle_payload_is_refused_without_executing(checkpoint, tmp_path, monkeypatch, target):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("RANMT_PWNED", str(marker))
    bad = _copy(checkpoint, tmp_path / "evil")
    (bad / target).write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError):
        load_checkpoint(bad)
    torch_style = tmp_path / "evil.pt"
    torch_style.write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CheckpointError):
        load_checkpoint(torch_style)  # a lone pickle file is not a checkpoint
    assert not marker.exists()


# ---------------------------------------------------------------- killed runs


def _cfg(**extra):
    values = {"model.preset": "tiny", "train.lr": 0.003, "train.warmup_steps": 20,
              "train.log_every": 1000, "train.progress": "false", "train.tensorboard": "false",
              "train.validate_bleu": "false", "data.max_tokens": 300, "train.seed": 5}
    values.update({k: str(v) for k, v in extra.items()})
    return load_config(None, values)


def test_interrupted_checkpoint_write_keeps_the_previous(reverse_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_cfg(**{"train.max_steps": 5}), reverse_data, run)
    import ranmt.checkpoint as ckpt_module

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt_module, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(**{"train.max_steps": 10}), reverse_data, run)
    monkeypatch.undo()
    model, _, meta, directory = load_checkpoint(run / "checkpoints" / "step_00000005")
    assert meta["trainer"]["step"] == 5
    summary = train(_cfg(**{"train.max_steps": 10}), reverse_data, run)  # resumes from 5
    assert summary["steps"] == 10
    assert (summary["resumed_from_step"], summary["steps_this_run"]) == (5, 5)


def _train_subprocess(data: Path, run: Path, steps: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ranmt", "train", "--data", str(data), "--out", str(run),
            "model.preset=tiny", "train.lr=0.003", "train.warmup_steps=20", "train.seed=5",
            "train.progress=false", "train.tensorboard=false", "train.validate_bleu=false",
            "data.max_tokens=300", "train.validate_every=10", "train.keep_last=100",
            f"train.max_steps={steps}", "train.threads=1"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_sigkill_then_resume_equals_uninterrupted(reverse_data, tmp_path):
    """Kill a real training process with SIGKILL mid-epoch; resuming reaches the same weights."""
    steps = 100  # within the reverse task's first epoch
    last = f"checkpoints/step_{steps:08d}"
    straight = _train_subprocess(reverse_data, tmp_path / "straight", steps)
    assert straight.wait(timeout=300) == 0
    killed = _train_subprocess(reverse_data, tmp_path / "killed", steps)
    deadline = time.time() + 300
    while not (tmp_path / "killed/checkpoints/step_00000040/checkpoint.json").exists():
        assert time.time() < deadline and killed.poll() is None
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / last).exists()
    resumed = _train_subprocess(reverse_data, tmp_path / "killed", steps)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()
    summary = json.loads((tmp_path / "killed/summary.json").read_text())
    started = summary["resumed_from_step"]  # the last checkpoint before the kill
    assert started is not None and 40 <= started < steps
    assert summary["steps_this_run"] == steps - started
    a = load_file(str(tmp_path / "straight" / last / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / last / "model.safetensors"))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(reverse_data, tmp_path):
    proc = _train_subprocess(reverse_data, tmp_path / "run", 100000)
    deadline = time.time() + 300
    while not (tmp_path / "run/checkpoints/step_00000010/checkpoint.json").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    assert "SIGTERM received" in proc.stderr.read().decode()
    _, _, meta, _ = load_checkpoint(tmp_path / "run")
    assert meta["trainer"]["step"] >= 10


# ---------------------------------------------------------------- non-finite losses


def test_nonfinite_losses_are_skipped_counted_and_stop_the_run(reverse_data, tmp_path,
                                                               monkeypatch):
    import ranmt.training.loss as train_module  # the training step's loss

    real = train_module.label_smoothed_loss
    calls = {"n": 0}

    def sometimes_nan(logits, target, smoothing):
        calls["n"] += 1
        loss, nll = real(logits, target, smoothing)
        if calls["n"] in (3, 4):
            return loss * float("nan"), nll
        return loss, nll

    monkeypatch.setattr(train_module, "label_smoothed_loss", sometimes_nan)
    summary = train(_cfg(**{"train.max_steps": 8}), reverse_data, tmp_path / "a")
    assert summary["nonfinite_skipped"] == 2 and summary["steps"] == 8
    weights = load_file(str(tmp_path / "a/checkpoints/step_00000008/model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())

    monkeypatch.setattr(train_module, "label_smoothed_loss",
                        lambda lo, ta, sm: (real(lo, ta, sm)[0] * float("inf"),
                                            real(lo, ta, sm)[1]))
    summary = train(_cfg(**{"train.max_steps": 50, "train.max_nonfinite": 3}), reverse_data,
                    tmp_path / "b")
    assert summary["steps"] == 0 and "non-finite losses in a row" in summary["stop_reason"]


# ---------------------------------------------------------------- property-based


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(st.text(max_size=30), st.binary(max_size=30)), min_size=1,
                      max_size=8))
def test_random_text_never_crashes_and_keeps_line_counts(lines, tmp_path_factory):
    from ranmt.data.corpus import PrepareError, prepare
    from ranmt.data.text import decode_lines
    from ranmt.data.vocab import VocabError

    root = tmp_path_factory.mktemp("prop")
    raw = b"\n".join(line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")
                     for line in lines) + b"\n"
    for name in ("train.src", "train.tgt", "valid.src", "valid.tgt"):
        (root / name).write_bytes(raw)
    expected = len(decode_lines(raw, "x", "replace"))
    try:
        meta = prepare("src", "tgt", str(root / "train"), str(root / "valid"), root / "data",
                       vocab_size=60, errors="replace", log=lambda _m: None)
    except (PrepareError, VocabError) as err:  # a clean, explained refusal, e.g. no
        assert any(text in str(err) for text in ("empty", "--vocab-size", "cannot train"))
        return
    assert meta["splits"]["valid"]["pairs"] == expected
    cfg = tiny_config(**{"model.src_vocab_size": meta["src_vocab_size"],
                         "model.tgt_vocab_size": meta["tgt_vocab_size"]})
    model = build_model(cfg.model)
    from ranmt.data.vocab import Vocab

    translator = Translator(model, cfg, Vocab(root / "data/spm.src.model"),
                            Vocab(root / "data/spm.tgt.model"), torch.device("cpu"))
    translator.decode_config.truncate_long = True
    inputs = decode_lines(raw, "x", "replace")
    outputs = translator.translate(inputs)
    assert len(outputs) == len(inputs)
    assert all(out == "" for inp, out in zip(inputs, outputs) if not inp.strip())
