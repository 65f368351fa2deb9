"""``ranmt serve``'s per-model queue: bounded admission, deadlines, and fair dynamic batches.

A request becomes a :class:`Job`: its lines (source ids), what it asks of the model
(:class:`Work`: translate with given settings, or score given targets) and per-line extras
(target prefixes, or the targets to score). One :class:`Batcher` per model holds the jobs
and one worker forms batches from them:

* **Admission**: a job that would take the queue past ``max_queued_tokens`` source tokens
  is refused at once (:class:`QueueFullError`, 503 with ``Retry-After``); a job alone in
  an empty queue is always taken. A request whose :func:`fewest_tokens` would already
  overflow the queue is refused before its text is tokenized.
* **Fair batches**: a batch takes lines from the waiting jobs of one kind of work in turns
  — one line of each job per round, rounds until ``max_batch_tokens`` source tokens or
  ``max_batch_lines`` lines (one decoding batch) — starting after the
  job the previous batch served last. A one-line request that arrives behind a burst of
  large requests is in the next batch, not after the burst; a lone request still decodes
  in as few batches as before (all its lines, round after round).
* **Deadlines and departures**: a job is answered 504 when its deadline passes, and
  dropped when its client disconnects: one none of whose lines was taken leaves the queue
  (nothing decoded); with step-level batching the lines of a started one leave the
  decoding batch at the next step (:meth:`StepBatcher.abandon`); a batch-level batch
  decodes to its end, the late job's results unused. Accepted jobs are never lost or
  mixed up: each line's result goes back to its job at its position.
* **Faults**: a model with no live decoding worker refuses new requests at once (503 +
  ``Retry-After``, :class:`ModelUnavailableError`) and answers those that waited for a
  worker that failed to load the same way; :meth:`Batcher.fail_all` answers every job it
  holds (the server's supervisor, when a scheduling loop fails; graceful shutdown).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ranmt.serving.schema import RequestError


@dataclass(frozen=True)
class Work:
    """What a job asks of the model; only jobs with equal ``Work`` share a batch.

    ``kind``: translate | score; ``options``: the decoding options of a translation (names
    of :class:`ranmt.config.DecodeConfig` fields, e.g. beam, nbest, sampling), as sorted
    (name, value) pairs so that equal requests compare and hash equal."""

    kind: str = "translate"
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def translate(cls, **options) -> Work:
        """Translation with these decoding options (None values left out)."""
        return cls("translate", tuple(sorted((k, v) for k, v in options.items()
                                             if v is not None)))

    def run(self, translator, ids: list[list[int]], extras: list | None) -> list:
        """Decode (or score) lines ``ids`` with their extras (prefix or target ids)."""
        if self.kind == "score":
            return translator.score_ids(ids, extras)
        return translator.translate_ids(ids, prefixes=extras, **dict(self.options))


@dataclass(eq=False)
class Job:
    ids: list[list[int]]
    work: Work
    extras: list | None
    """Per line: target prefix ids (translate) or target ids (score); None: none."""
    future: asyncio.Future
    deadline: float
    """Event-loop time after which the job is dropped unless a line of it was taken."""
    sequence: int = 0
    arrived: float = 0.0
    tokens: int = field(init=False)
    taken: int = 0
    """Lines handed to batches so far (in ``order``)."""
    order: list[int] = field(init=False)
    """The job's line numbers, shortest first: the order its lines are taken in, so that
    batches drawn from many jobs hold lines of similar lengths (less padding)."""
    results: list = field(init=False)
    answered: int = 0
    started: bool = False
    """A line was taken into a batch: the job will be decoded and answered."""
    dropped: bool = False
    """Given up (deadline, client gone) before its first line was taken: never decoded."""
    queued: bool = True
    """Counted in its batcher's queued requests (it has lines not taken yet)."""

    def __post_init__(self):
        self.tokens = sum(len(seq) + 1 for seq in self.ids)
        self.results = [None] * len(self.ids)
        self.order = sorted(range(len(self.ids)), key=lambda line: len(self.ids[line]))


_WORD = re.compile(r"[^ ]*\w[^ ]*")  # a run between ASCII spaces holding a letter or digit


