"""The in-memory ``ranmt prepare`` of ranmt 0.1 (every line and id list held at once), kept
as the reference that the streaming implementation must match byte for byte."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ranmt.data.corpus import PrepareError
from ranmt.data.text import read_lines, write_lines
from ranmt.data.vocab import Vocab, train_sentencepiece


def read_parallel(prefix: str, src: str, tgt: str, errors: str = "strict"):
    """(source lines, target lines) of PREFIX.SRC / PREFIX.TGT, checking their line counts."""
    src_path, tgt_path = Path(f"{prefix}.{src}"), Path(f"{prefix}.{tgt}")
    src_lines = read_lines(src_path, errors)
    tgt_lines = read_lines(tgt_path, errors)
    if len(src_lines) != len(tgt_lines):
        raise PrepareError(f"parallel files differ in length: {src_path} has "
                           f"{len(src_lines)} lines, {tgt_path} has {len(tgt_lines)}")
    if not src_lines:
        raise PrepareError(f"{src_path} and {tgt_path} are empty")
    return [s.strip() for s in src_lines], [t.strip() for t in tgt_lines]


def _pack(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def save_split(path: Path, src: list[list[int]], tgt: list[list[int]]) -> None:
    """Write ``SPLIT.{src,tgt}.{tokens,offsets}.npy`` (``path`` is ``DIR/SPLIT``)."""
    for side, seqs in (("src", src), ("tgt", tgt)):
        flat, offsets = _pack(seqs)
        np.save(f"{path}.{side}.tokens.npy", flat)
        np.save(f"{path}.{side}.offsets.npy", offsets)


def prepare(src: str, tgt: str, train: str, valid: str, out: str | Path,
            tests: dict[str, str] | None = None, vocab_size: int = 8000, joint: bool = True,
            model_type: str = "bpe", max_positions: int = 256, errors: str = "strict",
            log=print, progress: bool = False) -> dict:
    """Train SentencePiece, encode every split, write a prepared-data directory; return meta
    (``progress``: a bar over the sentences encoded, on stderr)."""
    out = Path(out)
    if src == tgt:
        raise PrepareError("source and target languages must differ")
    tests = tests or {}
    train_src, train_tgt = read_parallel(train, src, tgt, errors)
    keep = [i for i, (s, t) in enumerate(zip(train_src, train_tgt)) if s and t]
    empty = len(train_src) - len(keep)
    if empty:
        log(f"train: dropped {empty} pair(s) with an empty side")
    train_src = [train_src[i] for i in keep]
    train_tgt = [train_tgt[i] for i in keep]
    if not train_src:
        raise PrepareError(f"no non-empty training pairs in {train}.{src} / {train}.{tgt}")

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _prepare_into(tmp, src, tgt, train_src, train_tgt, valid, tests, vocab_size,
                             joint, model_type, max_positions, errors, empty, log,
                             progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # leave no partial output behind
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    log(f"wrote {out} (gamma = {meta['gamma']:.4f})")
    return meta


def _prepare_into(tmp: Path, src, tgt, train_src, train_tgt, valid, tests, vocab_size, joint,
                  model_type, max_positions, errors, empty, log, progress=False) -> dict:
    """The body of :func:`prepare`, writing into the temporary directory ``tmp``."""
    if joint:
        train_sentencepiece(train_src + train_tgt, tmp / "spm.src.model", vocab_size, model_type)
        shutil.copyfile(tmp / "spm.src.model", tmp / "spm.tgt.model")
    else:
        train_sentencepiece(train_src, tmp / "spm.src.model", vocab_size, model_type)
        train_sentencepiece(train_tgt, tmp / "spm.tgt.model", vocab_size, model_type)
    src_vocab, tgt_vocab = Vocab(tmp / "spm.src.model"), Vocab(tmp / "spm.tgt.model")
    log(f"vocabulary: {'joint' if joint else 'separate'} {model_type}, "
        f"source {len(src_vocab)}, target {len(tgt_vocab)}")

    splits = {"train": (train_src, train_tgt), "valid": read_parallel(valid, src, tgt, errors)}
    for name, prefix in tests.items():
        if name in splits:
            raise PrepareError(f"test split name '{name}' clashes with train/valid")
        splits[name] = read_parallel(prefix, src, tgt, errors)

    meta: dict = {"src_lang": src, "tgt_lang": tgt, "joint_vocab": joint,
                  "model_type": model_type, "vocab_size_requested": vocab_size,
                  "src_vocab_size": len(src_vocab), "tgt_vocab_size": len(tgt_vocab),
                  "max_positions": max_positions, "dropped_empty": empty, "splits": {}}
    bar = tqdm(total=sum(len(pair[0]) for pair in splits.values()), unit="sent",
               desc="encoding", file=sys.stderr, disable=not progress)
    for name, (src_lines, tgt_lines) in splits.items():
        src_ids, tgt_ids = src_vocab.encode(src_lines), tgt_vocab.encode(tgt_lines)
        bar.update(len(src_lines))
        too_long = 0
        if name == "train":
            # +1: the EOS appended to each side must fit into max_positions as well.
            kept = [i for i in range(len(src_ids))
                    if len(src_ids[i]) + 1 <= max_positions and len(tgt_ids[i]) + 1
                    <= max_positions]
            too_long = len(src_ids) - len(kept)
            if too_long:
                log(f"train: dropped {too_long} pair(s) longer than {max_positions - 1} "
                    "subwords (max_positions includes EOS)")
            src_ids = [src_ids[i] for i in kept]
            tgt_ids = [tgt_ids[i] for i in kept]
            src_lines = [src_lines[i] for i in kept]
            tgt_lines = [tgt_lines[i] for i in kept]
        save_split(tmp / name, src_ids, tgt_ids)
        write_lines(tmp / f"{name}.src.txt", src_lines)
        write_lines(tmp / f"{name}.tgt.txt", tgt_lines)
        src_mean = float(np.mean([len(s) for s in src_ids])) if src_ids else 0.0
        tgt_mean = float(np.mean([len(t) for t in tgt_ids])) if tgt_ids else 0.0
        meta["splits"][name] = {"pairs": len(src_ids), "dropped_too_long": too_long,
                                "src_mean_len": src_mean, "tgt_mean_len": tgt_mean,
                                "src_max_len": max((len(s) for s in src_ids), default=0),
                                "tgt_max_len": max((len(t) for t in tgt_ids), default=0)}
        log(f"{name}: {len(src_ids)} pairs, mean length {src_mean:.1f} -> {tgt_mean:.1f}")
    bar.close()
    train_meta = meta["splits"]["train"]
    meta["gamma"] = train_meta["src_mean_len"] / max(train_meta["tgt_mean_len"], 1e-9)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return meta
