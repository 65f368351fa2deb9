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


def test_compile_step_is_refused_with_what_it_does_not_go_with():
    with pytest.raises(ConfigError, match="choose one"):
        decode_with(DecodeConfig(), compile_step=True, cuda_graphs=True)
    with pytest.raises(ConfigError, match="shortlist"):
        decode_with(DecodeConfig(), compile_step=True, shortlist=True)
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
