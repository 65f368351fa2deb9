"""results.md / results.json (and results.vs-NAME.* for other baselines), rewritten after
every cell, and the validation curves (``validation_<dataset>.png``).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import yaml

from ranmt.experiment.bootstrap_cache import cache_path, cached_bootstraps
from ranmt.experiment.preparation import prepare_once
from ranmt.experiment.reported import reported_tables
from ranmt.experiment.spec import Cell, Experiment, git_commit
from ranmt.experiment.table_parts import valid_metric_name
from ranmt.experiment.tables import build_tables

_VALIDATE_LINE = re.compile(r"^validate step (\d+):.*?valid_bleu ([\d.]+)", re.MULTILINE)


def validation_curve(experiment: Experiment, cell: dict) -> list[tuple[int, float]]:
    """(step, validation score) of a cell, the score that chose its best checkpoint
    (``train.valid_metric``): from its summary, else (BLEU) parsed from its train.log."""
    history = cell["train"].get("validations")
    if history:
        key = f"valid_{cell['train'].get('valid_metric', 'bleu')}"
        return [(v["step"], v[key]) for v in history if key in v]
    names = (cell["dataset"], cell["variant"], cell["seed"])
    cell_dir, run_dir = experiment.cell_dir(*names), experiment.run_dir(*names)
    for log_file in (cell_dir / "train.log", run_dir / "train.log"):
        if log_file.is_file():
            points = {int(step): float(bleu) for step, bleu in
                      _VALIDATE_LINE.findall(log_file.read_text(encoding="utf-8"))}
            return sorted(points.items())
    return []


def plot_validation_curves(experiment: Experiment, cells: list[dict], path: Path) -> bool:
    """Validation score (BLEU, or the cells' ``train.valid_metric``) against optimizer
    steps, one line per cell; False if nothing to plot."""
    curves = [(cell, validation_curve(experiment, cell)) for cell in cells]
    curves = [(cell, points) for cell, points in curves if len(points) >= 2]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [v.name for v in experiment.variants]
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
    axis.set_ylabel(f"validation {valid_metric_name([c for c, _ in curves])} (greedy)")
    axis.set_title(f"{experiment.name}: validation curves (circle: best checkpoint)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


NAMED_CELLS_AT_MOST = 4
""":func:`precision_note` and :func:`machine_note` name the cells of a group up to this many,
else count them."""


def _label(cell: dict) -> str:
    return f"{cell['dataset']} / {cell['variant']} / seed {cell['seed']}"


def _grouped(cells: list[dict], key) -> dict[str, list[str]]:
    """Finished cells (cell.json dicts) by ``key(cell)`` -> "dataset / variant / seed N"
    labels; cells for which ``key`` gives None are left out."""
    groups: dict[str, list[str]] = {}
    for cell in cells:
        group = key(cell)
        if group:
            groups.setdefault(group, []).append(_label(cell))
    return groups


def _listed(groups: dict[str, list[str]]) -> str:
    """"GROUP: cell; cell | GROUP: N cells", the largest group first."""
    parts = []
    for name, labels in sorted(groups.items(), key=lambda group: (-len(group[1]), group[0])):
        listed = "; ".join(labels) if len(labels) <= NAMED_CELLS_AT_MOST else \
            f"{len(labels)} cells"
        parts.append(f"{name}: {listed}")
    return " | ".join(parts)


def precision_groups(cells: list[dict]) -> dict[str, list[str]]:
    """Finished cells (cell.json dicts) by the precision they record having trained in:
    precision -> "dataset / variant / seed N" labels (cells from before it was recorded
    are left out)."""
    return _grouped(cells, lambda cell: cell.get("train", {}).get("precision"))


def precision_note(cells: list[dict]) -> str:
    """A warning for results.md when the finished cells did not all train in the same
    precision (as their cell.json records it; cells from before it was recorded are left
    out), else "". ``auto`` trains in bf16 only where the hardware computes it natively, so
    a grid whose cells ran on different machines can mix precisions (a resumed cell keeps
    the precision it started in)."""
    groups = precision_groups(cells)
    if len(groups) < 2:
        return ""
    return ("> Not every cell trained in the same precision (" + _listed(groups) +
            "): `auto` trains in bf16 only on hardware that computes it natively. "
            "Differences between these cells include that of the precision.\n\n")


def _machine(cell: dict) -> str | None:
    """"CPU, N threads[, GPU]" as cell.json records where the cell finished; None for a
    cell from before it was recorded."""
    machine = cell.get("machine")
    if not machine:
        return None
    threads = machine.get("threads")
    name = machine.get("cpu", "unknown CPU")
    if threads:
        name += f", {threads} thread{'' if threads == 1 else 's'}"
    return name + (f", {machine['gpu']}" if machine.get("gpu") else "")


def machine_note(cells: list[dict]) -> str:
    """A warning for results.md when the finished cells did not all finish on one kind of
    machine with one thread count (cell.json's ``machine``; cells from before it was
    recorded are left out), else "": their cost columns (training time, tokens/s, decoding
    speed) are then not comparable across the groups; their scores are."""
    groups = _grouped(cells, _machine)
    if len(groups) < 2:
        return ""
    return ("> Not every cell finished on the same kind of machine (" + _listed(groups) +
            "; where its last training run and its decoding ran): compare the cost columns "
            "only within a group.\n\n")


def write_comparison(experiment: Experiment, cells: list[dict], baseline: str,
                     log=print) -> dict:
    """results.vs-BASELINE.md|json: the test tables against another variant of the grid;
    returns their numbers (what the .json holds)."""
    markdown, results = build_tables(replace(experiment, baseline=baseline), cells)
    markdown = (f"> Every difference and mark here is against **{baseline}**; the grid's "
                f"baseline is {experiment.baseline} (results.md).\n\n" + markdown)
    results.update({"baseline": baseline, "commit": git_commit(),
                    "experiment_file": str(experiment.path)})
    path = experiment.out / f"results.vs-{baseline}.md"
    _write_markdown_and_json(path, markdown, results)
    log(f"wrote {path} and {path.with_suffix('.json').name}")
    return results


def _write_markdown_and_json(markdown_path: Path, markdown: str, results: dict) -> None:
    """``NAME.md`` and, beside it, ``NAME.json``."""
    markdown_path.write_text(markdown, encoding="utf-8")
    markdown_path.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str),
                                                  encoding="utf-8")


def _comparisons(experiment: Experiment, requested: list[str], log) -> list[str]:
    """The baselines of results.vs-NAME.*: ``requested`` (``--baseline``), each baseline of
    the grid's ``reported`` entries (a paper's numbers against another baseline come with
    that comparison) and each comparison already in the output folder, so that a worker
    that lands a cell keeps an earlier ``--baseline``'s tables current (one whose variant
    has left the grid is left as written, with a note)."""
    variants = {variant.name for variant in experiment.variants}
    present = sorted(path.name[len("results.vs-"):-len(".md")]
                     for path in experiment.out.glob("results.vs-*.md"))
    for name in present:
        if name not in variants:
            log(f"results.vs-{name}.md left as written: {name} is no longer a variant of the "
                "grid")
    names = [*requested, *(entry.baseline for entry in experiment.reported),
             *(name for name in present if name in variants)]
    return [name for name in dict.fromkeys(names) if name != experiment.baseline]


def write_results(experiment: Experiment, grid: list[Cell], log=print,
                  extra_baselines: list[str] | None = None) -> dict:
    """(Re)write results.md and results.json from the finished cells of ``grid`` on disk
    (written by any worker), and a comparison against each of ``extra_baselines``, each
    baseline of the grid's ``reported`` entries and each comparison the folder already has
    (:func:`_comparisons`, :func:`write_comparison`); p-values of
    pairs tested by an earlier write are taken from its
    :mod:`~ranmt.experiment.bootstrap_cache`."""
    cells = [cell.result() for cell in grid if cell.finished]
    by_name = {dataset.name: dataset for dataset in experiment.datasets}
    for dataset in experiment.datasets:  # a fresh clone has the cells, not the prepared data
        if any(c["dataset"] == dataset.name for c in cells):  # (their references)
            prepare_once(by_name[dataset.references_from], experiment.out, log)
    extra_baselines = _comparisons(experiment, extra_baselines or [], log)
    with cached_bootstraps(cache_path(experiment), log) as cache:
        against = {baseline: write_comparison(experiment, cells, baseline, log)
                   for baseline in extra_baselines}
        markdown, results = build_tables(experiment, cells)
    beside_papers, beside_numbers = reported_tables(experiment, results, against)
    if beside_numbers:
        results["reported"] = beside_numbers
    markdown = precision_note(cells) + machine_note(cells) + markdown
    if beside_papers:
        markdown += "\n" + beside_papers
    if len(cells) < len(grid):
        markdown = (f"> Partial: {len(cells)} of {len(grid)} cells finished; rerun "
                    "`ranmt experiment` to complete the grid.\n\n" + markdown)
    results.update({"commit": git_commit(), "experiment_file": str(experiment.path),
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
        f"({len(cells)}/{len(grid)} cells; paired bootstraps: {cache.computed} resampled, "
        f"{cache.reused} kept in {cache.path})")
    return results
