"""Decoder caches joined under step-level batching (``ranmt.inference.continuous``): the
running batch's cache and the cache of lines that join it, made one (:func:`merge_caches`,
or :func:`reorder_merged`: the merge and the step's reorder in one copy of the running
cache), and a joining line's first-step cache widened to its beams (:func:`widen`). Every
tensor is concatenated along its first (batch, row or sentence) dimension, the others
padded to the larger of the two (source length, history length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from ranmt.attention.base import gather_histories
from ranmt.attention.cache import DecoderCache, EnsembleCache, HistoryPlan


def cat_padded(first: Tensor, second: Tensor, value: float | bool = 0) -> Tensor:
    """``first`` and ``second`` concatenated along dim 0, every other dim padded (at its end,
    with ``value``) to the larger of the two."""
    orders = tuple(torch.arange(part.shape[0], device=part.device) for part in (first, second))
    return _gather_two(first, second, orders, value)


def merge_caches(first: Any, second: Any, key: str = "") -> Any:
    """Two decoder caches (any variant's, an ensemble's) as one: every tensor concatenated
    along its first (batch, row or sentence) dimension, the others padded to the larger
    (source length, history length) with zeros, the source padding mask with True."""
    if key in ("vocabulary", "output"):  # the batch's, shared by the two (a shortlist)
        return first
    if isinstance(first, Tensor):
        return cat_padded(first, second, True if key == "pad_mask" else 0)
    if dataclasses.is_dataclass(first):  # the parts of ranmt.attention.cache
        return type(first)(**{part.name: merge_caches(getattr(first, part.name),
                                                      getattr(second, part.name), part.name)
                              for part in dataclasses.fields(first)})
    if key == "gathered":  # buffers that reorders gather histories into: the merged
        return {}          # histories are new tensors, the next reorder allocates anew
    if isinstance(first, dict):
        if first.keys() != second.keys():
            raise ValueError(f"cannot merge decoder caches with parts {sorted(first)} and "
                             f"{sorted(second)}")
        return {name: merge_caches(value, second[name], name) for name, value in first.items()}
    if isinstance(first, list):
        return [merge_caches(a, b, key) for a, b in zip(first, second)]
    return first  # ints and flags (step, group, capacity) are equal in both


def reorder_merged(running: Any, joining: Any, rows: Tensor, running_rows: int,
                   plan: HistoryPlan) -> None:
    """``reorder_cache(merge_caches(running, joining), rows)`` into ``running``, copying
    each of its tensors once: ``rows`` (1-D long, sorted by sentence) index the running
    cache's ``running_rows`` rows followed by the joining cache's. The memory side goes by
    sentence where it is grouped, as in ``Seq2Seq.reorder_cache``; self-attention
    histories are gathered by ``plan`` (its runs none across the two caches' rows)."""
    first = int((rows < running_rows).sum())
    row_orders = rows[:first], rows[first:] - running_rows
    for ahead, behind in zip(running.members, joining.members):
        group = ahead.group
        sentence_orders = row_orders if group == 1 else tuple(
            torch.div(order.view(-1, group)[:, 0], group, rounding_mode="floor")
            for order in row_orders)
        ahead.memory = _gather_two(ahead.memory, behind.memory, sentence_orders)
        ahead.pad_mask = _gather_two(ahead.pad_mask, behind.pad_mask, sentence_orders, True)
        ahead.plan = None
        for layer_ahead, layer_behind in zip(ahead.layers, behind.layers):
            for part, orders in (("self_attention", row_orders),
                                 ("cross_attention", sentence_orders)):
                cache_ahead, cache_behind = getattr(layer_ahead, part), getattr(layer_behind, part)
                tensors_behind = dict(cache_behind.row_tensors())
                for name, value in list(cache_ahead.row_tensors()):
                    parts = (value, tensors_behind[name])
                    if part == "self_attention" and name in ("k", "v"):
                        merged = gather_histories(cache_ahead, name, tuple(zip(parts, orders)),
                                                  plan)
                    else:
                        merged = _gather_two(*parts, orders)
                    cache_ahead.set_row_tensor(name, merged)


def _gather_two(first: Tensor, second: Tensor, orders: tuple[Tensor, Tensor],
                pad: float | bool = 0) -> Tensor:
    """``torch.cat([first[orders[0]], second[orders[1]]])`` with every other dim padded with
    ``pad`` to the larger of the two, written once into a new tensor."""
    shape = [max(a, b) for a, b in zip(first.shape[1:], second.shape[1:])]
    out = first.new_empty(orders[0].numel() + orders[1].numel(), *shape)
    start = 0
    for part, order in zip((first, second), orders):
        region = out[start: start + order.numel()]
        start += order.numel()
        common = (slice(None),) + tuple(slice(0, min(size, target))
                                        for size, target in zip(part.shape[1:], shape))
        torch.index_select(part[common], 0, order, out=region[common])
        for dim, (size, target) in enumerate(zip(part.shape[1:], shape), start=1):
            if size < target:  # the slab past this part's end, along this dim
                region[(slice(None),) * dim + (slice(size, None),)].fill_(pad)
    return out


def set_positions(cache: DecoderCache | EnsembleCache, positions: Tensor, span: int) -> None:
    """Give a decoder cache (an ensemble's: each member's) per-row positions (rows,)."""
    for member in cache.members:
        member.positions, member.span = positions, span


def widen(taken: Any, beams_cache: Any, beams: Tensor) -> Any:
    """The cache ``taken`` of a first step with one row a line, as the cache of a line's
    beams (``beams`` (n * g,): the line of each row): ``beams_cache``, fresh from
    ``init_cache(..., group=g)``, gets the step's self-attention histories row by row and
    its cross-attention state as it keeps its memory side: per line where the memory is
    grouped (the projected memory as computed), else per row. Ensembles member by member."""
    for small, wide in zip(taken.members, beams_cache.members):
        # The step's positions and span: what the step's reorder trims histories by (the
        # attention caches' own are set by the next step's forward).
        wide.step, wide.span = small.step, small.span
        wide.positions = small.positions.index_select(0, beams)
        for small_layer, wide_layer in zip(small.layers, wide.layers):
            for part in ("self_attention", "cross_attention"):
                before, after = getattr(small_layer, part), getattr(wide_layer, part)
                per_line = part == "cross_attention" and wide.group > 1
                for name, value in before.row_tensors():
                    after.set_row_tensor(name, value if per_line else value.index_select(0, beams))
    return beams_cache
