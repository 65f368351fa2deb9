"""Where ``ranmt serve`` runs a model's step-level decoding: in a process of its own (the
default) or in a thread of the server's process.

* :class:`LineDecoding`: lines in, finished lines out. One
  :class:`ranmt.inference.continuous.ContinuousDecoder` per kind of work (decoding options); with
  sampling a line's ``nbest`` draws are decoded as rows of their own, from the line's own
  generator (:func:`ranmt.inference.translator.line_generator`), and answered together.
  :meth:`LineDecoding.step` advances every decoder by one step.
* :class:`ThreadDecoding` (``--workers thread``) runs those steps in the server's decoding
  thread, one per call, so that lines are admitted between two steps. Decoding and the
  HTTP side then share one interpreter.
* :class:`ProcessDecoding` (``--workers process``) runs them in a child process that loads
  the model itself (same checkpoint, device, quantization, precision) and steps for as
  long as it holds lines. Lines go to it and finished lines come back over a pipe, which
  the event loop watches: the server's process only parses, tokenizes, queues and answers,
  so ``/health``, ``/ready``, ``/metrics`` and refusals never wait for a decoding step,
  and the worker runs at a lower scheduling priority (``nice`` 19 by default,
  ``--worker-nice``) so that on a busy machine the HTTP side gets the CPU when it needs
  it. A worker that exits (killed, out of memory) is started again; the lines it held are
  answered 500. A first worker that exits before it is ready fails the server's start;
  after three restarts in a row that never got ready no more are started (``/ready``
  stays 503, waiting requests get 504).

Both tell the queue (:class:`ranmt.serving.batching.StepBatcher`) what finished through
``on_done(key, hypotheses)`` and ``on_failed(keys, error)`` (``key``: the queue's number for
one line of one request), and how many steps were taken with how many sentences through
``on_steps(steps, sentences)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import Any

OnDone = Callable[[int, list], None]
OnFailed = Callable[[list[int], Exception], None]
OnSteps = Callable[[int, int], None]


class LineDecoding:
    """Lines in, finished lines out, for one loaded
    :class:`ranmt.inference.translator.Translator`."""

    EXPRESS_SHARE = 2.0
    """While both lanes hold lines, the main lane steps once the express lane's time since
    the main lane's last step reaches this many times that step's time: with express steps
    short beside the main lane's (what the lane is for) the express lane gets about two
    thirds of the decoding time and the main lane one third; at worst the lanes alternate."""

    def __init__(self, translator, clock: Callable[[], float] = time.perf_counter):
        self.translator = translator
        # (options, express) -> (ContinuousDecoder, DecodeConfig); options: sorted (name,
        # value) pairs of decoding settings; express: the lane (see step)
        self.decoders: dict[tuple, Any] = {}
        self.keys: dict[tuple, set[int]] = {}  # same keys -> keys of the lines decoding there
        self.draws: dict[int, list] = {}  # sampling: key -> the line's draws so far
        self.clock = clock
        self.main_step_s = 0.0  # how long the main lane's last step took
        self.express_s = 0.0  # express steps' time since the main lane's last step

    def add(self, key: int, options: tuple, ids: list[int], prefix: list[int] | None,
            line: int, express: bool = False) -> None:
        """Line ``line`` of a request (``ids``; ``prefix`` or None), decoded with
        ``options`` (sorted (name, value) pairs of decoding settings), in the express lane
        or the main one."""
        from ranmt.inference.translator import line_generator

        lane = (options, express)
        if lane not in self.decoders:
            self.decoders[lane] = self.translator.continuous_decoder(**dict(options))
            self.keys[lane] = set()
        decoder, settings = self.decoders[lane]
        if settings.sampling != "none":
            generator = line_generator(settings.seed, line, self.translator.device)
            self.draws[key] = [None] * settings.nbest
            for draw in range(settings.nbest):
                decoder.add((key, draw), ids, prefix, generator)
        else:
            decoder.add((key, 0), ids, prefix)
        self.keys[lane].add(key)

    def idle(self) -> bool:
        return not self.decoders

    def sentences(self) -> int:
        """Sentences (draws, with sampling) in the decoding batches now."""
        return sum(decoder.decoding + len(decoder.waiting)
                   for decoder, _ in self.decoders.values())

    def step(self) -> tuple[list[tuple[int, list]], list[tuple[list[int], Exception]]]:
        """One step of every decoder, except that while the express lane holds lines the
        main lane's decoders step only once the express lane has had
        :attr:`EXPRESS_SHARE` times the main lane's last step: (finished lines (key,
        hypotheses), failures (the keys of a decoder whose step raised, the error)).

        On a CPU a step costs in proportion to its rows: a one-line request decoded beside
        a 1,000-row batch takes a step of that batch per token. In a lane of its own it
        takes ~20 short steps in the time of about one long one (SERVING.md, "Run 6")."""
        express = [lane for lane in self.decoders if lane[1]]
        main = [lane for lane in self.decoders if not lane[1]]
        if express and main and self.express_s < self.EXPRESS_SHARE * self.main_step_s:
            main = []
        finished, failed = [], []
        started = self.clock()
        self._step_lanes(express, finished, failed)
        middle = self.clock()
        self._step_lanes(main, finished, failed)
        if main:  # the express step just taken counts towards the next main step
            self.main_step_s, self.express_s = self.clock() - middle, middle - started
        else:
            self.express_s += middle - started
        return finished, failed

    def _step_lanes(self, lanes: list[tuple], finished: list, failed: list) -> None:
        """One step of each of ``lanes``' decoders, their results added to ``finished``
        and ``failed``."""
        for lane in lanes:
            decoder, _ = self.decoders[lane]
            try:
                done = decoder.step()
            except Exception as err:  # noqa: BLE001 (reported to the lines decoding there)
                keys = self.keys.pop(lane)
                del self.decoders[lane]
                for key in keys:
                    self.draws.pop(key, None)
                failed.append((sorted(keys), err))
                continue
            for (key, draw), hyps in done:
                if key in self.draws:  # sampling: each draw is one added line
                    draws = self.draws[key]
                    draws[draw] = hyps[0]
                    if any(hyp is None for hyp in draws):
                        continue
                    hyps = self.draws.pop(key)
                self.keys[lane].discard(key)
                finished.append((key, hyps))
            if decoder.idle():
                del self.decoders[lane], self.keys[lane]


class ThreadDecoding:
    """Step-level decoding in the server's decoding thread (``executor``)."""

    ready = True

    def __init__(self, translator, executor, on_done: OnDone, on_failed: OnFailed,
                 on_steps: OnSteps):
        self.lines = LineDecoding(translator)
        self.executor = executor
        self.on_done, self.on_failed, self.on_steps = on_done, on_failed, on_steps

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add(self, key: int, options: tuple, ids: list[int], prefix, line: int,
            express: bool = False) -> None:
        self.lines.add(key, options, ids, prefix, line, express)

    async def wait_ready(self) -> None:
        pass

    async def advance(self, arrival: asyncio.Event) -> None:
        """One step of every decoder, its results reported."""
        sentences = self.lines.sentences()
        finished, failed = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.lines.step)
        self.on_steps(1, sentences)
        for keys, err in failed:
            self.on_failed(keys, err)
        for key, hyps in finished:
            self.on_done(key, hyps)


