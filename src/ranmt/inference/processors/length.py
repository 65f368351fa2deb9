"""Length rules of every search, as step processors: no EOS before a fixed length
(``fixed_length``, a speed measurement's equal work) and only EOS at a row's output length
limit (``max_len_a * |src| + max_len_b``, ``decode.max_len_a``/``max_len_b``, raised to a
forced prefix's length), so that every hypothesis ends by its limit and beam size 1
reproduces greedy search exactly."""

from __future__ import annotations

from torch import Tensor

from ranmt.config import DecodeConfig
from ranmt.inference.processors import Processor, StepRows, register_processor
from ranmt.model import EOS_ID


def only_eos(logprobs: Tensor) -> Tensor:
    """Rows (n, V) with every entry -inf but EOS's, which keeps its value (a new tensor)."""
    out = logprobs.new_full(logprobs.shape, float("-inf"))
    out[:, EOS_ID] = logprobs[:, EOS_ID]
    return out


@register_processor
class FixedLength(Processor):
    """No EOS while a row has written fewer than ``fixed_length`` tokens (the limit then
    forces it at ``fixed_length``: every caps entry equals it)."""

    name, order = "fixed_length", 10

    def __init__(self, length: int):
        self.length = length

    @classmethod
    def build(cls, options: DecodeConfig, fixed_length: int | None) -> FixedLength | None:
        return None if fixed_length is None else cls(fixed_length)

    def __call__(self, logprobs: Tensor, rows: StepRows) -> None:
        if isinstance(rows.step, Tensor):  # no host read: a mask over the rows
            logprobs[:, EOS_ID].masked_fill_(rows.step.lt(self.length), float("-inf"))
        elif rows.step < self.length:
            logprobs[:, EOS_ID] = float("-inf")


@register_processor
class LengthLimit(Processor):
    """At its length limit (``rows.caps``) a row may only write EOS, at EOS's own
    log-probability."""

    name, order = "length_limit", 20
    fields = ("max_len_a", "max_len_b")

    @classmethod
    def build(cls, options: DecodeConfig, fixed_length: int | None) -> LengthLimit:
        return cls()

    def __call__(self, logprobs: Tensor, rows: StepRows) -> None:
        at_limit = rows.caps.le(rows.step)  # (N,)
        if rows.sync_free:  # every row rewritten under a mask, EOS's column put back
            eos = logprobs[:, EOS_ID].clone()
            logprobs.masked_fill_(at_limit[:, None], float("-inf"))
            logprobs[:, EOS_ID] = eos
            return
        chosen = at_limit.nonzero()[:, 0]  # only the rows at their limit are rewritten
        if chosen.numel():
            logprobs[chosen] = only_eos(logprobs[chosen])
