"""A grid's datasets prepared once (under a lock, when several workers share the grid):
Multi30k, WMT, local files, a teacher's distilled translations (``distill_from``), test
sets added to a grid after it was prepared.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ranmt.config import ConfigError
from ranmt.data.corpus import add_test_splits, load_meta, prepare, raw_text, save_meta
from ranmt.data.dialogsum import download_dialogsum
from ranmt.data.download import download_multi30k
from ranmt.data.stream import resolve
from ranmt.data.text import read_lines, write_lines
from ranmt.data.wmt import available as available_wmt
from ranmt.data.wmt import download_wmt
from ranmt.experiment.locks import claim, release
from ranmt.experiment.spec import Cell, Dataset, Experiment
from ranmt.inference.translator import Translator


def prepare_dataset(dataset: Dataset, root: Path, log, experiment: Experiment | None = None
                    ) -> Path:
    """Download (if asked) and prepare a dataset once; return the prepared-data directory.
    A distilled dataset needs its grid (``experiment``: where the teacher cell is). Test
    sets added to the dataset after it was prepared are encoded into it
    (:func:`add_missing_tests`)."""
    prepared = root / "data" / dataset.name
    if (prepared / "meta.json").is_file():
        add_missing_tests(dataset, root, log, experiment)
        return prepared
    if dataset.distill is not None:
        if experiment is None:
            raise ConfigError(f"dataset {dataset.name} is distilled: prepared by its grid")
        return prepare_distilled(dataset, experiment, log)
    train_prefix, valid_prefix, tests = _corpus_prefixes(dataset, root, log)
    log(f"preparing dataset {dataset.name}")
    prepare(dataset.src, dataset.tgt, train_prefix, valid_prefix, prepared, tests,
            dataset.vocab_size, dataset.joint, dataset.model_type, dataset.max_positions,
            log=log)
    copy_extra_references(prepared, tests, dataset.tgt, log)
    return prepared


def copy_extra_references(prepared: Path, tests: dict[str, str], tgt: str, log) -> None:
    """Each test set's further references (``PREFIX.TGT2``, ``PREFIX.TGT3``, ...) into the
    prepared data as ``TEST.tgt2.txt``, ... (``corpus.extra_references``), checked line
    for line against the prepared references."""
    for test, prefix in tests.items():
        lines = len(raw_text(prepared, test, "tgt"))
        number = 2
        while resolve(f"{prefix}.{tgt}{number}").is_file():
            stream = read_lines(resolve(f"{prefix}.{tgt}{number}"))
            if len(stream) != lines:
                raise ConfigError(f"{prefix}.{tgt}{number}: {len(stream)} lines, the test set "
                                  f"{test} has {lines}")
            write_lines(prepared / f"{test}.tgt{number}.txt", stream)
            log(f"{test}: reference {number} from {prefix}.{tgt}{number}")
            number += 1


def _corpus_prefixes(dataset: Dataset, root: Path, log) -> tuple[str | list[str], str,
                                                                  dict[str, str]]:
    """(train, valid, test name -> prefix) of a dataset that is not distilled, downloading
    it first when it has ``download``."""
    tests = dict(dataset.tests)
    train_prefix, valid_prefix = dataset.train, dataset.valid
    if not dataset.download:
        return train_prefix, valid_prefix, tests
    raw = root / "data" / f"{dataset.name}.raw"
    spec = dict(dataset.download)
    kind = spec.get("dataset", "multi30k")
    pair = spec.get("pair", f"{dataset.src}-{dataset.tgt}")
    if kind in available_wmt():
        found = download_wmt(kind, pair, raw, spec.get("from"), log=log)
        train_prefix = train_prefix or found["train"]
        valid_prefix = valid_prefix or found["valid"]
        tests = tests or found["tests"]
    elif kind == "multi30k":
        download_multi30k(pair, raw, spec.get("from"), log=log)
        train_prefix = train_prefix or str(raw / "train")
        valid_prefix = valid_prefix or str(raw / "val")
    elif kind == "dialogsum":
        download_dialogsum(raw, spec.get("from"), log=log)
        train_prefix = train_prefix or str(raw / "train")
        valid_prefix = valid_prefix or str(raw / "dev")
        tests = tests or {"test": "test"}
    else:
        raise ConfigError(f"dataset {dataset.name}: cannot download '{kind}' (available: "
                          f"multi30k, dialogsum, {', '.join(available_wmt())})")
    tests = {name: str(raw / prefix) if not Path(prefix).is_absolute() and
             not Path(prefix).parent.parts else prefix for name, prefix in tests.items()}
    return train_prefix, valid_prefix, tests


def unprepared_tests(dataset: Dataset, root: Path) -> list[str] | None:
    """The dataset's test sets its prepared data lacks (None: not prepared at all)."""
    meta = root / "data" / dataset.name / "meta.json"
    if not meta.is_file():
        return None
    splits = load_meta(meta.parent)["splits"]
    return [test for test in dataset.tests if test not in splits]