class WorkerDiedError(RuntimeError):
    """The decoding worker process exited while it held lines."""


class ProcessDecoding:
    """Step-level decoding in a process of its own (see the module docstring).

    ``load``: the keyword arguments of :meth:`ranmt.inference.translator.Translator.load` that give
    the served model (:attr:`ranmt.inference.translator.Translator.load_options`)."""

    def __init__(self, load: dict, name: str, on_done: OnDone, on_failed: OnFailed,
                 on_steps: OnSteps, nice: int = 19):
        self.load = load
        self.nice = nice  # the worker's scheduling niceness (ServeLimits.worker_nice)
        self.name = name
        self.on_done, self.on_failed, self.on_steps = on_done, on_failed, on_steps
        self.process = None
        self.connection = None
        self.ready = False
        self.restarts = 0
        self.failed_starts = 0  # workers in a row that exited before they were ready
        self.error: str | None = None  # set when no more workers are started
        self.held: set[int] = set()  # keys sent and not answered
        self._news = asyncio.Event()
        self._became_ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start the worker and wait until it has loaded the model and decoded once."""
        self._loop = asyncio.get_running_loop()
        self._spawn()
        await self._became_ready.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    def _spawn(self) -> None:
        context = _context()
        parent, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, self.load, self.nice),
                                       name=f"ranmt-decode-{self.name}", daemon=True)
        self.process.start()
        child.close()
        self.connection = parent
        self.ready = False
        self._became_ready.clear()
        self._loop.add_reader(parent.fileno(), self._readable)

    def stop(self) -> None:
        if self.connection is not None:
            self._loop.remove_reader(self.connection.fileno())
            with contextlib.suppress(OSError):
                self.connection.send(("stop",))
            self.connection.close()
            self.connection = None
        if self.process is not None:
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)

    def add(self, key: int, options: tuple, ids: list[int], prefix, line: int,
            express: bool = False) -> None:
        self.held.add(key)
        self.connection.send(("add", key, options, ids, prefix, line, express))

    async def wait_ready(self) -> None:
        """Until a worker is ready; RuntimeError when none can start (``error``)."""
        await self._became_ready.wait()
        if self.error is not None:
            raise RuntimeError(self.error)

    async def advance(self, arrival: asyncio.Event) -> None:
        """Until the worker reports (finished lines arrive from it as it decodes), a new
        request arrives, or 50 ms pass (deadlines of waiting requests)."""
        if not self._news.is_set():
            waits = [asyncio.ensure_future(self._news.wait()),
                     asyncio.ensure_future(arrival.wait())]
            await asyncio.wait(waits, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for waiting in waits:
                waiting.cancel()
        self._news.clear()

    def _readable(self) -> None:
        """The event loop's callback when the pipe has data (or was closed)."""
        try:
            while self.connection.poll():
                self._handle(self.connection.recv())
        except (EOFError, OSError):
            self._died()
        self._news.set()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self.ready = True
            self.failed_starts = 0
            self._became_ready.set()
        elif kind == "done":
            self.on_steps(message[2], message[3])
            for key, hyps in message[1]:
                self.held.discard(key)
                self.on_done(key, hyps)
        elif kind == "failed":
            keys, text = message[1], message[2]
            self.held.difference_update(keys)
            self.on_failed(keys, RuntimeError(text))

    def _died(self) -> None:
        """The worker exited: fail the lines it held, start a new one."""
        self._loop.remove_reader(self.connection.fileno())
        self.connection.close()
        self.connection = None
        self.process.join(5)
        code = self.process.exitcode
        keys, self.held = sorted(self.held), set()
        if keys:
            self.on_failed(keys, WorkerDiedError(
                f"the decoding worker of model '{self.name}' exited (code {code}) while "
                "decoding this request"))
        if not self.ready:
            self.failed_starts += 1
        if (self.restarts == 0 and not self.ready) or self.failed_starts >= 3:
            # It cannot start (the first one, or three in a row): give up, say why.
            self.error = (f"the decoding worker of model '{self.name}' exited (code {code}) "
                          f"before it was ready; no new one is started")
            print(f"ranmt serve: {self.error}", file=sys.stderr)
            self._became_ready.set()  # wakes start(), which raises
            return
        print(f"ranmt serve: the decoding worker of model '{self.name}' exited (code {code});"
              " starting a new one", file=sys.stderr)
        self.restarts += 1
        self.ready = False
        self._spawn()


