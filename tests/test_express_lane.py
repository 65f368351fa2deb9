"""Step-level batching's express lane (``--express-rows``): small requests decode apart from
the main batch in steps that come first, the main batch keeping a third of the time; which
requests go there, that each lane has its own room, and that the translations are the
Python API's either way."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from conftest import assert_same_hypotheses

pytest.importorskip("fastapi")

from ranmt.inference.translator import Translator  # noqa: E402
from ranmt.serving.batching import Job, Work, wait_for_job  # noqa: E402
from ranmt.serving.limits import ServeLimits  # noqa: E402
from ranmt.serving.lines import LineDecoding  # noqa: E402
from ranmt.serving.step_batching import StepBatcher  # noqa: E402


class _Clock:
    """A clock that each fake decoder's step moves on by that decoder's step time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeDecoder:
    """A ContinuousDecoder stand-in: each step takes ``seconds`` on ``clock`` and is logged."""

    def __init__(self, name: str, seconds: float, clock: _Clock, log: list):
        self.name, self.seconds, self.clock, self.log = name, seconds, clock, log
        self.rows = 0

    def add(self, *_args) -> None:
        self.rows += 1

    def step(self) -> list:
        self.clock.now += self.seconds
        self.log.append(self.name)
        return []

    def idle(self) -> bool:
        return False


def _lanes(main_s: float, express_s: float) -> tuple[LineDecoding, list]:
    clock, log = _Clock(), []
    lines = LineDecoding(translator=None, clock=clock)
    lines.decoders[((("beam", 4),), False)] = (_FakeDecoder("main", main_s, clock, log), None)
    lines.decoders[((("beam", 4),), True)] = (_FakeDecoder("express", express_s, clock, log),
                                              None)
    return lines, log


def test_the_express_lane_steps_until_it_had_twice_the_main_lanes_step():
    lines, log = _lanes(main_s=0.5, express_s=1 / 32)  # exact in binary: no rounding
    for _ in range(65):
        lines.step()
    # the first step steps both (no main step measured yet); then the express lane alone
    # until it has had 2 x 0.5 s (its step beside the main one and 31 alone), then both
    # (express first), and so on
    assert log[:2] == ["express", "main"]
    mains = [i for i, name in enumerate(log) if name == "main"]
    assert mains == [1, 1 + 33, 1 + 2 * 33]
    assert log.count("express") == 65 and log.count("main") == 3


def test_without_an_express_line_the_main_lane_steps_every_time():
    lines, log = _lanes(main_s=0.075, express_s=0.005)
    del lines.decoders[((("beam", 4),), True)]
    for _ in range(5):
        lines.step()
    assert log == ["main"] * 5


def test_when_express_steps_are_long_both_lanes_alternate():
    lines, log = _lanes(main_s=0.010, express_s=0.030)
    for _ in range(4):
        lines.step()
    assert log == ["express", "main"] * 4  # 30 ms >= 2 x 10 ms: every step steps both


def _batcher(translator, **limits) -> StepBatcher:
    executor = concurrent.futures.ThreadPoolExecutor(1)
    return StepBatcher(translator, ServeLimits(batch_window_ms=1, workers="thread", **limits),
                       executor)


