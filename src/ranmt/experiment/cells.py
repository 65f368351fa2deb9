"""One cell of a grid: prepare its dataset (once, under a lock), train or resume it, decode
and score every test set (and with the grid's other settings, ``also_decode``), write
``cell.json``; the lock files that let several workers share a grid.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import torch

from ranmt.config import ConfigError, decode_with, to_dict
from ranmt.data.corpus import add_test_splits, load_meta, prepare, raw_text, save_meta
from ranmt.data.download import download_multi30k
from ranmt.data.text import write_lines
from ranmt.data.wmt import available as available_wmt
from ranmt.data.wmt import download_wmt
from ranmt.evaluate import TASK_METRICS, score
from ranmt.experiment.spec import LOAD_OPTIONS, SWEEP_KEY, Cell, Dataset, Experiment
from ranmt.inference.shortlist import SHORTLIST_FILE, build_shortlist, shortlist_beside
from ranmt.inference.sweep import describe, sweep
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description
from ranmt.training.train import train


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
    return prepared


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
    else:
        raise ConfigError(f"dataset {dataset.name}: cannot download '{kind}' (available: "
                          f"multi30k, {', '.join(available_wmt())})")
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
    data, with its SentencePiece models (``corpus.add_test_splits``); a distilled dataset
    copies them from its teacher's dataset (the same sources and references, encoded with
    the same models), which gets them first."""
    missing = unprepared_tests(dataset, root)
    if not missing:
        return
    prepared = root / "data" / dataset.name
    if dataset.distill is None:
        prefixes = _corpus_prefixes(dataset, root, log)[2]
        add_test_splits(prepared, {test: prefixes[test] for test in missing}, log)
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


class CellInterrupted(KeyboardInterrupt):
    """Training stopped on a signal: the cell is saved for resume, not finished."""


def run_cell(cell: Cell, data_dir: Path, log) -> dict:
    """Train (or resume) one cell, decode and score every test set (and with each of the
    grid's ``also_decode`` settings); write cell.json."""
    started = time.monotonic()
    run_dir, cell_dir = cell.run_dir, cell.dir
    summary = train(cell.config(), data_dir, run_dir)
    if str(summary.get("stop_reason", "")).endswith("received"):
        raise CellInterrupted(f"training stopped by {summary['stop_reason'].split()[0]}; "
                              "the checkpoint is saved, rerun `ranmt experiment` to resume")
    translator = Translator.load(run_dir, **cell.experiment.decode)
    tests = decode_tests(cell, data_dir, translator)
    result = {"dataset": cell.dataset.name, "variant": cell.variant.name, "seed": cell.seed,
              "checkpoint": str(translator.checkpoint_dir), "train": summary,
              "parameters": summary["parameters"], "tests": tests,
              "config": to_dict(translator.config),
              "machine": machine_description(translator.device),
              "wall_seconds": time.monotonic() - started}
    warm_file = run_dir / "warm_start.json"
    if warm_file.is_file():  # steps 1..N came from another grid's cell (find_warm_start)
        result["warm_started_from"] = json.loads(warm_file.read_text(encoding="utf-8"))
    log_file = run_dir / "train.log"
    if log_file.is_file():  # the run folder is not kept in git; the log is small
        shutil.copyfile(log_file, cell_dir / "train.log")
    decode_also(cell, data_dir, result, log)
    cell.file.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


def decode_tests(cell: Cell, data_dir: Path, translator: Translator,
                 name: str | None = None, only: list[str] | None = None) -> dict:
    """Decode and score every test set of the cell's dataset (``only``: those) with
    ``translator``: test -> metrics, the hypothesis file (``TEST.hyp``, ``TEST.NAME.hyp``
    for an ``also_decode`` setting) and the decoding speed."""
    meta = load_meta(data_dir)
    metrics = TASK_METRICS[cell.dataset.task]
    tests = {}
    for test in cell.dataset.tests if only is None else only:
        sources = raw_text(data_dir, test, "src")
        refs = raw_text(data_dir, test, "tgt")
        start = time.perf_counter()
        hyps = translator.translate(sources)
        seconds = time.perf_counter() - start
        hyp_path = cell.dir / (f"{test}.hyp" if name is None else f"{test}.{name}.hyp")
        write_lines(hyp_path, hyps)
        result = score(hyps, refs, metrics, meta.get("tgt_lang", ""))
        target_tokens = sum(len(ids) + 1 for ids in translator.tgt_vocab.encode(hyps))
        result.update({"hyp_file": str(hyp_path), "decode_seconds": seconds,
                       "sentences_per_s": len(hyps) / seconds,
                       "target_tokens_per_s": target_tokens / seconds})
        tests[test] = result
    return tests


def missing_tests(cell: Cell, result: dict, setting: str | None = None) -> list[str]:
    """The test sets of the cell's dataset its result has not scored (``setting``: with
    that ``also_decode`` setting): a test set added to the grid after the cell finished."""
    if setting is None:
        done = result.get("tests", {})
    else:
        done = result.get("also_decode", {}).get(setting, {}).get("tests", {})
    return [test for test in cell.dataset.tests if test not in done]


def missing_also_decode(cell: Cell, result: dict) -> list[str]:
    """The grid's ``also_decode`` settings a cell's result lacks, or lacks a test set of."""
    return [name for name in cell.experiment.also_decode
            if missing_tests(cell, result, name)]


