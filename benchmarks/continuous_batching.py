"""Step-level batching (``ranmt.inference.continuous``) against the shrinking beam search, in one
process, on the same lines: throughput, step time, and what ``join_wait`` and the capacity
change.

The shrinking search decodes the lines in consecutive batches of ``--capacity`` lines (as
batch-level serving forms them). The step-level decoder starts with ``--capacity`` lines and
adds a new one each time one finishes, so that it always holds ``--capacity`` lines (a
server under a burst). Printed: lines/s of each, their ratio, and the step-level decoder's
mean step time; with several ``--join-wait`` values or capacities, one row each.

    python benchmarks/continuous_batching.py --checkpoint RUN --data DATA \\
        --lines 320 --beam 16 --capacity 16 32 64 --join-wait 1 2 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ranmt.benchmark import synchronize
from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator


def shrinking(translator, lines: list[list[int]], beam: int, capacity: int) -> float:
    """Seconds for the shrinking search over consecutive batches of ``capacity`` lines."""
    device = translator.device
    start = time.perf_counter()
    for first in range(0, len(lines), capacity):
        search(translator.model, pad_sources(lines[first: first + capacity]).to(device),
               beam=beam)
    synchronize(device)
    return time.perf_counter() - start


def step_level(translator, lines: list[list[int]], beam: int, capacity: int,
               join_wait: int) -> tuple[float, int]:
    """(seconds, steps) for the step-level decoder kept at ``capacity`` lines."""
    decoder, _ = translator.continuous_decoder(beam=beam)
    decoder.join_wait = join_wait
    queue = iter(enumerate(lines))
    start = time.perf_counter()
    for _ in range(min(capacity, len(lines))):
        decoder.add(*next(queue))
    while not decoder.idle():
        for _ in decoder.step():
            following = next(queue, None)
            if following is not None:
                decoder.add(*following)
    synchronize(translator.device)
    return time.perf_counter() - start, decoder.steps_taken


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="prepared data directory")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--lines", type=int, default=320)
    p.add_argument("--beam", type=int, default=16)
    p.add_argument("--capacity", type=int, nargs="+", default=[64],
                   help="lines decoding at once (one row each)")
    p.add_argument("--join-wait", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    translator = Translator.load(args.checkpoint, device=args.device)
    sentences = raw_text(args.data, args.split, "src")[: args.lines]
    lines = [ids for ids in translator.encode_sources(sentences) if ids]
    device_name = (torch.cuda.get_device_name(0) if translator.device.type == "cuda"
                   else "cpu")
    shrinking(translator, lines[: 2 * args.capacity[0]], args.beam, args.capacity[0])  # warm
    print(f"{len(lines)} lines of {args.split}, beam {args.beam}, device {device_name}, "
          f"torch {torch.__version__}")
    print("| capacity (lines) | join_wait | shrinking lines/s | step-level lines/s | ratio | "
          "ms per step |")
    print("|---|---|---|---|---|---|")
    rows = []
    for capacity in args.capacity:
        for join_wait in args.join_wait:
            # Side by side: the shrinking search just before each step-level run.
            base = len(lines) / shrinking(translator, lines, args.beam, capacity)
            seconds, steps = step_level(translator, lines, args.beam, capacity, join_wait)
            rate = len(lines) / seconds
            row = {"capacity": capacity, "join_wait": join_wait, "shrinking_lines_per_s": base,
                   "step_level_lines_per_s": rate, "ratio": rate / base,
                   "ms_per_step": 1000 * seconds / steps}
            rows.append(row)
            print(f"| {capacity} | {join_wait} | {base:.1f} | {rate:.1f} | {rate / base:.2f}x | "
                  f"{row['ms_per_step']:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "rows": rows},
                                              indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