def test_which_requests_are_express(reverse_run):
    translator = Translator.load(reverse_run, device="cpu")
    batcher = _batcher(translator, express_rows=8)

    async def scenario():
        def express(lines: int, **work) -> bool:
            return batcher._express(batcher.submit([[5, 6]] * lines, Work.translate(**work), 5))

        assert express(2, beam=4, nbest=1)  # 8 rows
        assert not express(3, beam=4, nbest=1)  # 12
        assert not express(1, beam=9, nbest=1)
        assert express(8, beam=1, nbest=1)
        assert express(2, sampling="topk", topk=5, nbest=4)  # 2 x 4 draws
        assert not express(3, sampling="topk", topk=5, nbest=3)  # the beam plays no part
        default_beam = translator.decode_config.beam
        assert express(8 // default_beam, nbest=None) and \
            not express(8 // default_beam + 1, nbest=None)  # the checkpoint's beam
    asyncio.run(scenario())
    one_row = Job([[5]], Work.translate(beam=1, nbest=1), None, None, 0.0)
    assert batcher._express(one_row)
    assert not _batcher(translator, express_rows=0)._express(one_row)


def test_each_lane_has_its_own_room_and_the_translations_are_the_python_apis(reverse_run):
    """One line decodes at a time in the main lane (``max_batch_lines`` 1): a 2-line request
    at beam 4 holds it; a 1-line request is admitted at once into the express lane, beside
    it, and finishes first. Without the lane it waits for the main lane's room."""
    translator = Translator.load(reverse_run, device="cpu")
    long_ids = translator.encode_sources(["abcdefgh", "hgfedcba"])
    short_ids = translator.encode_sources(["ab"])
    expected = translator.translate_ids(long_ids + short_ids, beam=4)
    work = Work.translate(beam=4, nbest=1)

    async def scenario(express_rows: int):
        batcher = _batcher(translator, max_batch_lines=1, express_rows=express_rows)
        added = []
        engine_add = batcher.engine.add

        def recording(key, options, ids, prefix, line, express=False):
            added.append(express)
            engine_add(key, options, ids, prefix, line, express)

        batcher.engine.add = recording
        worker = asyncio.create_task(batcher.run())
        long_job = batcher.submit(long_ids, work, 60)
        await _until(lambda: batcher.inside)
        short_job = batcher.submit(short_ids, work, 60)
        await asyncio.sleep(0)
        batcher._arrival.set()
        await _until(lambda: short_job.taken or long_job.future.done())
        admitted_beside = long_job.taken == 1 and short_job.taken == 1 and \
            len(batcher.inside) == 2
        short = await asyncio.wait_for(wait_for_job(batcher, short_job, _false), 30)
        short_first = not long_job.future.done()
        long = await asyncio.wait_for(wait_for_job(batcher, long_job, _false), 30)
        worker.cancel()
        return added, admitted_beside, short_first, long + short

    added, beside, first, got = asyncio.run(scenario(express_rows=4))
    assert added == [False, True, False] and beside and first
    assert_same_hypotheses(got, expected, 1e-4)
    added, beside, first, got = asyncio.run(scenario(express_rows=0))
    assert added == [False, False, False] and not beside  # it waited for the main lane
    assert_same_hypotheses(got, expected, 1e-4)


async def _false() -> bool:
    return False


async def _until(condition, seconds: float = 30.0) -> None:
    """Wait until ``condition()`` holds; fail after ``seconds`` (a mutant that admits
    nothing fails here instead of hanging until mutmut's timeout)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_room_in_each_lane(reverse_run):
    """Lines and source tokens per lane: up to ``max_batch_lines`` lines and
    ``max_batch_tokens`` tokens each, a line alone in its lane always admitted."""
    batcher = _batcher(Translator.load(reverse_run, device="cpu"), max_batch_lines=2,
                       max_batch_tokens=10)
    assert batcher._room(False, 100) and batcher._room(True, 100)  # empty lanes
    batcher._place(Job([[5] * 5], GREEDY, None, None, 0.0), 0, 6)  # main: 1 line, 6 tokens
    assert batcher._room(False, 4) and not batcher._room(False, 5)
    assert batcher._room(True, 100)  # the express lane is still empty
    batcher._place(Job([[5] * 6], GREEDY, None, None, 0.0), 0, 7, express=True)
    assert batcher.express_tokens == 7 and batcher.decoding_tokens == 13
    assert batcher._room(True, 3) and not batcher._room(True, 4)  # 7 + 3 <= 10
    assert batcher._room(False, 4)  # the main lane counts its own tokens only
    key = next(iter(batcher.express_keys))
    batcher._place(Job([[5]], GREEDY, None, None, 0.0), 0, 2, express=True)
    assert not batcher._room(True, 1)  # 2 of 2 lines
    assert batcher._leave(key)[2] == 7
    assert batcher.express_tokens == 2 and batcher.decoding_tokens == 8
    assert batcher._room(True, 8) and not batcher._room(True, 9)


GREEDY = Work.translate(beam=1, nbest=1)
