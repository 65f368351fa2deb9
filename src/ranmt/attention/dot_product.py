"""Multi-head scaled dot-product attention (Vaswani et al., 2017; paper 003), the TransF baseline.

``softmax(Q K^T / sqrt(d_h)) V`` per head with Q = x W_q, K = m W_k, V = m W_v and the
output projection W_o. The fast path uses ``torch.nn.functional.scaled_dot_product_attention``;
when weights are requested a naive path computes them explicitly (same numbers).

Incremental decoding: self-attention appends this step's key/value to ``cache.k`` /
``cache.v`` (B, H, t, d_h) (in place in a static buffer when the cache has a capacity);
cross-attention projects the memory once into the cache. In decoding the self-attention's
Q, K, V (and the cross-attention's K, V) come from one fused matrix product.
In beam search, cross-attention keeps one copy of the keys/values per *sentence* (n, H, S,
d_h) for the n * beam query rows: the beam's queries of a sentence attend to its keys as one
(beam x S) product, so the cross cache is never copied when beams are reordered.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ranmt.attention.base import (
    Attention,
    AttentionSpec,
    AttnOutput,
    PassMasks,
    VersionedCache,
    additive_mask,
    blocked_mask,
    build_mask,
    cache_append,
    memory_heads,
    merge_heads,
    rows_allowed,
    split_heads,
)
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import Arch, register
from ranmt.runtime.dropout import dropout, fast_masks_on
from ranmt.runtime.packed import inference_linear


@register("dot", archs={"transf": Arch("dot", "dot")})
class DotProductAttention(Attention):
    """Standard multi-head attention with a KV cache."""

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.heads = spec.heads
        self.dropout = spec.dropout
        self.is_cross = spec.role == "cross"
        self.grouped_memory = self.is_cross
        d = spec.d_model
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)
        # Fused projection weights for decoding (not parameters, not in the state dict), and
        # their oneDNN-packed copies (``ranmt.runtime.packed``).
        self._fused_weights: dict[str, VersionedCache] = {}
        self._packed_fused: dict[str, tuple] = {}

    def _fused(self, name: str, projections: tuple[nn.Module, ...]) -> tuple[Tensor, Tensor] | None:
        """Concatenated (weight, bias) of float ``projections`` for one fused product in
        decoding, rebuilt when a parameter changes; None when they are not plain linears
        (e.g. int8-quantized: then each is applied on its own)."""
        if not all(isinstance(p, nn.Linear) for p in projections):
            return None
        cache = self._fused_weights.setdefault(name, VersionedCache())
        params = [t for p in projections for t in (p.weight, p.bias)]
        return cache.get(params, lambda: _concatenated(projections))

    def fuse_for_quantization(self) -> None:
        """Give the decoding products their own fused linear modules (``qkv``: W_q, W_k, W_v;
        ``kv``: W_k, W_v), so that int8 quantization turns each into one int8 product.
        For inference-only copies of a model (``ranmt.inference.quantize``); never saved."""
        d = self.q_proj.in_features
        self.fused = nn.ModuleDict()
        wanted = ([("kv", (self.k_proj, self.v_proj))] if self.is_cross
                  else [("qkv", (self.q_proj, self.k_proj, self.v_proj))])
        for name, parts in wanted:
            linear = nn.Linear(d, d * len(parts))
            with torch.no_grad():
                linear.weight.copy_(torch.cat([p.weight for p in parts]))
                linear.bias.copy_(torch.cat([p.bias for p in parts]))
            self.fused[name] = linear

    def _project(self, x: Tensor, name: str, projections: tuple[nn.Module, ...]) -> list[Tensor]:
        """``[p(x) for p in projections]`` as one matrix product where possible."""
        modules = self._modules.get("fused")
        if modules is not None and name in modules:
            return list(modules[name](x).chunk(len(projections), dim=-1))
        fused = self._fused(name, projections)
        if fused is None:
            return [p(x) for p in projections]
        out = inference_linear(x, *fused, self._packed_fused, name)
        return list(out.chunk(len(projections), dim=-1))

    def _full_pass_projection(self, x: Tensor, name: str, projections: tuple[nn.Module, ...]
                              ) -> list[Tensor]:
        """``[p(x) for p in projections]`` in a full (teacher-forced) pass as one matrix
        product over the concatenated weights: one product, one weight gradient and one
        bias gradient instead of one per projection, and no sum of input gradients (each
        a kernel launch on a GPU; ``benchmarks/count_ops.py``). In training the weights are
        concatenated on every call (autograd splits the gradient back); without gradients
        the fused product of decoding is used (:meth:`_project`: cached concatenation,
        int8 products one by one)."""
        if (torch.is_grad_enabled() and all(isinstance(p, nn.Linear) for p in projections)
                and any(p.weight.requires_grad for p in projections)):
            out = F.linear(x, *_concatenated(projections))  # (..., n * d)
            return list(out.chunk(len(projections), dim=-1))
        return self._project(x, name, projections)

    def _keys_values(self, memory: Tensor, cache: AttentionCache | None
                     ) -> tuple[Tensor, Tensor]:
        """(B, H, S, d_h) keys and values, using/updating the cache (reference path)."""
        if cache is None:
            return split_heads(self.k_proj(memory), self.heads), split_heads(
                self.v_proj(memory), self.heads)
        if self.is_cross:
            if cache.k is None:
                if not cache.fast:  # the reference decoder: unfused
                    k, v = self.k_proj(memory), self.v_proj(memory)
                else:
                    k, v = self._project(memory, "kv", (self.k_proj, self.v_proj))
                cache.k, cache.v = memory_heads(k, self.heads), memory_heads(v, self.heads)
            return cache.k, cache.v
        k = cache_append(cache, "k", split_heads(self.k_proj(memory), self.heads))
        v = cache_append(cache, "v", split_heads(self.v_proj(memory), self.heads))
        return k, v

    def _incremental_self(self, query: Tensor, cache: AttentionCache
                          ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoding step of self-attention: q, k, v from one fused product; k, v appended
        to the cache. Returns q (B, H, 1, d_h) and the keys/values so far (B, H, t+1, d_h)."""
        q, k, v = self._project(query, "qkv", (self.q_proj, self.k_proj, self.v_proj))
        k = cache_append(cache, "k", split_heads(k, self.heads))
        v = cache_append(cache, "v", split_heads(v, self.heads))
        return split_heads(q, self.heads), k, v

    def forward(self, query, memory, *, key_padding_mask=None, causal=False, state=None,
                cache=None, need_weights=False, masks=None) -> AttnOutput:
        # Per-row positions (step-level batching, ``ranmt.inference.continuous``): rows at different
        # steps, each attending to its own history (base.rows_allowed).
        at_rows = cache is not None and cache.positions is not None
        fast_decoder = cache is not None and cache.fast
        fast_step = fast_decoder and not self.is_cross and query.shape[1] == 1
        if fast_step:
            q, k, v = self._incremental_self(query, cache)
        elif cache is None and query is memory:  # a full pass of self-attention
            q, k, v = (split_heads(t, self.heads) for t in self._full_pass_projection(
                query, "qkv", (self.q_proj, self.k_proj, self.v_proj)))  # (B, H, T, d_h)
        elif cache is None:  # a full pass of cross-attention
            q = split_heads(self.q_proj(query), self.heads)  # (B, H, T, d_h)
            k, v = (split_heads(t, self.heads) for t in self._full_pass_projection(
                memory, "kv", (self.k_proj, self.v_proj)))  # (B, H, S, d_h)
        else:
            q = split_heads(self.q_proj(query), self.heads)  # (B, H, T, d_h)
            k, v = self._keys_values(memory, cache)  # (B or n, H, S, d_h)
        # Decoding steps of the fast path (a cache with a capacity): a few queries per row,
        # where explicit products beat the fused kernel's per-call overhead (~6% of a step).
        few_queries = fast_decoder
        if self.is_cross and k.shape[0] != q.shape[0]:
            return self._grouped(q, k, v, key_padding_mask, need_weights, state, few_queries,
                                 masks)
        q_len, k_len = q.shape[2], k.shape[2]
        # In incremental self-attention the single query sits at the last key position,
        # so causality is automatic; in full passes the mask is built from positions.
        incremental = cache is not None and not self.is_cross
        q_offset = k_len - q_len if incremental else 0
        if incremental and at_rows:
            allowed = rows_allowed(cache, k_len)  # (B, 1, 1, S >= span)
        else:
            allowed = build_mask(key_padding_mask, causal and not incremental, q_len, k_len,
                                 q_offset, q.device, masks)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            weights = _attention_weights(q, k, allowed, masks)  # (B, H, T, S)
            context = dropout(weights, dropout_p, self.training) @ v
        elif few_queries and not self.training:
            context = _explicit_attention(q, k, v, allowed, masks)
        else:
            context = _fused_attention(q, k, v, allowed, dropout_p, masks)
        return AttnOutput(self.out_proj(merge_heads(context)), weights, state)

    def _grouped(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
                 need_weights: bool, state, few_queries: bool = False,
                 masks: PassMasks | None = None) -> AttnOutput:
        """Cross-attention of B = n * g query rows (g per sentence, one step: T = 1) against
        keys/values of the n sentences (n, H, S, d_h): the g queries of a sentence become
        the query length of one attention call."""
        rows, heads, _, head_dim = q.shape
        sentences = k.shape[0]
        group = rows // sentences
        q = q.view(sentences, group, heads, head_dim).transpose(1, 2)  # (n, H, g, d_h)
        allowed = build_mask(key_padding_mask, False, group, k.shape[2], 0, q.device,
                             masks)  # (n, 1, 1, S)
        weights = None
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (n, H, g, S)
            if allowed is not None:
                scores = scores.masked_fill(blocked_mask(allowed, masks), float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            context = weights @ v
            weights = weights.transpose(1, 2).reshape(rows, heads, 1, -1)  # (B, H, 1, S)
        elif few_queries:
            context = _explicit_attention(q, k, v, allowed, masks)
        else:
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=additive_mask(allowed, q.dtype, masks))
        context = context.transpose(1, 2).reshape(rows, 1, heads * head_dim)  # (B, 1, d)
        return AttnOutput(self.out_proj(context), weights, state)


