"""One-off experiment (issue 99, 2026-12-05, night): the compiled search at Bergamot's
setting (int8 TransF student + shortlist, greedy, batch 32, one thread, fixed length 20,
320 test_2016 sentences) with and without Dynamo's guard evaluation
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: correct here, every shape is
compiled in the first pass and the outputs are compared), rounds alternating in one
process. Output: skip_guards_b32.txt.

    python docs/performance/engine/skip_guards_b32.py RUN DATA
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from perf_profile import bergamot_args  # noqa: E402  (this folder's)


def main() -> None:
    run, data = sys.argv[1:3]
    torch.set_num_threads(1)
    args = bergamot_args(run, data)
    builders, transf = peers._decode_systems(args, Path("/tmp/skip_guards_b32"))
    decode = builders["ranmt TransF int8 compiled + shortlist"]()
    _, batches = peers._source_batches(args, transf)
    seconds: dict[str, list[float]] = {"default": [], "skip_guards": []}
    with torch.inference_mode():
        reference = [decode(batch) for batch in batches]  # compiles every shape
        for _ in range(6):
            for name in seconds:
                stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True)
                          if name == "skip_guards" else contextlib.nullcontext())
                with stance:
                    start = time.perf_counter()
                    outputs = [decode(batch) for batch in batches]
                    seconds[name].append(time.perf_counter() - start)
                assert outputs == reference, name
    for name, values in seconds.items():
        print(f"{name}: median {1000 * statistics.median(values) / 320:.3f} ms/sentence "
              f"(rounds: {', '.join(f'{v:.3f}' for v in values)} s)")


if __name__ == "__main__":
    main()
