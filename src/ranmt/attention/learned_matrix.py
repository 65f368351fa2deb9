"""Shared machinery of input-agnostic attention: weights from a learned N x N matrix per head.

Used by RAN (``ran.py``) and the Random Synthesizer (``synthesizer.py``). There is no query or
key projection: layer l's pre-softmax weights are ``M_l[:, :T, :S]`` (H, T, S) for a
matrix ``M_l`` (H, N, N) that does not depend on the input. Padded keys (and, in the
decoder, keys above the diagonal) get ``-inf`` before the softmax over keys; then
attention dropout, the weighted sum of projected values ``x W_v``, and the output
projection ``W_o``.

Inference ("retrieved directly without recomputation", paper 000 Sec. 2.2): when the module
is in eval mode and no gradient is recorded, the per-layer matrices come from a cache that
is recomputed only when a parameter changed (tracked by tensor version counters), and the
decoder's causal softmax is cached too. Incremental decoding keeps only the values
(``cache.v``, (B, H, t, d_h)) and reads row t of the cached, softmaxed matrix.

In training, attention dropout draws an independent mask for every sentence of the batch:
weights shared by the batch (1, H, T, S) are expanded to (B, H, T, S) before the mask is
drawn.

Kernel (``kernel``: ``model.ran.kernel``; the Synthesizer uses ``auto``): ``explicit``
computes the softmax in fp32, the dropout and the product with the values as separate
operations (the default off CUDA: on a 2-core Zen 3 level with ``sdpa`` under
``train.dropout_masks=fast``, 0.93x it with PyTorch's masks; docs/PERFORMANCE.md);
``sdpa`` gives the matrix rows with ``-inf`` at blocked keys, in the values' dtype, to
``scaled_dot_product_attention`` as its additive ``attn_mask``, with queries and keys of
zeros and scale 1 (so ``q k^T`` adds nothing): softmax, dropout and the product in one fused
kernel (on CUDA the memory-efficient kernel, which also returns the bias's gradient), no
(B, H, T, S) fp32 weights written and read back. ``auto`` = ``sdpa`` on CUDA, ``explicit``
elsewhere. Both compute the same function (tested); decoding steps never take this path.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ranmt.attention.base import (
    Attention,
    AttentionSpec,
    AttnOutput,
    append_values,
    blocked_mask,
    build_mask,
    merge_heads,
)
from ranmt.attention.base import split_heads as _split
from ranmt.attention.cache import AttentionCache
from ranmt.runtime.dropout import dropout

MatrixKernel = Literal["auto", "sdpa", "explicit"]
"""How a full pass computes softmax(M_l + mask) x W_v (module docstring)."""
KERNELS: tuple[str, ...] = typing.get_args(MatrixKernel)


def xavier_per_head_(matrix: Tensor) -> Tensor:
    """Xavier-uniform init of each (N, N) head matrix of an (H, N, N) tensor."""
    with torch.no_grad():
        for head in matrix:
            nn.init.xavier_uniform_(head)
    return matrix


def causal_softmax(matrix: Tensor) -> Tensor:
    """Row-wise softmax of the lower triangle of (H, N, N); zeros above the diagonal."""
    size = matrix.shape[-1]
    upper = torch.ones(size, size, dtype=torch.bool, device=matrix.device).triu(1)
    return torch.softmax(matrix.float().masked_fill(upper, float("-inf")), dim=-1)


class LearnedMatrixAttention(Attention):
    """Base class: subclasses provide the layer's matrix for training and for inference."""

    roles = ("encoder_self", "decoder_self")
    input_agnostic = True

    def __init__(self, spec: AttentionSpec, dropout: float, kernel: str = "auto"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"attention kernel '{kernel}' unknown; choose from {KERNELS}")
        self.kernel = kernel
        self.heads = spec.heads
        self.max_positions = spec.max_positions
        self.layer_index = spec.layer_index
        self.dropout = dropout
        self.value_proj = nn.Linear(spec.d_model, spec.d_model)
        self.out_proj = nn.Linear(spec.d_model, spec.d_model)
        for proj in (self.value_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    # ---- to implement
    def layer_matrix(self, state, rows: int) -> tuple[Tensor, object]:
        """Training path: (pre-softmax rows :rows of M_l (H, rows, N), state for next layer)."""
        raise NotImplementedError

    def inference_matrix(self) -> Tensor:
        """Cached M_l (H, N, N) for inference."""
        raise NotImplementedError

    def inference_causal_probs(self) -> Tensor:
        """Cached causal softmax of M_l (H, N, N)."""
        raise NotImplementedError

    # ---- shared forward
    def _use_cache(self) -> bool:
        return not self.training and not torch.is_grad_enabled()

    def _fused_kernel(self, values: Tensor) -> bool:
        """Whether a full pass takes ``scaled_dot_product_attention`` (``kernel``)."""
        return self.kernel == "sdpa" or (self.kernel == "auto" and values.is_cuda)

    def _check_length(self, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(f"sequence of {length} positions exceeds the learned "
                             f"{self.max_positions}x{self.max_positions} attention matrices "
                             f"(model.max_positions={self.max_positions})")

    def forward(self, query, memory, *, key_padding_mask=None, causal=False, state=None,
                cache=None, need_weights=False, masks=None) -> AttnOutput:
        values = _split(self.value_proj(memory), self.heads)  # (B, H, S, d_h)
        if cache is not None:
            return self._incremental(values, cache, need_weights)
        q_len, k_len = query.shape[1], memory.shape[1]
        self._check_length(max(q_len, k_len))
        if causal and key_padding_mask is None and self._use_cache():
            weights = self.inference_causal_probs()[:, :q_len, :k_len].to(values.dtype)[None]
            next_state = None
        else:
            if self._use_cache():
                matrix, next_state = self.inference_matrix()[:, :q_len], None
            else:
                matrix, next_state = self.layer_matrix(state, q_len)  # (H, T, N)
            fused = not need_weights and self._fused_kernel(values)
            # (1, H, T, S): the fused kernel's bias in the values' dtype, else fp32 scores
            scores = matrix[None, :, :q_len, :k_len].to(
                values.dtype if fused else torch.float32)
            allowed = build_mask(key_padding_mask, causal, q_len, k_len, 0, query.device,
                                 masks)
            if allowed is not None:
                scores = scores.masked_fill(blocked_mask(allowed, masks), float("-inf"))
            if fused:
                context = self._bias_attention(scores, values)
                return AttnOutput(self.out_proj(merge_heads(context)), None, next_state)
            weights = torch.softmax(scores, dim=-1).to(values.dtype)  # (B|1, H, T, S)
        if self.training and self.dropout > 0:
            # One dropout mask per sentence, as in any dropout: weights shared by the batch
            # (1, H, T, S) are expanded to (B, H, T, S) before the mask is drawn.
            weights = weights.expand(values.shape[0], -1, -1, -1)
        dropped = dropout(weights, self.dropout, self.training)
        context = dropped @ values  # (B, H, T, d_h)
        out_weights = weights.expand(values.shape[0], -1, -1, -1) if need_weights else None
        return AttnOutput(self.out_proj(merge_heads(context)), out_weights, next_state)

    def _bias_attention(self, bias: Tensor, values: Tensor) -> Tensor:
        """softmax(bias) values in one ``scaled_dot_product_attention`` call: bias
        (B|1, H, T, S) (the scores, -inf at blocked keys, in the values' dtype), values
        (B, H, S, d_h) -> (B, H, T, d_h). Queries and keys are zeros (d_h wide, as the fused
        kernels want q, k and v alike) and the scale 1, so the kernel's q k^T adds 0."""
        batch, heads, k_len, head_dim = values.shape
        bias = bias.expand(batch, heads, -1, -1)  # (B, H, T, S), a view where it was (1, ...)
        zero_queries = values.new_zeros(batch, heads, bias.shape[2], head_dim)
        zero_keys = values.new_zeros(batch, heads, k_len, head_dim)
        dropout_p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(zero_queries, zero_keys, values, attn_mask=bias,
                                              dropout_p=dropout_p, scale=1.0)

    def _incremental(self, values: Tensor, cache: AttentionCache,
                     need_weights: bool) -> AttnOutput:
        """One decoder step: values (B, H, 1, d_h) of position t = ``cache.step``."""
        if cache.positions is not None:
            return self._incremental_at_rows(values, cache, need_weights)
        step = cache.step
        self._check_length(step + 1)
        values = append_values(cache, values)  # (B, H, t+1, d_h): values only
        # Row t as a narrow, not an integer index: a compiled step keeps t symbolic.
        probs = self.inference_causal_probs().narrow(1, step, 1)[:, :, : step + 1]  # (H, 1, t+1)
        probs = probs.to(values.dtype)
        # (1, H, 1, t+1) @ (B, H, t+1, d_h): a broadcast matmul reads the cache in place
        # (an einsum here permuted, i.e. copied, the whole value cache every step).
        context = probs[None] @ values  # (B, H, 1, d_h)
        weights = None
        if need_weights:
            weights = probs[None].expand(values.shape[0], -1, -1, -1)
        return AttnOutput(self.out_proj(merge_heads(context)), weights, None)

    def _incremental_at_rows(self, values: Tensor, cache: AttentionCache, need_weights: bool
                             ) -> AttnOutput:
        """One step of rows at their own positions p_r (``cache.positions`` (B,), step-level
        batching): row r reads row p_r of the causal matrix; its zeros above the diagonal
        mask the slots after p_r."""
        positions = cache.positions
        self._check_length(cache.span)
        values = append_values(cache, values)  # (B, H, L, d_h), L >= span, contiguous
        slots = values.shape[2]
        probs = self.inference_causal_probs()[:, :, :slots]  # (H, N, min(L, N))
        if probs.shape[2] < slots:  # a history longer than the matrices: zeros after them
            probs = F.pad(probs, (0, slots - probs.shape[2]))
        probs = probs.index_select(1, positions)  # (H, B, L)
        probs = probs.transpose(0, 1)[:, :, None].to(values.dtype)  # (B, H, 1, L)
        context = probs @ values  # (B, H, 1, d_h)
        weights = probs[..., : cache.span] if need_weights else None  # (B, H, 1, span)
        return AttnOutput(self.out_proj(merge_heads(context)), weights, None)
