"""The grid a YAML file describes: :class:`Experiment` (datasets x variants x seeds, the
shared overrides, decoding and significance settings), :class:`Dataset`, loading with
clear errors, and :class:`Cell`, one dataset x variant x seed of it: where it lives
(``runs/DATASET/VARIANT/seedN/``, its run folder inside it or under ``--work``), its
training config and its result. The file format is documented in docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ranmt.config import Config, ConfigError, DecodeConfig, decode_with, load_config

# Environment variable naming the work folder (``ranmt experiment --work``).
WORK_ENV = "RANMT_WORK_DIR"


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
    distill: dict | None = None
    """A distilled dataset: ``{teacher: {dataset, variant, seed}, decode: {...},
    chunk_lines, max_ratio, max_repeats}`` — the teacher cell's translations of its
    dataset's training split (``ranmt distill``), encoded with the teacher's SentencePiece
    models, its valid and test splits with their references (``cells.prepare_distilled``).
    The teacher's dataset comes earlier in the grid."""

    @property
    def references_from(self) -> str:
        """The dataset whose prepared test references score this one's cells: its own, or
        for a distilled dataset its teacher's (the same references, copied), which a fresh
        clone can prepare without the teacher's checkpoint."""
        return self.teacher_cell()[0] if self.distill is not None else self.name

    def teacher_cell(self) -> tuple[str, str, int]:
        """(dataset, variant, seed) of the teacher of a distilled dataset."""
        teacher = (self.distill or {}).get("teacher") or {}
        missing = sorted({"dataset", "variant", "seed"} - set(teacher))
        if missing:
            raise ConfigError(f"dataset {self.name}: distill.teacher needs {missing}")
        return str(teacher["dataset"]), str(teacher["variant"]), int(teacher["seed"])


@dataclass(frozen=True)
class Variant:
    """One column of the tables: a name and the config overrides that make it."""

    name: str
    overrides: dict = field(default_factory=dict)
    datasets: tuple[str, ...] | None = None
    """The datasets this variant runs on (None: every dataset of the grid)."""
    seeds: tuple[int, ...] | None = None
    """The seeds this variant runs with, a subset of the grid's (None: all of them): e.g. a
    teacher trained once for its students."""

    def runs_on(self, dataset: str, seed: int | None = None) -> bool:
        """Whether the variant has a cell on ``dataset`` (with ``seed``, when given)."""
        return ((self.datasets is None or dataset in self.datasets)
                and (seed is None or self.seeds is None or seed in self.seeds))


@dataclass(frozen=True)
class Comparison:
    """A table across datasets (or against one fixed cell): each cell of ``datasets`` x
    ``variants`` (None: all) against the cell ``against`` names, seed by seed on the test
    sets both share. ``against`` holds ``dataset`` / ``variant`` / ``seed``, each absent
    meaning the row's own: ``{dataset: original}`` is every variant against itself trained
    on another dataset (does distillation pay?), ``{dataset: original, variant: Teacher,
    seed: 1}`` every cell against one teacher."""

    name: str
    against: tuple[tuple[str, object], ...]
    datasets: tuple[str, ...] | None = None
    variants: tuple[str, ...] | None = None

    def against_cell(self, dataset: str, variant: str, seed: int) -> tuple[str, str, int]:
        """(dataset, variant, seed) of the cell a row's cell (dataset, variant, seed) is
        compared with."""
        against = dict(self.against)
        return (str(against.get("dataset", dataset)), str(against.get("variant", variant)),
                int(against.get("seed", seed)))

    @property
    def fixed_seed(self) -> bool:
        """Every seed is compared with one run (a teacher trained once): no Welch test."""
        return "seed" in dict(self.against)

    def covers(self, dataset: str, variant: str) -> bool:
        return ((self.datasets is None or dataset in self.datasets)
                and (self.variants is None or variant in self.variants))


