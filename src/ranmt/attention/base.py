"""The attention interface every variant implements, and its return type.

A layer receives an attention module (composition) and calls it the same way whatever
the variant is:

    out = attention(query, memory, key_padding_mask=..., causal=..., state=..., cache=...)

* ``query``  (B, T, d): the states that attend.
* ``memory`` (B, S, d): the states attended to (``query`` itself for self-attention).
* ``key_padding_mask`` (B, S) bool, True at padded keys, or None.
* ``causal``: query i may only attend to keys j <= i (decoder self-attention).
* ``state``: cross-layer state of the stack (e.g. RAN's refined matrix ``A_{l-1}``); the
  first layer gets :meth:`Attention.initial_state`, each layer passes ``out.state`` up.
* ``cache``: an :class:`~ranmt.attention.cache.AttentionCache` owned by the caller for
  incremental decoding (one per layer and component). Variants store what they need in
  its parts (keys/values ``k``/``v``, values only, ``recurrent`` state); every tensor in
  it has the batch (or batch x beam) dimension first, so the decoder can reorder any
  variant's cache with :func:`reorder_cache`. ``cache.step`` (maintained by the decoder)
  is the index of the query position during incremental decoding (T == 1). Per-step
  histories go through :func:`cache_append`: with ``cache.capacity`` set (the fast
  decoder) their buffers are allocated once at that length and written in place,
  otherwise they grow by concatenation (the reference). Step-level batching
  (``ranmt.inference.continuous``) decodes rows that are at different positions: then
  ``cache.positions`` (B,) long holds each row's query position and ``cache.span`` the
  largest position + 1; a history keeps position j of every row in slot j (rows shorter
  than the history have finite values after their position, zeros or what an earlier
  history left there, masked by :func:`rows_allowed`), :func:`cache_append` writes each row
  at its own position, and a reorder copies each row's written slots only
  (:func:`gather_histories`).
* ``need_weights``: also return the attention weights (B, H, T, S) for analysis.
* ``masks``: the :class:`PassMasks` of the forward pass (masks built once, shared by the
  layers), or None (built per call).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ranmt.attention.cache import AttentionCache, HistoryPlan, StaticHistory


@dataclass
class AttnOutput:
    """What every attention returns."""

    context: Tensor
    """(B, T, d) attended values after the output projection."""
    weights: Tensor | None = None
    """(B, H, T, S) attention weights, when requested (zero at masked keys)."""
    state: Any = None
    """Cross-layer state for the next layer of the stack (None for stateless variants)."""


@dataclass
class AttentionSpec:
    """Everything a variant's constructor may need, filled in by the model builder."""

    d_model: int
    heads: int
    dropout: float
    max_positions: int
    role: str
    """encoder_self | decoder_self | cross"""
    layer_index: int
    num_layers: int
    shared: Any = None
    """Stack-wide module shared by all layers of one stack (from ``build_shared``)."""
    options: dict = field(default_factory=dict)
    """Variant option sections of the model config (e.g. ``options["ran"]``)."""
    ffn_dim: int = 0
    """The model's feed-forward inner size (variants with a feed-forward layer of their own,
    AAN, default to it); 0 when unknown."""


class Attention(nn.Module):
    """Base class of all attention variants."""

    input_agnostic = False
    """True when the weights do not depend on the input (RAN, Syn-R, hard-coded)."""
    normalized = True
    """True when every row of the returned weights sums to 1."""
    has_weights = True
    """False for a self-attention replaced by a recurrence (the SSRU): ``need_weights``
    gets None."""
    grouped_memory = False
    """True when, in incremental decoding, the module accepts a memory of B/g sentences for
    B query rows (g consecutive rows per sentence: the beams) and keeps its cache per
    sentence; the decoder then never copies the memory side of the cache between beams."""

    def initial_state(self) -> Any:
        """State handed to the first layer of a stack (None unless the variant has one)."""
        return None

    def forward(
        self,
        query: Tensor,
        memory: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        state: Any = None,
        cache: AttentionCache | None = None,
        need_weights: bool = False,
        masks: PassMasks | None = None,
    ) -> AttnOutput:
        raise NotImplementedError


