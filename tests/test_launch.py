"""``ranmt experiment GRID --launcher``: a grid's cells as submitit jobs (issue 68, item 6),
checked with submitit's local executor (real processes): one job per unfinished cell, a job
killed mid-training resumes from its checkpoint when the grid is submitted again, and every
cell finishes exactly once."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from ranmt.config import ConfigError
from ranmt.experiment.launch import LaunchOptions, submit_grid
from test_distill import distilled_grid  # the tiny grid with a teacher and its student
from test_experiment import _grid  # the tiny reverse-task grid: TransF and RAN-ALL, seed 1

submitit = pytest.importorskip("submitit")


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_killed_cell_job_resumes_and_every_cell_finishes_once(tmp_path):
    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["overrides"].update({"train.max_steps": 200, "train.log_every": 5,
                                "train.validate_every": 20})
    path.write_text(yaml.safe_dump(config))
    exp = tmp_path / "exp"
    options = LaunchOptions(launcher="local", time_limit_min=10)
    messages: list[str] = []
    jobs = submit_grid(path, options, log=messages.append)
    assert len(jobs) == 2 and messages[0] == "2 of 2 cells unfinished"
    transf, ran = jobs
    ran_run = exp / "runs/reverse/RAN-ALL/seed1/run"
    # a step checkpoint first: the one SIGINT makes the trainer save can be cut short (the
    # local controller SIGKILLs its job a moment after the SIGINT, and a loaded machine may
    # not save by then), and the cell must resume from a checkpoint either way
    _wait_for(lambda: (ran_run / "checkpoints" / "step_00000020").is_dir(), 240,
              "RAN-ALL's first step checkpoint")
    ran.cancel()  # SIGINT: the trainer stops (saving) and the cell stays unfinished
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


class _RecordingExecutor:
    """Stands in for submitit's SLURM executor: records each submission with the extra
    SLURM parameters in force when it was made."""

    def __init__(self):
        self.extra: dict = {}
        self.submitted: list[tuple[str, str, dict]] = []

    def update_parameters(self, **parameters):
        self.extra = dict(parameters.get("slurm_additional_parameters", self.extra))

    def submit(self, job):
        job_id = str(100 + len(self.submitted))
        self.submitted.append((job_id, f"{job.dataset}/{job.variant}", dict(self.extra)))
        return type("Job", (), {"job_id": job_id})()


def test_on_slurm_a_student_waits_for_its_teachers_job_with_afterok(tmp_path, monkeypatch):
    import ranmt.experiment.launch as launch

    executor = _RecordingExecutor()
    monkeypatch.setattr(launch, "_executor", lambda options, folder: executor)
    messages: list[str] = []
    jobs = submit_grid(distilled_grid(tmp_path), LaunchOptions(launcher="slurm"),
                       log=messages.append)
    assert len(jobs) == 2
    (teacher_id, teacher, teacher_extra), (_, student, student_extra) = executor.submitted
    assert (teacher, student) == ("reverse/Teacher", "reverse-distilled/Student")
    assert teacher_extra == {}
    assert student_extra == {"dependency": f"afterok:{teacher_id}",
                             "kill_on_invalid_dep": "yes"}
    assert messages[-1].endswith(f"(slurm), after job {teacher_id}")


def test_locally_a_failed_teacher_stops_its_student_with_the_reason(tmp_path):
    path = distilled_grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["datasets"][0]["train"] = str(tmp_path / "missing")  # the teacher's job fails
    path.write_text(yaml.safe_dump(config))
    messages: list[str] = []
    jobs = submit_grid(path, LaunchOptions(launcher="local", time_limit_min=5),
                       log=messages.append)
    assert len(jobs) == 1  # the teacher's only
    refusal = messages[-1]
    assert refusal.startswith("reverse-distilled / Student / seed 1: not submitted: its "
                              "teacher reverse / Teacher / seed 1 did not finish: its job ")
    assert "failed (ranmt.data.text.TextError: " in refusal and "missing.src: file does not " \
        "exist" in refusal
    assert not (tmp_path / "exp/runs/reverse-distilled").exists()


@pytest.mark.slow
@pytest.mark.ci
def test_locally_a_student_starts_only_after_its_teacher_has_finished(tmp_path):
    """The teacher trains, the student's job is submitted once the teacher's cell.json is
    written, and both finish (~30 s on two cores)."""
    path = distilled_grid(tmp_path)
    jobs = submit_grid(path, LaunchOptions(launcher="local", time_limit_min=10),
                       log=lambda line: None)
    teacher, student = jobs
    assert student.result() is True
    teacher_cell = tmp_path / "exp/runs/reverse/Teacher/seed1/cell.json"
    assert teacher_cell.stat().st_mtime_ns <= student.paths.submitted_pickle.stat().st_mtime_ns
    assert (tmp_path / "exp/runs/reverse-distilled/Student/seed1/cell.json").is_file()
