"""Decoding: greedy and batched beam search over the incremental-decoding cache.

Both searches take a source batch (B, S) and return, per sentence, a list of hypotheses
``(tokens, score)`` best first (tokens without BOS/EOS). The output length is limited to
``max_len = a * |src| + b`` tokens (EOS not counted); at that length only EOS is allowed,
in both searches, so beam size 1 reproduces greedy decoding exactly.

Length penalty (normalising the summed log-probability of a finished hypothesis of |Y|
tokens including EOS): ``gnmt``: ``((5 + |Y|) / 6) ** alpha`` (Wu et al., 2016), or
``fairseq``: ``|Y| ** alpha``.

Target prefixes (``prefix`` (B, P) token ids, right-padded with PAD): for the first
``len(prefix[b])`` steps sentence b may only write its prefix token, whose log-probability
counts in the score; the search continues freely after it, and the length limit is raised to
the prefix length where it is shorter. Sampling (``ranmt.inference.sampling``) runs through
:func:`greedy_search` with another ``pick``.

Three implementations of each search, with the same hypotheses and scores: the reference
(growing caches, Python bookkeeping: the oracle of the tests), the fast shrinking search
(static caches, finished sentences leave the batch: the fastest on a CPU) and the sync-free
search (:func:`beam_search_sync_free`, :func:`greedy_search_sync_free`): every row stays in
the batch to the end with masks in place of a shrinking active set, so that no step reads a
device value on the host (no ``.item()``, ``bool(tensor)``, ``nonzero()``, boolean-mask
indexing); whether everyone is done is read once every ``check_every`` steps. On a GPU the
host then queues step after step without waiting for the device. :func:`search` picks it
on CUDA and the shrinking search elsewhere unless told (``sync_free``). With ``graphs`` the
sync-free search's whole step (its decoder at fixed addresses) is, on CUDA, recorded once as
a CUDA graph and replayed (``ranmt.inference.graphs``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ranmt.config import DecodeConfig, decode_with
from ranmt.inference.graphs import RecordedStep, StaticDecoder
from ranmt.model import BOS_ID, EOS_ID, PAD_ID, Seq2Seq

_DEFAULTS = DecodeConfig()  # never modified: decode_with copies

BEAM_FIELDS = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "nbest")
"""The :class:`ranmt.config.DecodeConfig` fields a beam search reads."""


def search_options(options: DecodeConfig | None, overrides: dict) -> DecodeConfig:
    """The decoding options of a search: ``options`` (the declared defaults when None) with
    keyword ``overrides`` of its fields, converted and checked by
    :func:`ranmt.config.decode_with` (an unknown name is an error naming the closest)."""
    if not overrides:  # a DecodeConfig is checked when it is made (decode_with, the config)
        return _DEFAULTS if options is None else options
    return decode_with(_DEFAULTS if options is None else options, **overrides)


def _options(options: DecodeConfig | None, overrides: dict, *names: str) -> tuple:
    """The values of fields ``names`` of :func:`search_options`."""
    resolved = search_options(options, overrides)
    return tuple(getattr(resolved, name) for name in names)


def length_penalty(length: int | Tensor, alpha: float, style: str = "gnmt"):
    """Divisor applied to a finished hypothesis' log-probability."""
    if style == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if style == "fairseq":
        return length ** alpha
    raise ValueError(f"unknown length penalty style '{style}' (gnmt | fairseq)")


def max_lengths(src: Tensor, a: float, b: int, limit: int) -> Tensor:
    """(B,) output length limits a*|src|+b (|src| without EOS/padding), capped at ``limit``."""
    src_len = src.ne(PAD_ID).sum(1) - 1
    return torch.clamp((a * src_len.float() + b).floor().long(), min=1, max=limit)


# ------------------------------------------------------------------------------ reference


