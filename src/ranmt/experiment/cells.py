"""One cell of a grid: train or resume it, decode and score every test set (and with the
grid's other settings, ``also_decode``), write ``cell.json``. Its dataset is prepared once
by ``ranmt.experiment.preparation``; the lock files that let several workers share a grid
are ``ranmt.experiment.locks``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ranmt.config import decode_with, to_dict
from ranmt.data.corpus import extra_references, load_meta, raw_text
from ranmt.data.text import write_lines
from ranmt.evaluate import TASK_METRICS, score
from ranmt.experiment.spec import LOAD_OPTIONS, SWEEP_KEY, Cell
from ranmt.inference.shortlist import SHORTLIST_FILE, build_shortlist, shortlist_beside
from ranmt.inference.sweep import describe, sweep
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description
from ranmt.training.train import train


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
    for an ``also_decode`` setting), the decoding speed and the output length
    (``length_ratio``: hypothesis over reference words as BLEU's brevity penalty counts
    them)."""
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
        result = score(hyps, refs, metrics, meta.get("tgt_lang", ""),
                       extra_refs=extra_references(data_dir, test),
                       rouge_rule=cell.dataset.rouge_references, length_ratio=True)
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
