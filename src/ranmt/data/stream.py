"""Streaming pieces of ``ranmt prepare``: corpora read line by line, never held whole.

* :func:`iter_lines` / :func:`iter_parallel`: the lines of plain, ``.gz`` or ``.xz`` text
  files, read as :func:`ranmt.data.text.read_lines` reads them (UTF-8, BOM dropped, ``\\n``,
  ``\\r\\n`` and ``\\r`` endings) but one at a time;
* :class:`PairReservoir`: a uniform, seeded sample of at most K pairs drawn in one pass
  (reservoir sampling, Vitter's Algorithm R), returned in corpus order — the SentencePiece
  training text;
* :class:`ChunkEncoder`: SentencePiece encoding of chunks of pairs in worker processes, in
  order, with a bounded number of chunks in flight;
* :class:`TokenWriter`: the flat token / offset arrays of a split appended chunk by chunk
  to the ``.npy`` files that :func:`ranmt.data.corpus.load_split` memory-maps.

Memory is bounded by the chunk size, the chunks in flight and the SentencePiece sample,
not by the corpus. This module imports no torch: the worker processes stay small.
"""

from __future__ import annotations

import array
import bz2
import collections
import gzip
import io
import itertools
import lzma
import multiprocessing
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ranmt.data.text import TextError

OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


class ParallelLengthError(ValueError):
    """Two sides of a parallel corpus with different numbers of lines."""


