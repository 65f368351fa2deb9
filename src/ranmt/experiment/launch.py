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

One GPU per cell for now: a cell on several GPUs would run its training under torchrun
inside the job, but the grid's per-cell lock is taken by the process that trains, and every
rank would try to take it (only one can); until the grid is rank-aware, ``gpus`` > 1 is
refused with that reason.
"""

from __future__ import annotations

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


def submit_grid(experiment_file: str | Path, options: LaunchOptions,
                out: str | Path | None = None, work: str | Path | None = None,
                log=print) -> list:
    """Submit one job per unfinished cell of the grid; return the submitit jobs."""
    from ranmt.experiment.loading import load_placed
    from ranmt.runtime.signals import children_honour_stop_signals

    experiment = load_placed(experiment_file, out, work)
    todo = [cell for cell in experiment.cells() if not cell.finished]
    log(f"{len(todo)} of {len(experiment.cells())} cells unfinished")
    if not todo:
        return []
    folder = Path(options.folder) if options.folder else experiment.out / "jobs"
    executor = _executor(options, folder)
    # the local launcher's job controllers are children of this process: a cancel (SIGINT)
    # must reach them even when this process was started with SIGINT ignored
    with children_honour_stop_signals():
        jobs = [executor.submit(CellJob(str(Path(experiment_file).resolve()),
                                        str(experiment.out.resolve()),
                                        str(experiment.work) if experiment.work else None,
                                        cell.dataset.name, cell.variant.name, cell.seed))
                for cell in todo]
    for cell, job in zip(todo, jobs):
        log(f"{cell.label}: job {job.job_id} ({options.launcher})")
    return jobs
