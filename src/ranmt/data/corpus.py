"""``ranmt prepare`` and loading of prepared data.

A prepared-data directory holds:

* ``spm.src.model`` / ``spm.tgt.model`` (identical files for a joint vocabulary);
* ``SPLIT.{src,tgt}.tokens.npy`` (flat int32 ids) and ``SPLIT.{src,tgt}.offsets.npy``
  (int64; sentence i is ``tokens[offsets[i]:offsets[i+1]]``, no BOS/EOS), memory-mapped when
  loaded (data written by ranmt 0.1's first format, ``SPLIT.safetensors``, is still read);
* ``SPLIT.src.txt`` / ``SPLIT.tgt.txt``: the raw text of the kept pairs (references);
* ``meta.json``: languages, counts, dropped pairs, mean lengths, gamma = mean source /
  mean target subword length over the training data (for hard-coded cross-attention).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from ranmt.data.stream import (
    ChunkEncoder,
    PairReservoir,
    ParallelLengthError,
    TokenWriter,
    chunked,
    iter_parallel,
    resolve,
)
from ranmt.data.text import read_lines
from ranmt.data.vocab import Vocab, train_sentencepiece_file

if TYPE_CHECKING:
    from ranmt.config import Config


class PrepareError(ValueError):
    pass


class TokenSequences(Sequence):
    """Sentences stored flat: sentence i is ``flat[offsets[i]:offsets[i+1]]``, a view.

    With memory-mapped arrays nothing is read until a sentence is used, so every training
    process shares one copy of the data through the page cache.
    """

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.flat[self.offsets[index]: self.offsets[index + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets))


class SubsetSequences(Sequence):
    """Sentences ``indices`` of another sequence of sentences, without copying any: item i
    is ``base[indices[i]]`` (e.g. the training pairs that fit a model's positions)."""

    def __init__(self, base: Sequence, indices: np.ndarray):
        self.base, self.indices = base, np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.base[int(self.indices[index])]


def gather(seqs: Sequence, indices: np.ndarray, limit: int | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Sentences ``indices`` of ``seqs``, each cut to ``limit`` tokens, as (their tokens
    concatenated (sum of lengths,) int64, their lengths (len(indices),) int64).

    Stored sentences (:class:`TokenSequences`, possibly through :class:`SubsetSequences`)
    are read with one fancy index of the flat array, not a Python loop over sentences."""
    indices = np.asarray(indices, dtype=np.int64)
    if isinstance(seqs, SubsetSequences):
        return gather(seqs.base, seqs.indices[indices], limit)
    if isinstance(seqs, TokenSequences):
        offsets = np.asarray(seqs.offsets)
        starts = offsets[indices].astype(np.int64)
        lengths = offsets[indices + 1].astype(np.int64) - starts
        if limit is not None:
            lengths = np.minimum(lengths, limit)
        ends = np.cumsum(lengths)
        # token k of the batch is token (k - its sentence's first k) of its sentence
        within = np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lengths,
                                                                           lengths)
        positions = np.repeat(starts, lengths) + within
        return np.asarray(seqs.flat[positions], dtype=np.int64), lengths
    return concatenated([np.asarray(seqs[int(i)])[:limit] for i in indices])


def concatenated(seqs: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """A list of sentences as (their tokens concatenated, their lengths), both int64."""
    lengths = np.fromiter((len(seq) for seq in seqs), dtype=np.int64, count=len(seqs))
    if not len(seqs):
        return np.zeros(0, dtype=np.int64), lengths
    return np.concatenate([np.asarray(seq, dtype=np.int64) for seq in seqs]), lengths


@dataclass
class EncodedSplit:
    src: Sequence
    tgt: Sequence

    def __len__(self) -> int:
        return len(self.src)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source lengths, target lengths), without EOS."""
        def of(seqs) -> np.ndarray:
            if isinstance(seqs, TokenSequences):
                return seqs.lengths()
            if isinstance(seqs, SubsetSequences) and isinstance(seqs.base, TokenSequences):
                return seqs.base.lengths()[seqs.indices]
            return np.array([len(s) for s in seqs], dtype=np.int64)

        return of(self.src), of(self.tgt)


def load_split(data_dir: str | Path, split: str) -> EncodedSplit:
    """An encoded split, memory-mapped (``.npy``; ``.safetensors`` of older data is read)."""
    base = Path(data_dir) / split
    if Path(f"{base}.src.tokens.npy").is_file():
        sides = [TokenSequences(np.load(f"{base}.{side}.tokens.npy", mmap_mode="r"),
                                np.load(f"{base}.{side}.offsets.npy", mmap_mode="r"))
                 for side in ("src", "tgt")]
        return EncodedSplit(*sides)
    legacy = Path(f"{base}.safetensors")
    if legacy.is_file():
        from safetensors.torch import load_file  # torch only for this old format

        tensors = load_file(str(legacy))
        return EncodedSplit(
            TokenSequences(tensors["src_tokens"].numpy(), tensors["src_offsets"].numpy()),
            TokenSequences(tensors["tgt_tokens"].numpy(), tensors["tgt_offsets"].numpy()))
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"data folder {data_dir} does not exist (a folder written by "
                                "`ranmt prepare`)")
    raise FileNotFoundError(f"split '{split}' not found in {data_dir}; splits there: "
                            f"{', '.join(available_splits(data_dir)) or 'none'}")


def available_splits(data_dir: str | Path) -> list[str]:
    root = Path(data_dir)
    names = {p.name[: -len(".src.tokens.npy")] for p in root.glob("*.src.tokens.npy")}
    names |= {p.name[: -len(".safetensors")] for p in root.glob("*.safetensors")}
    return sorted(names)


def load_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {data_dir} a directory written by "
                                "`ranmt prepare`?")
    return json.loads(path.read_text(encoding="utf-8"))


