"""Step-level (continuous) batching: lines join a running decoding batch between two steps
and leave it as soon as they finish.

:class:`ContinuousDecoder` holds the sentences being decoded with one set of decoding
options (beam search, greedy search or sampling). Every :meth:`ContinuousDecoder.step`
advances each of them by one token and first admits the lines queued by
:meth:`ContinuousDecoder.add`, so a batch never waits for its longest member and a new line
starts within two steps (``join_wait``). What makes it possible:

* **Rows at their own positions.** Each sentence (its ``beam`` rows) is at its own step.
  The decoder cache runs with per-row positions (``cache.positions`` (rows,),
  ``ranmt.attention.base``): position embeddings, self-attention histories (slot j holds
  position j of every row, later slots masked), RAN's and the Synthesizer's matrix rows,
  hard-coded Gaussian centres are all taken per row.
* **Joining.** Joining lines are encoded together and take their first step in a cache of
  their own, with one row a line (a line's beams all start alike; :func:`_widen` then
  gives each beam its row; their candidates come from that one row,
  :func:`ranmt.inference.decode.first_candidates`); that cache is then concatenated to the
  running one (source-side tensors padded to the longer source) by the reorder that ends
  the step (:func:`reorder_merged`: one copy of the running cache), or by
  :func:`merge_caches` where the step keeps every row, and their search state to the
  running state.
* **Histories copied as far as written.** A reorder copies each row's self-attention
  history only up to its own position, in runs of rows alike
  (:func:`ranmt.attention.base.history_plan`), not up to the batch's oldest line.
* **Leaving.** A sentence with ``beam`` finished hypotheses (or nothing left to extend,
  or EOS in greedy search and sampling) is answered at once and its rows leave the batch,
  as in the shrinking search (:func:`ranmt.inference.decode.beam_search`).

The search itself is that of :mod:`ranmt.inference.decode` (same candidates, same selection, same
length limits, prefixes and length penalty), per sentence step instead of one step for
the batch: each line gets the hypotheses and scores it gets decoded alone (within float
noise: its rows share matrix products with other rows, and its source is padded to the
batch's longest). Sampling draws each line's tokens from the generator given with it,
over its own rows only: a request decoded alone with the seed ``ranmt.inference.sampling.sample``
uses gives the same samples; sharing the batch with other requests does not change which
tokens a request draws (unlike batch-level sampling, where one generator serves the
whole batch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ranmt.attention.base import gather_histories, history_plan
from ranmt.attention.cache import DecoderCache, EnsembleCache, HistoryPlan
from ranmt.config import DecodeConfig
from ranmt.data.batching import pad_sources
from ranmt.inference.decode import (
    BEAM_FIELDS,
    Finished,
    best_candidates,
    caps_with_prefix,
    constrain_rows,
    first_candidates,
    length_penalty,
    next_beams,
    output_caps,
    prefix_lengths,
    search_options,
    select_candidates,
    store_finished,
)
from ranmt.inference.shortlist import Shortlist
from ranmt.model import BOS_ID, EOS_ID, PAD_ID

Hypotheses = list[tuple[list[int], float]]


@dataclass
class _Sentences:
    """The search state of the sentences in the batch, sentence-major (n sentences, rows =
    n * group, group = beam, or 1 in greedy search and sampling)."""

    tickets: list[Any]
    """Per sentence: what the caller gave with it (answered with its hypotheses)."""
    generators: list[torch.Generator | None]
    """Per sentence: the generator its samples are drawn from (sampling), else None."""
    steps: Tensor
    """(n,) the step each sentence takes next: its query position."""
    caps: Tensor
    """(n,) output length limits (EOS forced at that step)."""
    prefix: Tensor | None
    """(n, P) forced target prefixes (PAD-padded), or None."""
    scores: Tensor
    """(n, group) beam scores (greedy search, sampling: (n, 1) summed log-probs)."""
    history: Tensor
    """(rows, L) tokens written so far, token t of a row at column t."""
    finished: Finished | None
    """Beam search: up to ``beam`` finished hypotheses per sentence (+ a spare slot)."""
    prev: Tensor
    """(rows, 1) the token each row feeds at its next step."""

    def select(self, sentences: Tensor, rows: Tensor) -> _Sentences:
        """The state of ``sentences`` (m,) (with their ``rows`` (m * group,))."""
        chosen = sentences.tolist()
        finished = None
        if self.finished is not None:
            finished = _finished_from(
                lambda name: getattr(self.finished, name).index_select(0, sentences))
        return _Sentences(
            [self.tickets[i] for i in chosen], [self.generators[i] for i in chosen],
            self.steps.index_select(0, sentences), self.caps.index_select(0, sentences),
            None if self.prefix is None else self.prefix.index_select(0, sentences),
            self.scores.index_select(0, sentences), self.history.index_select(0, rows),
            finished, self.prev.index_select(0, rows))


def _cat_padded(first: Tensor, second: Tensor, value: float | bool = 0) -> Tensor:
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
        return _cat_padded(first, second, True if key == "pad_mask" else 0)
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


def _set_positions(cache: DecoderCache | EnsembleCache, positions: Tensor, span: int) -> None:
    """Give a decoder cache (an ensemble's: each member's) per-row positions (rows,)."""
    for member in cache.members:
        member.positions, member.span = positions, span


class ContinuousDecoder:
    """Decode lines with step-level batching (see the module docstring).

    ``options`` (a :class:`ranmt.config.DecodeConfig`, its declared defaults when None) and
    keyword ``overrides`` of its fields, as :func:`ranmt.inference.decode.search` takes them:
    ``beam`` 1 is greedy search, or sampling when lines come with a generator (``limit``:
    the longest output, by default the model's ``max_positions - 1``)."""

    def __init__(self, model, options: DecodeConfig | None = None, *,
                 limit: int | None = None, fixed_length: int | None = None, pick=None,
                 join_wait: int = 2, lexical_shortlist: Shortlist | None = None,
                 **overrides):
        beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest = (
            getattr(search_options(options, overrides), name) for name in BEAM_FIELDS)
        self.model = model
        self.beam = beam
        self.lenpen, self.lenpen_style = lenpen, lenpen_style
        self.max_len_a, self.max_len_b = max_len_a, max_len_b
        self.nbest = nbest
        self.limit = model.config.max_positions - 1 if limit is None else limit
        self.fixed_length = fixed_length
        self.pick = pick
        """Sampling: ``generator -> (log-probs (n, V) -> (scores (n,), tokens (n,)))``, the
        draw of :meth:`ranmt.inference.sampling.Sampler.pick`."""
        self.shortlist = lexical_shortlist
        """A lexical shortlist (``ranmt.inference.shortlist``): the batch's output layer is
        restricted to the union of its lines' lists (:meth:`_grow_vocabulary`)."""
        self.vocabulary: Tensor | None = None
        """With a shortlist: the target ids (V',) the running batch may write, specials
        first; tokens in the search state are indices into it. It only grows while the
        batch runs (joining lines append their missing ids, so indices keep their meaning)
        and starts afresh when the batch empties."""
        self._index_of: Tensor | None = None  # (V,) id -> index into vocabulary, -1: absent
        self.join_wait = join_wait
        """Steps a queued line may wait for company before it joins a running batch (1:
        the next step; 2, the default: the next or the one after). Every join encodes
        the joining lines and takes their first step apart, so lines that join together
        cost less: with 64 lines at beam 16 on two CPU cores, 2 gave 1.01x the lines/s of
        1, 4 1.03x (``benchmarks/continuous_batching.py``; 1.07x and 1.10x when a join
        also copied the whole cache). A line joins an empty batch at once, and the queue
        joins whenever it holds lines for a quarter of the batch."""
        self.device = next(model.parameters()).device
        self._queued_at = 0  # steps_taken when the oldest queued line was added
        self.waiting: list[tuple[Any, list[int], list[int], torch.Generator | None]] = []
        self.sentences: _Sentences | None = None
        self.cache: DecoderCache | EnsembleCache | None = None
        self._joined: tuple[Any, int] | None = None
        """At a step where lines join a running batch: their cache and the running rows,
        until the step's reorder merges the two caches (see :meth:`_reorder`)."""
        self.steps_taken = 0

    # ------------------------------------------------------------------ the queue
    def add(self, ticket: Any, ids: list[int], prefix: list[int] | None = None,
            generator: torch.Generator | None = None) -> None:
        """Queue one line (source ids without EOS; non-empty): it joins at the next step.
        ``ticket`` comes back with its hypotheses; ``generator``: sampling only."""
        if not ids:
            raise ValueError("an empty line has no translation to decode")
        if (generator is not None) != (self.pick is not None):
            raise ValueError("a generator goes with sampling (a decoder built with pick), "
                             "and sampling needs one per line")
        if not self.waiting:
            self._queued_at = self.steps_taken
        self.waiting.append((ticket, list(ids), list(prefix or []), generator))

    @torch.inference_mode()
    def cancel(self, tickets: set) -> int:
        """Drop the lines of ``tickets`` (queued or decoding) between two steps: their rows
        leave the batch as finished sentences do, unanswered; the others decode on as
        before. Returns how many lines were dropped. (The server drops a request's lines
        at its deadline, ``ranmt.serving``.)"""
        before = len(self.waiting)
        self.waiting = [line for line in self.waiting if line[0] not in tickets]
        dropped = before - len(self.waiting)
        if self.sentences is None:
            return dropped
        kept = [i for i, ticket in enumerate(self.sentences.tickets) if ticket not in tickets]
        gone = len(self.sentences.tickets) - len(kept)
        if not gone:
            return dropped
        if not kept:
            self.sentences = self.cache = self._joined = None
            return dropped + gone
        kept_sentences = torch.tensor(kept, dtype=torch.long, device=self.device)  # (m,)
        rows = (kept_sentences[:, None] * self.beam +
                torch.arange(self.beam, device=self.device)).view(-1)  # (m * beam,)
        # Between two steps each row has written ``steps`` history slots (positions
        # 0..steps-1), and no joined cache is pending (every step ends with its reorder).
        plan = history_plan(self.sentences.steps.index_select(0, kept_sentences).tolist(),
                            self.beam)
        for member in self.cache.members:
            member.plan = plan
        self.model.reorder_cache(self.cache, rows)
        self.sentences = self.sentences.select(kept_sentences, rows)
        return dropped + gone

    @property
    def decoding(self) -> int:
        """Sentences in the batch now."""
        return 0 if self.sentences is None else len(self.sentences.tickets)

    @property
    def rows(self) -> int:
        """Decoder rows in the batch now (sentences x beam)."""
        return self.decoding * self.beam

    def idle(self) -> bool:
        return self.sentences is None and not self.waiting

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[tuple[Any, Hypotheses]]:
        """Admit the waiting lines, advance every sentence by one token; returns the
        sentences that finished: (ticket, n-best ``(tokens, score)``, best first)."""
        running = joining_logprobs = None  # log-probs (rows, V); the joining: one row a line
        joins = bool(self.waiting) and self._joins_now()
        if joins and self.shortlist is not None:
            self._grow_vocabulary([ids for _, ids, _, _ in self.waiting],
                                  [prefix for _, _, prefix, _ in self.waiting])
        if self.sentences is not None:
            rows_steps = self.sentences.steps.repeat_interleave(self.beam)
            _set_positions(self.cache, rows_steps, int(self.sentences.steps.max()) + 1)
            running = self.model.decode_step(self.sentences.prev, self.cache)
        if joins:
            joining, cache, joining_logprobs = self._start(self.waiting)
            self.waiting = []
            if self.sentences is None:
                self.sentences, self.cache = joining, cache
            else:  # the caches are merged by the reorder that ends this step
                self._joined = (cache, self.rows)
                self.sentences = _merge_sentences(self.sentences, joining)
        if running is None and joining_logprobs is None:
            return []
        self.steps_taken += 1
        if self.beam > 1:
            done = self._advance_beams(running, joining_logprobs)
        else:
            parts = [part for part in (running, joining_logprobs) if part is not None]
            done = self._advance_greedy(torch.cat(parts) if len(parts) > 1 else parts[0])
        return self._as_ids(done)

    def _grow_vocabulary(self, sources: list[list[int]], prefixes: list[list[int]]) -> None:
        """Append to the batch's vocabulary the shortlist ids of joining lines it lacks (a
        fresh one for an empty batch); the running cache's output layer is rebuilt when it
        grew (its rows taken and packed once, ``Decoder.restricted_output``)."""
        src = pad_sources(sources)
        width = max((len(prefix) for prefix in prefixes), default=0)
        prefix = None
        if width:
            prefix = torch.tensor([p + [PAD_ID] * (width - len(p)) for p in prefixes])
        wanted = self.shortlist.vocabulary(src, prefix).to(self.device)  # sorted, specials
        if self.sentences is None or self.vocabulary is None:
            grown = wanted
        else:
            missing = wanted[self._index_of.index_select(0, wanted).lt(0)]
            if missing.numel() == 0:
                return
            grown = torch.cat([self.vocabulary, missing])
        self.vocabulary = grown
        self._index_of = torch.full((self.shortlist.target_vocab_size,), -1, dtype=torch.long,
                                    device=self.device)
        self._index_of[grown] = torch.arange(len(grown), device=self.device)
        if self.cache is not None:
            self._restrict(self.cache)

    def _restrict(self, cache, like=None) -> None:
        """The batch's vocabulary on every member of ``cache``: its output layer rebuilt, or
        taken from ``like`` (the running cache, whose layer is already built for it)."""
        built = [None] * len(cache.members) if like is None else \
            [member.output for member in like.members]
        for member, output in zip(cache.members, built):
            member.vocabulary, member.output = self.vocabulary, output

    def _as_ids(self, done: list[tuple[Any, Hypotheses]]) -> list[tuple[Any, Hypotheses]]:
        """Finished hypotheses with target ids (their tokens are indices into the batch's
        vocabulary with a shortlist); an emptied batch's vocabulary is dropped."""
        if self.vocabulary is None:
            return done
        ids = self.vocabulary.tolist()
        done = [(ticket, [([ids[token] for token in tokens], score) for tokens, score in hyps])
                for ticket, hyps in done]
        if self.sentences is None:
            self.vocabulary = self._index_of = None
        return done

    def _joins_now(self) -> bool:
        """Whether the queued lines join at this step (see ``join_wait``)."""
        return (self.sentences is None
                or self.steps_taken - self._queued_at + 1 >= self.join_wait
                or 4 * len(self.waiting) >= len(self.sentences.tickets))

    def run(self) -> list[tuple[Any, Hypotheses]]:
        """Step until every queued and running line has finished; all that finished."""
        done = []
        while not self.idle():
            done += self.step()
        return done

    def _start(self, waiting) -> tuple[_Sentences, dict, Tensor]:
        """Encode the joining lines and take their first step in a cache of their own:
        (their state, their cache, their log-probs (lines, V): one row a line, which every
        beam of the line shares at this step)."""
        model, device, group = self.model, self.device, self.beam
        src = pad_sources([ids for _, ids, _, _ in waiting]).to(device)
        count = src.shape[0]
        prefix = None
        if any(prefix for _, _, prefix, _ in waiting):
            width = max(len(prefix) for _, _, prefix, _ in waiting)
            prefix = torch.full((count, width), PAD_ID, dtype=torch.long, device="cpu")
            for row, (_, _, tokens, _) in enumerate(waiting):  # built on the host, copied once
                prefix[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long,
                                                          device="cpu")
            prefix = prefix.to(device)
            if self.vocabulary is not None:  # target ids -> indices into the vocabulary
                prefix = self._index_of[prefix]
        caps = output_caps(src, self.max_len_a, self.max_len_b, self.limit, self.fixed_length)
        caps = caps_with_prefix(caps, prefix_lengths(prefix, count, device), self.limit)
        memory, pad_mask, _ = model.encode(src)
        # The first step with one row a line: a line's beams all start from BOS alike.
        cache = model.init_cache(memory, pad_mask)
        if self.vocabulary is not None:  # the running batch's layer, not packed twice
            self._restrict(cache, self.cache)
        _set_positions(cache, torch.zeros(count, dtype=torch.long, device=device), 1)
        prev = torch.full((count, 1), BOS_ID, dtype=torch.long, device=device)
        logprobs = model.decode_step(prev, cache)  # (count, V)
        if group > 1:
            beams = torch.arange(count, device=device).repeat_interleave(group)
            wide = model.init_cache(memory, pad_mask, group=group)
            if self.vocabulary is not None:
                self._restrict(wide)
                for small, widened in zip(cache.members, wide.members):
                    widened.output = small.output  # packed once for the joining lines
            cache = _widen(cache, wide, beams)
            prev = prev.index_select(0, beams)
        scores = torch.zeros(count, group, device=device)
        scores[:, 1:] = float("-inf")  # all beams start identical: only the first is alive
        capacity = int(caps.max()) + 1
        finished = Finished(count, group + 1, capacity, device) if group > 1 else None
        state = _Sentences(
            [ticket for ticket, _, _, _ in waiting], [gen for _, _, _, gen in waiting],
            torch.zeros(count, dtype=torch.long, device=device), caps, prefix, scores,
            torch.zeros(count * group, capacity, dtype=torch.long, device=device), finished,
            prev)
        return state, cache, logprobs

    # ------------------------------------------------------------------ the searches
    def _constrain(self, logprobs: Tensor, sentences: slice = slice(None), group: int | None = None
                   ) -> Tensor:
        """Length limits, fixed length and prefixes at each row's own step (in place), for
        log-probs of ``sentences`` with ``group`` rows each (the beam by default); returns
        the rows' steps."""
        state, group = self.sentences, self.beam if group is None else group
        row_steps = state.steps[sentences].repeat_interleave(group)
        prefix = state.prefix
        if prefix is not None:
            prefix = prefix[sentences].repeat_interleave(group, 0)
        constrain_rows(logprobs, row_steps, self.fixed_length,
                        state.caps[sentences].repeat_interleave(group), prefix)
        return row_steps

    def _candidates(self, running: Tensor | None, joining: Tensor | None
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every sentence's best 2k candidates (:func:`best_candidates`): the running
        sentences' from their rows (rows, V), the joining lines' from their first step's
        one row a line (:func:`first_candidates`: no copy of it per beam, and no
        concatenation of the two parts' log-probs, only of their candidates)."""
        state, beam = self.sentences, self.beam
        running_count = 0 if running is None else running.shape[0] // beam
        parts = []
        if running is not None:
            self._constrain(running, slice(0, running_count))
            parts.append(best_candidates(running, state.scores[:running_count], beam))
        if joining is not None:
            self._constrain(joining, slice(running_count, None), group=1)
            parts.append(first_candidates(joining, beam))
        if len(parts) == 1:
            return parts[0]
        return tuple(torch.cat(pair) for pair in zip(*parts))

    def _advance_beams(self, running: Tensor | None, joining: Tensor | None
                       ) -> list[tuple[Any, Hypotheses]]:
        """One beam-search step of every sentence: the selection of
        :func:`ranmt.inference.decode.beam_search` with each sentence at its own step;
        log-probs of the running rows and of the joining lines (see :meth:`_candidates`)."""
        state, beam = self.sentences, self.beam
        top_scores, top_beams, top_tokens = self._candidates(running, joining)
        row_steps = state.steps.repeat_interleave(beam)
        ends, extends, slots = select_candidates(top_scores, top_tokens,
                                                  state.finished.counts, beam)
        if bool(ends.any()):
            steps = state.steps[:, None]
            penalty = length_penalty(steps.double() + 1, self.lenpen, self.lenpen_style)
            store_finished(state.finished, ends, slots, top_scores, top_beams, state.history,
                            steps, penalty.to(top_scores.dtype), beam)
        keep = state.finished.counts.lt(beam) & extends.any(1)  # (n,)
        done = [(state.tickets[i], self._nbest(i)) for i in (~keep).nonzero()[:, 0].tolist()]
        kept = keep.nonzero()[:, 0]
        if kept.numel() == 0:
            self.sentences = self.cache = self._joined = None
            return done
        picked, next_scores = next_beams(extends, top_scores, beam)
        rows = (kept[:, None] * beam + top_beams[kept].gather(1, picked[kept])).view(-1)
        tokens = top_tokens[kept].gather(1, picked[kept]).view(-1)
        self._reorder(rows, kept)
        state = state.select(kept, rows)
        state.scores = next_scores[kept]
        self._write(state, row_steps.index_select(0, rows), tokens)
        self.sentences = state
        return done

    def _advance_greedy(self, logprobs: Tensor) -> list[tuple[Any, Hypotheses]]:
        """One step of greedy search (or sampling) of every sentence: the arg-max (or each
        sentence's draw from its own generator), summed log-probs, done at EOS."""
        state = self.sentences
        row_steps = self._constrain(logprobs)
        if self.pick is None:
            best_score, best = logprobs.max(dim=-1)  # (n,)
        else:
            best_score, best = self._draw(logprobs, state.generators)
        state.scores[:, 0] += best_score
        state.history[torch.arange(len(row_steps), device=self.device), row_steps] = best
        ended = best.eq(EOS_ID)
        done = []
        if bool(ended.any()):
            lengths, scores = state.steps.tolist(), state.scores[:, 0].tolist()
            for i in ended.nonzero()[:, 0].tolist():
                tokens = state.history[i, : lengths[i]].tolist()
                done.append((state.tickets[i], [(tokens, scores[i])]))
            kept = (~ended).nonzero()[:, 0]
            if kept.numel() == 0:
                self.sentences = self.cache = self._joined = None
                return done
            self._reorder(kept, kept)
            state = state.select(kept, kept)
            best = best.index_select(0, kept)
            self.sentences = state
        elif self._joined is not None:
            self.cache, self._joined = merge_caches(self.cache, self._joined[0]), None
        state.steps += 1
        state.prev = best[:, None]
        return done

    def _reorder(self, rows: Tensor, kept: Tensor) -> None:
        """Keep decoder ``rows`` (sorted by sentence) of the cache, those of the sentences
        ``kept``; at a step where lines joined, of the running and the joining caches as
        one (:func:`reorder_merged`: one copy of the running cache instead of a merge and
        then a reorder). Self-attention histories are copied up to each row's position
        (:func:`ranmt.attention.base.history_plan`), not to the batch's longest."""
        written = (self.sentences.steps.index_select(0, kept) + 1).tolist()
        if self._joined is None:
            plan = history_plan(written, self.beam)
            for member in self.cache.members:
                member.plan = plan
            self.model.reorder_cache(self.cache, rows)
        else:
            joining, running_rows = self._joined
            split = int((kept < running_rows // self.beam).sum())
            reorder_merged(self.cache, joining, rows, running_rows,
                           history_plan(written, self.beam, split))
            self._joined = None

    def _draw(self, logprobs: Tensor, generators: list) -> tuple[Tensor, Tensor]:
        """Sampling: the rows of each run of sentences sharing a generator drawn together,
        in row order (as :func:`ranmt.inference.sampling.sample` draws a request's rows)."""
        scores, tokens, start = [], [], 0
        while start < len(generators):
            end = start
            while end < len(generators) and generators[end] is generators[start]:
                end += 1
            score, token = self.pick(generators[start])(logprobs[start:end])
            scores.append(score)
            tokens.append(token)
            start = end
        return torch.cat(scores), torch.cat(tokens)

    def _write(self, state: _Sentences, row_steps: Tensor, tokens: Tensor) -> None:
        """Write each row's new token at its step; the sentences move one step on."""
        state.history[torch.arange(len(row_steps), device=self.device), row_steps] = tokens
        state.steps += 1
        state.prev = tokens[:, None]

    def _nbest(self, sentence: int) -> Hypotheses:
        """The ``nbest`` best finished hypotheses of a sentence (ties in finishing order)."""
        finished = self.sentences.finished
        count = int(finished.counts[sentence])
        lengths = finished.lengths[sentence].tolist()
        scores = finished.scores[sentence].tolist()
        hyps = [(finished.tokens[sentence, slot, : lengths[slot]].tolist(), scores[slot])
                for slot in range(min(count, self.beam))]
        hyps = sorted(hyps, key=lambda item: -item[1])[: self.nbest]
        return hyps if hyps else [([], -math.inf)]


def _widen(taken: Any, beams_cache: Any, beams: Tensor) -> Any:
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


def _merge_sentences(first: _Sentences, second: _Sentences) -> _Sentences:
    """The running sentences followed by the joining ones (histories and prefixes padded)."""
    prefix = None
    if first.prefix is not None or second.prefix is not None:
        prefix = _cat_padded(_prefix_or_none(first), _prefix_or_none(second), PAD_ID)
    finished = None
    if first.finished is not None:
        finished = _finished_from(lambda name: _cat_padded(
            getattr(first.finished, name), getattr(second.finished, name),
            -math.inf if name == "scores" else 0))
    return replace(
        first, tickets=first.tickets + second.tickets,
        generators=first.generators + second.generators,
        steps=torch.cat([first.steps, second.steps]), caps=torch.cat([first.caps, second.caps]),
        prefix=prefix, scores=torch.cat([first.scores, second.scores]),
        history=_cat_padded(first.history, second.history), finished=finished,
        prev=torch.cat([first.prev, second.prev]))


def _prefix_or_none(state: _Sentences) -> Tensor:
    """The sentences' prefixes (n, P), or (n, 1) PAD (no prefix) when they have none."""
    if state.prefix is not None:
        return state.prefix
    return torch.full((len(state.tickets), 1), PAD_ID, dtype=torch.long,
                      device=state.steps.device)


def _finished_from(part) -> Finished:
    """A :class:`ranmt.inference.decode.Finished` whose tensors are ``part(name)`` for each of its
    scores, tokens, lengths and counts (a selection or a merge of others)."""
    finished = Finished.__new__(Finished)
    for name in ("scores", "tokens", "lengths", "counts"):
        setattr(finished, name, part(name))
    return finished
