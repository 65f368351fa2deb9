"""``ranmt experiment CONFIG.yaml``: a grid of datasets x variants x seeds, end to end.

For every dataset: download (optional) and prepare once. For every cell (dataset, variant,
seed; seed-major, so a grid cut short still has every variant's first seed): train
(resuming a run that was interrupted), take the best checkpoint on validation, translate
every test set (timed), score it; a finished cell writes ``cell.json`` (with the training
summary: steps run, best step, validation history) and a copy of ``train.log``, and is
never recomputed.

Fair by construction: budget cells by optimizer steps (``train.max_steps`` in the grid's
``overrides``, equal for every variant); a wall-clock budget (``train.max_time``) stays
possible, and either way the tables state the steps every cell ran, the step of its best
checkpoint and whether that was its last validation ("still improving", ``*``).

``results.md`` holds one table per test set in the layout of the RAN paper's Table 1
(metric rows, variant columns): mean ± sample std over seeds, the difference of the means
to the baseline in parentheses, and two significance marks (:func:`compare_over_seeds`):

* † every seed's paired bootstrap (sacreBLEU, variant seed s against baseline seed s) has
  p < ``alpha`` and all seeds differ in the same direction;
* ‡ Welch's t-test over the seed scores (two or more seeds per side) has p < ``alpha``.

A difference that holds across seeds has both. Then a training table (seeds, steps, best
steps, best validation BLEU, parameters, time, speed) and ``validation_<dataset>.png``
(validation BLEU against steps, every cell). ``results.json`` has every number, per-seed
scores and p-values, sacreBLEU signatures, the config and the git commit. Both are
rewritten after every cell so that a long grid shows its finished cells early;
``--tables-only`` rewrites them without training, ``--variants`` / ``--seeds`` restrict
the cells a worker runs.

``--reuse DIR`` (another grid's output folder): a cell that is the very same training as a
finished cell there (same seed, same resolved training/model/decoding config under any
variant name, byte-identical prepared data, hypotheses for every test set) is copied
instead of trained; its ``cell.json`` says ``reused_from``. The ablation grid's TransF and
RAN-ALL cells, for example, are the equal-step grid's. A cell whose training differs from
one there only in its budget (more steps, sparser validation, patience: the converged
grid's cells against the 1,000-step grid's) is *warm-started* instead
(:func:`find_warm_start`): it resumes from that cell's step checkpoint, which is exactly
where its own training would have been, and its ``cell.json`` says ``warm_started_from``.

``--baseline NAME`` compares against another variant of the grid as well (same rule, same
marks): ``results.vs-NAME.md|json`` beside the main tables, e.g. HC-SA against RAN-ALL.

Several workers may run the same grid at once (one per GPU, or one per pinned CPU core):
start ``ranmt experiment CONFIG.yaml`` several times. A worker claims a cell with a lock
file (``cell_dir/lock``, holding host and pid) and skips cells another live worker holds;
a lock left by a dead process is taken over, and the cell resumes from its checkpoint.
Whichever worker finishes last writes the complete tables.

A worker stopped by SIGTERM/SIGINT saves the cell's checkpoint and exits (status 130)
without recording the cell: rerunning resumes it. ``--out DIR`` overrides the file's
``out``; pointing it inside the repository (with the checkpoints and prepared data
git-ignored) keeps finished cells, whose ``cell.json`` and hypotheses are all the tables
need, across machines and sessions. ``--work DIR`` (or ``$RANMT_WORK_DIR``) keeps the run
folders themselves outside the checkout, under ``DIR/<out's folder name>/runs/...``: a cell
stopped mid-training (a SIGTERM, a preempted job, a fresh clone) resumes there from its
last checkpoint, from any checkout of the grid.

Experiment file (YAML)::

    name: multi30k_en_de
    out: experiments/multi30k_en_de     # relative to the current directory
    base_config: configs/multi30k_small.yaml
    overrides: {train.max_steps: 1000}  # for every cell: an equal step budget
    seeds: [1, 2, 3]                    # the default
    baseline: TransF
    alpha: 0.05                         # significance level of the marks
    decode: {beam: 4, lenpen: 0.6}
    datasets:
      - name: multi30k-en-de
        download: {dataset: multi30k, pair: en-de}   # or give train/valid/tests prefixes
        src: en
        tgt: de
        vocab_size: 8000
        tests: [test_2016_flickr, test_2017_flickr]
    variants:
      - {name: TransF, overrides: {model.arch: transf}}
      - {name: TransF+AD, overrides: {model.arch: transf, model.attention_dropout: 0.2,
                                      model.cross_attention_dropout: 0.0}}
      - {name: RAN-ALL, overrides: {model.arch: ran-all}}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from ranmt.checkpoint import step_checkpoints
from ranmt.config import ConfigError, load_config, to_dict
from ranmt.data.corpus import load_meta, prepare, raw_text
from ranmt.data.download import download_multi30k
from ranmt.data.text import write_lines
from ranmt.data.wmt import available as available_wmt
from ranmt.data.wmt import download_wmt
from ranmt.evaluate import TASK_METRICS, paired_bootstrap, score
from ranmt.precision import PrecisionError, legacy_precision, resolve_precision
from ranmt.train import fill_config_from_data, train
from ranmt.translator import Translator

# Environment variable naming the work folder (``ranmt experiment --work``).
WORK_ENV = "RANMT_WORK_DIR"

ROW_NAMES = {"tok_bleu": "BLEU", "bleu": "SacreBLEU", "chrf": "chrF", "ter": "TER",
             "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}
LOWER_IS_BETTER = {"ter"}


@dataclass
class Dataset:
    name: str
    src: str
    tgt: str
    train: str | list[str] = ""  # one prefix or several (concatenated)
    valid: str = ""
    tests: dict[str, str] = field(default_factory=dict)
    download: dict | None = None
    vocab_size: int = 8000
    joint: bool = True
    model_type: str = "bpe"
    max_positions: int = 256
    task: str = "translation"


@dataclass
class Experiment:
    name: str
    out: Path
    datasets: list[Dataset]
    variants: list[dict]
    seeds: list[int]
    baseline: str
    base_config: str | None
    overrides: dict
    decode: dict
    bootstrap_samples: int = 1000
    alpha: float = 0.05
    path: Path | None = None
    work: Path | None = None  # run folders outside ``out`` (--work / RANMT_WORK_DIR)


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {path} does not exist")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    known = {"name", "out", "datasets", "variants", "seeds", "baseline", "base_config",
             "overrides", "decode", "bootstrap_samples", "alpha"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{path}: unknown experiment key(s) {sorted(unknown)}; "
                          f"valid: {sorted(known)}")
    for key in ("datasets", "variants"):
        if not raw.get(key):
            raise ConfigError(f"{path}: '{key}' must list at least one entry")
    datasets = []
    for entry in raw["datasets"]:
        entry = dict(entry)
        tests = entry.pop("tests", {})
        if isinstance(tests, list):  # names of downloaded splits
            tests = {name: name for name in tests}
        try:
            datasets.append(Dataset(tests=dict(tests), **entry))
        except TypeError as err:
            raise ConfigError(f"{path}: dataset entry {entry.get('name')}: {err}") from None
    names = [v.get("name") for v in raw["variants"]]
    if len(set(names)) != len(names) or None in names:
        raise ConfigError(f"{path}: every variant needs a unique name")
    baseline = raw.get("baseline", names[0])
    if baseline not in names:
        raise ConfigError(f"{path}: baseline '{baseline}' is not one of the variants {names}")
    return Experiment(
        name=raw.get("name", path.stem), out=Path(raw.get("out", f"experiments/{path.stem}")),
        datasets=datasets, variants=raw["variants"], seeds=list(raw.get("seeds", [1, 2, 3])),
        baseline=baseline, base_config=raw.get("base_config"),
        overrides=dict(raw.get("overrides", {})), decode=dict(raw.get("decode", {})),
        bootstrap_samples=int(raw.get("bootstrap_samples", 1000)),
        alpha=float(raw.get("alpha", 0.05)), path=path)


def _git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10)
    except OSError:
        return None
    return result.stdout.strip() or None


def prepare_dataset(dataset: Dataset, root: Path, log) -> Path:
    """Download (if asked) and prepare a dataset once; return the prepared-data directory."""
    prepared = root / "data" / dataset.name
    if (prepared / "meta.json").is_file():
        return prepared
    tests = dict(dataset.tests)
    train_prefix, valid_prefix = dataset.train, dataset.valid
    if dataset.download:
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
    log(f"preparing dataset {dataset.name}")
    prepare(dataset.src, dataset.tgt, train_prefix, valid_prefix, prepared, tests,
            dataset.vocab_size, dataset.joint, dataset.model_type, dataset.max_positions,
            log=log)
    return prepared


class CellInterrupted(KeyboardInterrupt):
    """Training stopped on a signal: the cell is saved for resume, not finished."""


def _cell_config(experiment: Experiment, variant: dict, seed: int):
    """The training config of one cell: base config, grid overrides, variant, seed."""
    overrides = {**experiment.overrides, **variant.get("overrides", {}),
                 "train.seed": seed}
    return load_config(experiment.base_config, {k: str(v) for k, v in overrides.items()})


def run_cell(experiment: Experiment, dataset: Dataset, data_dir: Path, variant: dict,
             seed: int, cell_dir: Path, log) -> dict:
    """Train (or resume) one cell, decode and score every test set; write cell.json."""
    cfg = _cell_config(experiment, variant, seed)
    started = time.monotonic()
    run_dir = _run_dir(experiment, dataset.name, variant["name"], seed)
    summary = train(cfg, data_dir, run_dir)
    if str(summary.get("stop_reason", "")).endswith("received"):
        raise CellInterrupted(f"training stopped by {summary['stop_reason'].split()[0]}; "
                              "the checkpoint is saved, rerun `ranmt experiment` to resume")
    decode = {k: v for k, v in experiment.decode.items()}
    translator = Translator.load(run_dir, **decode)
    meta = load_meta(data_dir)
    metrics = TASK_METRICS[dataset.task]
    tests = {}
    for test in dataset.tests:
        sources = raw_text(data_dir, test, "src")
        refs = raw_text(data_dir, test, "tgt")
        start = time.perf_counter()
        hyps = translator.translate(sources)
        seconds = time.perf_counter() - start
        hyp_path = cell_dir / f"{test}.hyp"
        write_lines(hyp_path, hyps)
        result = score(hyps, refs, metrics, meta.get("tgt_lang", ""))
        target_tokens = sum(len(ids) + 1 for ids in translator.tgt_vocab.encode(hyps))
        result.update({"hyp_file": str(hyp_path), "decode_seconds": seconds,
                       "sentences_per_s": len(hyps) / seconds,
                       "target_tokens_per_s": target_tokens / seconds})
        tests[test] = result
    cell = {"dataset": dataset.name, "variant": variant["name"], "seed": seed,
            "checkpoint": str(translator.checkpoint_dir), "train": summary,
            "parameters": summary["parameters"], "tests": tests,
            "config": to_dict(translator.config),
            "wall_seconds": time.monotonic() - started}
    warm_file = run_dir / "warm_start.json"
    if warm_file.is_file():  # steps 1..N came from another grid's cell (find_warm_start)
        cell["warm_started_from"] = json.loads(warm_file.read_text(encoding="utf-8"))
    log_file = run_dir / "train.log"
    if log_file.is_file():  # the run folder is not kept in git; the log is small
        shutil.copyfile(log_file, cell_dir / "train.log")
    (cell_dir / "cell.json").write_text(json.dumps(cell, indent=1), encoding="utf-8")
    return cell


# Prepared-data files that decide what a cell learns from (the tokenizers and the token
# ids of the training and validation text); a reused cell must have been trained on
# byte-identical ones.
_TRAINING_DATA_FILES = ("spm.src.model", "spm.tgt.model", "train.src.tokens.npy",
                        "train.tgt.tokens.npy", "valid.src.tokens.npy", "valid.tgt.tokens.npy")


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
    hardware)."""
    config = json.loads(json.dumps(config))  # a deep copy with JSON types (tuples -> lists)
    config.get("data", {}).pop("dir", None)
    if precision is not None:
        config.setdefault("train", {})["precision"] = precision
    return config


