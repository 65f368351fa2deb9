"""Token-based batching with length bucketing, and collation into padded tensors.

A batch holds at most ``max_tokens`` tokens counted as ``sentences x longest side``
(padding and EOS included), so memory per batch is bounded. Training batches are formed
from lengths sorted with a little noise and visited in a shuffled order that depends only
on ``(seed, epoch)``: the position inside an epoch (its batch index) is all that is
needed to resume exactly.

Static shapes (:class:`ranmt.data.shapes.ShapeBuckets`): a compiled training step
recompiles for every new batch shape, and a CUDA graph replays one shape only. With shape
buckets every example goes to a shape ``(S, T)`` when batches are formed, a batch holds one
shape's examples and is padded to ``(max_tokens // max(S, T), S)`` on the source side and
``(same rows, T)`` on the target side: as many shapes as buckets. Padding rows are a lone
EOS on the source side (no fully masked attention row) and PAD targets, so they add
nothing to the loss or the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ranmt.data.corpus import concatenated, gather
from ranmt.data.shapes import ShapeBuckets
from ranmt.data.vocab import BOS, EOS, PAD

__all__ = ["Batch", "BatchPrefetcher", "ShapeBuckets", "batch_from_split", "collate",
           "make_batches", "pad_sources", "padding_share", "rank_plan"]


def padding_share(batches: list[np.ndarray], src_lens: np.ndarray, tgt_lens: np.ndarray,
                  buckets: ShapeBuckets | None = None) -> float:
    """The share of padding in the batches' slots (lengths without EOS, as
    :func:`make_batches` takes them): slots are sentences x width on each side, each side
    padded to its own longest example, or, with ``buckets``, both to the batch's shape."""
    src_lens, tgt_lens = np.asarray(src_lens), np.asarray(tgt_lens)
    real = slots = 0
    for indices in batches:
        src, tgt = src_lens[indices] + 1, tgt_lens[indices] + 1
        real += int(src.sum() + tgt.sum())
        if buckets is None:
            slots += len(indices) * int(src.max() + tgt.max())
        else:
            rows, src_length, tgt_length = buckets.batch_shape(int(src.max()), int(tgt.max()))
            slots += rows * (src_length + tgt_length)
    return 1 - real / max(slots, 1)


def make_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int,
                 max_sentences: int = 0, seed: int | None = None, epoch: int = 0,
                 noise: float = 0.0, buckets: ShapeBuckets | None = None, pool: int = 0
                 ) -> list[np.ndarray]:
    """Index arrays of batches covering every example exactly once.

    With ``seed`` None the order is deterministic by length (for decoding); otherwise lengths
    get uniform noise in [0, noise) and batch order is shuffled with ``(seed, epoch)``.

    Examples are visited in order of (target, source) length; a batch grows while its
    ``size x widest`` stays within ``max_tokens`` (and its size within ``max_sentences``);
    an example wider than ``max_tokens`` forms a batch of its own. With ``pool`` > 0 (and
    no buckets; Marian's "maxi-batches") that order is cut into pools of about ``pool``
    batches' tokens and each pool is ordered again by (source, target) length before it is
    cut into batches: a batch then holds sentences close in length on both sides, not on
    the target side alone (fill 80% -> 95% of the slots on Multi30k at 4,096 tokens, 79% ->
    96% on WMT-like lengths at 25,000 with pools of 8: ``benchmarks/batch_fill.py``). With
    ``buckets`` the examples are ordered by their shape (then source length, noise as
    above) and each shape's run is cut into batches of its ``rows``, so every batch holds
    one shape's examples and fits it. Vectorised: one pass of numpy operations per batch
    over a window no longer than the batch can be, never a Python loop over the examples
    (:func:`_greedy_cuts`).
    """
    src_lens = np.asarray(src_lens) + 1  # + EOS
    tgt_lens = np.asarray(tgt_lens) + 1  # + BOS/EOS shift
    count = len(src_lens)
    if count == 0:
        return []
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    jitter = rng.uniform(0, noise, count) if (rng is not None and noise > 0) else 0.0
    if buckets is None:
        order = _length_order(src_lens, tgt_lens, jitter)
        widths = np.maximum(src_lens, tgt_lens)[order]
        if pool <= 0:
            return _shuffled(np.split(order, _greedy_cuts(widths, max_tokens, max_sentences)),
                             rng)
        order, starts = _reorder_pools(order, src_lens, tgt_lens, pool * max_tokens, rng)
        widths = np.maximum(src_lens, tgt_lens)[order]
    else:  # by shape first, so that a batch holds one shape's examples
        shape = buckets.assign(src_lens, tgt_lens)  # (N,) -1: no shape holds it
        own = np.maximum(buckets.capped(src_lens), buckets.capped(tgt_lens))
        key = np.where(shape >= 0, shape, len(buckets) + own)  # one run per shape
        order = _length_order(src_lens, key * (int(np.ceil(noise)) + 1), jitter)
        # a batch's width is its shape's longer side: runs cut into batches of its rows
        shape, key = shape[order], key[order]
        longer = buckets.shapes.max(axis=1)
        widths = np.where(shape >= 0, longer[np.maximum(shape, 0)], own[order])
        starts = np.r_[0, np.flatnonzero(np.diff(key)) + 1, count]
    cuts = []  # batches never span two runs (pools, shapes)
    for start, end in zip(starts[:-1], starts[1:]):
        cuts.extend([start] if start else [])
        cuts.extend(start + cut for cut in _greedy_cuts(widths[start:end], max_tokens,
                                                        max_sentences))
    return _shuffled(np.split(order, cuts), rng)


