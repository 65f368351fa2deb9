"""The production searches: greedy and batched beam search over the incremental-decoding
cache, with the per-step rules as step processors (``ranmt.inference.processors``).

Both searches take a source batch (B, S) and return, per sentence, a list of hypotheses
``(tokens, score)`` best first (tokens without BOS/EOS). The output length is limited to
``max_len = a * |src| + b`` tokens (EOS not counted; ``ranmt.inference.lengths``); at that
length only EOS is allowed, in both searches, so beam size 1 reproduces greedy decoding
exactly. Every rule applied to a step's log-probabilities (length limits, a fixed length,
forced target prefixes, any registered option) is a processor: the searches here and
step-level batching (``ranmt.inference.continuous``) run the same processors
(:func:`ranmt.inference.processors.processors_for`). Sampling
(``ranmt.inference.sampling``) runs through :func:`greedy_search` with another ``pick``;
beam selection is ``ranmt.inference.selection``.

Target prefixes (``prefix`` (B, P) token ids, right-padded with PAD): for the first
``len(prefix[b])`` steps sentence b may only write its prefix token, whose log-probability
counts in the score; the search continues freely after it, and the length limit is raised to
the prefix length where it is shorter.

Two forms of each search, with the same hypotheses and scores as the reference
(``ranmt.inference.reference``, the tests' oracle): the shrinking search (static caches,
finished sentences leave the batch: the fastest on a CPU) and the sync-free search
(:func:`beam_search_sync_free`, :func:`greedy_search_sync_free`): every row stays in
the batch to the end with masks in place of a shrinking active set, so that no step reads a
device value on the host (no ``.item()``, ``bool(tensor)``, ``nonzero()``, boolean-mask
indexing; the processors get ``sync_free``); whether everyone is done is read once every
``check_every`` steps. On a GPU the host then queues step after step without waiting for
the device. :func:`search` picks it on CUDA and the shrinking search elsewhere unless told
(``sync_free``). With ``graphs`` the sync-free search's whole step (its decoder at fixed
addresses) is, on CUDA, recorded once as a CUDA graph and replayed
(``ranmt.inference.graphs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ranmt.config import DecodeConfig, decode_with
from ranmt.inference.graphs import CompiledStep, RecordedStep, StaticDecoder
from ranmt.inference.lengths import (  # noqa: F401  (length_penalty, max_lengths: re-exported)
    caps_with_prefix,
    length_penalty,
    max_lengths,
    output_caps,
    prefix_lengths,
)
from ranmt.inference.processors import StepRows, apply_processors, processors_for
from ranmt.inference.reference import (  # noqa: F401  (re-exported: the oracles)
    BEAM_FIELDS,
    beam_search_reference,
    greedy_search_reference,
)
from ranmt.inference.selection import (  # noqa: F401  (re-exported for step-level batching)
    Finished,
    best_candidates,
    first_beams,
    first_candidates,
    next_beams,
    penalties,
    row_topk,
    select_candidates,
    store_finished,
)
from ranmt.model import BOS_ID, EOS_ID, PAD_ID, Seq2Seq


def search_options(options: DecodeConfig | None, overrides: dict) -> DecodeConfig:
    """The decoding options of a search: ``options`` (the declared defaults when None) with
    keyword ``overrides`` of its fields, converted and checked by
    :func:`ranmt.config.decode_with` (an unknown name is an error naming the closest)."""
    if not overrides:  # a DecodeConfig is checked when it is made (decode_with, the config)
        return DecodeConfig() if options is None else options
    return decode_with(DecodeConfig() if options is None else options, **overrides)


# ------------------------------------------------------------------------------ the loop


def _start(model: Seq2Seq, src: Tensor, options: DecodeConfig, limit: int | None,
           fixed_length: int | None, prefix: Tensor | None, group: int = 1, bucket: int = 1,
           compiled: bool = False) -> tuple[Tensor, int, dict]:
    """Encode src (B, S) for a static-cache search (``compiled``: through
    :meth:`CompiledStep.encode`): (output length limits (B,), the cache capacity (the
    longest limit + 1, rounded up to a multiple of ``bucket`` within the model's
    positions), the decoder cache for ``group`` rows a sentence)."""
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = CompiledStep.encode(model, src) if compiled else model.encode(src)
    caps = output_caps(src, options.max_len_a, options.max_len_b, limit, fixed_length)
    caps = caps_with_prefix(caps, prefix_lengths(prefix, src.shape[0], src.device), limit)
    capacity = min(-(-(int(caps.max()) + 1) // bucket) * bucket, limit + 1)
    return caps, capacity, model.init_cache(memory, pad_mask, group=group, capacity=capacity)


class _Decoder:
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


class _GreedyState:
    """Greedy search (or sampling: another ``pick``) over B sentences, one row each.

    Shrinking (``static`` False): a sentence that writes EOS leaves the batch (its row
    dropped from the cache); the step is a host int. Static: every row stays to the end (a
    finished one writes PAD and adds nothing to its score), the state is updated in place
    and the step lives on the device, so that no step reads a device value on the host and
    the whole step can be recorded as a CUDA graph."""

    def __init__(self, batch: int, capacity: int, device, rows: StepRows, decoder: _Decoder,
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


class _BeamState:
    """Batched beam search over B sentences, ``beam`` rows each (sentence-major).

    Each step takes every sentence's best 2k candidates and selects among them as tensor
    operations over all sentences (``ranmt.inference.selection``). Shrinking: a sentence
    with ``beam`` finished hypotheses (or nothing left to extend) leaves the batch. Static:
    it keeps its rows to the end, takes no candidate (so its beam scores are -inf and it
    stays done without a mask), finished hypotheses are written with scatters into a slot
    per sentence (candidates that do not finish go to a spare slot ``beam``), the beams are
    reordered within each sentence, and everything is updated in place with the step on the
    device (no host read; recordable as a CUDA graph)."""

    def __init__(self, batch: int, capacity: int, device, rows: StepRows, decoder: _Decoder,
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


@torch.inference_mode()
def run_search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
               greedy: bool | None = None, static: bool = False, limit: int | None = None,
               fixed_length: int | None = None, prefix: Tensor | None = None, pick=None,
               check_every: int | None = None, **overrides) -> list[list[tuple[list[int], float]]]:
    """The search loop: src (B, S) -> per sentence its hypotheses ``(tokens, score)``, best
    first (greedy: one, with its summed log-probability; beam: the ``nbest`` best, scores
    length-normalised).

    Each step decodes every row, runs the options' step processors over the log-probs
    (``ranmt.inference.processors``) and advances the search state: greedy (``greedy``, by
    default when ``beam == 1``; ``pick`` (log-probs (n, V) -> (scores (n,), tokens (n,)))
    replaces its arg-max: a sampler) or beam. ``static``: the sync-free form (rows stay in
    the batch, masks instead of selections, "all done?" read every ``check_every`` steps:
    8 on CUDA, whose queue of steps a host read drains, 1 elsewhere, where it costs
    nothing); with ``cuda_graphs`` its step is recorded once as a CUDA graph and replayed
    (on CUDA; ``ranmt.inference.graphs``)."""
    options = search_options(options, overrides)
    greedy = options.beam == 1 if greedy is None else greedy
    graphs = static and options.cuda_graphs
    compiled = options.compile_step
    if compiled and not static:
        raise ValueError("compile_step compiles the sync-free search's step: not with the "
                         "shrinking search")
    if check_every is None:  # a host read costs a GPU its queue of steps, a CPU nothing
        check_every = 8 if src.device.type == "cuda" else 1
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1 (steps between checks whether every "
                         f"sentence is done), not {check_every}")
    if (graphs or compiled) and pick is not None:
        raise ValueError("sampling is neither recorded as a CUDA graph nor compiled: not "
                         "with cuda_graphs or compile_step")
    with CompiledStep.shape_limit(compiled):
        return _search(model, src, options, greedy, static, graphs, limit, fixed_length,
                       prefix, pick, check_every)


def _search(model: Seq2Seq, src: Tensor, options: DecodeConfig, greedy: bool, static: bool,
            graphs: bool, limit: int | None, fixed_length: int | None, prefix: Tensor | None,
            pick, check_every: int) -> list[list[tuple[list[int], float]]]:
    """:func:`run_search` once its options are checked."""
    compiled, group = options.compile_step, 1 if greedy else options.beam
    batch, device = src.shape[0], src.device
    bucket = CompiledStep.BUCKET if compiled else 1  # fewer shapes, fewer compilations
    if bucket > 1 and src.shape[1] % bucket:  # source columns of padding (masked)
        src = F.pad(src, (0, bucket - src.shape[1] % bucket), value=PAD_ID)
    caps, capacity, cache = _start(model, src, options, limit, fixed_length, prefix, group,
                                   bucket, compiled)
    decoder = _Decoder(model, cache, batch * group, capacity, device, static,
                       graphs or compiled, pin=not compiled,
                       grow=CompiledStep.GROW if compiled else 0)
    row_caps, row_prefix = caps, prefix
    if group > 1:  # a sentence's beam rows share its limit and prefix (sentence-major)
        row_caps = caps.repeat_interleave(group)
        row_prefix = None if prefix is None else prefix.repeat_interleave(group, dim=0)
    rows = StepRows(0, row_caps, row_prefix, options, fixed_length, sync_free=static)
    state = _GreedyState(batch, capacity, device, rows, decoder, pick, static) if greedy \
        else _BeamState(batch, capacity, device, rows, decoder, options, static)
    processors = processors_for(options, fixed_length)

    def one_step() -> None:
        logprobs = decoder.decode(state.prev)  # (rows, V)
        apply_processors(processors, logprobs, state.rows)
        state.advance(logprobs)

    run = CompiledStep(one_step) if compiled else RecordedStep(one_step, device, graphs)
    for index in range(capacity):
        decoder.reach(index + 1)
        run()
        if state.done(index, check_every):
            break
        if compiled and (index + 1) % check_every == 0:  # with the done check's host read
            state.compact()  # (a CPU: every step): finished sentences leave in buckets
    return state.results() if greedy else state.results(options.nbest)


def greedy_search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
                  limit: int | None = None, fixed_length: int | None = None,
                  prefix: Tensor | None = None, pick=None, **overrides
                  ) -> list[list[tuple[list[int], float]]]:
    """Greedy decoding of src (B, S) -> per sentence ``[(tokens, logprob)]``: the shrinking
    form of :func:`run_search` (finished sentences leave the batch: the fastest on a CPU).
    ``pick`` replaces the arg-max (a sampler, ``ranmt.inference.sampling``); the scores it
    returns are what the hypothesis' score sums."""
    return run_search(model, src, options, greedy=True, limit=limit, fixed_length=fixed_length,
                      prefix=prefix, pick=pick, **overrides)