def iter_lines(path: str | Path, errors: str = "strict") -> Iterator[str]:
    """The lines of a UTF-8 text file (``.gz``/``.xz``/``.bz2`` read transparently), one at
    a time, exactly as :func:`ranmt.data.text.read_lines` returns them all at once."""
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be strict or replace, not '{errors}'")
    path = Path(path)
    if not path.is_file():
        raise TextError(f"{path}: file does not exist")
    opener = OPENERS.get(path.suffix, open)
    offset = 0
    with opener(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                text = raw.decode("utf-8", errors=errors)
            except UnicodeDecodeError as err:
                raise TextError(f"{path}: invalid UTF-8 at byte {offset + err.start} (line "
                                f"{number}); fix the file or pass --errors replace") from None
            offset += len(raw)
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            if text.endswith("\n"):
                text = text[:-1]
            if text.endswith("\r"):  # "\r\n", or a lone "\r" that ends the file
                text = text[:-1]
            if "\r" in text:  # old Mac line endings: "\r" alone separates lines too
                yield from text.split("\r")
            else:
                yield text


def iter_parallel(prefix: str, src: str, tgt: str, errors: str = "strict",
                  ) -> Iterator[tuple[str, str]]:
    """(source, target) pairs of PREFIX.SRC / PREFIX.TGT (compressed: PREFIX.SRC.gz, ...),
    whitespace-stripped; :class:`ParallelLengthError` when the files differ in length."""
    src_path, tgt_path = resolve(f"{prefix}.{src}"), resolve(f"{prefix}.{tgt}")
    src_lines, tgt_lines = iter_lines(src_path, errors), iter_lines(tgt_path, errors)
    for count, pair in enumerate(itertools.zip_longest(src_lines, tgt_lines)):
        if pair[0] is None or pair[1] is None:
            src_count = count + (pair[0] is not None) + sum(1 for _ in src_lines)
            tgt_count = count + (pair[1] is not None) + sum(1 for _ in tgt_lines)
            raise ParallelLengthError(f"parallel files differ in length: {src_path} has "
                                      f"{src_count} lines, {tgt_path} has {tgt_count}")
        yield pair[0].strip(), pair[1].strip()


def resolve(path: str) -> Path:
    """``path`` itself, else the first of ``path.gz`` / ``.xz`` / ``.bz2`` that exists."""
    plain = Path(path)
    if plain.is_file():
        return plain
    for suffix in OPENERS:
        packed = Path(path + suffix)
        if packed.is_file():
            return packed
    return plain  # iter_lines names the missing file


class PairReservoir:
    """A uniform sample of at most ``capacity`` pairs of a stream (Algorithm R, seeded).

    :meth:`add` every pair in order; :meth:`sample` returns the kept pairs in corpus order,
    so that a stream no longer than ``capacity`` comes back whole and unchanged. The pairs
    are held as two lists of strings and an array of positions (no per-pair tuple).
    """

    def __init__(self, capacity: int, seed: int = 1):
        if capacity < 1:
            raise ValueError(f"the sample must hold at least one pair, not {capacity}")
        self.capacity = capacity
        self.rng = random.Random(seed)
        self.seen = 0
        self.src: list[str] = []
        self.tgt: list[str] = []
        self.positions = array.array("q")

    def add(self, src: str, tgt: str) -> None:
        if self.seen < self.capacity:
            self.src.append(src)
            self.tgt.append(tgt)
            self.positions.append(self.seen)
        else:
            slot = self.rng.randrange(self.seen + 1)
            if slot < self.capacity:
                self.src[slot], self.tgt[slot] = src, tgt
                self.positions[slot] = self.seen
        self.seen += 1

    def sample(self) -> tuple[list[str], list[str]]:
        """(source lines, target lines) of the sample, in corpus order."""
        order = np.argsort(np.frombuffer(self.positions, dtype=np.int64), kind="stable")
        return [self.src[i] for i in order], [self.tgt[i] for i in order]


# ------------------------------------------------------------------ encoding in workers

_WORKER_VOCABS: tuple | None = None


def _load_worker(src_model: str, tgt_model: str) -> None:
    """Process initializer: load the two SentencePiece models once per worker."""
    import sentencepiece as spm

    global _WORKER_VOCABS
    _WORKER_VOCABS = (spm.SentencePieceProcessor(model_file=src_model),
                      spm.SentencePieceProcessor(model_file=tgt_model))


def _pack(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 ids, int64 lengths) of a list of id lists."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                       count=int(lengths.sum()))
    return flat, lengths


def encode_chunk(src_lines: list[str], tgt_lines: list[str]) -> tuple[np.ndarray, ...]:
    """(source ids, source lengths, target ids, target lengths) of a chunk of pairs, with
    the models :func:`_load_worker` loaded into this process."""
    src_vocab, tgt_vocab = _WORKER_VOCABS
    return (*_pack(src_vocab.encode(src_lines, out_type=int)),
            *_pack(tgt_vocab.encode(tgt_lines, out_type=int)))


class ChunkEncoder:
    """Encode chunks of pairs in ``workers`` processes (in this process for 1), in order.

    :meth:`map` takes an iterable of ``(tag, src_lines, tgt_lines)`` and yields
    ``(tag, src_lines, tgt_lines, encoded)`` (:func:`encode_chunk`) in the same order; at
    most ``2 x workers`` chunks are in flight, so memory does not grow with the input. Use
    as a context manager.
    """

    def __init__(self, src_model: str | Path, tgt_model: str | Path, workers: int = 1):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, not {workers}")
        self.models = (str(src_model), str(tgt_model))
        self.workers = workers
        self.pool = None

    def __enter__(self) -> ChunkEncoder:
        if self.workers == 1:
            _load_worker(*self.models)
        else:  # spawn: the workers import numpy and sentencepiece, not the caller's torch
            context = multiprocessing.get_context("spawn")
            self.pool = context.Pool(self.workers, initializer=_load_worker,
                                     initargs=self.models)
        return self

    def __exit__(self, kind, *_):
        if self.pool is not None:
            if kind is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()

    def map(self, chunks: Iterable[tuple]) -> Iterator[tuple]:
        if self.pool is None:
            for tag, src_lines, tgt_lines in chunks:
                yield tag, src_lines, tgt_lines, encode_chunk(src_lines, tgt_lines)
            return
        pending: collections.deque = collections.deque()
        for tag, src_lines, tgt_lines in chunks:
            result = self.pool.apply_async(encode_chunk, (src_lines, tgt_lines))
            pending.append((tag, src_lines, tgt_lines, result))
            if len(pending) >= 2 * self.workers:
                *head, result = pending.popleft()
                yield *head, result.get()
        while pending:
            *head, result = pending.popleft()
            yield *head, result.get()


def chunked(pairs: Iterable[tuple[str, str]], size: int) -> Iterator[tuple[list, list]]:
    """(source lines, target lines) of consecutive chunks of at most ``size`` pairs."""
    iterator = iter(pairs)
    while True:
        chunk = list(itertools.islice(iterator, size))
        if not chunk:
            return
        yield [s for s, _ in chunk], [t for _, t in chunk]


# ------------------------------------------------------------------ incremental output


class TokenWriter:
    """One side of a split, written incrementally: ``PATH.tokens.npy`` (flat int32 ids) and
    ``PATH.offsets.npy`` (int64, sentence i is ``tokens[offsets[i]:offsets[i+1]]``).

    Chunks are appended to the ``.npy`` files behind a placeholder header, which
    :meth:`close` overwrites with the real one: the same bytes ``np.save`` writes for the
    whole arrays, without holding them or copying the files.
    """

    HEADER = 128  # bytes of a version 1.0 .npy header of any 1-D int32/int64 array

    def __init__(self, path: str | Path):
        self.path = str(path)
        # The handles live as long as the writer: close() or abort() ends them.
        self.tokens = open(f"{self.path}.tokens.npy", "wb")  # noqa: SIM115
        self.offsets = open(f"{self.path}.offsets.npy", "wb")  # noqa: SIM115
        for handle in (self.tokens, self.offsets):
            handle.write(bytes(self.HEADER))
        self.offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        self.total = 0
        self.count = 0
        self.longest = 0

    def write(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        self.tokens.write(np.ascontiguousarray(flat, dtype="<i4").tobytes())
        ends = self.total + np.cumsum(lengths, dtype=np.int64)
        self.offsets.write(ends.astype("<i8", copy=False).tobytes())
        if len(lengths):
            self.total = int(ends[-1])
            self.longest = max(self.longest, int(lengths.max()))
        self.count += len(lengths)

    def close(self) -> None:
        for handle, dtype, count in ((self.tokens, "<i4", self.total),
                                     (self.offsets, "<i8", self.count + 1)):
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {
                "descr": dtype, "fortran_order": False, "shape": (count,)})
            if len(header.getvalue()) != self.HEADER:
                raise AssertionError(f"unexpected .npy header size {len(header.getvalue())}")
            handle.seek(0)
            handle.write(header.getvalue())
            handle.close()

    def abort(self) -> None:
        self.tokens.close()
        self.offsets.close()