def _device(name: str) -> torch.device:
    cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if cuda else "cpu")


def _recorded_config(cell: dict) -> dict:
    """A finished cell's comparable config, with the precision it trained in (cells from
    before the precision was recorded: what ``auto`` meant then)."""
    train_config = cell["config"].get("train", {})
    precision = cell.get("train", {}).get("precision") or legacy_precision(
        train_config.get("precision", "auto"), _device(train_config.get("device", "auto")))
    return _comparable_config(cell["config"], precision)


def expected_cell_config(experiment: Experiment, variant: dict, seed: int,
                         data_dir: Path) -> dict:
    """The config a cell of this grid would record in cell.json (see :func:`run_cell`):
    its training config with what ``data_dir`` decides filled in as training does, and
    the grid's decoding options."""
    cfg = _cell_config(experiment, variant, seed)
    fill_config_from_data(cfg, data_dir)
    for key, value in experiment.decode.items():
        if value is not None and hasattr(cfg.decode, key):
            setattr(cfg.decode, key, value)
    try:
        precision = resolve_precision(cfg.train.precision, _device(cfg.train.device))[0]
    except PrecisionError:
        precision = cfg.train.precision  # the cell itself will say why it cannot run
    return _comparable_config(to_dict(cfg), precision)


def _same_data(ours: Path, theirs: Path, tests: list[str]) -> str | None:
    """None when two prepared-data folders hold identical training data and test sets,
    else the first difference."""
    names = list(_TRAINING_DATA_FILES) + [f"{test}.{side}.txt" for test in tests
                                          for side in ("src", "tgt")]
    for name in names:
        mine, other = _digest(ours / name), _digest(theirs / name)
        if other is None:
            return f"{theirs / name} is missing"
        if mine != other:
            return f"{name} differs"
    return None


