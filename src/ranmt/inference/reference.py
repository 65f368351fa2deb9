"""The reference searches: the tests' oracles, outside the production path.

Greedy and beam search written the plain way: growing caches, every constraint applied
with its own code here (not the step processors of ``ranmt.inference.processors``), the
beam bookkeeping in Python per sentence. The production searches
(``ranmt.inference.decode``, ``ranmt.inference.continuous``) must give the same hypotheses
and scores; ``tests/test_search_oracle.py`` checks these against an exhaustive search.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ranmt.config import DecodeConfig
from ranmt.inference.lengths import (
    caps_with_prefix,
    length_penalty,
    output_caps,
    prefix_lengths,
)
from ranmt.model import BOS_ID, EOS_ID, PAD_ID, Seq2Seq

BEAM_FIELDS = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "nbest")
"""The :class:`ranmt.config.DecodeConfig` fields a beam search reads."""


def _options(options: DecodeConfig | None, overrides: dict, *names: str) -> tuple:
    """The values of fields ``names`` of ``options`` (the declared defaults when None) with
    keyword ``overrides``, checked as the config checks them."""
    from ranmt.config import decode_with

    resolved = decode_with(DecodeConfig() if options is None else options, **overrides)
    return tuple(getattr(resolved, name) for name in names)


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


def _suppress_early_eos(logprobs: Tensor, step: int, fixed_length: int | None) -> None:
    """Fixed-length mode: EOS is not allowed before ``fixed_length`` tokens (in place)."""
    if fixed_length is not None and step < fixed_length:
        logprobs[:, EOS_ID] = float("-inf")


def _only_eos(logprobs: Tensor) -> Tensor:
    out = torch.full_like(logprobs, float("-inf"))
    out[:, EOS_ID] = logprobs[:, EOS_ID]
    return out


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
