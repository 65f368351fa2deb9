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
  the step (``ranmt.inference.cache_joins.reorder_merged``: one copy of the running
  cache), or by ``merge_caches`` where the step keeps every row, and their search state to
  the running state.
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

import math
from typing import Any

import torch
from torch import Tensor

from ranmt.attention.base import history_plan
from ranmt.attention.cache import DecoderCache, EnsembleCache
from ranmt.config import DecodeConfig
from ranmt.data.batching import pad_sources
from ranmt.inference.cache_joins import (  # noqa: F401  (merge_caches: re-exported)
    cat_padded,
    merge_caches,
    reorder_merged,
    set_positions,
    widen,
)
from ranmt.inference.decode import search_options
from ranmt.inference.lengths import caps_with_prefix, length_penalty, output_caps, prefix_lengths
from ranmt.inference.line_state import Sentences, merge_sentences
from ranmt.inference.processors import StepRows, apply_processors, processors_for
from ranmt.inference.selection import (
    Finished,
    best_candidates,
    first_candidates,
    next_beams,
    select_candidates,
    store_finished,
)
from ranmt.inference.shortlist import Shortlist
from ranmt.model import BOS_ID, EOS_ID, PAD_ID

Hypotheses = list[tuple[list[int], float]]


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
        options = search_options(options, overrides)
        beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest = (
            options.beam, options.lenpen, options.lenpen_style, options.max_len_a,
            options.max_len_b, options.nbest)
        self.model = model
        self.options = options
        self.processors = processors_for(options, fixed_length)
        """The step processors every row's log-probabilities go through
        (``ranmt.inference.processors``), each row at its own step."""
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
        self.sentences: Sentences | None = None
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
            set_positions(self.cache, rows_steps, int(self.sentences.steps.max()) + 1)
            running = self.model.decode_step(self.sentences.prev, self.cache)
        if joins:
            joining, cache, joining_logprobs = self._start(self.waiting)
            self.waiting = []
            if self.sentences is None:
                self.sentences, self.cache = joining, cache
            else:  # the caches are merged by the reorder that ends this step
                self._joined = (cache, self.rows)
                self.sentences = merge_sentences(self.sentences, joining)
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

    def _start(self, waiting) -> tuple[Sentences, dict, Tensor]:
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
        set_positions(cache, torch.zeros(count, dtype=torch.long, device=device), 1)
        prev = torch.full((count, 1), BOS_ID, dtype=torch.long, device=device)
        logprobs = model.decode_step(prev, cache)  # (count, V)
        if group > 1:
            beams = torch.arange(count, device=device).repeat_interleave(group)
            wide = model.init_cache(memory, pad_mask, group=group)
            if self.vocabulary is not None:
                self._restrict(wide)
                for small, widened in zip(cache.members, wide.members):
                    widened.output = small.output  # packed once for the joining lines
            cache = widen(cache, wide, beams)
            prev = prev.index_select(0, beams)
        scores = torch.zeros(count, group, device=device)
        scores[:, 1:] = float("-inf")  # all beams start identical: only the first is alive
        capacity = int(caps.max()) + 1
        finished = Finished(count, group + 1, capacity, device) if group > 1 else None
        state = Sentences(
            [ticket for ticket, _, _, _ in waiting], [gen for _, _, _, gen in waiting],
            torch.zeros(count, dtype=torch.long, device=device), caps, prefix, scores,
            torch.zeros(count * group, capacity, dtype=torch.long, device=device), finished,
            prev)
        return state, cache, logprobs

    # ------------------------------------------------------------------ the searches
    def _constrain(self, logprobs: Tensor, sentences: slice = slice(None), group: int | None = None
                   ) -> Tensor:
        """The step processors (length limits, fixed length, prefixes, ...) at each row's
        own step (in place), for log-probs of ``sentences`` with ``group`` rows each (the
        beam by default); returns the rows' steps."""
        state, group = self.sentences, self.beam if group is None else group
        row_steps = state.steps[sentences].repeat_interleave(group)
        prefix = state.prefix
        if prefix is not None:
            prefix = prefix[sentences].repeat_interleave(group, 0)
        rows = StepRows(row_steps, state.caps[sentences].repeat_interleave(group), prefix,
                        self.options, self.fixed_length)
        apply_processors(self.processors, logprobs, rows)
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
        one (``ranmt.inference.cache_joins.reorder_merged``: one copy of the running cache
        instead of a merge and then a reorder). Self-attention histories are copied up to
        each row's position (:func:`ranmt.attention.base.history_plan`), not to the
        batch's longest."""
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

    def _write(self, state: Sentences, row_steps: Tensor, tokens: Tensor) -> None:
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
