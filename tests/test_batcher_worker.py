"""ranmt.serving.batching's asynchronous workers without a model or a server: the batch-level
worker (``Batcher.run``, ``_wait_for_work``, ``_decode``, ``Work.run``) over a fake
translator, and the step-level worker (``StepBatcher``) over a fake decoding engine: what
each sends to the model, how each line's result reaches its job, the recent rate behind
Retry-After (exact values from a fake clock), the metrics and failures (docs/MUTATION.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from ranmt.config import DecodeConfig
from ranmt.serving import batching
from ranmt.serving.batching import Batcher, Work, wait_for_job
from ranmt.serving.limits import ServeLimits
from ranmt.serving.step_batching import StepBatcher

GREEDY = Work.translate(beam=1, nbest=1)


class FakeTranslator:
    """Records every call; a translation of ids is their reverse, scored -(its length)."""

    load_options = None
    decode_config = DecodeConfig()

    def __init__(self, fail: Exception | None = None):
        self.calls: list[tuple] = []
        self.fail = fail

    def translate_ids(self, ids, prefixes=None, **options):
        self.calls.append(("translate", ids, prefixes, options))
        if self.fail is not None:
            raise self.fail
        return [[(list(reversed(seq)), -float(len(seq)))] for seq in ids]

    def score_ids(self, ids, targets):
        self.calls.append(("score", ids, targets))
        return [float(len(src) + len(tgt)) for src, tgt in zip(ids, targets)]


class FakeClock:
    """``time.perf_counter`` replaced: returns the values given, in order."""

    def __init__(self, *values: float):
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def _metrics():
    from ranmt.serving.runner import ServeMetrics

    metrics = ServeMetrics()

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, {"model": "m1", **labels})
    return metrics, value


def _batcher(translator=None, metrics=None, name: str = "model", **limits) -> Batcher:
    """A batch-level batcher over ``translator`` (a new :class:`FakeTranslator` by default)
    with one decoding thread."""
    return Batcher(translator or FakeTranslator(), ServeLimits(**limits),
                   concurrent.futures.ThreadPoolExecutor(1), metrics, name=name)


def _run(main):
    return asyncio.run(asyncio.wait_for(main(), timeout=15))


async def _serve(batcher, *jobs):
    """Run ``batcher``'s worker until every job is answered; their futures' outcomes."""
    worker = asyncio.create_task(batcher.run())
    try:
        await asyncio.wait([job.future for job in jobs], timeout=5)  # ms when it works
    finally:
        worker.cancel()
    return [job.future.exception() or job.future.result() for job in jobs]


# ------------------------------------------------------------------ batch level
def test_work_runs_a_translation_with_its_options_and_a_scoring_with_its_targets():
    translator = FakeTranslator()
    work = Work.translate(beam=3, nbest=2, lenpen=None)
    assert work.run(translator, [[5, 6]], [[7]]) == [[([6, 5], -2.0)]]
    assert Work("score").run(translator, [[5, 6]], [[7, 8, 9]]) == [5.0]
    assert translator.calls == [("translate", [[5, 6]], [[7]], {"beam": 3, "nbest": 2}),
                                ("score", [[5, 6]], [[7, 8, 9]])]


def test_the_worker_decodes_waiting_jobs_in_one_batch_and_answers_each_line_in_place():
    async def main():
        translator = FakeTranslator()
        batcher = _batcher(translator, name="m1")
        first = batcher.submit([[1, 2, 3], [4]], GREEDY, timeout_s=60)
        second = batcher.submit([[5, 6]], GREEDY, timeout_s=60)
        results = await _serve(batcher, first, second)
        assert results == [[[([3, 2, 1], -3.0)], [([4], -1.0)]], [[([6, 5], -2.0)]]]
        # one batch, one line of each job per round, each job's shortest line first
        assert translator.calls == [("translate", [[4], [5, 6], [1, 2, 3]], None,
                                     {"beam": 1, "nbest": 1})]
        assert (batcher.batches, batcher.requests) == (1, 2)
        assert (batcher.pending, batcher.queued_tokens, batcher.queued_requests) == ([], 0, 0)
    _run(main)


def test_decoding_runs_in_the_servers_decoding_thread():
    """The batch is decoded in the executor the server gave (its one decoding thread, where
    PyTorch's threads are set), not in asyncio's default pool."""
    import threading

    class Recording(FakeTranslator):
        def translate_ids(self, ids, prefixes=None, **options):
            self.thread = threading.current_thread().name
            return super().translate_ids(ids, prefixes, **options)

    async def main():
        translator = Recording()
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decoding")
        batcher = Batcher(translator, ServeLimits(), executor)
        await _serve(batcher, batcher.submit([[1]], GREEDY, timeout_s=60))
        assert translator.thread.startswith("decoding")
    _run(main)


def test_prefixes_go_per_line_and_lines_of_a_job_without_them_get_none():
    async def main():
        translator = FakeTranslator()
        batcher = _batcher(translator)
        with_prefix = batcher.submit([[1, 1], [2]], GREEDY, timeout_s=60, extras=[[8], [9, 9]])
        without = batcher.submit([[3]], GREEDY, timeout_s=60)
        await _serve(batcher, with_prefix, without)
        assert translator.calls[0][1:3] == ([[2], [3], [1, 1]], [[9, 9], [], [8]])
    _run(main)


def test_the_first_rate_is_measured_and_later_ones_averaged_three_tenths_new(monkeypatch):
    monkeypatch.setattr(batching.time, "perf_counter",
                        FakeClock(10.0, 12.0, 20.0, 20.5, 30.0, 30.0))

    async def main():
        batcher = _batcher()
        loop = asyncio.get_running_loop()
        batcher.submit([[1, 2, 3], [4]], GREEDY, timeout_s=60)  # 4 + 2 source tokens
        await batcher._decode(loop, batcher.take_batch(loop.time()))
        assert batcher.tokens_per_s == pytest.approx(6 / 2.0)
        batcher.submit([[1] * 9], GREEDY, timeout_s=60)  # 10 tokens in 0.5 s
        await batcher._decode(loop, batcher.take_batch(loop.time()))
        assert batcher.tokens_per_s == pytest.approx(0.7 * 3.0 + 0.3 * 20.0)
        batcher.tokens_per_s = 0.0
        batcher.submit([[1]], GREEDY, timeout_s=60)  # no time measured: 2 tokens / 1 us
        await batcher._decode(loop, batcher.take_batch(loop.time()))
        assert batcher.tokens_per_s == pytest.approx(2 / 1e-6)
        assert batcher.batches == 3
    _run(main)


def test_batch_sizes_and_decoded_tokens_reach_the_metrics_scoring_decodes_none():
    metrics, value = _metrics()

    async def main():
        batcher = _batcher(metrics=metrics, name="m1")
        translation = batcher.submit([[1, 2, 3], [4]], GREEDY, timeout_s=60)
        await _serve(batcher, translation)
        assert value("ranmt_batch_sentences_count") == 1
        assert value("ranmt_batch_sentences_sum") == 2
        assert value("ranmt_decoded_tokens_total") == (3 + 1) + (1 + 1)  # best + EOS
        scoring = batcher.submit([[1, 2]], Work("score"), timeout_s=60, extras=[[3]])
        assert await _serve(batcher, scoring) == [[3.0]]
        assert value("ranmt_batch_sentences_count") == 2
        assert value("ranmt_batch_sentences_sum") == 3
        assert value("ranmt_decoded_tokens_total") == 6
    _run(main)


def test_a_failed_batch_fails_its_jobs_and_the_worker_goes_on():
    metrics, value = _metrics()

    async def main():
        error = RuntimeError("out of memory")
        translator = FakeTranslator(fail=error)
        batcher = _batcher(translator, metrics, name="m1")
        first = batcher.submit([[1], [2]], GREEDY, timeout_s=60)
        assert await _serve(batcher, first) == [error]
        assert value("ranmt_errors_total", kind="decoding") == 1
        assert (batcher.batches, batcher.requests, batcher.tokens_per_s) == (0, 0, 0.0)
        assert value("ranmt_batch_sentences_count") in (None, 0)
        translator.fail = None
        second = batcher.submit([[3]], GREEDY, timeout_s=60)
        assert await _serve(batcher, second) == [[[([3], -1.0)]]]
        assert batcher.batches == 1
    _run(main)


def _record_sleeps(monkeypatch) -> list[float]:
    """``asyncio.sleep`` in the batching module made instant; the delays asked for."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay, result=None):
        asked.append(delay)
        await real_sleep(0)
        return result
    monkeypatch.setattr(batching.asyncio, "sleep", sleep)
    return asked


@pytest.mark.parametrize(("older_age", "asked_for"), [(10.0, [90.0]), (200.0, [])])
def test_the_batch_window_counts_from_the_oldest_waiting_job(monkeypatch, older_age,
                                                             asked_for):
    """A 100 s window, the older job waiting 10 s: 90 s left; waiting 200 s: none."""
    asked = _record_sleeps(monkeypatch)

    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher(batch_window_ms=100_000)
        newer = batcher.submit([[1]], GREEDY, timeout_s=600)
        older = batcher.submit([[2]], GREEDY, timeout_s=600)
        older.arrived = loop.time() - older_age
        newer.arrived = loop.time()
        await batcher._wait_for_work(loop)
        assert asked == [pytest.approx(delay, abs=0.05) for delay in asked_for]
    _run(main)


@pytest.mark.parametrize(("queued", "waits"), [(9, True), (10, False), (11, False)])
def test_a_full_batch_waiting_does_not_wait_for_the_window(monkeypatch, queued, waits):
    asked = _record_sleeps(monkeypatch)

    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher(batch_window_ms=1000, max_batch_tokens=10)
        batcher.submit([[1] * (queued - 1)], GREEDY, timeout_s=600)
        assert batcher.queued_tokens == queued
        await batcher._wait_for_work(loop)
        assert len(asked) == int(waits)
        if waits:
            assert asked[0] == pytest.approx(1.0, abs=0.2)
    _run(main)


def test_the_worker_sleeps_until_a_job_arrives_and_answers_expired_ones_504():
    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher()
        expired = batcher.submit([[1]], GREEDY, timeout_s=-1)
        waiting = asyncio.create_task(batcher._wait_for_work(loop))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done()  # the expired job left the queue; nothing else waits
        assert expired.future.exception().status == 504 and batcher.pending == []
        batcher.submit([[2]], GREEDY, timeout_s=60)
        await asyncio.wait_for(waiting, timeout=5)
    _run(main)


# ------------------------------------------------------------------ a request's wait
class Client:
    """``is_disconnected`` of a request: gone from the ``after``-th question on."""

    def __init__(self, after: int | None = None):
        self.after, self.asked = after, 0

    async def __call__(self) -> bool:
        self.asked += 1
        return self.after is not None and self.asked >= self.after


def test_a_request_gets_its_jobs_results_once_the_worker_answers_them():
    async def main():
        batcher = _batcher()
        job = batcher.submit([[1, 2], [3]], GREEDY, timeout_s=60)
        worker = asyncio.create_task(batcher.run())
        try:
            results = await wait_for_job(batcher, job, Client(), poll_s=0.01)
        finally:
            worker.cancel()
        assert results == [[([2, 1], -2.0)], [([3], -1.0)]]
    _run(main)


def test_a_job_not_started_by_its_deadline_is_dropped_and_answered_504():
    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher()  # no worker runs
        job = batcher.submit([[1, 2]], GREEDY, timeout_s=0.05)
        with pytest.raises(batching.RequestError) as late:
            await wait_for_job(batcher, job, Client(), poll_s=10.0)
        assert late.value.status == 504 and late.value.message == (
            "the request waited past its deadline (timeout_s or --request-timeout) before its "
            "batch started; nothing was decoded")
        # answered at its deadline, not a poll (10 s) or a second later
        assert job.deadline <= loop.time() < job.deadline + 0.5
        assert job.dropped and batcher.pending == [] and batcher.queued_tokens == 0
    _run(main)


def test_a_client_gone_before_its_job_started_drops_the_job():
    async def main():
        batcher = _batcher()
        job = batcher.submit([[1, 2]], GREEDY, timeout_s=60)
        client = Client(after=3)
        assert await wait_for_job(batcher, job, client, poll_s=0.01) is None
        assert client.asked == 3 and job.dropped and batcher.pending == []
        assert batcher.queued_requests == 0 and not job.future.done()
    _run(main)


def test_a_started_job_is_answered_504_at_its_deadline():
    """The deadline holds once a job's lines are decoding too (issue 69): 504 at the
    deadline, its lines given up (a batch-level batch decodes on; its result is dropped)."""
    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher()
        job = batcher.submit([[1], [2]], GREEDY, timeout_s=0.2)
        batcher.take_batch(loop.time())  # started
        with pytest.raises(batching.RequestError) as raised:
            await wait_for_job(batcher, job, Client(), poll_s=0.05)
        assert raised.value.status == 504 and "while decoding" in raised.value.message
        assert job.deadline <= loop.time() < job.deadline + 0.5
        assert job.future.done() and batcher.queued_tokens == 0
        batcher._answer(job, 0, "a")  # the batch's results arrive late: dropped quietly
        batcher._answer(job, 1, "b")
    _run(main)


def test_a_started_job_whose_client_leaves_is_given_up():
    """A client that leaves while its job decodes: None (499), the job given up, its
    client asked at most every 10 polls (the check shares the event loop with decoding)."""
    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher()
        job = batcher.submit([[1], [2]], GREEDY, timeout_s=60)
        batcher.take_batch(loop.time())  # started
        client = Client(after=2)
        started = loop.time()
        assert await wait_for_job(batcher, job, client, poll_s=0.02) is None
        assert client.asked == 2 and 0.3 <= loop.time() - started < 2
        assert job.future.cancelled()
    _run(main)


def test_a_decoding_error_reaches_the_waiting_request():
    async def main():
        batcher = _batcher(FakeTranslator(fail=ValueError("bad line")))
        job = batcher.submit([[1]], GREEDY, timeout_s=60)
        worker = asyncio.create_task(batcher.run())
        try:
            with pytest.raises(ValueError, match="bad line"):
                await wait_for_job(batcher, job, Client(), poll_s=0.01)
        finally:
            worker.cancel()
    _run(main)


# ------------------------------------------------------------------ step level
class FakeEngine:
    """A decoding engine whose steps finish every line added (hyps: the ids reversed), or
    fail the lines in ``fail_keys``."""

    def __init__(self, batcher: StepBatcher, ready: bool = True):
        self.batcher = batcher
        self.ready = ready
        self.added: list[tuple] = []
        self.fail_keys: set[int] = set()
        self.events: list[str] = []

    async def start(self):
        self.events.append("start")

    def stop(self):
        self.events.append("stop")

    async def wait_ready(self):
        self.events.append("wait_ready")
        self.ready = True

    def add(self, key, options, ids, prefix, line, express=False):
        self.added.append((key, options, ids, prefix, line, express))

    async def advance(self, arrival):
        # the batcher's own event, set by each new request (a process engine wakes on it)
        assert arrival is self.batcher._arrival
        await asyncio.sleep(0)  # as the real engines do (they await the decoding thread)
        pending = [entry for entry in self.added if entry[0] in self.batcher.inside]
        self.batcher._stepped(3, len(pending))
        failed = [entry[0] for entry in pending if entry[0] in self.fail_keys]
        if failed:
            self.batcher._lines_failed(failed, RuntimeError("step failed"))
        for key, _, ids, _, _, _ in pending:
            if key not in failed:
                self.batcher._line_done(key, [(list(reversed(ids)), -1.0)])


def _step_batcher(metrics=None, **limits) -> tuple[StepBatcher, FakeEngine]:
    batcher = StepBatcher(FakeTranslator(), ServeLimits(workers="thread", **limits),
                          concurrent.futures.ThreadPoolExecutor(1), metrics, name="m1")
    batcher.engine = FakeEngine(batcher)
    return batcher, batcher.engine


def test_step_level_lines_decode_in_the_engine_and_empty_lines_are_answered_at_once():
    metrics, value = _metrics()

    async def main():
        batcher, engine = _step_batcher(metrics)
        job = batcher.submit([[1, 2], [], [3]], Work.translate(beam=2), timeout_s=60,
                             extras=[[7], [8], None])
        assert await _serve(batcher, job) == [[[([2, 1], -1.0)], [([], 0.0)], [([3], -1.0)]]]
        # the empty line never reaches the engine; shortest first; express: 3 lines x beam 2
        # rows are within express_rows
        assert [entry[2:] for entry in engine.added] == [([3], None, 2, True),
                                                         ([1, 2], [7], 0, True)]
        assert engine.added[0][1] == (("beam", 2),)
        assert (batcher.decoding_lines, batcher.decoding_tokens) == (0, 0)
        assert (batcher.express_keys, batcher.express_tokens) == (set(), 0)
        assert batcher.steps == 3 and batcher.requests == 1
        assert value("ranmt_batch_sentences_sum") == 2
        assert value("ranmt_decoded_tokens_total") == (2 + 1) + (1 + 1)
    _run(main)


def test_a_failed_step_fails_its_jobs_and_frees_their_rows():
    async def main():
        batcher, engine = _step_batcher(express_rows=0)
        engine.fail_keys = {0}
        failing = batcher.submit([[1]], GREEDY, timeout_s=60)
        other = batcher.submit([[2, 2]], GREEDY, timeout_s=60)
        failed, answered = await _serve(batcher, failing, other)
        assert str(failed) == "step failed" and answered == [[([2, 2], -1.0)]]
        assert not any(entry[5] for entry in engine.added)  # express_rows 0: main lane
        assert (batcher.inside, batcher.decoding_tokens) == ({}, 0)
    _run(main)


def test_a_line_leaving_the_express_lane_gives_back_its_tokens():
    async def main():
        batcher, _ = _step_batcher()
        express = batcher.submit([[1, 2, 3]], GREEDY, timeout_s=60)
        main_lane = batcher.submit([[4] * 9] * 40, GREEDY, timeout_s=60)  # 40 rows
        batcher._admit()
        assert batcher.express_tokens == 4 and len(batcher.express_keys) == 1
        assert batcher.decoding_tokens == 4 + 40 * 10
        express_key = next(iter(batcher.express_keys))
        assert batcher._leave(express_key) == (express, 0, 4)
        assert (batcher.express_tokens, batcher.express_keys) == (0, set())
        assert batcher.decoding_tokens == 400
        main_key = next(key for key in batcher.inside)
        assert batcher._leave(main_key)[0] is main_lane and batcher.express_tokens == 0
        assert batcher.decoding_tokens == 390
    _run(main)


def test_the_step_level_rate_is_measured_over_spans_of_at_least_a_second(monkeypatch):
    clock = FakeClock(100.0)  # the rate's start, at construction
    monkeypatch.setattr(batching.time, "perf_counter", clock)
    batcher = StepBatcher(FakeTranslator(), ServeLimits(workers="thread"),
                          concurrent.futures.ThreadPoolExecutor(1))
    clock.values += [100.5]
    batcher._rate(10)  # half a second: not yet a span
    assert batcher.tokens_per_s == 0.0
    clock.values += [101.0, 101.0]
    batcher._rate(30)  # exactly one second: 40 tokens / 1 s
    assert batcher.tokens_per_s == pytest.approx(40.0)
    clock.values += [103.0, 103.0]
    batcher._rate(100)  # a new span from 101: 100 tokens / 2 s, averaged
    assert batcher.tokens_per_s == pytest.approx(0.7 * 40.0 + 0.3 * 50.0)
    assert batcher._rate_tokens == 0 and batcher._rate_start == 103.0


def test_the_step_worker_waits_for_its_engine_and_scores_at_batch_level():
    async def main():
        batcher, engine = _step_batcher()
        engine.ready = False
        await batcher.start()
        scoring = batcher.submit([[1, 2]], Work("score"), timeout_s=60, extras=[[3, 4]])
        assert await _serve(batcher, scoring) == [[4.0]]
        batcher.stop()
        assert engine.events == ["start", "wait_ready", "stop"]
        assert batcher.translator.calls == [("score", [[1, 2]], [[3, 4]])]
        assert engine.added == [] and batcher.batches == 1
    _run(main)


def test_the_engine_is_a_worker_process_only_for_a_model_loaded_from_a_checkpoint():
    """``--workers process`` decodes in a process of the model's own (started from its load
    options, at ``--worker-nice``); without load options, or with ``--workers thread``, in
    the decoding thread. Either reports to the batcher's callbacks."""
    from ranmt.serving.lines import ThreadDecoding
    from ranmt.serving.supervisor import ProcessDecoding

    executor = concurrent.futures.ThreadPoolExecutor(1)
    loaded = FakeTranslator()
    loaded.load_options = {"checkpoint": "run/checkpoints/best"}
    batcher = StepBatcher(loaded, ServeLimits(workers="process", worker_nice=7), executor,
                          name="m1")
    engine = batcher.engine
    assert isinstance(engine, ProcessDecoding) and engine.process is None  # not started
    assert (engine.load, engine.name, engine.limits.worker_nice) == (
        loaded.load_options, "m1", 7)
    assert (engine.on_done, engine.on_failed, engine.on_steps) == (
        batcher._line_done, batcher._lines_failed, batcher._stepped)
    for translator, workers in ((FakeTranslator(), "process"), (loaded, "thread")):
        batcher = StepBatcher(translator, ServeLimits(workers=workers), executor)
        engine = batcher.engine
        assert isinstance(engine, ThreadDecoding) and batcher.executor is executor
        assert engine.executor is executor and engine.lines.translator is translator
        assert (engine.on_done, engine.on_failed, engine.on_steps) == (
            batcher._line_done, batcher._lines_failed, batcher._stepped)


@pytest.mark.parametrize(("lines", "options", "express"), [
    (4, {"beam": 4}, True), (5, {"beam": 4}, False),  # rows = lines x beam, up to 16
    (4, {}, True), (5, {}, False),  # the server's default beam: 4
    (16, {"beam": 1}, True), (17, {"beam": 1}, False),
    (8, {"sampling": "topk", "nbest": 2, "beam": 8}, True),  # sampling: lines x draws
    (9, {"sampling": "topk", "nbest": 2}, False),
    (16, {"sampling": "topk"}, True), (17, {"sampling": "topk"}, False),  # default nbest 1
    (4, {"sampling": "none", "nbest": 1, "beam": 4}, True),
    (2, {"sampling": "none", "nbest": 1, "beam": 9}, False)])
def test_the_express_lane_takes_requests_of_at_most_express_rows_rows(lines, options,
                                                                      express):
    batcher, _ = _step_batcher(express_rows=16)

    async def main():
        job = batcher.submit([[5]] * lines, Work.translate(**options), timeout_s=60)
        assert batcher._express(job) is express
    _run(main)


def _fill(batcher, lanes: list[tuple[bool, int]]) -> None:
    """Lines decoding: (express, source tokens) each."""
    for key, (express, size) in enumerate(lanes):
        batcher.inside[key] = (None, 0, size)
        batcher.decoding_tokens += size
        if express:
            batcher.express_keys.add(key)
            batcher.express_tokens += size


def test_each_lane_has_room_for_its_own_lines_and_tokens():
    batcher, _ = _step_batcher(max_batch_lines=3, max_batch_tokens=10)
    assert batcher._room(False, 10**6) and batcher._room(True, 10**6)  # alone: always
    _fill(batcher, [(False, 5), (True, 3), (True, 3)])
    assert batcher._room(False, 5) and not batcher._room(False, 6)  # 5 + 5 of 10 tokens
    assert batcher._room(True, 4) and not batcher._room(True, 5)  # 6 + 4 of 10
    full, _ = _step_batcher(max_batch_lines=3, max_batch_tokens=10)
    _fill(full, [(True, 1), (True, 1), (True, 1), (False, 5)])
    assert not full._room(True, 1)  # 3 express lines of 3
    assert full._room(False, 1)  # the main lane: 1 line, 5 tokens


def test_free_rows_go_to_the_job_with_fewest_lines_decoding_first_in_turn_among_equals():
    async def main():
        batcher, engine = _step_batcher(express_rows=0, max_batch_lines=5)
        busy = batcher.submit([[1]] * 4, GREEDY, timeout_s=60)
        batcher.pending.remove(busy)  # two of its lines decoding already
        batcher._place(busy, 0, 2)
        batcher._place(busy, 1, 2)
        batcher.pending.append(busy)
        busy.taken = 2
        newcomer = batcher.submit([[2]] * 3, GREEDY, timeout_s=60)
        batcher.last_served = -1
        batcher._admit()  # 3 free rows: newcomer, newcomer, then busy (2 each, first in turn)
        assert [entry[2] for entry in engine.added[2:]] == [[2], [2], [1]]
        assert batcher.decoding_lines == 5 and busy.taken == 3 and newcomer.taken == 2
    _run(main)


def test_a_full_express_lane_does_not_hold_the_main_lane_back():
    async def main():
        batcher, engine = _step_batcher(express_rows=2, max_batch_lines=1)
        first = batcher.submit([[1]], GREEDY, timeout_s=60)
        second = batcher.submit([[2]], GREEDY, timeout_s=60)
        burst = batcher.submit([[3]] * 4, GREEDY, timeout_s=60)
        batcher._admit()
        # express: one line at most (the first in turn); main: one line of the burst
        assert [(entry[2], entry[5]) for entry in engine.added] == [([1], True), ([3], False)]
        assert (first.taken, second.taken, burst.taken) == (1, 0, 1)
        assert batcher.pending == [second, burst]  # the first left the queue
    _run(main)


def test_translations_decode_only_step_level_even_when_the_lanes_are_full():
    """Lines that find no room wait for a free row; only scoring is batch-level."""
    async def main():
        batcher, engine = _step_batcher(express_rows=0, max_batch_lines=1)
        job = batcher.submit([[1], [2, 2], [3, 3, 3]], GREEDY, timeout_s=60)
        assert await _serve(batcher, job) == [[[([1], -1.0)], [([2, 2], -1.0)],
                                               [([3, 3, 3], -1.0)]]]
        assert batcher.translator.calls == [] and len(engine.added) == 3
        assert batcher.batches == 0
    _run(main)


def test_steps_and_step_sizes_add_up():
    metrics, value = _metrics()
    batcher, _ = _step_batcher(metrics)
    batcher._stepped(3, 2)
    batcher._stepped(2, 5)
    assert batcher.steps == 5
    assert (value("ranmt_batch_sentences_count"), value("ranmt_batch_sentences_sum")) == (2, 7)


@pytest.mark.parametrize("cls", [Batcher, StepBatcher])
def test_a_model_without_a_name_is_called_model(cls):
    """The name in refusals and metrics when the server gives none."""
    async def main():
        batcher = cls(FakeTranslator(), ServeLimits(max_queued_tokens=1, workers="thread"),
                      concurrent.futures.ThreadPoolExecutor(1))
        batcher.submit([[1]], GREEDY, timeout_s=60)
        with pytest.raises(batching.QueueFullError, match="^model 'model' is busy"):
            batcher.submit([[1]], GREEDY, timeout_s=60)
    _run(main)


def test_a_new_batcher_has_nothing_queued_decoding_or_in_flight():
    """The counters the server reads (``/health``) and increments start at zero."""
    batcher, _ = _step_batcher()
    assert (batcher.in_flight, batcher.requests, batcher.batches, batcher.steps) == (0, 0, 0, 0)
    assert (batcher.queued_tokens, batcher.queued_requests, batcher.tokens_per_s) == (0, 0, 0.0)
    assert (batcher.decoding_lines, batcher.decoding_tokens, batcher.express_tokens) == (0, 0, 0)


def test_a_client_gone_is_noticed_within_the_default_poll():
    """The server waits with the default poll (50 ms): a client that left is noticed
    within a fraction of a second, its job dropped."""
    async def main():
        loop = asyncio.get_running_loop()
        batcher = _batcher()
        job = batcher.submit([[1, 2]], GREEDY, timeout_s=60)
        started = loop.time()
        assert await wait_for_job(batcher, job, Client(after=1)) is None
        assert loop.time() - started < 0.5 and job.dropped
    _run(main)
