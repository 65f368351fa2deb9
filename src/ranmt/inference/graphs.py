"""A search step at fixed addresses, replayed as a CUDA graph (issue 44 item 4).

The sync-free searches (``ranmt.inference.decode``) keep every row to the end and read
nothing on the host inside a step, but they still launch their kernels one by one (a
``base`` beam step: a few hundred small kernels for the decoder and about sixty for the
bookkeeping, which the host issues more slowly than the GPU runs them). A CUDA graph
records a step once and replays it with one launch; it replays *the same kernels on the
same addresses*, so the step it records must

* have the same shapes every step: the rows keep per-row positions (``cache.positions``, a
  device tensor advanced in place) and attend over the whole capacity of their histories
  with a mask (``cache.span`` = capacity) instead of a history that grows by one slot; the
  search's own step counter is a device tensor too;
* read its inputs from, and leave its state in, the same tensors every step: the search
  keeps its beams, histories and finished hypotheses in tensors it updates in place, and
  every cache tensor a decoder step or a reorder replaces (a recurrent cross-attention's
  state, a reordered history) is copied back into the one it replaced
  (:meth:`StaticDecoder.decode`, :meth:`StaticDecoder.reorder`);
* decide nothing on the host from device values (the sync-free search already does not).

:class:`StaticDecoder` is the decoder side of such a step; :class:`RecordedStep` runs a
whole search step (a function of no arguments): on CUDA with ``record`` its first calls
run eagerly (warm-up, on a side stream), the next is recorded and every later call
replays the recording; elsewhere, or without ``record``, every call runs eagerly.
:class:`CompiledStep` runs the same step through ``torch.compile`` instead (on any device). The CPU
tests check what a replay relies on (equal outputs to the sync-free search, no host read,
no cache tensor moving after the warm-up); a ``gpu`` test checks the replay.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ranmt.attention.base import widened_history
from ranmt.attention.cache import AttentionCache, DecoderCache, EnsembleCache

WARMUP_STEPS = 2
"""Eager calls before a step is recorded (CUDA's lazy initialisation, the first step's
allocations of the caches)."""


def _cache_slots(cache: DecoderCache | EnsembleCache
                 ) -> Iterator[tuple[object, str, Tensor]]:
    """(owner, name, tensor) of every tensor a decoder step or a reorder may replace:
    each member's memory and padding mask and each attention cache's row tensors."""
    for member in cache.members:
        yield member, "memory", member.memory
        yield member, "pad_mask", member.pad_mask
        for layer in member.layers:
            for part in (layer.self_attention, layer.cross_attention):
                for name, tensor in list(part.row_tensors()):
                    yield part, name, tensor


def _replace(owner: object, name: str, tensor: Tensor) -> None:
    if isinstance(owner, AttentionCache):
        owner.set_row_tensor(name, tensor)
    else:
        setattr(owner, name, tensor)


class StaticDecoder:
    """``model.decode_step`` and ``model.reorder_cache`` over fixed addresses, for ``rows``
    decoder rows of ``cache`` (a fast cache of ``capacity`` steps, ``model.init_cache``).

    The cache is switched to per-row positions (all rows at the same position, advanced
    in place) with a span of ``capacity``: a row attends over every slot of its history,
    those after its position masked, so that every step has the same shapes.

    With ``grow`` (a compiled step, which needs equal shapes only between the calls that
    share a graph) the span starts at ``grow`` slots and :meth:`reach` widens it by
    ``grow`` at a time before the step that needs it: a few graphs (one per span) instead
    of one, but a step at position t attends over fewer than t + ``grow`` + 8 slots instead
    of the whole capacity."""

    def __init__(self, model, cache: DecoderCache | EnsembleCache, rows: int, capacity: int,
                 device: torch.device, pin: bool = True, grow: int = 0):
        self.model, self.cache, self.pin = model, cache, pin
        self.capacity, self.grow = capacity, grow
        self.span = min(capacity, grow) if grow else capacity
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (N,)
        for member in cache.members:
            member.positions, member.span = self.positions, self.span

    def reach(self, steps: int) -> None:
        """Before the step at position ``steps - 1``: with ``grow``, widen the span to
        ``steps`` rounded up to a multiple of ``grow`` (at most the capacity) and every
        self-attention history with it, each keeping the slots it had past the old span
        (so that the steps after share the graph of the first at this span). Outside the
        compiled step, so that the widening is not a graph of its own."""
        if not self.grow or steps <= self.span:
            return
        span = min(self.capacity, -(-steps // self.grow) * self.grow)
        for member in self.cache.members:
            member.span = span
            for layer in member.layers:
                part = layer.self_attention
                for name in ("k", "v"):
                    history = part.history(name)
                    if history is not None:  # L - old span: the 8 spare slots
                        slack = history.shape[2] - self.span
                        part.set_history(name, widened_history(history, span + slack))
        self.span = span

    def decode(self, prev: Tensor) -> Tensor:
        """prev (N, 1) -> log-probs (N, V) float32; the positions advance by one."""
        logprobs = self._pinned(lambda: self.model.decode_step(prev, self.cache))
        self.positions.add_(1)
        if not self.pin:  # compiled: the rows carry their positions, and the host counter
            for member in self.cache.members:  # would be a new constant of the graph a step
                member.step = 0
        return logprobs

    def reorder(self, order: Tensor) -> None:
        """Keep rows ``order`` (N,) of the cache, each sentence's from its own rows (a beam
        reorder: the memory side does not move)."""
        self._pinned(lambda: self.model.reorder_cache(self.cache, order, within_groups=True))

    def select(self, order: Tensor) -> None:
        """Keep rows ``order`` (M,), fewer than now, whole sentences (a beam search's
        groups of rows kept together): a compiled search's rows moved into a smaller row
        bucket (outside the graph; the memory side and the positions follow). Not at fixed
        addresses."""
        if self.pin:
            raise RuntimeError("rows leave a search replayed at fixed addresses only with it")
        self.model.reorder_cache(self.cache, order)
        self.positions = self.positions.index_select(0, order)
        for member in self.cache.members:
            member.positions = self.positions

    def _pinned(self, run):
        """Run ``run()`` and copy every cache tensor it replaced back into the tensor it
        replaced (same shape), so that the cache keeps its addresses; a tensor that is new
        (the first step's histories and states) is kept as it is. Without ``pin`` (a
        compiled step, which needs no fixed addresses) ``run()`` alone."""
        if not self.pin:
            return run()
        before = {(id(owner), name): tensor for owner, name, tensor in _cache_slots(self.cache)}
        result = run()
        for owner, name, tensor in list(_cache_slots(self.cache)):
            old = before.get((id(owner), name))
            if old is None or old is tensor:
                continue
            if old.shape != tensor.shape:
                raise RuntimeError(f"a decoder step changed the shape of cached {name} "
                                   f"{tuple(old.shape)} -> {tuple(tensor.shape)}: it cannot "
                                   f"be replayed at fixed addresses")
            old.copy_(tensor)
            _replace(owner, name, old)
        return result

    def addresses(self) -> dict[tuple[int, str], int]:
        """(owner id, name) -> data pointer of every cache tensor (the tests check that
        none moves after the warm-up, which a replay relies on)."""
        return {(id(owner), name): tensor.data_ptr()
                for owner, name, tensor in _cache_slots(self.cache)}


class RecordedStep:
    """Calls ``body`` (a search step that updates its state in place), replaying it as a
    CUDA graph from the call after the warm-up when ``record`` and on CUDA."""

    def __init__(self, body: Callable[[], None], device: torch.device, record: bool):
        self.body = body
        self.record = record and device.type == "cuda"
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def recorded(self) -> bool:
        """Whether the step has been recorded (and is being replayed)."""
        return self.graph is not None

    def __call__(self) -> None:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
        elif not self.record:
            self.body()
        elif self.calls <= WARMUP_STEPS:
            side = torch.cuda.Stream()  # warm-up off the capturing stream, as graphs want
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.body()
            torch.cuda.current_stream().wait_stream(side)
        else:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.body()
            self.graph = graph
            graph.replay()  # recording ran nothing: this is the step itself


class CompiledStep:
    """Calls ``body`` (a search step that updates its state in place) through
    ``torch.compile`` (inductor with freezing, ``fullgraph``, static shapes):
    ``decode.compile_step``; the encoder too (:meth:`encode`). What keeps the static step
    near the work of the shrinking one: the span grows by :data:`GROW` slots outside the
    graph (:meth:`StaticDecoder.reach`), a greedy search's rows leave in buckets
    (:data:`ROWS_SHRINK`), and a CPU reads "all done?" every step. Off by default, as
    measured (trained int8 TransF student, real outputs, greedy, 1 thread, 2-core Zen 4;
    docs/PERFORMANCE.md): batch 1 2.1-2.3x the eager shrinking search, batch 32
    1.16x; beam 4 / batch 100 / 2 threads 0.98x (0.54-0.59x before the span grew and the
    rows left in buckets); a minute or more of compiling per process.

    Dynamo caches a compiled graph by the body's code and guards on what it reads (shapes,
    dtypes, the decoder's settings), so a later search with the same batch shape reuses the
    graph without compiling again; a new shape compiles anew (tens of seconds on a CPU).
    The decoder runs without pinned addresses (:class:`StaticDecoder` with ``pin`` off):
    nothing replays the step at fixed addresses, and pinning reads ``id()``s, which change
    every search."""

    SHAPES = 64
    """Batch shapes (rows, source length, cache capacity) one process may compile: Dynamo's
    default limit (8) would end a long file's translation with an error at its ninth."""

    GROW = 16
    """Slots a compiled search's span widens by (:meth:`StaticDecoder.reach`): a graph per
    span (capacity / GROW of them) for attending over at most GROW + 8 unwritten slots."""

    ROWS_SHRINK = 4
    """A compiled search keeps 1/ROWS_SHRINK of its sentences (rounded up) once those
    still decoding fit in them (:meth:`smaller_bucket`): 32 -> 8 -> 2 -> 1."""

    BUCKET = 8
    """Source lengths (of the step's memory: padding columns, masked) and cache capacities
    (unused slots) a compiled search rounds up to a multiple of: a file's batches then
    share a few step graphs instead of one each (``run_search``). The encoder runs at the
    batch's own length (:meth:`encode`)."""

    _runner: Callable[[Callable[[], None]], None] | None = None
    """``_run_body`` through torch.compile, made once a process: wrapping each search's
    step anew cost 1.8 ms a search (15% of a one-sentence greedy search's time, int8
    student, Zen 4); dynamo inlines the body it is given and guards on its code and what
    it reads, as it did on a body compiled alone."""

    def __init__(self, body: Callable[[], None]):
        self.body = body
        if CompiledStep._runner is None:
            # freezing: the weights are constants of the graph (folded, packed for oneDNN)
            CompiledStep._runner = torch.compile(_run_body, fullgraph=True, dynamic=False,
                                                 options={"freezing": True})

    _warmed: weakref.WeakSet = weakref.WeakSet()
    """The models :meth:`warm` has run eagerly in this process."""

    @classmethod
    def warm(cls, model, run_eagerly: Callable[[object], object]) -> None:
        """Before a model's first compiled search: ``run_eagerly(model)`` (a one-token
        eager search), so that what the model derives from its weights and caches for
        inference (``ranmt.attention.base.VersionedCache``: RAN's refined matrices A_1..A_L
        and their causal softmax, the Synthesizer's, the fused projection weights) is
        computed before Dynamo traces it. A trace that finds such a cache empty computes
        it inside the graph, at every step: RAN-D's student, compiled first, decoded
        3,766 target tokens a second before this warm-up and 10,480 after it (int8 +
        shortlist, greedy, batch 32, fixed length 20, one thread, Zen 4; peers.py, each in
        a fresh process). A shortlist's ``RestrictedOutput`` is warmed through its model."""
        base = getattr(model, "model", model)  # RestrictedOutput -> the model it restricts
        if base in cls._warmed:
            return
        run_eagerly(base)
        cls._warmed.add(base)

    ENCODER_TRACE = {"fullgraph": True, "dynamic": True}
    """How :meth:`encode` traces the encoder: one graph, batch and source length symbolic."""

    _encoder: Callable | None = None
    """``_encode`` through torch.compile, made once a process (:meth:`encode`)."""

    def __call__(self) -> None:
        self._run(CompiledStep._runner, _run_body, self.body)

    @staticmethod
    def smaller_bucket(live: Tensor) -> Tensor | None:
        """A compiled static search's sentences to keep, given which are still decoding
        ``live`` (B,) bool: once the live ones fit in 1/``ROWS_SHRINK`` of them (rounded
        up; again and again), that many sentences -- live ones first, then finished ones
        (which add nothing) -- else None (keep all). Reads one count on the host (outside
        the step; on a CPU free)."""
        count, size = int(live.sum()), len(live)
        while size > 1 and -(-size // CompiledStep.ROWS_SHRINK) >= count:
            size = -(-size // CompiledStep.ROWS_SHRINK)
        if count == 0 or size == len(live):
            return None
        return torch.sort(live.to(torch.uint8), descending=True, stable=True).indices[:size]

    @classmethod
    def encode(cls, model, src: Tensor):
        """``model.encode(src)`` (src (B, S): memory (B, S, d), pad mask (B, S), weights)
        compiled with inductor and freezing: at batch 1 the eager encoder's per-operator
        dispatch is a fifth of a compiled search's time. The batch and the source length
        are dynamic (one graph per model, besides Dynamo's own for sizes 1), so a batch is
        encoded at its own longest source, not padded to the step's :data:`BUCKET`: with
        the columns padded to a multiple of 8, the trained int8 TransF student's encoder
        computed 6,400 positions for 4,664 real ones (test_2016, batches of 32; 5,216 at
        the longest) and took 1.17x the time (302 ms against 260 for the 320 sentences,
        one thread, Zen 4; docs/performance/engine/encoder_padding.txt)."""
        if cls._encoder is None:
            cls._encoder = torch.compile(_encode, **cls.ENCODER_TRACE,
                                         options={"freezing": True})
        return cls._run(cls._encoder, _encode, model, src)

    @classmethod
    @contextmanager
    def shape_limit(cls, compiled: bool = True) -> Iterator[None]:
        """Dynamo's limit of graphs a function raised to :data:`SHAPES` for a ``compiled``
        search (around the whole search, not each step: entering Dynamo's config patch
        took 21 us, 4% of a one-sentence search's time, int8 student, Zen 4), and the
        model's Python floats traced as constants (:data:`_FLOATS_AS_CONSTANTS`)."""
        if not compiled:
            yield
            return
        with torch._dynamo.config.patch(recompile_limit=cls.SHAPES,
                                        accumulated_recompile_limit=4 * cls.SHAPES,
                                        **_FLOATS_AS_CONSTANTS):
            yield

    @classmethod
    def _run(cls, compiled: Callable, eager: Callable, *args):
        """``compiled(*args)`` (within :meth:`shape_limit`); once this process has compiled
        :data:`SHAPES` shapes of it (Dynamo then refuses a new one before running
        anything), ``eager(*args)`` for the new shapes, with one warning: a long-lived
        server must not fail on its 65th. From then on the compiled graphs still run, and
        new shapes run eagerly under Dynamo's ``eager_on_recompile`` stance: without it
        Dynamo logs its limit warning (30 lines) at every step of every new shape (45,000
        lines in a 4-minute benchmark)."""
        limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
        if cls._warned:
            with torch.compiler.set_stance("eager_on_recompile"):
                return compiled(*args)
        try:
            return compiled(*args)
        except limit_hit:
            cls._warned = True  # (reached only before: afterwards the stance above runs)
            warnings.warn(f"compile_step: {cls.SHAPES} batch shapes compiled in this "
                          f"process; new shapes decode eagerly (the compiled ones still run "
                          f"compiled)", RuntimeWarning, stacklevel=3)
            return eager(*args)

    _warned = False
    """This process reached :data:`SHAPES` (and warned once): new shapes run eagerly."""


_FLOATS_AS_CONSTANTS = ({"specialize_float": True}
                        if hasattr(torch._dynamo.config, "specialize_float") else {})
"""The dynamic encoder trace (:meth:`CompiledStep.encode`) with the model's Python floats
(the embedding scale, layer norms' eps, dropout's p) as constants, as the static step's
trace has them. Under ``dynamic=True`` Dynamo (torch >= 2.6: ``specialize_float`` off)
makes each a symbolic input, fails to turn them into tensors, and traces the encoder a
second time with them specialized: a process's first encoder compile took 14.4-15.5 s
with that restart and 12.0-12.8 s without (tiny TransF, warm kernel cache, two runs
each, 2-core Zen 3)."""


def _run_body(body: Callable[[], None]) -> None:
    """What :class:`CompiledStep` compiles: one search step."""
    body()


def _encode(model, src: Tensor):
    """What :meth:`CompiledStep.encode` compiles."""
    return model.encode(src)
