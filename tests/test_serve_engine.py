"""The server's side of step-level decoding, without a model: the typed messages between the
event loop and a decoding worker (:mod:`ranmt.serving.messages`), readiness as the
supervisor's state (:class:`ranmt.serving.supervisor.ProcessDecoding`), the first step's
grace, and a scheduling loop (:meth:`ranmt.serving.step_batching.StepBatcher.run`) that never
goes round without letting the event loop run its other tasks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import time

import pytest

from ranmt.config import DecodeConfig
from ranmt.serving import messages
from ranmt.serving.batching import Work
from ranmt.serving.limits import ServeLimits
from ranmt.serving.step_batching import StepBatcher
from ranmt.serving.supervisor import ProcessDecoding


def _run(main):
    return asyncio.run(asyncio.wait_for(main(), timeout=20))


@pytest.mark.parametrize("message", [
    messages.AddLine(7, (("beam", 4), ("nbest", 2)), [5, 6, 2], [9], line=3, express=True),
    messages.AddLine(8, (), [5], None, line=0),
    messages.CancelLines([1, 2, 3]),
    messages.Stop(),
    messages.Ready(warmup_s=0.25),
    messages.LoadFailed("FileNotFoundError: no checkpoint"),
    messages.Stepped([(7, [([4, 5], -1.5), ([4], -2.0)])], steps=3, sentences=32,
                     slowest_s=0.01),
    messages.Stepped(),
    messages.LinesFailed([7, 8], "RuntimeError: boom"),
    messages.CancelAcknowledged(),
])
def test_the_worker_messages_round_trip_a_pipe_with_their_fields(message):
    """What one end sends the other reads back: the same type and the same fields by name
    (the pipe pickles them between the two processes)."""
    parent, child = multiprocessing.Pipe()
    parent.send(message)
    received = child.recv()
    assert type(received) is type(message) and received == message
    assert received is not message
    for field in dataclasses.fields(received):  # frozen: not edited on its way
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(received, field.name, None)


class _FakeProcess:
    pid = 0

    def __init__(self):
        self.killed = 0

    def kill(self):
        self.killed += 1


def _engine(**limits) -> ProcessDecoding:
    engine = ProcessDecoding({}, "m1", on_done=lambda *a: None, on_failed=lambda *a: None,
                             on_steps=lambda *a: None, limits=ServeLimits(**limits))
    engine._loop = asyncio.get_running_loop()
    engine.process = _FakeProcess()
    return engine


async def _finishes_within(coroutine, seconds: float) -> bool:
    task = asyncio.ensure_future(coroutine)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    task.cancel()
    return bool(done)


def test_a_killed_stalled_worker_is_not_ready_and_wait_ready_waits_for_its_replacement():
    """Readiness is the supervisor's state: the watchdog's kill leaves ``ready`` at once,
    and :meth:`ProcessDecoding.wait_ready` then waits (it returned at once while the event
    that the first ``ready`` had set stayed set) until a replacement says it is ready."""
    async def main():
        engine = _engine()
        assert not await _finishes_within(engine.wait_ready(), 0.05)  # starting
        engine._handle(messages.Ready(warmup_s=0.0))
        assert engine.ready and await _finishes_within(engine.wait_ready(), 0.05)
        engine._kill("it was stalled: no decoding step for 6.0 s", cause="stalled")
        assert engine.process.killed == 1
        assert not engine.ready and engine.state == "loading"
        assert engine.reason.startswith("it was stalled")
        assert not await _finishes_within(engine.wait_ready(), 0.2)
        waiting = asyncio.ensure_future(engine.wait_ready())
        await asyncio.sleep(0.01)
        engine._handle(messages.Ready(warmup_s=0.0))  # the replacement
        await asyncio.wait_for(waiting, 1)
        assert engine.ready and engine.reason is None
    _run(main)


def test_a_worker_killed_for_a_broken_pipe_is_not_ready_either():
    async def main():
        engine = _engine()
        engine._handle(messages.Ready())
        engine._kill("the pipe to it broke (BrokenPipeError)")
        assert not engine.ready
        assert not await _finishes_within(engine.wait_ready(), 0.1)
    _run(main)


def test_the_first_step_has_the_warm_up_as_grace():
    """Before its first step a worker's stall limit is ``--worker-stall-s`` plus the time its
    warm-up decode took (was: plus 0); later, plus its slowest step."""
    async def main():
        engine = _engine(worker_stall_s=5.0)
        assert engine.stall_limit_s() == 5.0
        engine._handle(messages.Ready(warmup_s=2.5))
        assert engine.stall_limit_s() == pytest.approx(7.5)
        engine._handle(messages.Stepped([], steps=4, sentences=8, slowest_s=0.5))
        assert engine.stall_limit_s() == pytest.approx(7.5)  # the grace stays the floor
        engine._handle(messages.Stepped([], steps=1, sentences=64, slowest_s=4.0))
        assert engine.stall_limit_s() == pytest.approx(9.0)
    _run(main)


class _NeverReadyEngine:
    """An engine that is not ready and whose ``wait_ready`` returns at once: what the
    supervisor's old readiness event gave after a stalled worker's kill."""

    ready = False
    state = "loading"
    reason = "it was stalled"
    restarts = 0

    def __init__(self):
        self.waits = 0

    async def start(self):
        pass

    def stop(self):
        pass

    def retry_after(self):
        return 1.0

    async def wait_ready(self):
        self.waits += 1


class _FakeTranslator:
    load_options = None
    decode_config = DecodeConfig()


def test_the_scheduling_loop_never_spins_while_its_engine_is_not_ready():
    """A request queued while the engine is not ready (and its ``wait_ready`` does not
    block) must not make the scheduling loop go round without yielding: the event loop's
    other tasks (``/health``, the watchdog, the pipe) keep their turns, and the loop waits
    rather than spins. On the old loop a heartbeat task did not run until the request's
    deadline had passed (1 s), and ``wait_ready`` was called millions of times."""
    async def main():
        batcher = StepBatcher(_FakeTranslator(), ServeLimits(workers="thread"),
                              concurrent.futures.ThreadPoolExecutor(1))
        batcher.engine = _NeverReadyEngine()
        job = batcher.submit([[5, 6]], Work.translate(beam=1), timeout_s=1.0)
        gaps, last = [], time.perf_counter()

        async def heartbeat():
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        beats = asyncio.ensure_future(heartbeat())
        loop_task = asyncio.ensure_future(batcher.run())
        await asyncio.sleep(0.6)
        loop_task.cancel()
        beats.cancel()
        assert not job.future.done()  # still queued: nothing decoded it, nothing failed it
        assert len(gaps) >= 20 and max(gaps) < 0.25
        assert batcher.engine.waits <= 0.6 / 0.05 + 2  # one look per idle tick
    _run(main)


def test_the_event_loop_lag_is_measured_by_the_server_and_exported():
    """A callback that blocks the loop for 0.3 s shows as a lag of about 0.3 s in
    ``ranmt_event_loop_lag_seconds`` and its 10-second maximum; an idle loop's lag is small.
    The maximum forgets lags older than its window."""
    from ranmt.serving.runner import LoopLagMonitor, ServeMetrics

    async def main():
        metrics = ServeMetrics()
        monitor = LoopLagMonitor(metrics, period_s=0.02)
        task = asyncio.ensure_future(monitor.run())
        await asyncio.sleep(0.2)
        quiet = metrics.registry.get_sample_value("ranmt_event_loop_lag_max_seconds")
        asyncio.get_running_loop().call_soon(time.sleep, 0.3)  # a blocking call on the loop
        await asyncio.sleep(0.2)
        for _ in range(100):  # a loaded CI machine samples slower than every 0.02 s
            if metrics.registry.get_sample_value("ranmt_event_loop_lag_seconds_count") >= 10:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        blocked = metrics.registry.get_sample_value("ranmt_event_loop_lag_max_seconds")
        count = metrics.registry.get_sample_value("ranmt_event_loop_lag_seconds_count")
        assert quiet < 0.1 and 0.25 <= blocked < 0.6 and count >= 10
        assert metrics.registry.get_sample_value(
            "ranmt_event_loop_lag_seconds_bucket", {"le": "0.25"}) == count - 1
        monitor.window_s, monitor.clock = 1.0, lambda: time.perf_counter() + 5.0
        monitor.observe(0.01)  # 5 s later: the 0.3 s lag has left the window
        assert metrics.registry.get_sample_value("ranmt_event_loop_lag_max_seconds") == 0.01
    _run(main)