def beam_search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
                limit: int | None = None, fixed_length: int | None = None,
                prefix: Tensor | None = None, **overrides
                ) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) -> per sentence the ``nbest`` best ``(tokens,
    score)``: the shrinking form of :func:`run_search` (a sentence leaves the batch once it
    holds ``beam`` finished hypotheses or nothing is left to extend)."""
    return run_search(model, src, options, greedy=False, limit=limit,
                      fixed_length=fixed_length, prefix=prefix, **overrides)


def greedy_search_sync_free(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                            *, limit: int | None = None, fixed_length: int | None = None,
                            prefix: Tensor | None = None, check_every: int | None = None,
                            **overrides) -> list[list[tuple[list[int], float]]]:
    """:func:`greedy_search`'s output without a host sync inside a step: the static form of
    :func:`run_search` (whether all have finished read once every ``check_every`` steps;
    with the options' ``cuda_graphs`` the step is replayed as a CUDA graph on CUDA)."""
    return run_search(model, src, options, greedy=True, static=True, limit=limit,
                      fixed_length=fixed_length, prefix=prefix, check_every=check_every,
                      **overrides)


def beam_search_sync_free(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                          *, limit: int | None = None, fixed_length: int | None = None,
                          prefix: Tensor | None = None, check_every: int | None = None,
                          **overrides) -> list[list[tuple[list[int], float]]]:
    """:func:`beam_search`'s hypotheses and scores without a host sync inside a step: the
    static form of :func:`run_search` (at most ``check_every - 1`` wasted steps at the end;
    with the options' ``cuda_graphs`` the whole step (decoder at fixed addresses, selection,
    reorder) is recorded once as a CUDA graph and replayed on CUDA)."""
    return run_search(model, src, options, greedy=False, static=True, limit=limit,
                      fixed_length=fixed_length, prefix=prefix, check_every=check_every,
                      **overrides)


def search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
           fixed_length: int | None = None, reference: bool = False,
           prefix: Tensor | None = None, sync_free: bool | None = None,
           check_every: int | None = None, **overrides) -> list[list[tuple[list[int], float]]]:
    """Greedy search for ``beam == 1``, beam search otherwise, with the decoding ``options``
    (a :class:`ranmt.config.DecodeConfig`; its declared defaults when None) and keyword
    ``overrides`` of its fields (``beam=4, lenpen=0.6``: checked as the config checks them).
    ``fixed_length`` L: every hypothesis has exactly L tokens (EOS is not allowed before, and
    forced at, L), for speed measurements independent of what a model happens to write.
    ``prefix`` (B, P): forced target prefixes (see the module docstring).

    Which implementation (same hypotheses and scores): the reference with ``reference``;
    else the sync-free search (whether all are done read every ``check_every`` steps) when
    ``sync_free``, or when it is None and ``src`` is on a GPU; else the shrinking search.
    ``cuda_graphs``: the sync-free search with its whole step replayed as a CUDA graph on
    CUDA (the same fixed-address step run eagerly elsewhere; ``ranmt.inference.graphs``);
    ``compile_step``: the sync-free search with its whole step compiled."""
    options = search_options(options, overrides)
    graphs = options.cuda_graphs or options.compile_step
    if graphs and (reference or sync_free is False):
        what = "compile_step compiles" if options.compile_step else "graphs replay"
        raise ValueError(f"{what} the sync-free search's step: not with the reference or "
                         f"the shrinking search")
    if sync_free is None:
        sync_free = graphs or src.device.type != "cpu"
    if reference:
        oracle = greedy_search_reference if options.beam == 1 else beam_search_reference
        return oracle(model, src, options, fixed_length=fixed_length, prefix=prefix)
    return run_search(model, src, options, static=sync_free, fixed_length=fixed_length,
                      prefix=prefix, check_every=check_every)