class VersionedCache:
    """Caches ``compute()`` until one of ``params`` is modified, moved or replaced."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, params: list[Tensor], compute: Callable[[], object]):
        if torch.compiler.is_compiling():  # traced: the eager value as a constant
            return self.value if self.value is not None else compute()
        key = tuple((p.data_ptr(), p._version, p.device, p.dtype) for p in params)
        if key != self.key:
            with torch.no_grad():
                self.value = compute()
            self.key = key
        return self.value


def reorder_cache(cache: AttentionCache, order: Tensor, plan: HistoryPlan | None = None
                  ) -> None:
    """Select batch entries ``order`` (1-D long) of every tensor in an attention cache.

    A static history (see :func:`cache_append`) is gathered into the other of its two
    preallocated buffers, laid out contiguously with room for the next step: one copy per
    reorder, no allocation, and the next step's history is contiguous again. With
    ``plan`` (a self-attention's history of rows at their own positions, step-level
    batching) the ``k`` / ``v`` histories are gathered by it (:func:`gather_histories`):
    each row's written slots only, with room for the next step.
    """
    for name, value in list(cache.row_tensors()):
        if plan is not None and name in ("k", "v"):
            cache.set_row_tensor(name, gather_histories(cache, name, ((value, order),), plan))
            continue
        history = cache.static.get(name)
        if history is None:
            cache.set_row_tensor(name, value.index_select(0, order))
            continue
        rows, heads, _, dim = value.shape
        room = min(history.filled + 1, cache.capacity)
        target = _spare_view(history, (order.numel(), heads, room, dim))
        torch.index_select(value[:, :, :history.filled], 0, order,
                           out=target[:, :, :history.filled])
        cache.set_history(name, target)


HISTORY_RUN_WASTE = 128
""":func:`history_plan` joins two runs of rows into one copy when that copies at most this
many (row, slot) pairs more than separate copies would: a copy call costs about as much
as copying ~100 slots of a `small` model's history."""


def history_plan(written: list[int], group: int = 1, split: int | None = None) -> HistoryPlan:
    """The :class:`HistoryPlan` of new rows in groups of ``group`` (a sentence's beams) whose
    rows have written ``written[g]`` slots each (their position + 1): runs of rows copied
    together (lines that joined together are alike), none across group ``split`` (where the
    rows start coming from another cache)."""
    parts = [(0, len(written))] if split is None else [(0, split), (split, len(written))]
    runs: list[tuple[int, int, int]] = []
    for first, last in parts:
        start = row = first * group  # the run being formed: rows start..row
        slots = useful = 0
        for value, alike in itertools.groupby(written[first:last]):
            rows = len(list(alike)) * group
            wider = max(slots, value)
            waste = wider * (row + rows - start) - (useful + value * rows)
            if row > start and waste > HISTORY_RUN_WASTE:
                runs.append((start, row, slots))
                start, wider, useful = row, value, 0
            slots, useful, row = wider, useful + value * rows, row + rows
        if row > start:
            runs.append((start, row, slots))
    return HistoryPlan(tuple(runs), max(written, default=0) + 1)


def whole_span_plan(rows: int, span: int) -> HistoryPlan:
    """Every row copies ``span`` slots (a reorder of rows at their own positions without a
    plan of its own: ``span`` is the largest position + 1)."""
    return HistoryPlan(((0, rows, span),) if rows else (), span + 1)


