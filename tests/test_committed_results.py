"""The committed grids' tables rebuild byte for byte: ``ranmt experiment GRID --tables-only``
over a copy of a ``docs/results`` folder (its cell.json files and hypotheses as committed)
writes results.md and every results.vs-NAME.md identical to the committed ones.

Slow (each grid prepares Multi30k and bootstraps its significance again); needs Multi30k
under ``$RANMT_DATA_DIR``; marked ``ci``: CI runs it. results.json is not compared: it
records the commit it was written at. Folders written before the one significance rule
(their results.json has no ``alpha``: the equal-time history of RESULTS.md, whose
single-run † meant p < 0.01 and whose grid file has changed since) are kept as they were
written and not collected here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest

from ranmt.cli import main

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
# Folders written before the one significance rule (no "alpha" in results.json) are history,
# kept as written: not collected (a skip would fail CI, which skips only for want of CUDA).
GRIDS = sorted(path.parent.name for path in RESULTS.glob("*/results.json")
               if "alpha" in json.loads(path.read_text(encoding="utf-8")))


def _baselines(folder: Path) -> list[str]:
    """The extra baselines the folder's tables were written against (results.vs-NAME.md)."""
    return sorted(path.name[len("results.vs-"):-len(".md")]
                  for path in folder.glob("results.vs-*.md"))


def _experiment_file(grid: str) -> Path:
    recorded = json.loads((RESULTS / grid / "results.json").read_text(encoding="utf-8"))
    return ROOT / recorded["experiment_file"]


def _dataset_key(dataset) -> str:
    """What a prepared dataset is made from (everything but its name)."""
    fields = dataclasses.asdict(dataset)
    fields.pop("name")
    return json.dumps(fields, sort_keys=True)


def _prepare(dataset, root: Path) -> Path:
    """Prepare ``dataset`` under ``root`` (in a worker process)."""
    from ranmt.experiment.cells import prepare_dataset

    os.environ.pop("RANMT_WORK_DIR", None)
    return prepare_dataset(dataset, root, log=lambda _msg: None)


def _rebuild(grid: str, copy: Path, prepared: dict[str, Path]) -> None:
    """``ranmt experiment GRID --tables-only`` over a copy of the committed folder (in a
    worker process), its datasets' prepared data (``prepared``: name -> folder) linked in
    where ``ranmt experiment`` looks for it."""
    os.environ.pop("RANMT_WORK_DIR", None)
    committed = RESULTS / grid
    recorded = json.loads((committed / "results.json").read_text(encoding="utf-8"))
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("*.png", "results*"))
    (copy / "data").mkdir(exist_ok=True)
    for name, folder in prepared.items():
        (copy / "data" / name).symlink_to(folder, target_is_directory=True)
    baselines = _baselines(committed)
    main(["experiment", str(ROOT / recorded["experiment_file"]), "--out", str(copy),
          "--tables-only", *(["--baseline", *baselines] if baselines else [])])


@pytest.fixture(scope="session")  # once per process (make test: --dist loadfile keeps
# this file's tests in one worker)
def rebuilt(tmp_path_factory) -> tuple[Path, dict]:
    """Every grid rebuilt, two at a time in worker processes (the grids are independent;
    their paired bootstraps were most of the suite's time: 12.7 of 30 minutes on 2 cores),
    the largest first. Each distinct dataset is prepared once and shared by the grids that
    use it (the same corpus and settings prepare the same data: SentencePiece training and
    encoding were repeated per grid before). Returns (the folder of the copies, grid -> the
    error or None)."""
    from ranmt.experiment.spec import load_placed

    if not (Path(os.environ.get("RANMT_DATA_DIR", "")) / "multi30k").is_dir():
        pytest.skip("needs Multi30k under $RANMT_DATA_DIR")
    root = tmp_path_factory.mktemp("rebuilt")
    datasets = {grid: load_placed(_experiment_file(grid), root / grid).datasets
                for grid in GRIDS}
    distinct = {_dataset_key(d): d for grid in GRIDS for d in datasets[grid]}
    largest_first = sorted(GRIDS, key=lambda grid: -len(list(
        (RESULTS / grid).glob("runs/**/cell.json"))))
    with ProcessPoolExecutor(max_workers=2, mp_context=get_context("spawn")) as pool:
        folders = {key: pool.submit(_prepare, dataset, root / "prepared" / str(number))
                   for number, (key, dataset) in enumerate(distinct.items())}
        folders = {key: future.result() for key, future in folders.items()}
        futures = {grid: pool.submit(_rebuild, grid, root / grid, {
            d.name: folders[_dataset_key(d)] for d in datasets[grid]}) for grid in largest_first}
    return root, {grid: future.exception() for grid, future in futures.items()}


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("grid", GRIDS)
def test_committed_tables_rebuild_byte_identical(grid, rebuilt):
    root, errors = rebuilt
    assert errors[grid] is None, f"{grid}: {errors[grid]!r}"
    committed, copy = RESULTS / grid, root / grid
    for name in ["results.md"] + [f"results.vs-{b}.md" for b in _baselines(committed)]:
        assert (copy / name).read_text(encoding="utf-8") == \
            (committed / name).read_text(encoding="utf-8"), f"{grid}/{name}"
