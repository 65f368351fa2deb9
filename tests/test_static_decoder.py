"""The search step at fixed addresses (``ranmt.inference.graphs``: ``StaticDecoder``,
``RecordedStep``) that CUDA graphs replay, checked on the CPU where it runs eagerly.

A replayed graph runs the recorded kernels on the recorded addresses, so the step must (1)
give the sync-free search's hypotheses and scores for every decoder-side attention, beam and
greedy, prefixes, fixed lengths, ensembles; (2) leave every cache tensor where it was after
the warm-up (a reordered history or a recurrent state written back in place, not a new
tensor); (3) read nothing on the host inside a step. The replay itself is checked on CUDA
(tests/test_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_hypotheses, random_batch
from ranmt.inference import graphs
from ranmt.inference.decode import search
from ranmt.runtime.host_syncs import SyncCounter
from test_fast_decode import DECODERS, _model


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
def test_static_step_equals_the_shrinking_search(self_attention, cross):
    for seed in (0, 1):
        model = _model(self_attention, cross, seed)
        src, _ = random_batch(batch=5, src_len=9, seed=seed)
        for beam in (1, 2, 5):
            args = dict(beam=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4, nbest=beam)
            assert_same_hypotheses(search(model, src, cuda_graphs=True, **args),
                                   search(model, src, sync_free=False, **args))


@pytest.mark.parametrize(("self_attention", "cross"),
                         [("dot", "dot"), ("ran", "dot"), ("dot", "concat-prev-context")])
def test_static_step_with_prefixes_fixed_length_and_ensembles(self_attention, cross):
    from ranmt.inference.ensemble import Ensemble

    model = _model(self_attention, cross, 3)
    src, _ = random_batch(batch=4, src_len=8, seed=3)
    prefix = torch.tensor([[7, 8, 0], [9, 0, 0], [0, 0, 0], [5, 6, 7]])
    for beam in (1, 3):
        args = dict(beam=beam, nbest=beam, max_len_b=5)
        assert_same_hypotheses(search(model, src, cuda_graphs=True, prefix=prefix, **args),
                               search(model, src, sync_free=False, prefix=prefix, **args))
        assert_same_hypotheses(search(model, src, cuda_graphs=True, fixed_length=9, **args),
                               search(model, src, sync_free=False, fixed_length=9, **args))
    ensemble = Ensemble([model, _model("dot", "dot", 4)])
    assert_same_hypotheses(search(ensemble, src, beam=3, nbest=3, cuda_graphs=True),
                           search(ensemble, src, beam=3, nbest=3, sync_free=False))


class _Recorder(graphs.StaticDecoder):
    """A StaticDecoder that notes the cache's addresses after every step."""

    made: list[_Recorder] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []
        _Recorder.made.append(self)

    def decode(self, prev):
        logprobs = super().decode(prev)
        self.seen.append(self.addresses())
        return logprobs


@pytest.mark.parametrize(("self_attention", "cross"), DECODERS)
@pytest.mark.parametrize("beam", [1, 4])
def test_no_cache_tensor_moves_after_the_warm_up(self_attention, cross, beam, monkeypatch):
    """What a replay relies on: after the warm-up steps every cache tensor (histories,
    memory, recurrent state) stays at its address, through reorders and steps."""
    monkeypatch.setattr("ranmt.inference.search_state.StaticDecoder", _Recorder)
    _Recorder.made.clear()
    model = _model(self_attention, cross, 0)
    src, _ = random_batch(batch=3, src_len=7)
    search(model, src, beam=beam, nbest=beam, cuda_graphs=True, fixed_length=12)
    (decoder,) = _Recorder.made
    settled = decoder.seen[graphs.WARMUP_STEPS - 1]
    assert len(decoder.seen) == 13 and settled  # 12 tokens and EOS
    for addresses in decoder.seen[graphs.WARMUP_STEPS:]:
        assert addresses == settled


