"""The grid a YAML file describes: :class:`Experiment` (datasets x variants x seeds, the
shared overrides, decoding and significance settings), :class:`Dataset`, loading with
clear errors, and where each cell lives (``runs/DATASET/VARIANT/seedN/``, its run folder
inside it or under ``--work``). The file format is documented in docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ranmt.config import ConfigError

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


@dataclass(frozen=True)
class Variant:
    """One column of the tables: a name and the config overrides that make it."""

    name: str
    overrides: dict = field(default_factory=dict)


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

    def __post_init__(self):
        # a YAML mapping {name, overrides} becomes a Variant
        self.variants = [v if isinstance(v, Variant) else Variant(**v) for v in self.variants]


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
    names = [v.get("name") if isinstance(v, dict) else None for v in raw["variants"]]
    if len(set(names)) != len(names) or None in names:
        raise ConfigError(f"{path}: every variant needs a unique name")
    for entry in raw["variants"]:
        if set(entry) - {"name", "overrides"}:
            raise ConfigError(f"{path}: variant {entry['name']}: unknown key(s) "
                              f"{sorted(set(entry) - {'name', 'overrides'})}; a variant has "
                              "a name and overrides")
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


def _check_variant_names(experiment: Experiment, option: str, requested: list[str] | None):
    """ConfigError when ``requested`` (the names given to ``option``) are not all variants."""
    names = [v.name for v in experiment.variants]
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
    return [(d, v, s) for d, v, s in grid if (not variants or v.name in variants)
            and (not seeds or s in seeds)]
