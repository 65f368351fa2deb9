"""``decode.compile_step`` (issue 99 item 2): the sync-free search's whole step through
torch.compile (inductor). Compiled = eager: the same hypotheses as the sync-free search for
greedy and beam search, scores equal but for float rounding (inductor fuses and reorders
sums); a second search of the same batch shape bucket (source length and cache capacity
rounded up to a multiple of 8) compiles nothing new; the pairs it does not go with are
refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from conftest import tiny_model
from ranmt.config import ConfigError, DecodeConfig, decode_with
from ranmt.inference.decode import search
from ranmt.model import EOS_ID

VOCAB = 40


BACKENDS = [pytest.param("inductor"), pytest.param("aot_eager", marks=pytest.mark.ci)]
"""The search-logic tests below (a span per graph, smaller buckets, the shape limit, the
translator's shortlist) run in CI through ``aot_eager``: Dynamo's graphs, guards,
recompile limit and AOT's functionalized step are the ones inductor compiles, without
inductor's C++ kernels (a cold kernel cache compiles each with gcc: 36-78 s a test on a
2-core Zen 3). Inductor's
own output (its fused numerics, freezing) is checked in CI by the parity, int8, two-models
and int8 shortlist tests; the inductor parametrizations here run under ``-m slow``."""


def _use_backend(monkeypatch, backend: str) -> None:
    """``CompiledStep``'s step and encoder compiled through ``backend`` in this test (made
    anew; the process's own are put back afterwards); inductor's ``options`` (freezing) only
    where the backend is inductor."""
    from ranmt.inference.graphs import CompiledStep

    compile_with = torch.compile
    monkeypatch.setattr(CompiledStep, "_runner", None)
    monkeypatch.setattr(CompiledStep, "_encoder", None)
    if backend == "inductor":
        return
    monkeypatch.setattr(torch, "compile", lambda function, options=None, **settings:
                        compile_with(function, backend=backend, **settings))


def _sources(seed: int, batch: int = 5, length: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (batch, length), generator=generator)
    src[:, -1] = EOS_ID
    return src


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("arch, beam", [("transf", 1), ("ran-all", 3)])
def test_the_compiled_step_gives_the_eager_hypotheses_and_compiles_once_per_shape(arch, beam):
    torch._dynamo.reset()
    model, _ = tiny_model(seed=3, **{"model.arch": arch})
    options = {"beam": beam, "nbest": beam, "max_len_a": 1.0, "max_len_b": 3}
    for seed in (0, 1):  # two batches of one bucket (7 and 6 source tokens, capacities 10
        src = _sources(seed, length=7 - seed)  # and 9 -> 8 and 16): the second compiles nothing
        eager = search(model, src, sync_free=True, **options)
        compiled = search(model, src, compile_step=True, **options)
        assert [[tokens for tokens, _ in hyps] for hyps in compiled] == \
            [[tokens for tokens, _ in hyps] for hyps in eager]
        for got, want in zip(compiled, eager):
            assert [score for _, score in got] == pytest.approx(
                [score for _, score in want], abs=1e-5)
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 1
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beam", [1, 2])
def test_a_long_compiled_search_widens_its_span_in_a_graph_per_span(beam, backend,
                                                                     monkeypatch):
    """40 steps (capacity 48): the span widens 16 -> 32 -> 48 between steps, outside the
    graphs, and the compiled search gives the eager one's hypotheses in one graph per span
    plus the first step's (whose histories are new) and the encoder's; a second search
    compiles nothing."""
    from ranmt.inference.graphs import CompiledStep

    assert CompiledStep.GROW == 16
    torch._dynamo.reset()
    _use_backend(monkeypatch, backend)
    model, _ = tiny_model(seed=3)
    options = {"beam": beam, "nbest": beam, "fixed_length": 40}
    src = _sources(0, batch=3)
    eager = search(model, src, sync_free=True, **options)
    before = counters["stats"]["unique_graphs"]
    compiled = search(model, src, compile_step=True, **options)
    assert [[t for t, _ in h] for h in compiled] == [[t for t, _ in h] for h in eager]
    assert counters["stats"]["unique_graphs"] - before == 1 + 1 + 3
    search(model, _sources(1, batch=3), compile_step=True, **options)
    assert counters["stats"]["unique_graphs"] - before == 1 + 1 + 3


def _eight_sources() -> torch.Tensor:
    """Eight sources of 1 to 8 tokens (and EOS), padded to 9."""
    src = torch.zeros(8, 9, dtype=torch.long)
    for row, length in enumerate((5, 1, 8, 3, 7, 2, 6, 4)):
        src[row, :length] = _sources(row, batch=1, length=length + 1)[0, 1:]
        src[row, length] = EOS_ID
    return src


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beam, rows_kept", [(1, [2, 1]), (2, [4, 2])])
def test_a_compiled_search_moves_its_sentences_into_smaller_buckets_as_they_end(
        beam, rows_kept, backend, monkeypatch):
    """Eight sources of 1 to 8 tokens, each stopped by its own limit (its length + 2): as
    sentences end the compiled search keeps 2, then 1 sentence (8 / ROWS_SHRINK 4, rounded
    up, once no more than that are decoding; the decoding ones first; a beam search's rows
    of a sentence together) and still gives the eager sync-free search's n-best lists and
    scores, every sentence's in its place."""
    from ranmt.inference import graphs

    assert graphs.CompiledStep.ROWS_SHRINK == 4
    torch._dynamo.reset()
    _use_backend(monkeypatch, backend)
    model, _ = tiny_model(seed=3)
    src = _eight_sources()
    options = {"beam": beam, "nbest": beam, "max_len_a": 1.0, "max_len_b": 2}
    kept = []
    select = graphs.StaticDecoder.select
    monkeypatch.setattr(graphs.StaticDecoder, "select",
                        lambda self, order: kept.append(len(order)) or select(self, order))
    eager = search(model, src, sync_free=True, **options)
    compiled = search(model, src, compile_step=True, **options)
    assert [[t for t, _ in h] for h in compiled] == [[t for t, _ in h] for h in eager]
    for got, want in zip(compiled, eager):
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)
    if beam == 1:
        assert sorted({len(h[0][0]) for h in eager}) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert kept == rows_kept


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_past_its_limit_of_shapes_a_process_decodes_new_shapes_eagerly(backend, monkeypatch):
    """Dynamo refuses a new graph past the recompile limit (with ``fullgraph``, an error):
    past ``CompiledStep.SHAPES`` a new batch shape decodes eagerly, warned once, with the
    same hypotheses, instead of failing the request; Dynamo's own limit warning is logged
    once, not again at every step of every new shape."""
    import logging

    from ranmt.inference import graphs

    torch._dynamo.reset()
    _use_backend(monkeypatch, backend)
    monkeypatch.setattr(graphs.CompiledStep, "SHAPES", 2)
    monkeypatch.setattr(graphs.CompiledStep, "_warned", False)
    model, _ = tiny_model(seed=3)
    options = {"beam": 1, "max_len_a": 1.0, "max_len_b": 3}
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        with pytest.warns(RuntimeWarning, match="decode eagerly"):
            for rows in (1, 2, 3, 4, 5):
                src = _sources(rows, batch=rows)
                got = search(model, src, compile_step=True, **options)
                want = search(model, src, sync_free=True, **options)
                assert [h[0][0] for h in got] == [h[0][0] for h in want]
    finally:
        logger.removeHandler(handler)
    assert sum("recompile_limit" in message for message in records) == 1


