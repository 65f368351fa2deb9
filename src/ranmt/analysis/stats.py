"""Attention statistics on weight tensors; pure functions, checked against hand values.

* entropy (paper 000 Eq. 5): ``E(x_t) = -sum_i A(x_t, x_i) log A(x_t, x_i)`` (0 log 0 = 0);
* Jensen-Shannon divergence of two distributions (natural log, bounded by log 2);
* distance between a query position and the argmax of its attention (paper 004 Fig. 2);
* off-diagonality (paper 004 Sec. 6): share of tokens whose attention argmax lies at least
  two positions away from the token itself.
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_entropy(weights: Tensor) -> Tensor:
    """Entropy over the last dimension: (..., S) -> (...)."""
    weights = weights.float()
    logs = torch.where(weights > 0, weights.clamp_min(1e-30).log(), torch.zeros_like(weights))
    return -(weights * logs).sum(-1)


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence of rows: (..., S), (..., S) -> (...)."""
    p, q = p.float(), q.float()
    m = 0.5 * (p + q)

    def kl(a: Tensor, b: Tensor) -> Tensor:
        ratio = torch.where(a > 0, a / b.clamp_min(1e-30), torch.ones_like(a))
        return (a * ratio.log()).sum(-1)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def argmax_distance(weights: Tensor, query_offset: int = 0) -> Tensor:
    """|argmax_j A(i, j) - i| for every query row: (..., T, S) -> (..., T) (float)."""
    positions = torch.arange(query_offset, query_offset + weights.shape[-2],
                             device=weights.device)
    return (weights.argmax(-1) - positions).abs().float()


def off_diagonality(weights: Tensor, valid: Tensor, threshold: int = 2) -> Tensor:
    """Per sentence, the share of valid tokens whose argmax is >= ``threshold`` away.

    weights (B, T, S) (already averaged over heads/layers), valid (B, T) bool -> (B,).
    """
    far = (argmax_distance(weights) >= threshold) & valid
    return far.sum(-1).float() / valid.sum(-1).clamp_min(1).float()
