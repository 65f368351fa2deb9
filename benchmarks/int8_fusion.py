"""Before/after of the int8 feed-forward fusion (a ReLU feed-forward's first product and its
ReLU as one fbgemm ``LinearReLU``, ``ranmt.inference.quantize``): one checkpoint quantized
twice, with and without the fusion, decoding the same length-sorted batches, alternating
batch by batch (slow drifts of a shared machine fall on both alike).

Both copies hold the same int8 weights and give the same values (asserted on the
hypotheses); only the pass over the (rows, ffn_dim) activations differs. Printed per copy:
milliseconds per batch for the encoder alone and for the whole greedy/beam search at a fixed
output length, the median of ``--rounds`` rounds (each the whole set of batches) after a
warm-up round, and the ratio.

    python benchmarks/int8_fusion.py --checkpoint RUN --data DATA --sentences 320 \\
        --batch 32 --beam 1 --threads 1 --fixed-length 20 --shortlist
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import numpy as np
import torch

from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import load_split
from ranmt.inference.decode import search
from ranmt.inference.shortlist import RestrictedOutput
from ranmt.inference.translator import Translator
from ranmt.model.layers import FeedForward


def _copies(checkpoint: str, shortlist: bool) -> dict[str, Translator]:
    """The checkpoint as int8 with the fusion (as ``--quantize int8`` makes it) and without."""
    fused = Translator.load(checkpoint, device="cpu", quantize="int8", shortlist=shortlist)
    with mock.patch.object(FeedForward, "fuse_relu_for_quantization", lambda self: False):
        apart = Translator.load(checkpoint, device="cpu", quantize="int8", shortlist=shortlist)
    return {"int8, ReLU apart": apart, "int8, LinearReLU": fused}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=320)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fixed-length", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shortlist", action="store_true",
                   help="restrict the output layer to each batch's lexical shortlist")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    encoded = load_split(args.data, args.split)
    sources = [list(map(int, s)) for s in encoded.src[:args.sentences]]
    lengths = np.array([len(s) for s in sources])
    batches = [pad_sources([sources[i] for i in rows])
               for rows in make_batches(lengths, lengths, 10 ** 9, args.batch)]
    copies = _copies(args.checkpoint, args.shortlist)

    def decode(translator: Translator, src: torch.Tensor):
        model = translator.model
        if args.shortlist:
            model = RestrictedOutput(model, translator.lexical_shortlist().vocabulary(src))
        return search(model, src, beam=args.beam, fixed_length=args.fixed_length)

    jobs = {"encoder": lambda t, src: t.model.encode(src),
            "search": decode}
    names = list(copies)
    totals = {(name, job): [] for name in names for job in jobs}  # seconds per round
    outputs: dict[str, list] = {name: [] for name in names}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            spent = dict.fromkeys(totals, 0.0)
            for index, src in enumerate(batches):  # the copies alternate batch by batch
                for shift in range(len(names)):
                    name = names[(round_ + index + shift) % len(names)]
                    for job, run in jobs.items():
                        start = time.perf_counter()
                        result = run(copies[name], src)
                        spent[name, job] += time.perf_counter() - start
                        if job == "search" and not round_:
                            outputs[name].append(result)
            if round_:
                for key, seconds in spent.items():
                    totals[key].append(seconds / len(batches))
    best = {key: statistics.median(values) for key, values in totals.items()}
    if outputs[names[0]] != outputs[names[1]]:
        raise SystemExit("the two int8 copies wrote different hypotheses")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {len(batches)} batches of "
          f"{args.batch}, beam {args.beam}, fixed length {args.fixed_length}, shortlist "
          f"{args.shortlist}; ms per batch, median of {args.rounds} rounds")
    print("| copy | encoder | encoder + search |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {1000 * best[name, 'encoder']:.1f} | "
              f"{1000 * best[name, 'search']:.1f} |")
    for job in jobs:
        print(f"{job}: apart / fused {best[names[0], job] / best[names[1], job]:.3f}x")


if __name__ == "__main__":
    main()
