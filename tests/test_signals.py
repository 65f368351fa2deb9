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


_CLOCK_CHILD = """
import sys, time
from ranmt.runtime.signals import RunningClock
with RunningClock() as clock:
    wall, running = time.monotonic(), clock.now()
    print("ready", flush=True)
    while clock.now() - running < 2.0:  # busy, reading the clock as a training loop does
        clock.now()
        time.sleep(0.01)
    print(time.monotonic() - wall, clock.now() - running, clock.stopped, flush=True)
"""


def test_the_running_clock_leaves_out_the_time_its_process_was_stopped():
    """A process stopped (SIGSTOP) for a second and continued (SIGCONT) reads about a
    second less on its RunningClock than on the wall (the trainer's step times, tokens/s,
    wall_time_s and max_time budget use it), and exactly the wall time when never stopped."""
    import os

    from ranmt.runtime.signals import RunningClock

    child = subprocess.Popen([sys.executable, "-c", _CLOCK_CHILD], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(child.pid, signal.SIGCONT)
        wall, running, stopped = map(float, child.stdout.readline().split())
    finally:
        child.kill()
        child.wait()
    assert wall >= 2.0 + 0.9  # the child's wall clock went on while it was stopped
    assert 0.9 <= stopped <= 1.5  # a pause counts from the clock's last reading (10 ms)
    assert running == pytest.approx(wall - stopped, abs=0.05)
    with RunningClock() as clock:  # never stopped: the wall clock
        start, wall_start = clock.now(), time.monotonic()
        time.sleep(0.05)
        assert clock.now() - start == pytest.approx(time.monotonic() - wall_start, abs=0.01)
        assert clock.stopped == 0.0
