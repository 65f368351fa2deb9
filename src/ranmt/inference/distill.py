"""Sequence-level knowledge distillation (Kim and Rush, 2016): a teacher's translations of a
training corpus become a student's targets.

:func:`distill` reads the source side of a prepared split (``SPLIT.src.txt``, the lines
``ranmt prepare`` kept), translates it with a teacher (a :class:`Translator`: one checkpoint
or an ensemble, with the teacher's decoding settings unless overridden) in chunks of
``chunk_lines`` lines, and writes

* ``parts/NNNNN.tgt``: the translations of chunk N, one line per source line, each written
  whole (a temporary file renamed into place): a run killed at any moment resumes at the
  first missing part and loses or repeats no line;
* ``settings.json``: what the parts were made with (teacher, decoding settings, split,
  chunk size, the source's line count and digest); a rerun with other settings refuses
  instead of mixing two teachers' outputs;
* once every part is there, ``SPLIT.<src>`` / ``SPLIT.<tgt>``: the distilled corpus (the
  original sources, the teacher's translations) without the pairs the filter drops
  (:class:`DistillFilter`: empty outputs, length-ratio outliers, repetitions), the
  prepared data's other splits (``valid``, tests) with their original references, and
  ``distill.json``: counts (kept, dropped per reason), throughput and the ``ranmt prepare``
  command that encodes the corpus with the teacher's SentencePiece models.

A run folder (checkpoints, parts) need not outlive its machine: :func:`keep_translations`
stores a finished distillation's translations (one gzip file, in source order, unfiltered)
and settings somewhere small enough for git, and :func:`restore_translations` puts them
back as parts, so that :func:`finish_distill` rebuilds the same corpus without the teacher.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ranmt.data.corpus import load_meta, raw_text


@dataclass
class DistillFilter:
    """Which distilled pairs are dropped (each test off at 0)."""

    max_ratio: float = 3.0
    """Drop a pair whose longer side has more than this many times the words of the shorter."""
    max_repeats: int = 4
    """Drop a translation where one word n-gram (n = 1..4) occurs this many times in a row."""
    drop_empty: bool = True
    """Drop empty translations."""

    def reason(self, source: str, translation: str) -> str | None:
        """Why the pair is dropped ("empty", "ratio", "repetition"), or None to keep it."""
        words, source_words = translation.split(), source.split()
        if not words:
            return "empty" if self.drop_empty else None
        if self.max_ratio > 0 and source_words:
            longer, shorter = sorted((len(words), len(source_words)), reverse=True)
            if longer > self.max_ratio * shorter:
                return "ratio"
        if self.max_repeats > 1 and repeated_ngram(words, self.max_repeats):
            return "repetition"
        return None


def repeated_ngram(words: list[str], times: int, longest: int = 4) -> bool:
    """Whether some n-gram (n = 1 .. ``longest``) occurs ``times`` times in a row."""
    for n in range(1, longest + 1):
        for start in range(len(words) - n * times + 1):
            gram = words[start: start + n]
            if all(words[start + k * n: start + (k + 1) * n] == gram for k in range(1, times)):
                return True
    return False


def _digest(lines: list[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]


def _chunk_count(lines: int, chunk_lines: int) -> int:
    """How many parts ``lines`` source lines make in chunks of ``chunk_lines``."""
    return -(-lines // chunk_lines)


def _write_whole(path: Path, lines: list[str]) -> None:
    """``lines`` into ``path``, which appears complete or not at all."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in lines))
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)