def _shuffled(batches: list[np.ndarray], rng: np.random.Generator | None) -> list[np.ndarray]:
    """The batches in a random order drawn from ``rng`` (as they are without one)."""
    if rng is None:
        return batches
    return [batches[i] for i in rng.permutation(len(batches))]


def _length_order(src_lens: np.ndarray, tgt_lens: np.ndarray, jitter) -> np.ndarray:
    """``np.lexsort((src_lens + jitter, tgt_lens + jitter))`` (by target length, then source
    length, then position), in a fraction of its time at WMT scale (36M pairs on 2 cores:
    ~5 s instead of 15 s).

    Without jitter the keys are integers and one stable sort of a combined key gives that
    order. With jitter one sort of the primary key does, except where two primary keys are
    equal (a few in tens of millions): those runs are put in order by the secondary key
    and position afterwards.
    """
    if np.isscalar(jitter) and jitter == 0:
        src_lens, tgt_lens = np.asarray(src_lens, np.int64), np.asarray(tgt_lens, np.int64)
        return np.argsort(tgt_lens * (int(src_lens.max()) + 1) + src_lens, kind="stable")
    primary = tgt_lens + jitter
    order = np.argsort(primary)
    sorted_primary = primary[order]
    ties = np.flatnonzero(sorted_primary[1:] == sorted_primary[:-1])
    if len(ties):
        # Runs of equal primary keys: [start, end) in the sorted order.
        starts = ties[np.r_[True, np.diff(ties) > 1]]
        ends = ties[np.r_[np.diff(ties) > 1, True]] + 2
        for start, end in zip(starts, ends):
            run = np.sort(order[start:end])  # positions, ascending: the stable tie-break
            secondary = src_lens[run] + jitter[run]
            order[start:end] = run[np.argsort(secondary, kind="stable")]
    return order