def test_compile_step_is_refused_with_what_it_does_not_go_with():
    with pytest.raises(ConfigError, match="choose one"):
        decode_with(DecodeConfig(), compile_step=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match="sampling"):
        decode_with(DecodeConfig(), compile_step=True, sampling="topk")
    model, _ = tiny_model()
    with pytest.raises(ValueError, match="shrinking search"):
        search(model, _sources(0), compile_step=True, sync_free=False)


@pytest.mark.slow
@pytest.mark.ci
def test_int8_decodes_compiled_as_it_decodes_eagerly(runs):
    """int8 under compile_step: the int8 layers trace as plain tensor operations around
    ``torch._int_mm`` (per-row activation scales), so the compiled step gives the eager
    int8 sync-free search's hypotheses when eager runs the same kernel (by default eager
    layers, the encoder's among them, run fbgemm's)."""
    from ranmt.data.batching import pad_sources
    from ranmt.inference.quantize import int8_kernel
    from ranmt.inference.translator import Translator

    torch._dynamo.reset()
    eager = Translator.load(runs["transf"], device="cpu", quantize="int8", beam=2)
    compiled = Translator.load(runs["transf"], device="cpu", quantize="int8", beam=2,
                               compile_step=True)
    src = pad_sources(eager.src_vocab.encode(["a b c d", "e f g h i", "j k l"]))
    with int8_kernel("int_mm"):  # the encoder, eager in both, on the same kernel too
        want = search(eager.model, src, eager.config.decode, sync_free=True)
        got = compiled._decode_batch(src, None, compiled.config.decode, 0)
    assert [[t for t, _ in h] for h in got] == [[t for t, _ in h] for h in want]
    for hyps, reference in zip(got, want):
        assert [s for _, s in hyps] == pytest.approx([s for _, s in reference], abs=1e-4)


