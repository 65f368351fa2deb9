"""``ranmt experiment GRID --dry-run``: the plan of a grid, every cell checked, nothing run.

For each cell (dataset x variant x seed) it resolves the training config exactly as the
runner will (base config, grid overrides, variant, seed), builds the model to count its
parameters (vocabulary sizes from the prepared data when it exists, else the dataset's
``vocab_size``) and reports the tokens one optimizer step takes per rank. It also checks
that each dataset can be had: a ``download`` the toolkit knows (dataset and pair), or
training/validation/test prefixes (missing files are reported, not fatal: a grid is often
checked before its corpora are copied to the machine that runs it). Any cell whose config
or model is invalid is an error that names it, so a grid for a GPU cluster can be checked
on a laptop before the first hour of GPU time is spent.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ranmt.config import ConfigError
from ranmt.data.corpus import fill_config_from_data
from ranmt.data.download import DownloadError
from ranmt.data.stream import resolve
from ranmt.data.wmt import available, find_task
from ranmt.experiment.loading import load_experiment
from ranmt.experiment.recipe import describe_differences, recipe_differences
from ranmt.experiment.spec import SWEEP_KEY, Cell, flow
from ranmt.model import build_model, count_parameters


def _dataset_notes(dataset, root: Path) -> list[str]:
    """What a dry run can say of a dataset's inputs (errors raise ConfigError)."""
    if dataset.distill is not None:
        source, variant, seed = dataset.teacher_cell()
        return [f"distilled: the translations of {source}'s training data by the cell "
                f"{source} / {variant} / seed {seed} once it has finished; scored on "
                f"{', '.join(dataset.tests) or 'no test set'}"]
    if dataset.download:
        spec = dict(dataset.download)
        name = spec.get("dataset", "multi30k")
        if name == "multi30k":
            return [f"downloads multi30k {spec.get('pair', f'{dataset.src}-{dataset.tgt}')}"]
        if name == "dialogsum":
            return ["reads DialogSum (train / dev / test with its three references; a "
                    f"line's ROUGE is the {dataset.rouge_references} over them) from "
                    "RANMT_DATA_DIR or the spec's `from`"]
        if name not in available():
            raise ConfigError(f"dataset {dataset.name}: cannot download '{name}' (available: "
                              f"multi30k, dialogsum, {', '.join(available())})")
        pair = spec.get("pair", f"{dataset.src}-{dataset.tgt}")
        try:
            task, _ = find_task(name, pair)
        except DownloadError as err:
            raise ConfigError(f"dataset {dataset.name}: {err}") from None
        return [f"downloads {name} {pair}: train {', '.join(c.name for c in task.train)}; "
                f"valid {task.valid[0]}; test {task.test[0]}"]
    notes = []
    prefixes = ([dataset.train] if isinstance(dataset.train, str) else list(dataset.train))
    prefixes += [dataset.valid, *dataset.tests.values()]
    for prefix in prefixes:
        for lang in (dataset.src, dataset.tgt):
            if not resolve(f"{prefix}.{lang}").is_file():
                notes.append(f"missing {prefix}.{lang} (give it before running)")
    prepared = root / "data" / dataset.name / "meta.json"
    notes.append(f"prepared data: {'present' if prepared.is_file() else 'not yet'}")
    return notes


def _cell_plan(cell: Cell, root: Path, parameters: int | None = None) -> dict:
    """One cell's resolved config and model size (ConfigError names the cell);
    ``parameters`` given: the model of another seed of the variant (the seed changes no
    shape), not built again."""
    dataset, variant, seed, label = cell.dataset, cell.variant, cell.seed, cell.label
    try:
        cfg = cell.config()
        prepared = root / "data" / dataset.name
        if (prepared / "meta.json").is_file():
            fill_config_from_data(cfg, prepared)
        else:
            cfg.model.src_vocab_size = cfg.model.tgt_vocab_size = dataset.vocab_size
            cfg.model.joint_vocab = dataset.joint
        if parameters is None:
            with torch.device("meta"):  # shapes only: no memory, no initialisation cost
                parameters = count_parameters(build_model(cfg.model))["total"]
    except (ConfigError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"cell {label}: {err}") from None
    t = cfg.train
    return {"cell": label, "dataset": dataset.name, "variant": variant.name, "seed": seed,
            "arch": cfg.model.arch, "preset": cfg.model.preset, "parameters": parameters,
            "tokens_per_step_per_rank": cfg.data.max_tokens * t.accumulation,
            "max_steps": t.max_steps, "max_time": t.max_time,
            "validate_every": t.validate_every, "patience": t.patience,
            "precision": t.precision, "lr": t.lr, "warmup_steps": t.warmup_steps}


