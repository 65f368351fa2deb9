"""Stop signals a process honours whatever its parent ignored.

A command started in the background of a non-interactive shell (``nohup make test &`` inside
a script, a test runner started that way, a job of submitit's local executor under it)
inherits SIGINT ignored (POSIX), and an ignored signal stays ignored across ``exec``: Ctrl-C,
``kill -INT``, a grid script's forwarded SIGINT or submitit's cancel would then do nothing,
and Python does not even install its KeyboardInterrupt handler. :func:`honour_stop_signals`
gives such a process back the handling it would have had from a terminal.
"""

from __future__ import annotations

import contextlib
import signal


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
