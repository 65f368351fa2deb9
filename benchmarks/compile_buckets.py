"""One training epoch with shape buckets, compiled and eager: recompilations and step time.

``train.compile=true`` recompiles for every new batch shape; with ``data.shape_buckets`` the
trainer compiles with ``dynamic=False`` once per shape. This script trains the same model
(``--config``, fp32) for ``--epochs`` epochs of a prepared corpus twice — eager, then
compiled — with the same buckets, and prints the graphs Dynamo compiled and the frames it
(re)compiled (``torch._dynamo.utils.counters``) against the shapes of the epoch's plan, and
the trainer's own tokens/s of both (the compiled run's includes its compilations: its
wall time is printed apart, and the tokens/s of the last three 10-step windows, when most
shapes have been compiled).

    python benchmarks/compile_buckets.py --data docs/results/multi30k_converged/data/multi30k-en-de
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo

from ranmt.config import load_config
from ranmt.training.train import train


def run(config: str, data: str, buckets: str, compiled: bool, epochs: int, steps: int,
        out: Path) -> dict:
    overrides = {"train.precision": "fp32", "train.max_epochs": str(epochs),
                 "train.max_steps": str(steps), "train.max_time": "0",
                 "train.validate_every": "1000000", "train.validate_bleu": "false",
                 "train.progress": "false", "train.tensorboard": "false",
                 "train.log_every": "10",
                 "data.shape_buckets": f"[{buckets}]",
                 "train.compile": "true" if compiled else "false"}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    summary = train(load_config(config, overrides), data, out)
    stats = torch._dynamo.utils.counters["stats"]
    log = (out / "train.log").read_text().splitlines()
    shapes = next((line for line in log if "data.shape_buckets" in line), "")
    windows = [float(line.split(" | ")[3].split()[0].replace(",", ""))
               for line in log if line.startswith("step ")]  # tok/s of each 10-step window
    return {"last_windows_tokens_per_s": windows[-3:], "compiled": compiled,
            "steps": summary["steps"],
            "tokens_per_s": summary["train_tokens_per_s"],
            "wall_s": time.perf_counter() - start,
            "unique_graphs": stats.get("unique_graphs", 0),
            "calls_captured": stats.get("calls_captured", 0),
            "frames_compiled": torch._dynamo.utils.counters["frames"].get("ok", 0),
            "plan": shapes}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--config", default="configs/multi30k_small.yaml")
    p.add_argument("--buckets", default="12,16,20,24,28,32,40,48,64,128")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop earlier (0: the whole epochs)")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.config}, "
          f"buckets {args.buckets}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for compiled in (False, True):
            rows.append(run(args.config, args.data, args.buckets, compiled, args.epochs,
                            args.steps, Path(tmp) / ("compiled" if compiled else "eager")))
            print(json.dumps(rows[-1]))
    eager, compiled = rows
    print(f"{compiled['plan']}")
    print(f"compiled: {compiled['unique_graphs']} graphs, {compiled['frames_compiled']} "
          f"frames compiled over {compiled['steps']} steps; tokens/s compiled / eager = "
          f"{compiled['tokens_per_s'] / eager['tokens_per_s']:.2f} (compilation included); "
          f"wall {compiled['wall_s']:.0f} s vs {eager['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
