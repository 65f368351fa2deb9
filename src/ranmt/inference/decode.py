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
(``ranmt.inference.graphs``). The state a step changes (tokens, scores, beams, finished
hypotheses; its decoder) is :mod:`ranmt.inference.search_state`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ranmt.config import DecodeConfig, decode_with
from ranmt.inference.graphs import CompiledStep, RecordedStep
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
from ranmt.inference.search_state import BeamState, GreedyState, SearchDecoder
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
from ranmt.model import Seq2Seq


def search_options(options: DecodeConfig | None, overrides: dict) -> DecodeConfig:
    """The decoding options of a search: ``options`` (the declared defaults when None) with
    keyword ``overrides`` of its fields, converted and checked by
    :func:`ranmt.config.decode_with` (an unknown name is an error naming the closest)."""
    if not overrides:  # a DecodeConfig is checked when it is made (decode_with, the config)
        return DecodeConfig() if options is None else options
    return decode_with(DecodeConfig() if options is None else options, **overrides)


# ------------------------------------------------------------------------------ the loop


def _padded_memory(memory: Tensor | list[Tensor], pad_mask: Tensor, columns: int
                   ) -> tuple[Tensor | list[Tensor], Tensor]:
    """The encoder's output (B, S, d) (an ensemble's: one per member) and its padding mask
    (B, S) with ``columns`` more source positions, zeros and masked: a compiled step's
    graphs are made for source lengths in buckets, the encoder runs at the batch's own."""
    if isinstance(memory, list):
        return [_padded_memory(m, pad_mask, columns)[0] for m in memory], \
            F.pad(pad_mask, (0, columns), value=True)
    return F.pad(memory, (0, 0, 0, columns)), F.pad(pad_mask, (0, columns), value=True)


def _start(model: Seq2Seq, src: Tensor, options: DecodeConfig, limit: int | None,
           fixed_length: int | None, prefix: Tensor | None, group: int = 1, bucket: int = 1,
           compiled: bool = False) -> tuple[Tensor, int, dict]:
    """Encode src (B, S) for a static-cache search (``compiled``: through
    :meth:`CompiledStep.encode`, at the batch's own length): (output length limits (B,),
    the cache capacity (the longest limit + 1, rounded up to a multiple of ``bucket``
    within the model's positions), the decoder cache for ``group`` rows a sentence, its
    source side padded to a multiple of ``bucket`` columns, masked)."""
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = CompiledStep.encode(model, src) if compiled else model.encode(src)
    if bucket > 1 and src.shape[1] % bucket:  # the step's source side in columns of bucket
        memory, pad_mask = _padded_memory(memory, pad_mask, -src.shape[1] % bucket)
    caps = output_caps(src, options.max_len_a, options.max_len_b, limit, fixed_length)
    caps = caps_with_prefix(caps, prefix_lengths(prefix, src.shape[0], src.device), limit)
    capacity = min(-(-(int(caps.max()) + 1) // bucket) * bucket, limit + 1)
    return caps, capacity, model.init_cache(memory, pad_mask, group=group, capacity=capacity)


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
    if compiled:  # the weights' derived tensors computed eagerly, before any tracing
        CompiledStep.warm(model, lambda base: run_search(
            base, src[:1], greedy=True, fixed_length=1, beam=1, nbest=1, compile_step=False))
    caps, capacity, cache = _start(model, src, options, limit, fixed_length, prefix, group,
                                   bucket, compiled)
    decoder = SearchDecoder(model, cache, batch * group, capacity, device, static,
                       graphs or compiled, pin=not compiled,
                       grow=CompiledStep.GROW if compiled else 0)
    row_caps, row_prefix = caps, prefix
    if group > 1:  # a sentence's beam rows share its limit and prefix (sentence-major)
        row_caps = caps.repeat_interleave(group)
        row_prefix = None if prefix is None else prefix.repeat_interleave(group, dim=0)
    rows = StepRows(0, row_caps, row_prefix, options, fixed_length, sync_free=static)
    state = GreedyState(batch, capacity, device, rows, decoder, pick, static) if greedy \
        else BeamState(batch, capacity, device, rows, decoder, options, static)
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
