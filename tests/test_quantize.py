"""int8 dynamic quantization: every variant quantizes, decodes, and stays close to fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import random_batch, tiny_model
from ranmt.inference.decode import search
from ranmt.inference.quantize import (
    Int8Linear,
    int8_kernel,
    is_quantized,
    quantize_model,
    quantized_engine,
)

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
    # int8 weights with one scale per row: small, bounded deviations of the log-probs
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


def test_int8_linear_traced_form_is_its_formula():
    """The traced kernel (what a compiled step runs): per-row symmetric scales on both sides,
    s_w[o] = max|W[o]| / 127, s_x[r] = max|x[r]| / 127, y = s_x s_w (round(x/s_x) .
    round(W/s_w)^T) + b -- checked in float64 from the definition; the fbgemm kernel
    (eager default, one activation scale per call) stays within int8 error of it."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 20)
    layer = Int8Linear(linear)
    x = torch.randn(2, 3, 48) * torch.tensor([0.1, 1.0, 10.0])[:, None]  # rows of unequal range
    w, b = linear.weight.detach().double(), linear.bias.detach().double()
    s_w = w.abs().amax(1) / 127
    s_x = x.double().abs().amax(-1, keepdim=True) / 127
    want = (torch.round(x.double() / s_x) @ torch.round(w / s_w[:, None]).t()) * s_x * s_w + b
    with torch.no_grad(), int8_kernel("int_mm"):
        got = layer(x)
    assert got.shape == (2, 3, 20) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        eager = layer(x)
    assert (eager - linear(x)).abs().max() < 0.3
    with pytest.raises(ValueError, match="unknown int8 kernel"), int8_kernel("int4"):
        pass


def test_nothing_imports_the_deprecated_quantization_api():
    """int8 runs without ``torch.ao.quantization`` (issue 99 item 3): no module of the
    package imports from ``torch.ao``, and a quantized model holds no torch.ao layer."""
    import re
    from pathlib import Path

    import ranmt

    sources = Path(ranmt.__file__).parent.rglob("*.py")
    imports = re.compile(r"^\s*(from|import)\s+torch\.ao\b", re.MULTILINE)
    assert not [p.name for p in sources if imports.search(p.read_text())]
    model = quantize_model(tiny_model(seed=1)[0], "int8")
    assert not [type(m) for m in model.modules() if type(m).__module__.startswith("torch.ao")]
