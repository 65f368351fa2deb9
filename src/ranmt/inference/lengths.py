"""Output length limits and the length penalty, shared by every search and by scoring.

The output length is limited to ``max_len = a * |src| + b`` tokens (EOS not counted;
``decode.max_len_a``/``max_len_b``), capped at the model's ``max_positions - 1``, raised to
a forced prefix's length. Length penalty (normalising the summed log-probability of a
finished hypothesis of |Y| tokens including EOS): ``gnmt``: ``((5 + |Y|) / 6) ** alpha``
(Wu et al., 2016), or ``fairseq``: ``|Y| ** alpha``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ranmt.model import EOS_ID, PAD_ID


def length_penalty(length: int | Tensor, alpha: float, style: str = "gnmt"):
    """Divisor applied to a finished hypothesis' log-probability."""
    if style == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if style == "fairseq":
        return length ** alpha
    raise ValueError(f"unknown length penalty style '{style}' (gnmt | fairseq)")


def max_lengths(src: Tensor, a: float, b: int, limit: int) -> Tensor:
    """(B,) output length limits a*|src|+b (|src| without EOS/padding), capped at ``limit``."""
    src_len = src.ne(PAD_ID).sum(1) - 1
    return torch.clamp((a * src_len.float() + b).floor().long(), min=1, max=limit)


def output_caps(src: Tensor, a: float, b: int, limit: int,
                fixed_length: int | None = None) -> Tensor:
    """(B,) output length limits: ``a*|src|+b`` capped at ``limit``, or ``fixed_length``."""
    if fixed_length is None:
        return max_lengths(src, a, b, limit)
    if not 1 <= fixed_length <= limit:
        raise ValueError(f"fixed length must be in 1..{limit} (the model's max_positions - 1),"
                         f" not {fixed_length}")
    return torch.full((src.shape[0],), fixed_length, dtype=torch.long, device=src.device)


def prefix_lengths(prefix: Tensor | None, batch: int, device) -> Tensor:
    """(B,) number of prefix tokens per sentence (0 without a prefix)."""
    if prefix is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if prefix.dim() != 2 or prefix.shape[0] != batch:
        raise ValueError(f"prefix must be (batch={batch}, P) token ids, not "
                         f"{tuple(prefix.shape)}")
    if bool(prefix.eq(EOS_ID).any()):
        raise ValueError("a target prefix may not contain EOS")
    return prefix.ne(PAD_ID).sum(1)


def caps_with_prefix(caps: Tensor, prefix_len: Tensor, limit: int) -> Tensor:
    """Output length limits raised to the prefix length (checked against ``limit``)."""
    if bool(prefix_len.gt(limit).any()):
        raise ValueError(f"a target prefix of {int(prefix_len.max())} tokens is longer than "
                         f"the model's output limit of {limit} tokens")
    return torch.maximum(caps, prefix_len)