@dataclass
class Experiment:
    name: str
    out: Path
    datasets: list[Dataset]
    variants: list[Variant]
    seeds: list[int]
    baseline: str
    base_config: str | None
    overrides: dict
    decode: dict
    bootstrap_samples: int = 1000
    alpha: float = 0.05
    path: Path | None = None
    work: Path | None = None  # run folders outside ``out`` (--work / RANMT_WORK_DIR)
    also_decode: dict[str, dict] = field(default_factory=dict)
    """Other decodings of every cell's checkpoint, by name: decoding options over
    ``decode`` and optionally ``quantize`` / ``precision`` / ``device`` (the copy decoded), e.g.
    ``{shortlist: {shortlist: true}, int8: {quantize: int8}}``; each is scored on every
    test set beside the grid's decode (``cells.decode_also``, cell.json's ``also_decode``).
    ``sweep: {FIELD: [values], ...}`` in a setting chooses those fields' values per cell on
    the valid split (``{valid-lenpen: {sweep: {lenpen: [0.6, 1.0, 2.0]}}}``)."""
    comparisons: list[Comparison] = field(default_factory=list)
    """Tables across datasets (``tables.comparison_tables``): distilled against original
    data, students against their teacher."""

    def __post_init__(self):
        # a YAML mapping {name, overrides} becomes a Variant
        self.variants = [v if isinstance(v, Variant) else Variant(**v) for v in self.variants]

    def cells(self) -> list[Cell]:
        """Every cell of the grid, seed-major: every variant's first seed comes before any
        second seed, so that a grid cut short still compares every variant."""
        return [Cell(self, d, v, s) for d in self.datasets for s in self.seeds
                for v in self.variants if v.runs_on(d.name, s)]

    def cell_dir(self, dataset: str, variant: str, seed: int) -> Path:
        """A cell's folder (cell.json, hypotheses, train.log) by names."""
        return self.out / "runs" / dataset / variant / f"seed{seed}"

    def run_dir(self, dataset: str, variant: str, seed: int) -> Path:
        """Where a cell trains (checkpoints, trainer state, train.log): ``<cell>/run``
        beside its cell.json, or under the work folder when one is set
        (:func:`work_run_dir`)."""
        cell_dir = self.cell_dir(dataset, variant, seed)
        if self.work is None:
            return cell_dir / "run"
        return work_run_dir(self.work, self.out, cell_dir.relative_to(self.out))

    def check_variant_names(self, option: str, requested: list[str] | None) -> None:
        """ConfigError when ``requested`` (the names given to ``option``) are not all
        variants of the grid."""
        names = [v.name for v in self.variants]
        unknown = sorted(set(requested or []) - set(names))
        if unknown:
            raise ConfigError(f"{option}: {unknown} not in the grid; its variants are {names}")

    def select(self, variants: list[str] | None, seeds: list[int] | None,
               datasets: list[str] | None = None) -> list[Cell]:
        """The cells this worker runs (``--variants`` / ``--seeds`` / ``--datasets``), in
        grid order."""
        self.check_variant_names("--variants", variants)
        missing = sorted(set(seeds or []) - set(self.seeds))
        if missing:
            raise ConfigError(f"--seeds: {missing} not in the grid's seeds {self.seeds}")
        names = [dataset.name for dataset in self.datasets]
        unknown = sorted(set(datasets or []) - set(names))
        if unknown:
            raise ConfigError(f"--datasets: {unknown} not in the grid's datasets {names}")
        return [cell for cell in self.cells() if (not variants or cell.variant.name in variants)
                and (not seeds or cell.seed in seeds)
                and (not datasets or cell.dataset.name in datasets)]


@dataclass(frozen=True, eq=False)
class Cell:
    """One dataset x variant x seed of a grid: its folders, its training config and (once
    finished) its result, ``cell.json``."""

    experiment: Experiment
    dataset: Dataset
    variant: Variant
    seed: int

    @property
    def label(self) -> str:
        return f"{self.dataset.name} / {self.variant.name} / seed {self.seed}"

    @property
    def dir(self) -> Path:
        """cell.json, the hypotheses (``TEST.hyp``) and train.log."""
        return self.experiment.cell_dir(self.dataset.name, self.variant.name, self.seed)

    @property
    def run_dir(self) -> Path:
        """Checkpoints and trainer state (see :meth:`Experiment.run_dir`)."""
        return self.experiment.run_dir(self.dataset.name, self.variant.name, self.seed)

    @property
    def file(self) -> Path:
        return self.dir / "cell.json"

    @property
    def lock(self) -> Path:
        """Held by the worker training the cell (``cells.claim``)."""
        return self.dir / "lock"

    @property
    def finished(self) -> bool:
        return self.file.is_file()

    def result(self) -> dict:
        """The finished cell's cell.json."""
        return json.loads(self.file.read_text(encoding="utf-8"))

    def config(self) -> Config:
        """The training config of the cell: base config, grid overrides, variant, seed."""
        overrides = {**self.experiment.overrides, **self.variant.overrides,
                     "train.seed": self.seed}
        return load_config(self.experiment.base_config,
                           {k: str(v) for k, v in overrides.items()})


