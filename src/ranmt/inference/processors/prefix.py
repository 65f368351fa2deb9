"""Forced target prefixes as a step processor: a row still inside its prefix (``prefix``
(N, P), PAD-padded, passed with the sources: ``ranmt translate --prefix``, the server's
``target``) may only write its prefix token, whose log-probability counts in the score;
the search continues freely after it."""

from __future__ import annotations

import torch
from torch import Tensor

from ranmt.config import DecodeConfig
from ranmt.inference.processors import Processor, StepRows, register_processor
from ranmt.model import PAD_ID


@register_processor
class PrefixForcing(Processor):
    """Rows inside their prefix keep only the prefix token's log-probability (a gather and
    a scatter: no host read, every row at its own step)."""

    name, order = "prefix", 30

    @classmethod
    def build(cls, options: DecodeConfig, fixed_length: int | None) -> PrefixForcing:
        return cls()  # a prefix comes with the batch: rows.prefix None is a no-op

    def __call__(self, logprobs: Tensor, rows: StepRows) -> None:
        prefix = rows.prefix
        if prefix is None or (isinstance(rows.step, int) and rows.step >= prefix.shape[1]):
            return
        steps = rows.steps(logprobs.shape[0])  # (N,)
        inside = steps.lt(prefix.shape[1])[:, None]  # PAD where a row's prefix has ended
        wanted = prefix.gather(1, steps.clamp(max=prefix.shape[1] - 1)[:, None])
        wanted = wanted.masked_fill(~inside, PAD_ID)  # (N, 1)
        forced = wanted.ne(PAD_ID)
        kept = logprobs.gather(1, wanted)  # (N, 1)
        logprobs.masked_fill_(forced, float("-inf"))
        logprobs.scatter_(1, wanted, torch.where(forced, kept, logprobs.gather(1, wanted)))
