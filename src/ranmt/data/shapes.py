"""Static batch shapes for compiled and graphed training steps (``data.shape_buckets``,
``data.auto_shape_buckets``).

A compiled step recompiles for every new batch shape and a CUDA graph replays one shape
only, so training batches are padded to a few shapes ``(sentences, source length, target
length)``. A shape ``(S, T)`` holds the examples whose source (EOS included) fits in ``S``
and target (BOS/EOS shift included) in ``T``, ``max_tokens // max(S, T)`` of them a batch
(the trainer's token budget counts sentences x longest side). An example goes to the
cheapest shape that holds it: fewest slots ``S + T`` a sentence.

Square buckets (``data.shape_buckets: [16, 24, 32, ...]``) pad both sides to one length;
a batch of short sources and long targets then pads its source side to the target's
length. :func:`choose_shapes` instead picks ``(S, T)`` pairs from the training corpus's
lengths (``data.auto_shape_buckets: K``): greedily, the shape that removes most padding
slots from the epoch, counting the half batch of padding a shape's last batch leaves on
average, until ``K`` shapes or no shape pays for itself; then each shape is tightened to
the longest example it holds. On WMT-like lengths (``benchmarks/batch_fill.py``, 25,000
tokens) 16 chosen shapes fill ~85% of the slots where 8 square buckets filled ~78%.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ShapeBuckets:
    """The shapes training batches are padded to.

    ``shapes``: lengths ``L`` (square: both sides padded to ``L``) or ``(S, T)`` pairs.
    With ``max_positions`` (the model's limit; truncation keeps every batch within it) the
    sides are capped there and a ``(max_positions, max_positions)`` shape holds what no other
    shape does; without it an example no shape holds is padded to its own widths.
    """

    def __init__(self, shapes: Sequence[int | Sequence[int]], max_tokens: int,
                 max_sentences: int = 0, max_positions: int | None = None):
        pairs = [(int(shape), int(shape)) if np.ndim(shape) == 0
                 else (int(shape[0]), int(shape[1])) for shape in shapes]
        if not pairs or min(min(pair) for pair in pairs) < 1:
            raise ValueError(f"shape buckets need positive lengths, not {list(shapes)}")
        if max_positions is not None:
            pairs = [(min(s, max_positions), min(t, max_positions)) for s, t in pairs]
            pairs.append((max_positions, max_positions))
        # cheapest first (slots a sentence, then the source side): the first shape that
        # holds an example is its shape
        pairs = sorted(set(pairs), key=lambda pair: (pair[0] + pair[1], pair[0]))
        self.shapes = np.array(pairs, dtype=np.int64)  # (K, 2): source, target length
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        self.max_positions = max_positions

    def __len__(self) -> int:
        return len(self.shapes)

    def rows(self, src_length: int, tgt_length: int) -> int:
        """Sentences a batch of these lengths holds: ``max_tokens // max(S, T)``, at least
        one, at most ``max_sentences`` when set."""
        rows = max(1, self.max_tokens // max(src_length, tgt_length))
        return min(rows, self.max_sentences) if self.max_sentences else rows

    def assign(self, src_widths: np.ndarray, tgt_widths: np.ndarray) -> np.ndarray:
        """(N,) the shape of each example (widths EOS included; sides beyond
        ``max_positions`` count as cut to it): the cheapest that holds both sides, -1 when
        none does (possible only without ``max_positions``). In chunks of a million
        examples, so a WMT-size corpus never holds an (N, K) table."""
        src_widths, tgt_widths = self.capped(src_widths), self.capped(tgt_widths)
        out = np.empty(len(src_widths), dtype=np.int64)
        for start in range(0, len(src_widths), 1 << 20):
            src = src_widths[start: start + (1 << 20), None]
            tgt = tgt_widths[start: start + (1 << 20), None]
            fits = (src <= self.shapes[None, :, 0]) & (tgt <= self.shapes[None, :, 1])
            out[start: start + len(src)] = np.where(fits.any(1), fits.argmax(1), -1)
        return out

    def batch_shape(self, src_width: int, tgt_width: int) -> tuple[int, int, int]:
        """(sentences, source length, target length) of a batch whose widest source and
        target are these (EOS included)."""
        index = int(self.assign(np.array([src_width]), np.array([tgt_width]))[0])
        if index < 0:
            src_length, tgt_length = int(src_width), int(tgt_width)
        else:
            src_length, tgt_length = (int(x) for x in self.shapes[index])
        return self.rows(src_length, tgt_length), src_length, tgt_length

    def describe(self) -> str:
        """``12x40/36, ...``: each shape as sentences x source/target length."""
        return ", ".join(f"{self.rows(s, t)}x{s}/{t}" for s, t in self.shapes.tolist())

    def capped(self, widths: np.ndarray) -> np.ndarray:
        """Widths as int64, cut to ``max_positions`` (as truncation cuts the sentences)."""
        widths = np.asarray(widths, dtype=np.int64)
        return widths if self.max_positions is None else np.minimum(widths, self.max_positions)


def choose_shapes(src_widths: np.ndarray, tgt_widths: np.ndarray, count: int,
                  max_tokens: int, max_sentences: int = 0, max_positions: int | None = None,
                  candidates: int = 96) -> list[tuple[int, int]]:
    """At most ``count`` (source length, target length) shapes chosen from a corpus's
    widths (EOS included), cheapest first; the first shape chosen holds every example.

    Candidate sides are ``candidates`` quantiles of each side's widths; the corpus is counted
    as a 2-D histogram of distinct (source, target) widths, so the cost of a choice does not
    grow with the corpus (a 4.5M-pair corpus has ~10^4 distinct pairs). Greedy: each round
    adds the candidate that lowers ``sum over examples of (S + T)`` (slots in full batches)
    plus ``rows x (S + T) / 2`` (the padding its last batch leaves, on average) the most; it
    stops early when no candidate lowers the total (a small corpus gets fewer shapes)."""
    if count < 1:
        raise ValueError(f"choose at least one shape, not {count}")
    capped = ShapeBuckets([1], max_tokens, max_sentences, max_positions)
    src, tgt = capped.capped(src_widths), capped.capped(tgt_widths)
    base = int(tgt.max()) + 1
    cells, weights = np.unique(src * base + tgt, return_counts=True)
    cell_src, cell_tgt = cells // base, cells % base  # (C,) distinct pairs, (C,) counts
    levels = np.linspace(0, 1, candidates + 1)[1:]
    side_s = np.unique(np.quantile(src, levels, method="higher").astype(np.int64))
    side_t = np.unique(np.quantile(tgt, levels, method="higher").astype(np.int64))
    cand_s, cand_t = (grid.ravel() for grid in np.meshgrid(side_s, side_t, indexing="ij"))
    slots = (cand_s + cand_t).astype(np.float64)  # (Q,) slots a sentence of each candidate
    last_batch = np.array([capped.rows(s, t) for s, t in zip(cand_s, cand_t)]) * slots / 2
    weights = weights.astype(np.float64)
    best_cost = np.full(len(cells), np.inf)  # (C,) slots of each cell under the chosen shapes
    chosen: list[int] = []
    while len(chosen) < count:
        totals = np.empty(len(slots))
        for start in range(0, len(slots), 256):  # (256, C) at a time
            part = slice(start, start + 256)
            holds = ((cell_src[None, :] <= cand_s[part, None])
                     & (cell_tgt[None, :] <= cand_t[part, None]))
            cost = np.where(holds, np.minimum(best_cost[None, :], slots[part, None]),
                            best_cost[None, :])
            totals[part] = cost @ weights + last_batch[part]
        totals[chosen] = np.inf
        pick = int(np.argmin(totals))
        current = best_cost @ weights if chosen else np.inf
        if not totals[pick] < current:
            break
        chosen.append(pick)
        holds = (cell_src <= cand_s[pick]) & (cell_tgt <= cand_t[pick])
        best_cost = np.where(holds, np.minimum(best_cost, slots[pick]), best_cost)
    shapes = ShapeBuckets([(cand_s[i], cand_t[i]) for i in chosen], max_tokens, max_sentences)
    return _tightened(shapes, cell_src, cell_tgt, max_tokens, max_sentences)


def _tightened(buckets: ShapeBuckets, cell_src: np.ndarray, cell_tgt: np.ndarray,
               max_tokens: int, max_sentences: int) -> list[tuple[int, int]]:
    """Each shape cut to the longest source and target it holds (repeated while that moves
    an example to a cheaper shape; a few rounds), shapes holding nothing dropped."""
    for _ in range(8):
        where = buckets.assign(cell_src, cell_tgt)  # (C,) every cell is held
        tight = ShapeBuckets([(int(cell_src[where == k].max()), int(cell_tgt[where == k].max()))
                              for k in range(len(buckets)) if (where == k).any()],
                             max_tokens, max_sentences)
        if np.array_equal(tight.shapes, buckets.shapes):
            break
        buckets = tight
    return [(int(s), int(t)) for s, t in buckets.shapes.tolist()]


def wmt_like_lengths(pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) lengths (subwords, without EOS) of ``pairs`` synthetic news-like
    sentence pairs, to measure batch plans where no WMT corpus can be fetched
    (``benchmarks/batch_fill.py``, tests): source lengths log-normal around 25 (sigma 0.6,
    1-250), target = source x a log-normal ratio (sigma 0.15) + Gaussian noise (sd 1.5)."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(25), 0.6, pairs)), 1, 250).astype(np.int64)
    ratio = rng.lognormal(0.05, 0.15, pairs)
    tgt = np.clip(np.round(src * ratio + rng.normal(0, 1.5, pairs)), 1, 250).astype(np.int64)
    return src, tgt
