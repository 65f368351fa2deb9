"""A grid's cells as cluster jobs, through submitit (``ranmt experiment GRID --launcher
slurm``): one job per unfinished cell, on SLURM or as local processes (``local``).

Nothing here schedules: submitit submits, SLURM (or the local executor) runs, and the grid's
own machinery does the rest. A job is ``ranmt experiment GRID`` restricted to its cell
(:func:`ranmt.experiment.run_experiment` with the cell's dataset, variant and seed), so the
per-cell lock keeps two jobs off one cell, a cell whose job was preempted or timed out
resumes from its last step checkpoint when it runs again, and a finished cell (its
cell.json) is never trained again: submitting the grid a second time submits only what is
not finished. On a preemption or time-out SLURM signals the job first; submitit then calls
:meth:`CellJob.checkpoint`, which requeues the same job (submitit's ``Checkpointable``).

A cell that depends on another — a student on the translations of a teacher cell
(``distill:`` in the grid) — is submitted after it: on SLURM with an ``afterok``
dependency on the teacher's job (``--kill-on-invalid-dep=yes``: a failed teacher cancels
its students instead of leaving them pending forever); with the local executor, which
has no dependencies, the submitting process waits for the teacher's job and submits the
student only once the teacher cell has finished, else names the teacher and why it did
not finish and leaves the student (and its own dependents) unsubmitted.

One GPU per cell for now: a cell on several GPUs would run its training under torchrun
inside the job, but the grid's per-cell lock is taken by the process that trains, and every
rank would try to take it (only one can); until the grid is rank-aware, ``gpus`` > 1 is
refused with that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ranmt.config import ConfigError

LAUNCHERS = ("slurm", "local")


@dataclass
class LaunchOptions:
    """Where and how the jobs run."""

    launcher: str = "slurm"
    """slurm | local (submitit's local executor: real processes on this machine)."""
    folder: str = ""
    """submitit's folder (job scripts, pickles, logs); default ``<out>/jobs``."""
    partition: str = ""
    """SLURM partition (default: the cluster's)."""
    gpus: int = 0
    """GPUs per cell: 0 or 1 (several: not yet, see the module docstring)."""
    cpus: int = 0
    """CPUs per cell (0: the cluster's default)."""
    time_limit_min: int = 240
    """A job's time limit in minutes (a cell that needs longer resumes in its requeued job)."""


@dataclass
class CellJob:
    """One cell of a grid as a submitit job: callable, picklable, requeued on preemption."""

    experiment_file: str
    out: str
    work: str | None
    dataset: str
    variant: str
    seed: int

    def __call__(self) -> bool:
        """Train (or resume) the cell, decode and score it; True when it is finished."""
        from ranmt.experiment import run_experiment
        from ranmt.experiment.loading import load_placed
        from ranmt.runtime.signals import honour_stop_signals

        honour_stop_signals()  # a cancel (SIGINT) stops the cell even under a nohup'd parent
        selection = {"datasets": [self.dataset], "variants": [self.variant],
                     "seeds": [self.seed]}
        run_experiment(self.experiment_file, out=self.out, work=self.work, **selection)
        (cell,) = load_placed(self.experiment_file, self.out, self.work).select(**selection)
        return cell.finished

    def checkpoint(self, *args, **kwargs):
        """submitit's hook on preemption or time-out: requeue this very job (the cell
        resumes from its last step checkpoint)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def _executor(options: LaunchOptions, folder: Path):
    try:
        import submitit
    except ImportError:
        raise ConfigError("--launcher needs submitit: pip install 'ranmt[cluster]' "
                          "(or pip install submitit)") from None
    if options.launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher must be one of {LAUNCHERS}, not '{options.launcher}'")
    if options.gpus > 1:
        raise ConfigError("--gpus: one GPU per cell for now (a cell's lock is taken by the "
                          "process that trains, and under torchrun every rank would take it); "
                          "run several cells at once instead")
    executor = submitit.AutoExecutor(folder=str(folder), cluster=options.launcher)
    parameters: dict = {"timeout_min": options.time_limit_min, "nodes": 1,
                        "tasks_per_node": 1, "name": "ranmt-cell"}
    if options.gpus:
        parameters["gpus_per_node"] = options.gpus
    if options.cpus:
        parameters["cpus_per_task"] = options.cpus
    if options.partition:
        parameters["slurm_partition"] = options.partition
    executor.update_parameters(**parameters)
    return executor


def _key(cell) -> tuple[str, str, int]:
    return cell.dataset.name, cell.variant.name, cell.seed


def unfinished_teachers(todo: list) -> dict[tuple[str, str, int], tuple[str, str, int]]:
    """(dataset, variant, seed) of each unfinished cell that distills from an unfinished
    teacher cell -> the teacher's: the cells that must wait. A teacher that has finished
    is no dependency (its translations can be made now)."""
    unfinished = {_key(cell) for cell in todo}
    waits = {}
    for cell in todo:
        if cell.dataset.distill is not None:
            teacher = cell.dataset.teacher_cell()
            if teacher in unfinished:
                waits[_key(cell)] = teacher
    return waits


def _label(key: tuple[str, str, int]) -> str:
    """A cell's (dataset, variant, seed) as :attr:`ranmt.experiment.spec.Cell.label` says it."""
    return f"{key[0]} / {key[1]} / seed {key[2]}"


def _teacher_failure(job) -> str | None:
    """Why a teacher's local job did not finish its cell, or None when it did."""
    try:
        finished = job.result()
    except Exception as error:  # submitit's FailedJobError carries the job's traceback:
        raised = [line.strip() for line in str(error).splitlines()  # its exception's line
                  if re.match(r"\s*[\w.]+(Error|Exception|Interrupt|Exit)\b.*:", line)]
        why = raised[-1] if raised else str(error).strip().splitlines()[0]
        return f"its job {job.job_id} failed ({why}; log {job.paths.stderr})"
    return None if finished else f"its job {job.job_id} ended with the cell unfinished"


def submit_grid(experiment_file: str | Path, options: LaunchOptions,
                out: str | Path | None = None, work: str | Path | None = None,
                log=print) -> list:
    """Submit one job per unfinished cell of the grid, each after the teacher cell it
    distills from (see the module docstring); return the submitted jobs in grid order."""
    from ranmt.experiment.loading import load_placed
    from ranmt.runtime.signals import children_honour_stop_signals

    experiment = load_placed(experiment_file, out, work)
    todo = [cell for cell in experiment.cells() if not cell.finished]
    log(f"{len(todo)} of {len(experiment.cells())} cells unfinished")
    if not todo:
        return []
    folder = Path(options.folder) if options.folder else experiment.out / "jobs"
    executor = _executor(options, folder)
    waits = unfinished_teachers(todo)
    jobs: dict[tuple[str, str, int], object] = {}
    refused: dict[tuple[str, str, int], str] = {}  # cell -> why it was not submitted
    # the local launcher's job controllers are children of this process: a cancel (SIGINT)
    # must reach them even when this process was started with SIGINT ignored
    with children_honour_stop_signals():
        for cell in todo:  # a teacher's dataset comes earlier in the grid: it is submitted
            teacher = waits.get(_key(cell))  # before its students
            after = None if teacher is None else jobs.get(teacher)
            if teacher is not None and after is None:
                refused[_key(cell)] = (f"its teacher {_label(teacher)} was not submitted "
                                       f"({refused.get(teacher, 'not in the grid')})")
            elif after is not None and options.launcher != "slurm":
                failure = _teacher_failure(after)
                if failure is not None:
                    refused[_key(cell)] = f"its teacher {_label(teacher)} did not finish: " \
                                          f"{failure}"
            if _key(cell) in refused:
                log(f"{cell.label}: not submitted: {refused[_key(cell)]}")
                continue
            job = _submit(executor, cell, experiment_file, experiment,
                          after if options.launcher == "slurm" else None)
            jobs[_key(cell)] = job
            log(f"{cell.label}: job {job.job_id} ({options.launcher})"
                + (f", after job {after.job_id}" if after is not None else ""))
    return list(jobs.values())


def _submit(executor, cell, experiment_file, experiment, after=None):
    """Submit ``cell``'s job; on SLURM ``after`` a teacher's job (``afterok``)."""
    job = CellJob(str(Path(experiment_file).resolve()), str(experiment.out.resolve()),
                  str(experiment.work) if experiment.work else None,
                  cell.dataset.name, cell.variant.name, cell.seed)
    if after is None:
        return executor.submit(job)
    executor.update_parameters(slurm_additional_parameters={
        "dependency": f"afterok:{after.job_id}", "kill_on_invalid_dep": "yes"})
    try:
        return executor.submit(job)
    finally:
        executor.update_parameters(slurm_additional_parameters={})
