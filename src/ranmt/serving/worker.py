"""A model's decoding worker process for ``ranmt serve`` (``--workers process``, the default):
the child's side. It loads the model itself (same checkpoint, device, quantization,
precision as the server), warms it up, says :class:`~ranmt.serving.messages.Ready`, then
takes lines from the pipe and steps (:class:`ranmt.serving.lines.LineDecoding`) for as long
as it holds any, reporting finished lines as they finish and at least every
:data:`HEARTBEAT_S` while it decodes (what the watchdog's "no step for N seconds" is
measured by). The server's side, which starts, watches and replaces it, is
:mod:`ranmt.serving.supervisor`; the messages are :mod:`ranmt.serving.messages`.

It ignores SIGINT (a terminal's Ctrl-C reaches the whole process group: the server decides
when its workers stop), runs at a lower scheduling priority (``nice`` 19 by default), and
dies with its parent (``PR_SET_PDEATHSIG`` on Linux; everywhere, it exits when the server's
end of its pipe closes).

The worker imports the translator and the runtime, never the server (a leaf of the serving
package).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from ranmt.serving.lines import LineDecoding
from ranmt.serving.messages import (
    AddLine,
    CancelAcknowledged,
    CancelLines,
    LinesFailed,
    LoadFailed,
    Ready,
    Stepped,
    Stop,
)

HEARTBEAT_S = 0.25
"""A worker that holds lines reports at least this often (after the step that passes it),
finished lines or not: what the watchdog's "no step for N seconds" is measured by."""


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent exits (the forkserver, which
    exits with the server). Elsewhere the closed pipe ends it (see :func:`decode_lines`)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(connection, load: dict, nice: int = 19) -> None:
    """The worker process: load the model, then take lines and step while it holds any.
    A model that cannot load is reported (:class:`LoadFailed`) before the process exits 1."""
    from ranmt.inference.translator import Translator
    from ranmt.runtime.memory import freeze_startup_heap

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
    die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(nice)
    try:
        translator = Translator.load(**load)
        started = time.monotonic()
        translator.warm_up()
        warmup_s = time.monotonic() - started
    except Exception as err:  # noqa: BLE001 (reported to the server, which retries)
        with contextlib.suppress(OSError, ValueError):
            connection.send(LoadFailed(f"{type(err).__name__}: {err}"))
        sys.exit(1)
    freeze_startup_heap()  # no full collection stalls a decoding step on the model's objects
    connection.send(Ready(warmup_s=warmup_s))
    with contextlib.suppress(EOFError, OSError):  # the server is gone: exit quietly
        decode_lines(connection, LineDecoding(translator))


def decode_lines(connection, lines: LineDecoding) -> None:
    """Take lines (and drops) from the pipe, and step while any are held; report finished
    lines as they finish, and at least every :data:`HEARTBEAT_S` while decoding."""
    steps, slowest, reported = 0, 0.0, time.monotonic()  # since the last report
    while True:
        if lines.idle() or connection.poll():
            message = connection.recv()  # blocks while there is nothing to decode
            if isinstance(message, Stop):
                return
            if isinstance(message, CancelLines):
                lines.cancel(set(message.keys))
                connection.send(CancelAcknowledged())
            elif isinstance(message, AddLine):
                lines.add(message.key, message.options, message.ids, message.prefix,
                          message.line, message.express)
            continue  # take every message already sent before the next step
        sentences = lines.sentences()
        started = time.monotonic()
        finished, failed = lines.step()
        now = time.monotonic()
        steps, slowest = steps + 1, max(slowest, now - started)
        if finished or now - reported >= HEARTBEAT_S:
            connection.send(Stepped(finished, steps, sentences, slowest))
            steps, slowest, reported = 0, 0.0, now
        for keys, err in failed:
            connection.send(LinesFailed(keys, f"{type(err).__name__}: {err}"))