@pytest.mark.parametrize(("self_attention", "cross"),
                         [("dot", "dot"), ("ran", "dot"), ("gaussian", "dot"),
                          ("dot", "coverage-subtract")])
def test_static_step_reads_nothing_on_the_host(self_attention, cross):
    model = _model(self_attention, cross, 0)
    src, _ = random_batch(batch=5, src_len=9)
    for beam in (1, 4):
        counts = []
        for length in (16, 48):
            with SyncCounter() as counter:
                search(model, src, beam=beam, fixed_length=length, cuda_graphs=True, check_every=64)
            counts.append(counter.total)
        assert counts[0] == counts[1], counts  # nothing inside the 32 extra steps


def test_graphs_only_with_the_sync_free_search():
    model = _model("dot", "dot", 0)
    src, _ = random_batch(batch=2, src_len=5)
    for other in ({"reference": True}, {"sync_free": False}):
        with pytest.raises(ValueError, match="graphs"):
            search(model, src, beam=2, cuda_graphs=True, **other)


def test_a_step_that_changes_a_cached_shape_is_refused():
    """Copying back needs the replaced tensor's shape: a step that grows a history (as
    the step without fixed span does) is an error, not a silent move."""
    model = _model("dot", "dot", 0)
    src, _ = random_batch(batch=2, src_len=5)
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask, capacity=20)
    decoder = graphs.StaticDecoder(model, cache, 2, 20, src.device)
    with torch.inference_mode():
        decoder.decode(torch.ones(2, 1, dtype=torch.long))
        for member in cache.members:
            member.span = 40  # the history must grow past its slots
        with pytest.raises(RuntimeError, match="shape"):
            decoder.decode(torch.ones(2, 1, dtype=torch.long))


@pytest.mark.parametrize("beam", [1, 2])
def test_a_growing_span_widens_before_the_step_that_needs_it(beam):
    """``StaticDecoder(grow=8)`` (a compiled step's): the span starts at 8 slots and
    ``reach`` widens it (and the self-attention histories, keeping the slots they had past
    the old span) to the next multiple of 8, at most the capacity; the search over it gives
    the fixed-span search's log-probs at every step."""
    model = _model("dot", "dot", 0)
    src, _ = random_batch(batch=2, src_len=5)
    rows = 2 * beam
    order = torch.arange(rows)
    decoders = []
    for grow in (0, 8):
        memory, pad_mask, _ = model.encode(src)
        cache = model.init_cache(memory, pad_mask, group=beam, capacity=20)
        decoders.append(graphs.StaticDecoder(model, cache, rows, 20, src.device, pin=False,
                                             grow=grow))
    fixed, growing = decoders
    assert (fixed.span, growing.span) == (20, 8)
    prev = torch.full((rows, 1), 5, dtype=torch.long)
    with torch.inference_mode():
        for steps in range(1, 20):
            growing.reach(steps)
            assert growing.span == min(20, -(-steps // 8) * 8)
            want, got = fixed.decode(prev), growing.decode(prev)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if beam > 1:
                fixed.reorder(order)
                growing.reorder(order)
            history = growing.cache.members[0].layers[0].self_attention.k
            assert history.shape[2] == growing.span + 8  # within groups: shapes kept
            prev = want.argmax(-1, keepdim=True)


def test_the_cuda_graphs_option_reaches_the_search(translators, monkeypatch):
    """``decode.cuda_graphs`` (``--cuda-graphs``): the translator's search runs through the
    static decoder and translates as without it."""
    from dataclasses import replace

    translator = translators["ran-all"]
    lines = ["a b c d", "e f", "g h i j k l"]
    plain = translator.translate(lines)
    made = []

    class Noting(graphs.StaticDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("ranmt.inference.search_state.StaticDecoder", Noting)
    monkeypatch.setattr(translator, "decode_config",
                        replace(translator.decode_config, cuda_graphs=True))
    assert translator.translate(lines) == plain
    assert made
