"""Token batching: every example exactly once per epoch, token budget, determinism, collation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ranmt.data.batching import collate, make_batches, padding_share
from ranmt.data.shapes import wmt_like_lengths


@pytest.mark.parametrize("epoch", [0, 1])
def test_every_example_once_per_epoch_within_budget(epoch):
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(1, 40, 500), rng.integers(1, 40, 500)
    batches = make_batches(src, tgt, max_tokens=300, seed=1, epoch=epoch, noise=0.5)
    seen = np.concatenate(batches)
    assert sorted(seen.tolist()) == list(range(500))
    for batch in batches:
        width = max(max(src[batch]), max(tgt[batch])) + 1
        assert len(batch) == 1 or width * len(batch) <= 300


def test_order_depends_only_on_seed_and_epoch():
    src = tgt = np.arange(1, 200) % 30 + 1
    a = make_batches(src, tgt, 200, seed=3, epoch=2, noise=0.5)
    b = make_batches(src, tgt, 200, seed=3, epoch=2, noise=0.5)
    c = make_batches(src, tgt, 200, seed=3, epoch=3, noise=0.5)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, c))


def test_max_sentences_and_oversized_example():
    src = np.array([100, 2, 2, 2, 2])
    batches = make_batches(src, src, max_tokens=50, max_sentences=2)
    assert sorted(np.concatenate(batches).tolist()) == list(range(5))
    assert max(len(b) for b in batches) <= 2  # the 100-token example still gets a batch


def test_collate_shifts_targets():
    batch = collate([np.array([5, 6]), np.array([7])], [np.array([8, 9, 10]), np.array([11])],
                    np.array([0, 1]))
    assert batch.src.tolist() == [[5, 6, 3], [7, 3, 0]]
    assert batch.tgt_in.tolist() == [[2, 8, 9, 10], [2, 11, 0, 0]]
    assert batch.tgt_out.tolist() == [[8, 9, 10, 3], [11, 3, 0, 0]]
    assert batch.target_tokens == 6


def _reference_batches(src_lens, tgt_lens, max_tokens, max_sentences=0, seed=None, epoch=0,
                       noise=0.0):
    """ranmt 0.1's planner, a Python loop over every example: the vectorised one must match."""
    src_lens = np.asarray(src_lens) + 1
    tgt_lens = np.asarray(tgt_lens) + 1
    count = len(src_lens)
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    jitter = rng.uniform(0, noise, count) if (rng is not None and noise > 0) else 0.0
    order = np.lexsort((src_lens + jitter, tgt_lens + jitter))
    batches, start, longest = [], 0, 0
    for pos in range(count):
        index = order[pos]
        width = max(longest, src_lens[index], tgt_lens[index])
        size = pos - start + 1
        too_many = (width * size > max_tokens) or (max_sentences and size > max_sentences)
        if too_many and pos > start:
            batches.append(order[start:pos])
            start, longest = pos, max(src_lens[index], tgt_lens[index])
        else:
            longest = width
    batches.append(order[start:count])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


@pytest.mark.parametrize("max_tokens,max_sentences,seed,noise", [
    (300, 0, None, 0.0), (300, 0, 7, 1.0), (1000, 12, 3, 1.0), (40, 0, 5, 0.5),
    (4096, 0, 11, 1.0)])
def test_vectorised_planning_gives_the_reference_batches(max_tokens, max_sentences, seed,
                                                         noise):
    rng = np.random.default_rng(0)
    src = rng.integers(0, 120, 5000)
    tgt = np.clip(src + rng.integers(-20, 20, 5000), 0, 150)
    src[:5] = 400  # wider than some budgets: a batch of its own
    for epoch in (0, 1):
        ours = make_batches(src, tgt, max_tokens, max_sentences, seed, epoch, noise)
        theirs = _reference_batches(src, tgt, max_tokens, max_sentences, seed, epoch, noise)
        assert len(ours) == len(theirs)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("world_size,accumulation,start", [(2, 1, 0), (4, 2, 6), (8, 1, 3)])
def test_rank_shards_of_a_large_epoch_are_disjoint_and_cover_it(world_size, accumulation,
                                                                start):
    """A million pairs planned once (every rank plans the same epoch from the same seed):
    each rank's shard is its own, together they hold every batch from ``start`` on except a
    tail shorter than one batch per rank, and every rank takes as many batches."""
    from ranmt.data.batching import rank_plan

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 120, 1_000_000)
    batches = make_batches(lengths, lengths, 4096, seed=5, epoch=2, noise=1.0)
    shards = [rank_plan(batches, start, world_size, rank, accumulation)
              for rank in range(world_size)]
    assert len({len(shard) for shard in shards}) == 1
    ids = [id(batch) for shard in shards for batch in shard]
    assert len(ids) == len(set(ids))  # disjoint
    covered = len(ids)
    assert len(batches) - start - world_size < covered <= len(batches) - start
    assert {id(b) for b in batches[start: start + covered]} == set(ids)
    examples = np.concatenate([b for shard in shards for b in shard])
    assert len(np.unique(examples)) == len(examples)


def test_length_order_is_lexsort_order_with_and_without_ties():
    from ranmt.data.batching import _length_order

    rng = np.random.default_rng(3)
    src, tgt = rng.integers(1, 30, 20_000), rng.integers(1, 30, 20_000)
    for jitter in (0.0, rng.uniform(0, 1, 20_000), rng.integers(0, 4, 20_000) / 4.0):
        expected = np.lexsort((src + jitter, tgt + jitter))
        assert np.array_equal(_length_order(src, tgt, jitter), expected)


