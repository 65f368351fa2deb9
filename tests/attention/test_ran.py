"""RAN (paper 000 Eq. 3-4) and Syn-R: the recurrence, precomputation, ablations, parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_batch, tiny_model
from ranmt.attention.ran import RANShared, initial_matrices
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


def _with_random_biases(shared: RANShared) -> RANShared:
    with torch.no_grad():
        for name, param in shared.named_parameters():
            if name.endswith("bias") or name.startswith("norm."):
                param.normal_()
    return shared


def test_released_tanh_transition_is_rec_func_1():
    """rec_func 1 of the authors' code: A_l = A_{l-1} + tanh(A_{l-1} W^T + b) (no LN)."""
    torch.manual_seed(1)
    shared = _with_random_biases(RANShared(heads=3, size=6, layers=2,
                                           transition="released_tanh"))
    W, b = shared.transition.weight.detach(), shared.transition.bias.detach()
    current, expected = shared.initial_attention.detach(), []
    for _ in range(2):
        current = current + torch.tanh(current @ W.T + b)
        expected.append(current)
    with torch.no_grad():
        for got, want in zip(shared.matrices(), expected):
            torch.testing.assert_close(got, want)


def test_released_relu_transition_is_rec_func_2():
    """rec_func 2: A_l = A_{l-1} + relu(A_{l-1} W^T + b)."""
    torch.manual_seed(2)
    shared = _with_random_biases(RANShared(heads=2, size=5, layers=3,
                                           transition="released_relu"))
    W, b = shared.transition.weight.detach(), shared.transition.bias.detach()
    current = shared.initial_attention.detach()
    with torch.no_grad():
        for got in shared.matrices():
            current = current + (current @ W.T + b).clamp(min=0)
            torch.testing.assert_close(got, current)


def test_released_ln_ffn_transition_is_rec_func_3():
    """rec_func 3: A_l = A_{l-1} + W_2 relu(W_1 LN(A_{l-1}) + b_1) + b_2."""
    torch.manual_seed(3)
    shared = _with_random_biases(RANShared(heads=2, size=6, layers=2,
                                           transition="released_ln_ffn", released_hidden=9))
    W1, b1 = shared.transition_in.weight.detach(), shared.transition_in.bias.detach()
    W2, b2 = shared.transition_out.weight.detach(), shared.transition_out.bias.detach()
    gamma, beta = shared.norm.weight.detach(), shared.norm.bias.detach()
    current = shared.initial_attention.detach()
    with torch.no_grad():
        for got in shared.matrices():
            mean = current.mean(-1, keepdim=True)
            var = current.var(-1, unbiased=False, keepdim=True)
            normed = (current - mean) / torch.sqrt(var + 1e-5) * gamma + beta
            current = current + (normed @ W1.T + b1).clamp(min=0) @ W2.T + b2
            torch.testing.assert_close(got, current)


def test_initial_matrix_bounds():
    """xavier_whole: one xavier-uniform over (H, N, N), bound sqrt(6 / (N*N + H*N)) as in
    the authors' code (0.0094 at N = 256, H = 8); xavier_per_head: sqrt(6 / 2N) (0.108)."""
    torch.manual_seed(0)
    heads, size = 8, 256
    whole = initial_matrices(heads, size, "xavier_whole")
    per_head = initial_matrices(heads, size, "xavier_per_head")
    whole_bound = (6 / (size * size + heads * size)) ** 0.5
    head_bound = (6 / (2 * size)) ** 0.5
    assert abs(whole_bound - 0.0094) < 1e-4 and abs(head_bound - 0.1083) < 1e-4
    for matrix, bound in ((whole, whole_bound), (per_head, head_bound)):
        assert matrix.abs().max() <= bound
        assert matrix.abs().max() > 0.99 * bound  # 524k draws reach the edge
        # a uniform(-a, a) has standard deviation a / sqrt(3)
        assert abs(matrix.std().item() - bound / 3 ** 0.5) < 0.01 * bound
    with pytest.raises(ValueError, match="ran.init"):
        initial_matrices(2, 4, "normal")


