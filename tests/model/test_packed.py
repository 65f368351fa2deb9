"""oneDNN inference linears: same numbers as F.linear, rebuilt when weights change, and
never used where gradients are needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import random_batch, tiny_model
from ranmt.runtime import packed
from ranmt.runtime.packed import PackedLinear, plain_linears, use_packed_linears

needs_onednn = pytest.mark.skipif(not packed.available(), reason="no oneDNN in this build")


@needs_onednn
def test_packed_linear_matches_f_linear_and_follows_weight_updates():
    torch.manual_seed(0)
    layer = use_packed_linears(nn.Sequential(nn.Linear(16, 24)))[0]
    assert type(layer) is PackedLinear
    layer.eval()
    x = torch.randn(5, 3, 16)
    with torch.inference_mode():
        out = layer(x)
    assert "weight" in layer._packed  # the packed path ran
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: the version counter moves, the pack is rebuilt
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)


def test_training_and_grad_mode_use_f_linear():
    torch.manual_seed(0)
    layer = use_packed_linears(nn.Sequential(nn.Linear(8, 4)))[0]
    x = torch.randn(2, 8)
    layer.train()
    layer(x).sum().backward()
    assert layer.weight.grad is not None
    layer.eval()
    out = layer(x)  # grad enabled: exact F.linear, differentiable
    assert out.requires_grad and torch.equal(out, F.linear(x, layer.weight, layer.bias))
    assert "weight" not in layer.__dict__.get("_packed", {})


@needs_onednn
@pytest.mark.parametrize("arch", ["transf", "ran-all"])
def test_model_inference_same_with_and_without_onednn(arch):
    model, _ = tiny_model(seed=1, **{"model.arch": arch})
    src, tgt = random_batch(batch=3, seed=1)
    with torch.inference_mode():
        fast = model(src, tgt)
        previous = packed.set_enabled(False)
        try:
            plain = model(src, tgt)
        finally:
            packed.set_enabled(previous)
    torch.testing.assert_close(fast, plain, atol=1e-4, rtol=1e-4)
    used = [m for m in model.modules() if isinstance(m, PackedLinear) and m.__dict__.get("_packed")]
    assert used  # the fast run really went through oneDNN


def test_plain_linears_restores_nn_linear():
    model, _ = tiny_model()
    assert any(type(m) is PackedLinear for m in model.modules())
    plain_linears(model)
    assert not any(type(m) is PackedLinear for m in model.modules())
    assert any(type(m) is nn.Linear for m in model.modules())
