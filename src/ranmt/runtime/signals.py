"""Stop signals a process honours whatever its parent ignored.

A command started in the background of a non-interactive shell (``nohup make test &`` inside
a script, a test runner started that way, a job of submitit's local executor under it)
inherits SIGINT ignored (POSIX), and an ignored signal stays ignored across ``exec``: Ctrl-C,
``kill -INT``, a grid script's forwarded SIGINT or submitit's cancel would then do nothing,
and Python does not even install its KeyboardInterrupt handler. :func:`honour_stop_signals`
gives such a process back the handling it would have had from a terminal.
:class:`RunningClock` is the other side of signals: a clock that stops while the process is
stopped (SIGSTOP ... SIGCONT).
"""

from __future__ import annotations

import contextlib
import signal
import time


def honour_stop_signals() -> list[str]:
    """SIGINT back to Python's KeyboardInterrupt and SIGTERM back to the default (end the
    process) where they were inherited ignored; the names of those restored. A no-op in a
    thread other than the main one (signals are only handled there)."""
    restored = []
    for sig, handler in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, signal.SIG_DFL)):
        with contextlib.suppress(ValueError):  # not the main thread
            if signal.getsignal(sig) is signal.SIG_IGN:
                signal.signal(sig, handler)
                restored.append(sig.name)
    return restored


@contextlib.contextmanager
def children_honour_stop_signals():
    """While inside: processes started from this one get SIGINT and SIGTERM back where this
    process has them ignored (an ignored disposition is inherited across ``exec``, a Python
    handler is reset to the default there). For children started by another library, such
    as submitit's local job controller, whose Ctrl-C / cancel must still reach them."""
    restored = honour_stop_signals()
    try:
        yield
    finally:
        for name in restored:  # ignored again, as this process had them
            signal.signal(signal.Signals[name], signal.SIG_IGN)


class RunningClock:
    """``time.monotonic()`` less the time this process spent stopped (SIGSTOP / SIGTSTP,
    then SIGCONT): a training's step times, tokens/s, ``wall_time_s`` and ``max_time``
    budget then measure the run, not the hours a grid was paused while other work measured
    speed on the same cores.

    Inside ``with clock:`` a SIGCONT handler adds the time since the clock was last read
    to :attr:`stopped` (the process cannot note the moment it is stopped, so a pause is
    counted from the last reading: at most the work done since then -- a step -- is
    counted as stopped too). Outside, or in a thread other than the main one, it is a plain
    monotonic clock."""

    def __init__(self):
        self.stopped = 0.0  # seconds spent stopped, as far as SIGCONT has told
        self._last = time.monotonic()
        self._previous = None

    def now(self) -> float:
        """Seconds on the running clock (a reading also marks the process as running)."""
        self._last = time.monotonic()
        return self._last - self.stopped

    def _continued(self, _signum, _frame) -> None:
        resumed = time.monotonic()
        self.stopped += resumed - self._last
        self._last = resumed

    def __enter__(self) -> RunningClock:
        with contextlib.suppress(ValueError):  # not in the main thread
            self._previous = signal.signal(signal.SIGCONT, self._continued)
        self._last = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGCONT, self._previous)
            self._previous = None
