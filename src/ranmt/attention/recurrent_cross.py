"""Recurrent cross-attention: Rosendahl et al., Insights 2021 (paper 001), Sec. 3.2-3.4.

Cross-attention of one decoder layer where target step i also depends on step i-1 of the same
layer and head. With ``q_i = W_q s_i``, ``k_j = W_k h_j``, ``v_j = W_v h_j`` per head and base
energies ``e_ij = q_i . k_j / sqrt(d_k)``:

* ``concat-prev-context`` (Eq. 2): query from ``[s_i; c^n_{i-1}]``, i.e.
  ``e_ij + k_j . (U^n c^n_{i-1}) / sqrt(d_k)`` with U^n (d_k x d_k) per head;
* ``concat-prev-weight`` (Eq. 3): query from ``[s_i; alpha_{i-1,j}]``, i.e.
  ``e_ij + alpha_{i-1,j} (k_j . u^n) / sqrt(d_k)`` with a vector u^n per head;
* ``concat-prev-accum-weight`` (Eq. 4): as Eq. 3 with ``sum_{i'<i} alpha_{i',j}``;
* ``expand-kv`` (Eq. 5-8): one extra key/value pair (g_k, g_v) from the previous context:
  variant 1 ``W_k c_{i-1}, W_v c_{i-1}`` (full context, the shared matrices), 2 the same through
  separate ``W_gk, W_gv``, 3 the head's own ``c^n_{i-1}`` through separate per-head matrices,
  4 ``W_gk c^n_{i-1}`` and ``c^n_{i-1}`` untransformed;
* ``smooth-energy`` (Eq. 9): ``s_ij = lam e_ij + (1-lam)/(2k+1) sum_{|j'-j|<=k} s_{i-1,j'}``;
* ``coverage-subtract`` (Eq. 10): ``e_ij - lam/sqrt(d_k) sum_{i'<i} alpha_{i',j}``;

each followed by a softmax over the (unpadded) source positions (Eq. 1 / 11). At i = 0 there
is no previous step: previous contexts and weights are zero, and the extra key/value pair of
``expand-kv`` is masked out.

Speed: under teacher forcing all decoder states are known, so queries, keys, values and the
base energies of all target positions are computed at once; only the recurrent term runs
step by step (small element-wise or (S x d_k) operations). Eq. 9 is linear in the energies:
it is solved by a scan over i of one banded (S x S) matrix product, and the softmax is taken
once over all positions afterwards. Incremental decoding runs the same step function with the
recurrent state (previous context, weights, accumulated weights or smoothed energies) kept in
the cache, where the decoder reorders it with the beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ranmt.attention.base import AttentionSpec, AttnOutput, merge_heads, split_heads
from ranmt.attention.dot_product import DotProductAttention
from ranmt.attention.registry import register
from ranmt.runtime.dropout import dropout

ExpandKVVariant = Literal[1, 2, 3, 4]


@dataclass
class RecurrentCrossConfig:
    """Recurrent cross-attention options, config keys ``model.recurrent_cross.*`` (paper 001,
    Eq. 2-10); one section for all six variants."""

    expand_kv_variant: ExpandKVVariant = 1
    """expand-kv: which extra key/value pair, Eq. 5 (1), 6 (2), 7 (3) or 8 (4)."""
    smooth_window: int = 5
    """smooth-energy (Eq. 9): window half-width k."""
    smooth_lambda: float = 0.5
    """smooth-energy (Eq. 9): weight lambda of the current energies (1 = plain attention)."""
    coverage_lambda: float = 0.5
    """coverage-subtract (Eq. 10): lambda (0 = plain attention)."""

    def validate(self) -> None:
        if self.smooth_window < 0 or not 0.0 <= self.smooth_lambda <= 1.0:
            raise ValueError("smooth_window must be >= 0 and smooth_lambda in [0, 1]")


def _variant(name: str):
    """Register a recurrent cross-attention class under ``name`` (all share one section)."""
    return register(name, options=RecurrentCrossConfig, section="recurrent_cross")


class RecurrentCrossAttention(DotProductAttention):
    """Base class: dot-product projections plus a per-step recurrence over target positions."""

    roles = ("cross",)

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        self.grouped_memory = False  # the recurrent state is per beam row
        self.options = spec.options["recurrent_cross"]
        self.head_dim = spec.d_model // spec.heads

    # ---- the recurrence, implemented by each variant
    def initial_recurrent_state(self, batch: int, keys: Tensor, values: Tensor) -> dict:
        """Recurrent state before step 0 (all tensors batch-first)."""
        raise NotImplementedError

    def step(self, energies: Tensor, query: Tensor, keys: Tensor, values: Tensor,
             allowed: Tensor, state: dict) -> tuple[Tensor, Tensor, dict]:
        """One target step (variants whose recurrence needs the context vector).

        energies (B, H, S) base energies e_i; query (B, H, d_k); keys/values (B, H, S, d_k);
        allowed (B, 1, S) bool. Returns (weights (B, H, S), head contexts (B, H, d_k), state).
        """
        raise NotImplementedError

    # ---- shared machinery
    def _softmax(self, scores: Tensor, allowed: Tensor) -> Tensor:
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)

    def run_steps(self, energies: Tensor, queries: Tensor, keys: Tensor, values: Tensor,
                  allowed: Tensor, state: dict) -> tuple[Tensor, Tensor, dict]:
        """All target steps: energies (B, H, T, S) -> weights (B, H, T, S'),
        contexts (B, H, T, d_k), final state."""
        weights, contexts = [], []
        for i in range(energies.shape[2]):
            w, c, state = self.step(energies[:, :, i], queries[:, :, i], keys, values, allowed,
                                    state)
            weights.append(w)
            contexts.append(c)
        return torch.stack(weights, 2), torch.stack(contexts, 2), state

    def forward(self, query, memory, *, key_padding_mask=None, causal=False, state=None,
                cache=None, need_weights=False, masks=None) -> AttnOutput:
        batch = query.shape[0]
        queries = split_heads(self.q_proj(query), self.heads)  # (B, H, T, d_k)
        keys, values = self._keys_values(memory, cache)  # (B, H, S, d_k), cached once
        energies = queries @ keys.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, S)
        if key_padding_mask is None:
            allowed = torch.ones(batch, 1, keys.shape[2], dtype=torch.bool, device=query.device)
        else:
            allowed = ~key_padding_mask[:, None, :]  # (B, 1, S)
        if cache is not None:
            recurrent = cache.recurrent or self.initial_recurrent_state(batch, keys, values)
            weights, contexts, recurrent = self.run_steps(energies, queries, keys, values,
                                                          allowed, recurrent)
            cache.recurrent = dict(recurrent)
        else:
            weights, contexts, _ = self.run_steps(
                energies, queries, keys, values, allowed,
                self.initial_recurrent_state(batch, keys, values))
        output = self.out_proj(merge_heads(contexts))
        if need_weights:
            weights = weights[..., : keys.shape[2]]  # drop expand-kv's extra slot
        return AttnOutput(output, weights if need_weights else None, state)

    def _dropout(self, weights: Tensor) -> Tensor:
        return dropout(weights, self.dropout, self.training)


@_variant("concat-prev-context")
class ConcatPrevContext(RecurrentCrossAttention):
    """Eq. 2: the query sees the head's previous context vector."""

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        # U^n (H, d_k, d_k): the block of W_q' acting on c^n_{i-1}.
        self.context_query = nn.Parameter(torch.empty(spec.heads, self.head_dim, self.head_dim))
        nn.init.xavier_uniform_(self.context_query.view(-1, self.head_dim))

    def initial_recurrent_state(self, batch, keys, values):
        return {"context": keys.new_zeros(batch, self.heads, self.head_dim)}

    def step(self, energies, query, keys, values, allowed, state):
        extra_query = torch.einsum("bhd,hed->bhe", state["context"], self.context_query)
        extra = (keys @ extra_query[..., None]).squeeze(-1) / math.sqrt(self.head_dim)
        weights = self._softmax(energies + extra, allowed)  # (B, H, S)
        context = (self._dropout(weights)[:, :, None] @ values).squeeze(2)  # (B, H, d_k)
        return weights, context, {"context": context}


@_variant("concat-prev-weight")
class ConcatPrevWeight(RecurrentCrossAttention):
    """Eq. 3 (previous weight) and, with ``accumulate``, Eq. 4 (accumulated weights)."""

    accumulate = False

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        # u^n (H, d_k): the column of W_q' multiplying the scalar feature.
        self.weight_query = nn.Parameter(torch.empty(spec.heads, self.head_dim))
        nn.init.normal_(self.weight_query, std=self.head_dim ** -0.5)

    def initial_recurrent_state(self, batch, keys, values):
        return {"feature": keys.new_zeros(batch, self.heads, keys.shape[2])}

    def run_steps(self, energies, queries, keys, values, allowed, state):
        # k_j . u^n / sqrt(d_k) does not depend on i: computed once, outside the loop.
        gain = (keys @ self.weight_query[None, :, :, None]).squeeze(-1) / math.sqrt(
            self.head_dim)  # (B, H, S)
        feature, weights = state["feature"], []
        for i in range(energies.shape[2]):  # only the element-wise recurrence steps
            step_weights = self._softmax(energies[:, :, i] + feature * gain, allowed)
            feature = feature + step_weights if self.accumulate else step_weights
            weights.append(step_weights)
        weights_all = torch.stack(weights, 2)  # (B, H, T, S)
        contexts = self._dropout(weights_all) @ values  # one batched product for all steps
        return weights_all, contexts, {"feature": feature}


@_variant("concat-prev-accum-weight")
class ConcatPrevAccumWeight(ConcatPrevWeight):
    """Eq. 4: the query sees how much each source position has been attended so far."""

    accumulate = True


@_variant("expand-kv")
class ExpandKeyValue(RecurrentCrossAttention):
    """Eq. 5-8: one extra key/value pair built from the previous context.

    Returned weights cover the S source positions only; the rest of each row's mass went to
    the extra pair, so rows sum to at most 1.
    """

    normalized = False

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        self.variant = self.options.expand_kv_variant
        if self.variant not in (1, 2, 3, 4):
            raise ValueError(f"recurrent_cross.expand_kv_variant must be 1-4, not {self.variant}")
        d, dk = spec.d_model, self.head_dim
        if self.variant == 2:
            self.extra_key = nn.Linear(d, d)
            self.extra_value = nn.Linear(d, d)
        elif self.variant in (3, 4):
            self.extra_key_heads = nn.Parameter(torch.empty(spec.heads, dk, dk))
            nn.init.xavier_uniform_(self.extra_key_heads.view(-1, dk))
            if self.variant == 3:
                self.extra_value_heads = nn.Parameter(torch.empty(spec.heads, dk, dk))
                nn.init.xavier_uniform_(self.extra_value_heads.view(-1, dk))

    def initial_recurrent_state(self, batch, keys, values):
        return {"heads": keys.new_zeros(batch, self.heads, self.head_dim),  # c^n_{i-1}
                "full": keys.new_zeros(batch, self.heads * self.head_dim),  # c_{i-1} after W_o
                "started": keys.new_zeros(batch, 1, 1, dtype=torch.bool)}

    def _extra_pair(self, state: dict) -> tuple[Tensor, Tensor]:
        """(g_k, g_v), each (B, H, d_k)."""
        if self.variant == 1:  # Eq. 5
            return (split_heads(self.k_proj(state["full"])[:, None], self.heads)[:, :, 0],
                    split_heads(self.v_proj(state["full"])[:, None], self.heads)[:, :, 0])
        if self.variant == 2:  # Eq. 6
            return (split_heads(self.extra_key(state["full"])[:, None], self.heads)[:, :, 0],
                    split_heads(self.extra_value(state["full"])[:, None], self.heads)[:, :, 0])
        own = state["heads"]
        g_k = torch.einsum("bhd,hed->bhe", own, self.extra_key_heads)
        if self.variant == 3:  # Eq. 7
            return g_k, torch.einsum("bhd,hed->bhe", own, self.extra_value_heads)
        return g_k, own  # Eq. 8

    def step(self, energies, query, keys, values, allowed, state):
        g_k, g_v = self._extra_pair(state)
        extra_energy = (query * g_k).sum(-1, keepdim=True) / math.sqrt(self.head_dim)  # (B,H,1)
        scores = torch.cat([energies, extra_energy], dim=-1)  # (B, H, S+1)
        extra_allowed = torch.cat([allowed, state["started"]], dim=-1)  # (B, 1, S+1)
        weights = self._softmax(scores, extra_allowed)
        dropped = self._dropout(weights)
        context = (dropped[:, :, None, :-1] @ values).squeeze(2) + dropped[..., -1:] * g_v
        full = self.out_proj(merge_heads(context[:, :, None]))[:, 0] if self.variant in (1, 2) \
            else state["full"]
        started = torch.ones_like(state["started"])
        return weights, context, {"heads": context, "full": full, "started": started}


@_variant("smooth-energy")
class SmoothEnergy(RecurrentCrossAttention):
    """Eq. 9: energies smoothed with the previous step's (window 2k+1), solved as a linear scan."""

    def initial_recurrent_state(self, batch, keys, values):
        return {"smoothed": keys.new_zeros(batch, self.heads, keys.shape[2])}

    def _band(self, size: int, device, dtype) -> Tensor:
        """(S, S) matrix of (1 - lam) / (2k + 1) on the band |j - j'| <= k."""
        k, lam = self.options.smooth_window, self.options.smooth_lambda
        index = torch.arange(size, device=device)
        band = ((index[:, None] - index[None, :]).abs() <= k).to(dtype)
        return band * (1.0 - lam) / (2 * k + 1)

    def run_steps(self, energies, queries, keys, values, allowed, state):
        lam = self.options.smooth_lambda
        band = self._band(keys.shape[2], keys.device, keys.dtype)
        mask = allowed[:, :, None, :].to(energies.dtype)  # (B, 1, 1, S)
        scaled = lam * energies * mask  # padded keys take no part in the window sums
        smoothed, previous = [], state["smoothed"]
        for i in range(energies.shape[2]):  # linear scan: no softmax inside the loop
            previous = scaled[:, :, i] + (previous @ band) * mask[:, :, 0]
            smoothed.append(previous)
        smoothed_all = torch.stack(smoothed, 2)  # (B, H, T, S)
        weights = self._softmax(smoothed_all, allowed[:, :, None, :])
        contexts = self._dropout(weights) @ values  # (B, H, T, d_k)
        return weights, contexts, {"smoothed": previous}


@_variant("coverage-subtract")
class CoverageSubtract(RecurrentCrossAttention):
    """Eq. 10: energies reduced in proportion to the attention each position already got."""

    def initial_recurrent_state(self, batch, keys, values):
        return {"coverage": keys.new_zeros(batch, self.heads, keys.shape[2])}

    def run_steps(self, energies, queries, keys, values, allowed, state):
        scale = self.options.coverage_lambda / math.sqrt(self.head_dim)
        coverage, weights = state["coverage"], []
        for i in range(energies.shape[2]):  # only the element-wise recurrence steps
            step_weights = self._softmax(energies[:, :, i] - scale * coverage, allowed)
            coverage = coverage + step_weights
            weights.append(step_weights)
        weights_all = torch.stack(weights, 2)
        contexts = self._dropout(weights_all) @ values  # one batched product for all steps
        return weights_all, contexts, {"coverage": coverage}