def fill_config_from_data(cfg: Config, data_dir: str | Path) -> None:
    """Set what the prepared data decides in a ``ranmt.config.Config``: its folder, the
    vocabulary sizes, and what a variant's ``fill_from_data`` takes (e.g. HC-ALL's gamma
    unless given), from ``data_dir/meta.json``. The one way a config is filled from data
    (training, ``ranmt info --data``, the grids' dry runs and reuse checks)."""
    meta = load_meta(data_dir)
    cfg.data.dir = str(data_dir)
    cfg.model.src_vocab_size = meta["src_vocab_size"]
    cfg.model.tgt_vocab_size = meta["tgt_vocab_size"]
    cfg.model.joint_vocab = bool(meta["joint_vocab"])
    for options in cfg.model.variant_options.values():
        fill = getattr(options, "fill_from_data", None)
        if fill is not None:
            fill(meta)


def raw_text(data_dir: str | Path, split: str, side: str) -> list[str]:
    return read_lines(Path(data_dir) / f"{split}.{side}.txt")


def extra_references(data_dir: str | Path, split: str) -> list[list[str]]:
    """A test split's further reference streams (``SPLIT.tgt2.txt``, ``SPLIT.tgt3.txt``,
    ...; none for most corpora), line by line with ``SPLIT.tgt.txt``."""
    streams, number = [], 2
    while (Path(data_dir) / f"{split}.tgt{number}.txt").is_file():
        streams.append(raw_text(data_dir, split, f"tgt{number}"))
        number += 1
    return streams


