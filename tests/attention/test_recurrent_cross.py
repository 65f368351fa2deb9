"""Recurrent cross-attention (paper 001, Eq. 2-10): the fast path against a naive step-by-step
reference written here from the equations, "off" settings equal dot-product attention, and
model-level incremental decoding / beam search invariants."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import random_batch, tiny_model
from ranmt.attention import AttentionSpec, build_attention
from ranmt.attention.cache import AttentionCache
from ranmt.attention.recurrent_cross import RecurrentCrossConfig
from ranmt.inference.decode import beam_search, greedy_search

D, H = 16, 2
DK = D // H
VARIANTS = [("concat-prev-context", {}), ("concat-prev-weight", {}),
            ("concat-prev-accum-weight", {}),
            ("expand-kv", {"expand_kv_variant": 1}), ("expand-kv", {"expand_kv_variant": 2}),
            ("expand-kv", {"expand_kv_variant": 3}), ("expand-kv", {"expand_kv_variant": 4}),
            ("smooth-energy", {"smooth_window": 1, "smooth_lambda": 0.3}),
            ("coverage-subtract", {"coverage_lambda": 0.7})]
IDS = [f"{name}{options.get('expand_kv_variant', '')}" for name, options in VARIANTS]


def make(name: str, **options):
    spec = AttentionSpec(d_model=D, heads=H, dropout=0.0, max_positions=32, role="cross",
                         layer_index=0, num_layers=1,
                         options={"recurrent_cross": RecurrentCrossConfig(**options)})
    torch.manual_seed(0)
    module = build_attention(name, spec).eval()
    with torch.no_grad():  # make every extra parameter matter
        for param in module.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return module


def inputs():
    torch.manual_seed(1)
    query, memory = torch.randn(3, 5, D), torch.randn(3, 7, D)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 6:] = True
    return query, memory, pad


def heads(x):  # (B, L, D) -> (B, H, L, DK)
    return x.view(x.shape[0], x.shape[1], H, DK).transpose(1, 2)


def naive(module, name: str, options: dict, query, memory, pad):
    """Step-by-step reference: each target step i computed from the equations alone."""
    q, k, v = heads(module.q_proj(query)), heads(module.k_proj(memory)), heads(module.v_proj(
        memory))
    batch, _, steps, _ = q.shape
    src = memory.shape[1]
    valid = ~pad  # (B, S)
    outputs = []
    prev_heads = torch.zeros(batch, H, DK)  # c^n_{i-1}
    prev_full = torch.zeros(batch, D)  # c_{i-1} (after W_o)
    prev_weights = torch.zeros(batch, H, src)
    accumulated = torch.zeros(batch, H, src)
    prev_smoothed = torch.zeros(batch, H, src)
    for i in range(steps):
        energy = torch.einsum("bhd,bhsd->bhs", q[:, :, i], k) / math.sqrt(DK)
        extra_key = extra_value = None
        if name == "concat-prev-context":  # Eq. 2: W_q'[s; c] = W_q s + U c
            u_c = torch.einsum("bhd,hed->bhe", prev_heads, module.context_query)
            energy = energy + torch.einsum("bhd,bhsd->bhs", u_c, k) / math.sqrt(DK)
        elif name in ("concat-prev-weight", "concat-prev-accum-weight"):  # Eq. 3 / 4
            feature = prev_weights if name == "concat-prev-weight" else accumulated
            key_gain = torch.einsum("bhsd,hd->bhs", k, module.weight_query) / math.sqrt(DK)
            energy = energy + feature * key_gain
        elif name == "expand-kv":
            variant = options["expand_kv_variant"]
            if variant == 1:  # Eq. 5
                extra_key, extra_value = module.k_proj(prev_full), module.v_proj(prev_full)
            elif variant == 2:  # Eq. 6
                extra_key = module.extra_key(prev_full)
                extra_value = module.extra_value(prev_full)
            else:
                extra_key = torch.einsum("bhd,hed->bhe", prev_heads, module.extra_key_heads)
                extra_value = (torch.einsum("bhd,hed->bhe", prev_heads,
                                            module.extra_value_heads) if variant == 3  # Eq. 7
                               else prev_heads)  # Eq. 8
            if variant in (1, 2):
                extra_key = extra_key.view(batch, H, DK)
                extra_value = extra_value.view(batch, H, DK)
        elif name == "smooth-energy":  # Eq. 9, window sums over real source positions only
            k_win, lam = options["smooth_window"], options["smooth_lambda"]
            smoothed = torch.zeros(batch, H, src)
            for b in range(batch):
                length = int(valid[b].sum())
                for j in range(length):
                    lo, hi = max(0, j - k_win), min(length, j + k_win + 1)
                    smoothed[b, :, j] = lam * energy[b, :, j] + (1 - lam) / (2 * k_win + 1) * \
                        prev_smoothed[b, :, lo:hi].sum(-1)
            energy = smoothed
            prev_smoothed = smoothed
        elif name == "coverage-subtract":  # Eq. 10
            energy = energy - options["coverage_lambda"] / math.sqrt(DK) * accumulated
        energy = energy.masked_fill(~valid[:, None, :], float("-inf"))
        if extra_key is not None:
            extra_energy = (q[:, :, i] * extra_key).sum(-1, keepdim=True) / math.sqrt(DK)
            if i == 0:
                extra_energy = torch.full_like(extra_energy, float("-inf"))
            weights = torch.softmax(torch.cat([energy, extra_energy], -1), -1)
            context = torch.einsum("bhs,bhsd->bhd", weights[..., :-1], v) + weights[..., -1:] * \
                extra_value
            weights = weights[..., :-1]
        else:
            weights = torch.softmax(energy, -1)
            context = torch.einsum("bhs,bhsd->bhd", weights, v)
        full = module.out_proj(context.reshape(batch, D))
        outputs.append(full)
        prev_heads, prev_full, prev_weights = context, full, weights
        accumulated = accumulated + weights
    return torch.stack(outputs, 1)


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_fast_path_equals_naive_reference(name, options):
    module = make(name, **options)
    query, memory, pad = inputs()
    with torch.no_grad():
        fast = module(query, memory, key_padding_mask=pad).context
        reference = naive(module, name, options, query, memory, pad)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_incremental_equals_teacher_forced(name, options):
    module = make(name, **options)
    query, memory, pad = inputs()
    with torch.no_grad():
        full = module(query, memory, key_padding_mask=pad).context
        cache = AttentionCache()
        steps = []
        for i in range(query.shape[1]):
            cache.step = i
            steps.append(module(query[:, i: i + 1], memory, key_padding_mask=pad,
                                cache=cache).context)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,options,zero", [
    ("smooth-energy", {"smooth_lambda": 1.0}, None),
    ("coverage-subtract", {"coverage_lambda": 0.0}, None),
    ("concat-prev-context", {}, "context_query"),
    ("concat-prev-weight", {}, "weight_query"),
    ("concat-prev-accum-weight", {}, "weight_query"),
])
def test_off_values_reproduce_dot_product_attention(name, options, zero):
    module = make(name, **options)
    if zero:
        with torch.no_grad():
            getattr(module, zero).zero_()
    dot = build_attention("dot", AttentionSpec(d_model=D, heads=H, dropout=0.0,
                                               max_positions=32, role="cross", layer_index=0,
                                               num_layers=1)).eval()
    dot.load_state_dict({k: v for k, v in module.state_dict().items()
                         if k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "out_proj")})
    query, memory, pad = inputs()
    with torch.no_grad():
        expected = dot(query, memory, key_padding_mask=pad, need_weights=True)
        got = module(query, memory, key_padding_mask=pad, need_weights=True)
    torch.testing.assert_close(got.context, expected.context, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.weights, expected.weights, atol=1e-6, rtol=1e-6)


def _model(name: str, options: dict, seed: int = 0):
    overrides = {"model.decoder.cross_attention": name}
    overrides.update({f"model.recurrent_cross.{k}": v for k, v in options.items()})
    model, _ = tiny_model(seed=seed, **overrides)
    with torch.no_grad():
        for layer in model.decoder.layers:
            for param in layer.cross_attention.parameters():
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_model_incremental_logits_equal_full_forward(name, options):
    model = _model(name, options)
    src, tgt = random_batch()
    with torch.no_grad():
        full = torch.log_softmax(model(src, tgt), -1)
        memory, pad_mask, _ = model.encode(src)
        cache = model.init_cache(memory, pad_mask)
        steps = [model.decode_step(tgt[:, t: t + 1], cache) for t in range(tgt.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_beam_one_equals_greedy_and_beams_reorder_state(name, options):
    model = _model(name, options, seed=2)
    src, _ = random_batch(batch=4, seed=2)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam1 = beam_search(model, src, beam=1, max_len_a=1.0, max_len_b=5)
    assert [g[0][0] for g in greedy] == [b[0][0] for b in beam1]
    # Beam search scores must be the model's own scores of the returned hypotheses, which
    # holds only if the recurrent state was reordered together with the beams.
    results = beam_search(model, src, beam=3, lenpen=0.0, max_len_a=1.0, max_len_b=5)
    for row, hyps in enumerate(results):
        tokens, score = hyps[0]
        tgt = torch.tensor([[2] + tokens])
        out = torch.tensor([tokens + [3]])
        with torch.no_grad():
            logprob = torch.log_softmax(model(src[row: row + 1], tgt), -1).gather(
                -1, out[..., None]).sum()
        assert score == pytest.approx(float(logprob), abs=1e-4)
