"""Building blocks of the encoder-decoder: embeddings, positions, feed-forward, layers.

Layers receive their attention modules (composition) and never look at variant names.
Both pre-norm (default; LN before each sublayer, a final LN after the stack) and post-norm
(the original Transformer; LN after each residual addition) are supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ranmt.attention.base import Attention, PassMasks
from ranmt.attention.cache import LayerCache
from ranmt.runtime.dropout import Dropout
from ranmt.runtime.precision import activation_dtype


class SinusoidalPositions(nn.Module):
    """Fixed sin/cos position embeddings (Vaswani et al., 2017, Sec. 3.5)."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", self._table(max_positions), persistent=False)

    def _table(self, length: int) -> Tensor:
        position = torch.arange(length, dtype=torch.float32)[:, None]
        half = self.d_model // 2
        freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        angles = position * freq[None, :]  # (N, d/2)
        table = torch.zeros(length, self.d_model)
        table[:, 0::2] = torch.sin(angles)
        table[:, 1: 2 * half: 2] = torch.cos(angles)
        return table

    def forward(self, length: int, offset: int | Tensor = 0, span: int | None = None
                ) -> Tensor:
        """(length, d) embeddings of positions offset .. offset+length-1; with ``offset`` a
        (B,) tensor of positions (one query per row): (B, 1, d), ``span`` (when known) a
        bound on them (the largest + 1), which spares reading their maximum on the host."""
        if isinstance(offset, Tensor):
            end = int(offset.max()) + 1 if span is None else span
            if end > self.table.shape[0]:
                self.table = self._table(end).to(self.table.device)
            return self.table[offset][:, None]
        end = offset + length
        if end > self.table.shape[0]:
            self.table = self._table(end).to(self.table.device)
        return self.table[offset:end]


class LearnedPositions(nn.Module):
    """Trainable position embeddings for positions 0..N-1."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model ** -0.5)

    def forward(self, length: int, offset: int | Tensor = 0, span: int | None = None
                ) -> Tensor:
        """As :meth:`SinusoidalPositions.forward`."""
        if isinstance(offset, Tensor):
            end = int(offset.max()) + 1 if span is None else span
            self._check(end)
            return self.embedding.weight[offset][:, None]
        end = offset + length
        self._check(end)
        return self.embedding.weight[offset:end]

    def _check(self, end: int) -> None:
        if end > self.embedding.num_embeddings:
            raise ValueError(
                f"sequence of {end} positions exceeds learned positions "
                f"(model.max_positions={self.embedding.num_embeddings})")


def build_positions(kind: str, d_model: int, max_positions: int) -> nn.Module | None:
    if kind == "sinusoidal":
        return SinusoidalPositions(d_model, max_positions)
    if kind == "learned":
        return LearnedPositions(d_model, max_positions)
    if kind == "none":
        return None
    raise ValueError(f"unknown position embedding '{kind}' (sinusoidal | learned | none)")


class Embedder(nn.Module):
    """Token embedding * sqrt(d) + position embedding, then dropout. (B, T) -> (B, T, d)."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Module | None, dropout: float):
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.scale = math.sqrt(tokens.embedding_dim)
        self.dropout = Dropout(dropout)

    def forward(self, ids: Tensor, offset: int | Tensor = 0, span: int | None = None
                ) -> Tensor:
        """``offset``: position of the first token, or (B,) positions of one token per row
        (``span``: their largest + 1, if known)."""
        x = self.tokens(ids) * self.scale
        if self.positions is not None:
            x = x + self.positions(ids.shape[1], offset, span).to(x.dtype)
        dtype = activation_dtype()  # bf16 training on a CPU: a bf16 residual stream
        if dtype is not None:
            x = x.to(dtype)
        return self.dropout(x)


