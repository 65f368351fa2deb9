"""int8 dynamic quantization: every variant quantizes, decodes, and stays close to fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import random_batch, tiny_model
from ranmt.inference.decode import search
from ranmt.inference.quantize import is_quantized, quantize_model, quantized_engine

ARCHS = ["transf", "ran-e", "ran-d", "ran-all", "hc-sa", "hc-all", "sh-x", "syn-r", "aan-d",
         "ssru-d"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_variant_quantizes_and_decodes(arch):
    model, _ = tiny_model(seed=1, **{"model.arch": arch})
    quantized = quantize_model(copy.deepcopy(model), "int8")
    assert is_quantized(quantized)
    assert not any(type(m) is nn.Linear or "PackedLinear" in type(m).__name__
                   for m in quantized.modules())  # every linear layer became int8
    src, tgt = random_batch(batch=3, seed=1)
    with torch.inference_mode():
        reference = torch.log_softmax(model(src, tgt), -1)
        approx = torch.log_softmax(quantized(src, tgt), -1)
    # int8 weights with one scale per tensor: small, bounded deviations of the log-probs
    assert (approx - reference).abs().max() < 0.25  # measured 0.09-0.13 on these models
    for beam in (1, 3):
        hyps = search(quantized, src, beam=beam, nbest=1, fixed_length=5)
        assert all(len(h[0][0]) == 5 for h in hyps)


def test_quantize_options():
    model, _ = tiny_model()
    assert quantize_model(model, "none") is model and not is_quantized(model)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(model, "int4")


def test_quantized_engine_switches_and_restores():
    before = torch.backends.quantized.engine
    other = next(e for e in torch.backends.quantized.supported_engines
                 if e not in (before, "none"))
    with pytest.raises(RuntimeError, match="inside"), quantized_engine(other):
        assert torch.backends.quantized.engine == other
        raise RuntimeError("inside")
    assert torch.backends.quantized.engine == before
    with pytest.raises(ValueError, match="no quantized engine"), \
            quantized_engine("no-such-engine"):
        pass
    assert torch.backends.quantized.engine == before
