"""The incremental-decoding cache, typed: one class per part, with slots, so that a
mistyped part (``cache.stpe = 3``, ``cache.histroy``) is an ``AttributeError`` instead of a
new entry nobody reads.

* :class:`DecoderCache` — one decoder's: the encoder memory and its padding mask, the
  step, the beam group, per-row positions (step-level batching) and a :class:`LayerCache`
  per decoder layer;
* :class:`LayerCache` — one layer's self- and cross-attention caches;
* :class:`AttentionCache` — one attention module's: its keys/values (the history of a
  self-attention, the projected memory of a cross-attention), a recurrent cross-attention's
  state, and the static buffers of the fast decoder (:class:`StaticHistory`);
* :class:`EnsembleCache` — an ensemble's: one :class:`DecoderCache` per member.

The fast and the reference searches share these classes; how a history grows (static
buffers or concatenation) is decided by ``capacity`` (see ``base.cache_append``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import Tensor


@dataclass(slots=True, eq=False)
class StaticHistory:
    """A history kept in two flat buffers of ``B x H x capacity x d`` allocated at the
    first step: ``in_buffer`` (0 or 1) holds it now, ``filled`` steps of it are written."""

    buffers: tuple[Tensor, Tensor]
    in_buffer: int = 0
    filled: int = 0


@dataclass(slots=True, frozen=True)
class HistoryPlan:
    """How a reorder of rows at their own positions (step-level batching) gathers the
    self-attention histories (``base.gather_histories``): the new rows in ``runs``
    ``(start, end, slots)``, each run copying its rows' first ``slots`` slots (what the
    longest row of the run has written), into histories of ``length`` slots (the longest
    row's + 1: room for the next step). A row's slots past its run's are not written: they
    hold finite values of earlier histories, and every variant masks slots past a row's
    position."""

    runs: tuple[tuple[int, int, int], ...]
    length: int


@dataclass(slots=True, eq=False)
class AttentionCache:
    """One attention module's incremental-decoding state."""

    capacity: int | None = None
    """The fast decoder: the most steps of the search; histories live in static buffers."""
    step: int = 0
    """Position of this step's query (every row), set by the decoder each step."""
    positions: Tensor | None = None
    """(B,) per-row positions (step-level batching), set by the decoder each step."""
    span: int = 0
    """With ``positions``: the largest position + 1."""
    k: Tensor | None = None
    """Keys: the history (B, H, t, d_h) of a self-attention, the memory's (B|n, H, S, d_h)
    of a cross-attention."""
    v: Tensor | None = None
    """Values, as ``k`` (value-only variants, RAN and hard-coded, keep only these)."""
    recurrent: dict[str, Tensor] = field(default_factory=dict)
    """A recurrent cross-attention's state (per row: previous context, weights, ...)."""
    static: dict[str, StaticHistory] = field(default_factory=dict)
    """The static buffers of the ``k`` / ``v`` histories (fast decoder)."""
    gathered: dict[str, StaticHistory] = field(default_factory=dict)
    """Rows at their own positions: the two buffers (grown as needed, zeros when new) that
    reorders gather the ``k`` / ``v`` histories into by a :class:`HistoryPlan`."""

    @property
    def fast(self) -> bool:
        """The fast decoder's cache (static histories, or per-row positions)."""
        return self.capacity is not None or self.positions is not None

    def history(self, name: str) -> Tensor | None:
        """The ``k`` or ``v`` tensor."""
        if name == "k":
            return self.k
        if name == "v":
            return self.v
        raise KeyError(f"an attention cache has histories 'k' and 'v', not {name!r}")

    def set_history(self, name: str, value: Tensor) -> None:
        if name == "k":
            self.k = value
        elif name == "v":
            self.v = value
        else:
            raise KeyError(f"an attention cache has histories 'k' and 'v', not {name!r}")

    def row_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of every tensor with a row (batch) dimension first: what a reorder
        selects and a merge concatenates (``k``, ``v``, ``recurrent.<name>``)."""
        for name in ("k", "v"):
            value = self.history(name)
            if value is not None:
                yield name, value
        for name, value in self.recurrent.items():
            yield f"recurrent.{name}", value

    def set_row_tensor(self, name: str, value: Tensor) -> None:
        """Replace the tensor :meth:`row_tensors` named ``name``."""
        if name.startswith("recurrent."):
            self.recurrent[name.removeprefix("recurrent.")] = value
        else:
            self.set_history(name, value)


@dataclass(slots=True, eq=False)
class LayerCache:
    """One decoder layer's attention caches."""

    self_attention: AttentionCache
    cross_attention: AttentionCache


@dataclass(slots=True, eq=False)
class DecoderCache:
    """One decoder's incremental-decoding state (``Seq2Seq.init_cache``)."""

    memory: Tensor
    """(n, S, d) encoder output (n sentences; n * group rows when the memory is grouped)."""
    pad_mask: Tensor
    """(n, S) bool, True at padded source positions."""
    layers: list[LayerCache]
    step: int = 0
    """Decoding steps taken (every row at the same position)."""
    group: int = 1
    """Query rows per sentence of ``memory`` (the beams) when the cross-attention keeps its
    memory per sentence; 1 when the memory is expanded to one row per query row."""
    positions: Tensor | None = None
    """(B,) per-row positions (step-level batching, ``ranmt.inference.continuous``)."""
    span: int = 0
    """With ``positions``: the largest position + 1."""
    plan: HistoryPlan | None = None
    """With ``positions``: how the next reorder gathers the self-attention histories (set
    by the step-level decoder, used once); None: every row's ``span`` slots."""
    vocabulary: Tensor | None = None
    """(V',) sorted target ids the output is restricted to (a lexical shortlist,
    ``ranmt.inference.shortlist``): tokens in and out of a step are indices into it; None:
    the whole vocabulary."""
    output: Callable[[Tensor], Tensor] | None = None
    """With ``vocabulary``: the restricted output layer, (..., d) -> logits (..., V'),
    built once per cache (its weight rows taken and packed for the CPU kernels once:
    ``Decoder.restricted_output``)."""

    @property
    def members(self) -> list[DecoderCache]:
        """The decoders' caches: this one (an :class:`EnsembleCache` has several)."""
        return [self]


@dataclass(slots=True, eq=False)
class EnsembleCache:
    """An ensemble's cache: one :class:`DecoderCache` per member model."""

    members: list[DecoderCache]
