"""Step-level batching of translations for ``ranmt serve`` (``--batching step``, the default):
:class:`StepBatcher`, the queue of :class:`ranmt.serving.batching.Batcher` whose lines join
and leave one running decoding batch between two steps (docs/SERVING.md, "Step-level
batching"). The steps run in a decoding engine: a worker process of the model
(:class:`ranmt.serving.supervisor.ProcessDecoding`) or the server's decoding thread
(:class:`ranmt.serving.lines.ThreadDecoding`).

Its scheduling loop (:meth:`StepBatcher.run`) awaits something that takes time on every
round (a worker ready, a request's arrival, a step's report, or a short tick): it never goes
round without letting the event loop run its other tasks (``/health``, the watchdog, the
pipe).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import time

from ranmt.serving.batching import Batcher, Job, ModelUnavailableError

IDLE_TICK_S = 0.05
"""How long a round that found nothing to do waits for an arrival before it looks again
(the deadlines of waiting requests are checked at least this often)."""


class StepBatcher(Batcher):
    """The queue of :class:`Batcher` with step-level batching of translations
    (:mod:`ranmt.inference.continuous`): waiting lines are admitted into the decoding batch between
    two steps, up to ``max_batch_lines`` lines and ``max_batch_tokens`` source tokens
    decoding (a line alone is always admitted), each free row to the job with the fewest
    lines decoding now (the first in turn among equals): a request that arrives behind a
    burst starts at the next step, and no job waits while one with more lines decoding is
    served. Every line is answered the step it finishes. A request of at most
    ``limits.express_rows`` rows decodes in an express lane of its own, whose steps come
    first (:meth:`ranmt.serving.lines.LineDecoding.step`), with its own ``max_batch_lines``
    and ``max_batch_tokens``.
    Scoring stays batch-level: a score batch runs in the server's decoding thread.

    Decoding runs in a worker process of the model (``limits.workers == "process"``, when
    the translator was loaded from a checkpoint) or in the decoding thread
    (:mod:`ranmt.serving.supervisor`, :mod:`ranmt.serving.lines`). A job is started (no
    longer dropped at its deadline or when its client leaves) once a line of it is
    admitted; a failed step, or a worker that died, fails the jobs with lines decoding
    there (their other lines are not decoded)."""

    def __init__(self, translator, limits, executor: concurrent.futures.Executor,
                 metrics=None, name: str = "model"):
        from ranmt.serving.lines import ThreadDecoding
        from ranmt.serving.supervisor import ProcessDecoding

        super().__init__(translator, limits, executor, metrics, name)
        if limits.workers == "process" and translator.load_options is not None:
            self.engine = ProcessDecoding(translator.load_options, name, self._line_done,
                                          self._lines_failed, self._stepped, limits,
                                          on_down=self._model_down)
        else:
            self.engine = ThreadDecoding(translator, executor, self._line_done,
                                         self._lines_failed, self._stepped)
        self.steps = 0
        self.inside: dict[int, tuple[Job, int, int]] = {}
        """The lines decoding: key -> (job, line, source tokens)."""
        self.express_keys: set[int] = set()
        """Those of :attr:`inside` decoding in the express lane (``limits.express_rows``)."""
        self.express_tokens = 0  # their source tokens (part of decoding_tokens)
        self._keys = itertools.count()
        self.decoding_tokens = 0
        self._rate_start = time.perf_counter()
        self._rate_tokens = 0

    @property
    def decoding_lines(self) -> int:
        return len(self.inside)

    async def start(self) -> None:
        """Start the decoding worker (load the model there) before serving."""
        await self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    def refuse_if_down(self) -> None:
        if not self.engine.ready:
            reason = self.engine.reason or "its decoding worker is starting"
            retry = self.engine.retry_after()
            raise ModelUnavailableError(f"model '{self.name}' cannot decode now: {reason}; "
                                        f"retry in {retry:.0f} s", retry)

    def status(self) -> dict:
        return {"state": self.engine.state, "reason": self.engine.reason,
                "restarts": self.engine.restarts}

    def jobs(self) -> list[Job]:
        held = {id(job): job for job in super().jobs()}
        held.update((id(job), job) for job, _, _ in self.inside.values())
        return list(held.values())

    def abandon(self, job: Job, err: Exception) -> None:
        """As :meth:`Batcher.abandon`; the job's lines decoding leave the batch at the
        next step (never answered)."""
        keys = [key for key, (owner, _, _) in self.inside.items() if owner is job]
        for key in keys:
            self._leave(key)
        if keys:
            self.engine.cancel(keys)
        super().abandon(job, err)

    def _model_down(self, reason: str, retry_after: float) -> None:
        """The model's worker failed to load: what waits for it is refused now (503)."""
        waiting = [job for job in self.pending if not job.future.done()]
        for job in waiting:
            self.abandon(job, ModelUnavailableError(
                f"model '{self.name}' cannot decode now: {reason}; retry in "
                f"{retry_after:.0f} s", retry_after))

    async def run(self) -> None:
        """The scheduling loop: admit lines between steps, run score batches, advance the
        decoding. Every round awaits something that takes time (see the module
        docstring), whatever the engine says of its readiness."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.ready:
                await self.engine.wait_ready()
                if not self.engine.ready:  # woken while still not ready (stopping, or an
                    self._arrival.clear()  # engine that does not block): look again
                    await self._idle_tick()  # after a tick (nothing can be admitted)
                continue
            if not self.inside:
                await self._wait_for_work(loop)
            self._arrival.clear()  # what arrives from here on wakes the waits below
            self._expire(loop.time())
            self._admit()
            batch = self.take_batch(loop.time(), kind="score")
            if batch:
                await self._decode(loop, batch)
            if self.inside:
                await self.engine.advance(self._arrival)
            elif not batch:
                await self._idle_tick()

    async def _idle_tick(self) -> None:
        """Until a request arrives or :data:`IDLE_TICK_S` passes."""
        arrival = asyncio.ensure_future(self._arrival.wait())
        try:  # (not wait_for: on Python 3.11 it can swallow the task's own cancellation)
            await asyncio.wait({arrival}, timeout=IDLE_TICK_S)
        finally:
            arrival.cancel()

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Lines of the waiting translation jobs into the decoding batch while there is
        room (see the class docstring), while the decoding worker is ready."""
        if not self.engine.ready:
            return
        turn = self._in_turn("translate")
        decoding = collections.Counter(id(job) for job, _, _ in self.inside.values())
        for express in (True, False):
            lane = [job for job in turn if self._express(job) == express]
            while True:
                waiting = [job for job in lane if job.taken < len(job.ids)]
                if not waiting:
                    break
                job = min(waiting, key=lambda candidate: decoding[id(candidate)])
                line = job.order[job.taken]
                size = len(job.ids[line]) + 1
                if not self._room(express, size):
                    break
                self._take(job, size)
                self._place(job, line, size, express)
                decoding[id(job)] += 1
        self._took(turn)

    def _express(self, job: Job) -> bool:
        """Whether ``job`` decodes in the express lane: at most ``limits.express_rows``
        rows (lines x beam, or x the nbest draws when sampling)."""
        options = dict(job.work.options)
        if options.get("sampling", "none") != "none":
            per_line = options.get("nbest") or self.translator.decode_config.nbest
        else:
            per_line = options.get("beam") or self.translator.decode_config.beam
        return len(job.ids) * per_line <= self.limits.express_rows

    def _room(self, express: bool, size: int) -> bool:
        """Whether a line of ``size`` source tokens fits its lane now: up to
        ``max_batch_lines`` lines and ``max_batch_tokens`` source tokens in each lane (a
        line alone in its lane always fits)."""
        lines, tokens = len(self.express_keys), self.express_tokens
        if not express:
            lines, tokens = len(self.inside) - lines, self.decoding_tokens - tokens
        if not lines:
            return True
        return lines < self.limits.max_batch_lines and \
            tokens + size <= self.limits.max_batch_tokens

    def _place(self, job: Job, line: int, size: int, express: bool = False) -> None:
        ids = job.ids[line]
        if not ids:  # an empty line has an empty translation; the model is not run
            self._answer(job, line, [([], 0.0)])
            return
        key = next(self._keys)
        self.inside[key] = (job, line, size)
        self.decoding_tokens += size
        if express:
            self.express_keys.add(key)
            self.express_tokens += size
        prefix = job.extras[line] if job.extras is not None else None
        self.engine.add(key, job.work.options, ids, prefix, line, express)

    # ------------------------------------------------------------------ results
    def _stepped(self, steps: int, sentences: int) -> None:
        self.steps += steps
        if self.metrics is not None:
            self.metrics.batch_sentences.labels(self.name).observe(sentences)

    def _line_done(self, key: int, hyps: list) -> None:
        job, line, size = self._leave(key)
        self._rate(size)
        if self.metrics is not None:
            self.metrics.decoded_tokens.labels(self.name).inc(len(hyps[0][0]) + 1)
        self._answer(job, line, hyps)

    def _leave(self, key: int) -> tuple[Job, int, int]:
        """Line ``key`` leaves the decoding batch (and its lane): (job, line, tokens)."""
        job, line, size = self.inside.pop(key)
        self.decoding_tokens -= size
        if key in self.express_keys:
            self.express_keys.discard(key)
            self.express_tokens -= size
        return job, line, size

    def _rate(self, tokens: int) -> None:
        """Source tokens decoded per second (for Retry-After), over spans of >= 1 s."""
        self._rate_tokens += tokens
        elapsed = time.perf_counter() - self._rate_start
        if elapsed >= 1.0:
            rate = self._rate_tokens / elapsed
            self.tokens_per_s = rate if not self.tokens_per_s else \
                0.7 * self.tokens_per_s + 0.3 * rate
            self._rate_start, self._rate_tokens = time.perf_counter(), 0

    def _lines_failed(self, keys: list[int], err: Exception) -> None:
        """Decoding failed for lines ``keys``: their jobs get the error (their other lines
        are not decoded)."""
        lines = []
        for key in keys:
            job, line, _ = self._leave(key)
            lines.append((job, line))
        self._fail(lines, err)
