"""Step-level decoding of lines for ``ranmt serve`` (docs/SERVING.md, "Step-level batching").

* :class:`LineDecoding`: lines in, finished lines out. One
  :class:`ranmt.inference.continuous.ContinuousDecoder` per kind of work (decoding options)
  and lane; with sampling a line's ``nbest`` draws are decoded as rows of their own, from
  the line's own generator (:func:`ranmt.inference.translator.line_generator`), and
  answered together. :meth:`LineDecoding.step` advances every decoder by one step. It runs
  in a decoding worker process (:mod:`ranmt.serving.worker`, supervised by
  :mod:`ranmt.serving.supervisor`) or in the server's decoding thread:
* :class:`ThreadDecoding` (``--workers thread``) runs those steps in the server's decoding
  thread, one per call, so that lines are admitted between two steps. Decoding and the
  HTTP side then share one interpreter.

Both engines (this one and :class:`ranmt.serving.supervisor.ProcessDecoding`) tell the
queue (:class:`ranmt.serving.step_batching.StepBatcher`) what finished through
``on_done(key, hypotheses)`` and ``on_failed(keys, error)`` (``key``: the queue's number for
one line of one request), and how many steps were taken with how many sentences through
``on_steps(steps, sentences)``. ``cancel(keys)`` drops lines (a request past its deadline,
or whose client left) from the decoding batch between two steps.
"""

from __future__ import annotations

import asyncio
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

    def cancel(self, keys: set[int]) -> None:
        """Drop the lines ``keys`` (queued or decoding, every draw of a sampled line) from
        their decoders; they are never answered."""
        for lane in list(self.decoders):
            mine = self.keys[lane] & keys
            if not mine:
                continue
            decoder, settings = self.decoders[lane]
            draws = settings.nbest if settings.sampling != "none" else 1
            decoder.cancel({(key, draw) for key in mine for draw in range(draws)})
            self.keys[lane] -= mine
            for key in mine:
                self.draws.pop(key, None)
            if decoder.idle():
                del self.decoders[lane], self.keys[lane]

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
    """Step-level decoding in the server's decoding thread (``executor``). Lines dropped
    while a step runs there are dropped before the next step, in that thread."""

    state = "ready"  # always: it decodes in the server's own thread
    reason: str | None = None
    restarts = 0
    ready = True

    def __init__(self, translator, executor, on_done: OnDone, on_failed: OnFailed,
                 on_steps: OnSteps):
        self.lines = LineDecoding(translator)
        self.executor = executor
        self.on_done, self.on_failed, self.on_steps = on_done, on_failed, on_steps
        self.cancelled: set[int] = set()

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def retry_after(self) -> float:
        return 0.0

    def add(self, key: int, options: tuple, ids: list[int], prefix, line: int,
            express: bool = False) -> None:
        self.lines.add(key, options, ids, prefix, line, express)

    def cancel(self, keys: list[int]) -> None:
        self.cancelled.update(keys)

    async def wait_ready(self) -> None:
        pass

    def _step(self):
        """In the decoding thread: drop what was cancelled, then one step."""
        if self.cancelled:
            cancelled, self.cancelled = self.cancelled, set()
            self.lines.cancel(cancelled)
        if self.lines.idle():
            return [], []
        return self.lines.step()

    async def advance(self, arrival: asyncio.Event) -> None:
        """One step of every decoder, its results reported."""
        sentences = self.lines.sentences()
        finished, failed = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._step)
        self.on_steps(1, sentences)
        for keys, err in failed:
            self.on_failed(keys, err)
        for key, hyps in finished:
            self.on_done(key, hyps)