def distill(translator, data_dir: str | Path, out_dir: str | Path, split: str = "train",
            chunk_lines: int = 2000, keep: DistillFilter | None = None,
            log: Callable[[str], None] = lambda _msg: None, progress: bool = False,
            stop_after: int | None = None) -> dict:
    """Distill split ``split`` of the prepared data ``data_dir`` into ``out_dir`` with the
    teacher ``translator`` (see the module docstring); returns the report (``distill.json``).
    ``stop_after``: translate at most this many more chunks, then return None (for tests
    and budgets: the next call resumes)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    keep = keep or DistillFilter()
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines must be at least 1, not {chunk_lines}")
    load_meta(data_dir)  # a prepared-data folder, or its error
    source_file = data_dir / f"{split}.src.txt"
    if not source_file.is_file():
        raise FileNotFoundError(f"{source_file} not found: distill reads the source text of a "
                                "split prepared by `ranmt prepare`")
    sources = raw_text(data_dir, split, "src")
    teacher = {key: value for key, value in (translator.load_options or {}).items()
               if key != "device"}  # a run may resume on another device
    settings = {"teacher": teacher, "split": split,
                "decode": dataclasses.asdict(translator.decode_config),
                "chunk_lines": chunk_lines, "lines": len(sources), "digest": _digest(sources)}
    parts = out_dir / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    _check_settings(out_dir / "settings.json", settings)
    chunks = _chunk_count(len(sources), chunk_lines)
    missing = [n for n in range(chunks) if not (parts / f"{n:05d}.tgt").is_file()]
    if len(missing) < chunks:
        log(f"resuming: {chunks - len(missing)} of {chunks} parts already written")
    started, words = time.perf_counter(), 0
    translator.progress = False
    to_translate = sum(len(sources[n * chunk_lines: (n + 1) * chunk_lines]) for n in missing)
    bar = tqdm(total=len(sources), initial=len(sources) - to_translate, unit="line",
               file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for done, number in enumerate(missing):
        if stop_after is not None and done >= stop_after:
            bar.close()
            return None
        chunk = sources[number * chunk_lines: (number + 1) * chunk_lines]
        translations = [line.replace("\n", " ") for line in
                        translator.translate(chunk, first_line=number * chunk_lines + 1)]
        _write_whole(parts / f"{number:05d}.tgt", translations)
        words += sum(len(line.split()) for line in translations)
        bar.update(len(chunk))
        bar.set_postfix(words_s=f"{words / (time.perf_counter() - started):,.0f}",
                        refresh=False)
    bar.close()
    seconds = time.perf_counter() - started
    return finish_distill(data_dir, out_dir, split, keep, log, this_run={
        "chunks": len(missing), "seconds": round(seconds, 2),
        "target_words_per_second": round(words / max(seconds, 1e-9), 1)})


def finish_distill(data_dir: str | Path, out_dir: str | Path, split: str = "train",
                   keep: DistillFilter | None = None,
                   log: Callable[[str], None] = lambda _msg: None,
                   this_run: dict | None = None) -> dict:
    """The distilled corpus, the other splits and ``distill.json`` from a complete set of
    parts in ``out_dir`` (no teacher needed); returns the report. The parts must be of this
    split of ``data_dir`` (``settings.json``: its line count and digest)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    settings = json.loads((out_dir / "settings.json").read_text(encoding="utf-8"))
    sources = raw_text(data_dir, split, "src")
    if (settings["split"], settings["lines"], settings["digest"]) != (
            split, len(sources), _digest(sources)):
        raise ValueError(f"{out_dir} holds the translations of another corpus than the "
                         f"split {split} of {data_dir} (settings.json: its split, line count "
                         "and digest differ)")
    chunks = _chunk_count(len(sources), settings["chunk_lines"])
    report = _assemble(data_dir, out_dir, load_meta(data_dir), split, sources, chunks,
                       keep or DistillFilter())
    report["this_run"] = this_run or {"chunks": 0, "seconds": 0.0}
    (out_dir / "distill.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(f"distilled {report['lines']} lines: kept {report['kept']}, dropped "
        + ", ".join(f"{count} {reason}" for reason, count in report["dropped"].items())
        + f"; encode with: {report['prepare_command']}")
    return report


