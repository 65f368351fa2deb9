"""``ranmt serve`` with step-level batching (``StepBatcher``): a request that arrives while
others decode starts at the next step and is answered when its own lines finish, with the
translations the Python API gives; the HTTP side answers while a long batch decodes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from conftest import assert_same_hypotheses, assert_same_translations

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from ranmt.inference.translator import Translator  # noqa: E402
from ranmt.serving.app import ServeLimits, create_app  # noqa: E402
from ranmt.serving.batching import Work, wait_for_job  # noqa: E402
from ranmt.serving.step_batching import StepBatcher  # noqa: E402

BOUND_S = 30
"""The longest a test waits for a job (a mutant that never admits a line fails, not hangs)."""


async def _steps(batcher, count: int) -> None:
    """Return once ``batcher`` has taken ``count`` steps."""
    while batcher.steps < count:
        await asyncio.sleep(0.001)


async def _connected():
    return False


def test_a_request_arriving_mid_decoding_joins_at_the_next_step(reverse_run):
    """A one-line request submitted after two steps of a 24-line request starts within two
    steps, finishes before the long request, and both get the Python API's translations."""
    translator = Translator.load(reverse_run, device="cpu")
    long_lines = translator.encode_sources(["abcdefgh", "hgfedcba", "abcdhgfe"] * 8)
    short_line = translator.encode_sources(["ab"])
    work = Work.translate(beam=4, nbest=1)
    finished_at: dict[str, int] = {}

    async def scenario():
        executor = concurrent.futures.ThreadPoolExecutor(1)
        limits = ServeLimits(batch_window_ms=1, workers="thread")  # counts every step
        batcher = StepBatcher(translator, limits, executor)
        worker = asyncio.create_task(batcher.run())
        long_job = batcher.submit(long_lines, work, timeout_s=60)
        long_job.future.add_done_callback(lambda _: finished_at.setdefault("long", batcher.steps))
        await asyncio.wait_for(_steps(batcher, 2), BOUND_S)
        submitted = batcher.steps
        short_job = batcher.submit(short_line, work, timeout_s=60)
        short_job.future.add_done_callback(
            lambda _: finished_at.setdefault("short", batcher.steps))
        short = await asyncio.wait_for(wait_for_job(batcher, short_job, _connected), BOUND_S)
        long = await asyncio.wait_for(wait_for_job(batcher, long_job, _connected), BOUND_S)
        worker.cancel()
        executor.shutdown()
        return submitted, short, long

    submitted, short, long = asyncio.run(scenario())
    assert_same_hypotheses(short, translator.translate_ids(short_line, beam=4), 1e-4)
    assert_same_hypotheses(long, translator.translate_ids(long_lines, beam=4), 1e-4)
    # The steps it takes alone, plus the step under way when it arrived and at most one
    # waiting for company (join_wait).
    alone, _ = translator.continuous_decoder(beam=4)
    alone.add("short", short_line[0])
    alone.run()
    assert finished_at["short"] - submitted <= alone.steps_taken + 2
    assert finished_at["short"] < finished_at["long"]


def test_health_is_answered_while_a_long_decoding_runs(translators, monkeypatch):
    """Every step takes 0.2 s: /health, /ready and /metrics still answer at once (a bound,
    not a benchmark: 1 s), and the slow request is answered."""
    from ranmt.inference.continuous import ContinuousDecoder

    original = ContinuousDecoder.step

    def slow_step(self):
        time.sleep(0.2)
        return original(self)

    monkeypatch.setattr(ContinuousDecoder, "step", slow_step)
    limits = ServeLimits(max_lines=10, max_chars=200, batch_window_ms=1, workers="thread")
    with TestClient(create_app(translators, limits)) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.post, "/translate", json={"text": ["a b c d e f"] * 4})
        time.sleep(0.5)
        for path in ("/health", "/ready", "/metrics") * 3:
            start = time.perf_counter()
            assert client.get(path).status_code == 200
            assert time.perf_counter() - start < 1.0, path
        assert not busy.done()
        assert busy.result(timeout=BOUND_S).status_code == 200


