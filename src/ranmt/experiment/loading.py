"""Loading a grid's YAML file into an :class:`ranmt.experiment.spec.Experiment`, with an
error naming the file and the key for anything wrong in it: datasets (their tests, teachers
of distilled data), variants, seeds, the baseline, ``also_decode`` settings (load options,
sweeps) and ``comparisons``. The file format is documented in docs/EXPERIMENTS.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from ranmt.config import ConfigError, DecodeConfig, decode_with
from ranmt.evaluate import ROUGE_REFERENCE_RULES, TASK_METRICS
from ranmt.experiment.spec import (
    LOAD_OPTIONS,
    SWEEP_KEY,
    WORK_ENV,
    Comparison,
    Dataset,
    Experiment,
    Reported,
)


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
             "comparisons", "reported"}
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
        if datasets[-1].rouge_references not in ROUGE_REFERENCE_RULES:
            raise ConfigError(f"{path}: dataset {datasets[-1].name}: rouge_references must be "
                              f"one of {', '.join(ROUGE_REFERENCE_RULES)}")
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
                                       seeds),
        reported=_check_reported(path, raw.get("reported"), datasets, names, baseline))


def _check_reported(path: Path, raw, datasets: list[Dataset], variants: list[str],
                    baseline: str) -> list[Reported]:
    """The ``reported`` list, checked: unique names, a source, scores (numbers) for variants
    of the grid including the entry's baseline (default: the grid's), a dataset of the grid
    (default: the first) and one of its metrics (default ``bleu``, SacreBLEU)."""
    if raw is None:
        return []
    example = ("[{name: RAN paper Table 2, source: 'Zeng et al. 2021, WMT14 En-De', "
               "scores: {TransF: 27.12, RAN-ALL: 27.87}}]")
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: reported lists a paper's numbers, e.g. {example}")
    checked: list[Reported] = []
    for entry in raw:
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("source"):
            raise ConfigError(f"{path}: every reported entry needs a name and a source, e.g. "
                              f"{example}")
        name = str(entry["name"])
        unknown = sorted(set(entry) - {"name", "source", "dataset", "baseline", "scores",
                                       "metric"})
        if unknown or name in [r.name for r in checked]:
            raise ConfigError(f"{path}: reported {name}: " + (
                f"unknown key(s) {unknown}" if unknown else "two entries have this name"))
        dataset = str(entry.get("dataset", datasets[0].name))
        by_name = {d.name: d for d in datasets}
        if dataset not in by_name:
            raise ConfigError(f"{path}: reported {name}: dataset {dataset} is not in the grid")
        metric = str(entry.get("metric", "bleu"))
        if metric not in TASK_METRICS[by_name[dataset].task]:
            raise ConfigError(f"{path}: reported {name}: metric {metric} is not one of "
                              f"{TASK_METRICS[by_name[dataset].task]}")
        scores = entry.get("scores")
        entry_baseline = str(entry.get("baseline", baseline))
        if not isinstance(scores, dict) or entry_baseline not in scores or any(
                isinstance(v, bool) or not isinstance(v, int | float) for v in scores.values()):
            raise ConfigError(f"{path}: reported {name}: scores maps variants to numbers, "
                              f"the baseline {entry_baseline} among them")
        outside = sorted(set(scores) - set(variants))
        if outside:
            raise ConfigError(f"{path}: reported {name}: {outside} are not variants of the "
                              f"grid ({variants})")
        checked.append(Reported(name, str(entry["source"]), dataset, entry_baseline,
                                tuple((str(k), float(v)) for k, v in scores.items()), metric))
    return checked


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