def fewest_tokens(lines: list[str]) -> int:
    """A lower bound of the :attr:`Job.tokens` of ``lines``, without tokenizing them: one
    EOS per line, plus one subword per run of characters between ASCII spaces that holds a
    letter or digit. ranmt's SentencePiece models split at whitespace (its default
    ``split_by_whitespace``) and no subword spans a space; their normalization (NFKC) maps
    a letter or digit to one or more characters, never to none, and keeps ASCII spaces as
    separators (``tests/test_serve_refusals.py`` checks the bound against whole-word
    pieces, the served test models and random Unicode). About 0.1 ms for 64 lines against
    0.65 ms for tokenizing them."""
    return len(lines) + sum(len(_WORD.findall(line)) for line in lines)


class UnavailableError(RequestError):
    """503 with ``Retry-After: retry_after`` (seconds): the request may succeed later."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(503, message)
        self.retry_after = max(1, int(-(-retry_after // 1)))


class QueueFullError(UnavailableError):
    """The model's queue holds ``max_queued_tokens``."""


class ModelUnavailableError(UnavailableError):
    """The model has no live decoding worker (it is being replaced, or cannot load)."""


def timeout_error(started: bool = False) -> RequestError:
    if started:
        return RequestError(504, "the request passed its deadline (timeout_s or "
                                 "--request-timeout) while decoding; its lines were dropped")
    return RequestError(504, "the request waited past its deadline (timeout_s or "
                             "--request-timeout) before its batch started; nothing was decoded")


