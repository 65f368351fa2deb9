"""The grid a YAML file describes: :class:`Experiment` (datasets x variants x seeds, the
shared overrides, decoding and significance settings), :class:`Dataset`, loading with
clear errors, and :class:`Cell`, one dataset x variant x seed of it: where it lives
(``runs/DATASET/VARIANT/seedN/``, its run folder inside it or under ``--work``), its
training config and its result. The file format is documented in docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ranmt.config import Config, ConfigError, load_config

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
    rouge_references: str = "max"
    """Test sets with several references (``PREFIX.TGT2``, ``PREFIX.TGT3``, ... beside
    ``PREFIX.TGT``, e.g. DialogSum's): a line's ROUGE is the best over them (max,
    rouge-score's ``score_multi``) or their mean; BLEU / chrF / TER take them all."""
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


@dataclass(frozen=True)
class Reported:
    """Scores a paper reports for some of the grid's variants (``reported`` in the grid
    file), shown beside the grid's own (:mod:`ranmt.experiment.reported`): ``scores`` maps
    the grid's variant names to the paper's ``metric`` (a key of the dataset's metrics:
    ``bleu`` is SacreBLEU), ``baseline`` is the variant both differences are taken to,
    ``source`` says where the numbers come from (paper, table, corpus, model)."""

    name: str
    source: str
    dataset: str
    baseline: str
    scores: tuple[tuple[str, float], ...]
    metric: str = "bleu"


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
    reported: list[Reported] = field(default_factory=list)
    """A paper's numbers beside the grid's (``reported.reported_tables``)."""

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


LOAD_OPTIONS = {"device": None, "quantize": ("none", "int8"), "precision": ("fp32", "bf16")}


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
