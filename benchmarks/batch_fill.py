"""How much of a training batch is real tokens: the batch plans' fill, side by side.

Fill = real tokens (EOS included, both sides) / slots (sentences x padded length, both
sides), over one epoch's plan (:func:`ranmt.data.batching.make_batches`), for the plain plan
(sorted by target length: ``data.pool_batches=0``), pools of 2 / 4 / 8 batches
(``data.pool_batches``), shape buckets (``data.shape_buckets``, both sides padded to the
bucket) and 8 / 16 / 24 (source, target) shapes chosen from the corpus's lengths
(``data.auto_shape_buckets``: each side padded to its own length), at several
``max_tokens``; also the mean tokens a batch holds against ``max_tokens`` (``budget``: how
full the steps are).

Corpora: Multi30k's training lengths (subwords of a prepared data directory, ``--data``; else
whitespace words of ``$RANMT_DATA_DIR/multi30k/train.*.gz``, said so in the output), and a
synthetic WMT-like length distribution (no WMT corpus can be fetched here): source lengths
log-normal around 25 subwords (sigma 0.6, 1-250, news-text-like), target = source x a
log-normal length ratio (sigma 0.15) + Gaussian noise; ``--pairs`` of them.

    python benchmarks/batch_fill.py --data docs/results/multi30k_converged/data/multi30k-en-de
"""

from __future__ import annotations

import argparse
import gzip
import os
from pathlib import Path

import numpy as np

from ranmt.data.batching import ShapeBuckets, make_batches, padding_share
from ranmt.data.shapes import choose_shapes, wmt_like_lengths

BUCKETS = (16, 24, 32, 48, 64, 96, 128, 256)


def multi30k_lengths(data: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """Multi30k training lengths: subwords of a prepared directory, else whitespace words."""
    if data:
        from ranmt.data.corpus import load_split

        split = load_split(Path(data), "train")
        return (np.array([len(s) for s in split.src]), np.array([len(t) for t in split.tgt]),
                f"Multi30k subwords ({data})")
    folder = Path(os.environ.get("RANMT_DATA_DIR", "../shared/data")) / "multi30k"

    def words(name: str) -> np.ndarray:
        with gzip.open(folder / name, "rt", encoding="utf-8") as lines:
            return np.array([len(line.split()) for line in lines])

    return words("train.en.gz"), words("train.de.gz"), "Multi30k whitespace words (no --data)"


def fill_row(src: np.ndarray, tgt: np.ndarray, max_tokens: int, plan: str) -> str:
    buckets = None
    if plan == "buckets":
        buckets = ShapeBuckets(BUCKETS, max_tokens)
    elif plan.startswith("chosen"):
        buckets = ShapeBuckets(choose_shapes(src + 1, tgt + 1, int(plan.split()[1]),
                                             max_tokens), max_tokens)
        plan = f"{plan} ({len(buckets)} shapes)"
    pool = int(plan.removeprefix("pool ")) if plan.startswith("pool") else 0
    batches = make_batches(src, tgt, max_tokens, seed=1, noise=0.5, buckets=buckets, pool=pool)
    fill = 1 - padding_share(batches, src, tgt, buckets)
    tokens = np.array([int(np.maximum(src[b] + 1, tgt[b] + 1).max()) * len(b) for b in batches])
    return (f"| {max_tokens:,} | {plan} | {100 * fill:.1f}% | {len(batches):,} | "
            f"{100 * tokens.mean() / max_tokens:.0f}% |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a prepared Multi30k directory (subword lengths)")
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[4096, 25000, 50000, 100000])
    args = p.parse_args()
    corpora = [multi30k_lengths(args.data),
               (*wmt_like_lengths(args.pairs), f"synthetic WMT-like, {args.pairs:,} pairs")]
    for src, tgt, name in corpora:
        print(f"\n{name}: mean length {src.mean():.1f} / {tgt.mean():.1f}")
        print("| max_tokens | plan | fill | batches | budget |\n|---|---|---|---|---|")
        for max_tokens in args.max_tokens:
            for plan in ("plain", "pool 2", "pool 4", "pool 8", "buckets", "chosen 8",
                         "chosen 16", "chosen 24"):
                print(fill_row(src, tgt, max_tokens, plan))


if __name__ == "__main__":
    main()