class Batcher:
    """One model's bounded queue and worker (see the module docstring). ``limits`` is a
    :class:`ranmt.serving.limits.ServeLimits`; ``metrics`` a
    :class:`ranmt.serving.runner.ServeMetrics`."""

    def __init__(self, translator, limits, executor: concurrent.futures.Executor,
                 metrics=None, name: str = "model"):
        self.translator = translator
        self.limits = limits
        self.executor = executor
        self.metrics = metrics
        self.name = name
        self.pending: list[Job] = []  # jobs with lines not taken yet, in arrival order
        self._arrival = asyncio.Event()
        self._numbers = itertools.count()
        self.last_served = -1  # sequence number of the job the last batch served last
        self.batches = 0
        self.requests = 0
        self.in_flight = 0
        self.queued_tokens = 0
        self.queued_requests = 0
        self.tokens_per_s = 0.0  # source tokens decoded per second, recent batches
        self.decoding_jobs: list[Job] = []  # batch-level: the jobs of the batch decoding

    # ------------------------------------------------------------------ admission, dropping
    def submit(self, ids: list[list[int]], work: Work, timeout_s: float,
               extras: list | None = None) -> Job:
        """Queue a job; its future gets one result per line, in order, once all its lines
        are decoded. :class:`QueueFullError` when the queue has no room for it."""
        loop = asyncio.get_running_loop()
        job = Job(ids, work, extras, loop.create_future(), loop.time() + timeout_s,
                  next(self._numbers), loop.time())
        if self.queued_tokens and self.queued_tokens + job.tokens > self.limits.max_queued_tokens:
            raise self._full()
        self.queued_tokens += job.tokens
        self.queued_requests += 1
        self._gauges()
        self.pending.append(job)
        self._arrival.set()
        return job

    def refuse_if_full(self, fewest: int = 0) -> None:
        """:class:`QueueFullError` when the queue is at its limit or a request of at least
        ``fewest`` tokens (:func:`fewest_tokens`) would take it past: checked before the
        request's text is tokenized, so refusals stay fast under a burst. The rule is
        :meth:`submit`'s (an empty queue takes anything), with a bound for the count."""
        if self.queued_tokens and (self.queued_tokens >= self.limits.max_queued_tokens or
                                   self.queued_tokens + fewest > self.limits.max_queued_tokens):
            raise self._full()

    def _full(self) -> QueueFullError:
        rate = self.tokens_per_s or 1000.0
        retry = int(min(60, max(1, -(-self.queued_tokens // rate))))
        return QueueFullError(f"model '{self.name}' is busy: {self.queued_tokens} source "
                              f"tokens queued, at most {self.limits.max_queued_tokens}; "
                              f"retry in {retry} s", retry)

    def drop(self, job: Job) -> bool:
        """Give up a job none of whose lines was taken (deadline, client gone); False if
        it started."""
        if job.started:
            return False
        if not job.dropped:
            job.dropped = True
            self.queued_tokens -= job.tokens
            self._leave_queue(job)
        return True

    def abandon(self, job: Job, err: Exception) -> None:
        """Answer ``job`` with ``err`` now, whether it started or not: its lines not taken
        leave the queue (and, with step-level batching, its decoding lines the batch)."""
        if job.queued:
            self.queued_tokens -= sum(len(job.ids[line]) + 1 for line in job.order[job.taken:])
            job.taken = len(job.ids)
            self._leave_queue(job)
        if not job.future.done():
            job.future.set_exception(err)

    def jobs(self) -> list[Job]:
        """Every job this queue holds: waiting, or decoding."""
        held = {id(job): job for job in self.pending}
        held.update((id(job), job) for job in self.decoding_jobs if not job.future.done())
        return list(held.values())

    def fail_all(self, err: Exception) -> int:
        """Answer every job held with ``err``; how many there were."""
        jobs = self.jobs()
        for job in jobs:
            self.abandon(job, err)
        return len(jobs)

    def refuse_if_down(self) -> None:
        """:class:`ModelUnavailableError` when the model cannot decode now (batch-level
        batching decodes in the server's own thread: never)."""

    def status(self) -> dict:
        """The model's state for ``/ready``, ``/models`` and ``/metrics``."""
        return {"state": "ready", "reason": None, "restarts": 0}

    def _leave_queue(self, job: Job) -> None:
        if job.queued:
            job.queued = False
            self.queued_requests -= 1
            self.pending.remove(job)
            self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_tokens.labels(self.name).set(self.queued_tokens)
            self.metrics.queue_requests.labels(self.name).set(self.queued_requests)

    def _expire(self, now: float) -> None:
        """Answer 504 to the jobs not started whose deadline has passed."""
        for job in [job for job in self.pending if not job.started and now > job.deadline]:
            self.drop(job)
            if not job.future.done():
                job.future.set_exception(timeout_error())

    # ------------------------------------------------------------------ batches
    def _in_turn(self, kind: str | None = None) -> list[Job]:
        """The waiting jobs (of ``kind`` of work, or any), starting after the job served
        last."""
        start = next((i for i, job in enumerate(self.pending)
                      if job.sequence > self.last_served), 0)
        turn = self.pending[start:] + self.pending[:start]
        return [job for job in turn if kind is None or job.work.kind == kind]

    def take_batch(self, now: float, kind: str | None = None) -> list[tuple[Job, int]]:
        """The next batch: (job, line) pairs, lines taken in turns (see the module
        docstring); the work of all of them is that of the first job in turn (of ``kind``
        of work, when given)."""
        self._expire(now)
        turn = self._in_turn(kind)
        if not turn:
            return []
        work = turn[0].work
        turn = [job for job in turn if job.work == work]
        batch: list[tuple[Job, int]] = []
        tokens = 0
        for job, line, size in _rounds(turn):
            if batch and (tokens + size > self.limits.max_batch_tokens
                          or len(batch) >= self.limits.max_batch_lines):
                break
            batch.append((job, line))
            self._take(job, size)
            tokens += size
        self._took([job for job, _ in batch])
        return batch

    def _take(self, job: Job, size: int) -> None:
        """A line of ``job`` (``size`` source tokens) leaves the queue for decoding."""
        job.taken += 1
        job.started = True
        self.queued_tokens -= size
        self.last_served = job.sequence

    def _took(self, jobs: list[Job]) -> None:
        """Jobs all of whose lines are taken leave the queue."""
        for job in {id(job): job for job in jobs}.values():
            if job.taken == len(job.ids):
                self._leave_queue(job)
        self._gauges()

    async def _wait_for_work(self, loop) -> None:
        """Until a job waits; then let the batch window collect more (from the oldest
        job's arrival) unless a full batch is already waiting."""
        while True:
            self._expire(loop.time())
            if self.pending:
                break
            self._arrival.clear()
            await self._arrival.wait()
        oldest = min(job.arrived for job in self.pending)
        wait = oldest + self.limits.batch_window_ms / 1000 - loop.time()
        if wait > 0 and self.queued_tokens < self.limits.max_batch_tokens:
            await asyncio.sleep(wait)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_work(loop)
            batch = self.take_batch(loop.time())
            if batch:
                await self._decode(loop, batch)

    async def _decode(self, loop, batch: list[tuple[Job, int]]) -> None:
        work = batch[0][0].work
        ids = [job.ids[line] for job, line in batch]
        extras = None
        if any(job.extras is not None for job, _ in batch):
            extras = [job.extras[line] if job.extras is not None else [] for job, line in batch]
        started = time.perf_counter()
        self.decoding_jobs = [job for job, _ in batch]
        try:
            results = await loop.run_in_executor(
                self.executor, lambda: work.run(self.translator, ids, extras))
        except Exception as err:  # noqa: BLE001 (reported to the requests of this batch)
            self._fail(batch, err)
            return
        finally:
            self.decoding_jobs = []
        seconds = time.perf_counter() - started
        source_tokens = sum(len(seq) + 1 for seq in ids)
        rate = source_tokens / max(seconds, 1e-6)
        self.tokens_per_s = rate if not self.tokens_per_s else 0.7 * self.tokens_per_s + 0.3 * rate
        self.batches += 1
        if self.metrics is not None:
            self.metrics.batch_sentences.labels(self.name).observe(len(ids))
            if work.kind == "translate":
                self.metrics.decoded_tokens.labels(self.name).inc(
                    sum(len(hyps[0][0]) + 1 for hyps in results))
        for (job, line), result in zip(batch, results):
            self._answer(job, line, result)

    def _answer(self, job: Job, line: int, result: list) -> None:
        """Line ``line`` of ``job`` is done; the job is answered once all its lines are."""
        job.results[line] = result
        job.answered += 1
        if job.answered == len(job.ids):
            self.requests += 1
            if not job.future.done():
                job.future.set_result(job.results)

    def _fail(self, batch: list[tuple[Job, int]], err: Exception) -> None:
        """A batch failed: its jobs get the error and their remaining lines are dropped."""
        if self.metrics is not None:
            self.metrics.errors.labels(self.name, "decoding").inc()
        for job in {id(job): job for job, _ in batch}.values():
            self.abandon(job, err)


def _rounds(turn: list[Job]):
    """The untaken lines of ``turn``'s jobs in rounds: one line of each job per round, each
    job's shortest first: (job, line, source tokens). The caller takes each line it is
    given (or stops)."""
    while any(job.taken < len(job.ids) for job in turn):
        for job in turn:
            if job.taken < len(job.ids):
                line = job.order[job.taken]
                yield job, line, len(job.ids[line]) + 1


async def wait_for_job(batcher: Batcher, job: Job, is_disconnected, poll_s: float = 0.05):
    """The job's results; :class:`RequestError` 504 when its deadline passes (its lines
    leave the queue, or the decoding batch if it started: :meth:`Batcher.abandon`), None
    when the client disconnects (dropped the same way). A started job is checked for its
    client every ``10 * poll_s``, so a client that hangs up stops costing decoding steps."""
    loop = asyncio.get_running_loop()
    while True:
        # A started job is checked for its client ten times less often: the check runs on
        # the event loop, which shares the CPU with decoding (33 requests polled every
        # 50 ms cost the worker ~3% of its burst throughput on 2 cores).
        poll = poll_s * 10 if job.started else poll_s
        wait = min(poll, max(job.deadline - loop.time(), 0.0))
        await asyncio.wait({job.future}, timeout=wait)
        if job.future.done():
            return job.future.result()  # a 504, 503 or decoding error raises here
        if loop.time() >= job.deadline:
            if batcher.drop(job):
                raise timeout_error()
            job.future.cancel()  # what is raised here is the answer
            batcher.abandon(job, timeout_error(started=True))
            raise timeout_error(started=True)
        if await is_disconnected():
            if not batcher.drop(job):
                job.future.cancel()
                batcher.abandon(job, ConnectionResetError("the client disconnected"))
            return None
