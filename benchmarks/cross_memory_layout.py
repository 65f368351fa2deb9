"""Before/after of caching a cross-attention's memory keys/values contiguous
(``ranmt.attention.base.memory_heads``) instead of as ``split_heads``' transposed view,
which every decoding step's matrix product copied (a whole key and value tensor per layer
and step).

One checkpoint, decoded in one process with either layout, alternating batch by batch over
the same length-sorted batches at a fixed output length (equal work), fp32 and int8, with
or without the lexical shortlist; the median of ``--rounds`` rounds after a warm-up round
(milliseconds per batch), the ratio, and whether both layouts wrote the same hypotheses.

    python benchmarks/cross_memory_layout.py --checkpoint RUN --data DATA --sentences 320 \\
        --batch 32 --beam 1 --threads 1 --fixed-length 20 --precision fp32 int8 --shortlist
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from profile_decode import sorted_batches  # a sibling script

import ranmt.attention.dot_product as dot_product
from ranmt.attention.base import split_heads
from ranmt.inference.decode import search
from ranmt.inference.shortlist import RestrictedOutput
from ranmt.inference.translator import Translator

LAYOUTS = ("transposed view (before)", "contiguous (after)")


def _decode(translator: Translator, src: torch.Tensor, args, layout: str):
    model = translator.model
    if args.shortlist:
        model = RestrictedOutput(model, translator.lexical_shortlist().vocabulary(src))
    if layout == LAYOUTS[1]:
        return search(model, src, beam=args.beam, fixed_length=args.fixed_length)
    with mock.patch.object(dot_product, "memory_heads", split_heads):  # the old layout
        return search(model, src, beam=args.beam, fixed_length=args.fixed_length)


def measure(translator: Translator, batches: list, args) -> tuple[dict, bool]:
    """Median milliseconds per batch of either layout, and whether their outputs agree."""
    totals: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    outputs: dict[str, list] = {layout: [] for layout in LAYOUTS}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            spent = dict.fromkeys(LAYOUTS, 0.0)
            for index, src in enumerate(batches):  # the layouts alternate batch by batch
                for shift in range(len(LAYOUTS)):
                    layout = LAYOUTS[(round_ + index + shift) % len(LAYOUTS)]
                    start = time.perf_counter()
                    hyps = _decode(translator, src, args, layout)
                    spent[layout] += time.perf_counter() - start
                    if not round_:
                        outputs[layout].append([h[0][0] for h in hyps])
            if round_:
                for layout in LAYOUTS:
                    totals[layout].append(1000 * spent[layout] / len(batches))
    same = outputs[LAYOUTS[0]] == outputs[LAYOUTS[1]]
    return {layout: statistics.median(values) for layout, values in totals.items()}, same


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", action="append", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=320)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fixed-length", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--precision", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    p.add_argument("--shortlist", action="store_true",
                   help="restrict the output layer to each batch's lexical shortlist")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = sorted_batches(args.data, args.split, args.sentences, args.batch)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {len(batches)} batches of "
          f"{args.batch}, beam {args.beam}, fixed length {args.fixed_length}, shortlist "
          f"{args.shortlist}; ms per batch (encoder + search), median of {args.rounds} rounds")
    print(f"| system | {LAYOUTS[0]} | {LAYOUTS[1]} | before / after | same output |")
    print("|---|---|---|---|---|")
    for checkpoint in args.checkpoint:
        for precision in args.precision:
            translator = Translator.load(checkpoint, device="cpu", shortlist=args.shortlist,
                                         quantize="int8" if precision == "int8" else "none")
            ms, same = measure(translator, batches, args)
            name = f"{translator.config.model.arch} {precision} ({checkpoint})"
            print(f"| {name} | {ms[LAYOUTS[0]]:.1f} | {ms[LAYOUTS[1]]:.1f} | "
                  f"{ms[LAYOUTS[0]] / ms[LAYOUTS[1]]:.3f}x | {same} |", flush=True)


if __name__ == "__main__":
    main()