def _finished_cells(sources: list[Path], seed: int):
    """(grid folder, cell.json path, its contents) of every finished cell of ``seed`` in the
    grid output folders ``sources``."""
    for source in sources:
        for cell_file in sorted(Path(source).glob("runs/*/*/seed*/cell.json")):
            cell = json.loads(cell_file.read_text(encoding="utf-8"))
            if cell.get("seed") == seed:
                yield Path(source), cell_file, cell


def find_reusable_cell(experiment: Experiment, dataset: Dataset, data_dir: Path,
                       variant: dict, seed: int, sources: list[Path],
                       log) -> tuple[Path, dict] | None:
    """A finished cell of another grid (its output folder in ``sources``) that is the very
    training this cell would run: same seed, same resolved config (training, model and
    decoding; any variant name), byte-identical prepared data, and hypotheses for every
    test set of this dataset. Returns (its cell folder, its cell.json) or None.

    Training is deterministic on a given machine for a given config and seed, so such a
    cell is what this one would compute; reusing it saves its training time."""
    expected = expected_cell_config(experiment, variant, seed, data_dir)
    for source, cell_file, cell in _finished_cells(sources, seed):
        if _recorded_config(cell) != expected:
            continue
        if any(test not in cell["tests"] or not (cell_file.parent / f"{test}.hyp").is_file()
               for test in dataset.tests):
            log(f"not reusing {cell_file.parent}: it lacks hypotheses for one of "
                f"{list(dataset.tests)}")
            continue
        difference = _same_data(data_dir, source / "data" / cell["dataset"],
                                list(dataset.tests))
        if difference is not None:
            log(f"not reusing {cell_file.parent}: its prepared data cannot be shown "
                f"identical ({difference})")
            continue
        return cell_file.parent, cell
    return None


