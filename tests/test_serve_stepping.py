"""``ranmt serve`` with step-level batching (``StepBatcher``): a request that arrives while
others decode starts at the next step and is answered when its own lines finish, with the
translations the Python API gives; the HTTP side answers while a long batch decodes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from ranmt.serve import ServeLimits, Work, create_app, wait_for_job  # noqa: E402
from ranmt.serve_batching import StepBatcher  # noqa: E402
from ranmt.translator import Translator  # noqa: E402


def _same(got, expected):
    """The same hypotheses, scores within float noise (rows share matrix products)."""
    assert [[tokens for tokens, _ in hyps] for hyps in got] == \
        [[tokens for tokens, _ in hyps] for hyps in expected]
    for hyps, wanted in zip(got, expected):
        assert [score for _, score in hyps] == pytest.approx([s for _, s in wanted], abs=1e-4)


async def _connected():
    return False


def test_a_request_arriving_mid_decoding_joins_at_the_next_step(reverse_run):
    """A one-line request submitted after two steps of a 24-line request starts at the next
    step, finishes before the long request, and both get the Python API's translations."""
    translator = Translator.load(reverse_run, device="cpu")
    long_lines = translator.encode_sources(["abcdefgh", "hgfedcba", "abcdhgfe"] * 8)
    short_line = translator.encode_sources(["ab"])
    work = Work.translate(beam=4, nbest=1)
    finished_at: dict[str, int] = {}

    async def scenario():
        executor = concurrent.futures.ThreadPoolExecutor(1)
        batcher = StepBatcher(translator, ServeLimits(batch_window_ms=1), executor)
        worker = asyncio.create_task(batcher.run())
        long_job = batcher.submit(long_lines, work, timeout_s=60)
        long_job.future.add_done_callback(lambda _: finished_at.setdefault("long", batcher.steps))
        while batcher.steps < 2:
            await asyncio.sleep(0.001)
        submitted = batcher.steps
        short_job = batcher.submit(short_line, work, timeout_s=60)
        short_job.future.add_done_callback(
            lambda _: finished_at.setdefault("short", batcher.steps))
        short = await wait_for_job(batcher, short_job, _connected)
        long = await wait_for_job(batcher, long_job, _connected)
        worker.cancel()
        executor.shutdown()
        return submitted, short, long

    submitted, short, long = asyncio.run(scenario())
    _same(short, translator.translate_ids(short_line, beam=4))
    _same(long, translator.translate_ids(long_lines, beam=4))
    # The steps it takes alone, plus at most the step under way when it arrived.
    alone, _ = translator.continuous_decoder(beam=4)
    alone.add("short", short_line[0])
    alone.run()
    assert finished_at["short"] - submitted <= alone.steps_taken + 1
    assert finished_at["short"] < finished_at["long"]


def test_health_is_answered_while_a_long_decoding_runs(translators, monkeypatch):
    """Every step takes 0.2 s: /health, /ready and /metrics still answer at once (a bound,
    not a benchmark: 1 s), and the slow request is answered."""
    from ranmt.continuous import ContinuousDecoder

    original = ContinuousDecoder.step

    def slow_step(self):
        time.sleep(0.2)
        return original(self)

    monkeypatch.setattr(ContinuousDecoder, "step", slow_step)
    limits = ServeLimits(max_lines=10, max_chars=200, batch_window_ms=1)
    with TestClient(create_app(translators, limits)) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(client.post, "/translate", json={"text": ["a b c d e f"] * 4})
        time.sleep(0.5)
        for path in ("/health", "/ready", "/metrics") * 3:
            start = time.perf_counter()
            assert client.get(path).status_code == 200
            assert time.perf_counter() - start < 1.0, path
        assert not busy.done()
        assert busy.result().status_code == 200


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
            assert all(other.result().status_code == 200 for other in others)
            company = company.result().json()
    assert alone == company
    texts = [hyp["text"] for entry in alone["translations"] for hyp in entry["nbest"]]
    assert len(texts) == 6
