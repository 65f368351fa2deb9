"""Cells that need not be trained again: an identical finished cell of another grid is
copied (:func:`find_reusable_cell`), one that differs only in its budget is warm-started
from that cell's step checkpoint (:func:`find_warm_start`). Identity is decided on the
resolved config (precision included) and byte-identical prepared data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import torch

from ranmt.checkpoint import CheckpointError, read_meta, step_checkpoints, write_meta
from ranmt.config import ConfigError, decode_with, to_dict
from ranmt.data.corpus import fill_config_from_data
from ranmt.experiment.spec import Cell, source_run_dir
from ranmt.inference.translator import device_kind
from ranmt.runtime.precision import PrecisionError, legacy_precision, resolve_precision

# Prepared-data files that decide what a cell learns from (the tokenizers and the token
# ids of the training and validation text); a reused cell must have been trained on
# byte-identical ones.
_TRAINING_DATA_FILES = ("spm.src.model", "spm.tgt.model", "train.src.tokens.npy",
                        "train.tgt.tokens.npy", "valid.src.tokens.npy", "valid.tgt.tokens.npy")


# Config fields newer than some recorded cells (dotted paths) -> the value that computes
# what every cell before the field computed: a cell recorded without the field is the same
# training as one that sets it to this value (and only this value).
_FIELDS_ADDED = {
    "train.dropout_masks": "torch",
    "data.pool_batches": 0,            # one sort by target length (before 2026-11-28)
    "data.shape_buckets": [],          # off
    "data.auto_shape_buckets": 0,      # off
    "train.compile_mode": "default",
    "train.valid_metric": "bleu",      # the best checkpoint chosen by validation BLEU
    "train.host_reads": "auto",        # per-step reads off CUDA, as every trainer before it
    "model.ran.kernel": "auto",        # explicit off CUDA, what RAN computed before the field
    "model.aan": {"ffn_dim": 0, "gate": True},  # read by the AAN decoder only
    "decode.cuda_graphs": False,
    "decode.compile_step": False,
    "decode.shortlist": False,
    "decode.sampling": "none",         # search, as every decode before sampling existed
    "decode.topk": 0,                  # the sampling settings, unread without sampling
    "decode.topp": 0.9,
    "decode.epsilon": 0.02,
    "decode.temperature": 1.0,
    "decode.seed": 0,
}


def _digest(path: Path) -> str | None:
    """SHA-256 of a file's bytes, None if it does not exist."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _comparable_config(config: dict, precision: str | None = None) -> dict:
    """A cell's config without what may differ between identical trainings: the location
    of the prepared data (its content is compared separately); ``train.precision`` replaced
    by the precision the cell trains (or trained) in when given (``auto`` resolves by the
    hardware). Training fields added after a cell was written are given the value that
    cell trained with (``_FIELDS_ADDED``)."""
    config = json.loads(json.dumps(config))  # a deep copy with JSON types (tuples -> lists)
    config.get("data", {}).pop("dir", None)
    for dotted, before in _FIELDS_ADDED.items():
        *sections, field_name = dotted.split(".")
        owner = config
        for section in sections:
            owner = owner.setdefault(section, {})
        owner.setdefault(field_name, json.loads(json.dumps(before)))
    if precision is not None:
        config.setdefault("train", {})["precision"] = precision
    return config


def recorded_config(cell: dict) -> dict:
    """A finished cell's comparable config, with the precision it trained in (cells from
    before the precision was recorded: what ``auto`` meant then)."""
    train_config = cell["config"].get("train", {})
    device = torch.device(device_kind(train_config.get("device", "auto")))
    precision = cell.get("train", {}).get("precision") or legacy_precision(
        train_config.get("precision", "auto"), device)
    return _comparable_config(cell["config"], precision)


def expected_cell_config(cell: Cell, data_dir: Path) -> dict:
    """The config a cell of this grid would record in cell.json (see :func:`run_cell`):
    its training config with what ``data_dir`` decides filled in as training does, and
    the grid's decoding options."""
    cfg = cell.config()
    fill_config_from_data(cfg, data_dir)
    # the grid's decode options that are DecodeConfig fields (others, e.g. device, go to
    # Translator.load and are not recorded in the config)
    cfg.decode = decode_with(cfg.decode, **{key: value
                                            for key, value in cell.experiment.decode.items()
                                            if hasattr(cfg.decode, key)})
    try:
        device = torch.device(device_kind(cfg.train.device))
        precision = resolve_precision(cfg.train.precision, device)[0]
    except PrecisionError:
        precision = cfg.train.precision  # the cell itself will say why it cannot run
    return _comparable_config(to_dict(cfg), precision)


