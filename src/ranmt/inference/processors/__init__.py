"""Step processors: the per-step rules of every search, over a step's log-probabilities.

A search step gives log-probabilities (N, V) for its N decoder rows. Before the search
selects from them, the batch's processors rewrite them in place, one after the other in
their ``order``: no EOS before a fixed length, only EOS at a row's length limit, the forced
target prefix (``ranmt.inference.processors.length``, ``.prefix``), and any processor
registered since. What a processor may read of the rows is a :class:`StepRows`: each row's
step (or one step for all), length limit, forced prefix, the decoding options, and whether
the step may read device values on the host (``sync_free``: a sync-free or recorded step
may not).

A new decoding option is one file: a :class:`Processor` subclass that declares its
:class:`ranmt.config.DecodeConfig` field(s) in ``declares`` (made with
:func:`ranmt.config.decode_option`: default, bounds, help, whether served) and is
registered with :func:`register_processor`. The field is then a flag of ``ranmt
translate`` / ``ranmt evaluate``, a keyword of the Python API, a field of the server's
request (``served=True``) and a key of ``decode.*`` in configs, and the processor runs in
every production search (greedy, beam, sync-free, sampling, step-level batching); the
reference searches (``ranmt.inference.reference``) are the tests' oracles and keep their
own rules. Built-in processors read fields declared in ``ranmt.config`` (``fields``).

Every processor must leave a row's log-probabilities as a function of that row alone (its
own step, limit, prefix), so that a line decoded beside others under step-level batching
gets what it gets alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ranmt.config import DecodeConfig, declare_decode_option, withdraw_decode_option


@dataclass
class StepRows:
    """The rows of one search step, as processors see them (N rows)."""

    step: int | Tensor
    """The step of every row (an int, or a 0-dim long tensor in a sync-free search), or
    each row's own (N,) (step-level batching): the number of tokens the row has written."""
    caps: Tensor
    """(N,) each row's output length limit: at that step only EOS may be written."""
    prefix: Tensor | None
    """(N, P) each row's forced target prefix, PAD-padded (column ids), or None."""
    options: DecodeConfig
    """The search's decoding options."""
    fixed_length: int | None = None
    """Every output exactly this long (a speed measurement's equal work), or None."""
    sync_free: bool = False
    """True: no device value may be read on the host (masks instead of row selections)."""

    @property
    def per_row(self) -> bool:
        """Whether each row is at its own step (step-level batching)."""
        return isinstance(self.step, Tensor) and self.step.dim() == 1

    def steps(self, count: int) -> Tensor:
        """(N,) each row's step as a tensor (``count`` = N)."""
        if self.per_row:
            return self.step
        if isinstance(self.step, Tensor):
            return self.step.expand(count)
        return torch.full((count,), self.step, dtype=torch.long, device=self.caps.device)

    def select(self, rows: Tensor) -> StepRows:
        """These rows' view: ``rows`` (M,) indexes caps, prefixes and per-row steps."""
        return dataclasses.replace(
            self, step=self.step.index_select(0, rows) if self.per_row else self.step,
            caps=self.caps.index_select(0, rows),
            prefix=None if self.prefix is None else self.prefix.index_select(0, rows))


class Processor:
    """One per-step rule over log-probabilities (N, V), applied in place.

    Subclasses set ``name``, ``order`` (smaller runs first), ``fields`` (the DecodeConfig
    fields it reads) and, for a new option, ``declares`` (field name -> (type, declaration
    from :func:`ranmt.config.decode_option`)); they implement :meth:`build` and
    :meth:`__call__`."""

    name: ClassVar[str] = ""
    order: ClassVar[int] = 100
    fields: ClassVar[tuple[str, ...]] = ()
    declares: ClassVar[dict[str, tuple[Any, dataclasses.Field]]] = {}

    @classmethod
    def build(cls, options: DecodeConfig, fixed_length: int | None) -> Processor | None:
        """The processor of a search with ``options``, or None where it has nothing to do
        (e.g. its option is off): a search runs only the processors that apply."""
        raise NotImplementedError

    def __call__(self, logprobs: Tensor, rows: StepRows) -> None:
        """Rewrite ``logprobs`` (N, V) of ``rows`` in place."""
        raise NotImplementedError


PROCESSORS: dict[str, type[Processor]] = {}
"""Registered processors by name, in the order they run (see :func:`register_processor`)."""


def register_processor(processor: type[Processor]) -> type[Processor]:
    """Register a processor (usable as a class decorator): its ``declares`` fields become
    DecodeConfig fields, and every production search runs it from now on."""
    if not processor.name or processor.name in PROCESSORS:
        raise ValueError(f"a processor needs a name not yet registered, not "
                         f"'{processor.name}'")
    declared = []
    try:
        for field_name, (kind, declaration) in processor.declares.items():
            declare_decode_option(field_name, kind, declaration)
            declared.append(field_name)
    except Exception:
        for field_name in declared:
            withdraw_decode_option(field_name)
        raise
    PROCESSORS[processor.name] = processor
    ordered = sorted(PROCESSORS.values(), key=lambda item: item.order)
    PROCESSORS.clear()
    PROCESSORS.update((item.name, item) for item in ordered)
    return processor


def unregister_processor(name: str) -> None:
    """Remove a registered processor and the DecodeConfig fields it declared."""
    processor = PROCESSORS.pop(name)
    for field_name in processor.declares:
        withdraw_decode_option(field_name)


def processors_for(options: DecodeConfig, fixed_length: int | None = None
                   ) -> tuple[Processor, ...]:
    """The processors of a search with ``options`` (those that apply), in order."""
    built = (processor.build(options, fixed_length) for processor in PROCESSORS.values())
    return tuple(processor for processor in built if processor is not None)


def apply_processors(processors: tuple[Processor, ...], logprobs: Tensor, rows: StepRows
                     ) -> None:
    """Run ``processors`` over ``logprobs`` (N, V) of ``rows``, in place, in order."""
    for processor in processors:
        processor(logprobs, rows)


from ranmt.inference.processors import length, prefix  # noqa: E402,F401  (the built-ins)
