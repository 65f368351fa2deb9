"""The search state of :func:`ranmt.inference.decode.run_search`: what one step changes.

* :class:`SearchDecoder`: the decoder side of a step (the model's incremental
  ``decode_step`` over its cache, or a :class:`ranmt.inference.graphs.StaticDecoder` at
  fixed addresses for a recorded or compiled step);
* :class:`GreedyState`: greedy search (and sampling, with another ``pick``): per row its
  tokens (B, capacity), lengths (B,) and summed log-probabilities (B,);
* :class:`BeamState`: beam search over ``beam`` rows a sentence (sentence-major, (B * beam)
  rows): beam scores, histories and the finished hypotheses
  (:class:`ranmt.inference.selection.Finished`).

Each has a shrinking form (finished sentences leave the batch) and a static one (every row
stays, masks instead of selections; a compiled step's rows move into smaller buckets as
sentences end: ``compact``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ranmt.config import DecodeConfig
from ranmt.inference.graphs import CompiledStep, StaticDecoder
from ranmt.inference.lengths import length_penalty
from ranmt.inference.processors import StepRows
from ranmt.inference.selection import (
    Finished,
    best_candidates,
    first_beams,
    next_beams,
    penalties,
    select_candidates,
    store_finished,
)
from ranmt.model import BOS_ID, EOS_ID, PAD_ID


class SearchDecoder:
    """The decoder side of a search step: the model's ``decode_step`` and ``reorder_cache``
    (a shrinking search's rows leave the batch; a static one's move within their sentence),
    or a :class:`StaticDecoder` (fixed addresses, for a recorded step)."""

    def __init__(self, model, cache, rows: int, capacity: int, device, static: bool,
                 fixed_addresses: bool, pin: bool = True, grow: int = 0):
        self.model, self.cache, self.static = model, cache, static
        self.fixed = StaticDecoder(model, cache, rows, capacity, device, pin, grow) \
            if fixed_addresses else None

    def reach(self, steps: int) -> None:
        """Before a step at position ``steps - 1``: a growing span widened to it."""
        if self.fixed is not None:
            self.fixed.reach(steps)

    def select(self, rows: Tensor) -> None:
        """Keep ``rows`` (M,) of a static search of one row a sentence (fewer, outside a
        step: :meth:`StaticDecoder.select`)."""
        if self.fixed is not None:
            self.fixed.select(rows)
        else:
            self.model.reorder_cache(self.cache, rows)

    def decode(self, prev: Tensor) -> Tensor:
        if self.fixed is not None:
            return self.fixed.decode(prev)
        return self.model.decode_step(prev, self.cache)

    def reorder(self, rows: Tensor) -> None:
        if self.fixed is not None:
            self.fixed.reorder(rows)
        else:
            self.model.reorder_cache(self.cache, rows, within_groups=self.static)


def _argmax(logprobs: Tensor) -> tuple[Tensor, Tensor]:
    return logprobs.max(dim=-1)


class GreedyState:
    """Greedy search (or sampling: another ``pick``) over B sentences, one row each.

    Shrinking (``static`` False): a sentence that writes EOS leaves the batch (its row
    dropped from the cache); the step is a host int. Static: every row stays to the end (a
    finished one writes PAD and adds nothing to its score), the state is updated in place
    and the step lives on the device, so that no step reads a device value on the host and
    the whole step can be recorded as a CUDA graph."""

    def __init__(self, batch: int, capacity: int, device, rows: StepRows, decoder: SearchDecoder,
                 pick, static: bool):
        self.capacity, self.static, self.decoder = capacity, static, decoder
        self.pick = _argmax if pick is None else pick
        self.tokens = torch.full((batch, capacity), PAD_ID, dtype=torch.long, device=device)
        self.lengths = torch.full((batch,), capacity, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, device=device)
        self.prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device) if static else 0
        self.active = torch.arange(batch, device=device)  # shrinking: sentences decoding
        self.rows, self.over = rows, False
        rows.step = self.step
        self.kept: tuple[Tensor, Tensor, Tensor] | None = None  # per sentence, once compacted

    def advance(self, logprobs: Tensor) -> None:
        """Take one token per row from its (processed) log-probs (n, V)."""
        best_score, best = self.pick(logprobs)  # (n,)
        if self.static:
            live = self.lengths.eq(self.capacity)
            self.scores.add_(best_score.masked_fill(~live, 0.0))
            self.tokens.scatter_(1, self.step.expand(len(live), 1),
                                 best.masked_fill(~live, PAD_ID)[:, None])
            self.lengths.copy_(torch.where(live & best.eq(EOS_ID), self.step, self.lengths))
            self.prev.copy_(best[:, None])
            self.step.add_(1)
            return
        active, step = self.active, self.step
        self.scores[active] += best_score
        self.tokens[active, step] = best
        ended = best.eq(EOS_ID)
        if bool(ended.any()):
            self.lengths[active[ended]] = step
            keep = (~ended).nonzero().squeeze(1)
            if keep.numel() == 0:
                self.over = True
                return
            self.active, best = active[keep], best[keep]
            self.rows = self.rows.select(keep)
            self.decoder.reorder(keep)
        self.prev = best[:, None]
        self.step = self.rows.step = step + 1

    def done(self, index: int, check_every: int) -> bool:
        if not self.static:
            return self.over
        return (index + 1) % check_every == 0 and not bool(self.lengths.eq(self.capacity).any())

    def compact(self) -> None:
        """Static (a compiled step): rows into a smaller bucket
        (:meth:`CompiledStep.smaller_bucket`; finished rows kept as filler write PAD), so
        that the step runs a graph of fewer rows instead of decoding the finished ones to
        the end."""
        keep = CompiledStep.smaller_bucket(self.lengths.eq(self.capacity))  # (M,) or None
        if keep is None:
            return
        self._store()
        self.active = self.active.index_select(0, keep)
        self.tokens, self.lengths, self.scores, self.prev = (
            t.index_select(0, keep) for t in (self.tokens, self.lengths, self.scores, self.prev))
        self.rows = self.rows.select(keep)
        self.decoder.select(keep)

    def _store(self) -> None:
        """Write the rows' tokens, lengths and scores into their sentences' places (the
        rows a compaction drops are finished)."""
        if self.kept is None:
            self.kept = (self.tokens.clone(), self.lengths.clone(), self.scores.clone())
        for every, now in zip(self.kept, (self.tokens, self.lengths, self.scores)):
            every.index_copy_(0, self.active, now)

    def results(self) -> list[list[tuple[list[int], float]]]:
        tokens, lengths, scores = self.tokens, self.lengths, self.scores
        if self.kept is not None:
            self._store()
            tokens, lengths, scores = self.kept
        lengths, scores, tokens = lengths.tolist(), scores.tolist(), tokens.tolist()
        return [[(tokens[row][: lengths[row]], scores[row])] for row in range(len(lengths))]


class BeamState:
    """Batched beam search over B sentences, ``beam`` rows each (sentence-major).

    Each step takes every sentence's best 2k candidates and selects among them as tensor
    operations over all sentences (``ranmt.inference.selection``). Shrinking: a sentence
    with ``beam`` finished hypotheses (or nothing left to extend) leaves the batch. Static:
    it keeps its rows to the end, takes no candidate (so its beam scores are -inf and it
    stays done without a mask), finished hypotheses are written with scatters into a slot
    per sentence (candidates that do not finish go to a spare slot ``beam``), the beams are
    reordered within each sentence, and everything is updated in place with the step on the
    device (no host read; recordable as a CUDA graph)."""

    def __init__(self, batch: int, capacity: int, device, rows: StepRows, decoder: SearchDecoder,
                 options: DecodeConfig, static: bool):
        beam = options.beam
        self.beam, self.capacity, self.static, self.decoder = beam, capacity, static, decoder
        self.lenpen, self.lenpen_style = options.lenpen, options.lenpen_style
        self.finished = Finished(batch, beam + static, capacity, device)  # static: a spare
        self.beam_scores, self.history, self.prev = first_beams(batch, beam, capacity, device)
        self.rows, self.over = rows, False
        self.active = torch.arange(batch, device=device)  # rows' sentences (compaction too)
        self.every: Finished | None = None  # static, compacted: every sentence's hypotheses
        if static:
            self.step = torch.zeros((), dtype=torch.long, device=device)
            self.keep = torch.ones(batch, dtype=torch.bool, device=device)  # not done
            self.first_row = torch.arange(batch, device=device)[:, None] * beam  # (B, 1)
            self.step_penalty = penalties(capacity, self.lenpen, self.lenpen_style, device)
        else:
            self.step = 0
        rows.step = self.step

    def advance(self, logprobs: Tensor) -> None:
        """One step of every sentence from its rows' (processed) log-probs (n*beam, V)."""
        candidates = best_candidates(logprobs, self.beam_scores, self.beam)  # each (n, 2k)
        if self.static:
            self._advance_static(*candidates)
        else:
            self._advance_shrinking(*candidates)

    def _advance_static(self, top_scores: Tensor, top_beams: Tensor, top_tokens: Tensor
                        ) -> None:
        beam, finished, step = self.beam, self.finished, self.step
        ends, extends, slots = select_candidates(top_scores, top_tokens, finished.counts, beam)
        store_finished(finished, ends, slots, top_scores, top_beams, self.history, step,
                       self.step_penalty.gather(0, step.view(1)), beam)
        self.keep.copy_(finished.counts.lt(beam) & extends.any(1))
        picked, next_scores = next_beams(extends, top_scores, beam)  # (B, beam)
        self.beam_scores.copy_(next_scores)
        rows = (self.first_row + top_beams.gather(1, picked)).view(-1)  # within sentences
        self.decoder.reorder(rows)
        self.history.copy_(self.history.index_select(0, rows))
        self.prev.copy_(top_tokens.gather(1, picked).view(-1, 1))
        self.history.scatter_(1, step.expand(self.history.shape[0], 1), self.prev)
        step.add_(1)

    def _advance_shrinking(self, top_scores: Tensor, top_beams: Tensor, top_tokens: Tensor
                           ) -> None:
        beam, finished, step, active = self.beam, self.finished, self.step, self.active
        counts = finished.counts[active]  # (n,) finished hypotheses before this step
        ends, extends, slots = select_candidates(top_scores, top_tokens, counts, beam)
        if bool(ends.any()):
            rows, cols = ends.nonzero(as_tuple=True)
            penalty = length_penalty(step + 1, self.lenpen, self.lenpen_style)
            finished.add(active[rows], slots[rows, cols], top_scores[rows, cols] / penalty,
                         self.history[rows * beam + top_beams[rows, cols], :step])
            counts = counts + ends.sum(1)
            finished.counts[active] = counts
        keep = (counts < beam) & extends.any(1)
        if not bool(keep.any()):
            self.over = True
            return
        picked, next_scores = next_beams(extends, top_scores, beam)
        kept = keep.nonzero().squeeze(1)
        picked, self.beam_scores = picked[kept], next_scores[kept]
        rows = (kept[:, None] * beam + top_beams[kept].gather(1, picked)).view(-1)
        self.decoder.reorder(rows)
        self.rows = self.rows.select(rows)  # a row's limit and prefix are its sentence's
        self.history = self.history.index_select(0, rows)
        self.history[:, step] = top_tokens[kept].gather(1, picked).view(-1)
        self.active = active[kept]
        self.prev = self.history[:, step: step + 1]
        self.step = self.rows.step = step + 1

    def done(self, index: int, check_every: int) -> bool:
        if not self.static:
            return self.over
        return (index + 1) % check_every == 0 and not bool(self.keep.any())

    def compact(self) -> None:
        """Static (a compiled step): sentences into a smaller bucket
        (:meth:`CompiledStep.smaller_bucket`; finished ones kept as filler stay done: their beams
        score -inf), their ``beam`` rows each, so that the step runs a graph of fewer rows
        instead of carrying the finished sentences to the end."""
        kept = CompiledStep.smaller_bucket(self.keep)  # (M,) sentences or None
        if kept is None:
            return
        beam = self.beam
        rows = (kept[:, None] * beam + torch.arange(beam, device=kept.device)).view(-1)
        self._store()
        self.finished.select(kept)
        self.active, self.beam_scores, self.keep = (
            t.index_select(0, kept) for t in (self.active, self.beam_scores, self.keep))
        self.first_row = self.first_row[: len(kept)]
        self.history = self.history.index_select(0, rows)
        self.prev = self.prev.index_select(0, rows)
        self.rows = self.rows.select(rows)
        self.decoder.select(rows)

    def _store(self) -> None:
        """Write the sentences' finished hypotheses into their places in :attr:`every`."""
        if self.every is None:
            batch, slots, capacity = self.finished.tokens.shape
            self.every = Finished(batch, slots, capacity, self.finished.tokens.device)
        self.finished.copy_into(self.every, self.active)

    def results(self, nbest: int) -> list[list[tuple[list[int], float]]]:
        if self.every is None:
            return self.finished.nbest(nbest)
        self._store()
        return self.every.nbest(nbest)
