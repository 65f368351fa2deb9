"""``ranmt experiment CONFIG.yaml``: a grid of datasets x variants x seeds, end to end
(docs/EXPERIMENTS.md is the user manual).

Rooms: :mod:`.spec` (the grid, and :class:`Cell`: one cell's folders, config and result),
:mod:`.cells` (prepare, train, decode and score one cell; locks), :mod:`.reuse` (reused
and warm-started cells), :mod:`.recipe` (one recipe per grid), :mod:`.tables` and
:mod:`.results` (tables, curves, results files), :mod:`.plan` (``--dry-run``).
:func:`run_experiment` walks the grid.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ranmt.checkpoint import CheckpointError, resolve_checkpoint, step_checkpoints
from ranmt.config import ConfigError
from ranmt.evaluate import compare_over_seeds, significance_marks
from ranmt.experiment.cells import (
    CellInterrupted,
    decode_also,
    decode_missing_tests,
    missing_also_decode,
    missing_tests,
    run_cell,
)
from ranmt.experiment.loading import load_experiment, load_placed
from ranmt.experiment.locks import claim, release
from ranmt.experiment.plan import plan_experiment
from ranmt.experiment.preparation import prepare_dataset, prepare_once
from ranmt.experiment.recipe import describe_differences, recipe_differences
from ranmt.experiment.results import precision_groups, write_comparison, write_results
from ranmt.experiment.reuse import (
    adopt_cell,
    expected_cell_config,
    find_reusable_cell,
    find_warm_start,
    precision_it_trains_in,
    warm_start,
    warm_start_if_possible,
    warm_start_state,
)
from ranmt.experiment.spec import WORK_ENV, Cell, Dataset, Experiment, Variant
from ranmt.experiment.tables import build_tables

__all__ = ["Cell", "CellInterrupted", "Dataset", "Experiment", "Variant", "WORK_ENV",
           "adopt_cell", "build_tables", "compare_over_seeds", "expected_cell_config",
           "find_reusable_cell", "find_warm_start", "load_experiment", "plan_experiment",
           "prepare_dataset", "run_cell", "run_experiment", "significance_marks",
           "stopped_first", "warm_start", "warm_start_state", "write_comparison",
           "write_results"]


def run_experiment(path: str | Path, log=print, out: str | Path | None = None,
                   variants: list[str] | None = None, seeds: list[int] | None = None,
                   tables_only: bool = False,
                   reuse_from: list[str | Path] | None = None,
                   baselines: list[str] | None = None,
                   work: str | Path | None = None,
                   datasets: list[str] | None = None) -> dict:
    """Run (or resume) the whole grid, cooperating with other workers; return the results.

    ``out`` overrides the experiment file's output directory; ``variants`` / ``seeds`` /
    ``datasets`` restrict the cells this call runs (the tables show every finished cell of
    the grid);
    ``tables_only`` trains nothing and rewrites the tables; ``reuse_from`` lists output
    folders of other grids whose finished cells are copied instead of trained where they
    are the very same training (:func:`find_reusable_cell`); ``baselines`` names variants
    to compare against besides the grid's baseline (:func:`write_comparison`); ``work``
    (default ``$RANMT_WORK_DIR``) keeps the cells' run folders outside ``out``
    (:func:`_run_dir`), where a fresh checkout of the grid finds and resumes them. A signal
    during training raises :class:`CellInterrupted` (a ``KeyboardInterrupt``) after the
    cell's checkpoint is saved and its lock released; the cell is not recorded as finished.
    """
    experiment = load_placed(path, out, work)
    experiment.check_variant_names("--baseline", baselines)
    extra_baselines = [b for b in baselines or [] if b != experiment.baseline]
    reuse_from = [Path(folder) for folder in reuse_from or []]
    for folder in reuse_from:
        if not (folder / "runs").is_dir():
            raise ConfigError(f"--reuse {folder}: not a grid's output folder (no runs/ in it)")
    experiment.out.mkdir(parents=True, exist_ok=True)
    grid = experiment.cells()
    selected = [] if tables_only else stopped_first(experiment.select(variants, seeds,
                                                                      datasets))
    durations, elsewhere = [], []
    tables = _Tables(experiment, grid, log, extra_baselines)
    for index, cell in enumerate(selected, 1):
        data_dir = prepare_once(cell.dataset, experiment.out, log, experiment)
        label = f"cell {index}/{len(selected)}: {cell.label}"
        if cell.finished:
            if _complete_decodes(cell, data_dir, label, log):
                tables.write()
            else:
                log(f"{label}: done, reusing {cell.file}")
            continue
        if not claim(cell.lock):
            log(f"{label}: another worker is running it, skipping")
            elsewhere.append(label)
            continue
        try:
            if cell.finished:  # finished by another worker just before we claimed it
                continue
            remaining = len(selected) - index + 1
            eta = (f", ETA {statistics.mean(durations) * remaining / 60:.0f} min for the "
                   f"{remaining} cells left (this worker)" if durations else "")
            if not _reuse_or_warm_start(cell, data_dir, reuse_from, label, log):
                _warn_if_another_precision(cell, grid, data_dir, label, log)
                _warn_if_another_recipe(cell, grid, data_dir, label, log)
                log(f"{label}: running{eta}")
                start = time.monotonic()
                run_cell(cell, data_dir, log)
                durations.append(time.monotonic() - start)
        finally:
            release(cell.lock)
        tables.write()
    if elsewhere:
        log(f"{len(elsewhere)} cell(s) are still running in other workers; the last worker "
            "to finish writes the complete tables")
    return tables.current()


def _warn_if_another_precision(cell: Cell, grid: list[Cell], data_dir: Path, label: str,
                               log) -> None:
    """Say so before ``cell`` trains in a precision other than the one the grid's finished
    cells trained in (``auto`` resolves by the hardware: bf16 only where it is native);
    results.md names such cells too (:func:`~ranmt.experiment.results.precision_note`)."""
    finished = precision_groups([other.result() for other in grid if other.finished])
    precision = precision_it_trains_in(cell, data_dir)
    others = [f"{len(names)} in {name}" for name, names in sorted(finished.items())
              if name != precision]
    if others:
        log(f"{label}: trains in {precision}, where finished cells of the grid trained "
            f"{', '.join(others)}; results.md will name it (set train.precision in the "
            "grid's overrides to train every cell in one precision)")


def _warn_if_another_recipe(cell: Cell, grid: list[Cell], data_dir: Path, label: str,
                            log) -> None:
    """Say so before ``cell`` trains with a training, data or decoding setting that differs
    from the grid's finished cells of its dataset (:func:`~.recipe.recipe_differences`):
    their tables would compare two recipes."""
    finished = [other.result() for other in grid
                if other.finished and other.dataset.name == cell.dataset.name]
    differences = recipe_differences(cell, data_dir, finished)
    if differences:
        log(f"{label}: trains with {describe_differences(differences, len(finished))}; "
            "the tables will compare two recipes (set these in the grid's overrides to "
            "train every cell one way)")


class _Tables:
    """The grid's tables, rewritten (:func:`write_results`) when a cell lands, and once
    more at the end only where the finished cells changed since the last write (another
    worker finished one) or nothing was written yet: the tables' bootstrap takes minutes
    on a grid of many cells."""

    def __init__(self, experiment: Experiment, grid: list[Cell], log, extra_baselines):
        self.experiment, self.grid, self.log = experiment, grid, log
        self.extra_baselines = extra_baselines
        self.written_for: frozenset[Path] | None = None  # the finished cells last written
        self.results: dict = {}

    def _finished(self) -> frozenset[Path]:
        return frozenset(cell.file for cell in self.grid if cell.finished)

    def write(self) -> dict:
        finished = self._finished()
        self.results = write_results(self.experiment, self.grid, self.log,
                                     self.extra_baselines)
        self.written_for = finished
        return self.results

    def current(self) -> dict:
        """The results, rewritten only if they could differ from the last write."""
        if self.written_for is not None and self.written_for == self._finished():
            return self.results
        return self.write()


def stopped_first(cells: list[Cell]) -> list[Cell]:
    """``cells`` with those stopped part-way (unfinished, with a step checkpoint) first, each
    group in grid order: a worker finishes what was started before it starts anything new,
    so that a grid stopped and restarted does not leave half-trained cells waiting behind
    fresh ones (and their checkpoints on disk)."""
    return sorted(cells, key=lambda cell: cell.finished or not step_checkpoints(cell.run_dir))


def _complete_decodes(cell: Cell, data_dir: Path, label: str, log) -> bool:
    """A finished cell lacking some of the grid's test sets or ``also_decode`` settings
    (added to the grid after it finished) is decoded with them now, from its best
    checkpoint, when that is on this machine; True when cell.json was updated."""
    result = cell.result()
    missing = missing_tests(cell, result) + missing_also_decode(cell, result)
    if not missing:
        return False
    try:
        resolve_checkpoint(cell.run_dir)
    except CheckpointError:
        log(f"{label}: done; its checkpoint is not in {cell.run_dir}, so {missing} cannot "
            "be decoded here")
        return False
    if not claim(cell.lock):
        log(f"{label}: another worker holds it, skipping {missing}")
        return False
    try:
        result = cell.result()  # as it is now that this worker holds the cell
        added = decode_missing_tests(cell, data_dir, result, log)
        added += decode_also(cell, data_dir, result, log)
        if added:
            cell.file.write_text(json.dumps(result, indent=1), encoding="utf-8")
    finally:
        release(cell.lock)
    if added:
        log(f"{label}: done; decoded {added} too")
    return bool(added)


def _reuse_or_warm_start(cell: Cell, data_dir: Path, reuse_from: list[Path], label: str,
                         log) -> bool:
    """With ``--reuse``: True when a finished cell of another grid is this very training
    and was copied in (nothing to train); else False, after seeding the cell's run folder
    from another grid's step checkpoint when one is on this training's path."""
    if not reuse_from:
        return False
    reusable = find_reusable_cell(cell, data_dir, reuse_from, log)
    if reusable is not None:
        adopt_cell(*reusable, cell)
        log(f"{label}: the same training as the finished cell {reusable[0]}, reused "
            "(nothing trained)")
        return True
    if not step_checkpoints(cell.run_dir):
        found = warm_start_if_possible(cell, data_dir, reuse_from, log)
        if found is not None:
            log(f"{label}: warm start from {found[0]} (step {found[1]['step']}, a step of "
                "this very training)")
    return False