@torch.no_grad()
def greedy_search_reference(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                            *, limit: int | None = None, fixed_length: int | None = None,
                            prefix: Tensor | None = None, **overrides
                            ) -> list[list[tuple[list[int], float]]]:
    """Greedy decoding of src (B, S) -> per sentence ``[(tokens, logprob)]`` (the reference:
    growing caches, every sentence stays in the batch until all are done)."""
    max_len_a, max_len_b = _options(options, overrides, "max_len_a", "max_len_b")
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask)
    batch = src.shape[0]
    caps = output_caps(src, max_len_a, max_len_b, limit, fixed_length)  # (B,)
    caps = caps_with_prefix(caps, prefix_lengths(prefix, batch, src.device), limit)
    everyone = torch.arange(batch, device=src.device)
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=src.device)
    tokens = torch.zeros(batch, 0, dtype=torch.long, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    for step in range(int(caps.max()) + 1):
        logprobs = model.decode_step(prev, cache)  # (B, V)
        _constrain(logprobs, step, fixed_length, caps, prefix, everyone)
        best_score, best = logprobs.max(dim=-1)
        best = best.masked_fill(finished, PAD_ID)
        scores += best_score.masked_fill(finished, 0.0)
        tokens = torch.cat([tokens, best[:, None]], dim=1)
        finished |= best.eq(EOS_ID)
        if bool(finished.all()):
            break
        prev = best[:, None]
    results = []
    for row in range(batch):
        seq = tokens[row].tolist()
        seq = seq[: seq.index(EOS_ID)] if EOS_ID in seq else seq
        results.append([(seq, float(scores[row]))])
    return results


def output_caps(src: Tensor, a: float, b: int, limit: int,
                fixed_length: int | None = None) -> Tensor:
    """(B,) output length limits: ``a*|src|+b`` capped at ``limit``, or ``fixed_length``."""
    if fixed_length is None:
        return max_lengths(src, a, b, limit)
    if not 1 <= fixed_length <= limit:
        raise ValueError(f"fixed length must be in 1..{limit} (the model's max_positions - 1),"
                         f" not {fixed_length}")
    return torch.full((src.shape[0],), fixed_length, dtype=torch.long, device=src.device)


def _suppress_early_eos(logprobs: Tensor, step: int, fixed_length: int | None) -> None:
    """Fixed-length mode: EOS is not allowed before ``fixed_length`` tokens (in place)."""
    if fixed_length is not None and step < fixed_length:
        logprobs[:, EOS_ID] = float("-inf")


def _only_eos(logprobs: Tensor) -> Tensor:
    out = torch.full_like(logprobs, float("-inf"))
    out[:, EOS_ID] = logprobs[:, EOS_ID]
    return out


def prefix_lengths(prefix: Tensor | None, batch: int, device) -> Tensor:
    """(B,) number of prefix tokens per sentence (0 without a prefix)."""
    if prefix is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if prefix.dim() != 2 or prefix.shape[0] != batch:
        raise ValueError(f"prefix must be (batch={batch}, P) token ids, not "
                         f"{tuple(prefix.shape)}")
    if bool(prefix.eq(EOS_ID).any()):
        raise ValueError("a target prefix may not contain EOS")
    return prefix.ne(PAD_ID).sum(1)


def caps_with_prefix(caps: Tensor, prefix_len: Tensor, limit: int) -> Tensor:
    """Output length limits raised to the prefix length (checked against ``limit``)."""
    if bool(prefix_len.gt(limit).any()):
        raise ValueError(f"a target prefix of {int(prefix_len.max())} tokens is longer than "
                         f"the model's output limit of {limit} tokens")
    return torch.maximum(caps, prefix_len)


def _force_prefix(logprobs: Tensor, step: int, prefix: Tensor | None, sentences: Tensor
                  ) -> None:
    """Rows (n, V) of ``sentences`` (n,) still inside their prefix at ``step`` may only write
    the prefix token, with its own log-probability (in place)."""
    if prefix is None or step >= prefix.shape[1]:
        return
    wanted = prefix[sentences, step]  # (n,)
    rows = wanted.ne(PAD_ID).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    tokens = wanted[rows]
    kept = logprobs[rows, tokens]
    logprobs[rows] = float("-inf")
    logprobs[rows, tokens] = kept


def _constrain(logprobs: Tensor, step: int, fixed_length: int | None, caps: Tensor,
               prefix: Tensor | None, sentences: Tensor) -> None:
    """All per-step constraints on rows (n, V) of ``sentences`` (n,) with limits ``caps``
    (n,), in place: no EOS before a fixed length, only EOS at the limit, the prefix."""
    _suppress_early_eos(logprobs, step, fixed_length)
    force_eos = step >= caps
    if bool(force_eos.any()):
        logprobs[force_eos] = _only_eos(logprobs[force_eos])
    _force_prefix(logprobs, step, prefix, sentences)


@torch.no_grad()
def beam_search_reference(model: Seq2Seq, src: Tensor, options: DecodeConfig | None = None,
                          *, limit: int | None = None, fixed_length: int | None = None,
                          prefix: Tensor | None = None, **overrides
                          ) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) -> per sentence the ``nbest`` best ``(tokens, score)``
    (the reference: growing caches, bookkeeping in Python per sentence).

    Scores are length-normalised log-probabilities. A sentence is done once it holds
    ``beam`` finished hypotheses; done sentences are removed from the batch (their cache
    entries dropped), so the work shrinks as the batch finishes.
    """
    beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest = _options(
        options, overrides, *BEAM_FIELDS)
    limit = model.config.max_positions - 1 if limit is None else limit
    device = src.device
    batch = src.shape[0]
    memory, pad_mask, _ = model.encode(src)
    caps_all = output_caps(src, max_len_a, max_len_b, limit, fixed_length)
    caps_all = caps_with_prefix(caps_all, prefix_lengths(prefix, batch, device), limit)
    # Every sentence has `beam` decoder rows: row b*beam + k is beam k of sentence b; the
    # memory side of the cache stays per sentence where the cross-attention allows it.
    cache = model.init_cache(memory, pad_mask, group=beam)
    active = torch.arange(batch, device=device)  # sentence ids still decoding
    beam_scores = torch.full((batch, beam), float("-inf"), device=device)
    beam_scores[:, 0] = 0.0  # all beams start identical: only the first is alive
    beam_tokens = torch.zeros(batch * beam, 0, dtype=torch.long, device=device)
    prev = torch.full((batch * beam, 1), BOS_ID, dtype=torch.long, device=device)
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(batch)]

    step = 0
    while active.numel() > 0:
        n_active = active.numel()
        logprobs = model.decode_step(prev, cache)  # (n*beam, V)
        vocab = logprobs.shape[-1]
        rows_sentences = active.repeat_interleave(beam)
        _constrain(logprobs, step, fixed_length, caps_all[rows_sentences], prefix,
                   rows_sentences)
        # The best 2k extensions of a sentence are among the best 2k tokens of each of its
        # beams (adding a beam's score does not reorder its row), so select per row first
        # and then among beam * 2k candidates: no (beam x V) sum and no top-k over it.
        width = min(2 * beam, vocab)
        row_scores, row_tokens = logprobs.topk(width, dim=1)  # (n*beam, 2k)
        candidates = (beam_scores.view(-1, 1) + row_scores).view(n_active, beam * width)
        top_scores, top_ids = candidates.topk(min(2 * beam, beam * width), dim=1)  # (n, 2k)
        top_beams = torch.div(top_ids, width, rounding_mode="floor")
        top_tokens = row_tokens.view(n_active, beam * width).gather(1, top_ids)

        # Move everything needed for bookkeeping to the CPU once per step.
        top_scores_c, top_beams_c = top_scores.tolist(), top_beams.tolist()
        top_tokens_c = top_tokens.tolist()
        prefixes = beam_tokens.view(n_active, beam, -1)
        next_rows, next_tokens, next_scores, keep_sentences = [], [], [], []
        for i in range(n_active):
            sentence = int(active[i])
            chosen = 0
            for score, beam_idx, token in zip(top_scores_c[i], top_beams_c[i], top_tokens_c[i]):
                if score == float("-inf"):
                    break
                if token == EOS_ID:
                    hyp = prefixes[i, beam_idx].tolist()
                    norm = score / length_penalty(len(hyp) + 1, lenpen, lenpen_style)
                    if len(finished[sentence]) < beam:
                        finished[sentence].append((hyp, norm))
                else:
                    next_rows.append(i * beam + beam_idx)
                    next_tokens.append(token)
                    next_scores.append(score)
                    chosen += 1
                if chosen == beam or len(finished[sentence]) >= beam:
                    break
            if len(finished[sentence]) >= beam or chosen == 0:
                # Done: beam finished hypotheses (or nothing left to extend).
                if chosen:
                    del next_rows[-chosen:], next_tokens[-chosen:], next_scores[-chosen:]
                continue
            for _ in range(beam - chosen):  # fewer live candidates than beams: pad dead ones
                next_rows.append(next_rows[-1])
                next_tokens.append(next_tokens[-1])
                next_scores.append(float("-inf"))
            keep_sentences.append(i)

        if not keep_sentences:
            break
        rows = torch.tensor(next_rows, dtype=torch.long, device=device)
        model.reorder_cache(cache, rows)
        beam_tokens = torch.cat(
            [beam_tokens.index_select(0, rows),
             torch.tensor(next_tokens, dtype=torch.long, device=device)[:, None]], dim=1)
        beam_scores = torch.tensor(next_scores, device=device).view(len(keep_sentences), beam)
        active = active[torch.tensor(keep_sentences, dtype=torch.long, device=device)]
        prev = beam_tokens[:, -1:]
        step += 1

    results = []
    for hyps in finished:
        hyps = sorted(hyps, key=lambda item: -item[1])[:nbest]
        results.append(hyps if hyps else [([], -math.inf)])
    return results


# ------------------------------------------------------------------------------ fast path


def _start(model: Seq2Seq, src: Tensor, max_len_a: float, max_len_b: int,
           limit: int | None, fixed_length: int | None, prefix: Tensor | None,
           group: int = 1) -> tuple[Tensor, int, dict]:
    """Encode src (B, S) for a static-cache search: (output length limits (B,), the cache
    capacity (the longest limit + 1), the decoder cache for ``group`` rows a sentence)."""
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = model.encode(src)
    caps = output_caps(src, max_len_a, max_len_b, limit, fixed_length)
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
    max_len_a, max_len_b = _options(options, overrides, "max_len_a", "max_len_b")
    batch, device = src.shape[0], src.device
    caps, capacity, cache = _start(model, src, max_len_a, max_len_b, limit, fixed_length,
                                   prefix)  # caps (B,)
    tokens = torch.full((batch, capacity), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.full((batch,), capacity, dtype=torch.long, device=device)
    scores = torch.zeros(batch, device=device)
    active = torch.arange(batch, device=device)  # sentences still decoding
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
    for step in range(capacity):
        logprobs = model.decode_step(prev, cache)  # (n, V)
        _constrain(logprobs, step, fixed_length, caps[active], prefix, active)
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
            model.reorder_cache(cache, keep)
        prev = best[:, None]
    lengths, scores, tokens = lengths.tolist(), scores.tolist(), tokens.tolist()
    return [[(tokens[row][: lengths[row]], scores[row])] for row in range(batch)]


def row_topk(scores: Tensor, k: int, block: int = 64) -> tuple[Tensor, Tensor]:
    """``scores.topk(k, dim=1)`` for wide rows (n, V), sorted, in fewer passes over memory.

    The k largest entries of a row lie in the k blocks (of ``block`` columns) with the
    largest maxima, so one max per block (a vectorised reduction), a top-k over the V/block
    maxima and a top-k over those k blocks give the same values and ids as a top-k over the
    row (ties between equal scores aside, which no caller relies on). Narrow rows go to
    ``topk`` directly.
    """
    rows, width = scores.shape
    full = width // block * block
    if full < 16 * block or k * block * 4 > width:
        return scores.topk(k, dim=1)
    blocks = scores[:, :full].view(rows, full // block, block)
    best_blocks = blocks.amax(-1).topk(k, dim=1).indices  # (n, k)
    offsets = torch.arange(block, device=scores.device)
    candidates = blocks.gather(1, best_blocks[..., None].expand(-1, -1, block))
    ids = best_blocks[..., None] * block + offsets  # (n, k, block)
    candidates, ids = candidates.view(rows, k * block), ids.view(rows, k * block)
    if full < width:  # the columns after the last whole block are always candidates
        candidates = torch.cat([candidates, scores[:, full:]], dim=1)
        tail = torch.arange(full, width, device=scores.device).expand(rows, -1)
        ids = torch.cat([ids, tail], dim=1)
    top, where = candidates.topk(k, dim=1)
    return top, ids.gather(1, where)


def best_candidates(logprobs: Tensor, beam_scores: Tensor, beam: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Each sentence's best 2k extensions, best first: (scores, beam index, token), each
    (n, 2k), of log-probs (n*beam, V) added to ``beam_scores`` (n, beam). As in the
    reference: the best 2k tokens of each row (:func:`row_topk`), then the best 2k of the
    sentence's beam * 2k candidates."""
    width = min(2 * beam, logprobs.shape[-1])
    row_scores, row_tokens = row_topk(logprobs, width)  # (n*beam, 2k)
    sentences = beam_scores.shape[0]
    candidates = (beam_scores.view(-1, 1) + row_scores).view(sentences, beam * width)
    top_scores, top_ids = candidates.topk(min(2 * beam, beam * width), dim=1)  # (n, 2k)
    top_beams = torch.div(top_ids, width, rounding_mode="floor")
    top_tokens = row_tokens.view(sentences, beam * width).gather(1, top_ids)
    return top_scores, top_beams, top_tokens


