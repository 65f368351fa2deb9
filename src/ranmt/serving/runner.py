"""What ``ranmt serve`` runs behind its routes: the served models with their queues, the
decoding workers' supervision, graceful draining, and the Prometheus metrics
(:class:`ServedModels`, :class:`ServeMetrics`). :mod:`ranmt.serving.app` puts HTTP in front.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ranmt.inference.translator import Translator
from ranmt.serving.batching import (
    Batcher,
    ModelUnavailableError,
    QueueFullError,
    UnavailableError,
    Work,
    fewest_tokens,
    wait_for_job,
)
from ranmt.serving.limits import ServeLimits
from ranmt.serving.schema import RequestError
from ranmt.serving.step_batching import StepBatcher


class ServeMetrics:
    """The Prometheus metrics of one app (its own registry, exported at ``GET /metrics``)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("ranmt_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("ranmt_request_seconds", "HTTP request latency",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                          10, 30, 60))
        self.queue_requests = Gauge("ranmt_queue_requests", "requests waiting for a batch",
                                    ["model"], registry=self.registry)
        self.queue_tokens = Gauge("ranmt_queue_tokens", "source tokens waiting for a batch",
                                  ["model"], registry=self.registry)
        self.batch_sentences = Histogram("ranmt_batch_sentences", "sentences per decoded batch",
                                         ["model"], registry=self.registry,
                                         buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.decoded_tokens = Counter("ranmt_decoded_tokens", "target tokens decoded (best "
                                      "hypotheses, EOS included)", ["model"],
                                      registry=self.registry)
        self.errors = Counter("ranmt_errors", "errors by model and kind (decoding, timeout, "
                              "overload, unavailable, disconnect, scheduler, shutdown)",
                              ["model", "kind"], registry=self.registry)
        self.loop_lag = Histogram(
            "ranmt_event_loop_lag_seconds", "how late the event loop ran a timer it was "
            "given every 100 ms: time its other work (parsing, tokenizing, answering, a "
            "blocking call) kept it from turning", registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.loop_lag_max = Gauge("ranmt_event_loop_lag_max_seconds", "the largest event-loop "
                                  "lag of the last 10 seconds", registry=self.registry)

    def watch(self, served: ServedModels) -> None:
        """Export each model's readiness and its workers' replacements, read at scrape
        time from ``served``."""
        self.registry.register(_ModelStates(served))


class _ModelStates:
    """A Prometheus collector: ``ranmt_model_ready{model}`` (1 ready, 0 not: its worker is
    loading, stalled, waiting to retry, or the server drains) and
    ``ranmt_worker_replacements_total{model, cause}`` (exited, stalled, load-failed)."""

    def __init__(self, served: ServedModels):
        self.served = served

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ready = GaugeMetricFamily("ranmt_model_ready", "1 when the model can decode now",
                                  labels=["model"])
        replaced = CounterMetricFamily("ranmt_worker_replacements", "decoding workers "
                                       "replaced, by cause", labels=["model", "cause"])
        for name, batcher in self.served.batchers.items():
            ready.add_metric([name], float(self.served.model_ready(name)))
            for cause, count in getattr(getattr(batcher, "engine", None), "causes", {}).items():
                replaced.add_metric([name, cause], count)
        yield ready
        yield replaced


class LoopLagMonitor:
    """The event loop's lag as the server itself measures it: a timer due every
    ``period_s`` seconds, and how late the loop ran it (``ranmt_event_loop_lag_seconds``,
    and the largest of the last ``window_s`` seconds, ``ranmt_event_loop_lag_max_seconds``).
    ``/health`` and every refusal wait as long as this lag: it is what a client's
    time-to-first-byte shows when the HTTP side is starved."""

    def __init__(self, metrics: ServeMetrics, period_s: float = 0.1, window_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.metrics, self.period_s, self.window_s, self.clock = metrics, period_s, window_s, clock
        self.recent: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag)

    def observe(self, lag_s: float) -> None:
        now = self.clock()
        self.metrics.loop_lag.observe(lag_s)
        self.recent.append((now, lag_s))
        while self.recent and self.recent[0][0] < now - self.window_s:
            self.recent.popleft()
        self.metrics.loop_lag_max.set(max(lag for _, lag in self.recent))

    async def run(self) -> None:
        while True:
            due = self.clock() + self.period_s
            await asyncio.sleep(self.period_s)
            self.observe(max(self.clock() - due, 0.0))


# ------------------------------------------------------------------------------ the app


class ServedModels:
    """The loaded models, each with its :class:`Batcher`, the one decoding thread they share,
    and the metrics: what every endpoint of :func:`create_app` works with."""

    def __init__(self, translators: dict[str, Translator], limits: ServeLimits):
        self.translators = translators
        self.limits = limits
        self.default = next(iter(translators))
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ranmt-decode")
        self.batchers: dict[str, Batcher] = {}
        self.workers: dict[str, asyncio.Task] = {}  # model -> its supervised scheduling loop
        self.loop_failures: dict[str, int] = {}  # model -> scheduling loops that raised
        self.lag_monitor: asyncio.Task | None = None
        self.metrics = ServeMetrics()
        self.metrics.watch(self)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    async def start(self) -> None:
        """A batcher per model, one warm-up decoding each, then the batching workers."""
        self.loop = loop = asyncio.get_running_loop()
        for name, translator in self.translators.items():
            kind = StepBatcher if self.limits.batching == "step" else Batcher
            self.batchers[name] = kind(translator, self.limits, self.executor, self.metrics,
                                       name)
            self._warn_compile_step(name, translator)
            # One decoding before serving: the first call's one-off costs (weight packing,
            # allocator warm-up) are not paid by the first requests.
            await loop.run_in_executor(self.executor, translator.warm_up)
            if isinstance(self.batchers[name], StepBatcher):
                await self.batchers[name].start()  # its decoding worker, when a process
        for name, batcher in self.batchers.items():
            self.loop_failures[name] = 0
            self.workers[name] = asyncio.create_task(self._supervise(name, batcher))
        self.lag_monitor = asyncio.create_task(LoopLagMonitor(self.metrics).run())

    def _warn_compile_step(self, name: str, translator: Translator) -> None:
        """A checkpoint whose decoding settings ask for ``decode.compile_step``: step-level
        batching (rows join and leave every step) does not run it, batch-level batching
        compiles each new batch shape on the request that first brings it."""
        if not translator.decode_config.compile_step:
            return
        log = logging.getLogger("ranmt.serving.app")
        if self.limits.batching == "step":
            log.warning("model '%s': decode.compile_step is not used by step-level batching "
                        "(it decodes eagerly); serve with --batching batch to compile", name)
        else:
            log.warning("model '%s': decode.compile_step compiles each new batch shape on "
                        "the first request that brings it (tens of seconds on a CPU; such "
                        "a request may pass --request-timeout)", name)

    async def _supervise(self, name: str, batcher: Batcher) -> None:
        """Run ``batcher``'s scheduling loop for as long as the server runs: if it raises,
        every job it held is answered 500 with the reason, and it starts again."""
        while True:
            try:
                await batcher.run()
            except Exception as err:  # noqa: BLE001 (a bug or a fault below: survive it)
                self.loop_failures[name] += 1
                self.metrics.errors.labels(name, "scheduler").inc()
                logging.getLogger("ranmt.serving.app").exception(
                    "the scheduling loop of model '%s' failed; restarting it", name)
                batcher.fail_all(RuntimeError(
                    f"the scheduling loop of model '{name}' failed ({type(err).__name__}: "
                    f"{err}); it was restarted"))
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        """Answer what is left (503), stop the loops and the decoding workers."""
        self._fail_all(self._shutting_down())
        if self.lag_monitor is not None:
            self.lag_monitor.cancel()
        for worker in self.workers.values():
            worker.cancel()
        for batcher in self.batchers.values():
            if isinstance(batcher, StepBatcher):
                batcher.stop()
        self.executor.shutdown(wait=True)

    def _fail_all(self, err: Exception) -> int:
        left = 0
        for name, batcher in self.batchers.items():
            count = batcher.fail_all(err)
            left += count
            if count:
                self.metrics.errors.labels(name, "shutdown").inc(count)
        return left

    @staticmethod
    def _shutting_down() -> UnavailableError:
        return UnavailableError("the server is shutting down: this request was not "
                               "finished within its drain period (--drain-s)", 5)

    def model_ready(self, name: str) -> bool:
        """Model ``name`` can decode now: its scheduling loop runs, its decoding worker (if
        any) is ready, and the server is not shutting down."""
        worker = self.workers.get(name)
        return not self.draining and worker is not None and not worker.done() and \
            self.batchers[name].status()["state"] == "ready"

    def running(self) -> bool:
        """Every model can decode now (:meth:`model_ready`)."""
        return bool(self.workers) and all(self.model_ready(name) for name in self.batchers)

    def states(self) -> dict[str, dict]:
        """Per model: state, reason (None when ready), workers replaced, loops restarted."""
        states = {}
        for name, batcher in self.batchers.items():
            status = dict(batcher.status())
            if self.draining:
                status.update(state="draining", reason="the server is shutting down")
            status["scheduler_restarts"] = self.loop_failures.get(name, 0)
            states[name] = status
        return states

    def in_flight(self) -> int:
        return sum(batcher.in_flight for batcher in self.batchers.values())

    def begin_drain(self, then: Callable[[], None]) -> None:
        """Graceful shutdown (in the event loop): refuse new requests, give those in
        flight ``limits.drain_s`` seconds, answer the rest 503, then ``then()`` (uvicorn's
        exit). A second call (a second signal) calls ``then`` at once."""
        if self.draining:
            then()
            return
        self.draining = True
        self._drain = asyncio.get_running_loop().create_task(self._drain_then(then))

    async def _drain_then(self, then: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.drain_s
        while self.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._fail_all(self._shutting_down()):
            await asyncio.sleep(0.2)  # their handlers answer before uvicorn stops
        then()

    def pick(self, requested: str | None, lines: list[str]) -> tuple[str, Translator]:
        """The model asked for; 404 if unknown, 503 at once if its queue has no room for
        ``lines`` (the request's source lines, counted untokenized by a lower bound)."""
        name = requested or self.default
        if name not in self.translators:
            raise RequestError(404, f"unknown model '{name}'; loaded: "
                                    f"{sorted(self.translators)}")
        if self.draining:
            raise UnavailableError("the server is shutting down", 5)
        try:
            self.batchers[name].refuse_if_down()
            self.batchers[name].refuse_if_full(fewest_tokens(lines))
        except QueueFullError:
            self.metrics.errors.labels(name, "overload").inc()
            raise
        except ModelUnavailableError:
            self.metrics.errors.labels(name, "unavailable").inc()
            raise
        return name, self.translators[name]

    async def run_job(self, request: Request, name: str, ids: list[list[int]], work: Work,
                      extras: list | None, timeout_s: float | None):
        """Queue one request's lines with its model and wait: its results, or the
        response for a client that left (499) or a failed decoding (500)."""
        batcher = self.batchers[name]
        errors = self.metrics.errors
        try:
            job = batcher.submit(ids, work, timeout_s or self.limits.request_timeout_s, extras)
        except QueueFullError:
            errors.labels(name, "overload").inc()
            raise
        batcher.in_flight += 1
        try:
            results = await wait_for_job(batcher, job, request.is_disconnected)
        except UnavailableError:
            raise  # counted where it was raised (unavailable, shutdown)
        except RequestError as err:
            errors.labels(name, "timeout" if err.status == 504 else "request").inc()
            raise
        except Exception as err:  # noqa: BLE001 (decoding failed: this request only)
            return JSONResponse({"error": f"decoding failed: {type(err).__name__}: {err}"},
                                status_code=500)
        finally:
            batcher.in_flight -= 1
        if results is None:  # the client left before its batch started: nothing decoded
            errors.labels(name, "disconnect").inc()
            return Response(status_code=499)
        return results