def gather_histories(cache: AttentionCache, name: str, parts: tuple[tuple[Tensor, Tensor], ...],
                     plan: HistoryPlan) -> Tensor:
    """The new ``name`` history of rows at their own positions, (rows, H, plan.length, d):
    rows ``order`` of each ``(history, order)`` of ``parts`` in turn (a running and a joining
    cache's, or one), each run of ``plan`` copying its written slots, into the buffer of
    ``cache.gathered[name]`` that does not hold the current history (the other slots keep
    finite values of earlier histories; masked)."""
    sample = parts[0][0]
    _, heads, _, dim = sample.shape
    ends = list(itertools.accumulate(order.numel() for _, order in parts))
    target = _gathered_view(cache, name, (ends[-1], heads, plan.length, dim), sample)
    for start, end, slots in plan.runs:
        part = bisect.bisect_right(ends, start)  # the part whose rows this run takes
        history, order = parts[part]
        offset = ends[part] - order.numel()
        written = min(slots, history.shape[2])
        torch.index_select(history[:, :, :written], 0, order[start - offset: end - offset],
                           out=target[start:end, :, :written])
    return target


def _gathered_view(cache: AttentionCache, name: str, shape: tuple[int, ...], like: Tensor
                   ) -> Tensor:
    """A contiguous ``shape`` view of the buffer of ``cache.gathered[name]`` that does not
    hold the current history (grown, with zeros, when too small); that buffer holds the
    history from now on."""
    size = math.prod(shape)
    buffers = cache.gathered.get(name)
    if buffers is None:
        empty = like.new_zeros(0)
        buffers = cache.gathered[name] = StaticHistory((empty, empty))
    spare = 1 - buffers.in_buffer
    if buffers.buffers[spare].numel() < size or buffers.buffers[spare].dtype != like.dtype:
        grown = like.new_zeros(size + size // 2)  # room for more rows or slots: few growths
        buffers.buffers = ((grown, buffers.buffers[1]) if spare == 0
                           else (buffers.buffers[0], grown))
    buffers.in_buffer = spare
    return buffers.buffers[spare][:size].view(shape)


def _spare_view(history: StaticHistory, shape: tuple[int, ...]) -> Tensor:
    """A contiguous tensor of ``shape`` in the buffer of a static history that does not
    hold it now (``in_buffer``, an index, not a pointer comparison, so that a compiled
    decoder step traces it); that buffer holds the history from now on."""
    history.in_buffer = 1 - history.in_buffer
    return history.buffers[history.in_buffer][: math.prod(shape)].view(shape)


def cache_append(cache: AttentionCache, name: str, step_values: Tensor) -> Tensor:
    """Append this step's ``step_values`` (B, H, 1, d) to the history ``name`` (``k`` or
    ``v``) and return the whole history (B, H, t+1, d), contiguous, t = ``cache.step``.

    Without ``cache.capacity`` the history grows by concatenation (the reference). With
    it, two flat buffers of B x H x capacity x d are allocated at the first step and the
    history always lives, contiguous, in one of them (:class:`StaticHistory`): a step
    writes in place where the last reorder left room (beam search: every step), else the
    history moves to the other buffer with one more step (greedy search between reorders;
    one copy, as with concatenation, but no allocation).
    """
    if cache.positions is not None:
        return _append_at_positions(cache, name, step_values)
    capacity = cache.capacity
    current = cache.history(name)
    if capacity is None:
        if current is not None:
            step_values = torch.cat([current, step_values], dim=2)
        cache.set_history(name, step_values)
        return step_values
    step = cache.step
    end = step + step_values.shape[2]
    if end > capacity:
        raise ValueError(f"decoder step {end} exceeds the cache capacity {capacity}")
    batch, heads, _, dim = step_values.shape
    history = cache.static.get(name)
    if current is None or history is None:
        size = batch * heads * capacity * dim
        history = StaticHistory((step_values.new_empty(size), step_values.new_empty(size)))
        cache.static[name] = history
        current = history.buffers[0][: batch * heads * end * dim].view(batch, heads, end, dim)
    elif current.shape[2] < end:
        grown = _spare_view(history, (batch, heads, end, dim))
        grown[:, :, :step] = current[:, :, :step]
        current = grown
    current[:, :, step:end] = step_values
    cache.set_history(name, current)
    history.filled = end
    return current if current.shape[2] == end else current[:, :, :end]


def _append_at_positions(cache: AttentionCache, name: str, step_values: Tensor) -> Tensor:
    """Per-row positions (step-level batching): write row r's ``step_values`` (B, H, 1, d)
    at slot ``cache.positions[r]`` of the history (B, H, L, d), grown by 8 slots (zeros)
    when the span passes L: it is kept close to the span (a reorder trims it to the span
    + 1). Returns the whole history (B, H, L, d), L >= span, contiguous (slots after a
    row's position hold finite values, zeros or an earlier history's; callers mask them): slots
    ``:span`` alone would be a strided view, which every matrix product over it copies
    first (a whole history per layer and step)."""
    positions, span = cache.positions, cache.span
    batch, heads, _, dim = step_values.shape
    current = cache.history(name)
    if current is None:
        current = step_values.new_zeros(batch, heads, span + 8, dim)
    elif current.shape[2] < span:
        current = widened_history(current, span + 8)
    elif current.shape[2] > span + 16:  # the longest rows left: later copies take less
        current = current[:, :, : span + 8].contiguous()
    current[torch.arange(batch, device=positions.device), :, positions] = step_values[:, :, 0]
    cache.set_history(name, current)
    return current


def widened_history(history: Tensor, length: int) -> Tensor:
    """A history (B, H, L, d) of rows at their own positions widened to ``length`` >= L
    slots, zeros after its own (finite; every variant masks slots past a row's position)."""
    return torch.nn.functional.pad(history, (0, 0, 0, length - history.shape[2]))


def rows_allowed(cache: AttentionCache, length: int) -> Tensor:
    """Per-row positions: (B, 1, 1, length) bool over a history of ``length`` slots, True
    at the keys row r may attend to (slots 0 .. ``positions[r]``, its own history up to
    and including this step)."""
    positions = cache.positions
    slots = torch.arange(length, device=positions.device)
    return (slots[None, :] <= positions[:, None])[:, None, None, :]


def append_values(cache: AttentionCache, values: Tensor) -> Tensor:
    """Value-only self-attention cache: append this step's values (B, H, 1, d_h) and return
    all values so far (B, H, t+1, d_h)."""
    return cache_append(cache, "v", values)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, d) -> (B, H, T, d/H)."""
    batch, length, dim = x.shape
    return x.view(batch, length, heads, dim // heads).transpose(1, 2)


def memory_heads(x: Tensor, heads: int) -> Tensor:
    """(B, S, d) -> (B, H, S, d/H), contiguous: a cross-attention's keys or values, cached
    once and read by every decoding step. :func:`split_heads`' transposed view would be
    copied by every step's matrix product instead (its (B, H) dimensions do not fold into
    one batch dimension): a whole key or value tensor per layer and step, 4-7% of a greedy
    batch's decoding time (32 sentences, one thread; docs/PERFORMANCE.md, measured with the
    since retired ``benchmarks/cross_memory_layout.py``)."""
    return split_heads(x, heads).contiguous()


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, d_h) -> (B, T, H*d_h)."""
    batch, heads, length, dim = x.shape
    return x.transpose(1, 2).reshape(batch, length, heads * dim)


