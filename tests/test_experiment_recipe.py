"""One recipe per grid (ranmt.experiment.recipe): a cell about to train with a training, data
or decoding setting other than the grid's finished cells of its dataset is named, in the
run's log and in ``--dry-run``; what the variants set, the seed and the precision are not.
And results.md says when the cost columns mix machines or thread counts
(ranmt.experiment.results.machine_note)."""

from __future__ import annotations

import json

import yaml

import ranmt.experiment as experiment_module
from conftest import reverse_task, write_parallel
from ranmt.cli import main
from ranmt.experiment import Cell, expected_cell_config, load_experiment
from ranmt.experiment.preparation import prepare_once
from ranmt.experiment.recipe import flatten, recipe_differences
from ranmt.experiment.results import machine_note


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


def test_results_say_when_cost_columns_mix_machines_or_thread_counts():
    """Two CPUs, or one CPU at 2 and at 1 thread: a note naming each group's cells (counted
    past four); one kind of machine, or cells from before the machine was recorded: none."""
    def cell(variant, seed, cpu="AMD EPYC; avx512_bf16", threads=2, **extra):
        machine = {"cpu": cpu, "device": "cpu", "cores": 2, "threads": threads, **extra}
        return {"dataset": "d", "variant": variant, "seed": seed, "machine": machine}

    same = [cell("TransF", 1), cell("RAN", 1), {"dataset": "d", "variant": "old", "seed": 1}]
    assert machine_note(same) == ""
    mixed = same + [cell("RAN", 2, threads=1)]
    assert machine_note(mixed) == (
        "> Not every cell finished on the same kind of machine (AMD EPYC; avx512_bf16, 2 "
        "threads: d / TransF / seed 1; d / RAN / seed 1 | AMD EPYC; avx512_bf16, 1 thread: "
        "d / RAN / seed 2; where its last training run and its decoding ran): compare the "
        "cost columns only within a group.\n\n")
    many = [cell("TransF", seed) for seed in range(5)] + [cell("G", 1, gpu="NVIDIA H200")]
    assert "2 threads: 5 cells | AMD EPYC; avx512_bf16, 2 threads, NVIDIA H200: d / G / " \
        "seed 1;" in machine_note(many)