def add_missing_tests(dataset: Dataset, root: Path, log,
                      experiment: Experiment | None = None) -> None:
    """Encode the test sets added to ``dataset`` after it was prepared into its prepared
    data, with its SentencePiece models (``corpus.add_test_splits``), and copy their
    further references (:func:`copy_extra_references`); a distilled dataset
    copies them from its teacher's dataset (the same sources and references, encoded with
    the same models), which gets them first."""
    missing = unprepared_tests(dataset, root)
    if not missing:
        return
    prepared = root / "data" / dataset.name
    if dataset.distill is None:
        prefixes = _corpus_prefixes(dataset, root, log)[2]
        added = {test: prefixes[test] for test in missing}
        add_test_splits(prepared, added, log)
        copy_extra_references(prepared, added, dataset.tgt, log)
        return
    if experiment is None:
        raise ConfigError(f"dataset {dataset.name} is distilled: prepared by its grid")
    source = next(d for d in experiment.datasets if d.name == dataset.references_from)
    source_dir = prepare_once(source, root, log, experiment)
    meta, source_splits = load_meta(prepared), load_meta(source_dir)["splits"]
    for test in missing:
        for path in source_dir.glob(f"{test}.*"):
            shutil.copyfile(path, prepared / path.name)
        meta["splits"][test] = source_splits[test]
        log(f"{prepared}: added the test set {test} (from {source_dir})")
    save_meta(prepared, meta)


def prepare_distilled(dataset: Dataset, experiment: Experiment, log) -> Path:
    """A distilled dataset: the finished teacher cell translates its dataset's training
    split (``ranmt distill``, resumable: ``data/NAME.distill``), and the result is encoded
    with the teacher's SentencePiece models into ``data/NAME``. The translations are kept
    in ``OUT/distilled/NAME`` (small, in git beside the cells): a checkout without the
    teacher's run folder rebuilds the same dataset from them."""
    from ranmt.inference.distill import (
        DistillFilter,
        distill,
        finish_distill,
        keep_translations,
        restore_translations,
    )

    source_name, variant, seed = dataset.teacher_cell()
    source = next(d for d in experiment.datasets if d.name == source_name)
    teacher_data = prepare_once(source, experiment.out, log, experiment)
    teacher = Cell(experiment, source, next(v for v in experiment.variants
                                            if v.name == variant), seed)
    if not teacher.finished:
        raise ConfigError(f"dataset {dataset.name} is distilled by the cell {teacher.label}, "
                          "which has not finished: run it first (it comes earlier in the "
                          "grid; with --datasets/--variants/--seeds, include it)")
    options = dict(dataset.distill)
    decode = {**experiment.decode, **options.get("decode", {})}
    keep = DistillFilter(**{key: options[key] for key in ("max_ratio", "max_repeats")
                            if key in options})
    work = experiment.out / "data" / f"{dataset.name}.distill"
    kept = kept_translations_dir(experiment, dataset)
    if (kept / "translations.gz").is_file():
        _check_kept_decode(kept, decode)
        log(f"{dataset.name}: the teacher {teacher.label}'s translations kept in {kept}")
        restore_translations(kept, work)
        report = finish_distill(teacher_data, work, "train", keep, log=log)
    else:
        if not teacher.run_dir.is_dir():
            raise ConfigError(
                f"dataset {dataset.name} is distilled by {teacher.label}, whose run folder "
                f"{teacher.run_dir} (its checkpoint) is not here and whose translations "
                f"were not kept ({kept}): restore the run folder, or move the cell's "
                f"cell.json aside to train the teacher again")
        translator = Translator.load(teacher.run_dir, **decode)
        log(f"distilling {source_name} with the teacher {teacher.label} -> {work}")
        report = distill(translator, teacher_data, work, "train",
                         int(options.get("chunk_lines", 2000)), keep, log=log)
        keep_translations(work, kept)
        log(f"{dataset.name}: the teacher's translations kept in {kept} (commit them)")
    meta = load_meta(teacher_data)
    tests = {name: str(work / name) for name in report["splits"]
             if name not in ("train", "valid")}
    log(f"preparing dataset {dataset.name}")
    prepared = experiment.out / "data" / dataset.name
    prepare(meta["src_lang"], meta["tgt_lang"], str(work / "train"), str(work / "valid"),
            prepared, tests, max_positions=meta.get("max_positions", dataset.max_positions),
            log=log, spm_models=(teacher_data / "spm.src.model",
                                 teacher_data / "spm.tgt.model"))
    return prepared


def kept_translations_dir(experiment: Experiment, dataset: Dataset) -> Path:
    """Where a distilled dataset's translations are kept (``OUT/distilled/NAME``)."""
    return experiment.out / "distilled" / dataset.name


def _check_kept_decode(kept: Path, decode: dict) -> None:
    """Kept translations made with other decoding settings than the grid asks for are
    refused (they would pass for the grid's)."""
    settings = json.loads((kept / "settings.json").read_text(encoding="utf-8"))
    # a decoding field, else a loading option (quantize, ...); the device may differ
    made_with = {**settings["teacher"], **settings["decode"]}
    differ = sorted(key for key, value in decode.items()
                    if key != "device" and made_with.get(key) != value)
    if differ:
        raise ConfigError(f"{kept} holds translations decoded with other settings "
                          f"({', '.join(f'{key}={made_with.get(key)!r}' for key in differ)}) "
                          "than the grid's: remove it to distill again")


def prepare_once(dataset: Dataset, root: Path, log, experiment: Experiment | None = None
                 ) -> Path:
    """prepare_dataset under a lock, so that concurrent workers prepare a dataset once."""
    lock = root / "data" / f"{dataset.name}.lock"
    while not claim(lock):
        if unprepared_tests(dataset, root) == []:
            return root / "data" / dataset.name
        time.sleep(2.0)
    try:
        return prepare_dataset(dataset, root, log, experiment)
    finally:
        release(lock)
