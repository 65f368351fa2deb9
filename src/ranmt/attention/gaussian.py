"""Hard-coded Gaussian attention: You et al., ACL 2020 (paper 004), Sec. 3 and 6.3, Eq. 2.

No W_q / W_k: head h of query position i puts weight ``phi((j - f_h(i)) / sigma) / sigma`` on
key j (phi the standard normal pdf, sigma = 1), cut off at the sentence borders and
**not renormalised** (footnote 5); padded and future keys get exactly 0. The weighted sum
of values ``x W_v`` goes through the output projection ``W_o``.

Head centres f_h(i) cycle over the heads:

* encoder self-attention (HC-SA): i - 1, i + 1;
* decoder self-attention (HC-SA): i - 1, i;
* cross-attention (HC-ALL, Sec. 3.2): floor(gamma i - 1), floor(gamma i), floor(gamma i + 1),
  gamma = mean source length / mean target length of the training data (``meta.json``).

Implementations (Table 5, ``hardcoded.implementation``): ``gaussian`` (the full, cut-off
pdf), ``conv`` (a window of 3 around the centre with kernel [0.242, 0.399, 0.242]) and
``index`` (weight 1 on the centre key only: each head copies one neighbour's value).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ranmt.attention.base import (
    Attention,
    AttentionSpec,
    AttnOutput,
    PassMasks,
    append_values,
    build_mask,
    memory_heads,
    merge_heads,
    padding_key,
    split_heads,
)
from ranmt.attention.cache import AttentionCache
from ranmt.attention.registry import Arch, register

HardcodedImplementation = Literal["gaussian", "conv", "index"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(HardcodedImplementation)
CONV_KERNEL = (0.242, 0.399, 0.242)


@dataclass
class HardcodedConfig:
    """Hard-coded Gaussian attention options, config keys ``model.hardcoded.*`` (paper 004)."""

    sigma: float = 1.0
    """Standard deviation of the Gaussians."""
    implementation: HardcodedImplementation = "gaussian"
    """gaussian (cut-off pdf) | conv (window 3, kernel [0.242, 0.399, 0.242]) | index."""
    gamma: float = 0.0
    """Source/target length ratio for hard-coded cross-attention (0 = take it from the data)."""

    def fill_from_data(self, meta: dict[str, Any]) -> None:
        """gamma from the prepared data (``meta.json``) unless it was given."""
        if self.gamma <= 0:
            self.gamma = float(meta.get("gamma", 1.0))


def head_centres(role: str, heads: int, positions: Tensor, gamma: float) -> Tensor:
    """(H, T) float centres f_h(i) of query positions ``positions`` (T,)."""
    i = positions.float()
    if role == "encoder_self":
        options = [i - 1, i + 1]
    elif role == "decoder_self":
        options = [i - 1, i]
    else:
        options = [torch.floor(gamma * i - 1), torch.floor(gamma * i), torch.floor(gamma * i + 1)]
    return torch.stack([options[h % len(options)] for h in range(heads)])


def hard_coded_weights(centres: Tensor, key_len: int, sigma: float, implementation: str
                       ) -> Tensor:
    """(H, T, S) unmasked weights of keys 0..S-1 for centres (H, T)."""
    keys = torch.arange(key_len, device=centres.device, dtype=torch.float32)
    distance = keys[None, None, :] - centres[:, :, None]  # (H, T, S)
    if implementation == "gaussian":
        return torch.exp(-0.5 * (distance / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    if implementation == "conv":
        weights = torch.zeros_like(distance)
        for offset, value in zip((-1, 0, 1), CONV_KERNEL):
            weights = torch.where(distance == offset, torch.full_like(distance, value), weights)
        return weights
    if implementation == "index":
        return (distance == 0).float()
    raise ValueError(f"hardcoded.implementation '{implementation}' unknown; "
                     f"choose from {IMPLEMENTATIONS}")


@register("gaussian", options=HardcodedConfig, section="hardcoded",
          archs={"hc-sa": Arch("gaussian", "gaussian"),
                 "hc-all": Arch("gaussian", "gaussian", "gaussian"),
                 "sh-x": Arch("gaussian", "gaussian", "dot", "last", 1)})
class GaussianAttention(Attention):
    """Hard-coded attention for any component (self- or cross-attention)."""

    normalized = False  # rows deliberately do not sum to 1 (cut off, not renormalised)
    input_agnostic = True

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        options = spec.options["hardcoded"]
        if options.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"hardcoded.implementation '{options.implementation}' unknown; "
                             f"choose from {IMPLEMENTATIONS}")
        self.role = spec.role
        self.heads = spec.heads
        self.sigma = options.sigma
        self.implementation = options.implementation
        self.gamma = options.gamma if options.gamma > 0 else 1.0  # 0: not set from data
        self.value_proj = nn.Linear(spec.d_model, spec.d_model)
        self.out_proj = nn.Linear(spec.d_model, spec.d_model)
        for proj in (self.value_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def weights_for(self, q_offset: int | Tensor, q_len: int, k_len: int,
                    key_padding_mask: Tensor | None, causal: bool, device,
                    masks: PassMasks | None = None) -> Tensor:
        """(B|1, H, T, S) weights with masked keys at exactly 0. ``q_offset`` a (B,) tensor:
        one query per row at its own position (step-level batching)."""
        if isinstance(q_offset, Tensor):
            return self._weights_at_rows(q_offset, k_len, key_padding_mask, causal)
        if masks is None:
            return self._weights(q_offset, q_len, k_len, key_padding_mask, causal, device)
        # the same for every layer of a role: built once per forward pass (base.PassMasks)
        key = ("gaussian", self.role, self.heads, self.sigma, self.implementation, self.gamma,
               q_offset, q_len, k_len, padding_key(key_padding_mask), causal, device)
        return masks.get(key, lambda: self._weights(
            q_offset, q_len, k_len, key_padding_mask, causal, device, masks))

    def _weights(self, q_offset: int, q_len: int, k_len: int, key_padding_mask: Tensor | None,
                 causal: bool, device, masks: PassMasks | None = None) -> Tensor:
        """(B|1, H, T, S) weights of queries q_offset .. q_offset + q_len - 1."""
        positions = torch.arange(q_offset, q_offset + q_len, device=device)
        centres = head_centres(self.role, self.heads, positions, self.gamma)
        weights = hard_coded_weights(centres, k_len, self.sigma, self.implementation)[None]
        allowed = build_mask(key_padding_mask, causal, q_len, k_len, q_offset, device, masks)
        if allowed is not None:
            weights = weights * allowed
        return weights

    def _weights_at_rows(self, positions: Tensor, k_len: int, key_padding_mask: Tensor | None,
                         causal: bool) -> Tensor:
        """(B, H, 1, S) weights of one query per row at ``positions`` (B,)."""
        centres = head_centres(self.role, self.heads, positions, self.gamma)  # (H, B)
        weights = hard_coded_weights(centres, k_len, self.sigma, self.implementation)
        weights = weights.transpose(0, 1)[:, :, None]  # (B, H, 1, S)
        keys = torch.arange(k_len, device=positions.device)
        if causal:
            weights = weights * (keys[None, :] <= positions[:, None])[:, None, None]
        if key_padding_mask is not None:
            weights = weights * ~key_padding_mask[:, None, None, :]
        return weights

    def forward(self, query, memory, *, key_padding_mask=None, causal=False, state=None,
                cache=None, need_weights=False, masks=None) -> AttnOutput:
        q_offset = 0
        if cache is not None and self.role == "cross":
            if cache.v is None:
                cache.v = memory_heads(self.value_proj(memory), self.heads)
            values = cache.v
            q_offset = _query_offset(cache)
        elif cache is not None:
            values = append_values(cache, split_heads(self.value_proj(memory), self.heads))
            q_offset = _query_offset(cache)
        else:
            values = split_heads(self.value_proj(memory), self.heads)  # (B, H, S, d_h)
        weights = self.weights_for(q_offset, query.shape[1], values.shape[2], key_padding_mask,
                                   causal, query.device, masks).to(values.dtype)
        context = weights @ values  # (B, H, T, d_h)
        out_weights = weights.expand(values.shape[0], -1, -1, -1) if need_weights else None
        return AttnOutput(self.out_proj(merge_heads(context)), out_weights, state)


def _query_offset(cache: AttentionCache) -> int | Tensor:
    """The incremental query's position: the step (an int), or per row (B,) under
    step-level batching."""
    return cache.step if cache.positions is None else cache.positions