def decode_missing_tests(cell: Cell, data_dir: Path, result: dict, log) -> list[str]:
    """Decode and score, with the grid's decode, the test sets the finished cell's
    ``result`` lacks (added to the grid after it finished), into ``result["tests"]``;
    returns them."""
    missing = missing_tests(cell, result)
    if missing:
        log(f"{cell.label}: decoding the test sets {missing}")
        translator = Translator.load(cell.run_dir, **cell.experiment.decode)
        result.setdefault("tests", {}).update(
            decode_tests(cell, data_dir, translator, only=missing))
    return missing


def decode_also(cell: Cell, data_dir: Path, result: dict, log) -> list[str]:
    """Decode and score the cell's checkpoint with each ``also_decode`` setting its
    ``result`` lacks (on the test sets it lacks), into ``result["also_decode"][NAME] =
    {"settings", "tests"}``; a setting with ``shortlist`` first builds the run's lexical
    shortlist from the cell's training split when none is beside the checkpoint (``ranmt
    shortlist``'s defaults). A setting that cannot decode here (bf16 on a CPU without it,
    say) is logged and left out, so that it never costs the cell its result; the next run
    tries it again. Returns the settings added to."""
    added = []
    for name in missing_also_decode(cell, result):
        settings = cell.experiment.also_decode[name]
        options = {**cell.experiment.decode, **settings}
        load = {key: options.pop(key) for key in LOAD_OPTIONS if key in options}
        swept = options.pop(SWEEP_KEY, None)
        missing = missing_tests(cell, result, name)
        log(f"{cell.label}: decoding the test sets {missing} as '{name}' ({settings})")
        chosen = result.get("also_decode", {}).get(name, {}).get("chosen")
        try:
            if options.get("shortlist"):
                ensure_shortlist(cell.run_dir, data_dir, log)
            translator = Translator.load(cell.run_dir, **load, **options)
            if swept and chosen is None:
                chosen = choose_on_valid(cell, data_dir, translator, swept, log)
            if chosen is not None:
                translator.decode_config = decode_with(translator.decode_config,
                                                       **chosen["value"])
            tests = decode_tests(cell, data_dir, translator, name, only=missing)
        except (ValueError, RuntimeError, OSError) as err:
            log(f"{cell.label}: cannot decode as '{name}' here, left out: {err}")
            continue
        entry = result.setdefault("also_decode", {}).setdefault(
            name, {"settings": settings, "tests": {}})
        if chosen is not None:
            entry["chosen"] = chosen
        entry["tests"].update(tests)
        added.append(name)
    return added


def choose_on_valid(cell: Cell, data_dir: Path, translator: Translator,
                    swept: dict[str, list], log) -> dict:
    """An ``also_decode`` setting's ``sweep: {FIELD: [values], ...}``: the values of the best
    score on the dataset's valid split (the task's first metric; ties at two decimals to
    the combination listed first, :func:`ranmt.inference.sweep.sweep`). Returns
    ``{"value": {FIELD: chosen}, "split": "valid", "select", "rows": [per combination: its
    values, metrics, length ratio, seconds]}`` (cell.json's ``also_decode.NAME.chosen``);
    nothing of a test set takes part."""
    metrics = list(TASK_METRICS[cell.dataset.task])
    sources, refs = raw_text(data_dir, "valid", "src"), raw_text(data_dir, "valid", "tgt")
    result = sweep(translator, sources, refs, swept, metrics,
                   load_meta(data_dir).get("tgt_lang", ""),
                   log=lambda line: log(f"{cell.label}: valid, {line}"))
    log(f"{cell.label}: {describe(result['best'])} chosen on valid")
    return {"value": result["best"], "split": "valid", "select": result["select"],
            "rows": result["rows"]}


def ensure_shortlist(run_dir: Path, data_dir: Path, log) -> Path:
    """The lexical shortlist beside a run's checkpoints, built from ``data_dir``'s training
    split (k 50, 100 frequent: ``ranmt shortlist``'s defaults) when there is none."""
    found = shortlist_beside(run_dir)
    if found is not None:
        return found
    settings = {"data": str(data_dir), "split": "train", "k": 50, "frequent": 100}
    path = run_dir / SHORTLIST_FILE
    build_shortlist(data_dir, settings["k"], settings["frequent"]).save(path, settings)
    log(f"wrote {path} (built from {data_dir}'s training split)")
    return path


def machine_description(device) -> dict:
    """What a cell finished on (its last training run and its decoding): the CPU's model
    and bf16/VNNI/AMX flags (``cpu_description``), the cores the worker may run on and its
    torch threads (one worker per core trains each cell more slowly, the grid sooner), and
    the GPU where it decoded on one."""
    machine = {"cpu": cpu_description(), "device": str(device),
               "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.device(device).type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return machine


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def claim(lock: Path) -> bool:
    """Take ``lock`` for this process; False if another live process on this host holds it.

    A lock from a dead process (or an unreadable one) is stale and taken over. Locks from
    another host are respected (no way to check them), so remove those by hand if needed.
    """
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = f"{socket.gethostname()} {os.getpid()}"
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                host, pid = lock.read_text(encoding="utf-8").split()
                holder_alive = host != socket.gethostname() or pid_alive(int(pid))
            except (OSError, ValueError):
                holder_alive = False
            if holder_alive:
                return f"{host} {pid}" == me
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(me)
        return True
    return False


def release(lock: Path) -> None:
    lock.unlink(missing_ok=True)
