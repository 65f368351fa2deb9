"""``ranmt train``, ``ranmt experiment`` and ``ranmt average``: one run, a grid of runs,
and the average of a run's checkpoints."""

from __future__ import annotations

import argparse
import json
import os

from ranmt.cli.common import Command, info
from ranmt.runtime.memory import cap_onednn_primitive_cache  # torch-free: no import cost here


def _args_train(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt train``."""
    p.add_argument("--data", required=True, help="prepared-data directory")
    p.add_argument("--out", required=True, help="run directory (resumed when it exists)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _cmd_train(args) -> None:
    cap_onednn_primitive_cache()  # before torch runs anything (ranmt.runtime.memory)
    from ranmt.config import load_config
    from ranmt.training.train import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, args.data, args.out)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports
        print(json.dumps(summary))


def _args_experiment(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt experiment``."""
    p.add_argument("config", help="experiment YAML (see configs/experiments/)")
    p.add_argument("--out", help="output directory (default: the file's `out`)")
    p.add_argument("--variants", nargs="+", action="extend", metavar="NAME",
                   help="run only these variants' cells (the tables still show every "
                        "finished cell of the grid; a name that starts with '-' takes the "
                        "'=' form, --variants=-Pos-E, and the option repeats)")
    p.add_argument("--seeds", nargs="+", type=int, metavar="N",
                   help="run only these seeds' cells")
    p.add_argument("--datasets", nargs="+", metavar="NAME",
                   help="run only these datasets' cells")
    p.add_argument("--tables-only", action="store_true",
                   help="train nothing: rewrite results.md/json from the finished cells")
    p.add_argument("--reuse", nargs="+", metavar="DIR", default=[],
                   help="output folders of other grids: a finished cell there that is the "
                        "same training (seed, resolved config, identical prepared data) is "
                        "copied instead of trained; a cell whose training only runs longer "
                        "(or validates less often) than one there starts from its checkpoint")
    p.add_argument("--baseline", nargs="+", action="extend", metavar="NAME", default=[],
                   help="also compare every variant against these variants of the grid "
                        "(results.vs-NAME.md|json beside results.md, kept current by every "
                        "later write of the tables; with --tables-only nothing is trained; "
                        "a name that starts with '-': --baseline=-Pos-E, repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (cells, resolved configs, parameter counts, tokens "
                        "per step) and check every cell; train nothing")
    p.add_argument("--status", action="store_true",
                   help="print where every cell stands (done with its scores, training, "
                        "stopped part-way with its best validation and patience, not "
                        "started), read from disk: safe beside running workers")
    p.add_argument("--json", action="store_true",
                   help="with --status: one JSON document (every cell's entry) instead of "
                        "the table")
    p.add_argument("--work", metavar="DIR",
                   help="keep the cells' run folders (checkpoints, trainer state) under "
                        "DIR/<out's folder name>/runs/... instead of beside cell.json, so "
                        "that a stopped cell resumes from another checkout of the grid "
                        "(default: $RANMT_WORK_DIR, else beside cell.json)")
    cluster = p.add_argument_group(
        "cluster", "submit one job per unfinished cell through submitit instead of training "
        "here (pip install 'ranmt[cluster]'); the cells' locks and resume do the rest: "
        "submit again after a failure and only unfinished cells are submitted")
    cluster.add_argument("--launcher", choices=["slurm", "local"],
                         help="slurm, or local (submitit's local executor: processes here)")
    cluster.add_argument("--partition", default="", help="SLURM partition")
    cluster.add_argument("--gpus", type=int, default=0,
                         help="GPUs per cell: 1 (several per cell: not yet)")
    cluster.add_argument("--cpus", type=int, default=0, help="CPUs per cell")
    cluster.add_argument("--time-limit", type=int, default=240, metavar="MINUTES",
                         help="a job's time limit; a cell that needs longer is requeued and "
                              "resumes from its last checkpoint (default 240)")
    cluster.add_argument("--jobs-folder", default="", metavar="DIR",
                         help="submitit's folder: job scripts and logs (default OUT/jobs)")
    cluster.add_argument("--wait", action="store_true",
                         help="wait for the jobs and report each cell's outcome")


def _cmd_experiment(args) -> None:
    cap_onednn_primitive_cache()  # before torch runs anything (ranmt.runtime.memory)
    from ranmt.experiment import plan_experiment, run_experiment

    if args.dry_run:
        plan_experiment(args.config, out=args.out, log=print)
        return
    if args.status:
        from ranmt.experiment.status import grid_status

        entries = grid_status(args.config, out=args.out, work=args.work,
                              log=(lambda _line: None) if args.json else print)
        if args.json:
            print(json.dumps(entries, indent=1))
        return
    if args.json:
        raise ValueError("--json goes with --status")
    if args.launcher:
        _launch(args)
        return
    try:
        run_experiment(args.config, log=info, out=args.out, variants=args.variants,
                       seeds=args.seeds, tables_only=args.tables_only,
                       reuse_from=args.reuse, baselines=args.baseline, work=args.work,
                       datasets=args.datasets)
    except KeyboardInterrupt as err:
        info(f"interrupted: {err}" if str(err) else "interrupted")
        raise


def _launch(args) -> None:
    """``--launcher``: the grid's unfinished cells as submitit jobs."""
    from ranmt.experiment.launch import LaunchOptions, submit_grid

    options = LaunchOptions(launcher=args.launcher, folder=args.jobs_folder,
                            partition=args.partition, gpus=args.gpus, cpus=args.cpus,
                            time_limit_min=args.time_limit)
    jobs = submit_grid(args.config, options, out=args.out, work=args.work, log=info)
    if args.wait:
        finished = sum(bool(job.result()) for job in jobs)
        info(f"{finished} of {len(jobs)} submitted cells finished")


def _args_average(p: argparse.ArgumentParser) -> None:
    """The options of ``ranmt average``."""
    p.add_argument("--checkpoint", required=True, help="run directory")
    p.add_argument("--last", type=int, default=5, help="how many of the newest checkpoints")
    p.add_argument("--out", required=True, help="output checkpoint directory")


def _cmd_average(args) -> None:
    from ranmt.checkpoint import average_checkpoints

    path = average_checkpoints(args.checkpoint, args.last, args.out)
    info(f"wrote the average of the last {args.last} checkpoints to {path}")


TRAIN = Command("train", "train a model", _args_train, _cmd_train)
EXPERIMENT = Command("experiment", "run a grid of datasets x variants x seeds",
                     _args_experiment, _cmd_experiment)
AVERAGE = Command("average", "average the weights of a run's last K checkpoints",
                  _args_average, _cmd_average)
