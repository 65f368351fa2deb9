"""Padding and shape counts of shape-bucketed training batches over one epoch of a corpus.

For each bucket set (``--buckets``, comma-separated lengths; several sets allowed) and each
``--max-tokens``: the number of batches and distinct batch shapes of one training epoch
(the plan the trainer makes: noisy length order, seed 1, epoch 0), and the share of the
batch slots (sentences x width, both sides) that is padding, with and without buckets.

    python benchmarks/shape_buckets.py --data docs/results/multi30k_converged/data/multi30k-en-de \\
        --max-tokens 4096 16384 25000 --buckets 16,24,32,48,64,96,128 8,16,32,64,128
"""

from __future__ import annotations

import argparse

import numpy as np

from ranmt.data.batching import ShapeBuckets, make_batches, padding_share
from ranmt.data.corpus import load_split


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a prepared-data folder (ranmt prepare)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--buckets", nargs="+", default=["16,24,32,48,64,96,128"])
    p.add_argument("--max-positions", type=int, default=256)
    args = p.parse_args(argv)
    split = load_split(args.data, "train")
    src_lens = np.array([len(s) for s in split.src])
    tgt_lens = np.array([len(t) for t in split.tgt])
    print(f"{args.data}: {len(split)} training pairs")
    for max_tokens in args.max_tokens:
        plain = make_batches(src_lens, tgt_lens, max_tokens, seed=1, noise=0.5)
        for spec in args.buckets:
            lengths = [int(x) for x in spec.split(",")]
            buckets = ShapeBuckets(lengths, max_tokens, max_positions=args.max_positions)
            batches = make_batches(src_lens, tgt_lens, max_tokens, seed=1, noise=0.5,
                                   buckets=buckets)
            shapes = {buckets.batch_shape(int(src_lens[b].max()) + 1, int(tgt_lens[b].max()) + 1)
                      for b in batches}
            padded = padding_share(batches, src_lens, tgt_lens, buckets)
            bare = padding_share(plain, src_lens, tgt_lens)
            plain_shapes = {(len(b), int(max(src_lens[b].max(), tgt_lens[b].max())) + 1)
                            for b in plain}
            print(f"max_tokens {max_tokens}, buckets {spec}: {len(batches)} batches in "
                  f"{len(shapes)} shapes, padding {padded:.1%} of the slots; without buckets "
                  f"{len(plain)} batches in {len(plain_shapes)} shapes, padding {bare:.1%}")


if __name__ == "__main__":
    main()
