"""Shape buckets: training batches padded to a few static shapes (for compiled and graphed
steps). Every example exactly once, every batch inside its shape, no more shapes than
buckets, the reported padding equal to the collated tensors', padding rows that change
neither loss nor gradients, and a compiled step that compiles once per shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from ranmt.config import ConfigError, load_config
from ranmt.data.batching import (
    ShapeBuckets,
    batch_from_split,
    collate,
    make_batches,
    padding_share,
)
from ranmt.data.corpus import EncodedSplit
from ranmt.data.shapes import choose_shapes, wmt_like_lengths
from ranmt.model import PAD_ID
from ranmt.training.loss import label_smoothed_loss, teacher_forced_loss

BUCKETS = [8, 16, 24, 32, 48, 64]


def _corpus(count: int = 600, seed: int = 0, vocab: int = 40) -> EncodedSplit:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=(count, 2))
    return EncodedSplit([rng.integers(4, vocab, size=n) for n in lengths[:, 0]],
                        [rng.integers(4, vocab, size=n) for n in lengths[:, 1]])


def _lengths(split):
    return (np.array([len(s) for s in split.src]), np.array([len(t) for t in split.tgt]))


@pytest.mark.parametrize("max_sentences", [0, 12])
def test_bucketed_batches_cover_every_example_once_and_fit_their_shapes(max_sentences):
    split = _corpus()
    src_lens, tgt_lens = _lengths(split)
    buckets = ShapeBuckets(BUCKETS, 512, max_sentences, max_positions=128)
    batches = make_batches(src_lens, tgt_lens, 512, max_sentences, seed=3, epoch=1,
                           noise=0.5, buckets=buckets)
    covered = np.sort(np.concatenate(batches))
    assert np.array_equal(covered, np.arange(len(split)))
    shapes = set()
    for indices in batches:
        batch = batch_from_split(split, indices, buckets=buckets)
        rows, length = batch.src.shape
        assert batch.tgt_in.shape == batch.tgt_out.shape == (rows, length)
        assert length in BUCKETS + [128] and rows >= len(indices)
        assert rows * length <= 512 or len(indices) == 1
        if max_sentences:
            assert rows <= max_sentences
        widest = int(max(src_lens[indices].max(), tgt_lens[indices].max())) + 1
        assert length == min(b for b in BUCKETS + [128] if b >= widest)
        shapes.add((rows, length))
    assert len(shapes) <= len(BUCKETS)


@pytest.mark.parametrize("chosen", [False, True])
def test_reported_padding_is_the_collated_padding(chosen):
    split = _corpus(seed=1)
    src_lens, tgt_lens = _lengths(split)
    shapes = choose_shapes(src_lens + 1, tgt_lens + 1, 6, 600) if chosen else BUCKETS
    buckets = ShapeBuckets(shapes, 600)
    batches = make_batches(src_lens, tgt_lens, 600, seed=1, noise=0.5, buckets=buckets)
    padded = padding_share(batches, src_lens, tgt_lens, buckets)
    plain = padding_share(batches, src_lens, tgt_lens)
    real = slots = plain_slots = 0
    for indices in batches:
        batch = batch_from_split(split, indices, buckets=buckets)
        rows = len(indices)
        real += int(batch.src[:rows].ne(PAD_ID).sum() + batch.tgt_out[:rows].ne(PAD_ID).sum())
        slots += batch.src.numel() + batch.tgt_out.numel()
        bare = batch_from_split(split, indices)
        plain_slots += bare.src.numel() + bare.tgt_out.numel()
    assert padded == pytest.approx(1 - real / slots)
    assert plain == pytest.approx(1 - real / plain_slots)
    assert 0 < plain < padded < 0.6


def test_chosen_shapes_batches_cover_every_example_once_in_the_cheapest_shape_holding_it():
    """Shapes chosen from the data: every example once, a batch of one shape, each side
    padded to that shape's own length, the shape the cheapest (S + T) of those holding
    every sentence of the batch, no more sentences than max_tokens // max(S, T)."""
    split = _corpus(count=1500, seed=7)
    src_lens, tgt_lens = _lengths(split)
    shapes = choose_shapes(src_lens + 1, tgt_lens + 1, 8, 1000, max_positions=64)
    assert 2 <= len(shapes) <= 8
    buckets = ShapeBuckets(shapes, 1000, max_positions=64)
    batches = make_batches(src_lens, tgt_lens, 1000, seed=2, epoch=3, noise=0.5,
                           buckets=buckets)
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(len(split)))
    seen = set()
    for indices in batches:
        batch = batch_from_split(split, indices, max_positions=64, buckets=buckets)
        rows, src_length = batch.src.shape
        assert batch.tgt_out.shape[0] == rows and len(indices) <= rows
        tgt_length = batch.tgt_out.shape[1]
        assert rows == max(1, 1000 // max(src_length, tgt_length))
        holding = [(s, t) for s, t in buckets.shapes.tolist()
                   if all(src_lens[i] + 1 <= s and tgt_lens[i] + 1 <= t for i in indices)]
        assert (src_length, tgt_length) == min(holding, key=lambda st: (sum(st), st[0]))
        for i in indices:  # and each of its sentences has no cheaper shape of its own
            own = [(s, t) for s, t in buckets.shapes.tolist()
                   if src_lens[i] + 1 <= s and tgt_lens[i] + 1 <= t]
            assert min(own, key=lambda st: (sum(st), st[0])) == (src_length, tgt_length)
        seen.add((src_length, tgt_length))
    assert len(seen) <= len(buckets)


def test_shapes_chosen_from_a_hand_made_corpus():
    """Two kinds of sentences, 5/5 and 20/40 tokens (EOS included): one shape must hold
    all (20/40); the second pays for itself (100 x 50 slots saved against the half batch
    of 80 x 10 its last batch leaves) and is 5/5. Sides are per shape, not square; an
    asymmetric example goes to a shape of its own sides' lengths."""
    src = np.array([5] * 100 + [20] * 100)
    tgt = np.array([5] * 100 + [40] * 100)
    assert choose_shapes(src, tgt, 4, 400) == [(5, 5), (20, 40)]
    assert choose_shapes(src, tgt, 1, 400) == [(20, 40)]
    # a tail that costs more than it saves: 3 short sentences, a 80 x 10 / 2 last batch
    few = np.array([5] * 3 + [20] * 100)
    assert choose_shapes(few, np.array([5] * 3 + [40] * 100), 4, 400) == [(20, 40)]
    buckets = ShapeBuckets([(32, 12), (32, 32), 16], 640)
    assert buckets.batch_shape(30, 10) == (20, 32, 12)
    assert buckets.batch_shape(10, 30) == (20, 32, 32)
    assert buckets.batch_shape(16, 16) == (40, 16, 16)
    assert buckets.batch_shape(40, 3) == (16, 40, 3)  # none holds it: its own widths


def test_chosen_shapes_pad_less_than_square_buckets_on_wmt_like_lengths():
    """benchmarks/batch_fill.py's synthetic news-like lengths (50,000 pairs here), 4,096
    tokens a batch: 16 shapes chosen from the data fill more of the slots than 8 square
    buckets (0.84 against 0.77; 0.85 against 0.78 at 10^6 pairs and 25,000 tokens), and
    never more shapes than asked for."""
    src, tgt = wmt_like_lengths(50_000, seed=3)
    square = ShapeBuckets([16, 24, 32, 48, 64, 96, 128, 256], 4096)
    shapes = choose_shapes(src + 1, tgt + 1, 16, 4096)
    chosen = ShapeBuckets(shapes, 4096)
    assert len(chosen) <= 16
    fills = {}
    for name, buckets in (("square", square), ("chosen", chosen)):
        batches = make_batches(src, tgt, 4096, seed=1, noise=0.5, buckets=buckets)
        fills[name] = 1 - padding_share(batches, src, tgt, buckets)
    assert fills["chosen"] > fills["square"] + 0.04 and fills["chosen"] > 0.8, fills


def test_bucket_order_keeps_padding_near_the_plain_plan():
    """Ordered by bucket first, a bucketed plan pads little more than the plain plan (each
    side padded to its own longest example); ordered by target length alone it padded about
    twice as much on Multi30k (36% vs 19% at 4,096 tokens)."""
    split = _corpus(count=3000, seed=5)
    src_lens, tgt_lens = _lengths(split)
    lengths = list(range(4, 61, 4))
    buckets = ShapeBuckets(lengths, 2048)
    bucketed = make_batches(src_lens, tgt_lens, 2048, seed=1, noise=0.5, buckets=buckets)
    plain = make_batches(src_lens, tgt_lens, 2048, seed=1, noise=0.5)
    assert padding_share(bucketed, src_lens, tgt_lens, buckets) < \
        padding_share(plain, src_lens, tgt_lens) + 0.08


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-all", "syn-r"])
def test_padding_rows_and_columns_change_neither_loss_nor_gradients(arch):
    model, _ = tiny_model(seed=1, **{"model.arch": arch, "model.max_positions": 64})
    model.eval()  # no dropout (masks of another shape would be other draws); grads still flow
    rng = np.random.default_rng(2)
    src = [rng.integers(4, 40, size=n) for n in (5, 9, 3)]
    tgt = [rng.integers(4, 40, size=n) for n in (7, 4, 6)]

    def loss_and_grads(shape):
        batch = collate(src, tgt, np.arange(3), shape=shape)
        model.zero_grad(set_to_none=True)
        loss, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(None)
    padded_loss, padded_grads = loss_and_grads((8, 16))
    assert padded_loss == pytest.approx(loss, rel=1e-5)
    assert len(grads) == len(padded_grads)
    for grad, padded in zip(grads, padded_grads):
        torch.testing.assert_close(padded, grad, rtol=1e-4, atol=1e-5)  # summation order


def test_a_batch_larger_than_its_shape_is_an_error():
    with pytest.raises(ValueError, match="does not fit"):
        collate([np.array([5, 6, 7])], [np.array([5])], np.arange(1), shape=(1, 3))


def test_shape_buckets_config_is_checked():
    cfg = load_config(None, {"data.shape_buckets": "[16, 32, 64]"})
    assert cfg.data.shape_buckets == (16, 32, 64)
    assert load_config(None, {}).data.shape_buckets == ()
    with pytest.raises(ConfigError, match="shape_buckets"):
        load_config(None, {"data.shape_buckets": "[32, 16]"})
    assert load_config(None, {"data.auto_shape_buckets": "16"}).data.auto_shape_buckets == 16
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(None, {"data.shape_buckets": "[16]", "data.auto_shape_buckets": "4"})


def test_training_with_shape_buckets_logs_its_shapes(reverse_data, tmp_path):
    from ranmt.training.train import train
    from test_train import _cfg

    summary = train(_cfg(**{"train.max_steps": 6, "data.shape_buckets": "[8, 12, 16, 24]"}),
                    reverse_data, tmp_path / "run")
    assert summary["steps"] == 6
    log = (tmp_path / "run/train.log").read_text()
    line = next(line for line in log.splitlines() if "(shape buckets)" in line)
    shapes = int(line.split(" batches in ")[1].split()[0])
    assert 1 <= shapes <= 4 and "padding" in line


def test_training_with_chosen_shapes_logs_them(reverse_data, tmp_path):
    from ranmt.training.train import train
    from test_train import _cfg

    summary = train(_cfg(**{"train.max_steps": 4, "data.auto_shape_buckets": 3}),
                    reverse_data, tmp_path / "run")
    assert summary["steps"] == 4
    log = (tmp_path / "run/train.log").read_text()
    chosen = next(line for line in log.splitlines() if "data.auto_shape_buckets" in line)
    described = chosen.split("source/target length): ")[1].split(", ")
    assert 1 <= len(described) <= 4  # 3 chosen + max_positions
    used = next(line for line in log.splitlines() if "(shape buckets)" in line)
    assert 1 <= int(used.split(" batches in ")[1].split()[0]) <= len(described)


def test_compiled_step_compiles_once_per_shape():
    """torch.compile (dynamic=False, as the trainer does with buckets) over an epoch of
    bucketed batches: the graphs compiled are those of the first shape times the number
    of shapes, and the losses (forward and backward traced) equal eager's."""
    import torch._dynamo

    split = _corpus(count=200, seed=4)
    buckets = ShapeBuckets([16, 32, 64], 640)
    batches = make_batches(*_lengths(split), 640, seed=1, noise=0.5, buckets=buckets)
    model, _ = tiny_model(seed=0, **{"model.arch": "transf", "model.max_positions": 64})
    model.train()
    # As trained, but through aot_eager: Dynamo's graphs per shape do not depend on the
    # backend, and Inductor's kernels are checked against eager by the trainer's compile
    # test (test_distributed.py), ~30 s of C++ compilation less here.
    compiled = torch.compile(teacher_forced_loss, dynamic=False, fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    shapes, per_shape = set(), None
    for indices in batches:
        batch = batch_from_split(split, indices, buckets=buckets)
        shapes.add(tuple(batch.src.shape))
        loss, _ = compiled(model, batch.src, batch.tgt_in, batch.tgt_out, 0.1)
        eager, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1)
        assert float(loss) == pytest.approx(float(eager), rel=1e-4)
        loss.backward()
        if per_shape is None:
            per_shape = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert per_shape >= 1 and 2 <= len(shapes) <= 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= per_shape * len(shapes)


def test_compiling_with_buckets_allows_a_graph_per_shape(reverse_data, tmp_path, monkeypatch):
    """Dynamo stops compiling a frame after its recompile limit (8): with more buckets than
    that the trainer raises the limit to the number of shapes (measured: 10 buckets gave 8
    graphs and a warning before). torch.compile itself is stubbed out: no compilation."""
    import torch._dynamo.config as dynamo_config

    from ranmt.training.train import train
    from test_train import _cfg

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(kw) or model)
    buckets = list(range(6, 66, 4))  # 15 lengths (+ max_positions as the top bucket)
    # torch's own patch: pytest's monkeypatch deletes a config entry when it undoes (torch
    # 2.13), and every later torch.compile in the process then fails
    before = getattr(dynamo_config, name)
    with dynamo_config.patch(**{name: 8}):
        train(_cfg(**{"train.max_steps": 1, "train.compile": "true",
                      "data.shape_buckets": str(buckets)}), reverse_data, tmp_path / "run")
        assert compiled and compiled[0]["dynamic"] is False
        assert getattr(dynamo_config, name) >= len(buckets) + 1
    assert getattr(dynamo_config, name) == before  # restored, not deleted
