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
