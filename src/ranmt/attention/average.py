"""Average Attention Network (AAN): Zhang, Xiong and Su, *Accelerating Neural
Transformer via an Average Attention Network*, ACL 2018, Sec. 3.

A decoder self-attention without queries and keys: position j attends to positions
``0..j`` with equal weights, so its "attention" is the cumulative average of the layer's
inputs ``y`` (B, T, d), followed by the paper's feed-forward layer and gating layer:

* average layer: ``g_j = FFN((1 / (j + 1)) * sum_{k <= j} y_k)`` with
  ``FFN(x) = W_2 relu(W_1 x + b_1) + b_2`` (inner size ``aan.ffn_dim``, 0 = the model's
  ``ffn_dim`` as in the paper);
* gating layer: ``i_j, f_j = sigmoid(W_g [y_j; g_j] + b_g)`` (two d-wide halves),
  ``h_j = i_j * y_j + f_j * g_j``; ``aan.gate = false`` returns ``g_j`` (Marian's
  "no gate" AAN).

The layer's residual connection and layer norm are the decoder layer's, as for every
variant. Incremental decoding keeps one running sum per row (``cache.recurrent["sum"]``,
(B, 1, d), float32): constant state per step, no history; step-level batching divides by
each row's own position + 1. Sums are taken in float32 whatever the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ranmt.attention.base import Attention, AttentionSpec, AttnOutput
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import Arch, register


@dataclass
class AANConfig:
    """Average attention options, config keys ``model.aan.*`` (Zhang et al., 2018)."""

    ffn_dim: int = 0
    """Inner size of the average layer's feed-forward network (0 = model.ffn_dim)."""
    gate: bool = True
    """The gating layer; false returns the feed-forward output alone."""

    def validate(self) -> None:
        if self.ffn_dim < 0:
            raise ValueError("aan.ffn_dim must be >= 0 (0 = model.ffn_dim)")


def _xavier(*linears: nn.Linear) -> None:
    for linear in linears:
        nn.init.xavier_uniform_(linear.weight)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


def query_positions(cache: AttentionCache | None, batch: int, length: int,
                    device: torch.device) -> Tensor:
    """Positions of the ``length`` queries of each row, (B, T, 1) float32: ``0..T-1`` in a
    full pass; from ``cache.step`` in incremental decoding, or from each row's
    ``cache.positions`` (step-level batching, the static decoder)."""
    offsets = torch.arange(length, device=device, dtype=torch.float32)
    if cache is None:
        return offsets[None, :, None].expand(batch, length, 1)
    if cache.positions is not None:
        return (cache.positions.to(torch.float32)[:, None] + offsets[None, :])[..., None]
    return (offsets + cache.step)[None, :, None].expand(batch, length, 1)


@register("aan", options=AANConfig, archs={"aan-d": Arch("dot", "aan")})
class AverageAttention(Attention):
    """One decoder layer's average attention (the module docstring's average and gating layers)."""

    roles = ("decoder_self",)

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        options = spec.options["aan"]
        d = spec.d_model
        hidden = options.ffn_dim or spec.ffn_dim or 4 * d
        self.heads = spec.heads  # the weights are returned per head, as every variant's
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.gate = nn.Linear(2 * d, 2 * d) if options.gate else None
        _xavier(self.fc1, self.fc2, *([self.gate] if self.gate is not None else []))

    def forward(self, query: Tensor, memory: Tensor, *, key_padding_mask: Tensor | None = None,
                causal: bool = False, state=None, cache: AttentionCache | None = None,
                need_weights: bool = False, masks=None) -> AttnOutput:
        """query (B, T, d) -> context (B, T, d); ``memory`` is ``query`` (self-attention)."""
        if not causal:
            raise ValueError("average attention is a causal (decoder) self-attention")
        batch, length, _ = query.shape
        sums = torch.cumsum(query, dim=1, dtype=torch.float32)  # (B, T, d)
        if cache is not None:
            previous = cache.recurrent.get("sum")
            if previous is not None:
                sums = sums + previous
            cache.recurrent["sum"] = sums[:, -1:]
        positions = query_positions(cache, batch, length, query.device)  # (B, T, 1)
        average = (sums / (positions + 1)).to(query.dtype)
        summary = self.fc2(F.relu(self.fc1(average)))  # g (B, T, d)
        if self.gate is None:
            context = summary
        else:
            input_gate, forget_gate = torch.sigmoid(
                self.gate(torch.cat([query, summary], dim=-1))).chunk(2, dim=-1)
            context = input_gate * query + forget_gate * summary
        weights = self._weights(positions, cache) if need_weights else None
        return AttnOutput(context, weights, state)

    def _weights(self, positions: Tensor, cache: AttentionCache | None) -> Tensor:
        """The equal weights (B, H, T, S) of the average: 1 / (i + 1) at keys 0..i."""
        rows = positions[..., 0]  # (B, T)
        keys = int(rows.max()) + 1 if cache is None or cache.positions is None else cache.span
        slots = torch.arange(keys, device=rows.device, dtype=torch.float32)
        allowed = slots[None, None, :] <= rows[..., None]  # (B, T, S)
        weights = allowed / (rows[..., None] + 1)  # (B, T, S)
        return weights[:, None].expand(-1, self.heads, -1, -1)