def load_placed(path: str | Path, out: str | Path | None = None,
                work: str | Path | None = None) -> Experiment:
    """:func:`load_experiment` with ``out`` (when given) as its output folder and its work
    folder resolved: ``work``, else ``$RANMT_WORK_DIR``, else none."""
    experiment = load_experiment(path)
    if out is not None:
        experiment.out = Path(out)
    work = work or os.environ.get(WORK_ENV) or None
    experiment.work = Path(work).expanduser().resolve() if work else None
    return experiment


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file {path} does not exist")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    known = {"name", "out", "datasets", "variants", "seeds", "baseline", "base_config",
             "overrides", "decode", "bootstrap_samples", "alpha", "also_decode",
             "comparisons"}
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
    names = [v.get("name") if isinstance(v, dict) else None for v in raw["variants"]]
    if len(set(names)) != len(names) or None in names:
        raise ConfigError(f"{path}: every variant needs a unique name")
    dataset_names = [d.name for d in datasets]
    seeds = list(raw.get("seeds", [1, 2, 3]))
    variant_keys = {"name", "overrides", "datasets", "seeds"}
    for entry in raw["variants"]:
        if set(entry) - variant_keys:
            raise ConfigError(f"{path}: variant {entry['name']}: unknown key(s) "
                              f"{sorted(set(entry) - variant_keys)}; a variant has a name, "
                              "overrides and optionally datasets and seeds")
        if "seeds" in entry:
            outside = sorted(set(entry["seeds"]) - set(seeds))
            if outside or not entry["seeds"]:
                raise ConfigError(f"{path}: variant {entry['name']}: seeds "
                                  f"{outside or '[]'} are not a part of the grid's {seeds}")
            entry["seeds"] = tuple(entry["seeds"])
        if "datasets" in entry:
            unknown = sorted(set(entry["datasets"]) - set(dataset_names))
            if unknown:
                raise ConfigError(f"{path}: variant {entry['name']}: datasets {unknown} are "
                                  f"not in the grid ({dataset_names})")
            entry["datasets"] = tuple(entry["datasets"])
    _check_teachers(path, datasets, raw["variants"])
    _check_tests(path, datasets)
    baseline = raw.get("baseline", names[0])
    if baseline not in names:
        raise ConfigError(f"{path}: baseline '{baseline}' is not one of the variants {names}")
    return Experiment(
        name=raw.get("name", path.stem), out=Path(raw.get("out", f"experiments/{path.stem}")),
        datasets=datasets, variants=raw["variants"], seeds=seeds,
        baseline=baseline, base_config=raw.get("base_config"),
        overrides=dict(raw.get("overrides", {})), decode=dict(raw.get("decode", {})),
        bootstrap_samples=int(raw.get("bootstrap_samples", 1000)),
        alpha=float(raw.get("alpha", 0.05)), path=path,
        also_decode=_check_also_decode(path, raw.get("decode", {}), raw.get("also_decode")),
        comparisons=_check_comparisons(path, raw.get("comparisons"), dataset_names, names,
                                       seeds))


