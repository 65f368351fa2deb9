"""``decode.compile_step`` against the eager searches, side by side: the ``student`` preset
with random weights, greedy, 10 batches of 32 sentences of 16 source tokens, a fixed
output length of 20, one thread, best of 3 alternating rounds. Prints the first compiled
batch's seconds (the compilation) and each system's target tokens/s with its ratio to the
eager shrinking search (the CPU default).

    python benchmarks/compile_step_option.py [--int8]
"""

from __future__ import annotations

import argparse
import time

import torch

from ranmt.config import load_config
from ranmt.inference.decode import search
from ranmt.inference.quantize import quantize_model
from ranmt.model import EOS_ID
from ranmt.model.seq2seq import build_model
from ranmt.runtime.precision import cpu_description

SYSTEMS = {"eager shrinking": {}, "eager static": {"sync_free": True},
           "compiled static": {"compile_step": True}}
BATCHES, BATCH, SOURCE, LENGTH = 10, 32, 16, 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int8", action="store_true", help="int8 dynamic quantization")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config("configs/multi30k_small.yaml", [
        "model.preset=student", "model.arch=transf", "model.src_vocab_size=8000",
        "model.tgt_vocab_size=8000"])
    model = build_model(cfg.model).eval()
    if args.int8:
        model = quantize_model(model, "int8")
    sources = []
    for _ in range(BATCHES):
        src = torch.randint(4, 8000, (BATCH, SOURCE))
        src[:, -1] = EOS_ID
        sources.append(src)

    def run(options: dict) -> float:
        start = time.perf_counter()
        for src in sources:
            search(model, src, beam=1, fixed_length=LENGTH, **options)
        return time.perf_counter() - start

    start = time.perf_counter()
    search(model, sources[0], beam=1, fixed_length=LENGTH, compile_step=True)
    print(f"{cpu_description()}, torch {torch.__version__}, "
          f"{'int8' if args.int8 else 'fp32'}: first compiled batch "
          f"{time.perf_counter() - start:.1f} s")
    best = dict.fromkeys(SYSTEMS, float("inf"))
    for round_index in range(3):
        order = list(SYSTEMS) if round_index % 2 == 0 else list(reversed(SYSTEMS))
        for name in order:
            best[name] = min(best[name], run(SYSTEMS[name]))
    tokens = BATCHES * BATCH * (LENGTH + 1)
    for name, seconds in best.items():
        print(f"  {name:16s} {tokens / seconds:8,.0f} tok/s  "
              f"{best['eager shrinking'] / seconds:.2f}x eager shrinking")


if __name__ == "__main__":
    main()