def _reference_rows(seqs, shape, first, lead, end):
    """The per-row collation the vectorised one replaced: row r = lead?, seq, end?, PAD."""
    width = max(len(s) for s in seqs) + 1
    rows, width = shape or (len(seqs), width)
    out = np.zeros((rows, width), dtype=np.int64)
    for row, seq in enumerate(seqs):
        if lead is not None:
            out[row, 0] = lead
        out[row, first: first + len(seq)] = seq
        if end is not None:
            out[row, len(seq)] = end
    return out, rows


@pytest.mark.parametrize("stored", ["flat", "subset", "lists"])
@pytest.mark.parametrize("shaped", [False, True])
def test_batch_from_split_equals_per_row_collation(tmp_path, stored, shaped):
    """The vectorised gather + collation: every sentence in its row (cut to the positions),
    BOS/EOS/PAD where the per-row reference puts them, padding rows as documented, for
    sentences stored flat (memory-mapped), through a subset, and as plain lists."""
    from ranmt.data.batching import ShapeBuckets, batch_from_split
    from ranmt.data.corpus import EncodedSplit, SubsetSequences, TokenSequences
    from ranmt.data.vocab import BOS, EOS, PAD

    rng = np.random.default_rng(5)
    sides = []
    for _ in range(2):
        seqs = [rng.integers(4, 50, size=n) for n in rng.integers(0, 30, size=80)]
        sides.append(seqs)
    if stored == "lists":
        split = EncodedSplit(*sides)
        view = sides
    else:
        stores = []
        for side, seqs in zip("st", sides):
            offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
            np.save(tmp_path / f"{side}.npy", np.concatenate(seqs).astype(np.int32))
            stores.append(TokenSequences(np.load(tmp_path / f"{side}.npy", mmap_mode="r"),
                                         offsets))
        keep = np.arange(5, 80)
        view = [[seqs[i] for i in keep] for seqs in sides] if stored == "subset" else sides
        split = EncodedSplit(*(SubsetSequences(s, keep) if stored == "subset" else s
                               for s in stores))
    indices = np.array([7, 0, 33, 12, 60, 2])
    buckets = ShapeBuckets([8, 64], 1024, max_positions=21) if shaped else None
    batch = batch_from_split(split, indices, max_positions=21, buckets=buckets)
    src = [view[0][i][:20] for i in indices]
    tgt = [view[1][i][:20] for i in indices]
    shape = tuple(batch.src.shape) if shaped else None
    if shaped:
        assert shape == (1024 // 21, 21)
    want_src, rows = _reference_rows(src, shape, 0, None, EOS)
    want_src[len(src):rows, 0] = EOS
    want_in, _ = _reference_rows(tgt, shape, 1, BOS, None)
    want_in[len(tgt):rows, 0] = BOS
    want_out, _ = _reference_rows(tgt, shape, 0, None, EOS)
    assert PAD == 0 and batch.src.dtype == torch.long
    assert np.array_equal(batch.src.numpy(), want_src)
    assert np.array_equal(batch.tgt_in.numpy(), want_in)
    assert np.array_equal(batch.tgt_out.numpy(), want_out)
    assert batch.indices is indices


@pytest.mark.parametrize("pool", [2, 8])
def test_pools_cover_every_example_once_within_budget_and_never_span_two_pools(pool):
    src, tgt = wmt_like_lengths(3000, seed=1)
    batches = make_batches(src, tgt, max_tokens=2000, seed=1, epoch=0, noise=0.5, pool=pool)
    assert sorted(np.concatenate(batches).tolist()) == list(range(3000))
    for batch in batches:
        assert len(batch) == 1 or (max(src[batch].max(), tgt[batch].max()) + 1) * len(batch) \
            <= 2000
    again = make_batches(src, tgt, max_tokens=2000, seed=1, epoch=0, noise=0.5, pool=pool)
    assert all((x == y).all() for x, y in zip(batches, again))


def test_pools_fill_ninety_percent_of_the_slots_where_one_sort_does_not():
    """WMT-like lengths at 25,000 tokens a batch: one sort by target length leaves the source
    side ragged (fill under 80%); pools of 8 batches sorted again by source length fill more
    than 90% of the slots of both sides."""
    src, tgt = wmt_like_lengths(60000)
    plain = 1 - padding_share(make_batches(src, tgt, 25000, seed=1, noise=0.5), src, tgt)
    pooled = 1 - padding_share(make_batches(src, tgt, 25000, seed=1, noise=0.5, pool=8),
                               src, tgt)
    assert plain < 0.8 and pooled > 0.9


def test_fill_counts_a_hand_counted_batch():
    """Sources of 3 and 1 tokens, targets of 2 and 4: + EOS, 4 + 2 source tokens in a 2 x 4
    tensor, 3 + 5 target tokens in 2 x 5; in a shape bucket of 4 x 6 the padding rows (a
    lone EOS) are slots, not tokens."""
    src = [np.array([5, 6, 7]), np.array([8])]
    tgt = [np.array([9, 10]), np.array([11, 12, 13, 14])]
    assert collate(src, tgt, np.array([0, 1])).fill() == (6, 8, 8, 10)
    assert collate(src, tgt, np.array([0, 1]), shape=(4, 6)).fill() == (6, 24, 8, 24)
