"""Decoding: greedy and batched beam search over the incremental-decoding cache.

Both searches take a source batch (B, S) and return, per sentence, a list of hypotheses
``(tokens, score)`` best first (tokens without BOS/EOS). The output length is limited to
``max_len = a * |src| + b`` tokens (EOS not counted); at that length only EOS is allowed,
in both searches, so beam size 1 reproduces greedy decoding exactly.

Length penalty (normalising the summed log-probability of a finished hypothesis of |Y|
tokens including EOS): ``gnmt``: ``((5 + |Y|) / 6) ** alpha`` (Wu et al., 2016), or
``fairseq``: ``|Y| ** alpha``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ranmt.model import BOS_ID, EOS_ID, PAD_ID, Seq2Seq


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


@torch.no_grad()
def greedy_search(model: Seq2Seq, src: Tensor, max_len_a: float = 1.2, max_len_b: int = 10,
                  limit: int | None = None) -> list[list[tuple[list[int], float]]]:
    """Greedy decoding of src (B, S) -> per sentence ``[(tokens, logprob)]``."""
    limit = model.config.max_positions - 1 if limit is None else limit
    memory, pad_mask, _ = model.encode(src)
    cache = model.init_cache(memory, pad_mask)
    batch = src.shape[0]
    caps = max_lengths(src, max_len_a, max_len_b, limit)  # (B,)
    prev = torch.full((batch, 1), BOS_ID, dtype=torch.long, device=src.device)
    tokens = torch.zeros(batch, 0, dtype=torch.long, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    for step in range(int(caps.max()) + 1):
        logprobs = model.decode_step(prev, cache)  # (B, V)
        force_eos = step >= caps
        if bool(force_eos.any()):
            logprobs[force_eos] = _only_eos(logprobs[force_eos])
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


def _only_eos(logprobs: Tensor) -> Tensor:
    out = torch.full_like(logprobs, float("-inf"))
    out[:, EOS_ID] = logprobs[:, EOS_ID]
    return out


@torch.no_grad()
def beam_search(model: Seq2Seq, src: Tensor, beam: int = 4, lenpen: float = 0.6,
                lenpen_style: str = "gnmt", max_len_a: float = 1.2, max_len_b: int = 10,
                nbest: int = 1, limit: int | None = None) -> list[list[tuple[list[int], float]]]:
    """Batched beam search of src (B, S) -> per sentence the ``nbest`` best ``(tokens, score)``.

    Scores are length-normalised log-probabilities. A sentence is done once it holds
    ``beam`` finished hypotheses; done sentences are removed from the batch (their cache
    entries dropped), so the work shrinks as the batch finishes.
    """
    limit = model.config.max_positions - 1 if limit is None else limit
    device = src.device
    batch = src.shape[0]
    memory, pad_mask, _ = model.encode(src)
    caps_all = max_lengths(src, max_len_a, max_len_b, limit)
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
        caps = caps_all[active].repeat_interleave(beam)
        force = step >= caps
        if bool(force.any()):
            logprobs[force] = _only_eos(logprobs[force])
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


def search(model: Seq2Seq, src: Tensor, beam: int = 4, lenpen: float = 0.6,
           lenpen_style: str = "gnmt", max_len_a: float = 1.2, max_len_b: int = 10,
           nbest: int = 1) -> list[list[tuple[list[int], float]]]:
    """Greedy search for ``beam == 1``, beam search otherwise."""
    if beam < 1:
        raise ValueError(f"beam size must be >= 1, not {beam}")
    if beam == 1:
        return greedy_search(model, src, max_len_a, max_len_b)
    return beam_search(model, src, beam, lenpen, lenpen_style, max_len_a, max_len_b, nbest)
