"""RAN (paper 000 Eq. 3-4) and Syn-R: the recurrence, precomputation, ablations, parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_batch, tiny_model
from ranmt.attention.ran import RANShared
from ranmt.model import count_parameters


def test_recurrence_matches_equations_3_and_4():
    torch.manual_seed(0)
    shared = RANShared(heads=2, size=6, layers=3, transition="paper")
    with torch.no_grad():
        shared.transition.bias.normal_()
        shared.norm.weight.uniform_(0.5, 1.5)
        shared.norm.bias.normal_()
    W, b = shared.transition.weight, shared.transition.bias
    gamma, beta = shared.norm.weight, shared.norm.bias
    expected, current = [], shared.initial_attention.detach()
    for _ in range(3):
        hidden = torch.tanh(current @ W.T + b)  # linear on the key dimension (Eq. 3)
        mean = hidden.mean(-1, keepdim=True)
        var = hidden.var(-1, unbiased=False, keepdim=True)
        normed = (hidden - mean) / torch.sqrt(var + 1e-5) * gamma + beta
        current = normed + current  # residual (Eq. 4)
        expected.append(current)
    with torch.no_grad():
        for got, want in zip(shared.matrices(), expected):
            torch.testing.assert_close(got, want.detach())


def test_no_ln_res_and_released_code_transitions():
    torch.manual_seed(0)
    plain = RANShared(heads=2, size=5, layers=2, transition="no_ln_res")
    a0 = plain.initial_attention.detach()
    with torch.no_grad():
        a1 = torch.tanh(a0 @ plain.transition.weight.T + plain.transition.bias)
        torch.testing.assert_close(plain.matrices()[0], a1)
    released = RANShared(heads=2, size=5, layers=1, transition="released_code",
                         released_hidden=7)
    a0 = released.initial_attention.detach()
    with torch.no_grad():
        hidden = F.relu(released.transition_in(a0))
        torch.testing.assert_close(released.matrices()[0], a0 + released.transition_out(hidden))
    with pytest.raises(ValueError, match="transition"):
        RANShared(2, 5, 1, transition="gru")


@pytest.mark.parametrize("arch", ["ran-e", "ran-d", "ran-all", "syn-r"])
def test_precomputed_path_equals_training_path(arch):
    model, _ = tiny_model(**{"model.arch": arch})
    src, tgt = random_batch()
    with torch.enable_grad():
        training_path = model(src, tgt)  # eval mode, grad on: matrices computed layer by layer
    with torch.no_grad():
        precomputed = model(src, tgt)  # cached matrices / cached causal softmax
    torch.testing.assert_close(precomputed, training_path.detach(), atol=1e-5, rtol=1e-5)


def test_cached_matrices_follow_parameter_updates():
    model, _ = tiny_model(**{"model.arch": "ran-all"})
    shared = model.encoder.layers[0].self_attention.shared
    with torch.no_grad():
        before = shared.matrices()[0].clone()
        assert shared.matrices()[0] is shared.matrices()[0]  # cached, not recomputed
        shared.initial_attention.add_(1.0)  # what an optimizer step does (in place)
        after = shared.matrices()[0]
    assert not torch.allclose(before, after)


def test_layers_share_one_transition_and_initial_matrix():
    model, _ = tiny_model(**{"model.arch": "ran-all"})
    enc = {id(layer.self_attention.shared) for layer in model.encoder.layers}
    dec = {id(layer.self_attention.shared) for layer in model.decoder.layers}
    assert len(enc) == 1 and len(dec) == 1 and enc != dec


@pytest.mark.parametrize("key,arch", [("model.ran.fixed_initial", "ran-all"),
                                      ("model.synthesizer.fixed", "syn-r")])
def test_fixed_matrices_get_no_gradient(key, arch):
    model, _ = tiny_model(**{"model.arch": arch, key: "true"})
    model.train()
    src, tgt = random_batch()
    model(src, tgt).sum().backward()
    attention = model.encoder.layers[0].self_attention
    fixed = attention.shared.initial_attention if arch == "ran-all" else attention.matrix
    assert not fixed.requires_grad and fixed.grad is None
    assert attention.value_proj.weight.grad is not None



def test_parameter_counts_match_formulas():
    """RAN adds H N^2 + N^2 + N + 2N per stack and removes W_q, W_k (2(d^2 + d) per layer);
    Syn-R adds H N^2 per layer and removes W_q, W_k."""
    transf, cfg = tiny_model()
    m = cfg.model
    H, N, d, L = m.heads, m.max_positions, m.d_model, m.encoder.layers
    qk = 2 * (d * d + d)
    ran_stack = H * N * N + N * N + N + 2 * N
    base = count_parameters(transf)["total"]
    ran_e, _ = tiny_model(**{"model.arch": "ran-e"})
    ran_all, _ = tiny_model(**{"model.arch": "ran-all"})
    syn, _ = tiny_model(**{"model.arch": "syn-r"})
    assert count_parameters(ran_e)["total"] == base + ran_stack - L * qk
    assert count_parameters(ran_all)["total"] == base + 2 * ran_stack - 2 * L * qk
    assert count_parameters(syn)["total"] == base + 2 * L * (H * N * N) - 2 * L * qk


def test_sequence_longer_than_n_is_an_error():
    model, cfg = tiny_model(**{"model.arch": "ran-e"})
    n = cfg.model.max_positions
    src = torch.full((1, n + 1), 5)
    src[0, -1] = 3
    with pytest.raises(ValueError, match="max_positions"):
        model(src, torch.tensor([[2, 5]]))
