"""The messages between ``ranmt serve``'s event loop and a model's decoding worker process
(:mod:`ranmt.serving.supervisor` on the server's side, :mod:`ranmt.serving.worker` in the
child), one frozen dataclass each: fields by name, never positions in a tuple.

They travel over a :func:`multiprocessing.Pipe` between two processes of one server
(pickled by the pipe; never read from a file or a client). A line is named by its
``key``: the queue's number for one line of one request.

To the worker: :class:`AddLine`, :class:`CancelLines`, :class:`Stop`.
From it: :class:`Ready` (once loaded and warmed up), :class:`LoadFailed` (before it exits 1),
:class:`Stepped` (finished lines and the steps since the last report, at least every
:data:`ranmt.serving.worker.HEARTBEAT_S` while it decodes), :class:`LinesFailed` (a
decoder's step raised), :class:`CancelAcknowledged` (a :class:`CancelLines` was applied).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Hypotheses = list  # [(token ids, score), ...] best first, as decoding returns them


# ---------------------------------------------------------------------- to the worker
@dataclass(frozen=True, slots=True)
class AddLine:
    """Decode line ``line`` of a request: source ``ids``, target ``prefix`` (or None), with
    ``options`` (sorted (name, value) pairs of decoding settings), in the express lane or
    the main one (:meth:`ranmt.serving.lines.LineDecoding.step`)."""

    key: int
    options: tuple
    ids: list[int]
    prefix: list[int] | None
    line: int
    express: bool = False


@dataclass(frozen=True, slots=True)
class CancelLines:
    """Drop these lines from the decoding batch (never answered)."""

    keys: list[int]


@dataclass(frozen=True, slots=True)
class Stop:
    """The server is shutting down: exit."""


# ---------------------------------------------------------------------- from the worker
@dataclass(frozen=True, slots=True)
class Ready:
    """The model is loaded and has decoded once; ``warmup_s``: how long that decode took
    (the watchdog's grace for the first step, :meth:`ProcessDecoding.stall_limit_s`)."""

    warmup_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The model could not be loaded (the worker exits 1 next)."""

    error: str


@dataclass(frozen=True, slots=True)
class Stepped:
    """``steps`` decoding steps since the last report, ``sentences`` rows in the last one,
    the slowest of them ``slowest_s`` seconds; ``finished``: lines done meanwhile, as
    (key, hypotheses)."""

    finished: list[tuple[int, Hypotheses]] = field(default_factory=list)
    steps: int = 0
    sentences: int = 0
    slowest_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LinesFailed:
    """A decoder's step raised: its lines ``keys`` fail with ``error``."""

    keys: list[int]
    error: str


@dataclass(frozen=True, slots=True)
class CancelAcknowledged:
    """The worker applied one :class:`CancelLines` (the watchdog waits for it)."""


ToWorker = AddLine | CancelLines | Stop
FromWorker = Ready | LoadFailed | Stepped | LinesFailed | CancelAcknowledged