def test_default_init_is_the_authors_and_config_selects_per_head():
    model, cfg = tiny_model(**{"model.arch": "ran-all"})
    m = cfg.model
    a0 = model.encoder.layers[0].self_attention.shared.initial_attention
    whole_bound = (6 / (m.max_positions ** 2 + m.heads * m.max_positions)) ** 0.5
    assert cfg.model.ran.init == "xavier_whole" and a0.abs().max() <= whole_bound
    model, _ = tiny_model(**{"model.arch": "ran-all", "model.ran.init": "xavier_per_head"})
    a0 = model.encoder.layers[0].self_attention.shared.initial_attention
    assert a0.abs().max() > 2 * whole_bound


@pytest.mark.parametrize("arch,component", [("ran-e", "encoder"), ("ran-d", "decoder"),
                                            ("syn-r", "encoder"), ("syn-r", "decoder")])
@pytest.mark.parametrize("kernel", ["explicit", "sdpa"])
def test_attention_dropout_masks_differ_across_sentences(arch, component, kernel):
    """Identical sentences in one batch must get different attention-dropout masks (the
    decoder's training path once drew one (1, H, T, S) mask for the whole batch), with
    either kernel."""
    key = "model.synthesizer.attention_dropout" if arch == "syn-r" \
        else "model.ran.attention_dropout"
    model, cfg = tiny_model(**{"model.arch": arch, key: "0.5", "model.dropout": "0.0"})
    layer = getattr(model, component).layers[0]
    attention = layer.self_attention
    attention.kernel = kernel
    attention.train()
    torch.manual_seed(0)
    x = torch.randn(1, 9, cfg.model.d_model).expand(6, -1, -1)  # 6 identical sentences
    causal = component == "decoder"
    state = attention.initial_state()
    out = attention(x, x, causal=causal, state=state).context  # (6, 9, d)
    for i in range(1, 6):
        assert not torch.allclose(out[0], out[i])
    attention.dropout = 0.0  # without dropout the identical sentences agree
    out = attention(x, x, causal=causal, state=state).context
    for i in range(1, 6):
        torch.testing.assert_close(out[0], out[i])


def _set_kernel(model, kernel: str) -> None:
    for module in model.modules():
        if hasattr(module, "kernel"):
            module.kernel = kernel


@pytest.mark.parametrize("arch", ["ran-e", "ran-d", "ran-all", "syn-r"])
def test_fused_bias_kernel_equals_explicit_softmax(arch):
    """model.ran.kernel=sdpa (the matrix + padding as one additive bias into
    scaled_dot_product_attention, queries and keys of zeros) computes the explicit path's
    function: outputs and every gradient, padded sources (row 1) and training mode."""
    results = {}
    for kernel in ("explicit", "sdpa"):
        model, _ = tiny_model(**{"model.arch": arch, "model.dropout": "0.0",
                                 "model.ran.attention_dropout": "0.0",
                                 "model.synthesizer.attention_dropout": "0.0"})
        _set_kernel(model, kernel)
        model.train()
        src, tgt = random_batch()
        logits = model(src, tgt)  # (B, T, V)
        (logits.log_softmax(-1)[..., 5] * torch.arange(1, 4.0)[:, None]).sum().backward()
        results[kernel] = (logits.detach(), {name: p.grad for name, p in
                                             model.named_parameters() if p.grad is not None})
    (explicit, explicit_grads), (fused, fused_grads) = results["explicit"], results["sdpa"]
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == explicit_grads.keys()
    for name, grad in explicit_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_kernel_option_reaches_the_layers_and_is_checked():
    model, _ = tiny_model(**{"model.arch": "ran-all", "model.ran.kernel": "sdpa"})
    kernels = {m.kernel for m in model.modules() if hasattr(m, "kernel")}
    assert kernels == {"sdpa"}
    default, _ = tiny_model(**{"model.arch": "ran-all"})
    assert {m.kernel for m in default.modules() if hasattr(m, "kernel")} == {"auto"}
    with pytest.raises(ValueError, match="model.ran.kernel"):
        tiny_model(**{"model.arch": "ran-all", "model.ran.kernel": "flash"})


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
