"""ranmt.serving.batching's queue without a model or a server: admission and its Retry-After,
the queue totals, batches taken in rounds from the job after the last one served, work kinds
kept apart, deadlines, drops and failed batches (exact values; docs/MUTATION.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from ranmt.serving.batching import Batcher, Job, QueueFullError, Work, _rounds
from ranmt.serving.limits import ServeLimits

GREEDY = Work.translate(beam=1, nbest=1)
BEAM = Work.translate(beam=4, nbest=1)


def _batcher(metrics=None, **limits) -> Batcher:
    return Batcher(object(), ServeLimits(**limits), concurrent.futures.ThreadPoolExecutor(1),
                   metrics, name="m1")


def _in_loop(scenario):
    """Run ``scenario(loop)`` inside an event loop (submit needs a running one)."""
    async def main():
        return scenario(asyncio.get_running_loop())
    return asyncio.run(main())


def test_work_translate_leaves_out_unset_options_and_compares_by_value():
    assert Work.translate(beam=4, nbest=None, lenpen=0.6) == Work(
        "translate", (("beam", 4), ("lenpen", 0.6)))
    assert Work.translate(nbest=1, beam=1) == GREEDY and GREEDY != BEAM
    assert Work("score") != Work("translate")


def test_a_job_counts_its_tokens_and_takes_its_shortest_lines_first():
    job = Job([[1, 2, 3], [4], [5, 6], [7]], GREEDY, None, None, 9.0)
    assert job.tokens == 4 + 2 + 3 + 2
    assert job.order == [1, 3, 2, 0]  # shortest first, ties in line order
    assert job.results == [None] * 4 and job.queued and not job.started


def test_admission_refuses_past_the_limit_but_always_takes_a_lone_job():
    def scenario(loop):
        batcher = _batcher(max_queued_tokens=10)
        big = batcher.submit([[1] * 20], GREEDY, timeout_s=5)  # 21 tokens, queue empty
        assert (batcher.queued_tokens, batcher.queued_requests) == (21, 1)
        assert batcher.pending == [big] and big.deadline == pytest.approx(loop.time() + 5,
                                                                          abs=0.5)
        with pytest.raises(QueueFullError) as refused:
            batcher.submit([[1]], GREEDY, timeout_s=5)
        assert refused.value.status == 503 and refused.value.retry_after == 1
        assert refused.value.message == ("model 'm1' is busy: 21 source tokens queued, at "
                                         "most 10; retry in 1 s")
        assert (batcher.queued_tokens, batcher.queued_requests) == (21, 1)
        with pytest.raises(QueueFullError):
            batcher.refuse_if_full()
    _in_loop(scenario)


def test_admission_takes_a_job_that_just_fits():
    def scenario(loop):
        batcher = _batcher(max_queued_tokens=10)
        batcher.submit([[1, 2, 3, 4]], GREEDY, timeout_s=5)  # 5
        batcher.refuse_if_full()  # 5 < 10: no refusal
        batcher.submit([[1, 2, 3, 4]], GREEDY, timeout_s=5)  # 10: exactly the limit
        assert batcher.queued_tokens == 10
        with pytest.raises(QueueFullError):
            batcher.refuse_if_full()  # at the limit: full
    _in_loop(scenario)


@pytest.mark.parametrize(("queued", "rate", "retry"), [
    (21, 0.0, 1), (2500, 0.0, 3), (1001, 0.0, 2), (5000, 100.0, 50), (10000, 100.0, 60),
    (1, 1000.0, 1), (301, 100.0, 4)])
def test_retry_after_is_the_queue_over_the_recent_rate_rounded_up_within_1_to_60(
        queued, rate, retry):
    batcher = _batcher()
    batcher.queued_tokens, batcher.tokens_per_s = queued, rate
    assert batcher._full().retry_after == retry


def test_batches_take_one_line_of_each_job_per_round_from_the_one_after_the_last_served():
    def scenario(loop):
        batcher = _batcher(max_batch_lines=4, max_batch_tokens=1000)
        a = batcher.submit([[1, 1, 1], [2], [3, 3]], GREEDY, timeout_s=60)  # order 1, 2, 0
        b = batcher.submit([[4, 4]], GREEDY, timeout_s=60)
        c = batcher.submit([[5], [6, 6, 6, 6]], GREEDY, timeout_s=60)
        assert batcher.queued_tokens == 9 + 3 + 7
        first = batcher.take_batch(loop.time())
        assert [(job, line) for job, line in first] == [(a, 1), (b, 0), (c, 0), (a, 2)]
        assert batcher.queued_tokens == 19 - (2 + 3 + 2 + 3)
        assert batcher.last_served == a.sequence and a.started and not a.dropped
        assert batcher.pending == [a, c] and batcher.queued_requests == 2  # b: all taken
        second = batcher.take_batch(loop.time())
        assert [(job, line) for job, line in second] == [(c, 1), (a, 0)]  # after a: c first
        assert batcher.queued_tokens == 0 and batcher.pending == []
        assert batcher.queued_requests == 0 and batcher.take_batch(loop.time()) == []
    _in_loop(scenario)


def test_a_batch_stops_before_its_token_limit_but_always_holds_one_line():
    def scenario(loop):
        batcher = _batcher(max_batch_tokens=10)
        big = batcher.submit([[1] * 30], GREEDY, timeout_s=60)
        small = batcher.submit([[1] * 4, [2] * 4, [3] * 4], GREEDY, timeout_s=60)
        assert batcher.take_batch(loop.time()) == [(big, 0)]  # 31 tokens, alone
        assert batcher.take_batch(loop.time()) == [(small, 0), (small, 1)]  # 5 + 5 = 10
        assert batcher.take_batch(loop.time()) == [(small, 2)]
    _in_loop(scenario)


def test_only_jobs_of_the_same_work_share_a_batch_and_kind_filters():
    def scenario(loop):
        batcher = _batcher()
        greedy = batcher.submit([[1]], GREEDY, timeout_s=60)
        beam = batcher.submit([[2]], BEAM, timeout_s=60)
        score = batcher.submit([[3]], Work("score"), timeout_s=60, extras=[[4]])
        greedy2 = batcher.submit([[5]], GREEDY, timeout_s=60)
        assert batcher.take_batch(loop.time(), kind="score") == [(score, 0)]
        assert batcher.take_batch(loop.time()) == [(greedy2, 0), (greedy, 0)]
        assert batcher.take_batch(loop.time()) == [(beam, 0)]
    _in_loop(scenario)


def test_a_job_past_its_deadline_is_answered_504_and_leaves_the_queue():
    def scenario(loop):
        batcher = _batcher()
        late = batcher.submit([[1, 2]], GREEDY, timeout_s=1)
        on_time = batcher.submit([[3]], GREEDY, timeout_s=100)
        batcher._expire(late.deadline)  # not past yet: kept
        assert batcher.pending == [late, on_time]
        assert batcher.take_batch(late.deadline + 0.01) == [(on_time, 0)]
        assert late.dropped and late.future.done() and batcher.queued_tokens == 0
        assert late.future.exception().status == 504
        assert "deadline" in late.future.exception().message
        assert batcher.queued_requests == 0
    _in_loop(scenario)


def test_drop_gives_up_a_waiting_job_once_and_never_a_started_one():
    def scenario(loop):
        batcher = _batcher(max_batch_lines=1)
        started = batcher.submit([[1], [2]], GREEDY, timeout_s=60)
        waiting = batcher.submit([[3, 3]], GREEDY, timeout_s=60)
        batcher.take_batch(loop.time())
        assert not batcher.drop(started) and not started.dropped
        assert batcher.drop(waiting) and batcher.drop(waiting)  # twice: counted once
        assert batcher.queued_tokens == 2 and batcher.queued_requests == 1
        assert batcher.pending == [started]
    _in_loop(scenario)


def test_a_failed_batch_fails_its_jobs_and_frees_their_untaken_lines():
    def scenario(loop):
        batcher = _batcher(max_batch_lines=2)
        job = batcher.submit([[1], [2, 2], [3, 3, 3]], GREEDY, timeout_s=60)
        other = batcher.submit([[4]], GREEDY, timeout_s=60)
        batch = batcher.take_batch(loop.time())
        assert batch == [(job, 0), (other, 0)]
        error = RuntimeError("decoding failed")
        batcher._fail(batch, error)
        assert job.future.exception() is error and other.future.exception() is error
        assert batcher.queued_tokens == 0 and batcher.pending == []
        assert batcher.queued_requests == 0 and job.taken == 3
    _in_loop(scenario)


def test_a_job_is_answered_once_all_its_lines_are_in_their_places():
    def scenario(loop):
        batcher = _batcher()
        job = batcher.submit([[1], [2]], GREEDY, timeout_s=60)
        batcher._answer(job, 1, "second")
        assert not job.future.done() and batcher.requests == 0
        batcher._answer(job, 0, "first")
        assert job.future.result() == ["first", "second"] and batcher.requests == 1
    _in_loop(scenario)


def test_rounds_yield_each_untaken_line_once_shortest_first():
    a = Job([[1, 1], [2]], GREEDY, None, None, 0.0)
    b = Job([[3, 3, 3]], GREEDY, None, None, 0.0)
    rounds = _rounds([a, b])
    assert next(rounds) == (a, 1, 2)
    a.taken += 1  # the caller takes what it is given
    assert next(rounds) == (b, 0, 4)
    b.taken += 1
    assert next(rounds) == (a, 0, 3)
    a.taken += 1
    assert next(rounds, None) is None


def test_admission_counts_the_new_job_on_top_of_the_queue():
    def scenario(loop):
        batcher = _batcher(max_queued_tokens=10)
        batcher.submit([[1, 2, 3, 4]], GREEDY, timeout_s=5)  # 5
        with pytest.raises(QueueFullError):
            batcher.submit([[1, 2, 3, 4, 5]], GREEDY, timeout_s=5)  # 5 + 6 > 10
        job = batcher.submit([[9]], GREEDY, timeout_s=5, extras=[[7, 8]])  # 5 + 2
        assert job.extras == [[7, 8]] and job.sequence == 2  # the refused one took number 1
        assert job.arrived == pytest.approx(loop.time(), abs=0.5) and job.arrived > 0
    _in_loop(scenario)


def test_without_a_job_after_the_last_served_the_turn_starts_at_the_oldest():
    def scenario(loop):
        batcher = _batcher(max_batch_lines=2)
        a = batcher.submit([[1], [1], [1]], GREEDY, timeout_s=60)
        b = batcher.submit([[2], [2], [2]], GREEDY, timeout_s=60)
        assert batcher.take_batch(loop.time()) == [(a, 0), (b, 0)]  # b served last
        assert batcher.take_batch(loop.time()) == [(a, 1), (b, 1)]
    _in_loop(scenario)


def test_answered_requests_are_counted():
    def scenario(loop):
        batcher = _batcher()
        first, second = (batcher.submit([[1]], GREEDY, timeout_s=60) for _ in range(2))
        batcher._answer(first, 0, "a")
        batcher._answer(second, 0, "b")
        assert batcher.requests == 2
    _in_loop(scenario)


def test_queue_gauges_and_decoding_errors_reach_the_metrics():
    from ranmt.serving.runner import ServeMetrics

    metrics = ServeMetrics()

    def value(name, **labels):
        return metrics.registry.get_sample_value(name, labels)

    def scenario(loop):
        batcher = _batcher(metrics, max_batch_lines=1)
        job = batcher.submit([[1, 2], [3]], GREEDY, timeout_s=60)
        assert value("ranmt_queue_tokens", model="m1") == 5
        assert value("ranmt_queue_requests", model="m1") == 1
        batch = batcher.take_batch(loop.time())
        assert value("ranmt_queue_tokens", model="m1") == 3
        batcher._fail(batch, RuntimeError("boom"))
        assert value("ranmt_errors_total", model="m1", kind="decoding") == 1
        assert value("ranmt_queue_tokens", model="m1") == 0
        assert value("ranmt_queue_requests", model="m1") == 0
        assert isinstance(job.future.exception(), RuntimeError)
    _in_loop(scenario)


def test_refusal_before_tokenizing_counts_the_fewest_tokens_the_request_can_hold():
    """``refuse_if_full(fewest)``: refused when the queue plus ``fewest`` would pass the
    limit (at the limit: taken), as ``submit`` would refuse it."""
    def scenario(loop):
        batcher = _batcher(max_queued_tokens=10)
        batcher.submit([[1, 2, 3, 4]], GREEDY, timeout_s=5)  # 5 queued
        batcher.refuse_if_full(5)  # 10: exactly the limit
        with pytest.raises(QueueFullError):
            batcher.refuse_if_full(6)
    _in_loop(scenario)
