"""The grid tables' bootstrap cache (ranmt.experiment.bootstrap_cache): tables built through
it equal tables built without it — cold, warm, and after one cell's hypotheses change (then
only that cell's pairs are resampled, in a test without the other systems of its seed) —
and a file that is not a cache is recomputed, not trusted."""

from __future__ import annotations

import json
import random

import pytest

from conftest import patch_tables
from ranmt.evaluate import paired_bootstrap
from ranmt.experiment import Dataset, Experiment, build_tables
from ranmt.experiment.bootstrap_cache import CACHE_NAME, cache_path, cached_bootstraps
from ranmt.experiment.spec import Comparison

WORDS = ["a", "dog", "runs", "on", "the", "green", "grass", "while", "two", "men", "in",
         "red", "shirts", "watch", "it"]


def _references(count: int = 40) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))) for _ in range(count)]


def _hypotheses(references: list[str], name: str) -> list[str]:
    """The references with words replaced at a rate and pattern of ``name``'s own."""
    rng = random.Random(name)
    rate = rng.uniform(0.1, 0.5)
    return [" ".join(word if rng.random() > rate else rng.choice(WORDS)
                     for word in line.split()) for line in references]


def _cell(dataset: str, variant: str, seed: int) -> dict:
    scores = {"bleu": 30.0, "tok_bleu": 30.0, "chrf": 50.0, "ter": 60.0,
              "sentences_per_s": 1.0, "target_tokens_per_s": 1.0}
    return {"dataset": dataset, "variant": variant, "seed": seed, "parameters": 1,
            "tests": {"t": scores},
            "train": {"steps": 1, "best_step": 1, "best_valid_bleu": 30.0,
                      "wall_time_s": 1.0, "train_tokens_per_s": 1.0}}


@pytest.fixture
def grid(tmp_path, monkeypatch):
    """Two datasets (one distilled, compared with the original seed by seed) x three
    variants x two seeds of hand-made hypotheses; ``versions`` renames a cell's output (its
    hypotheses change); ``calls`` records the systems of every bootstrap run."""
    experiment = Experiment(
        name="cached", out=tmp_path / "out",
        datasets=[Dataset(name="orig", src="s", tgt="t", tests={"t": "t"}),
                  Dataset(name="dist", src="s", tgt="t", tests={"t": "t"},
                          distill={"teacher": {"dataset": "orig", "variant": "B",
                                               "seed": 1}})],
        variants=[{"name": "B"}, {"name": "V1"}, {"name": "V2"}], seeds=[1, 2],
        baseline="B", base_config=None, overrides={}, decode={}, bootstrap_samples=100,
        comparisons=[Comparison("distillation", (("dataset", "orig"),), ("dist",))])
    references = _references()
    versions: dict[tuple, str] = {}
    calls: list[list[str]] = []

    def hyps(e, cell, test, recorded=None, setting=None):
        key = (cell["dataset"], cell["variant"], cell["seed"])
        return _hypotheses(references, "/".join(map(str, key)) + versions.get(key, ""))

    def counted_bootstrap(systems, refs, metrics, samples):
        calls.append([name for name, _ in systems])
        return paired_bootstrap(systems, refs, metrics, samples)

    patch_tables(monkeypatch, "raw_text", lambda *a: references)
    patch_tables(monkeypatch, "read_hyps", hyps)
    patch_tables(monkeypatch, "paired_bootstrap", counted_bootstrap)
    cells = [_cell(d, v, s) for d in ("orig", "dist") for v in ("B", "V1", "V2")
             for s in (1, 2)]
    return experiment, cells, versions, calls


def _p_values(results: dict) -> dict:
    """Every per-seed p-value of the results, by where it stands."""
    found = {}
    for dataset, entry in results["datasets"].items():
        for variant, metrics in entry["tests"]["t"]["significance"].items():
            for metric, value in metrics.items():
                found[(dataset, variant, metric)] = value["per_seed_p"]
    for dataset, by_variant in results["comparisons"]["distillation"]["t"].items():
        for variant, entry in by_variant.items():
            for metric, value in entry.items():
                if isinstance(value, dict) and value.get("significance"):
                    found[("distillation", dataset, variant, metric)] = \
                        value["significance"]["per_seed_p"]
    return found


