"""The streaming preparation's small parts, against exact expectations (the mutation run of
data/stream.py found them unchecked, docs/MUTATION.md): the parallel reader's length error
and decoding errors, and the reservoir sample (Algorithm R, seeded, in corpus order)."""

from __future__ import annotations

import random
import re

import pytest

from ranmt.data.stream import PairReservoir, ParallelLengthError, iter_parallel
from ranmt.data.text import TextError


def _write(path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


@pytest.mark.parametrize(("src_lines", "tgt_lines"), [(5, 3), (3, 5), (1, 4), (4, 0)])
def test_parallel_length_error_counts_both_files(tmp_path, src_lines, tgt_lines):
    _write(tmp_path / "c.en", [b"s%d" % i for i in range(src_lines)])
    _write(tmp_path / "c.de", [b"t%d" % i for i in range(tgt_lines)])
    with pytest.raises(ParallelLengthError) as error:
        list(iter_parallel(str(tmp_path / "c"), "en", "de"))
    counts = [int(n) for n in re.findall(r"has (\d+)", str(error.value))]
    assert counts == [src_lines, tgt_lines]


def test_parallel_pairs_are_stripped_and_in_order(tmp_path):
    _write(tmp_path / "c.en", [b" a b ", b"c\t"])
    _write(tmp_path / "c.de", [b"x", b"  y z"])
    assert list(iter_parallel(str(tmp_path / "c"), "en", "de")) == [("a b", "x"), ("c", "y z")]


def test_parallel_decoding_errors_apply_to_both_sides(tmp_path):
    _write(tmp_path / "c.en", [b"ok", b"bad \xff src"])
    _write(tmp_path / "c.de", [b"bad \xfe tgt", b"ok"])
    with pytest.raises(TextError, match="invalid UTF-8"):
        list(iter_parallel(str(tmp_path / "c"), "en", "de"))
    pairs = list(iter_parallel(str(tmp_path / "c"), "en", "de", errors="replace"))
    assert pairs == [("ok", "bad \ufffd tgt"), ("bad \ufffd src", "ok")]


def _algorithm_r(items: list[int], capacity: int, seed: int) -> list[int]:
    """Algorithm R written out independently: the positions kept, in corpus order."""
    rng = random.Random(seed)
    kept: list[int] = []
    for seen, item in enumerate(items):
        if seen < capacity:
            kept.append(item)
        else:
            slot = rng.randrange(seen + 1)
            if slot < capacity:
                kept[slot] = item
    return sorted(kept)


@pytest.mark.parametrize(("count", "capacity", "seed"), [(50, 7, 1), (200, 13, 5), (9, 9, 2),
                                                         (30, 1, 3)])
def test_reservoir_is_algorithm_r_in_corpus_order(count, capacity, seed):
    reservoir = PairReservoir(capacity, seed=seed)
    for i in range(count):
        reservoir.add(f"s{i}", f"t{i}")
    src, tgt = reservoir.sample()
    expected = _algorithm_r(list(range(count)), capacity, seed)
    assert src == [f"s{i}" for i in expected] and tgt == [f"t{i}" for i in expected]


def test_reservoir_seed_decides_the_sample_and_a_short_stream_comes_back_whole():
    def sample(seed: int) -> list[str]:
        reservoir = PairReservoir(10, seed=seed)
        for i in range(500):
            reservoir.add(f"s{i}", f"t{i}")
        return reservoir.sample()[0]

    assert sample(4) == sample(4) and sample(4) != sample(5)
    short = PairReservoir(10)
    for i in range(6):
        short.add(f"s{i}", f"t{i}")
    assert short.sample() == ([f"s{i}" for i in range(6)], [f"t{i}" for i in range(6)])


def test_reservoir_needs_room_for_one_pair():
    PairReservoir(1)  # the smallest sample
    with pytest.raises(ValueError, match="at least one pair, not 0"):
        PairReservoir(0)


def test_reading_errors_name_the_problem(tmp_path):
    from ranmt.data.stream import iter_lines

    with pytest.raises(TextError, match=r"missing\.txt: file does not exist"):
        list(iter_lines(tmp_path / "missing.txt"))
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(ValueError, match="errors must be strict or replace, not 'ignore'"):
        list(iter_lines(tmp_path / "a.txt", errors="ignore"))


def test_chunks_hold_at_most_size_pairs_in_order():
    from ranmt.data.stream import chunked

    pairs = [(f"s{i}", f"t{i}") for i in range(7)]
    chunks = list(chunked(pairs, 3))
    assert [len(src) for src, _ in chunks] == [3, 3, 1]
    assert chunks[2] == (["s6"], ["t6"])
    assert list(chunked([], 3)) == []


def test_chunk_encoder_needs_a_worker():
    from ranmt.data.stream import ChunkEncoder

    with pytest.raises(ValueError, match="--workers must be at least 1, not 0"):
        ChunkEncoder("a.model", "b.model", workers=0)


class _FakeResult:
    def __init__(self, pool, fn, args):
        self.pool, self.fn, self.args = pool, fn, args

    def get(self):
        self.pool.in_flight -= 1
        return self.fn(*self.args)


class _FakePool:
    """What ``ChunkEncoder`` asks of a process pool, recorded; work runs at ``get``."""

    def __init__(self, processes, initializer=None, initargs=()):
        self.processes, self.initializer, self.initargs = processes, initializer, initargs
        self.in_flight = self.most_in_flight = 0
        self.events: list[str] = []

    def apply_async(self, fn, args):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return _FakeResult(self, fn, args)

    def close(self):
        self.events.append("close")

    def terminate(self):
        self.events.append("terminate")

    def join(self):
        self.events.append("join")


@pytest.fixture()
def fake_pools(monkeypatch):
    """``multiprocessing`` contexts replaced: (the start methods asked for, the pools made);
    chunks are 'encoded' to their line counts, models loaded in this process recorded."""
    from ranmt.data import stream

    asked, pools, loaded = [], [], []

    class Context:
        def Pool(self, *args, **kwargs):  # noqa: N802 (multiprocessing's name)
            pools.append(_FakePool(*args, **kwargs))
            return pools[-1]

    def get_context(method):
        asked.append(method)
        return Context()
    monkeypatch.setattr(stream.multiprocessing, "get_context", get_context)
    monkeypatch.setattr(stream, "encode_chunk", lambda src, tgt: (len(src), len(tgt)))
    monkeypatch.setattr(stream, "_load_worker", lambda *models: loaded.append(models))
    return asked, pools, loaded


def test_one_worker_encodes_here_and_more_in_a_spawned_pool_of_that_many(fake_pools):
    """Workers are spawned (they import numpy and SentencePiece, not the caller's torch),
    exactly ``workers`` of them, each loading both models; one worker needs no pool."""
    from ranmt.data.stream import ChunkEncoder, _load_worker

    asked, pools, loaded = fake_pools
    with ChunkEncoder("s.model", "t.model") as encoder:  # one worker unless told
        assert encoder.pool is None and loaded == [("s.model", "t.model")]
        assert list(encoder.map([(0, ["a"], ["b"])])) == [(0, ["a"], ["b"], (1, 1))]
    assert asked == [] and pools == []
    with ChunkEncoder("s.model", "t.model", workers=2) as encoder:
        assert asked == ["spawn"] and encoder.pool is pools[0]
        assert (pools[0].processes, pools[0].initargs) == (2, ("s.model", "t.model"))
        assert pools[0].initializer is _load_worker


@pytest.mark.parametrize("workers", [2, 3])
def test_at_most_twice_the_workers_chunks_are_in_flight_in_order(fake_pools, workers):
    from ranmt.data.stream import ChunkEncoder

    _, pools, _ = fake_pools
    chunks = [(tag, ["x"] * tag, ["y"] * (tag + 1)) for tag in range(11)]
    with ChunkEncoder("s.model", "t.model", workers=workers) as encoder:
        out = list(encoder.map(chunks))
    assert out == [(tag, src, tgt, (tag, tag + 1)) for tag, src, tgt in chunks]
    assert pools[0].most_in_flight == 2 * workers and pools[0].in_flight == 0


def test_the_pool_is_closed_after_success_and_terminated_after_an_error(fake_pools):
    from ranmt.data.stream import ChunkEncoder

    _, pools, _ = fake_pools
    with ChunkEncoder("s.model", "t.model", workers=2):
        pass
    with pytest.raises(RuntimeError), ChunkEncoder("s.model", "t.model", workers=2):
        raise RuntimeError("interrupted")
    assert [pool.events for pool in pools] == [["close", "join"], ["terminate", "join"]]


def test_a_split_of_empty_lines_has_longest_zero_and_writes_valid_arrays(tmp_path):
    import numpy as np

    from ranmt.data.stream import TokenWriter

    writer = TokenWriter(tmp_path / "train.en")
    writer.write(np.zeros(0, dtype=np.int32), np.zeros(3, dtype=np.int64))
    writer.close()
    assert (writer.longest, writer.count, writer.total) == (0, 3, 0)
    assert np.load(tmp_path / "train.en.offsets.npy").tolist() == [0, 0, 0, 0]
    assert np.load(tmp_path / "train.en.tokens.npy").shape == (0,)


def test_a_npy_header_of_another_size_is_an_error_naming_it(tmp_path, monkeypatch):
    from ranmt.data.stream import TokenWriter

    monkeypatch.setattr(TokenWriter, "HEADER", 64)
    writer = TokenWriter(tmp_path / "train.en")
    with pytest.raises(AssertionError, match=r"^unexpected \.npy header size 128$"):
        writer.close()
    writer.abort()
