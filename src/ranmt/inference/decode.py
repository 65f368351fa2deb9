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
from torch import Tensor

from ranmt.config import DecodeConfig, decode_with
from ranmt.inference.graphs import RecordedStep, StaticDecoder
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


# ------------------------------------------------------------------------------ shrinking


def _start(model: Seq2Seq, src: Tensor, options: DecodeConfig, limit: int | None,
           fixed_length: int | None, prefix: Tensor | None, group: int = 1
           ) -> tuple[Tensor, int, dict]:
    """Encode src (B, S) for a static-cache search: (output length limits (B,), the cache
    capacity (the longest limit + 1), the decoder cache for ``group`` rows a sentence)."""
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = model.encode(src)
    caps = output_caps(src, options.max_len_a, options.max_len_b, limit, fixed_length)
    caps = caps_with_prefix(caps, prefix_lengths(prefix, src.shape[0], src.device), limit)
    capacity = int(caps.max()) + 1
    return caps, capacity, model.init_cache(memory, pad_mask, group=group, capacity=capacity)


@torch.inference_mode()
def greedy_search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
                  limit: int | None = None, fixed_length: int | None = None,
                  prefix: Tensor | None = None, pick=None, **overrides
                  ) -> list[list[tuple[list[int], float]]]:
    """Greedy decoding of src (B, S) -> per sentence ``[(tokens, logprob)]``.

    The fast path: histories in static caches, tokens written into one (B, max_len + 1)
    tensor, finished sentences leave the batch. Same output as
    :func:`greedy_search_reference`. ``pick`` (log-probs (n, V) -> (scores (n,), tokens
    (n,))) replaces the arg-max: a sampler (``ranmt.inference.sampling``); the scores it returns are
    what the hypothesis' score sums.
    """
    options = search_options(options, overrides)
    processors = processors_for(options, fixed_length)
    batch, device = src.shape[0], src.device
    caps, capacity, cache = _start(model, src, options, limit, fixed_length, prefix)  # (B,)
    tokens = torch.full((batch, capacity), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.full((batch,), capacity, dtype=torch.long, device=device)
    scores = torch.zeros(batch, device=device)
    active = torch.arange(batch, device=device)  # sentences still decoding
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
    rows = StepRows(0, caps, prefix, options, fixed_length)  # the active rows'
    for step in range(capacity):
        logprobs = model.decode_step(prev, cache)  # (n, V)
        rows.step = step
        apply_processors(processors, logprobs, rows)
        best_score, best = logprobs.max(dim=-1) if pick is None else pick(logprobs)  # (n,)
        scores[active] += best_score
        tokens[active, step] = best
        ended = best.eq(EOS_ID)
        if bool(ended.any()):
            lengths[active[ended]] = step
            keep = (~ended).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            active, best = active[keep], best[keep]
            rows = rows.select(keep)
            model.reorder_cache(cache, keep)
        prev = best[:, None]
    lengths, scores, tokens = lengths.tolist(), scores.tolist(), tokens.tolist()
    return [[(tokens[row][: lengths[row]], scores[row])] for row in range(batch)]


@torch.inference_mode()
def beam_search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
                limit: int | None = None, fixed_length: int | None = None,
                prefix: Tensor | None = None, **overrides
                ) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) -> per sentence the ``nbest`` best ``(tokens, score)``.

    The fast path of :func:`beam_search_reference` (same hypotheses, same scores): static
    caches, the selection of each step as tensor operations over all sentences (no Python
    loop over sentences), the histories and finished hypotheses in preallocated tensors.
    Scores are length-normalised log-probabilities; a sentence leaves the batch once it
    holds ``beam`` finished hypotheses or nothing is left to extend.
    """
    options = search_options(options, overrides)
    beam, lenpen, lenpen_style, nbest = (options.beam, options.lenpen, options.lenpen_style,
                                         options.nbest)
    processors = processors_for(options, fixed_length)
    device, batch = src.device, src.shape[0]
    caps_all, capacity, cache = _start(model, src, options, limit, fixed_length, prefix,
                                       group=beam)  # caps (B,)
    finished = Finished(batch, beam, capacity, device)
    active = torch.arange(batch, device=device)  # sentence ids still decoding
    beam_scores, history, prev = first_beams(batch, beam, capacity, device)
    step_rows = _beam_rows(caps_all, prefix, beam, options, fixed_length)
    for step in range(capacity):
        logprobs = model.decode_step(prev, cache)  # (n*beam, V)
        step_rows.step = step
        apply_processors(processors, logprobs, step_rows)
        top_scores, top_beams, top_tokens = best_candidates(logprobs, beam_scores, beam)

        counts = finished.counts[active]  # (n,) finished hypotheses before this step
        ends, extends, slots = select_candidates(top_scores, top_tokens, counts, beam)
        if bool(ends.any()):
            rows, cols = ends.nonzero(as_tuple=True)
            penalty = length_penalty(step + 1, lenpen, lenpen_style)
            finished.add(active[rows], slots[rows, cols], top_scores[rows, cols] / penalty,
                         history[rows * beam + top_beams[rows, cols], :step])
            counts = counts + ends.sum(1)
            finished.counts[active] = counts
        keep = (counts < beam) & extends.any(1)
        if not bool(keep.any()):
            break
        picked, next_scores = next_beams(extends, top_scores, beam)
        kept = keep.nonzero().squeeze(1)
        picked, beam_scores = picked[kept], next_scores[kept]
        rows = (kept[:, None] * beam + top_beams[kept].gather(1, picked)).view(-1)
        model.reorder_cache(cache, rows)
        step_rows = step_rows.select(rows)  # a row's limit and prefix are its sentence's
        history = history.index_select(0, rows)
        history[:, step] = top_tokens[kept].gather(1, picked).view(-1)
        active = active[kept]
        prev = history[:, step: step + 1]
    return finished.nbest(nbest)


def _beam_rows(caps: Tensor, prefix: Tensor | None, beam: int, options: DecodeConfig,
               fixed_length: int | None, sync_free: bool = False) -> StepRows:
    """The processors' view of ``beam`` rows a sentence: limits (B,) and prefixes (B, P)
    repeated per row, sentence-major."""
    return StepRows(0, caps.repeat_interleave(beam),
                    None if prefix is None else prefix.repeat_interleave(beam, dim=0),
                    options, fixed_length, sync_free)


# ------------------------------------------------------------------------------ sync-free

class _DeviceDecoder:
    """The decoder side of a sync-free search step: the model's own ``decode_step`` and
    ``reorder_cache`` (histories move between buffers), or a :class:`StaticDecoder` (fixed
    addresses, for a recorded step)."""

    def __init__(self, model, cache, rows: int, capacity: int, device, static: bool):
        self.model, self.cache = model, cache
        self.static = StaticDecoder(model, cache, rows, capacity, device) if static else None

    def decode(self, prev: Tensor) -> Tensor:
        if self.static is not None:
            return self.static.decode(prev)
        return self.model.decode_step(prev, self.cache)

    def reorder(self, rows: Tensor) -> None:
        if self.static is not None:
            self.static.reorder(rows)
        else:
            self.model.reorder_cache(self.cache, rows, within_groups=True)


@torch.inference_mode()
def greedy_search_sync_free(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                            *, limit: int | None = None, fixed_length: int | None = None,
                            prefix: Tensor | None = None, check_every: int = 8, **overrides
                            ) -> list[list[tuple[list[int], float]]]:
    """Greedy decoding of src (B, S) -> per sentence ``[(tokens, logprob)]``, the output of
    :func:`greedy_search` without a host sync inside a step: every sentence stays in the
    batch (a finished one writes PAD and adds nothing to its score) and whether all have
    finished is read once every ``check_every`` steps. The state lives in tensors updated
    in place and the step counter on the device, so that with ``graphs`` the whole step is
    recorded once as a CUDA graph and replayed (on CUDA; ``ranmt.inference.graphs``): the
    options' ``cuda_graphs``."""
    options = search_options(options, overrides)
    graphs, processors = options.cuda_graphs, processors_for(options, fixed_length)
    _check_every(check_every)
    batch, device = src.shape[0], src.device
    caps, capacity, cache = _start(model, src, options, limit, fixed_length, prefix)  # (B,)
    decoder = _DeviceDecoder(model, cache, batch, capacity, device, static=graphs)
    tokens = torch.full((batch, capacity), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.full((batch,), capacity, dtype=torch.long, device=device)  # capacity: live
    scores = torch.zeros(batch, device=device)
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
    step = torch.zeros((), dtype=torch.long, device=device)
    rows = StepRows(step, caps, prefix, options, fixed_length, sync_free=True)

    def one_step() -> None:
        logprobs = decoder.decode(prev)  # (B, V)
        apply_processors(processors, logprobs, rows)
        best_score, best = logprobs.max(dim=-1)  # (B,)
        live = lengths.eq(capacity)
        scores.add_(best_score.masked_fill(~live, 0.0))
        tokens.scatter_(1, step.expand(batch, 1), best.masked_fill(~live, PAD_ID)[:, None])
        lengths.copy_(torch.where(live & best.eq(EOS_ID), step, lengths))  # ended at step
        prev.copy_(best[:, None])
        step.add_(1)

    run = RecordedStep(one_step, device, graphs)
    for index in range(capacity):
        run()
        if (index + 1) % check_every == 0 and not bool(lengths.eq(capacity).any()):
            break
    lengths, scores, tokens = lengths.tolist(), scores.tolist(), tokens.tolist()
    return [[(tokens[row][: lengths[row]], scores[row])] for row in range(batch)]


def _check_every(check_every: int) -> None:
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1 (steps between checks whether every "
                         f"sentence is done), not {check_every}")


@torch.inference_mode()
def beam_search_sync_free(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                          *, limit: int | None = None, fixed_length: int | None = None,
                          prefix: Tensor | None = None, check_every: int = 8, **overrides
                          ) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) -> per sentence the ``nbest`` best ``(tokens, score)``:
    the hypotheses and scores of :func:`beam_search` without a host sync inside a step.

    Every sentence keeps its ``beam`` rows to the end. A sentence that is done (``beam``
    finished hypotheses, or nothing left to extend) takes no candidate and so gets -inf
    beam scores: none of its candidates is taken again; its rows go on being computed and
    are ignored. Finished
    hypotheses are written with scatters into a slot per sentence (candidates that do not
    finish go to a spare slot ``beam``), the beams are reordered within each sentence (the
    memory side of a grouped cache never moves), and whether every sentence is done is read
    once every ``check_every`` steps (at most ``check_every - 1`` wasted steps).

    The search's state (beam scores, histories, finished hypotheses, the step counter) lives
    in tensors updated in place, so that with ``graphs`` the whole step (decoder, selection,
    reorder) is recorded once as a CUDA graph and replayed (on CUDA; the decoder then runs
    at fixed addresses, ``ranmt.inference.graphs``; the options' ``cuda_graphs``); same
    hypotheses.
    """
    options = search_options(options, overrides)
    beam, graphs = options.beam, options.cuda_graphs
    processors = processors_for(options, fixed_length)
    _check_every(check_every)
    device, batch = src.device, src.shape[0]
    caps_all, capacity, cache = _start(model, src, options, limit, fixed_length, prefix,
                                       group=beam)  # caps (B,)
    decoder = _DeviceDecoder(model, cache, batch * beam, capacity, device, static=graphs)
    finished = Finished(batch, beam + 1, capacity, device)  # slot `beam`: the spare
    first_row = torch.arange(batch, device=device)[:, None] * beam  # (B, 1)
    beam_scores, history, prev = first_beams(batch, beam, capacity, device)
    step_penalty = penalties(capacity, options.lenpen, options.lenpen_style, device)
    step = torch.zeros((), dtype=torch.long, device=device)
    keep = torch.ones(batch, dtype=torch.bool, device=device)  # sentences not done
    # rows reorder within their sentence: each keeps its sentence's limit and prefix
    step_rows = _beam_rows(caps_all, prefix, beam, options, fixed_length, sync_free=True)
    step_rows.step = step

    def one_step() -> None:
        logprobs = decoder.decode(prev)  # (B*beam, V)
        apply_processors(processors, logprobs, step_rows)
        top_scores, top_beams, top_tokens = best_candidates(logprobs, beam_scores, beam)
        ends, extends, slots = select_candidates(top_scores, top_tokens, finished.counts,
                                                  beam)
        store_finished(finished, ends, slots, top_scores, top_beams, history, step,
                        step_penalty.gather(0, step.view(1)), beam)
        keep.copy_(finished.counts.lt(beam) & extends.any(1))
        # A done sentence takes no candidate (its slots are full, or none was finite), so
        # next_beams gives it -inf beam scores: it stays done without a mask.
        picked, next_scores = next_beams(extends, top_scores, beam)  # (B, beam)
        beam_scores.copy_(next_scores)
        rows = (first_row + top_beams.gather(1, picked)).view(-1)  # within each sentence
        decoder.reorder(rows)
        history.copy_(history.index_select(0, rows))
        prev.copy_(top_tokens.gather(1, picked).view(-1, 1))
        history.scatter_(1, step.expand(batch * beam, 1), prev)
        step.add_(1)

    run = RecordedStep(one_step, device, graphs)
    for index in range(capacity):
        run()
        if (index + 1) % check_every == 0 and not bool(keep.any()):
            break
    return finished.nbest(options.nbest)


def search(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None, *,
           fixed_length: int | None = None, reference: bool = False,
           prefix: Tensor | None = None, sync_free: bool | None = None,
           check_every: int = 8, **overrides) -> list[list[tuple[list[int], float]]]:
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
    CUDA (the same fixed-address step run eagerly elsewhere; ``ranmt.inference.graphs``)."""
    options = search_options(options, overrides)
    graphs = options.cuda_graphs
    if graphs and (reference or sync_free is False):
        raise ValueError("graphs replay the sync-free search's step: not with the reference "
                         "or the shrinking search")
    if sync_free is None:
        sync_free = graphs or src.device.type != "cpu"
    if reference:
        greedy, beam_fn, extra = greedy_search_reference, beam_search_reference, {}
    elif sync_free:
        greedy, beam_fn = greedy_search_sync_free, beam_search_sync_free
        extra = {"check_every": check_every}
    else:
        greedy, beam_fn, extra = greedy_search, beam_search, {}
    fn = greedy if options.beam == 1 else beam_fn
    return fn(model, src, options, fixed_length=fixed_length, prefix=prefix, **extra)