def adopt_cell(source_dir: Path, cell: dict, dataset: Dataset, variant: dict,
               cell_dir: Path) -> dict:
    """Copy a reusable cell (:func:`find_reusable_cell`) into this grid: its hypotheses for
    this dataset's test sets, its train.log and its cell.json, which names the source."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    tests = {}
    for test in dataset.tests:
        shutil.copyfile(source_dir / f"{test}.hyp", cell_dir / f"{test}.hyp")
        tests[test] = {**cell["tests"][test], "hyp_file": str(cell_dir / f"{test}.hyp")}
    if (source_dir / "train.log").is_file():
        shutil.copyfile(source_dir / "train.log", cell_dir / "train.log")
    adopted = {**cell, "dataset": dataset.name, "variant": variant["name"], "tests": tests,
               "reused_from": str(source_dir)}
    (cell_dir / "cell.json").write_text(json.dumps(adopted, indent=1), encoding="utf-8")
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


def _warm_start_state(trainer: dict, validate_every: int) -> dict | None:
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


def find_warm_start(experiment: Experiment, data_dir: Path, variant: dict, seed: int,
                    sources: list[Path], log) -> tuple[Path, dict] | None:
    """A step checkpoint of another grid's cell that this cell's training passes through:
    same seed, same resolved config except the budget keys (``_BUDGET_KEYS``: e.g. the
    converged grid's cells are the 1,000-step grid's cells trained on), byte-identical
    training data, a step this cell reaches and validates at, the source's best validation
    at that step. Returns (checkpoint folder, the trainer state this cell would hold there).

    Training is deterministic and resumes exactly, so resuming from that checkpoint gives
    the model this cell would have trained from scratch, without the steps' time."""
    cfg = _cell_config(experiment, variant, seed)
    if not cfg.train.validate_every or cfg.train.max_epochs:
        return None  # epoch-budgeted or unvalidated runs: keep it simple, train from scratch
    expected = _without_budget(expected_cell_config(experiment, variant, seed, data_dir))
    for source, cell_file, cell in _finished_cells(sources, seed):
        if _without_budget(_recorded_config(cell)) != expected:
            continue
        if _same_data(data_dir, source / "data" / cell["dataset"], []) is not None:
            continue
        source_run = _source_run_dir(source, cell_file.parent, experiment.work)
        for checkpoint in reversed(step_checkpoints(source_run)):
            trainer = json.loads((checkpoint / "checkpoint.json").read_text(
                encoding="utf-8")).get("trainer", {})
            if cfg.train.max_steps and trainer.get("step", 0) > cfg.train.max_steps:
                continue
            state = _warm_start_state(trainer, cfg.train.validate_every)
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
        meta = json.loads((target / "checkpoint.json").read_text(encoding="utf-8"))
        meta["config"] = cfg_dict
        meta["trainer"] = dict(state)
        if drop:  # best/ carries the validation of its step, as training writes it
            meta["trainer"]["valid"] = {k: v for k, v in state["validations"][-1].items()
                                        if k != "step"}
            meta.pop("optimizer", None)
        (target / "checkpoint.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    (run_dir / "warm_start.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint), "step": step}, indent=1), encoding="utf-8")
    source_log = checkpoint.parent.parent / "train.log"
    with open(run_dir / "train.log", "w", encoding="utf-8") as log_file:
        if source_log.is_file():
            log_file.write(source_log.read_text(encoding="utf-8"))
        log_file.write(f"warm start: steps 1-{step} are those of {checkpoint} (its run's log "
                       "is above); this cell resumes from that checkpoint\n")


def _warm_start_if_possible(experiment: Experiment, data_dir: Path, variant: dict, seed: int,
                            sources: list[Path], run_dir: Path,
                            log) -> tuple[Path, dict] | None:
    """:func:`find_warm_start` and, where it finds a checkpoint, :func:`warm_start`;
    returns what it found."""
    found = find_warm_start(experiment, data_dir, variant, seed, sources, log)
    if found is not None:
        cfg = _cell_config(experiment, variant, seed)
        fill_config_from_data(cfg, data_dir)
        warm_start(*found, to_dict(cfg), run_dir)
    return found


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1) over seeds; std None for one seed."""
    if len(values) == 1:
        return values[0], None
    return statistics.mean(values), statistics.stdev(values)


def _format(mean: float, std: float | None) -> str:
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def welch_p_value(first: list[float], second: list[float]) -> float | None:
    """Two-sided p of Welch's t-test between two sets of seed scores (None if undefined)."""
    if len(first) < 2 or len(second) < 2:
        return None
    if statistics.stdev(first) == 0 and statistics.stdev(second) == 0:
        return 1.0 if statistics.mean(first) == statistics.mean(second) else 0.0
    from scipy.stats import ttest_ind

    return float(ttest_ind(first, second, equal_var=False).pvalue)


def compare_over_seeds(baseline: dict[int, float], variant: dict[int, float],
                       bootstrap_p: dict[int, float], alpha: float) -> dict:
    """The significance rule of the results tables, for one metric of one variant.

    ``baseline`` / ``variant``: seed -> score; ``bootstrap_p``: seed -> p-value of the paired
    bootstrap between the variant's and the baseline's outputs of that seed.

    * ``dagger`` (†): every seed the two share is significant (p < alpha) **and** every
      per-seed difference has the same sign: the gain (or loss) holds in every run.
    * ``double_dagger`` (‡): Welch's two-sided t-test over the seed scores (at least two
      seeds on each side) gives p < alpha: the difference of the seed means is larger than
      the spread between seeds.
    """
    shared = sorted(set(baseline) & set(variant) & set(bootstrap_p))
    deltas = [variant[s] - baseline[s] for s in shared]
    signs = {(d > 0) - (d < 0) for d in deltas}
    dagger = bool(shared) and all(bootstrap_p[s] < alpha for s in shared) \
        and len(signs) == 1 and 0 not in signs
    welch = welch_p_value(list(variant.values()), list(baseline.values()))
    return {"delta": statistics.mean(variant.values()) - statistics.mean(baseline.values()),
            "seeds": shared, "per_seed_delta": deltas,
            "per_seed_p": [bootstrap_p[s] for s in shared], "welch_p": welch,
            "dagger": dagger, "double_dagger": welch is not None and welch < alpha}