def _concatenated(projections: tuple[nn.Module, ...]) -> tuple[Tensor, Tensor]:
    """(weight (n * d, d), bias (n * d,)) of n linears stacked: one product for all of them."""
    return (torch.cat([p.weight for p in projections]),
            torch.cat([p.bias for p in projections]))


def _fused_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
                     dropout_p: float, masks: PassMasks | None = None) -> Tensor:
    """``scaled_dot_product_attention`` (B, H, T, d_h) -> (B, H, T, d_h). bf16 training on a
    CPU runs it in fp32: PyTorch's CPU flash-attention backward is ~5x slower in bf16 than
    in fp32 at these sizes (benchmarks/profile_train.py), and the products inside are too
    small for bf16 to pay back the casts. With fast dropout masks (``ranmt.runtime.dropout``) and
    attention dropout on a CPU, the attention is computed as PyTorch's math kernel would
    (which is what ``scaled_dot_product_attention`` runs on a CPU with dropout), with the
    fast masks."""
    if dropout_p > 0.0 and q.device.type == "cpu" and fast_masks_on():
        return _attention_with_fast_dropout(q, k, v, allowed, dropout_p, masks)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and torch.is_grad_enabled():
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(),
                attn_mask=additive_mask(allowed, torch.float32, masks),
                dropout_p=dropout_p).to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=additive_mask(allowed, q.dtype, masks), dropout_p=dropout_p)


def _attention_with_fast_dropout(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
                                 dropout_p: float, masks: PassMasks | None = None) -> Tensor:
    """dropout(softmax(q k^T / sqrt(d_h))) v (B, H, T, d_h) -> (B, H, T, d_h), the softmax in
    fp32 (rows with nothing allowed give zeros, as PyTorch's kernel), the dropout through
    :func:`ranmt.runtime.dropout.dropout` (training)."""
    return dropout(_attention_weights(q, k, allowed, masks), dropout_p, True) @ v


def _attention_weights(q: Tensor, k: Tensor, allowed: Tensor | None,
                       masks: PassMasks | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d_h)) (B, H, T, S) in fp32, cast to q's dtype; keys not
    ``allowed`` get no weight, rows with none allowed are zeros."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(blocked_mask(allowed, masks), float("-inf"))
    return torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
                        masks: PassMasks | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d_h)) v with ``allowed`` (True = may attend) for a few queries:
    q (B, H, T, d_h), k/v (B, H, S, d_h) -> (B, H, T, d_h)."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if allowed is not None:
        scores = scores.masked_fill(blocked_mask(allowed, masks), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
