"""``ranmt experiment GRID --launcher``: a grid's cells as submitit jobs (issue 68, item 6),
checked with submitit's local executor (real processes): one job per unfinished cell, a job
killed mid-training resumes from its checkpoint when the grid is submitted again, and every
cell finishes exactly once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from ranmt.config import ConfigError
from ranmt.experiment.launch import LaunchOptions, submit_grid
from test_experiment import _grid  # the tiny reverse-task grid: TransF and RAN-ALL, seed 1

submitit = pytest.importorskip("submitit")


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _training_started(run: Path) -> bool:
    log = run / "train.log"
    return log.is_file() and any(line.startswith("step ") for line in
                                 log.read_text().splitlines())


def test_a_killed_cell_job_resumes_and_every_cell_finishes_once(tmp_path):
    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["overrides"].update({"train.max_steps": 200, "train.log_every": 5,
                                "train.validate_every": 200})
    path.write_text(yaml.safe_dump(config))
    exp = tmp_path / "exp"
    options = LaunchOptions(launcher="local", time_limit_min=10)
    messages: list[str] = []
    jobs = submit_grid(path, options, log=messages.append)
    assert len(jobs) == 2 and messages[0] == "2 of 2 cells unfinished"
    transf, ran = jobs
    ran_run = exp / "runs/reverse/RAN-ALL/seed1/run"
    _wait_for(lambda: _training_started(ran_run), 240, "RAN-ALL's first training steps")
    ran.cancel()  # SIGINT: the trainer saves a checkpoint and the cell stays unfinished
    assert transf.result() is True
    # The cancelled job ends without a result (its `result()` would raise only after
    # submitit's 15 s wait for a result file that never comes).
    ran.wait()
    assert not ran.paths.result_pickle.exists()
    transf_cell = exp / "runs/reverse/TransF/seed1/cell.json"
    assert transf_cell.is_file() and not (ran_run.parent / "cell.json").is_file()
    finished_at = transf_cell.stat().st_mtime_ns

    again = submit_grid(path, options, log=messages.append)
    assert len(again) == 1 and messages[-2] == "1 of 2 cells unfinished"
    assert again[0].result() is True
    summary = json.loads((ran_run / "summary.json").read_text())
    assert summary["steps"] == 200 and summary["resumed_from_step"] > 0
    assert transf_cell.stat().st_mtime_ns == finished_at  # not trained again
    assert submit_grid(path, options, log=messages.append) == []
    assert messages[-1] == "0 of 2 cells unfinished"
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is True


def test_an_unknown_launcher_is_an_error(tmp_path):
    path = _grid(tmp_path)
    with pytest.raises(ConfigError, match="--launcher must be one of"):
        submit_grid(path, LaunchOptions(launcher="pbs"), log=lambda line: None)


def test_several_gpus_per_cell_are_refused_with_the_reason(tmp_path):
    path = _grid(tmp_path)
    with pytest.raises(ConfigError, match="one GPU per cell"):
        submit_grid(path, LaunchOptions(launcher="local", gpus=2), log=lambda line: None)
