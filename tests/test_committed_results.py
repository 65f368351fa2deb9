"""The committed grids' tables rebuild byte for byte: ``ranmt experiment GRID --tables-only``
over a copy of a ``docs/results`` folder (its cell.json files and hypotheses as committed)
writes results.md and every results.vs-NAME.md identical to the committed ones.

Needs Multi30k under ``$RANMT_DATA_DIR`` (each grid prepares its data again). The paired
bootstraps (sacreBLEU's TER, chrF and BLEU statistics of every hypothesis file, then 1000
resamples per comparison) were 4-5 of the suite's minutes on 2 cores, so CI (``ci``)
recomputes them for one grid, :data:`RECOMPUTED` (the bootstrap machinery end to end, p-values
equal to those recorded), and rebuilds the other grids with each comparison's per-seed
p-values replayed from its recorded results*.json (everything else recomputed: scores,
means, deltas, the seed rule, Welch's test, the marks, the layout). The test marked only
``slow`` recomputes every grid's bootstraps (``make test-all``). results.json is not
compared: it records the commit it was written at. Folders written before the one
significance rule (their results.json has no ``alpha``: the equal-time history of
RESULTS.md, whose single-run † meant p < 0.01 and whose grid file has changed since) are kept
as they were written and not collected here.
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
RECOMPUTED = "multi30k_en_de_1k_bf16"
"""The grid whose bootstraps CI recomputes: one of the smallest (6 cells) whose tables carry
marks (7 †/‡)."""


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
    from ranmt.experiment.preparation import prepare_dataset

    os.environ.pop("RANMT_WORK_DIR", None)
    return prepare_dataset(dataset, root, log=lambda _msg: None)


def _rebuild(grid: str, copy: Path, prepared: dict[str, Path], replay: bool) -> None:
    """``ranmt experiment GRID --tables-only`` over a copy of the committed folder (in a
    worker process), its datasets' prepared data (``prepared``: name -> folder) linked in
    where ``ranmt experiment`` looks for it; ``replay``: the paired bootstraps answer with
    the committed per-seed p-values (:func:`_replayed_bootstrap`)."""
    os.environ.pop("RANMT_WORK_DIR", None)
    committed = RESULTS / grid
    recorded = json.loads((committed / "results.json").read_text(encoding="utf-8"))
    # (data/: prepared data a local checkout may hold beside the cells, linked in below;
    # bootstrap_cache.json: p-values a local write kept, which would skip the recomputation)
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns(
        "*.png", "results*", "data", "bootstrap_cache.json"))
    (copy / "data").mkdir(exist_ok=True)
    for name, folder in prepared.items():
        (copy / "data" / name).symlink_to(folder, target_is_directory=True)
    import ranmt.experiment.table_parts as tables

    computed = tables.paired_bootstrap  # the pool's processes take grids of either kind
    if replay:
        tables.paired_bootstrap = _replayed_bootstrap(committed)
    baselines = _baselines(committed)
    try:
        main(["experiment", str(ROOT / recorded["experiment_file"]), "--out", str(copy),
              "--tables-only", *(f"--baseline={name}" for name in baselines)])
    finally:
        tables.paired_bootstrap = computed


def _replayed_bootstrap(committed: Path):
    """A stand-in for ``ranmt.evaluate.paired_bootstrap`` that answers each comparison with
    the per-seed p-values recorded in the committed results*.json: the variants' hypotheses
    name their cell (dataset, test, seed), the first system names the baseline; in the
    tables of other decodings (``also_decode``) the first system is the grid's decode
    ("decode") and the second is named by its setting (``TEST.SETTING.hyp``); in the
    comparisons across datasets the first is "comparison NAME", the second the row's
    variant."""
    cells = {}  # (system name, hypotheses) -> (dataset, test, seed, variant)
    for path in (committed / "runs").glob("*/*/seed*/*.hyp"):
        dataset, variant, seed = path.parts[-4], path.parts[-3], int(path.parts[-2][4:])
        test, _, setting = path.stem.partition(".")
        lines = tuple(path.read_text(encoding="utf-8").split("\n")[:-1])
        cells[(setting or variant, lines)] = (dataset, test, seed, variant)
    recorded = {}  # (baseline, dataset, test, variant[, setting]) -> metric -> seed -> p
    for path in committed.glob("results*.json"):
        results = json.loads(path.read_text(encoding="utf-8"))
        baseline = results.get("baseline") or results["experiment_config"]["baseline"]
        for dataset, entry in results["datasets"].items():
            for test, numbers in entry["tests"].items():
                for variant, metrics in numbers["significance"].items():
                    recorded[(baseline, dataset, test, variant)] = {
                        metric: dict(zip(value["seeds"], value["per_seed_p"]))
                        for metric, value in metrics.items() if "per_seed_p" in value}
            for test, by_variant in entry.get("also_decode", {}).items():
                for variant, by_setting in by_variant.items():
                    for setting, metrics in by_setting.items():
                        recorded[("decode", dataset, test, variant, setting)] = {
                            metric: dict(zip(value["significance"]["seeds"],
                                             value["significance"]["per_seed_p"]))
                            for metric, value in metrics.items() if value["significance"]}
        for name, by_test in results.get("comparisons", {}).items():
            for test, by_dataset in by_test.items():
                for dataset, by_variant in by_dataset.items():
                    for variant, entry in by_variant.items():
                        recorded[(f"comparison {name}", dataset, test, variant)] = {
                            metric: dict(zip(value["significance"]["seeds"],
                                             value["significance"]["per_seed_p"]))
                            for metric, value in entry.items()
                            if isinstance(value, dict) and value.get("significance")}

    def replay(systems, refs, metrics, samples=1000, seed=12345):
        rows: list[dict] = [{"name": systems[0][0]}]
        for name, hyps in systems[1:]:
            dataset, test, cell_seed, variant = cells[(name, tuple(hyps))]
            key = ((systems[0][0], dataset, test, variant, name) if systems[0][0] == "decode"
                   else (systems[0][0], dataset, test, name))
            rows.append({"name": name, **{f"{metric}_p": recorded[key][metric][cell_seed]
                                          for metric in metrics}})
        return {"systems": rows}

    return replay


def _rebuild_grids(root: Path, grids: list[str], replay: set[str]) -> dict:
    """``grids`` rebuilt under ``root``, two at a time in worker processes (the grids are
    independent), the recomputed ones first, then the largest. Each distinct dataset is
    prepared once and shared by the grids that use it. Returns grid -> the error or None."""
    from ranmt.experiment.loading import load_placed

    # The datasets the tables read references from (a distilled dataset's are its teacher
    # dataset's: it is prepared by its grid, from the teacher's checkpoint, which a clone lacks)
    datasets = {}
    for grid in grids:
        every = load_placed(_experiment_file(grid), root / grid).datasets
        by_name = {d.name: d for d in every}
        datasets[grid] = [by_name[name] for name in dict.fromkeys(
            d.references_from for d in every)]
    distinct = {_dataset_key(d): d for grid in grids for d in datasets[grid]}
    order = sorted(grids, key=lambda grid: (grid in replay, -len(list(
        (RESULTS / grid).glob("runs/**/cell.json")))))
    with ProcessPoolExecutor(max_workers=2, mp_context=get_context("spawn")) as pool:
        folders = {key: pool.submit(_prepare, dataset, root / "prepared" / str(number))
                   for number, (key, dataset) in enumerate(distinct.items())}
        folders = {key: future.result() for key, future in folders.items()}
        futures = {grid: pool.submit(_rebuild, grid, root / grid, {
            d.name: folders[_dataset_key(d)] for d in datasets[grid]}, grid in replay)
            for grid in order}
    return {grid: future.exception() for grid, future in futures.items()}


def _needs_multi30k() -> None:
    if not (Path(os.environ.get("RANMT_DATA_DIR", "")) / "multi30k").is_dir():
        pytest.skip("needs Multi30k under $RANMT_DATA_DIR")


@pytest.fixture(scope="session")  # once per process (make test: --dist loadfile keeps
# this file's tests in one worker)
def rebuilt(tmp_path_factory) -> tuple[Path, dict]:
    """Every grid rebuilt, :data:`RECOMPUTED` with its bootstraps, the others with their
    recorded p-values replayed. Returns (the folder of the copies, grid -> error or None)."""
    _needs_multi30k()
    root = tmp_path_factory.mktemp("rebuilt")
    return root, _rebuild_grids(root, GRIDS, replay=set(GRIDS) - {RECOMPUTED})


def _significance(path: Path) -> dict:
    results = json.loads(path.read_text(encoding="utf-8"))
    return {(dataset, test): numbers["significance"]
            for dataset, entry in results["datasets"].items()
            for test, numbers in entry["tests"].items()}


def _assert_identical(root: Path, errors: dict, grid: str, recomputed: bool) -> None:
    """The rebuilt tables equal the committed ones; where the bootstraps were recomputed,
    so do the recorded p-values (every seed's, not only the marks they give)."""
    assert errors[grid] is None, f"{grid}: {errors[grid]!r}"
    committed, copy = RESULTS / grid, root / grid
    for name in ["results.md"] + [f"results.vs-{b}.md" for b in _baselines(committed)]:
        assert (copy / name).read_text(encoding="utf-8") == \
            (committed / name).read_text(encoding="utf-8"), f"{grid}/{name}"
        if recomputed:
            numbers = name.replace(".md", ".json")
            assert _significance(copy / numbers) == _significance(committed / numbers), \
                f"{grid}/{numbers}: p-values"


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.parametrize("grid", GRIDS)
def test_committed_tables_rebuild_byte_identical(grid, rebuilt):
    _assert_identical(*rebuilt, grid, recomputed=grid == RECOMPUTED)


@pytest.mark.slow
def test_committed_tables_rebuild_with_every_bootstrap_recomputed(tmp_path):
    """Every grid's paired bootstraps recomputed (about 5 minutes on 2 cores)."""
    _needs_multi30k()
    errors = _rebuild_grids(tmp_path, GRIDS, replay=set())
    for grid in GRIDS:
        _assert_identical(tmp_path, errors, grid, recomputed=True)