def precision_it_trains_in(cell: Cell, data_dir: Path) -> str:
    """The precision cell ``cell`` will train in when it runs now: a cell stopped part-way
    goes on in the one its newest step checkpoint records (training keeps it); a new one
    in what its config's precision resolves to on this machine."""
    steps = step_checkpoints(cell.run_dir)
    if steps:
        with contextlib.suppress(CheckpointError):
            recorded = read_meta(steps[-1]).get("trainer", {}).get("precision")
            if recorded:
                return recorded
    return expected_cell_config(cell, data_dir)["train"]["precision"]


def _same_data(ours: Path, theirs: Path, tests: list[str]) -> tuple[str, str] | None:
    """None when two prepared-data folders hold identical training data and test sets,
    else the first difference as (kind, text): kind ``missing`` (a file of ``theirs`` is not
    there, so nothing can be compared) or ``differs``."""
    names = list(_TRAINING_DATA_FILES) + [f"{test}.{side}.txt" for test in tests
                                          for side in ("src", "tgt")]
    for name in names:
        mine, other = _digest(ours / name), _digest(theirs / name)
        if other is None:
            return "missing", f"{theirs / name} is missing"
        if mine != other:
            return "differs", f"{name} differs"
    return None


def _finished_cells(sources: list[Path], seed: int):
    """(grid folder, cell.json path, its contents) of every finished cell of ``seed`` in the
    grid output folders ``sources``."""
    for source in sources:
        for cell_file in sorted(Path(source).glob("runs/*/*/seed*/cell.json")):
            cell = json.loads(cell_file.read_text(encoding="utf-8"))
            if cell.get("seed") == seed:
                yield Path(source), cell_file, cell


def find_reusable_cell(cell: Cell, data_dir: Path, sources: list[Path],
                       log) -> tuple[Path, dict] | None:
    """A finished cell of another grid (its output folder in ``sources``) that is the very
    training this cell would run: same seed, same resolved config (training, model and
    decoding; any variant name), byte-identical prepared data, and hypotheses for every
    test set of this dataset. Returns (its cell folder, its cell.json) or None.

    Training is deterministic on a given machine for a given config and seed, so such a
    cell is what this one would compute; reusing it saves its training time.

    Raises ConfigError when the only candidates are cells whose grid has no prepared data
    to compare with (its ``data/`` folder, not committed with the cells, was never built
    on this machine): the user asked for a reuse that a data preparation would allow, and
    training the cell again instead would silently cost its whole training time."""
    expected = expected_cell_config(cell, data_dir)
    tests = list(cell.dataset.tests)
    unverifiable = []
    for source, cell_file, found in _finished_cells(sources, cell.seed):
        if recorded_config(found) != expected:
            continue
        if any(test not in found["tests"] or not (cell_file.parent / f"{test}.hyp").is_file()
               for test in tests):
            log(f"not reusing {cell_file.parent}: it lacks hypotheses for one of {tests}")
            continue
        difference = _same_data(data_dir, source / "data" / found["dataset"], tests)
        if difference is not None:
            kind, text = difference
            if kind == "missing":
                unverifiable.append((source, cell_file.parent, text))
            log(f"not reusing {cell_file.parent}: its prepared data cannot be shown "
                f"identical ({text})")
            continue
        return cell_file.parent, found
    if unverifiable:
        source, cell_dir, text = unverifiable[0]
        raise ConfigError(
            f"--reuse: {cell_dir} is the same training as {cell.label} (config and seed) but "
            f"its grid's prepared data cannot be compared with this one's ({text}). Prepare "
            f"that grid's data first (no training): `ranmt experiment <its grid file> --out "
            f"{source} --tables-only`, then rerun; or drop --reuse {source} to train the "
            f"cell here.")
    return None


def adopt_cell(source_dir: Path, found: dict, cell: Cell) -> dict:
    """Copy a reusable cell (:func:`find_reusable_cell`: its folder and cell.json) into
    this grid's ``cell``: its hypotheses for this dataset's test sets, its train.log and its
    cell.json, which names the source."""
    cell_dir = cell.dir
    cell_dir.mkdir(parents=True, exist_ok=True)
    tests = {}
    for test in cell.dataset.tests:
        shutil.copyfile(source_dir / f"{test}.hyp", cell_dir / f"{test}.hyp")
        tests[test] = {**found["tests"][test], "hyp_file": str(cell_dir / f"{test}.hyp")}
    if (source_dir / "train.log").is_file():
        shutil.copyfile(source_dir / "train.log", cell_dir / "train.log")
    adopted = {**found, "dataset": cell.dataset.name, "variant": cell.variant.name,
               "tests": tests, "reused_from": str(source_dir)}
    cell.file.write_text(json.dumps(adopted, indent=1), encoding="utf-8")
    return adopted