class PassMasks:
    """The masks of one forward pass, built once and shared by the layers that need them.

    A stack's forward creates one (``Seq2Seq.forward`` one for both stacks) and hands it to
    every attention call (``masks=``): the causal mask, the padding mask's negation, the
    additive mask ``scaled_dot_product_attention`` would derive from a boolean one, HC-SA's
    Gaussian weights — each a kernel launch per layer on a GPU if built per layer. A plain
    object local to the pass: masks are keyed by what they are built from (role, shapes,
    offsets, flags), never by tensor identity or global state, and one pass has one key
    padding mask per side (the source's). A mask derived from another (``~allowed``) is
    found by the object it came from. In a traced (compiled) forward every mask is built
    where it is used: the compiler removes the repeats, and nothing is guarded on.
    ``share = False`` (class attribute) builds every mask per use: the code before sharing,
    for parity tests and benchmarks.
    """

    share = True

    def __init__(self):
        self._built: dict[tuple, Tensor | None] = {}
        self._sources: list[tuple[Tensor, tuple]] = []  # (mask, its key) for derived masks

    def _sharing(self) -> bool:
        return self.share and not torch.compiler.is_compiling()

    def get(self, key: tuple, build: Callable[[], Tensor | None]) -> Tensor | None:
        """``build()``, once per ``key`` in this pass."""
        if not self._sharing():
            return build()
        if key not in self._built:
            value = build()
            self._built[key] = value
            if isinstance(value, Tensor):
                self._sources.append((value, key))
        return self._built[key]

    def derived(self, source: Tensor, kind: tuple, build: Callable[[], Tensor]) -> Tensor:
        """``build()`` of a mask derived from ``source``: once per pass when ``source`` was
        built here (:meth:`get`), else every time."""
        if self._sharing():
            for tensor, key in self._sources:
                if tensor is source:
                    return self.get(kind + key, build)
        return build()