def _context():
    """Workers are forked from a clean server process that has imported torch and ranmt
    but run nothing (``forkserver``): they start in a fraction of a second, and no thread
    pool of the serving process is copied into them (``spawn`` where there is no
    forkserver)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows: spawn
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ranmt.serving.worker", "ranmt.inference.translator"])
    return context


def _worker_main(connection, load: dict, nice: int = 19) -> None:
    """The worker process: load the model, then take lines and step while it holds any."""
    from ranmt.inference.translator import Translator
    from ranmt.serving.app import freeze_startup_heap, warm_up

    with contextlib.suppress(OSError):
        os.nice(nice)
    translator = Translator.load(**load)
    warm_up(translator)
    freeze_startup_heap()  # no full collection stalls a decoding step on the model's objects
    lines = LineDecoding(translator)
    connection.send(("ready",))
    steps = 0  # since the last report
    while True:
        if lines.idle() or connection.poll():
            message = connection.recv()  # blocks while there is nothing to decode
            if message[0] == "stop":
                return
            lines.add(*message[1:])
            continue  # take every line already sent before the next step
        sentences = lines.sentences()
        finished, failed = lines.step()
        steps += 1
        if finished:  # (lines, steps since the last report, sentences in the last step)
            connection.send(("done", finished, steps, sentences))
            steps = 0
        for keys, err in failed:
            connection.send(("failed", keys, f"{type(err).__name__}: {err}"))
