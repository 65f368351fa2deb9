"""Beam-search selection as tensor operations over every sentence at once: each sentence's
best 2k candidates (:func:`best_candidates`), which of them finish or extend a hypothesis
(:func:`select_candidates`), the next beams (:func:`next_beams`) and the finished
hypotheses (:class:`Finished`, :func:`store_finished`). The production beam searches
(``ranmt.inference.decode``) and step-level batching (``ranmt.inference.continuous``) select
with these; the reference (``ranmt.inference.reference``) does it in Python per sentence,
and the tests check they agree.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ranmt.inference.lengths import length_penalty
from ranmt.model import BOS_ID, EOS_ID


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


def first_beams(batch: int, beam: int, capacity: int, device) -> tuple[Tensor, Tensor, Tensor]:
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

    def parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(scores, tokens, lengths, counts), each with the sentence dimension first."""
        return self.scores, self.tokens, self.lengths, self.counts

    def select(self, sentences: Tensor) -> None:
        """Keep the hypotheses of ``sentences`` (M,) only (a compacted search)."""
        self.scores, self.tokens, self.lengths, self.counts = (
            part.index_select(0, sentences) for part in self.parts())

    def copy_into(self, other: Finished, sentences: Tensor) -> None:
        """Write these sentences' hypotheses into ``other``'s sentences ``sentences`` (M,)."""
        for mine, theirs in zip(self.parts(), other.parts()):
            theirs.index_copy_(0, sentences, mine)

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


def penalties(capacity: int, lenpen: float, style: str, device) -> Tensor:
    """(capacity,) float32: the length penalty of a hypothesis finishing at each step (the
    values the host would compute, so that scores equal the other searches')."""
    return torch.tensor([length_penalty(step + 1, lenpen, style) for step in range(capacity)],
                        dtype=torch.float32, device=device)


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
