"""Hard-coded Gaussian attention (paper 004): exact weights, cut-off without renormalisation,
HC-ALL / SH-X wiring, conv and index implementations, -SA / -FF ablations."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.attention import AttentionSpec, build_attention
from ranmt.attention.gaussian import HardcodedConfig
from ranmt.model import count_parameters


def pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def make(role: str, implementation: str = "gaussian", gamma: float = 1.0, heads: int = 4,
         d_model: int = 16):
    spec = AttentionSpec(d_model=d_model, heads=heads, dropout=0.0, max_positions=32, role=role,
                         layer_index=0, num_layers=1,
                         options={"hardcoded": HardcodedConfig(implementation=implementation,
                                                               gamma=gamma)})
    return build_attention("gaussian", spec)


@pytest.mark.parametrize("role,offsets", [("encoder_self", (-1, 1)), ("decoder_self", (-1, 0))])
def test_self_attention_weights_equal_the_pdf(role, offsets):
    attention = make(role)
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True  # sentence 1 has 4 tokens: keys 4, 5 are beyond its border
    causal = role == "decoder_self"
    weights = attention(x, x, key_padding_mask=None if causal else pad, causal=causal,
                        need_weights=True).weights
    length = {0: 6, 1: 6 if causal else 4}
    for b in range(2):
        for h in range(4):
            centre_offset = offsets[h % 2]
            for i in range(6):
                for j in range(6):
                    allowed = j < length[b] and (not causal or j <= i)
                    expected = pdf(j - (i + centre_offset)) if allowed else 0.0
                    assert float(weights[b, h, i, j]) == pytest.approx(expected, abs=1e-6)
    # cut off at the border and not renormalised: the first row of an i-1 head loses mass
    assert float(weights[0, 0, 0].sum()) < 0.9


def test_cross_attention_centres_use_gamma():
    attention = make("cross", gamma=1.5, heads=3, d_model=18)
    query, memory = torch.randn(1, 4, 18), torch.randn(1, 9, 18)
    weights = attention(query, memory, need_weights=True).weights[0]  # (H, T, S)
    for i in range(4):
        centres = [math.floor(1.5 * i - 1), math.floor(1.5 * i), math.floor(1.5 * i + 1)]
        for h, centre in enumerate(centres):
            for j in range(9):
                assert float(weights[h, i, j]) == pytest.approx(pdf(j - centre), abs=1e-6)


def test_conv_and_index_implementations():
    x = torch.randn(1, 5, 16)
    conv = make("encoder_self", "conv")(x, x, need_weights=True).weights[0, 1]  # centre i+1
    assert conv[1].tolist() == pytest.approx([0.0, 0.242, 0.399, 0.242, 0.0])
    index = make("encoder_self", "index")(x, x, need_weights=True).weights[0, 0]  # centre i-1
    assert index.tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [0, 1, 0, 0, 0],
                              [0, 0, 1, 0, 0], [0, 0, 0, 1, 0]]


def test_sh_x_has_one_learned_head_in_the_last_layer_only():
    model, cfg = tiny_model(**{"model.arch": "sh-x"})
    layers = model.decoder.layers
    assert all(layer.cross_attention is None for layer in layers[:-1])
    assert layers[-1].cross_attention.heads == 1
    assert layers[-1].self_attention.__class__.__name__ == "GaussianAttention"


def test_hc_all_has_no_query_key_parameters():
    model, cfg = tiny_model(**{"model.arch": "hc-all"})
    counts = count_parameters(model)
    d, layers = cfg.model.d_model, cfg.model.decoder.layers
    assert counts["decoder.cross_attention"] == layers * 2 * (d * d + d)  # W_v and W_o only


@pytest.mark.parametrize("arch", ["transf-sa", "sh-x-sa", "transf-ff", "hc-sa-ff"])
def test_ablations_remove_sublayers(arch):
    model, _ = tiny_model(**{"model.arch": arch})
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    if arch.endswith("-sa"):
        assert all(layer.self_attention is None for layer in layers)
    else:
        assert all(layer.ffn is None for layer in layers)
    src, tgt = random_batch()
    assert torch.isfinite(model(src, tgt)).all()
