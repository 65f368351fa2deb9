"""One recipe per grid: before a cell trains, the training, data and decoding settings it
would record are compared with those of the grid's finished cells of its dataset, leaving
out what the variants themselves set and what is each cell's own (its seed; its precision,
which :func:`ranmt.experiment._warn_if_another_precision` reports). A difference —
typically a default that changed between the sessions a grid trained in, e.g.
``data.pool_batches`` 0 -> 8 on 2026-11-28 — would otherwise put two trainings side by side
in one table without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ranmt.experiment.reuse import expected_cell_config, recorded_config
from ranmt.experiment.spec import Cell

RECIPE_SECTIONS = ("train", "data", "decode")
"""The config sections that make a grid's recipe (``model`` is what the variants vary)."""

OWN_TO_EACH_CELL = frozenset({"train.seed", "train.precision"})
"""Dotted keys that differ between a grid's cells by design (the precision: its own
warning)."""


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; lists and other values kept whole."""
    flat = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _set_by_variants(cell: Cell, other_variant: str | None) -> set[str]:
    """Dotted keys that ``cell``'s variant or the grid's variant named ``other_variant``
    override (and what lies under them)."""
    return {key for variant in cell.experiment.variants
            if variant.name in (cell.variant.name, other_variant)
            for key in variant.overrides}


def _compared(key: str, varied: set[str]) -> bool:
    return (key.split(".", 1)[0] in RECIPE_SECTIONS and key not in OWN_TO_EACH_CELL
            and not any(key == v or key.startswith(v + ".") for v in varied))


def recipe_differences(cell: Cell, data_dir: Path, finished: list[dict]) -> dict[str, tuple]:
    """Dotted key -> (the value ``cell`` trains with, sorted JSON texts of the values the
    grid's finished cells of its dataset recorded, how many of them differ) for every
    recipe setting (:data:`RECIPE_SECTIONS`, less :data:`OWN_TO_EACH_CELL` and the keys
    that either cell's variant sets) where ``cell`` differs from at least one of them.
    ``finished``: the grid's finished cells' cell.json contents."""
    ours = flatten(expected_cell_config(cell, data_dir))
    differences: dict[str, tuple] = {}
    for result in finished:
        if result.get("dataset") != cell.dataset.name or "config" not in result:
            continue
        varied = _set_by_variants(cell, result.get("variant"))
        theirs = flatten(recorded_config(result))
        for key in sorted(ours.keys() | theirs.keys()):
            if not _compared(key, varied) or ours.get(key) == theirs.get(key):
                continue
            _, values, count = differences.get(key, (None, set(), 0))
            values.add(json.dumps(theirs.get(key)))
            differences[key] = (ours.get(key), values, count + 1)
    return {key: (value, sorted(values), count)
            for key, (value, values, count) in differences.items()}


def describe_differences(differences: dict[str, tuple], finished: int) -> str:
    """One clause per setting: ``data.pool_batches=8 where 12 of the 12 finished cells
    recorded 0``."""
    return "; ".join(
        f"{key}={json.dumps(value)} where {count} of the {finished} finished cells recorded "
        f"{' / '.join(values)}" for key, (value, values, count) in differences.items())