def test_sampling_per_line_is_independent_of_company(translators):
    """A sampled request gets the same samples alone and decoded beside other requests
    (each line draws from a generator of its own, seeded by the request's seed)."""
    request = {"text": ["a b c", "d e f g"], "sampling": "topk", "topk": 5, "nbest": 3,
               "seed": 7}
    limits = ServeLimits(max_lines=10, max_chars=200, batch_window_ms=30)
    with TestClient(create_app(translators, limits)) as client:
        alone = client.post("/translate", json=request).json()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            others = [pool.submit(client.post, "/translate",
                                  json={"text": ["h i j"] * 3, "sampling": "topk", "topk": 5,
                                        "nbest": 3, "seed": seed}) for seed in (1, 2)]
            company = pool.submit(client.post, "/translate", json=request)
            assert all(other.result(timeout=BOUND_S).status_code == 200 for other in others)
            company = company.result(timeout=BOUND_S).json()
    assert_same_translations(alone, company)
    texts = [hyp["text"] for entry in alone["translations"] for hyp in entry["nbest"]]
    assert len(texts) == 6


def test_a_killed_decoding_worker_is_restarted_and_its_requests_get_500(translators):
    """With decoding in a worker process: while the worker is frozen (SIGSTOP: as busy as a
    worker can be) /health, /metrics, /ready and a refusal answer at once; killed with a
    request in it, that request gets 500, a new worker is started, and the request that
    waited in the queue meanwhile is translated as the Python API does."""
    import os
    import signal

    limits = ServeLimits(max_lines=10, max_chars=200, batch_window_ms=1, workers="process",
                         max_batch_lines=1, max_queued_tokens=4, worker_nice=7)
    expected = translators["transf"].translate(["d e f"])[0]
    with TestClient(create_app(translators, limits)) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        engine = client.app.state.served.batchers["transf"].engine
        first_pid = engine.process.pid
        assert os.getpriority(os.PRIO_PROCESS, first_pid) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + 7)  # --worker-nice
        os.kill(first_pid, signal.SIGSTOP)
        held = pool.submit(client.post, "/translate", json={"text": ["a b c"]})
        _until(lambda: engine.held)  # its line was sent to the frozen worker
        queued = pool.submit(client.post, "/translate", json={"text": ["d e f"]})
        batcher = client.app.state.served.batchers["transf"]
        _until(lambda: batcher.queued_tokens >= 4)  # waits: one line decodes at a time
        for path in ("/health", "/metrics", "/ready"):
            start = time.perf_counter()
            assert client.get(path).status_code == 200
            assert time.perf_counter() - start < 1.0, path
        start = time.perf_counter()
        refused = client.post("/translate", json={"text": ["g h"]})
        assert refused.status_code == 503 and time.perf_counter() - start < 1.0
        os.kill(first_pid, signal.SIGKILL)
        answer = held.result(timeout=60)
        assert answer.status_code == 500 and "exited" in answer.json()["error"]
        waited = queued.result(timeout=60)
        assert waited.status_code == 200
        assert waited.json()["translations"][0]["text"] == expected
        assert engine.restarts == 1 and engine.process.pid != first_pid
        assert client.get("/ready").status_code == 200


def _until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_worker_that_cannot_start_fails_the_servers_start(runs):
    """A decoding worker that exits before it is ready (here: its checkpoint is gone) stops
    the server's start with the reason, instead of being restarted for ever."""
    translator = Translator.load(runs["transf"], device="cpu")
    translator.load_options = {**translator.load_options, "checkpoint": ["/nonexistent/run"]}
    limits = ServeLimits(max_lines=10, max_chars=200, workers="process")
    with pytest.raises(RuntimeError, match="before it was ready"), \
            TestClient(create_app({"transf": translator}, limits)):
        pass
