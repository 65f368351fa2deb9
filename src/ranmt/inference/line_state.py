"""The search state of the sentences in a step-level batch (``ranmt.inference.continuous``):
per sentence its ticket, generator, step, length limit, prefix, beam scores, histories and
finished hypotheses (:class:`Sentences`), selected (sentences that go on) and merged
(lines that join) between two steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ranmt.inference.cache_joins import cat_padded
from ranmt.inference.selection import Finished
from ranmt.model import PAD_ID


@dataclass
class Sentences:
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

    def select(self, sentences: Tensor, rows: Tensor) -> Sentences:
        """The state of ``sentences`` (m,) (with their ``rows`` (m * group,))."""
        chosen = sentences.tolist()
        finished = None
        if self.finished is not None:
            finished = finished_from(
                lambda name: getattr(self.finished, name).index_select(0, sentences))
        return Sentences(
            [self.tickets[i] for i in chosen], [self.generators[i] for i in chosen],
            self.steps.index_select(0, sentences), self.caps.index_select(0, sentences),
            None if self.prefix is None else self.prefix.index_select(0, sentences),
            self.scores.index_select(0, sentences), self.history.index_select(0, rows),
            finished, self.prev.index_select(0, rows))


def merge_sentences(first: Sentences, second: Sentences) -> Sentences:
    """The running sentences followed by the joining ones (histories and prefixes padded)."""
    prefix = None
    if first.prefix is not None or second.prefix is not None:
        prefix = cat_padded(prefix_or_none(first), prefix_or_none(second), PAD_ID)
    finished = None
    if first.finished is not None:
        finished = finished_from(lambda name: cat_padded(
            getattr(first.finished, name), getattr(second.finished, name),
            -math.inf if name == "scores" else 0))
    return replace(
        first, tickets=first.tickets + second.tickets,
        generators=first.generators + second.generators,
        steps=torch.cat([first.steps, second.steps]), caps=torch.cat([first.caps, second.caps]),
        prefix=prefix, scores=torch.cat([first.scores, second.scores]),
        history=cat_padded(first.history, second.history), finished=finished,
        prev=torch.cat([first.prev, second.prev]))


def prefix_or_none(state: Sentences) -> Tensor:
    """The sentences' prefixes (n, P), or (n, 1) PAD (no prefix) when they have none."""
    if state.prefix is not None:
        return state.prefix
    return torch.full((len(state.tickets), 1), PAD_ID, dtype=torch.long,
                      device=state.steps.device)


def finished_from(part) -> Finished:
    """A :class:`ranmt.inference.decode.Finished` whose tensors are ``part(name)`` for each of its
    scores, tokens, lengths and counts (a selection or a merge of others)."""
    finished = Finished.__new__(Finished)
    for name in ("scores", "tokens", "lengths", "counts"):
        setattr(finished, name, part(name))
    return finished
