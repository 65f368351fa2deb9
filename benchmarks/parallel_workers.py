"""Training throughput of one worker on every core against one single-threaded worker per
core (a grid's cells trained side by side, ``ranmt experiment`` started once per core).

The same training (``ranmt train --config CONFIG`` with the given overrides, a fresh run
folder each time, ``--steps`` optimizer steps) runs first alone with every core's threads,
then as ``--workers`` copies at once, each pinned to its own core (``taskset``) with one
thread (``OMP_NUM_THREADS=1``). Printed: each run's target tokens/s (the trainer's
summary, ``train_tokens_per_s``), the workers' sum, and the ratio of the sum to the lone
run: above 1, a grid finishes sooner with one worker per core.

    python benchmarks/parallel_workers.py --data DATA --config configs/multi30k_small.yaml \\
        --steps 60 model.preset=student model.arch=ran-d train.precision=fp32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train_command(args, run: Path) -> list[str]:
    overrides = ["train.max_steps=" + str(args.steps), "train.max_time=0",
                 f"train.validate_every={args.steps}", "train.validate_bleu=false",
                 "train.progress=false", "train.tensorboard=false",
                 *args.overrides]
    return [sys.executable, "-m", "ranmt", "train", "--config", args.config, "--data",
            args.data, "--out", str(run), *overrides]


def run_workers(args, root: Path, label: str, workers: int, threads: int | None) -> list[float]:
    """Start ``workers`` trainings at once (pinned to cores 0.. when ``threads`` is set);
    their target tokens/s."""
    processes = []
    for index in range(workers):
        run = root / f"{label}{index}"
        shutil.rmtree(run, ignore_errors=True)
        env = dict(os.environ)
        command = train_command(args, run)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
            command = ["taskset", "-c", str(index), *command]
        log = (root / f"{label}{index}.log").open("w")
        processes.append((subprocess.Popen(command, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), run, log))
    speeds = []
    for process, run, log in processes:
        if process.wait() != 0:
            raise SystemExit(f"training in {run} failed: see {log.name}")
        log.close()
        summary = json.loads((run / "summary.json").read_text())
        speeds.append(float(summary["train_tokens_per_s"]))
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepared-data directory")
    parser.add_argument("--config", default="configs/multi30k_small.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="single-threaded workers, one per core (default: every core)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of (lone run, workers side by side), the order "
                             "alternating")
    parser.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ranmt-workers-"))
    print(f"{os.cpu_count()} cores; {args.steps} steps of {args.config} {' '.join(args.overrides)}")
    for round_ in range(1, args.rounds + 1):
        start = time.monotonic()
        if round_ % 2:  # odd rounds: the lone run first; even rounds: the workers first
            (lone,) = run_workers(args, root, "lone", 1, None)
            side = run_workers(args, root, "pinned", args.workers, 1)
        else:
            side = run_workers(args, root, "pinned", args.workers, 1)
            (lone,) = run_workers(args, root, "lone", 1, None)
        print(f"round {round_} ({time.monotonic() - start:.0f} s): one worker, all threads: "
              f"{lone:,.0f} tgt tok/s; {args.workers} pinned single-threaded workers: "
              + " + ".join(f"{s:,.0f}" for s in side)
              + f" = {sum(side):,.0f} tgt tok/s; ratio {sum(side) / lone:.2f}x", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