def significance_marks(comparison: dict) -> str:
    return ("†" if comparison["dagger"] else "") + ("‡" if comparison["double_dagger"] else "")


def _cell_dir(experiment: Experiment, dataset: str, variant: str, seed: int) -> Path:
    return experiment.out / "runs" / dataset / variant / f"seed{seed}"


def _work_run_dir(work: Path, out: Path, cell_path: Path) -> Path:
    """A run folder under the work folder: ``WORK/<out's folder name>/runs/<dataset>/
    <variant>/seed<N>/run``, so that two checkouts of one grid share their run folders."""
    return work / out.resolve().name / cell_path / "run"


def _run_dir(experiment: Experiment, dataset: str, variant: str, seed: int) -> Path:
    """Where a cell trains (checkpoints, trainer state, train.log): ``<cell>/run`` beside
    its cell.json, or under the work folder when one is set (:func:`_work_run_dir`)."""
    cell_dir = _cell_dir(experiment, dataset, variant, seed)
    if experiment.work is None:
        return cell_dir / "run"
    return _work_run_dir(experiment.work, experiment.out, cell_dir.relative_to(experiment.out))


def _source_run_dir(source: Path, cell_dir: Path, work: Path | None) -> Path:
    """The run folder of a finished cell of another grid (``--reuse``): beside it, else
    under the work folder."""
    beside = cell_dir / "run"
    if work is None or beside.is_dir():
        return beside
    return _work_run_dir(work, source, cell_dir.relative_to(source))


def _read_hyps(experiment: Experiment, cell: dict, test: str) -> list[str]:
    """A cell's hypotheses for ``test``, from its cell directory (so that a results folder
    that was moved or checked out elsewhere still works), else the recorded path."""
    path = _cell_dir(experiment, cell["dataset"], cell["variant"], cell["seed"]) / f"{test}.hyp"
    if not path.is_file():
        path = Path(cell["tests"][test]["hyp_file"])
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _metrics_in_order(task: str) -> list[str]:
    """The metrics in the RAN paper's row order (BLEU, SacreBLEU, chrF, TER), then the rest."""
    return sorted(TASK_METRICS[task],
                  key=lambda m: list(ROW_NAMES).index(m) if m in ROW_NAMES else 99)


def _bootstrap_p_values(experiment: Experiment, test: str, refs: list[str],
                        base_cells: dict[int, dict], cells: list[dict], name: str,
                        metrics: list[str]) -> dict[str, dict[int, float]]:
    """metric -> seed -> paired-bootstrap p of variant ``name`` against the same seed's baseline."""
    sig_metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    pvalues: dict[str, dict[int, float]] = {m: {} for m in sig_metrics}
    if not sig_metrics:
        return pvalues
    for cell in cells:
        base = base_cells.get(cell["seed"])
        if base is None:
            continue
        result = paired_bootstrap([(experiment.baseline, _read_hyps(experiment, base, test)),
                                   (name, _read_hyps(experiment, cell, test))], refs,
                                  sig_metrics, experiment.bootstrap_samples)
        for metric in sig_metrics:
            pvalues[metric][cell["seed"]] = result["systems"][1][f"{metric}_p"]
    return pvalues