@pytest.mark.slow
@pytest.mark.ci
def test_two_models_of_one_shape_each_decode_with_their_own_weights():
    """The compiled step folds the weights into the graph (freezing): a second model of the
    same architecture and batch shape in the same process must not run the first's."""
    torch._dynamo.reset()
    src = _sources(0)
    outputs = []
    for seed in (3, 4):
        model, _ = tiny_model(seed=seed)
        eager = search(model, src, beam=1, sync_free=True, max_len_a=1.0, max_len_b=3)
        compiled = search(model, src, beam=1, compile_step=True, max_len_a=1.0, max_len_b=3)
        assert [h[0][0] for h in compiled] == [h[0][0] for h in eager]
        outputs.append([h[0][0] for h in eager])
    assert outputs[0] != outputs[1]  # the two models differ, so the check above can fail


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", pytest.param("int8", marks=pytest.mark.ci)])
def test_a_compiled_shortlist_decodes_as_the_eager_one_in_one_graph_per_bucket(precision):
    """The shortlist inside the compiled step: the batch's vocabulary padded to its bucket
    (padding rows -inf), the restricted layer's rows graph inputs -- the eager shortlisted
    search's hypotheses, and a second batch with another vocabulary of the bucket compiles
    nothing. CI runs int8 (the deployed students' precision); fp32 under ``-m slow`` (37 s
    of CI's cold-cache run on a 2-core Zen 3), as the translator's shortlist through
    inductor (the next test)."""
    from ranmt.inference.quantize import int8_kernel, quantize_model
    from ranmt.inference.shortlist import RestrictedOutput, bucketed_vocabulary, vocabulary_bucket

    assert [vocabulary_bucket(n) for n in (1, 64, 65, 96, 97, 129, 200, 3000)] == \
        [64, 64, 96, 96, 128, 192, 256, 3072]
    torch._dynamo.reset()
    model, _ = tiny_model(seed=5)
    model.eval()
    if precision == "int8":
        model = quantize_model(model, "int8")
    options = {"beam": 2, "nbest": 1, "max_len_a": 1.0, "max_len_b": 3}
    generator = torch.Generator().manual_seed(0)
    for size in (21, 26):  # two vocabularies of one bucket (min(64, V = 40))
        others = torch.randperm(VOCAB - 4, generator=generator)[: size - 4] + 4
        vocabulary = torch.cat([torch.arange(4), others.sort().values])
        padded, blocked = bucketed_vocabulary(vocabulary, VOCAB)
        assert len(padded) == VOCAB and blocked == VOCAB - size
        src = _sources(size)
        with int8_kernel("int_mm"):  # eager on the compiled step's int8 kernel
            eager = search(RestrictedOutput(model, vocabulary), src, sync_free=True, **options)
            compiled = search(RestrictedOutput(model, padded, blocked), src,
                              compile_step=True, **options)
        assert [[t for t, _ in h] for h in compiled] == [[t for t, _ in h] for h in eager]
        assert all(t < size for h in compiled for tokens, _ in h for t in tokens)
        for got, want in zip(compiled, eager):
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-4)
        if size == 21:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_translator_decodes_a_compiled_shortlist_as_the_eager_one(
        backend, reverse_run, reverse_data, tmp_path, monkeypatch):
    """``--compile-step --shortlist`` through the translator (the batch's vocabulary
    bucketed there) on a trained model: the eager shortlisted translator's outputs. CI
    runs the translator's side through aot_eager (inductor's shortlisted step: the int8
    parametrization above; 78 s of CI's cold-cache run with inductor, 2-core Zen 3)."""
    import shutil

    from ranmt.cli import main
    from ranmt.data.corpus import raw_text
    from ranmt.inference.translator import Translator

    run = tmp_path / "shortlisted"
    shutil.copytree(reverse_run, run, symlinks=True)
    main(["shortlist", "--data", str(reverse_data), "--out", str(run), "--k", "6",
          "--frequent", "4"])
    torch._dynamo.reset()
    _use_backend(monkeypatch, backend)
    eager = Translator.load(run, device="cpu", beam=2, shortlist=True)
    compiled = Translator.load(run, device="cpu", beam=2, shortlist=True, compile_step=True)
    sources = eager.encode_sources(raw_text(reverse_data, "test", "src")[:6])
    want, got = eager.translate_ids(sources), compiled.translate_ids(sources)
    assert [h[0][0] for h in got] == [h[0][0] for h in want]
    assert len({t for h in want for t in h[0][0]}) > 5  # real outputs, not one token
