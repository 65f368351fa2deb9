"""``ranmt experiment CONFIG.yaml``: a grid of datasets x variants x seeds, end to end
(docs/EXPERIMENTS.md is the user manual).

Rooms: :mod:`.spec` (the grid and its cell paths), :mod:`.cells` (prepare, train, decode and
score one cell; locks), :mod:`.reuse` (reused and warm-started cells), :mod:`.tables` and
:mod:`.results` (tables, curves, results files). :func:`run_experiment` walks the grid.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from ranmt.checkpoint import step_checkpoints
from ranmt.config import ConfigError
from ranmt.experiment.cells import (
    CellInterrupted,
    _cell_config,
    _prepare_once,
    claim,
    prepare_dataset,
    release,
    run_cell,
)
from ranmt.experiment.results import write_comparison, write_results
from ranmt.experiment.reuse import (
    _warm_start_if_possible,
    _warm_start_state,
    adopt_cell,
    expected_cell_config,
    find_reusable_cell,
    find_warm_start,
    warm_start,
)
from ranmt.experiment.spec import (
    WORK_ENV,
    Dataset,
    Experiment,
    Variant,
    _cell_dir,
    _check_variant_names,
    _run_dir,
    _select,
    load_experiment,
)
from ranmt.experiment.tables import build_tables, compare_over_seeds, significance_marks

__all__ = ["CellInterrupted", "Dataset", "Experiment", "Variant", "WORK_ENV", "adopt_cell",
           "build_tables", "compare_over_seeds", "expected_cell_config", "find_reusable_cell",
           "find_warm_start", "load_experiment", "prepare_dataset", "run_cell",
           "run_experiment", "significance_marks", "warm_start", "write_comparison",
           "write_results", "_cell_config", "_warm_start_state"]


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
        cell_dir = _cell_dir(experiment, dataset.name, variant.name, seed)
        cell_file = cell_dir / "cell.json"
        label = f"cell {index}/{len(selected)}: {dataset.name} / {variant.name} / seed {seed}"
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
                run_dir = _run_dir(experiment, dataset.name, variant.name, seed)
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
