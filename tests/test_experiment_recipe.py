"""One recipe per grid (ranmt.experiment.recipe): a cell about to train with a training, data
or decoding setting other than the grid's finished cells of its dataset is named, in the
run's log and in ``--dry-run``; what the variants set, the seed and the precision are not."""

from __future__ import annotations

import json

import yaml

import ranmt.experiment as experiment_module
from conftest import reverse_task, write_parallel
from ranmt.cli import main
from ranmt.experiment import Cell, expected_cell_config, load_experiment
from ranmt.experiment.preparation import prepare_once
from ranmt.experiment.recipe import flatten, recipe_differences


def _grid(tmp_path, overrides: dict) -> object:
    for name, count, seed in (("train", 300, 0), ("valid", 20, 1), ("test", 20, 2)):
        write_parallel(tmp_path / name, *reverse_task(count, seed))
    config = {
        "name": "tiny", "out": str(tmp_path / "exp"), "seeds": [1, 2],
        "baseline": "TransF", "overrides": {"model.preset": "tiny", **overrides},
        "decode": {"beam": 2},
        "datasets": [{"name": "reverse", "src": "src", "tgt": "tgt",
                      "train": str(tmp_path / "train"), "valid": str(tmp_path / "valid"),
                      "tests": {"test": str(tmp_path / "test")}, "vocab_size": 40}],
        "variants": [{"name": "TransF", "overrides": {"model.arch": "transf"}},
                     {"name": "RAN-ALL", "overrides": {"model.arch": "ran-all",
                                                       "train.label_smoothing": 0.2}}],
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _finish_as_before(cell: Cell, data_dir, **changes) -> None:
    """Write ``cell``'s cell.json as a cell trained with ``changes`` (dotted key -> value)
    to what it would record now, seed and precision of its own."""
    config = expected_cell_config(cell, data_dir)
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        config[section][key] = value
    precision = {"fp32": "bf16", "bf16": "fp32"}[config["train"]["precision"]]
    cell.dir.mkdir(parents=True, exist_ok=True)
    cell.file.write_text(json.dumps({"dataset": cell.dataset.name, "variant": cell.variant.name,
                                     "seed": cell.seed, "config": config,
                                     "train": {"precision": precision}, "tests": {}}))


def test_flatten_keeps_lists_and_empty_sections_whole():
    assert flatten({"train": {"lr": 1, "a": {"b": [1, 2]}}, "x": {}}) == {
        "train.lr": 1, "train.a.b": [1, 2], "x": {}}


def test_a_cell_with_another_recipe_than_the_finished_cells_is_named(tmp_path, capsys):
    """The finished TransF seed 1 trained with data.pool_batches 0 and label smoothing 0.3
    (a default changed since; RAN-ALL sets its own smoothing): RAN-ALL seed 2 is told about
    the batching only, in the run's log and in --dry-run; with the batching in the grid's
    overrides nothing is said."""
    path = _grid(tmp_path, {})
    experiment = load_experiment(path)
    dataset = experiment.datasets[0]
    data_dir = prepare_once(dataset, experiment.out, lambda *_: None, experiment)
    transf, ran = experiment.variants
    _finish_as_before(Cell(experiment, dataset, transf, 1), data_dir,
                      **{"data.pool_batches": 0, "train.label_smoothing": 0.3})
    grid = experiment.cells()
    finished = [cell.result() for cell in grid if cell.finished]
    ran_seed2 = Cell(experiment, dataset, ran, 2)
    assert recipe_differences(ran_seed2, data_dir, finished) == {
        "data.pool_batches": (8, ["0"], 1)}
    # TransF sets no smoothing of its own: its next seed is told about both
    assert set(recipe_differences(Cell(experiment, dataset, transf, 2), data_dir, finished)) \
        == {"data.pool_batches", "train.label_smoothing"}

    said: list[str] = []
    experiment_module._warn_if_another_recipe(ran_seed2, grid, data_dir, "cell 1/1", said.append)
    assert said == ["cell 1/1: trains with data.pool_batches=8 where 1 of the 1 finished cells "
                    "recorded 0; the tables will compare two recipes (set these in the grid's "
                    "overrides to train every cell one way)"]
    capsys.readouterr()
    main(["experiment", str(path), "--dry-run"])
    printed = capsys.readouterr().out
    assert ("recipe: RAN-ALL would train with data.pool_batches=8 where 1 of the 1 finished "
            "cells recorded 0") in printed

    fixed = _grid(tmp_path, {"data.pool_batches": 0, "train.label_smoothing": 0.3})
    experiment = load_experiment(fixed)
    assert recipe_differences(Cell(experiment, dataset, ran, 2), data_dir, finished) == {}
    said.clear()
    experiment_module._warn_if_another_recipe(Cell(experiment, dataset, transf, 2),
                                              experiment.cells(), data_dir, "c", said.append)
    assert said == []
    main(["experiment", str(fixed), "--dry-run"])
    assert "recipe:" not in capsys.readouterr().out