def _check_comparisons(path: Path, raw, datasets: list[str], variants: list[str],
                       seeds: list[int]) -> list[Comparison]:
    """The ``comparisons`` list, checked: unique names; ``against`` a mapping of at least
    one of dataset / variant / seed, naming the grid's datasets, variants and seeds; the
    optional ``datasets`` / ``variants`` filters naming the grid's."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: comparisons lists tables across datasets, e.g. "
                          "[{name: distillation, datasets: [distilled], against: "
                          "{dataset: original}}]")
    checked: list[Comparison] = []
    for entry in raw:
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ConfigError(f"{path}: every comparison needs a name")
        name = str(entry["name"])
        unknown = sorted(set(entry) - {"name", "against", "datasets", "variants"})
        if unknown:
            raise ConfigError(f"{path}: comparison {name}: unknown key(s) {unknown}; a "
                              "comparison has a name, against and optionally datasets and "
                              "variants")
        if name in [c.name for c in checked]:
            raise ConfigError(f"{path}: two comparisons are named {name}")
        against = entry.get("against")
        if not isinstance(against, dict) or not against or \
                set(against) - {"dataset", "variant", "seed"}:
            raise ConfigError(f"{path}: comparison {name}: against maps some of dataset, "
                              "variant and seed to the cell to compare with")
        known = {"dataset": datasets, "variant": variants, "seed": seeds}
        for key, value in against.items():
            if value not in known[key]:
                raise ConfigError(f"{path}: comparison {name}: against.{key} {value!r} is "
                                  f"not one of the grid's {known[key]}")
        for key, grid_names in (("datasets", datasets), ("variants", variants)):
            outside = sorted(set(entry.get(key) or []) - set(grid_names))
            if outside:
                raise ConfigError(f"{path}: comparison {name}: {key} {outside} are not in "
                                  f"the grid ({grid_names})")
        checked.append(Comparison(
            name, tuple(sorted(against.items())),
            tuple(entry["datasets"]) if entry.get("datasets") else None,
            tuple(entry["variants"]) if entry.get("variants") else None))
    return checked


# keys of ``decode`` / ``also_decode`` that choose where and which copy of the model is
# decoded (Translator.load's), not decoding options; None: any value
LOAD_OPTIONS = {"device": None, "quantize": ("none", "int8"), "precision": ("fp32", "bf16")}


def _check_also_decode(path: Path, decode: dict, raw) -> dict[str, dict]:
    """The ``also_decode`` mapping, checked: names usable in file names (``TEST.NAME.hyp``),
    every entry a mapping of known decoding options (valid over the grid's ``decode``) and
    load options (:data:`LOAD_OPTIONS`)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: also_decode maps names to decoding options, e.g. "
                          "{shortlist: {shortlist: true}}")
    checked = {}
    for name, options in raw.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", str(name)):
            raise ConfigError(f"{path}: also_decode name '{name}': use letters, digits, _ "
                              "and - (it names the hypothesis files)")
        if not isinstance(options, dict) or not options:
            raise ConfigError(f"{path}: also_decode.{name} must map at least one option to "
                              "its value")
        for key, allowed in LOAD_OPTIONS.items():
            if key in options and allowed is not None and options[key] not in allowed:
                raise ConfigError(f"{path}: also_decode.{name}.{key}: {options[key]!r} is "
                                  f"not one of {list(allowed)}")
        if options.get("precision") == "bf16" and options.get("quantize", "none") != "none":
            raise ConfigError(f"{path}: also_decode.{name}: bf16 and int8 are alternatives")
        checked[str(name)] = dict(options)
        if SWEEP_KEY in options:
            checked[str(name)][SWEEP_KEY] = _check_sweep(path, name, options)
        decoding = {k: v for k, v in {**decode, **options}.items()
                    if k not in LOAD_OPTIONS and k != SWEEP_KEY}
        try:
            decode_with(DecodeConfig(), **decoding)
        except ConfigError as err:
            raise ConfigError(f"{path}: also_decode.{name}: {err}") from None
    return checked


def flow(options: dict) -> str:
    """Options as a YAML flow mapping, as the experiment file writes them: {beam: 4}."""
    def text(value) -> str:
        if isinstance(value, dict):
            return flow(value)
        if isinstance(value, list):
            return "[" + ", ".join(text(item) for item in value) + "]"
        return str(value).lower() if isinstance(value, bool) else str(value)

    return "{" + ", ".join(f"{key}: {text(value)}" for key, value in options.items()) + "}"


SWEEP_KEY = "sweep"
"""An ``also_decode`` setting's key for a value chosen on the valid split:
``{sweep: {lenpen: [0.6, 1.0, 2.0]}}`` (ranmt.inference.sweep; ``cells.decode_also``)."""


def _check_sweep(path: Path, name: str, options: dict) -> dict[str, list]:
    """``also_decode.NAME.sweep``: sweepable fields mapped to lists of their values (several:
    every combination), none also set by the same setting."""
    from ranmt.inference.sweep import checked_values, sweepable_fields

    where = f"{path}: also_decode.{name}.{SWEEP_KEY}"
    raw = options[SWEEP_KEY]
    if not isinstance(raw, dict) or not raw or not all(
            isinstance(values, list) for values in raw.values()):
        raise ConfigError(f"{where} maps fields of {list(sweepable_fields())} to lists of "
                          "values, e.g. {lenpen: [0.6, 1.0, 2.0]}")
    checked = {}
    for field_name, values in raw.items():
        if field_name in options:
            raise ConfigError(f"{where}: {field_name} is both swept and set to "
                              f"{options[field_name]!r}; give one")
        checked[field_name] = checked_values(field_name, values, where)
    return checked


