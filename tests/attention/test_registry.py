"""Invariants every registered attention variant must satisfy (parametrized over the registry)."""

from __future__ import annotations

import pytest
import torch

from ranmt.attention import REGISTRY, AttentionSpec, build_attention, reorder_cache
from ranmt.attention.base import build_mask
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import default_options

D, H, N = 32, 4, 16


def make(name: str, role: str, dropout: float = 0.0):
    cls = REGISTRY[name]
    options = default_options()  # every registered section
    options["hardcoded"].gamma = 1.3
    spec = AttentionSpec(d_model=D, heads=H, dropout=dropout, max_positions=N, role=role,
                         layer_index=0, num_layers=1, options=options, ffn_dim=2 * D)
    spec.shared = cls.build_shared(spec) if hasattr(cls, "build_shared") else None
    torch.manual_seed(0)
    return build_attention(name, spec).eval()


def _cases():
    for name, cls in sorted(REGISTRY.items()):
        for role in getattr(cls, "roles", ("encoder_self", "decoder_self", "cross")):
            yield pytest.param(name, role, id=f"{name}-{role}")


def cases():
    return list(_cases())


def inputs(role: str):
    torch.manual_seed(1)
    query = torch.randn(2, 5, D)
    memory = query if role != "cross" else torch.randn(2, 7, D)
    pad = torch.zeros(2, memory.shape[1], dtype=torch.bool)
    if role != "decoder_self":
        pad[1, -2:] = True
    return query, memory, pad, role == "decoder_self"


@pytest.mark.parametrize("name,role", cases())
def test_shapes_and_masked_weights_are_zero(name, role):
    attention = make(name, role)
    query, memory, pad, causal = inputs(role)
    state = attention.initial_state()
    out = attention(query, memory, key_padding_mask=pad, causal=causal, state=state,
                    need_weights=True)
    assert out.context.shape == query.shape
    weights = out.weights
    if not attention.has_weights:  # a recurrence (the SSRU): nothing attends
        assert weights is None
        return
    assert weights.shape == (2, H, query.shape[1], memory.shape[1])
    allowed = build_mask(pad, causal, query.shape[1], memory.shape[1], 0, query.device)
    allowed = allowed.expand_as(weights)
    assert bool((weights[~allowed] == 0).all())
    if getattr(attention, "normalized", True):
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))


@pytest.mark.parametrize("name,role", cases())
def test_fast_path_equals_weights_path(name, role):
    attention = make(name, role)
    query, memory, pad, causal = inputs(role)
    fast = attention(query, memory, key_padding_mask=pad, causal=causal,
                     state=attention.initial_state())
    slow = attention(query, memory, key_padding_mask=pad, causal=causal,
                     state=attention.initial_state(), need_weights=True)
    torch.testing.assert_close(fast.context, slow.context, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,role", cases())
def test_gradients_flow(name, role):
    attention = make(name, role).train()
    query, memory, pad, causal = inputs(role)
    query.requires_grad_(True)
    if role == "cross":
        memory = memory.clone().requires_grad_(True)
    out = attention(query, memory if role == "cross" else query, key_padding_mask=pad,
                    causal=causal, state=attention.initial_state())
    out.context.sum().backward()
    # The attended states always get a gradient (through the values); in cross-attention an
    # input-agnostic variant legitimately ignores the query.
    attended = memory if role == "cross" else query
    assert attended.grad is not None and bool(attended.grad.abs().sum() > 0)
    trainable = [p for p in attention.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)


@pytest.mark.parametrize("name,role", [c for c in cases() if c.values[1] != "encoder_self"])
def test_incremental_equals_full(name, role):
    attention = make(name, role)
    query, memory, pad, causal = inputs(role)
    full = attention(query, memory, key_padding_mask=pad, causal=causal,
                     state=attention.initial_state()).context
    cache = AttentionCache()
    steps = []
    for t in range(query.shape[1]):
        cache.step = t
        step_memory = memory if role == "cross" else query[:, t: t + 1]
        out = attention(query[:, t: t + 1], step_memory, key_padding_mask=pad if role == "cross"
                        else None, causal=causal, state=attention.initial_state(), cache=cache)
        steps.append(out.context)
        if t == 1:  # reordering with the identity must change nothing
            reorder_cache(cache, torch.arange(query.shape[0]))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_unknown_name_lists_registered():
    from ranmt.attention import check_name

    with pytest.raises(ValueError, match="registered"):
        check_name("no-such-attention", "cross")


def test_dot_product_matches_formula():
    attention = make("dot", "encoder_self")
    query, _, _, _ = inputs("encoder_self")
    out = attention(query, query, need_weights=True)
    q = attention.q_proj(query).view(2, 5, H, D // H).transpose(1, 2)
    k = attention.k_proj(query).view(2, 5, H, D // H).transpose(1, 2)
    expected = torch.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5, dim=-1)
    torch.testing.assert_close(out.weights, expected)