def prepare(src: str, tgt: str, train: str | Sequence[str], valid: str, out: str | Path,
            tests: dict[str, str] | None = None, vocab_size: int = 8000, joint: bool = True,
            model_type: str = "bpe", max_positions: int = 256, errors: str = "strict",
            log=print, progress: bool = False, *, spm_sample: int = 2_000_000,
            spm_models: tuple[str | Path, str | Path] | None = None,
            max_ratio: float | None = None, workers: int | None = None,
            chunk_size: int = 20_000, sample_seed: int = 1) -> dict:
    """Train SentencePiece, encode every split, write a prepared-data directory; return meta.

    Streaming (:mod:`ranmt.data.stream`): ``train`` (one prefix or several, concatenated)
    is read twice, line by line — once to draw SentencePiece's training text, a uniform
    sample of at most ``spm_sample`` sentences, once to encode — and every split is encoded
    in chunks of ``chunk_size`` pairs by ``workers`` processes (default: the cores) and
    written as it comes, so memory does not grow with the corpus. ``spm_models`` (source,
    target) encodes with existing SentencePiece models instead of training (one file twice
    for a joint vocabulary). Training pairs with an empty side, longer than
    ``max_positions`` subwords (EOS included) or, with ``max_ratio``, whose longer side has
    more than ``max_ratio`` times the subwords of the shorter are dropped and counted.
    Atomic: the output appears whole or not at all. ``progress``: bars on stderr.
    """
    out = Path(out)
    if src == tgt:
        raise PrepareError("source and target languages must differ")
    if spm_sample < 2:
        raise PrepareError(f"--spm-sample must be at least 2, not {spm_sample}")
    if max_ratio is not None and max_ratio < 1:
        raise PrepareError(f"--max-ratio must be at least 1, not {max_ratio}")
    corpora = [train] if isinstance(train, (str, Path)) else list(train)
    if not corpora:
        raise PrepareError("at least one training corpus is needed")
    tests = tests or {}
    for name in tests:
        if name in ("train", "valid"):
            raise PrepareError(f"test split name '{name}' clashes with train/valid")
    settings = _Settings(src, tgt, [str(c) for c in corpora], errors, max_positions,
                         max_ratio, chunk_size, workers or available_cores(), progress, log)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if spm_models is None:
            read, empty = _train_vocabulary(tmp, settings, vocab_size, joint, model_type,
                                            spm_sample, sample_seed)
            # No more worker processes than training chunks (none for a small corpus).
            settings.workers = min(settings.workers, -(-read // chunk_size))
            settings.train_pairs = read - empty
        else:
            joint = _copy_vocabulary(tmp, *spm_models)
            vocab_size, empty = None, None
        meta = _encode_splits(tmp, settings, valid, tests, vocab_size, joint, model_type,
                              empty)
        if spm_models is not None:
            meta["spm_models_from"] = [str(Path(m).resolve()) for m in spm_models]
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # leave no partial output behind
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    log(f"wrote {out} (gamma = {meta['gamma']:.4f})")
    return meta


def add_test_splits(data_dir: str | Path, tests: dict[str, str], log=print,
                    workers: int = 1) -> dict:
    """Encode more test sets (name -> prefix) into a prepared-data directory with its own
    SentencePiece models, as :func:`prepare` encodes test sets (nothing filtered): a test
    set added to a grid after its dataset was prepared. meta.json lists them once they are
    written whole (a killed run leaves them unlisted, to be encoded again); the other
    splits are not touched. Returns the updated meta."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    for name in tests:
        if name in ("train", "valid"):
            raise PrepareError(f"test split name '{name}' clashes with train/valid")
        if name in meta["splits"]:
            raise PrepareError(f"{data_dir} already has a split '{name}'")
    settings = _Settings(meta["src_lang"], meta["tgt_lang"], [], "strict",
                         meta["max_positions"], None, 20_000, workers, False, log)
    with ChunkEncoder(data_dir / "spm.src.model", data_dir / "spm.tgt.model",
                      workers) as encoder:
        for name, prefix in tests.items():
            meta["splits"][name], _ = _encode_split(data_dir, name, settings, encoder,
                                                    [prefix], filtered=False)
            log(f"{data_dir}: added the test set {name} ({meta['splits'][name]['pairs']} "
                "pairs)")
    save_meta(data_dir, meta)
    return meta


def save_meta(data_dir: str | Path, meta: dict) -> None:
    """Replace ``data_dir/meta.json`` whole (written beside it, then renamed)."""
    written = Path(data_dir) / "meta.json.tmp"
    written.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    written.replace(Path(data_dir) / "meta.json")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class _Settings:
    """What every pass of :func:`prepare` needs to know."""
    src: str
    tgt: str
    corpora: list[str]
    errors: str
    max_positions: int
    max_ratio: float | None
    chunk_size: int
    workers: int
    progress: bool
    log: object
    train_pairs: int | None = None  # non-empty training pairs, once the first pass counted

    def pairs(self, prefix: str):
        """The pairs of one corpus; a corpus with no line at all is an error."""
        empty = True
        try:
            for pair in iter_parallel(prefix, self.src, self.tgt, self.errors):
                empty = False
                yield pair
        except ParallelLengthError as err:
            raise PrepareError(str(err)) from None
        if empty:
            raise PrepareError(f"{resolve(f'{prefix}.{self.src}')} and "
                               f"{resolve(f'{prefix}.{self.tgt}')} are empty")

    def bar(self, desc: str, total: int | None = None) -> tqdm:
        return tqdm(total=total, unit="pair", desc=desc, file=sys.stderr,
                    disable=not self.progress, unit_scale=True)


def _train_vocabulary(tmp: Path, settings: _Settings, vocab_size: int, joint: bool,
                      model_type: str, spm_sample: int, seed: int) -> tuple[int, int]:
    """First pass over the training corpora: count pairs with an empty side, draw the
    SentencePiece sample (``spm_sample`` sentences: half as many pairs for a joint
    vocabulary), train the model(s) into ``tmp``. Returns (pairs read, pairs with an empty
    side)."""
    reservoir = PairReservoir(spm_sample // 2 if joint else spm_sample, seed)
    read = empty = 0
    with settings.bar("reading") as bar:
        for prefix in settings.corpora:
            for source, target in settings.pairs(prefix):
                read += 1
                if source and target:
                    reservoir.add(source, target)
                else:
                    empty += 1
                if read % 10_000 == 0:
                    bar.update(10_000)
        bar.update(read % 10_000)
    if empty:
        settings.log(f"train: dropped {empty} pair(s) with an empty side")
    if not reservoir.seen:
        raise PrepareError("no non-empty training pairs in "
                           + ", ".join(f"{c}.{settings.src} / {c}.{settings.tgt}"
                                       for c in settings.corpora))
    if reservoir.seen > reservoir.capacity:
        settings.log(f"SentencePiece: training on a uniform sample of {reservoir.capacity:,} "
                     f"of {reservoir.seen:,} pairs (--spm-sample)")
    # SentencePiece reads the sample from files: the Python copy is gone while it trains.
    src_lines, tgt_lines = reservoir.sample()
    del reservoir
    texts = {"src": [src_lines, tgt_lines]} if joint else {"src": [src_lines],
                                                             "tgt": [tgt_lines]}
    characters = {side: _write_sample(tmp / f"spm.sample.{side}.txt", parts)
                  for side, parts in texts.items()}
    del src_lines, tgt_lines, texts
    gc.collect()
    for side, chars in characters.items():
        sample_file = tmp / f"spm.sample.{side}.txt"
        train_sentencepiece_file(sample_file, chars, tmp / f"spm.{side}.model", vocab_size,
                                 model_type)
        sample_file.unlink()
    if joint:
        shutil.copyfile(tmp / "spm.src.model", tmp / "spm.tgt.model")
    return read, empty


def _write_sample(path: Path, parts: list[list[str]]) -> set[str]:
    """Write the lines of ``parts`` (in order) to ``path``; return their characters."""
    characters: set[str] = set()
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for lines in parts:
            for line in lines:
                out.write(line + "\n")
                characters.update(line)
    return characters


def _copy_vocabulary(tmp: Path, src_model: str | Path, tgt_model: str | Path) -> bool:
    """Use existing SentencePiece models; returns whether they are one (joint) vocabulary."""
    for model, side in ((src_model, "src"), (tgt_model, "tgt")):
        Vocab(model)  # a clear error for a missing file or other special ids
        shutil.copyfile(model, tmp / f"spm.{side}.model")
    return (tmp / "spm.src.model").read_bytes() == (tmp / "spm.tgt.model").read_bytes()


def _encode_splits(tmp: Path, settings: _Settings, valid: str, tests: dict[str, str],
                   vocab_size: int | None, joint: bool, model_type: str,
                   empty: int | None) -> dict:
    """Second pass: encode train (filtered), valid and the test sets into ``tmp``."""
    src_vocab, tgt_vocab = Vocab(tmp / "spm.src.model"), Vocab(tmp / "spm.tgt.model")
    settings.log(f"vocabulary: {'joint' if joint else 'separate'} {model_type}, "
                 f"source {len(src_vocab)}, target {len(tgt_vocab)}")
    meta: dict = {"src_lang": settings.src, "tgt_lang": settings.tgt, "joint_vocab": joint,
                  "model_type": model_type, "vocab_size_requested": vocab_size,
                  "src_vocab_size": len(src_vocab), "tgt_vocab_size": len(tgt_vocab),
                  "max_positions": settings.max_positions, "dropped_empty": empty,
                  "splits": {}}
    with ChunkEncoder(tmp / "spm.src.model", tmp / "spm.tgt.model",
                      settings.workers) as encoder:
        split_meta, corpora = _encode_split(tmp, "train", settings, encoder,
                                            settings.corpora, filtered=True)
        meta["splits"]["train"] = split_meta
        if meta["dropped_empty"] is None:  # existing vocabulary: counted in this pass
            meta["dropped_empty"] = sum(c["dropped_empty"] for c in corpora)
        if len(corpora) > 1:
            meta["train_corpora"] = corpora
        for name, prefix in {"valid": valid, **tests}.items():
            meta["splits"][name], _ = _encode_split(tmp, name, settings, encoder, [prefix],
                                                    filtered=False)
    train_meta = meta["splits"]["train"]
    if not train_meta["pairs"]:
        raise PrepareError("every training pair was dropped by the filters")
    meta["gamma"] = train_meta["src_mean_len"] / max(train_meta["tgt_mean_len"], 1e-9)
    return meta


def _chunks(settings: _Settings, corpora: list[str], counts: list[dict], filtered: bool):
    """(corpus index, source lines, target lines) chunks; with ``filtered`` pairs with an
    empty side are left out (and counted in ``counts``)."""
    for index, prefix in enumerate(corpora):
        pairs = settings.pairs(prefix)
        if filtered:
            def non_empty(pairs=pairs, count=counts[index]):
                for source, target in pairs:
                    count["read"] += 1
                    if source and target:
                        yield source, target
                    else:
                        count["dropped_empty"] += 1
            pairs = non_empty()
        for src_lines, tgt_lines in chunked(pairs, settings.chunk_size):
            yield index, src_lines, tgt_lines


def _keep_mask(settings: _Settings, src_lengths: np.ndarray, tgt_lengths: np.ndarray,
               drops: dict) -> np.ndarray:
    """Which pairs of a training chunk pass the length (and ratio) filters; counts drops."""
    # +1: the EOS appended to each side must fit into max_positions as well.
    keep = ((src_lengths + 1 <= settings.max_positions)
            & (tgt_lengths + 1 <= settings.max_positions))
    drops["too_long"] += int((~keep).sum())
    if settings.max_ratio is not None:
        longer = np.maximum(src_lengths, tgt_lengths)
        shorter = np.maximum(np.minimum(src_lengths, tgt_lengths), 1)
        skewed = keep & (longer > settings.max_ratio * shorter)
        drops["ratio"] += int(skewed.sum())
        keep &= ~skewed
    return keep


def _encode_split(tmp: Path, name: str, settings: _Settings, encoder: ChunkEncoder,
                  corpora: list[str], filtered: bool) -> tuple[dict, list[dict]]:
    """Encode one split (its corpora concatenated) into ``tmp/NAME.*``; returns its meta
    entry and per-corpus counts."""
    counts = [{"prefix": c, "read": 0, "dropped_empty": 0, "pairs": 0} for c in corpora]
    drops = {"too_long": 0, "ratio": 0}
    writers = TokenWriter(tmp / f"{name}.src"), TokenWriter(tmp / f"{name}.tgt")
    try:
        total = settings.train_pairs if name == "train" else None
        with contextlib.ExitStack() as stack, settings.bar(f"encoding {name}", total) as bar:
            texts = [stack.enter_context(open(tmp / f"{name}.{side}.txt", "w",
                                              encoding="utf-8", newline="\n"))
                     for side in ("src", "tgt")]
            for index, src_lines, tgt_lines, encoded in encoder.map(
                    _chunks(settings, corpora, counts, filtered)):
                src_flat, src_lengths, tgt_flat, tgt_lengths = encoded
                if filtered:
                    keep = _keep_mask(settings, src_lengths, tgt_lengths, drops)
                    if not keep.all():
                        src_flat = src_flat[np.repeat(keep, src_lengths)]
                        tgt_flat = tgt_flat[np.repeat(keep, tgt_lengths)]
                        src_lengths, tgt_lengths = src_lengths[keep], tgt_lengths[keep]
                        src_lines = list(itertools.compress(src_lines, keep))
                        tgt_lines = list(itertools.compress(tgt_lines, keep))
                writers[0].write(src_flat, src_lengths)
                writers[1].write(tgt_flat, tgt_lengths)
                for handle, lines in zip(texts, (src_lines, tgt_lines)):
                    handle.write("".join(line + "\n" for line in lines))
                counts[index]["pairs"] += len(src_lines)
                bar.update(len(encoded[1]))
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    if drops["too_long"]:
        settings.log(f"{name}: dropped {drops['too_long']} pair(s) longer than "
                     f"{settings.max_positions - 1} subwords (max_positions includes EOS)")
    if drops["ratio"]:
        settings.log(f"{name}: dropped {drops['ratio']} pair(s) whose longer side has more "
                     f"than {settings.max_ratio:g} times the subwords of the shorter "
                     "(--max-ratio)")
    pairs = writers[0].count
    src_mean = writers[0].total / pairs if pairs else 0.0
    tgt_mean = writers[1].total / pairs if pairs else 0.0
    entry = {"pairs": pairs, "dropped_too_long": drops["too_long"],
             "src_mean_len": src_mean, "tgt_mean_len": tgt_mean,
             "src_max_len": writers[0].longest, "tgt_max_len": writers[1].longest}
    if settings.max_ratio is not None and filtered:
        entry["dropped_ratio"] = drops["ratio"]
    settings.log(f"{name}: {pairs} pairs, mean length {src_mean:.1f} -> {tgt_mean:.1f}")
    return entry, counts
