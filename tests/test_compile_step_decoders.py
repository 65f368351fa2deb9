"""``decode.compile_step`` for every registered decoder self- and cross-attention (issue
99: every search equals its oracle for every decoder variant), and its encoder for every
registered encoder self-attention: Dynamo traces the encoder (one graph for every batch
and source length) and the whole search step (the decoder's cache writes, the processors,
the selection) as single graphs -- ``fullgraph``, so a graph break fails -- and the
compiled searches give the eager sync-free search's hypotheses, greedy and beam with
n-best.

Dynamo's own eager backend runs the traced graphs (no inductor code generation: seconds a
decoder); inductor's kernels are checked on TransF and RAN-ALL in
``tests/test_compile_step_option.py``. CI runs the students' decoders beside TransF's (RAN-D's
learned matrices, AAN, SSRU); ``-m slow`` all."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from conftest import assert_same_hypotheses, random_batch, tiny_model
from ranmt.attention.registry import names_for
from ranmt.inference import graphs
from ranmt.inference.decode import search
from ranmt.inference.graphs import CompiledStep
from test_fast_decode import DECODERS, _model

IN_CI = {("ran", "dot"), ("aan", "dot"), ("ssru", "dot")}


def _marked(decoder: tuple[str, str]):
    marks = [pytest.mark.slow] + ([pytest.mark.ci] if decoder in IN_CI else [])
    return pytest.param(*decoder, marks=marks, id="-".join(decoder))


@pytest.mark.parametrize(("self_attention", "cross"), [_marked(d) for d in DECODERS])
def test_every_decoder_traces_its_compiled_step_as_one_graph_with_the_eager_hypotheses(
        self_attention, cross, monkeypatch):
    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(CompiledStep, "_runner", torch.compile(
        graphs._run_body, fullgraph=True, dynamic=False, backend=counter))
    monkeypatch.setattr(CompiledStep, "_encoder", torch.compile(
        graphs._encode, **CompiledStep.ENCODER_TRACE, backend=counter))
    model = _model(self_attention, cross, seed=5)
    src, _ = random_batch(batch=5, src_len=9, seed=5)
    for beam in (1, 3):
        args = dict(beam=beam, nbest=beam, lenpen=0.6, max_len_a=1.5, max_len_b=4)
        before = counter.frame_count
        assert_same_hypotheses(search(model, src, compile_step=True, **args),
                               search(model, src, sync_free=True, **args))
        assert counter.frame_count > before  # traced, not run eagerly past the compiler


@pytest.mark.parametrize("self_attention", names_for("encoder_self"))
def test_every_encoder_compiles_once_for_every_source_length_with_the_eager_output(
        self_attention, monkeypatch):
    """The compiled search encodes a batch at its own length (dynamic shapes), and pads
    the memory to the step's bucket after: one graph serves sources of 9, 6 and 13
    columns, and its output equals the eager encoder's at every real position."""
    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(CompiledStep, "_encoder", torch.compile(
        graphs._encode, **CompiledStep.ENCODER_TRACE, backend=counter))
    model = tiny_model(seed=3, **{"model.encoder.self_attention": self_attention})[0]
    with torch.inference_mode():
        for length in (9, 6, 13):
            src, _ = random_batch(batch=4, src_len=length, seed=length)
            eager, eager_mask, _ = model.encode(src)  # first: it fills the fused-weight
            memory, pad_mask, _ = CompiledStep.encode(model, src)  # caches graphs guard on
            assert torch.equal(pad_mask, eager_mask)
            real = ~pad_mask[..., None]
            torch.testing.assert_close(memory * real, eager * real, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("arch", ["ran-d", pytest.param("ran-all", marks=pytest.mark.slow),
                                  pytest.param("transf", marks=pytest.mark.slow)])
def test_a_compiled_search_finds_the_weights_derived_tensors_computed_eagerly(
        arch, monkeypatch):
    """A model's first search is compiled: what it derives from its weights (RAN's refined
    matrices and their causal softmax, fused projection weights: VersionedCache) is
    computed eagerly before Dynamo traces the search, never inside a graph (where it
    would be recomputed at every step)."""
    from ranmt.attention.base import VersionedCache

    torch._dynamo.reset()
    monkeypatch.setattr(CompiledStep, "_runner", torch.compile(
        graphs._run_body, fullgraph=True, dynamic=False, backend="eager"))
    monkeypatch.setattr(CompiledStep, "_encoder", torch.compile(
        graphs._encode, **CompiledStep.ENCODER_TRACE, backend="eager"))
    traced_empty = []
    original = VersionedCache.get

    def recording_get(self, params, compute):
        if torch.compiler.is_compiling() and self.value is None:
            traced_empty.append(compute)
        return original(self, params, compute)

    monkeypatch.setattr(VersionedCache, "get", recording_get)
    model = tiny_model(seed=4, **{"model.arch": arch})[0]
    src, _ = random_batch(batch=3, src_len=7, seed=4)
    compiled = search(model, src, compile_step=True, beam=1, max_len_a=1.5, max_len_b=4)
    assert not traced_empty
    assert_same_hypotheses(compiled, search(model, src, sync_free=True, beam=1,
                                            max_len_a=1.5, max_len_b=4))


def test_the_encoder_is_traced_once_with_the_models_floats_as_constants(monkeypatch):
    """The encoder's dynamic trace takes the model's Python floats (embedding scale, layer
    norms' eps, dropout's p) as constants: Dynamo does not make them symbolic inputs and
    then restart the whole trace to specialize them (torch >= 2.6), which cost a compiled
    search's first encode a second trace."""
    import logging

    torch._dynamo.reset()
    monkeypatch.setattr(CompiledStep, "_runner", torch.compile(
        graphs._run_body, fullgraph=True, dynamic=False, backend="eager"))
    monkeypatch.setattr(CompiledStep, "_encoder", torch.compile(  # AOT autograd's passes
        graphs._encode, **CompiledStep.ENCODER_TRACE, backend="aot_eager"))  # restart it
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    torch._logging.set_logs(dynamo=logging.INFO)
    try:
        model = tiny_model(seed=3)[0]
        src, _ = random_batch(batch=3, src_len=7, seed=3)
        search(model, src, compile_step=True, beam=1, max_len_a=1.0, max_len_b=2)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    assert any("start tracing _encode" in message for message in records)  # the log is read
    assert not [message for message in records if "Restarting analysis" in message]