def _check_teachers(path: Path, datasets: list[Dataset], variants: list[dict]) -> None:
    """Every distilled dataset's teacher is a cell of the grid on an earlier dataset."""
    seen: list[str] = []
    for dataset in datasets:
        if dataset.distill is not None:
            unknown = sorted(set(dataset.distill) - {"teacher", "decode", "chunk_lines",
                                                     "max_ratio", "max_repeats"})
            if unknown:
                raise ConfigError(f"{path}: dataset {dataset.name}: unknown distill key(s) "
                                  f"{unknown}")
            source, variant, seed = dataset.teacher_cell()
            if source not in seen:
                raise ConfigError(f"{path}: dataset {dataset.name} is distilled from dataset "
                                  f"'{source}', which must come before it in the grid")
            _inherit_tests(path, dataset, next(d for d in datasets if d.name == source))
            entry = next((v for v in variants if v.get("name") == variant), None)
            if entry is None or source not in entry.get("datasets", (source,)):
                raise ConfigError(f"{path}: dataset {dataset.name}: the teacher variant "
                                  f"'{variant}' does not run on dataset '{source}'")
            if seed not in entry.get("seeds", (seed,)):
                raise ConfigError(f"{path}: dataset {dataset.name}: the teacher variant "
                                  f"'{variant}' does not run with seed {seed}")
        seen.append(dataset.name)


def _check_tests(path: Path, datasets: list[Dataset]) -> None:
    """Every dataset has test sets to score its cells on: those it lists, a WMT download's
    official test set when it lists none (what ``download_wmt`` prepares), a distilled
    dataset's teacher dataset's (:func:`_inherit_tests`); none at all is an error (its
    cells would train and be scored on nothing)."""
    from ranmt.data.download import DownloadError
    from ranmt.data.wmt import available, find_task

    for dataset in datasets:
        kind = (dataset.download or {}).get("dataset")
        if not dataset.tests and kind in available():
            try:
                task, _ = find_task(kind, dataset.download.get(
                    "pair", f"{dataset.src}-{dataset.tgt}"))
            except DownloadError as err:
                raise ConfigError(f"{path}: dataset {dataset.name}: {err}") from None
            dataset.tests = {task.test[0]: task.test[0]}
        if not dataset.tests:
            raise ConfigError(f"{path}: dataset {dataset.name} lists no test sets (tests: "
                              "[NAME, ...] or {NAME: PREFIX}): its cells would be scored on "
                              "nothing")


def _inherit_tests(path: Path, dataset: Dataset, source: Dataset) -> None:
    """A distilled dataset is scored on its teacher dataset's test sets (their sources and
    human references, copied by ``cells.prepare_distilled``): all of them when it lists
    none, else the ones it lists, which must be among them."""
    if not dataset.tests:
        dataset.tests = {name: name for name in source.tests}
        return
    unknown = sorted(set(dataset.tests) - set(source.tests))
    if unknown:
        raise ConfigError(f"{path}: dataset {dataset.name}: test sets {unknown} are not "
                          f"test sets of its teacher's dataset {source.name} "
                          f"({sorted(source.tests)}); a distilled dataset is scored on those")
    dataset.tests = {name: name for name in dataset.tests}


def git_commit() -> str | None:
    """The checkout's commit (recorded in results.json), None outside git."""
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10)
    except OSError:
        return None
    return result.stdout.strip() or None


def grid_work_dir(work: Path, out: Path) -> Path:
    """A grid's folder under the work folder: ``WORK/<out's folder name>``, shared by every
    checkout of the grid."""
    return work / out.resolve().name


def work_run_dir(work: Path, out: Path, cell_path: Path) -> Path:
    """A run folder under the work folder: ``WORK/<out's folder name>/runs/<dataset>/
    <variant>/seed<N>/run``, so that two checkouts of one grid share their run folders."""
    return grid_work_dir(work, out) / cell_path / "run"


def source_run_dir(source: Path, cell_dir: Path, work: Path | None) -> Path:
    """The run folder of a finished cell of another grid (``--reuse``): beside it, else
    under the work folder."""
    beside = cell_dir / "run"
    if work is None or beside.is_dir():
        return beside
    return work_run_dir(work, source, cell_dir.relative_to(source))