def keep_translations(out_dir: str | Path, kept_dir: str | Path) -> None:
    """Store the translations of a finished distillation in ``out_dir`` (every part, in
    source order, unfiltered) as ``kept_dir/translations.gz`` (byte-identical for the same
    lines) beside a copy of its ``settings.json``."""
    out_dir, kept_dir = Path(out_dir), Path(kept_dir)
    settings = json.loads((out_dir / "settings.json").read_text(encoding="utf-8"))
    chunks = _chunk_count(settings["lines"], settings["chunk_lines"])
    text = "".join((out_dir / "parts" / f"{number:05d}.tgt").read_text(encoding="utf-8")
                   for number in range(chunks))
    if text.count("\n") != settings["lines"]:
        raise RuntimeError(f"{out_dir}: the parts hold {text.count(chr(10))} lines for "
                           f"{settings['lines']} sources")
    kept_dir.mkdir(parents=True, exist_ok=True)
    with (kept_dir / "translations.gz").open("wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as packed:
        packed.write(text.encode("utf-8"))
    (kept_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n",
                                            encoding="utf-8")


def restore_translations(kept_dir: str | Path, out_dir: str | Path) -> None:
    """Put translations stored by :func:`keep_translations` back into ``out_dir`` as the
    parts and settings a distillation writes (:func:`finish_distill` checks they are of the
    corpus it is given)."""
    kept_dir, out_dir = Path(kept_dir), Path(out_dir)
    settings = json.loads((kept_dir / "settings.json").read_text(encoding="utf-8"))
    lines = gzip.decompress((kept_dir / "translations.gz").read_bytes()).decode(
        "utf-8").split("\n")[:-1]
    if len(lines) != settings["lines"]:
        raise ValueError(f"{kept_dir}: translations.gz holds {len(lines)} lines, "
                         f"settings.json {settings['lines']}")
    (out_dir / "parts").mkdir(parents=True, exist_ok=True)
    _check_settings(out_dir / "settings.json", settings)
    size = settings["chunk_lines"]
    for number, start in enumerate(range(0, len(lines), size)):
        _write_whole(out_dir / "parts" / f"{number:05d}.tgt", lines[start: start + size])


def _check_settings(path: Path, settings: dict) -> None:
    """Write the settings of a new run; refuse to resume one made with others."""
    if not path.is_file():
        path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        return
    before = json.loads(path.read_text(encoding="utf-8"))
    changed = sorted(key for key in set(before) | set(settings)
                     if before.get(key) != settings.get(key))
    if changed:
        raise ValueError(f"{path.parent} holds parts distilled with other settings "
                         f"({', '.join(changed)} differ): use another --out, or remove it")


def _assemble(data_dir: Path, out_dir: Path, meta: dict, split: str, sources: list[str],
              chunks: int, keep: DistillFilter) -> dict:
    """The distilled corpus from the parts, the other splits copied; the report."""
    translations: list[str] = []
    for number in range(chunks):
        translations += (out_dir / "parts" / f"{number:05d}.tgt").read_text(
            encoding="utf-8").split("\n")[:-1]
    if len(translations) != len(sources):
        raise RuntimeError(f"the parts hold {len(translations)} lines for {len(sources)} "
                           "sources: remove the parts folder and distill again")
    src_lang, tgt_lang = meta["src_lang"], meta["tgt_lang"]
    dropped = {"empty": 0, "ratio": 0, "repetition": 0}
    kept_src, kept_tgt = [], []
    for source, translation in zip(sources, translations):
        reason = keep.reason(source, translation)
        if reason is None:
            kept_src.append(source)
            kept_tgt.append(translation)
        else:
            dropped[reason] += 1
    for lang, lines in ((src_lang, kept_src), (tgt_lang, kept_tgt)):
        _write_whole(out_dir / f"{split}.{lang}", lines)
    others = sorted(path.name[: -len(".src.txt")] for path in data_dir.glob("*.src.txt")
                    if path.name != f"{split}.src.txt")
    for name in others:
        for side, lang in (("src", src_lang), ("tgt", tgt_lang)):
            _write_whole(out_dir / f"{name}.{lang}", raw_text(data_dir, name, side))
    return {"lines": len(sources), "kept": len(kept_src), "dropped": dropped,
            "filter": dataclasses.asdict(keep), "splits": [split, *others],
            "prepare_command": _prepare_command(data_dir, out_dir, meta, split, others)}


def _prepare_command(data_dir: Path, out_dir: Path, meta: dict, split: str,
                     others: list[str]) -> str:
    """The ``ranmt prepare`` call that encodes the distilled corpus with the teacher's
    SentencePiece models."""
    tests = [name for name in others if name not in ("valid", "train")]
    words = ["ranmt", "prepare", "--src", meta["src_lang"], "--tgt", meta["tgt_lang"],
             "--train", str(out_dir / split), "--valid", str(out_dir / "valid")]
    for name in tests:
        words += ["--test", f"{name}={out_dir / name}"]
    words += ["--spm-src", str(data_dir / "spm.src.model"),
              "--spm-tgt", str(data_dir / "spm.tgt.model"),
              "--max-positions", str(meta.get("max_positions", 256)),
              "--out", str(out_dir / "prepared")]
    return shlex.join(words)  # paths with spaces or quotes stay one word each
