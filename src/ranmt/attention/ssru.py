"""Simpler Simple Recurrent Unit (SSRU): Kim et al., *From Research to Production and Back:
Ludicrously Fast Neural Machine Translation*, WNGT 2019.

A decoder self-attention replaced by an element-wise recurrence over the layer's inputs
``x`` (B, T, d), as in the fast CPU students of Marian and Bergamot:

* ``f_t = sigmoid(W_f x_t + b_f)``                  (forget gate)
* ``c_t = f_t * c_{t-1} + (1 - f_t) * W x_t``        (cell, ``c_{-1} = 0``)
* ``o_t = relu(c_t)``                                (output)

The layer's residual connection and layer norm are the decoder layer's, as for every
variant. ``W_f`` and ``W`` are one (2d x d) product (``W x`` has no bias).

Training (a full pass) solves the linear recurrence ``c_t = f_t c_{t-1} + u_t`` with
``u_t = (1 - f_t) W x_t`` by a parallel prefix scan over the affine maps ``c -> f c + u``
(Hillis-Steele: ceil(log2 T) rounds of element-wise products, exact, no division, so it
stays finite however small the gates get) instead of T sequential steps. Incremental
decoding keeps ``c_{t-1}`` per row (``cache.recurrent["cell"]``, (B, 1, d), float32):
constant state, no history. The recurrence runs in float32 whatever the activation dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ranmt.attention.base import Attention, AttentionSpec, AttnOutput
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import Arch, register


def linear_scan(gates: Tensor, inputs: Tensor, initial: Tensor | None = None) -> Tensor:
    """``c_t = gates_t * c_{t-1} + inputs_t`` along dim 1 of (B, T, d) tensors, from
    ``c_{-1} = initial`` (B, 1, d) or zero: every ``c_t`` (B, T, d)."""
    length = gates.shape[1]
    if length == 1:
        return inputs if initial is None else gates * initial + inputs
    products, cells = gates, inputs  # element t: the map over steps (t - offset, t]
    offset = 1
    while offset < length:
        cells = torch.cat([cells[:, :offset],
                           cells[:, offset:] + products[:, offset:] * cells[:, :-offset]], dim=1)
        products = torch.cat([products[:, :offset],
                              products[:, offset:] * products[:, :-offset]], dim=1)
        offset *= 2
    return cells if initial is None else cells + products * initial


@register("ssru", archs={"ssru-d": Arch("dot", "ssru")})
class SSRU(Attention):
    """One decoder layer's SSRU (the module docstring's three equations)."""

    roles = ("decoder_self",)
    has_weights = False

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        d = spec.d_model
        self.projection = nn.Linear(d, 2 * d, bias=False)  # [W_f; W]
        self.forget_bias = nn.Parameter(torch.zeros(d))  # b_f
        nn.init.xavier_uniform_(self.projection.weight[:d])
        nn.init.xavier_uniform_(self.projection.weight[d:])

    def forward(self, query: Tensor, memory: Tensor, *, key_padding_mask: Tensor | None = None,
                causal: bool = False, state=None, cache: AttentionCache | None = None,
                need_weights: bool = False, masks=None) -> AttnOutput:
        """query (B, T, d) -> context (B, T, d); ``memory`` is ``query`` (self-attention).
        There are no attention weights: ``need_weights`` gets None."""
        if not causal:
            raise ValueError("the SSRU is a causal (decoder) self-attention")
        gate_in, values = self.projection(query).float().chunk(2, dim=-1)  # (B, T, d) each
        forget = torch.sigmoid(gate_in + self.forget_bias.float())
        previous = None if cache is None else cache.recurrent.get("cell")
        cells = linear_scan(forget, (1 - forget) * values, previous)
        if cache is not None:
            cache.recurrent["cell"] = cells[:, -1:]
        return AttnOutput(torch.relu(cells).to(query.dtype), None, state)
