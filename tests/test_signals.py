"""ranmt.runtime.signals: a process started with SIGINT / SIGTERM ignored (the background of a
non-interactive shell, ``nohup ... &`` in a script) still stops on them: the CLI and the
local launcher's jobs restore them; children started inside
``children_honour_stop_signals`` get them too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import sys, time
from ranmt.runtime import signals
if sys.argv[1] == "restore":
    print(signals.honour_stop_signals(), flush=True)
else:
    print([], flush=True)
try:
    time.sleep(30)
except KeyboardInterrupt:
    sys.exit(3)
"""


@pytest.mark.parametrize(("sig", "restored", "code"), [
    # KeyboardInterrupt as from a terminal (caught: 3; arrived before the try: -SIGINT)
    (signal.SIGINT, "['SIGINT', 'SIGTERM']", {3, -signal.SIGINT}),
    (signal.SIGTERM, "['SIGINT', 'SIGTERM']", {-signal.SIGTERM})])
def test_a_process_started_with_stop_signals_ignored_stops_on_them_once_restored(sig, restored,
                                                                               code):
    def both_ignored():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    for mode in ("restore", "leave"):
        child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE,
                                 text=True, preexec_fn=both_ignored)
        try:
            said = child.stdout.readline().strip()
            child.send_signal(sig)
            if mode == "restore":
                assert said == restored and child.wait(timeout=10) in code
            else:  # the control: ignored, it sleeps on
                with pytest.raises(subprocess.TimeoutExpired):
                    child.wait(timeout=1)
        finally:
            child.kill()
            child.wait(timeout=10)


def test_children_started_inside_the_context_get_sigint_back_and_the_parent_keeps_its_own():
    from ranmt.runtime.signals import children_honour_stop_signals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with children_honour_stop_signals():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored on leaving
        time.sleep(0.5)  # Python has installed its handler
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=10) != 0  # KeyboardInterrupt, not ignored
    finally:
        signal.signal(signal.SIGINT, previous)