def _test_table(experiment: Experiment, dataset: Dataset, test: str,
                by_variant: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """One test set's table (metric rows, variant columns) and its numbers."""
    metrics = _metrics_in_order(dataset.task)
    present = [n for n, cells in by_variant.items() if cells]
    scores = {name: {metric: {c["seed"]: c["tests"][test][metric] for c in by_variant[name]}
                     for metric in metrics} for name in present}
    refs = raw_text(Path(experiment.out) / "data" / dataset.name, test, "tgt")
    base_cells = {c["seed"]: c for c in by_variant.get(experiment.baseline, [])}
    comparisons: dict = {}
    for name in present:
        if name == experiment.baseline or not base_cells:
            continue
        pvalues = _bootstrap_p_values(experiment, test, refs, base_cells, by_variant[name],
                                      name, metrics)
        comparisons[name] = {
            metric: compare_over_seeds(scores[experiment.baseline][metric],
                                       scores[name][metric], pvalues[metric], experiment.alpha)
            for metric in pvalues}
    lines = [f"## {dataset.name} — {test}", "",
             "| metric | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
    for metric in metrics:
        row = []
        for name in present:
            text = _format(*_mean_std(list(scores[name][metric].values())))
            comparison = comparisons.get(name, {}).get(metric)
            if name != experiment.baseline and experiment.baseline in scores:
                base_mean = statistics.mean(scores[experiment.baseline][metric].values())
                delta = statistics.mean(scores[name][metric].values()) - base_mean
                text += f" ({delta:+.2f})"
                if comparison is not None and significance_marks(comparison):
                    text += " " + significance_marks(comparison)
            row.append(text)
        lines.append(f"| {ROW_NAMES.get(metric, metric)} | " + " | ".join(row) + " |")
    lines.append("")
    numbers = {"scores": {n: {m: {"mean": _mean_std(list(v.values()))[0],
                                  "std": _mean_std(list(v.values()))[1],
                                  "per_seed": {str(k): x for k, x in v.items()}}
                              for m, v in t.items()} for n, t in scores.items()},
               "significance": comparisons}
    return lines, numbers


def _steps_text(cells: list[dict]) -> tuple[str, str]:
    """'steps' and 'best step' columns: per seed, '*' where the best checkpoint is the last."""
    steps = [c["train"]["steps"] for c in cells]
    steps_text = f"{steps[0]:,}" if len(set(steps)) == 1 else " / ".join(f"{x:,}" for x in steps)
    best = []
    for cell in cells:
        best_step = cell["train"].get("best_step")
        still_improving = best_step is not None and best_step == cell["train"]["steps"]
        best.append(f"{best_step:,}" + ("*" if still_improving else "")
                    if best_step is not None else "-")
    return steps_text, " / ".join(best)


def _training_table(experiment: Experiment, dataset: Dataset,
                    by_variant: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """Per variant: seeds, optimizer steps, best step (still improving?), cost, speed."""
    lines = [f"## {dataset.name} — training and cost per variant", "",
             "| variant | seeds | steps | best step | best valid BLEU | parameters | "
             "training time (min) | train tgt tok/s | decode sent/s | decode tgt tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    numbers = {}
    first_test = next(iter(dataset.tests), None)
    for name, runs in by_variant.items():
        if not runs:
            continue
        steps_text, best_text = _steps_text(runs)
        best_bleu = [c["train"]["best_valid_bleu"] for c in runs
                     if c["train"].get("best_valid_bleu") is not None]
        train_min = _mean_std([c["train"]["wall_time_s"] / 60 for c in runs])
        train_tok = _mean_std([c["train"]["train_tokens_per_s"] for c in runs])
        sent = _mean_std([c["tests"][first_test]["sentences_per_s"] for c in runs]) \
            if first_test else (0.0, None)
        tok = _mean_std([c["tests"][first_test]["target_tokens_per_s"] for c in runs]) \
            if first_test else (0.0, None)
        bleu_text = _format(*_mean_std(best_bleu)) if best_bleu else "-"
        lines.append(f"| {name} | {len(runs)} | {steps_text} | {best_text} | {bleu_text} | "
                     f"{runs[0]['parameters']:,} | {_format(*train_min)} | "
                     f"{_format(*train_tok)} | {_format(*sent)} | {_format(*tok)} |")
        numbers[name] = {
            "parameters": runs[0]["parameters"], "seeds": [c["seed"] for c in runs],
            "steps": [c["train"]["steps"] for c in runs],
            "best_step": [c["train"].get("best_step") for c in runs],
            "still_improving": [c["train"].get("best_step") == c["train"]["steps"]
                                for c in runs],
            "stop_reason": [c["train"].get("stop_reason") for c in runs],
            "training_minutes": train_min, "train_tokens_per_s": train_tok,
            "decode_sentences_per_s": sent, "decode_tokens_per_s": tok}
    return lines, numbers


def _legend(alpha: float) -> list[str]:
    return ["", "Scores: mean ± sample std over seeds (one seed: the score alone); (±x) is "
            "the difference of the means to the baseline. BLEU: tokenized (sacremoses) as "
            "multi-bleu.perl; SacreBLEU: detokenized, 13a.",
            f"† every seed's paired bootstrap against the baseline's run with the same seed "
            f"has p < {alpha} and all seeds differ in the same direction; ‡ Welch's t-test "
            f"over the seed scores has p < {alpha} (needs two or more seeds per side).",
            "steps: optimizer steps each cell ran (one number when all seeds ran the same); "
            "best step: the step of the checkpoint that was evaluated, per seed, * where it "
            "is the last validated one (still improving when training stopped). Decoding "
            "speed on the first test set.", ""]


def build_tables(experiment: Experiment, cells: list[dict]) -> tuple[str, dict]:
    """results.md text and the results dict (with significance against the baseline)."""
    names = [v["name"] for v in experiment.variants]
    lines = [f"# Results: {experiment.name}", ""]
    results: dict = {"experiment": experiment.name, "alpha": experiment.alpha, "datasets": {}}
    for dataset in experiment.datasets:
        by_variant = {name: [c for c in cells if c["dataset"] == dataset.name
                             and c["variant"] == name] for name in names}
        dataset_result: dict = {"tests": {}, "variants": {}}
        for test in dataset.tests:
            test_lines, dataset_result["tests"][test] = _test_table(experiment, dataset, test,
                                                                    by_variant)
            lines += test_lines
        training_lines, dataset_result["variants"] = _training_table(experiment, dataset,
                                                                     by_variant)
        lines += training_lines + _legend(experiment.alpha)
        results["datasets"][dataset.name] = dataset_result
    return "\n".join(lines), results


_VALIDATE_LINE = re.compile(r"^validate step (\d+):.*?valid_bleu ([\d.]+)", re.MULTILINE)


def validation_curve(experiment: Experiment, cell: dict) -> list[tuple[int, float]]:
    """(step, validation BLEU) of a cell: from its summary, else parsed from its train.log."""
    history = cell["train"].get("validations")
    if history:
        return [(v["step"], v["valid_bleu"]) for v in history if "valid_bleu" in v]
    cell_dir = _cell_dir(experiment, cell["dataset"], cell["variant"], cell["seed"])
    run_dir = _run_dir(experiment, cell["dataset"], cell["variant"], cell["seed"])
    for log_file in (cell_dir / "train.log", run_dir / "train.log"):
        if log_file.is_file():
            points = {int(step): float(bleu) for step, bleu in
                      _VALIDATE_LINE.findall(log_file.read_text(encoding="utf-8"))}
            return sorted(points.items())
    return []


def plot_validation_curves(experiment: Experiment, cells: list[dict], path: Path) -> bool:
    """Validation BLEU against optimizer steps, one line per cell; False if nothing to plot."""
    curves = [(cell, validation_curve(experiment, cell)) for cell in cells]
    curves = [(cell, points) for cell, points in curves if len(points) >= 2]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v["name"] for v in experiment.variants]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for cell, points in curves:
        index = names.index(cell["variant"]) if cell["variant"] in names else 0
        seed_index = experiment.seeds.index(cell["seed"]) if cell["seed"] in experiment.seeds \
            else 0
        steps, bleu = zip(*points)
        axis.plot(steps, bleu, styles[seed_index % len(styles)],
                  color=colours[index % len(colours)], marker=".",
                  label=f"{cell['variant']} seed {cell['seed']}")
        best = cell["train"].get("best_step")
        if best in steps:
            axis.plot([best], [bleu[steps.index(best)]], "o", color=colours[index % len(colours)],
                      markersize=8, fillstyle="none")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("validation BLEU (greedy)")
    axis.set_title(f"{experiment.name}: validation curves (circle: best checkpoint)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _pid_alive(pid: int) -> bool:
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
                holder_alive = host != socket.gethostname() or _pid_alive(int(pid))
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


def _read_cells(experiment: Experiment, grid: list) -> list[dict]:
    """Every finished cell of the grid on disk (written by any worker), in grid order."""
    cells = []
    for dataset, variant, seed in grid:
        cell_file = _cell_dir(experiment, dataset.name, variant["name"], seed) / "cell.json"
        if cell_file.is_file():
            cells.append(json.loads(cell_file.read_text(encoding="utf-8")))
    return cells


def write_comparison(experiment: Experiment, cells: list[dict], baseline: str,
                     log=print) -> Path:
    """results.vs-BASELINE.md|json: the test tables against another variant of the grid."""
    markdown, results = build_tables(replace(experiment, baseline=baseline), cells)
    markdown = (f"> Every difference and mark here is against **{baseline}**; the grid's "
                f"baseline is {experiment.baseline} (results.md).\n\n" + markdown)
    results.update({"baseline": baseline, "commit": _git_commit(),
                    "experiment_file": str(experiment.path)})
    path = experiment.out / f"results.vs-{baseline}.md"
    _write_markdown_and_json(path, markdown, results)
    log(f"wrote {path} and {path.with_suffix('.json').name}")
    return path


def _write_markdown_and_json(markdown_path: Path, markdown: str, results: dict) -> None:
    """``NAME.md`` and, beside it, ``NAME.json``."""
    markdown_path.write_text(markdown, encoding="utf-8")
    markdown_path.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str),
                                                  encoding="utf-8")


def write_results(experiment: Experiment, grid: list, log=print,
                  extra_baselines: list[str] | None = None) -> dict:
    """(Re)write results.md and results.json from the finished cells on disk, and a
    comparison against each of ``extra_baselines`` (:func:`write_comparison`)."""
    cells = _read_cells(experiment, grid)
    for dataset in experiment.datasets:  # a fresh clone has the cells, not the prepared data
        if any(c["dataset"] == dataset.name for c in cells):
            _prepare_once(dataset, experiment.out, log)
    for baseline in extra_baselines or []:
        write_comparison(experiment, cells, baseline, log)
    markdown, results = build_tables(experiment, cells)
    if len(cells) < len(grid):
        markdown = (f"> Partial: {len(cells)} of {len(grid)} cells finished; rerun "
                    "`ranmt experiment` to complete the grid.\n\n" + markdown)
    results.update({"commit": _git_commit(), "experiment_file": str(experiment.path),
                    "experiment_config": yaml.safe_load(experiment.path.read_text()),
                    "complete": len(cells) == len(grid), "cells": cells})
    root = experiment.out
    for dataset in experiment.datasets:
        figure = root / f"validation_{dataset.name}.png"
        if plot_validation_curves(experiment, [c for c in cells if c["dataset"] == dataset.name],
                                  figure):
            markdown += (f"\nValidation curves of {dataset.name}: "
                         f"[{figure.name}]({figure.name})\n")
    _write_markdown_and_json(root / "results.md", markdown, results)
    log(f"wrote {root / 'results.md'} and {root / 'results.json'} "
        f"({len(cells)}/{len(grid)} cells)")
    return results


def _prepare_once(dataset: Dataset, root: Path, log) -> Path:
    """prepare_dataset under a lock, so that concurrent workers prepare a dataset once."""
    lock = root / "data" / f"{dataset.name}.lock"
    while not claim(lock):
        if (root / "data" / dataset.name / "meta.json").is_file():
            return root / "data" / dataset.name
        time.sleep(2.0)
    try:
        return prepare_dataset(dataset, root, log)
    finally:
        release(lock)


def _check_variant_names(experiment: Experiment, option: str, requested: list[str] | None):
    """ConfigError when ``requested`` (the names given to ``option``) are not all variants."""
    names = [v["name"] for v in experiment.variants]
    unknown = sorted(set(requested or []) - set(names))
    if unknown:
        raise ConfigError(f"{option}: {unknown} not in the grid; its variants are {names}")


def _select(experiment: Experiment, grid: list, variants: list[str] | None,
            seeds: list[int] | None) -> list:
    """The cells of ``grid`` this worker runs (``--variants`` / ``--seeds``)."""
    _check_variant_names(experiment, "--variants", variants)
    missing = sorted(set(seeds or []) - set(experiment.seeds))
    if missing:
        raise ConfigError(f"--seeds: {missing} not in the grid's seeds {experiment.seeds}")
    return [(d, v, s) for d, v, s in grid if (not variants or v["name"] in variants)
            and (not seeds or s in seeds)]


def run_experiment(path: str | Path, log=print, out: str | Path | None = None,
                   variants: list[str] | None = None, seeds: list[int] | None = None,
                   tables_only: bool = False,
                   reuse_from: list[str | Path] | None = None,
                   baselines: list[str] | None = None,
                   work: str | Path | None = None) -> dict:
    """Run (or resume) the whole grid, cooperating with other workers; return the results.

    ``out`` overrides the experiment file's output directory; ``variants`` / ``seeds``
    restrict the cells this call runs (the tables show every finished cell of the grid);
    ``tables_only`` trains nothing and rewrites the tables; ``reuse_from`` lists output
    folders of other grids whose finished cells are copied instead of trained where they
    are the very same training (:func:`find_reusable_cell`); ``baselines`` names variants
    to compare against besides the grid's baseline (:func:`write_comparison`); ``work``
    (default ``$RANMT_WORK_DIR``) keeps the cells' run folders outside ``out``
    (:func:`_run_dir`), where a fresh checkout of the grid finds and resumes them. A signal
    during training raises :class:`CellInterrupted` (a ``KeyboardInterrupt``) after the
    cell's checkpoint is saved and its lock released; the cell is not recorded as finished.
    """
    experiment = load_experiment(path)
    _check_variant_names(experiment, "--baseline", baselines)
    extra_baselines = [b for b in baselines or [] if b != experiment.baseline]
    reuse_from = [Path(folder) for folder in reuse_from or []]
    for folder in reuse_from:
        if not (folder / "runs").is_dir():
            raise ConfigError(f"--reuse {folder}: not a grid's output folder (no runs/ in it)")
    if out is not None:
        experiment.out = Path(out)
    work = work or os.environ.get(WORK_ENV) or None
    experiment.work = Path(work).expanduser().resolve() if work else None
    root = experiment.out
    root.mkdir(parents=True, exist_ok=True)
    # Seed-major: every variant's first seed runs before any second seed, so that a grid
    # cut short still compares every variant.
    grid = [(d, v, s) for d in experiment.datasets for s in experiment.seeds
            for v in experiment.variants]
    selected = [] if tables_only else _select(experiment, grid, variants, seeds)
    durations, elsewhere = [], []
    for index, (dataset, variant, seed) in enumerate(selected, 1):
        data_dir = _prepare_once(dataset, root, log)
        cell_dir = _cell_dir(experiment, dataset.name, variant["name"], seed)
        cell_file = cell_dir / "cell.json"
        label = f"cell {index}/{len(selected)}: {dataset.name} / {variant['name']} / seed {seed}"
        if cell_file.is_file():
            log(f"{label}: done, reusing {cell_file}")
            continue
        if not claim(cell_dir / "lock"):
            log(f"{label}: another worker is running it, skipping")
            elsewhere.append(label)
            continue
        try:
            if cell_file.is_file():  # finished by another worker just before we claimed it
                continue
            remaining = len(selected) - index + 1
            eta = (f", ETA {statistics.mean(durations) * remaining / 60:.0f} min for the "
                   f"{remaining} cells left (this worker)" if durations else "")
            reusable = find_reusable_cell(experiment, dataset, data_dir, variant, seed,
                                          reuse_from, log) if reuse_from else None
            if reusable is not None:
                adopt_cell(*reusable, dataset, variant, cell_dir)
                log(f"{label}: the same training as the finished cell {reusable[0]}, "
                    "reused (nothing trained)")
            else:
                run_dir = _run_dir(experiment, dataset.name, variant["name"], seed)
                if reuse_from and not step_checkpoints(run_dir):
                    found = _warm_start_if_possible(experiment, data_dir, variant, seed,
                                                    reuse_from, run_dir, log)
                    if found is not None:
                        log(f"{label}: warm start from {found[0]} (step {found[1]['step']}, "
                            "a step of this very training)")
                log(f"{label}: running{eta}")
                start = time.monotonic()
                run_cell(experiment, dataset, data_dir, variant, seed, cell_dir, log)
                durations.append(time.monotonic() - start)
        finally:
            release(cell_dir / "lock")
        write_results(experiment, grid, log, extra_baselines)
    if elsewhere:
        log(f"{len(elsewhere)} cell(s) are still running in other workers; the last worker "
            "to finish writes the complete tables")
    return write_results(experiment, grid, log, extra_baselines)