def _recipe_notes(experiment, dataset, log) -> list[str]:
    """Where a variant's next cell would train with another recipe than the dataset's
    finished cells (:func:`~.recipe.recipe_differences`; needs the prepared data)."""
    data_dir = experiment.out / "data" / dataset.name
    cells = [cell for cell in experiment.cells() if cell.dataset.name == dataset.name]
    finished = [cell.result() for cell in cells if cell.finished]
    if not finished or not (data_dir / "meta.json").is_file():
        return []
    notes, checked = [], set()
    for cell in cells:
        if cell.finished or cell.variant.name in checked:
            continue
        checked.add(cell.variant.name)
        differences = recipe_differences(cell, data_dir, finished)
        if differences:
            notes.append(f"{cell.variant.name} would train with "
                         f"{describe_differences(differences, len(finished))}")
            log(f"recipe: {notes[-1]}")
    return notes


def plan_experiment(path: str | Path, out: str | Path | None = None, log=print) -> dict:
    """Check every cell of the grid ``path`` and print its plan; return it."""
    experiment = load_experiment(path)
    if out is not None:
        experiment.out = Path(out)
    root = experiment.out
    log(f"grid {experiment.name}: {len(experiment.datasets)} dataset(s) x "
        f"{len(experiment.variants)} variant(s) x {len(experiment.seeds)} seed(s): "
        f"{len(experiment.cells())} cells -> {root}")
    plan = {"name": experiment.name, "out": str(root), "datasets": {}, "cells": [],
            "decode": experiment.decode, "also_decode": experiment.also_decode}
    decode = flow(experiment.decode) if experiment.decode else "the defaults"
    log(f"every cell decodes its test sets with {decode}"
        + "".join(f"; also as '{name}' ({flow(options)}"
                  + (", chosen on valid per cell" if SWEEP_KEY in options else "") + ")"
                  for name, options in experiment.also_decode.items()))
    for comparison in experiment.comparisons:
        rows = (f"{', '.join(comparison.variants) if comparison.variants else 'every variant'}"
                f" on {', '.join(comparison.datasets) if comparison.datasets else 'every dataset'}")
        log(f"comparison '{comparison.name}': {rows} against "
            + ", ".join(f"{key} {value}" for key, value in comparison.against)
            + " (seed by seed, on the test sets they share)")
    plan["comparisons"] = [comparison.name for comparison in experiment.comparisons]
    for dataset in experiment.datasets:
        notes = _dataset_notes(dataset, root)
        log(f"dataset {dataset.name} ({dataset.src}->{dataset.tgt}, vocabulary "
            f"{dataset.vocab_size}{' joint' if dataset.joint else ''}): {'; '.join(notes)}")
        sizes: dict[str, dict] = {}
        for variant in experiment.variants:
            if not variant.runs_on(dataset.name):
                continue
            for seed in (s for s in experiment.seeds if variant.runs_on(dataset.name, s)):
                known = sizes.get(variant.name, {}).get("parameters")
                cell = _cell_plan(Cell(experiment, dataset, variant, seed), root, known)
                plan["cells"].append(cell)
                sizes.setdefault(variant.name, cell)
        log(f"{'variant':<14} {'arch':<8} {'parameters':>12} {'tokens/step/rank':>17} "
            f"{'max steps':>10} {'validate':>9} {'precision':>9}")
        for name, cell in sizes.items():
            log(f"{name:<14} {cell['arch']:<8} {cell['parameters']:>12,} "
                f"{cell['tokens_per_step_per_rank']:>17,} {cell['max_steps'] or '-':>10} "
                f"{cell['validate_every']:>9} {cell['precision']:>9}")
        plan["datasets"][dataset.name] = notes + _recipe_notes(experiment, dataset, log)
    log(f"every cell checked ({len(plan['cells'])}); nothing was trained")
    return plan