def first_candidates(logprobs: Tensor, beam: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`best_candidates` of a first step taken with one row a sentence, log-probs
    (n, V): what it returns for those rows repeated ``beam`` times with beam scores
    (0, -inf, ..., -inf), without the (n * beam, V) copy. The candidates of beams 1.. are
    -inf either way, so the top-k runs over the same values in the same places and returns
    the same result, ties included."""
    width = min(2 * beam, logprobs.shape[-1])
    row_scores, row_tokens = row_topk(logprobs, width)  # (n, 2k)
    candidates = row_scores.new_full((row_scores.shape[0], beam * width), float("-inf"))
    candidates[:, :width] = row_scores
    top_scores, top_ids = candidates.topk(min(2 * beam, beam * width), dim=1)  # (n, 2k)
    top_beams = torch.div(top_ids, width, rounding_mode="floor")
    top_tokens = row_tokens.repeat(1, beam).gather(1, top_ids)  # every beam's row alike
    return top_scores, top_beams, top_tokens


def _first_beams(batch: int, beam: int, capacity: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The beams before the first step: scores (B, beam) (all beams start identical, so only
    the first is alive), token histories (B*beam, capacity), previous tokens (B*beam, 1)."""
    beam_scores = torch.full((batch, beam), float("-inf"), device=device)
    beam_scores[:, 0] = 0.0
    history = torch.zeros(batch * beam, capacity, dtype=torch.long, device=device)
    prev = torch.full((batch * beam, 1), BOS_ID, dtype=torch.long, device=device)
    return beam_scores, history, prev


class Finished:
    """Up to ``beam`` finished hypotheses per sentence, in the order they finished:
    scores (B, beam) (length-normalised), tokens (B, beam, capacity), lengths, counts."""

    def __init__(self, batch: int, beam: int, capacity: int, device: torch.device):
        self.scores = torch.full((batch, beam), float("-inf"), device=device)
        self.tokens = torch.zeros(batch, beam, capacity, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, beam, dtype=torch.long, device=device)
        self.counts = torch.zeros(batch, dtype=torch.long, device=device)

    def add(self, sentences: Tensor, slots: Tensor, scores: Tensor, prefixes: Tensor) -> None:
        """Store hypotheses: sentence ids (m,), slot within the sentence (m,), normalised
        scores (m,), token prefixes (m, L) (all of the same length L)."""
        self.scores[sentences, slots] = scores
        self.tokens[sentences, slots, : prefixes.shape[1]] = prefixes
        self.lengths[sentences, slots] = prefixes.shape[1]

    def nbest(self, nbest: int) -> list[list[tuple[list[int], float]]]:
        """Per sentence the ``nbest`` best (tokens, score), ties in finishing order."""
        counts, lengths = self.counts.tolist(), self.lengths.tolist()
        scores, tokens = self.scores.tolist(), self.tokens.tolist()
        results = []
        for sentence, count in enumerate(counts):
            hyps = [(tokens[sentence][slot][: lengths[sentence][slot]], scores[sentence][slot])
                    for slot in range(count)]
            hyps = sorted(hyps, key=lambda item: -item[1])[:nbest]
            results.append(hyps if hyps else [([], -math.inf)])
        return results


def select_candidates(top_scores: Tensor, top_tokens: Tensor, finished_before: Tensor,
                       beam: int) -> tuple[Tensor, Tensor, Tensor]:
    """Which of each sentence's best 2k candidates (n, 2k), best first, are taken.

    The candidates are read in order until ``beam`` of them extend a hypothesis or the
    sentence holds ``beam`` finished ones (``finished_before`` (n,) before this step);
    -inf candidates are never taken. Returns the masks (n, 2k) of the finishing (EOS)
    and the extending candidates, and for each EOS candidate its finished slot (n, 2k).
    """
    is_eos = top_tokens.eq(EOS_ID)
    eos_before = is_eos.long().cumsum(1) - is_eos.long()  # EOS candidates ahead of each
    extend_before = (~is_eos).long().cumsum(1) - (~is_eos).long()
    slot = finished_before[:, None] + eos_before
    taken = top_scores.gt(float("-inf")) & extend_before.lt(beam) & slot.lt(beam)
    return taken & is_eos, taken & ~is_eos, slot


def next_beams(extends: Tensor, top_scores: Tensor, beam: int) -> tuple[Tensor, Tensor]:
    """Candidate index (n, beam) of each sentence's next beams: its extending candidates in
    order, padded with copies of the last one at score -inf; and their scores (n, beam)."""
    width = extends.shape[1]
    positions = torch.arange(width, device=extends.device)
    first_extending = torch.where(extends, positions, positions + width).argsort(1)[:, :beam]
    count = extends.sum(1, keepdim=True)  # (n, 1)
    slots = torch.arange(beam, device=extends.device)[None]
    last = first_extending.gather(1, (count - 1).clamp(min=0))
    picked = torch.where(slots < count, first_extending, last)
    scores = top_scores.gather(1, picked).masked_fill(slots >= count, float("-inf"))
    return picked, scores


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
    beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest = _options(
        options, overrides, *BEAM_FIELDS)
    device, batch = src.device, src.shape[0]
    caps_all, capacity, cache = _start(model, src, max_len_a, max_len_b, limit, fixed_length,
                                       prefix, group=beam)  # caps (B,)
    finished = Finished(batch, beam, capacity, device)
    active = torch.arange(batch, device=device)  # sentence ids still decoding
    beam_scores, history, prev = _first_beams(batch, beam, capacity, device)
    for step in range(capacity):
        logprobs = model.decode_step(prev, cache)  # (n*beam, V)
        rows_sentences = active.repeat_interleave(beam)
        _constrain(logprobs, step, fixed_length, caps_all[rows_sentences], prefix,
                   rows_sentences)
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
        history = history.index_select(0, rows)
        history[:, step] = top_tokens[kept].gather(1, picked).view(-1)
        active = active[kept]
        prev = history[:, step: step + 1]
    return finished.nbest(nbest)


# ------------------------------------------------------------------------------ sync-free


def constrain_rows(logprobs: Tensor, step: Tensor, fixed_length: int | None,
                    caps: Tensor, prefix: Tensor | None) -> None:
    """:func:`_constrain` for every row at once, without reading a device value on the host:
    rows (N, V), their limits ``caps`` (N,) and forced prefixes ``prefix`` (N, P) or None
    (in place). ``step``: the step of every row (a 0-dim tensor: the sync-free searches), or
    each row's own (N,) (step-level batching, ``ranmt.inference.continuous``)."""
    per_row = step.dim() == 1
    if fixed_length is not None:
        logprobs[:, EOS_ID].masked_fill_(step.lt(fixed_length), float("-inf"))
    if per_row:  # step-level batching (a CPU search): only the rows at their limit, found
        at_limit = caps.le(step).nonzero()[:, 0]  # on the host, are rewritten
        if at_limit.numel():
            logprobs[at_limit] = _only_eos(logprobs[at_limit])
    else:
        eos = logprobs[:, EOS_ID].clone()  # rows at their limit keep EOS only, at its value
        logprobs.masked_fill_(caps.le(step)[:, None], float("-inf"))
        logprobs[:, EOS_ID] = eos
    if prefix is None:
        return
    steps = step if per_row else step.expand(logprobs.shape[0])  # (N,)
    inside = steps.lt(prefix.shape[1])[:, None]  # PAD where a row's prefix has ended
    wanted = prefix.gather(1, steps.clamp(max=prefix.shape[1] - 1)[:, None])
    wanted = wanted.masked_fill(~inside, PAD_ID)  # (N, 1)
    forced = wanted.ne(PAD_ID)
    kept = logprobs.gather(1, wanted)  # (N, 1)
    logprobs.masked_fill_(forced, float("-inf"))
    logprobs.scatter_(1, wanted, torch.where(forced, kept, logprobs.gather(1, wanted)))


def _penalties(capacity: int, lenpen: float, style: str, device) -> Tensor:
    """(capacity,) float32: the length penalty of a hypothesis finishing at each step (the
    values the host would compute, so that scores equal the other searches')."""
    return torch.tensor([length_penalty(step + 1, lenpen, style) for step in range(capacity)],
                        dtype=torch.float32, device=device)


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
    max_len_a, max_len_b, graphs = _options(options, overrides, "max_len_a", "max_len_b",
                                            "cuda_graphs")
    _check_every(check_every)
    batch, device = src.shape[0], src.device
    caps, capacity, cache = _start(model, src, max_len_a, max_len_b, limit, fixed_length,
                                   prefix)  # caps (B,)
    decoder = _DeviceDecoder(model, cache, batch, capacity, device, static=graphs)
    tokens = torch.full((batch, capacity), PAD_ID, dtype=torch.long, device=device)
    lengths = torch.full((batch,), capacity, dtype=torch.long, device=device)  # capacity: live
    scores = torch.zeros(batch, device=device)
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=device)
    step = torch.zeros((), dtype=torch.long, device=device)

    def one_step() -> None:
        logprobs = decoder.decode(prev)  # (B, V)
        constrain_rows(logprobs, step, fixed_length, caps, prefix)
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
    beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest, graphs = _options(
        options, overrides, *BEAM_FIELDS, "cuda_graphs")
    _check_every(check_every)
    device, batch = src.device, src.shape[0]
    caps_all, capacity, cache = _start(model, src, max_len_a, max_len_b, limit, fixed_length,
                                       prefix, group=beam)  # caps (B,)
    decoder = _DeviceDecoder(model, cache, batch * beam, capacity, device, static=graphs)
    finished = Finished(batch, beam + 1, capacity, device)  # slot `beam`: the spare
    row_caps = caps_all.repeat_interleave(beam)  # (B*beam,)
    row_prefix = None if prefix is None else prefix.repeat_interleave(beam, dim=0)
    first_row = torch.arange(batch, device=device)[:, None] * beam  # (B, 1)
    beam_scores, history, prev = _first_beams(batch, beam, capacity, device)
    penalties = _penalties(capacity, lenpen, lenpen_style, device)  # (capacity,)
    step = torch.zeros((), dtype=torch.long, device=device)
    keep = torch.ones(batch, dtype=torch.bool, device=device)  # sentences not done

    def one_step() -> None:
        logprobs = decoder.decode(prev)  # (B*beam, V)
        constrain_rows(logprobs, step, fixed_length, row_caps, row_prefix)
        top_scores, top_beams, top_tokens = best_candidates(logprobs, beam_scores, beam)
        ends, extends, slots = select_candidates(top_scores, top_tokens, finished.counts,
                                                  beam)
        store_finished(finished, ends, slots, top_scores, top_beams, history, step,
                        penalties.gather(0, step.view(1)), beam)
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
    return finished.nbest(nbest)


def store_finished(finished: Finished, ends: Tensor, slots: Tensor, top_scores: Tensor,
                    top_beams: Tensor, history: Tensor, step: Tensor, penalty: Tensor,
                    beam: int) -> None:
    """Write the finishing candidates ``ends`` (B, 2k) of every sentence into their slots
    (B, 2k) of ``finished`` (scores divided by ``penalty``, the beam's history (B*beam,
    capacity) up to ``step``) with scatters; the other candidates land in the spare slot.
    ``step`` and ``penalty``: tensors, 0-dim or (1,) (every sentence at the same step), or
    (B, 1) under step-level batching."""
    batch, width = ends.shape
    target = torch.where(ends, slots, beam)  # (B, 2k)
    finished.scores.scatter_(1, target, top_scores / penalty)
    finished.lengths.scatter_(1, target, step.expand_as(target))
    capacity = history.shape[1]
    hypotheses = history.view(batch, -1, capacity).gather(
        1, top_beams[..., None].expand(-1, -1, capacity))  # (B, 2k, capacity)
    finished.tokens.scatter_(1, target[..., None].expand(-1, -1, capacity), hypotheses)
    finished.counts += ends.sum(1)


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
