"""The cheap decoder self-attentions: AAN (Zhang et al., 2018) and the SSRU (Kim et al., 2019)
against their formulas written out step by step; the registry-wide tests (incremental =
full forward, fast = reference search, step-level = per-request) cover them as variants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_batch, tiny_model
from ranmt.attention import AttentionSpec, build_attention
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import default_options
from ranmt.attention.ssru import linear_scan


def _spec(**options) -> AttentionSpec:
    sections = default_options()
    for key, value in options.items():
        setattr(sections["aan"], key, value)
    return AttentionSpec(d_model=16, heads=2, dropout=0.0, max_positions=32,
                         role="decoder_self", layer_index=0, num_layers=1, options=sections,
                         ffn_dim=24)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 13])
@pytest.mark.parametrize("with_initial", [False, True])
def test_linear_scan_equals_the_recurrence_step_by_step(length, with_initial):
    gen = torch.Generator().manual_seed(length)
    gates = torch.rand(3, length, 5, generator=gen)
    inputs = torch.randn(3, length, 5, generator=gen)
    initial = torch.randn(3, 1, 5, generator=gen) if with_initial else None
    cell = torch.zeros(3, 5) if initial is None else initial[:, 0]
    expected = []
    for t in range(length):
        cell = gates[:, t] * cell + inputs[:, t]
        expected.append(cell)
    torch.testing.assert_close(linear_scan(gates, inputs, initial), torch.stack(expected, 1))


def test_linear_scan_stays_finite_with_vanishing_gates():
    gates = torch.full((1, 64, 2), 1e-30)
    inputs = torch.ones(1, 64, 2)
    cells = linear_scan(gates, inputs, torch.full((1, 1, 2), 1e30))
    assert torch.isfinite(cells).all()
    torch.testing.assert_close(cells[:, 1:], inputs[:, 1:])


@pytest.mark.parametrize("gate", [True, False])
def test_aan_equals_its_formula(gate):
    torch.manual_seed(0)
    module = build_attention("aan", _spec(gate=gate)).eval()
    assert module.fc1.out_features == 24  # aan.ffn_dim 0: the model's ffn_dim
    y = torch.randn(2, 5, 16)
    rows = []
    for j in range(5):
        average = y[:, : j + 1].mean(dim=1)
        g = module.fc2(F.relu(module.fc1(average)))
        if gate:
            i, f = torch.sigmoid(module.gate(torch.cat([y[:, j], g], -1))).chunk(2, -1)
            g = i * y[:, j] + f * g
        rows.append(g)
    out = module(y, y, causal=True, need_weights=True)
    torch.testing.assert_close(out.context, torch.stack(rows, 1))
    expected = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6)[:, None]
    torch.testing.assert_close(out.weights, expected.expand(2, 2, 5, 5))  # per head


def test_ssru_equals_its_formula():
    torch.manual_seed(0)
    module = build_attention("ssru", _spec()).eval()
    with torch.no_grad():
        module.forget_bias.normal_()
    d = 16
    w_f, w = module.projection.weight[:d], module.projection.weight[d:]
    x = torch.randn(2, 6, d)
    cell, rows = torch.zeros(2, d), []
    for t in range(6):
        forget = torch.sigmoid(x[:, t] @ w_f.T + module.forget_bias)
        cell = forget * cell + (1 - forget) * (x[:, t] @ w.T)
        rows.append(torch.relu(cell))
    torch.testing.assert_close(module(x, x, causal=True).context, torch.stack(rows, 1))


@pytest.mark.parametrize("name", ["aan", "ssru"])
def test_step_level_positions_give_each_row_its_own_step(name):
    """Rows at different positions (step-level batching) step as each would alone."""
    torch.manual_seed(0)
    module = build_attention(name, _spec()).eval()
    x = torch.randn(2, 4, 16)
    full = module(x, x, causal=True).context  # (2, 4, d)
    # Row 0 is at position 3 and row 1 at position 1: feed each its own history first.
    alone = [AttentionCache(), AttentionCache()]
    for row, steps in ((0, 3), (1, 1)):
        for t in range(steps):
            alone[row].step = t
            module(x[row: row + 1, t: t + 1], None, causal=True, cache=alone[row])
    together = AttentionCache(positions=torch.tensor([3, 1]), span=4)
    together.recurrent = {key: torch.cat([alone[0].recurrent[key], alone[1].recurrent[key]])
                          for key in alone[0].recurrent}
    step = torch.stack([x[0, 3], x[1, 1]])[:, None]
    out = module(step, step, causal=True, cache=together).context
    torch.testing.assert_close(out[:, 0], torch.stack([full[0, 3], full[1, 1]]))


@pytest.mark.parametrize("arch", ["aan-d", "ssru-d"])
def test_student_preset_builds_the_deployed_shape(arch):
    model, cfg = tiny_model(**{"model.preset": "student", "model.arch": arch})
    assert (cfg.model.encoder.layers, cfg.model.decoder.layers) == (6, 2)
    assert (cfg.model.d_model, cfg.model.ffn_dim, cfg.model.heads) == (256, 1536, 8)
    src, tgt = random_batch()
    assert model(src, tgt).shape == (3, tgt.shape[1], cfg.model.tgt_vocab_size)
