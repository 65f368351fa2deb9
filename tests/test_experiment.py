"""`ranmt experiment`: a tiny grid end to end; its table equals `ranmt evaluate`; resume."""

from __future__ import annotations

import json

import yaml

import ranmt.experiment as experiment_module
from conftest import reverse_task, write_parallel
from ranmt.cli import main


def _grid(tmp_path) -> object:
    for name, count, seed in (("train", 3000, 0), ("valid", 60, 1), ("test", 40, 2)):
        src, tgt = reverse_task(count, seed)
        write_parallel(tmp_path / name, src, tgt)
    config = {
        "name": "tiny-grid", "out": str(tmp_path / "exp"), "seeds": [1], "baseline": "TransF",
        "overrides": {"model.preset": "tiny", "train.max_steps": 40, "train.lr": 0.003,
                      "train.warmup_steps": 20, "train.validate_every": 20,
                      "train.validate_bleu": False, "train.progress": False,
                      "train.tensorboard": False, "data.max_tokens": 600},
        "decode": {"beam": 2, "device": "cpu"},
        "bootstrap_samples": 200,
        "datasets": [{"name": "reverse", "src": "src", "tgt": "tgt",
                      "train": str(tmp_path / "train"), "valid": str(tmp_path / "valid"),
                      "tests": {"test": str(tmp_path / "test")}, "vocab_size": 40,
                      "max_positions": 64}],
        "variants": [{"name": "TransF", "overrides": {"model.arch": "transf"}},
                     {"name": "RAN-ALL", "overrides": {"model.arch": "ran-all"}}],
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_tiny_grid_table_matches_evaluate_and_resumes(tmp_path, capsys, monkeypatch):
    path = _grid(tmp_path)
    main(["experiment", str(path)])
    exp = tmp_path / "exp"
    results = json.loads((exp / "results.json").read_text())
    markdown = (exp / "results.md").read_text()
    assert "| metric | TransF | RAN-ALL |" in markdown and "| SacreBLEU |" in markdown
    rows = [markdown.index(f"| {name} |") for name in ("BLEU", "SacreBLEU", "chrF", "TER")]
    assert rows == sorted(rows)  # the RAN paper's Table 1 order
    assert results["commit"] is None or len(results["commit"]) == 40
    scores = results["datasets"]["reverse"]["tests"]["test"]["scores"]
    for variant in ("TransF", "RAN-ALL"):
        run = exp / "runs" / "reverse" / variant / "seed1" / "run"
        capsys.readouterr()
        main(["evaluate", "--checkpoint", str(run), "--data", str(exp / "data" / "reverse"),
              "--split", "test", "--beam", "2", "--device", "cpu", "--json"])
        evaluated = json.loads(capsys.readouterr().out)
        assert scores[variant]["bleu"]["mean"] == evaluated["bleu"]
        assert scores[variant]["chrf"]["mean"] == evaluated["chrf"]
        row = f"{evaluated['bleu']:.2f}"
        assert row in markdown

    # Interrupt: the RAN-ALL cell lost its result; rerunning recomputes only that cell.
    transf_cell = exp / "runs/reverse/TransF/seed1/cell.json"
    before = transf_cell.stat().st_mtime_ns
    (exp / "runs/reverse/RAN-ALL/seed1/cell.json").unlink()
    calls = []
    real_train = experiment_module.train

    def counting_train(cfg, data_dir, run_dir):
        calls.append(str(run_dir))
        return real_train(cfg, data_dir, run_dir)

    monkeypatch.setattr(experiment_module, "train", counting_train)
    main(["experiment", str(path)])
    assert len(calls) == 1 and "RAN-ALL" in calls[0]
    assert transf_cell.stat().st_mtime_ns == before
    again = json.loads((exp / "results.json").read_text())
    assert again["datasets"]["reverse"]["tests"]["test"]["scores"] == scores


def test_every_shipped_experiment_config_is_valid():
    """Each configs/experiments/*.yaml loads and every variant builds a valid config."""
    from pathlib import Path

    from ranmt.config import load_config
    from ranmt.experiment import load_experiment

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "configs" / "experiments").glob("*.yaml"))
    assert len(files) >= 7
    for path in files:
        experiment = load_experiment(path)
        for variant in experiment.variants:
            overrides = {**experiment.overrides, **variant.get("overrides", {})}
            load_config(root / experiment.base_config,
                        {k: str(v) for k, v in overrides.items()})


def test_concurrent_workers_skip_claimed_cells_and_take_over_stale_locks(tmp_path):
    """A cell locked by a live worker is skipped (partial tables); a dead worker's lock is
    taken over and the last worker writes the complete tables."""
    import os
    import socket
    import subprocess
    import sys

    path = _grid(tmp_path)
    exp = tmp_path / "exp"
    lock = exp / "runs/reverse/RAN-ALL/seed1/lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {os.getppid()}")  # a live process, not us
    main(["experiment", str(path)])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is False and [c["variant"] for c in results["cells"]] == ["TransF"]
    assert (exp / "results.md").read_text().startswith("> Partial: 1 of 2 cells")
    assert lock.is_file()  # not ours to remove

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    lock.write_text(f"{socket.gethostname()} {dead}")
    main(["experiment", str(path)])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is True
    assert [c["variant"] for c in results["cells"]] == ["TransF", "RAN-ALL"]
    assert not lock.exists() and "Partial" not in (exp / "results.md").read_text()


def test_signal_during_a_cell_stops_the_worker_without_recording_it(tmp_path, monkeypatch):
    """A SIGTERM'd cell (train returns 'SIGTERM received') is not marked finished, the worker
    exits with status 130 before the next cell, and a rerun resumes and completes the grid;
    --out moves the whole grid, and a moved results folder still rebuilds its tables."""
    import shutil

    import pytest

    path = _grid(tmp_path)
    out = tmp_path / "elsewhere"
    real_train = experiment_module.train
    calls = []

    def signalled_train(cfg, data_dir, run_dir):
        calls.append(str(run_dir))
        summary = real_train(cfg, data_dir, run_dir)
        return {**summary, "stop_reason": "SIGTERM received"}

    monkeypatch.setattr(experiment_module, "train", signalled_train)
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", str(path), "--out", str(out)])
    assert exit_info.value.code == 130
    assert len(calls) == 1  # the worker stopped; RAN-ALL was not started
    cell_dir = out / "runs/reverse/TransF/seed1"
    assert not (cell_dir / "cell.json").exists() and not (cell_dir / "lock").exists()
    assert (cell_dir / "run" / "checkpoints").is_dir()  # saved for resume
    assert not (tmp_path / "exp").exists()  # the file's `out` was overridden

    monkeypatch.setattr(experiment_module, "train", real_train)
    main(["experiment", str(path), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True

    moved = tmp_path / "moved"
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("run"))
    shutil.rmtree(out)
    main(["experiment", str(path), "--out", str(moved)])  # nothing to train: tables only
    again = json.loads((moved / "results.json").read_text())
    assert again["datasets"] == results["datasets"]