def blocked_mask(allowed: Tensor, masks: PassMasks | None = None) -> Tensor:
    """``~allowed`` (True where attention is *not* allowed), once per pass with ``masks``."""
    if masks is None:
        return ~allowed
    return masks.derived(allowed, ("blocked",), lambda: ~allowed)


def additive_mask(allowed: Tensor | None, dtype: torch.dtype, masks: PassMasks | None = None
                  ) -> Tensor | None:
    """The ``attn_mask`` for ``scaled_dot_product_attention``: with ``masks`` (sharing), 0
    where ``allowed`` and -inf elsewhere in ``dtype`` (the conversion the kernel makes of a
    boolean mask on every call, made once per pass); otherwise ``allowed`` itself."""
    if allowed is None or masks is None or not masks._sharing():
        return allowed
    return masks.derived(allowed, ("additive", dtype),
                         lambda: torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                         .masked_fill_(blocked_mask(allowed, masks), float("-inf")))


def padding_key(key_padding_mask: Tensor | None) -> tuple | None:
    """What names a key padding mask in a :class:`PassMasks` key: its shape (one pass has
    one padding mask per side; grouped and expanded copies differ in shape)."""
    return None if key_padding_mask is None else tuple(key_padding_mask.shape)


def build_mask(
    key_padding_mask: Tensor | None, causal: bool, q_len: int, k_len: int, q_offset: int,
    device: torch.device, masks: PassMasks | None = None,
) -> Tensor | None:
    """Boolean mask (B or 1, 1, T, S), True where attention is *allowed*; None if all allowed.

    ``q_offset`` is the absolute position of the first query (for incremental decoding).
    With ``masks`` a mask is built once per pass and shared by the layers.
    """
    if key_padding_mask is None and not causal:
        return None
    if masks is None:
        return _build_mask(key_padding_mask, causal, q_len, k_len, q_offset, device)
    key = ("allowed", padding_key(key_padding_mask), causal, device,
           (q_offset, q_len, k_len) if causal else None)
    return masks.get(key, lambda: _build_mask(
        key_padding_mask, causal, q_len, k_len, q_offset, device))


def _build_mask(key_padding_mask: Tensor | None, causal: bool, q_len: int, k_len: int,
                q_offset: int, device: torch.device) -> Tensor | None:
    allowed = None
    if causal:
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
        k_pos = torch.arange(k_len, device=device)[None, :]
        allowed = (k_pos <= q_pos)[None, None]  # (1, 1, T, S)
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        allowed = keep if allowed is None else allowed & keep
    return allowed
