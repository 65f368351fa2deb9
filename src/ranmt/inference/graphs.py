"""A decoder step at fixed addresses, replayed as a CUDA graph (issue 44 item 4).

The sync-free searches (``ranmt.inference.decode``) keep every row to the end and read
nothing on the host inside a step, but they still launch the decoder's kernels one by one
(a ``base`` decoder step: a few hundred small kernels, which the host issues more slowly
than the GPU runs them). A CUDA graph records a step once and replays it with one launch;
it replays the *same kernels on the same addresses*, so the step it records must

* have the same shapes every step: the rows keep per-row positions (``cache.positions``, a
  device tensor advanced in place) and attend over the whole capacity of their histories
  with a mask (``cache.span`` = capacity), instead of a history that grows by one slot;
* read its inputs from, and leave its state in, the same tensors every step: the previous
  tokens and the beam reorder come in through static buffers, and every cache tensor the
  step or the reorder replaces (a recurrent cross-attention's state, a reordered history)
  is copied back into the tensor it replaced (:meth:`StaticDecoder._pinned`);
* decide nothing on the host from device values (the sync-free search already does not).

:class:`StaticDecoder` runs that step. On CUDA with ``graphs`` it takes its first steps
eagerly (warm-up, on a side stream), records the next one (with the beam reorder before
it, if it has one) and replays it for every later step of the same kind; elsewhere, or
without ``graphs``, it runs the same fixed-address step eagerly, which is how the CPU
tests check everything a replay relies on (equal outputs to the sync-free search, no host
read, no cache tensor moving after the warm-up). The bookkeeping of the search around it
(candidates, finished hypotheses) stays eager.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from ranmt.attention.cache import AttentionCache, DecoderCache, EnsembleCache
from ranmt.model import BOS_ID

WARMUP_STEPS = 2
"""Eager steps before a graph is recorded (CUDA's lazy initialisation; a beam search's
first step has no reorder, its second has)."""


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
    """``model.decode_step`` (and the beam reorder before it) over fixed addresses, for
    ``rows`` decoder rows of ``cache`` (a fast cache of ``capacity`` steps, from
    ``model.init_cache``), replayed as a CUDA graph when ``graphs`` and on CUDA.

    The cache is switched to per-row positions (all rows at the same position, advanced
    in place) with a span of ``capacity``: a row attends over every slot of its history,
    those after its position masked, so that every step has the same shapes."""

    def __init__(self, model, cache: DecoderCache | EnsembleCache, rows: int, capacity: int,
                 device: torch.device, graphs: bool = False):
        self.model, self.cache = model, cache
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # (N,)
        for member in cache.members:
            member.positions, member.span = self.positions, capacity
        self.prev = torch.full((rows, 1), BOS_ID, dtype=torch.long, device=device)  # (N, 1)
        self.order = torch.arange(rows, device=device)  # (N,) the rows to keep, in order
        self.use_graph = graphs and device.type == "cuda"
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_output: Tensor | None = None
        self.graph_reorders = False  # whether the recorded step starts with a reorder

    @property
    def recorded(self) -> bool:
        """Whether a CUDA graph of the step has been recorded (and is being replayed)."""
        return self.graph is not None

    def step(self, prev: Tensor, order: Tensor | None = None) -> Tensor:
        """Keep rows ``order`` (N,) of the cache when given (a beam reorder, within each
        sentence's rows), then decode ``prev`` (N, 1) -> log-probs (N, V) float32.

        The log-probs live in a buffer the next step overwrites (a graph's output)."""
        self.prev.copy_(prev)
        reorder = order is not None
        if reorder:
            self.order.copy_(order)
        self.steps += 1
        if self.graph is not None and reorder == self.graph_reorders:
            self.graph.replay()
            return self.graph_output
        if not self.use_graph or self.steps <= WARMUP_STEPS or self.graph is not None:
            return self._eager(reorder)
        return self._record_and_replay(reorder)

    def _eager(self, reorder: bool) -> Tensor:
        if not self.use_graph:
            return self._body(reorder)
        side = torch.cuda.Stream()  # warm-up off the capturing stream, as CUDA graphs want
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logprobs = self._body(reorder)
        torch.cuda.current_stream().wait_stream(side)
        return logprobs

    def _record_and_replay(self, reorder: bool) -> Tensor:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self._body(reorder)
        self.graph, self.graph_output, self.graph_reorders = graph, output, reorder
        graph.replay()  # recording ran nothing: this is the step itself
        return output

    def _body(self, reorder: bool) -> Tensor:
        """The recorded step: reorder, decode, advance the positions; every cache tensor
        that was replaced is copied back into the one it replaced."""
        if reorder:
            self._pinned(lambda: self.model.reorder_cache(self.cache, self.order,
                                                          within_groups=True))
        logprobs = self._pinned(lambda: self.model.decode_step(self.prev, self.cache))
        self.positions.add_(1)
        return logprobs

    def _pinned(self, run):
        """Run ``run()`` and copy every cache tensor it replaced back into the tensor it
        replaced (same shape), so that the cache keeps its addresses; a tensor that is new
        (the first step's histories and states) is kept as it is."""
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