class FeedForward(nn.Module):
    """Position-wise FFN: W_2 act(W_1 x + b_1) + b_2."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str, activation_dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.activation = F.gelu if activation == "gelu" else F.relu
        self.dropout = Dropout(activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class Sublayer(nn.Module):
    """Residual wrapper with pre- or post-layer-norm around one sublayer."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def normed_input(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.pre_norm else x

    def residual(self, x: Tensor, update: Tensor) -> Tensor:
        out = x + self.dropout(update)
        return out if self.pre_norm else self.norm(out)


def _attend(sublayer: Sublayer, attention: Attention, x: Tensor, memory: Tensor | None,
            key_padding_mask: Tensor | None, causal: bool, state: Any, cache: dict | None,
            need_weights: bool, masks: PassMasks | None) -> tuple[Tensor, Any, Tensor | None]:
    """One attention sublayer with its residual: memory None means self-attention;
    ``masks``: the pass's shared masks.

    Returns (x after the sublayer, state for the next layer, weights or None).
    """
    h = sublayer.normed_input(x)
    out = attention(h, h if memory is None else memory, key_padding_mask=key_padding_mask,
                    causal=causal, state=state, cache=cache, need_weights=need_weights,
                    masks=masks)
    return sublayer.residual(x, out.context), out.state, out.weights


class EncoderLayer(nn.Module):
    """Self-attention (optional) + feed-forward (optional)."""

    def __init__(self, self_attention: Attention | None, ffn: FeedForward | None,
                 d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.self_attention = self_attention
        self.ffn = ffn
        self.attn_sub = Sublayer(d_model, dropout, pre_norm) if self_attention is not None else None
        self.ffn_sub = Sublayer(d_model, dropout, pre_norm) if ffn is not None else None

    def forward(self, x: Tensor, pad_mask: Tensor, state: Any = None,
                need_weights: bool = False, masks: PassMasks | None = None
                ) -> tuple[Tensor, Any, Tensor | None]:
        """x (B, S, d), pad_mask (B, S) -> (x, state for next layer, weights (B,H,S,S)|None);
        ``masks``: the pass's masks, shared by the layers."""
        weights = None
        if self.self_attention is not None:
            x, state, weights = _attend(self.attn_sub, self.self_attention, x, None, pad_mask,
                                        False, state, None, need_weights, masks)
        if self.ffn is not None:
            x = self.ffn_sub.residual(x, self.ffn(self.ffn_sub.normed_input(x)))
        return x, state, weights


class DecoderLayer(nn.Module):
    """Causal self-attention (optional) + cross-attention (optional) + feed-forward (optional)."""

    def __init__(self, self_attention: Attention | None, cross_attention: Attention | None,
                 ffn: FeedForward | None, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.self_attention = self_attention
        self.cross_attention = cross_attention
        self.ffn = ffn
        def sublayer(part):
            return Sublayer(d_model, dropout, pre_norm) if part is not None else None

        self.self_sub = sublayer(self_attention)
        self.cross_sub = sublayer(cross_attention)
        self.ffn_sub = sublayer(ffn)

    def forward(self, x: Tensor, memory: Tensor, src_pad_mask: Tensor, self_state: Any = None,
                cross_state: Any = None, cache: LayerCache | None = None,
                need_weights: bool = False, masks: PassMasks | None = None):
        """x (B, T, d), memory (B, S, d) -> (x, self_state, cross_state, weights dict).

        ``cache`` (incremental decoding): the layer's self- and cross-attention caches;
        ``masks``: the pass's masks, shared by the layers.
        """
        weights: dict[str, Tensor | None] = {}
        if self.self_attention is not None:
            x, self_state, weights["self"] = _attend(
                self.self_sub, self.self_attention, x, None, None, True, self_state,
                None if cache is None else cache.self_attention, need_weights, masks)
        if self.cross_attention is not None:
            x, cross_state, weights["cross"] = _attend(
                self.cross_sub, self.cross_attention, x, memory, src_pad_mask, False,
                cross_state, None if cache is None else cache.cross_attention, need_weights,
                masks)
        if self.ffn is not None:
            x = self.ffn_sub.residual(x, self.ffn(self.ffn_sub.normed_input(x)))
        return x, self_state, cross_state, weights