# Training keys that only stop or observe a training (how long, how often it validates, how
# many checkpoints it keeps), not what any of its steps compute: two configs that differ in
# nothing else train the very same model up to the shorter one's last step.
_BUDGET_KEYS = ("max_steps", "max_time", "max_epochs", "patience", "validate_every",
                "keep_last")


def _without_budget(config: dict) -> dict:
    config = _comparable_config(config)
    for key in _BUDGET_KEYS:
        config.get("train", {}).pop(key, None)
    return config


def warm_start_state(trainer: dict, validate_every: int) -> dict | None:
    """The trainer state this cell's own training would hold at the checkpoint's step, or
    None when it would differ: the cell validates every ``validate_every`` steps, so the
    source must have validated at each of those steps (it may have validated more often;
    those extra validations are dropped) and its best validation must be at the checkpoint's
    step (then the best, and the count of validations without gain, are the same either
    way)."""
    step = trainer.get("step", 0)
    if step <= 0 or step % validate_every or trainer.get("best_step") != step:
        return None
    kept = [v for v in trainer.get("validations", []) if v["step"] % validate_every == 0]
    if [v["step"] for v in kept] != list(range(validate_every, step + 1, validate_every)):
        return None
    return {**trainer, "validations": kept, "bad_validations": 0}


def find_warm_start(cell: Cell, data_dir: Path, sources: list[Path],
                    log) -> tuple[Path, dict] | None:
    """A step checkpoint of another grid's cell that this cell's training passes through:
    same seed, same resolved config except the budget keys (``_BUDGET_KEYS``: e.g. the
    converged grid's cells are the 1,000-step grid's cells trained on), byte-identical
    training data, a step this cell reaches and validates at, the source's best validation
    at that step. Returns (checkpoint folder, the trainer state this cell would hold there).

    Training is deterministic and resumes exactly, so resuming from that checkpoint gives
    the model this cell would have trained from scratch, without the steps' time."""
    cfg = cell.config()
    if not cfg.train.validate_every or cfg.train.max_epochs:
        return None  # epoch-budgeted or unvalidated runs: keep it simple, train from scratch
    expected = _without_budget(expected_cell_config(cell, data_dir))
    for source, cell_file, found in _finished_cells(sources, cell.seed):
        if _without_budget(recorded_config(found)) != expected:
            continue
        if _same_data(data_dir, source / "data" / found["dataset"], []) is not None:
            continue
        source_run = source_run_dir(source, cell_file.parent, cell.experiment.work)
        for checkpoint in reversed(step_checkpoints(source_run)):
            trainer = read_meta(checkpoint).get("trainer", {})
            if cfg.train.max_steps and trainer.get("step", 0) > cfg.train.max_steps:
                continue
            state = warm_start_state(trainer, cfg.train.validate_every)
            if state is not None:
                return checkpoint, state
        log(f"not warm-starting from {cell_file.parent}: none of its step checkpoints is "
            f"at a validation this cell runs with its best validation there")
    return None


def warm_start(checkpoint: Path, state: dict, cfg_dict: dict, run_dir: Path) -> None:
    """Seed ``run_dir`` with ``checkpoint`` (:func:`find_warm_start`) as its own step
    checkpoint and its ``best``, both holding this cell's config and trainer state, so that
    ``train`` resumes from there; the source's train.log starts this run's log."""
    step = state["step"]
    for target, drop in ((run_dir / "checkpoints" / f"step_{step:08d}", ()),
                         (run_dir / "best", ("optimizer.safetensors",))):
        shutil.copytree(checkpoint, target, ignore=shutil.ignore_patterns(*drop))
        meta = read_meta(target)
        meta["config"] = cfg_dict
        meta["trainer"] = dict(state)
        if drop:  # best/ carries the validation of its step, as training writes it
            meta["trainer"]["valid"] = {k: v for k, v in state["validations"][-1].items()
                                        if k != "step"}
            meta.pop("optimizer", None)
        write_meta(target, meta)
    (run_dir / "warm_start.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint), "step": step}, indent=1), encoding="utf-8")
    source_log = checkpoint.parent.parent / "train.log"
    with open(run_dir / "train.log", "w", encoding="utf-8") as log_file:
        if source_log.is_file():
            log_file.write(source_log.read_text(encoding="utf-8"))
        log_file.write(f"warm start: steps 1-{step} are those of {checkpoint} (its run's log "
                       "is above); this cell resumes from that checkpoint\n")


def warm_start_if_possible(cell: Cell, data_dir: Path, sources: list[Path],
                           log) -> tuple[Path, dict] | None:
    """:func:`find_warm_start` and, where it finds a checkpoint, :func:`warm_start` into the
    cell's run folder; returns what it found."""
    found = find_warm_start(cell, data_dir, sources, log)
    if found is not None:
        cfg = cell.config()
        fill_config_from_data(cfg, data_dir)
        warm_start(*found, to_dict(cfg), cell.run_dir)
    return found