def test_tables_through_the_cache_equal_tables_without_it(grid, tmp_path):
    experiment, cells, versions, calls = grid
    plain_markdown, plain = build_tables(experiment, cells)
    p_values = _p_values(plain)
    assert len(p_values) == 2 * 2 * 3 + 3 * 3  # 2 datasets x V1, V2 + 3 distilled rows
    assert len({p for seeds in p_values.values() for p in seeds}) > 10  # they differ
    systems = sum(len(names) - 1 for names in calls)  # 2 x 2 x 2 + 3 x 2 = 14
    path = tmp_path / "work" / CACHE_NAME

    calls.clear()
    with cached_bootstraps(path) as cache:  # cold: every pair resampled, as without it
        cold_markdown, cold = build_tables(experiment, cells)
    assert (cold_markdown, _p_values(cold)) == (plain_markdown, p_values)
    assert (cache.computed, cache.reused) == (systems, 0)
    assert sum(len(names) - 1 for names in calls) == systems

    calls.clear()
    with cached_bootstraps(path) as cache:  # warm: nothing resampled
        warm_markdown, warm = build_tables(experiment, cells)
    assert (warm_markdown, _p_values(warm)) == (plain_markdown, p_values)
    assert calls == [] and (cache.computed, cache.reused) == (0, systems)

    # One cell's output changes: its pairs alone are resampled, V1 alone against B in its
    # seed (the plain build tests B, V1 and V2 together) and as a distillation row.
    versions[("dist", "V1", 2)] = " retrained"
    changed_markdown, changed = build_tables(experiment, cells)
    assert _p_values(changed) != p_values
    calls.clear()
    with cached_bootstraps(path) as cache:
        cached_markdown, cached = build_tables(experiment, cells)
    assert (cached_markdown, _p_values(cached)) == (changed_markdown, _p_values(changed))
    assert sorted(calls) == [["B", "V1"], ["comparison distillation", "V1"]]
    # The file keeps what the last write used: 14 pairs x 3 metrics, not the stale pairs.
    stored = json.loads(path.read_text(encoding="utf-8"))["p_values"]
    assert len(stored) == systems * 3


def test_a_file_that_is_not_a_cache_is_recomputed(grid, tmp_path):
    experiment, cells, _, calls = grid
    plain_markdown, plain = build_tables(experiment, cells)
    path = tmp_path / CACHE_NAME
    path.write_text('{"format": 1, "p_values": [0.5]}', encoding="utf-8")
    said: list[str] = []
    calls.clear()
    with cached_bootstraps(path, log=said.append) as cache:
        markdown, results = build_tables(experiment, cells)
    assert (markdown, _p_values(results)) == (plain_markdown, _p_values(plain))
    assert cache.reused == 0 and calls and "not a bootstrap cache" in said[0]
    assert len(json.loads(path.read_text(encoding="utf-8"))["p_values"]) == 14 * 3
    # Another format's file is dropped silently and rewritten in this one.
    path.write_text(json.dumps({"format": 0, "p_values": {}}), encoding="utf-8")
    with cached_bootstraps(path, log=said.append) as cache:
        build_tables(experiment, cells)
    assert cache.reused == 0 and len(said) == 1


def test_the_cache_sits_in_the_work_folder_when_the_grid_has_one(grid, tmp_path):
    experiment = grid[0]
    assert cache_path(experiment) == experiment.out / CACHE_NAME
    experiment.work = tmp_path / "work"
    assert cache_path(experiment) == tmp_path / "work" / "out" / CACHE_NAME


def test_a_key_names_everything_a_p_value_depends_on():
    from ranmt.experiment.bootstrap_cache import BootstrapCache

    base = ("bleu", 1000, 12345, "baseline", "system", "references")
    keys = {BootstrapCache.key(*base)}
    for index, other in enumerate(("chrf", 100, 1, "other", "other", "other")):
        keys.add(BootstrapCache.key(*base[:index], other, *base[index + 1:]))
    assert len(keys) == 7


def test_a_long_write_says_how_far_it_got(grid, tmp_path, monkeypatch):
    import ranmt.experiment.bootstrap_cache as cache_module

    experiment, cells, _, calls = grid
    monkeypatch.setattr(cache_module, "PROGRESS_EVERY_S", 0.0)
    said: list[str] = []
    with cached_bootstraps(tmp_path / CACHE_NAME, log=said.append):
        build_tables(experiment, cells)
    progress = [line for line in said if line.startswith("paired bootstraps: ")]
    assert len(progress) == len(calls) == 2 * 2 + 6  # a test per dataset and seed, 6 rows
    assert progress[-1].startswith("paired bootstraps: 14 resampled, 0 kept so far")