def _reorder_pools(order: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray,
                   pool_tokens: int, rng: np.random.Generator | None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``order`` (by target length) cut into consecutive pools of about ``pool_tokens``
    tokens (counted as each example's wider side) and each pool ordered by (source, target)
    length; ties in a random order drawn from ``rng`` (in position order without one).
    One stable sort of a combined integer key: pool, then source, then target length.
    Returns (the new order, the pools' start positions in it and its length at the end)."""
    widths = np.maximum(src_lens, tgt_lens)[order]
    pools = (np.cumsum(widths) - widths) // max(pool_tokens, 1)  # (N,) pool of each slot
    src, tgt = src_lens[order].astype(np.int64), tgt_lens[order].astype(np.int64)
    key = (pools * (int(src.max()) + 1) + src) * (int(tgt.max()) + 1) + tgt
    shuffle = rng.permutation(len(order)) if rng is not None else np.arange(len(order))
    starts = np.r_[0, np.flatnonzero(np.diff(pools)) + 1, len(order)]
    return order[shuffle[np.argsort(key[shuffle], kind="stable")]], starts


def _greedy_cuts(widths: np.ndarray, max_tokens: int, max_sentences: int = 0) -> list[int]:
    """Start positions (after the first) of the batches that greedily fill ``widths`` in
    order: a batch ``[start, end)`` ends before the first position at which
    ``(position - start + 1) x max(widths[start:position + 1])`` exceeds ``max_tokens``, or
    its size exceeds ``max_sentences`` (when set), but holds at least one example.

    A batch starting at ``start`` cannot hold more than ``max_tokens // widths[start]``
    examples (the widest is at least as wide as the first), so each batch looks at that
    many widths only.
    """
    count = len(widths)
    cuts = []
    start = 0
    while True:
        limit = max_tokens // max(int(widths[start]), 1) + 1
        if max_sentences:
            limit = min(limit, max_sentences + 1)
        window = widths[start: start + max(limit, 2)]
        sizes = np.arange(1, len(window) + 1)
        over = np.maximum.accumulate(window) * sizes > max_tokens
        if max_sentences:
            over |= sizes > max_sentences
        over[0] = False  # one example always fits (alone, if it must)
        first = int(np.argmax(over)) if over.any() else len(window)
        start += first
        if start >= count:
            return cuts
        cuts.append(start)


def rank_plan(batches: list, start: int, world_size: int, rank: int,
              accumulation: int = 1) -> list:
    """The batches rank ``rank`` of ``world_size`` trains on, in order, from batch ``start``
    of an epoch's plan: one optimizer step consumes ``world_size x accumulation``
    consecutive batches and each rank takes every ``world_size``-th of them, so the ranks'
    shards are disjoint; a tail too short to give every rank a batch is left out."""
    per_step = world_size * accumulation
    plan, position = [], start
    while len(batches) - position >= world_size:
        plan.extend(batches[position: position + per_step][rank::world_size])
        position += min(per_step, len(batches) - position)
    return plan


@dataclass
class Batch:
    src: torch.Tensor
    """(B, S) source ids + EOS, right-padded."""
    tgt_in: torch.Tensor
    """(B, T) BOS + target ids, right-padded."""
    tgt_out: torch.Tensor
    """(B, T) target ids + EOS, right-padded."""
    indices: np.ndarray
    """(B,) example indices in the split."""
    src_tokens: int = -1
    """Tokens of the batch's sources, EOS included (counted on the host at collation)."""
    tgt_tokens: int = -1
    """Tokens of the batch's targets, EOS included (counted on the host at collation)."""

    @property
    def target_tokens(self) -> int:
        return int(self.tgt_out.ne(PAD).sum())

    def fill(self) -> tuple[int, int, int, int]:
        """(source tokens, source slots, target tokens, target slots): the tokens of the
        batch's sentences (EOS included) against the cells of its padded tensors; a shape
        bucket's padding rows (a lone EOS on the source side) are slots, not tokens. Counts
        made at collation: nothing is read from the tensors (no host read of a device)."""
        return self.src_tokens, self.src.numel(), self.tgt_tokens, self.tgt_out.numel()

    def pin_memory(self) -> Batch:
        """The batch in page-locked memory, so that its copy to a GPU runs asynchronously
        (a copy from pageable memory makes the host wait; needs CUDA)."""
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(),
                     self.tgt_out.pin_memory(), self.indices, self.src_tokens, self.tgt_tokens)

    def to(self, device: torch.device) -> Batch:
        return Batch(self.src.to(device, non_blocking=True),
                     self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.indices,
                     self.src_tokens, self.tgt_tokens)


def _place(out: np.ndarray, flat: np.ndarray, lengths: np.ndarray, first: int) -> None:
    """Sentence r (of ``flat``/``lengths``) into ``out[r, first : first + length]``, every row
    at once: the True cells of a (rows, width) mask, in row-major order, are the concatenated
    tokens' places. Vectorised: a Python loop of tensor assignments per row took ~65 ms for a
    1,000-sentence batch, and the training loop's background collation then held the
    interpreter lock the loop needs to launch a GPU step's kernels."""
    columns = np.arange(out.shape[1])[None, :] - first  # (1, width)
    cells = (columns >= 0) & (columns < lengths[:, None])  # (sentences, width)
    out[: len(lengths)][cells] = flat


def _sources(flat: np.ndarray, lengths: np.ndarray,
             shape: tuple[int, int] | None = None) -> torch.Tensor:
    """(rows, width) tensor of sources + EOS; extra rows of ``shape`` a lone EOS."""
    rows, width = _frame(lengths, shape)
    out = np.full((rows, width), PAD, dtype=np.int64)  # on the host
    out[len(lengths):, 0] = EOS
    _place(out, flat, lengths, 0)
    out[np.arange(len(lengths)), lengths] = EOS
    return torch.from_numpy(out)


def pad_sources(seqs: list[np.ndarray] | list[list[int]],
                shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Sources + EOS, right-padded: (B, S); with ``shape`` (rows, S) padded to it, the extra
    rows a lone EOS."""
    return _sources(*concatenated(seqs), shape)


def _frame(lengths: np.ndarray, shape: tuple[int, int] | None) -> tuple[int, int]:
    """(rows, width) of the padded tensor for sentences of ``lengths`` plus one BOS/EOS:
    ``shape`` when given (it must hold them), else just large enough."""
    rows, width = len(lengths), int(lengths.max(initial=0)) + 1
    if shape is None:
        return rows, width
    if shape[0] < rows or shape[1] < width:
        raise ValueError(f"a batch of {rows} x {width} does not fit the shape {shape}")
    return shape


def _side_shapes(shape: tuple[int, ...] | None
                 ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """((rows, S), (rows, T)) of a batch shape given as (rows, length) or (rows, S, T)."""
    if shape is None:
        return None, None
    rows, *lengths = shape
    src_length, tgt_length = (lengths[0], lengths[0]) if len(lengths) == 1 else lengths
    return (rows, src_length), (rows, tgt_length)


def _collate_flat(src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray],
                  indices: np.ndarray, shape: tuple[int, ...] | None = None) -> Batch:
    """:func:`collate` of sentences given as (tokens concatenated, lengths) per side."""
    src_shape, tgt_shape = _side_shapes(shape)
    flat, lengths = tgt
    rows, width = _frame(lengths, tgt_shape)
    tgt_in = np.full((rows, width), PAD, dtype=np.int64)  # BOS, sentence, PAD...
    tgt_out = np.full((rows, width), PAD, dtype=np.int64)  # sentence, EOS, PAD...
    tgt_in[:, 0] = BOS
    _place(tgt_in, flat, lengths, 1)
    _place(tgt_out, flat, lengths, 0)
    tgt_out[np.arange(len(lengths)), lengths] = EOS
    return Batch(_sources(*src, src_shape), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 indices, src_tokens=int(src[1].sum()) + len(src[1]),
                 tgt_tokens=int(lengths.sum()) + len(lengths))


def collate(src: list[np.ndarray], tgt: list[np.ndarray], indices: np.ndarray,
            shape: tuple[int, ...] | None = None) -> Batch:
    """Padded tensors of a batch; with ``shape`` (rows, length) both sides padded to it, with
    (rows, S, T) the source to S and the target to T (the extra rows: a lone EOS source, BOS
    then PAD target input, PAD target output)."""
    return _collate_flat(concatenated(src), concatenated(tgt), indices, shape)


def batch_from_split(split, indices: np.ndarray, max_positions: int | None = None,
                     buckets: ShapeBuckets | None = None) -> Batch:
    """Collate examples ``indices`` of an :class:`EncodedSplit` (truncated to fit positions),
    padded to its bucket's shape when ``buckets`` are given."""
    limit = None if max_positions is None else max_positions - 1
    src, tgt = gather(split.src, indices, limit), gather(split.tgt, indices, limit)
    if buckets is None:
        return _collate_flat(src, tgt, indices)
    shape = buckets.batch_shape(int(src[1].max(initial=0)) + 1, int(tgt[1].max(initial=0)) + 1)
    return _collate_flat(src, tgt, indices, shape=shape)


class BatchPrefetcher:
    """Collates batches in a background thread, ``depth`` ahead of the training loop.

    ``plan`` lists the index arrays in the order the loop will consume them; iteration
    yields the collated :class:`Batch` objects in that order. ``close()`` stops the worker
    (the loop may stop early: time budget, signal). ``pin``: the worker also pins each batch
    (training on CUDA).
    """

    def __init__(self, split, plan: list[np.ndarray], max_positions: int | None = None,
                 depth: int = 8, buckets: ShapeBuckets | None = None, pin: bool = False):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None

        def work() -> None:
            try:
                for indices in plan:
                    batch = batch_from_split(split, indices, max_positions, buckets)
                    if pin:
                        batch = batch.pin_memory()
                    while not self._stop.is_set():
                        try:
                            self._queue.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
            except BaseException as err:  # handed to the consumer
                self._error = err
            finally:
                if not self._stop.is_set():
                    self._queue.put(None)

        self._thread = threading.Thread(target=work, name="ranmt-batches", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self._queue.get()
        if batch is None:
            if self._error is not None:
                raise self._error
            raise StopIteration
        return batch

    def close(self) -> None:
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._thread.join(timeout=5)
