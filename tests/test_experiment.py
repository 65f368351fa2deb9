"""`ranmt experiment`: a tiny grid end to end; its table equals `ranmt evaluate`; resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import ranmt.experiment as experiment_module
import ranmt.experiment.cells as cells_module
import ranmt.experiment.tables as tables_module
from conftest import patch_tables, reverse_task, signal_each, write_parallel
from ranmt.cli import main
from ranmt.config import ConfigError
from ranmt.evaluate import score
from ranmt.experiment import run_experiment


def _grid(tmp_path) -> object:
    for name, count, seed in (("train", 3000, 0), ("valid", 60, 1), ("test", 40, 2)):
        src, tgt = reverse_task(count, seed)
        write_parallel(tmp_path / name, src, tgt)
    config = {
        "name": "tiny-grid", "out": str(tmp_path / "exp"), "seeds": [1], "baseline": "TransF",
        "overrides": {"model.preset": "tiny", "train.max_steps": 40, "train.lr": 0.003,
                      "train.warmup_steps": 20, "train.validate_every": 20,
                      "train.validate_bleu": False, "train.progress": False,
                      "train.tensorboard": False, "data.max_tokens": 600},
        "decode": {"beam": 2, "device": "cpu"},
        "bootstrap_samples": 200,
        "datasets": [{"name": "reverse", "src": "src", "tgt": "tgt",
                      "train": str(tmp_path / "train"), "valid": str(tmp_path / "valid"),
                      "tests": {"test": str(tmp_path / "test")}, "vocab_size": 40,
                      "max_positions": 64}],
        "variants": [{"name": "TransF", "overrides": {"model.arch": "transf"}},
                     {"name": "RAN-ALL", "overrides": {"model.arch": "ran-all"}}],
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _count_trainings(monkeypatch) -> list[str]:
    """Record the run folder of every training `ranmt experiment` starts from now on."""
    calls: list[str] = []
    real_train = cells_module.train

    def counting_train(cfg, data_dir, run_dir):
        calls.append(str(run_dir))
        return real_train(cfg, data_dir, run_dir)

    monkeypatch.setattr(cells_module, "train", counting_train)
    return calls


def test_tiny_grid_table_matches_evaluate_and_resumes(tmp_path, capsys, monkeypatch):
    path = _grid(tmp_path)
    main(["experiment", str(path)])
    exp = tmp_path / "exp"
    results = json.loads((exp / "results.json").read_text())
    markdown = (exp / "results.md").read_text()
    assert "| metric | TransF | RAN-ALL |" in markdown and "| SacreBLEU |" in markdown
    rows = [markdown.index(f"| {name} |") for name in ("BLEU", "SacreBLEU", "chrF", "TER")]
    assert rows == sorted(rows)  # the RAN paper's Table 1 order
    assert results["commit"] is None or len(results["commit"]) == 40
    scores = results["datasets"]["reverse"]["tests"]["test"]["scores"]
    for variant in ("TransF", "RAN-ALL"):
        run = exp / "runs" / "reverse" / variant / "seed1" / "run"
        capsys.readouterr()
        main(["evaluate", "--checkpoint", str(run), "--data", str(exp / "data" / "reverse"),
              "--split", "test", "--beam", "2", "--device", "cpu", "--json"])
        evaluated = json.loads(capsys.readouterr().out)
        assert scores[variant]["bleu"]["mean"] == evaluated["bleu"]
        assert scores[variant]["chrf"]["mean"] == evaluated["chrf"]
        # the cell records its output length as BLEU's brevity penalty counts it
        hyps = (exp / "runs" / "reverse" / variant / "seed1" / "test.hyp").read_text(
            encoding="utf-8").splitlines()
        refs = (exp / "data" / "reverse" / "test.tgt.txt").read_text(
            encoding="utf-8").splitlines()
        cell = json.loads((exp / "runs" / "reverse" / variant / "seed1" / "cell.json")
                          .read_text())
        assert cell["tests"]["test"]["length_ratio"] == \
            score(hyps, refs, ("bleu",), length_ratio=True)["length_ratio"]
        row = f"{evaluated['bleu']:.2f}"
        assert row in markdown

    # Each cell records the machine it finished on.
    from ranmt.runtime.precision import cpu_description

    transf_cell = exp / "runs/reverse/TransF/seed1/cell.json"
    assert json.loads(transf_cell.read_text())["machine"] == {
        "cpu": cpu_description(), "device": "cpu", "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads()}
    # Interrupt: the RAN-ALL cell lost its result; rerunning recomputes only that cell.
    before = transf_cell.stat().st_mtime_ns
    (exp / "runs/reverse/RAN-ALL/seed1/cell.json").unlink()
    calls = _count_trainings(monkeypatch)
    capsys.readouterr()
    main(["experiment", str(path)])
    assert len(calls) == 1 and "RAN-ALL" in calls[0]
    assert transf_cell.stat().st_mtime_ns == before
    # The tables are written once when the cell lands, not again at the end (unchanged).
    assert capsys.readouterr().err.count("results.md and") == 1
    main(["experiment", str(path)])  # nothing to run: the tables are still written once,
    said = capsys.readouterr().err  # their one pair's p-values kept from the last write
    assert said.count("results.md and") == 1
    assert f"0 resampled, 1 kept in {exp / 'bootstrap_cache.json'}" in said
    again = json.loads((exp / "results.json").read_text())
    assert again["datasets"]["reverse"]["tests"]["test"]["scores"] == scores


def test_dry_run_checks_every_cell_of_every_shipped_grid(tmp_path):
    """`ranmt experiment GRID --dry-run` on each configs/experiments/*.yaml: every cell's
    config resolves and its model builds (counted on the meta device); nothing is written."""
    from pathlib import Path

    from ranmt.experiment import plan_experiment

    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "configs" / "experiments").glob("*.yaml"))
    assert len(files) >= 9
    for path in files:
        plan = plan_experiment(path, out=tmp_path / path.stem, log=lambda _m: None)
        assert plan["cells"] and all(c["parameters"] > 0 for c in plan["cells"])
        assert not (tmp_path / path.stem).exists()
    de_en = plan_experiment(root / "configs/experiments/multi30k_de_en_converged.yaml",
                            out=tmp_path / "d", log=lambda _m: None)
    # issue 48: 4 systems x 3 seeds, one precision, to convergence; issue 100: plain TransF too
    assert len(de_en["cells"]) == 15
    assert {(c["precision"], c["validate_every"], c["patience"]) for c in de_en["cells"]} == \
        {("fp32", 500, 4)}
    assert {c["variant"] for c in de_en["cells"]} == {"TransF+AD", "RAN-D", "RAN-ALL", "HC-SA",
                                                      "TransF"}
    wmt = plan_experiment(root / "configs/experiments/wmt14_en_de.yaml", out=tmp_path / "w",
                          log=lambda _m: None)
    assert len(wmt["cells"]) == 21
    assert {c["tokens_per_step_per_rank"] for c in wmt["cells"]} == {25_000}
    assert "newstest2014" in wmt["datasets"]["wmt14-en-de"][0]
    dialogsum = plan_experiment(root / "configs/experiments/dialogsum.yaml",
                                out=tmp_path / "s", log=lambda _m: None)
    # issue 100 item 5: every test reference scored, the rule named
    assert "three references; a line's ROUGE is the max over them" in \
        dialogsum["datasets"]["dialogsum"][0]
    from ranmt.experiment import load_experiment

    summaries = load_experiment(root / "configs/experiments/dialogsum.yaml").cells()
    # validated by its test metric, with its test decode's length limit
    assert {(c.config().train.valid_metric, c.config().decode.max_len_a,
             c.config().decode.max_len_b) for c in summaries} == {("rougeL", 0.5, 20)}


def test_dry_run_of_the_german_english_grid(tmp_path, capsys):
    """The second direction's grid: 4 variants x 3 seeds of de->en, checked and printed."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    main(["experiment", str(root / "configs/experiments/multi30k_de_en.yaml"), "--dry-run",
          "--out", str(tmp_path / "de-en")])
    out = capsys.readouterr().out
    assert ": 12 cells" in out and "(de->en, vocabulary 8000 joint)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("variant "))
    assert [line.split()[0] for line in lines[header + 1:header + 5]] == \
        ["TransF", "RAN-D", "RAN-ALL", "HC-SA"]
    assert "every cell decodes its test sets with {beam: 4" in out
    assert "every cell checked (12)" in out and not (tmp_path / "de-en").exists()
    broken = tmp_path / "broken.yaml"
    broken.write_text((root / "configs/experiments/multi30k_de_en.yaml").read_text()
                      .replace("model.arch: ran-d", "model.arch: ran-x"))
    with pytest.raises(SystemExit):
        main(["experiment", str(broken), "--dry-run", "--out", str(tmp_path / "b")])
    assert "RAN-D / seed 1" in capsys.readouterr().err


def test_concurrent_workers_skip_claimed_cells_and_take_over_stale_locks(tmp_path,
                                                                          monkeypatch):
    """A cell locked by a live worker is skipped (partial tables); a dead worker's lock is
    taken over and the last worker writes the complete tables, also where another worker
    finished a cell after this one last wrote them."""
    import os
    import socket
    import subprocess
    import sys

    path = _grid(tmp_path)
    exp = tmp_path / "exp"
    lock = exp / "runs/reverse/RAN-ALL/seed1/lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(f"{socket.gethostname()} {os.getppid()}")  # a live process, not us
    main(["experiment", str(path)])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is False and [c["variant"] for c in results["cells"]] == ["TransF"]
    assert (exp / "results.md").read_text().startswith("> Partial: 1 of 2 cells")
    assert lock.is_file()  # not ours to remove

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    lock.write_text(f"{socket.gethostname()} {dead}")
    main(["experiment", str(path)])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is True
    assert [c["variant"] for c in results["cells"]] == ["TransF", "RAN-ALL"]
    assert not lock.exists() and "Partial" not in (exp / "results.md").read_text()

    # This worker trains TransF (and writes 1-cell tables) while another finishes RAN-ALL.
    ran_all = exp / "runs/reverse/RAN-ALL/seed1/cell.json"
    finished_elsewhere = ran_all.read_text()
    ran_all.unlink()
    (exp / "runs/reverse/TransF/seed1/cell.json").unlink()
    real_claim = experiment_module.claim

    def claimed_by_a_worker_that_then_finishes(lock_path):
        if "RAN-ALL" in str(lock_path):
            ran_all.write_text(finished_elsewhere)
            return False
        return real_claim(lock_path)

    monkeypatch.setattr(experiment_module, "claim", claimed_by_a_worker_that_then_finishes)
    main(["experiment", str(path)])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] is True
    assert [c["variant"] for c in results["cells"]] == ["TransF", "RAN-ALL"]


def test_signal_during_a_cell_stops_the_worker_without_recording_it(tmp_path, monkeypatch):
    """A SIGTERM'd cell (train returns 'SIGTERM received') is not marked finished, the worker
    exits with status 130 before the next cell, and a rerun resumes and completes the grid;
    --out moves the whole grid, and a moved results folder without its run folders and
    prepared data (a fresh clone) still rebuilds its tables with --tables-only."""
    import shutil

    path = _grid(tmp_path)
    out = tmp_path / "elsewhere"
    real_train = cells_module.train
    calls = []

    def signalled_train(cfg, data_dir, run_dir):
        calls.append(str(run_dir))
        summary = real_train(cfg, data_dir, run_dir)
        return {**summary, "stop_reason": "SIGTERM received"}

    monkeypatch.setattr(cells_module, "train", signalled_train)
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", str(path), "--out", str(out)])
    assert exit_info.value.code == 130
    assert len(calls) == 1  # the worker stopped; RAN-ALL was not started
    cell_dir = out / "runs/reverse/TransF/seed1"
    assert not (cell_dir / "cell.json").exists() and not (cell_dir / "lock").exists()
    assert (cell_dir / "run" / "checkpoints").is_dir()  # saved for resume
    assert not (tmp_path / "exp").exists()  # the file's `out` was overridden

    monkeypatch.setattr(cells_module, "train", real_train)
    main(["experiment", str(path), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] is True

    moved = tmp_path / "moved"  # what a fresh clone has: cells, no run folders, no data
    shutil.copytree(out, moved, ignore=shutil.ignore_patterns("run", "data"))
    shutil.rmtree(out)
    main(["experiment", str(path), "--out", str(moved), "--tables-only"])  # prepares the data
    again = json.loads((moved / "results.json").read_text())
    assert again["datasets"] == results["datasets"]


def test_precision_note_names_the_cells_of_each_precision_and_skips_unrecorded_ones():
    from ranmt.experiment.results import precision_note

    def cell(variant, seed, precision=None):
        train = {"precision": precision} if precision else {}
        return {"dataset": "d", "variant": variant, "seed": seed, "train": train}

    same = [cell("A", 1, "bf16"), cell("A", 2, "bf16"), cell("B", 1)]  # B: not recorded
    assert precision_note(same) == ""
    many = [cell("A", seed, "bf16") for seed in range(1, 6)] + [cell("B", 3, "fp32")]
    assert "(bf16: 5 cells | fp32: d / B / seed 3)" in precision_note(many)


def test_a_stopped_cell_goes_on_in_the_precision_its_checkpoint_records(tmp_path):
    """What the runner warns about is what training does: a resumed run keeps the
    precision it started in (the step checkpoint's trainer state), whatever this machine's
    ``auto`` would pick."""
    from ranmt.checkpoint import FORMAT_VERSION, write_meta
    from ranmt.experiment import load_experiment
    from ranmt.experiment.reuse import precision_it_trains_in

    cell = load_experiment(_grid(tmp_path)).cells()[0]
    step = cell.run_dir / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    for precision in ("bf16", "fp32"):
        write_meta(step, {"format_version": FORMAT_VERSION, "trainer": {"precision": precision}})
        assert precision_it_trains_in(cell, data_dir=None) == precision


def test_significance_rule_on_hand_made_scores():
    """† needs every seed significant in one direction; ‡ is Welch's t-test over seeds."""
    from scipy.stats import t as student_t

    from ranmt.experiment import compare_over_seeds, significance_marks

    base = {1: 30.0, 2: 31.0, 3: 32.0}
    variant = {1: 33.0, 2: 34.0, 3: 35.0}
    result = compare_over_seeds(base, variant, {1: 0.01, 2: 0.02, 3: 0.04}, alpha=0.05)
    assert result["delta"] == 3.0 and result["per_seed_delta"] == [3.0, 3.0, 3.0]
    # Welch by its formula: both variances 1, n = 3: t = 3 / sqrt(2/3), df = 4
    t_stat, df = 3.0 / (2 / 3) ** 0.5, 4.0
    assert abs(result["welch_p"] - 2 * student_t.sf(t_stat, df)) < 1e-9
    assert abs(result["welch_p"] - 0.02131) < 1e-4
    assert result["dagger"] and result["double_dagger"] and significance_marks(result) == "†‡"

    # every seed significant, but the seeds spread too much for the seed-level test
    spread = compare_over_seeds(base, {1: 32.0, 2: 33.5, 3: 34.0}, {1: 0.01, 2: 0.02, 3: 0.04},
                                alpha=0.05)
    var_v = ((7 / 6) ** 2 + (1 / 3) ** 2 + (5 / 6) ** 2) / 2
    se2 = 1 / 3 + var_v / 3
    t_stat = ((32.0 + 33.5 + 34.0) / 3 - 31.0) / se2 ** 0.5
    df = se2 ** 2 / ((1 / 3) ** 2 / 2 + (var_v / 3) ** 2 / 2)
    assert abs(spread["welch_p"] - 2 * student_t.sf(t_stat, df)) < 1e-9
    assert spread["dagger"] and not spread["double_dagger"] and significance_marks(spread) == "†"
    # the baseline one run repeated for every seed: no Welch's test (nor scipy's warning
    # about its constant sample), no double dagger; the seed rule's dagger still stands
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_run = compare_over_seeds({1: 31.0, 2: 31.0, 3: 31.0}, variant,
                                     {1: 0.01, 2: 0.02, 3: 0.04}, alpha=0.05, seed_spread=False)
    assert one_run["welch_p"] is None and not one_run["double_dagger"] and one_run["dagger"]
    # one seed not significant: no dagger (the seed-level test is unchanged)
    one_weak = compare_over_seeds(base, variant, {1: 0.01, 2: 0.2, 3: 0.04}, alpha=0.05)
    assert not one_weak["dagger"] and one_weak["double_dagger"]
    assert significance_marks(one_weak) == "‡"
    # every seed significant but one in the other direction: no dagger
    mixed = compare_over_seeds(base, {1: 32.0, 2: 33.5, 3: 30.0}, {1: 0.01, 2: 0.01, 3: 0.01},
                               alpha=0.05)
    assert not mixed["dagger"] and mixed["per_seed_delta"] == [2.0, 2.5, -2.0]
    assert mixed["welch_p"] > 0.05 and significance_marks(mixed) == ""
    # a single seed: bootstrap only, no seed-level test
    single = compare_over_seeds({1: 30.0}, {1: 29.0}, {1: 0.001}, alpha=0.05)
    assert single["dagger"] and single["welch_p"] is None and not single["double_dagger"]
    assert single["delta"] == -1.0


def test_tables_aggregate_seeds_exactly(tmp_path, monkeypatch):
    """Hand-made cells: mean ± sample std, delta of the means, marks from the rule, steps and
    best steps per seed with * where the best checkpoint is the last."""
    from ranmt.experiment import Dataset, Experiment, build_tables

    def cell(variant, seed, bleu, steps, best):
        scores = {"bleu": bleu, "tok_bleu": bleu + 0.5, "chrf": 50.0 + seed, "ter": 60.0,
                  "sentences_per_s": 10.0, "target_tokens_per_s": 100.0}
        return {"dataset": "d", "variant": variant, "seed": seed, "parameters": 1000,
                "tests": {"t": scores},
                "train": {"steps": steps, "best_step": best, "best_valid_bleu": bleu,
                          "wall_time_s": 60.0, "train_tokens_per_s": 5.0}}

    cells = [cell("TransF", 1, 30.0, 1000, 750), cell("TransF", 2, 31.0, 1000, 1000),
             cell("TransF", 3, 32.0, 1000, 1000), cell("RAN", 1, 32.0, 1000, 1000),
             cell("RAN", 2, 33.5, 1000, 1000), cell("RAN", 3, 34.0, 1000, 500)]
    experiment = Experiment(name="hand", out=tmp_path, datasets=[Dataset(
        name="d", src="s", tgt="t", tests={"t": "t"})], variants=[{"name": "TransF"},
        {"name": "RAN"}], seeds=[1, 2, 3], baseline="TransF", base_config=None, overrides={},
        decode={}, alpha=0.05)
    p_by_seed = {1: 0.01, 2: 0.02, 3: 0.04}
    patch_tables(monkeypatch, "raw_text", lambda *a: ["ref"])
    patch_tables(monkeypatch, "read_hyps", lambda e, c, t: [str(c["seed"])])

    def fake_bootstrap(systems, refs, metrics, samples):
        p = p_by_seed[int(systems[1][1][0])]
        return {"systems": [{}, {f"{m}_p": (p if m == "bleu" else 0.5) for m in metrics}]}

    patch_tables(monkeypatch, "paired_bootstrap", fake_bootstrap)
    markdown, results = build_tables(experiment, cells)
    assert "| SacreBLEU | 31.00 ± 1.00 | 33.17 ± 1.04 (+2.17) † |" in markdown  # Welch p 0.06
    assert "| chrF | 52.00 ± 1.00 | 52.00 ± 1.00 (+0.00) |" in markdown
    assert "| TransF | 3 | 1,000 | 750 / 1,000* / 1,000* |" in markdown
    assert "| RAN | 3 | 1,000 | 1,000* / 1,000* / 500 |" in markdown
    numbers = results["datasets"]["d"]["tests"]["t"]
    assert numbers["scores"]["RAN"]["bleu"]["per_seed"] == {"1": 32.0, "2": 33.5, "3": 34.0}
    assert numbers["significance"]["RAN"]["bleu"]["per_seed_p"] == [0.01, 0.02, 0.04]
    variants = results["datasets"]["d"]["variants"]
    assert variants["TransF"]["still_improving"] == [False, True, True]


def test_per_seed_table_lists_every_cell_and_marks_the_missing_ones(tmp_path, monkeypatch):
    """The per-seed table: a row per seed (in the grid's seed order), a column per variant
    that has a cell, SacreBLEU of the two test sets side by side, "-" for a cell not run."""
    from ranmt.experiment import Dataset, Experiment, build_tables

    def cell(variant, seed, first, second):
        tests = {test: {"bleu": bleu, "sentences_per_s": 1.0, "target_tokens_per_s": 1.0}
                 for test, bleu in (("a", first), ("b", second))}
        return {"dataset": "d", "variant": variant, "seed": seed, "parameters": 1,
                "tests": tests, "train": {"steps": 10, "best_step": 5, "best_valid_bleu": 1.0,
                                          "wall_time_s": 1.0, "train_tokens_per_s": 1.0}}

    cells = [cell("TransF", 3, 30.0, 20.5), cell("TransF", 1, 31.25, 21.0),
             cell("RAN", 1, 33.0, 24.125)]
    experiment = Experiment(
        name="seeds", out=tmp_path, datasets=[Dataset(name="d", src="s", tgt="t",
                                                      tests={"a": "a", "b": "b"})],
        variants=[{"name": "TransF"}, {"name": "RAN"}, {"name": "HC-SA"}], seeds=[1, 2, 3],
        baseline="TransF", base_config=None, overrides={}, decode={}, alpha=0.05)
    patch_tables(monkeypatch, "TASK_METRICS", {"translation": ["bleu"]})
    patch_tables(monkeypatch, "raw_text", lambda *a: ["ref"])
    patch_tables(monkeypatch, "read_hyps", lambda e, c, t: ["hyp"])
    patch_tables(monkeypatch, "paired_bootstrap", lambda *a: {
        "systems": [{}, {"bleu_p": 0.5}]})
    markdown, _ = build_tables(experiment, cells)
    table = markdown.split("## d — SacreBLEU per seed (a / b)\n\n")[1].split("\n\n")[0]
    assert table.splitlines() == ["| seed | TransF | RAN |", "|---|---|---|",
                                  "| 1 | 31.25 / 21.00 | 33.00 / 24.12 |",
                                  "| 3 | 30.00 / 20.50 | - |"]
    # a cell that has not scored test set b (added to the grid after it finished, its
    # checkpoint elsewhere): "-" there, left out of b's table, kept in a's
    del cells[1]["tests"]["b"]
    markdown, results = build_tables(experiment, cells)
    assert "| 1 | 31.25 / - | 33.00 / 24.12 |" in markdown
    assert results["datasets"]["d"]["tests"]["b"]["scores"]["TransF"]["bleu"]["per_seed"] \
        == {"3": 20.5}
    assert results["datasets"]["d"]["tests"]["a"]["scores"]["TransF"]["bleu"]["per_seed"] \
        == {"3": 30.0, "1": 31.25}
    # no cell at all (a dataset whose cells have not run): no empty test tables
    markdown, _ = build_tables(experiment, [])
    assert "## d — a" not in markdown and "## d — training" in markdown


def test_step_budgeted_grid_runs_equal_steps_and_selects_cells(tmp_path, capsys):
    """Two variants x two seeds at train.max_steps: every cell runs exactly that many steps;
    --seeds runs a subset, --tables-only trains nothing, the table states the steps. A
    finished cell recorded in another precision: the cells trained after it say so, and
    results.md names it."""
    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["seeds"] = [1, 2]
    config["overrides"]["train.max_steps"] = 30
    config["overrides"]["train.validate_every"] = 10
    config["overrides"]["train.validate_bleu"] = True  # curves plot validation BLEU
    path.write_text(yaml.safe_dump(config))
    exp = tmp_path / "exp"
    main(["experiment", str(path), "--seeds", "2"])
    results = json.loads((exp / "results.json").read_text())
    assert [(c["variant"], c["seed"]) for c in results["cells"]] == [("TransF", 2),
                                                                     ("RAN-ALL", 2)]
    main(["experiment", str(path), "--tables-only"])
    assert len(json.loads((exp / "results.json").read_text())["cells"]) == 2
    assert "Not every cell trained in the same precision" not in (exp / "results.md").read_text()
    moved = exp / "runs/reverse/RAN-ALL/seed2/cell.json"  # as if trained on another machine
    cell = json.loads(moved.read_text())
    ours = cell["train"]["precision"]
    other = {"fp32": "bf16", "bf16": "fp32"}[ours]
    moved.write_text(json.dumps({**cell, "train": {**cell["train"], "precision": other}}))
    capsys.readouterr()
    main(["experiment", str(path)])
    said = "".join(capsys.readouterr())
    assert said.count(f"trains in {ours}, where finished cells of the grid trained 1 in "
                      f"{other};") == 2, said
    assert (f"({ours}: reverse / TransF / seed 1; reverse / RAN-ALL / seed 1; reverse / "
            f"TransF / seed 2 | {other}: reverse / RAN-ALL / seed 2)"
            ) in (exp / "results.md").read_text()
    moved.write_text(json.dumps(cell))
    main(["experiment", str(path), "--tables-only"])
    results = json.loads((exp / "results.json").read_text())
    assert results["complete"] and len(results["cells"]) == 4
    assert {c["train"]["steps"] for c in results["cells"]} == {30}
    assert all(len(c["train"]["validations"]) == 3 for c in results["cells"])
    assert all((exp / "runs/reverse" / c["variant"] / f"seed{c['seed']}" / "train.log").is_file()
               for c in results["cells"])
    variants = results["datasets"]["reverse"]["variants"]
    assert variants["TransF"]["steps"] == [30, 30] and variants["RAN-ALL"]["steps"] == [30, 30]
    markdown = (exp / "results.md").read_text()
    assert "| TransF | 2 | 30 |" in markdown and "| RAN-ALL | 2 | 30 |" in markdown
    assert (exp / "validation_reverse.png").stat().st_size > 1000
    assert "Not every cell trained in the same precision" not in markdown
    # --baseline: the same cells against RAN-ALL; every difference flips its sign
    main(["experiment", str(path), "--tables-only", "--baseline", "RAN-ALL"])
    against = json.loads((exp / "results.vs-RAN-ALL.json").read_text())
    assert against["baseline"] == "RAN-ALL"
    ours = results["datasets"]["reverse"]["tests"]["test"]["significance"]
    theirs = against["datasets"]["reverse"]["tests"]["test"]["significance"]
    assert set(theirs) == {"TransF"}
    for metric in ("bleu", "chrf", "ter"):
        assert theirs["TransF"][metric]["delta"] == pytest.approx(
            -ours["RAN-ALL"][metric]["delta"])
    assert "against **RAN-ALL**" in (exp / "results.vs-RAN-ALL.md").read_text()
    with pytest.raises(ConfigError, match="--baseline"):
        run_experiment(path, tables_only=True, baselines=["RAN-X"])
    # a later write without --baseline (a worker landing a cell) keeps that comparison current
    hidden = moved.with_name("cell.json.away")
    moved.rename(hidden)
    main(["experiment", str(path), "--tables-only"])
    against = json.loads((exp / "results.vs-RAN-ALL.json").read_text())
    assert against["datasets"]["reverse"]["tests"]["test"]["significance"]["TransF"]["bleu"][
        "seeds"] == [1]
    hidden.rename(moved)
    main(["experiment", str(path), "--tables-only"])
    against = json.loads((exp / "results.vs-RAN-ALL.json").read_text())
    assert against["datasets"]["reverse"]["tests"]["test"]["significance"]["TransF"]["bleu"][
        "seeds"] == [1, 2]


def test_a_variant_runs_only_with_its_own_seeds(tmp_path):
    """A variant's ``seeds`` (a teacher trained once) restricts its cells, in the grid, the
    selection and the dry-run plan; seeds outside the grid's, or a distilled dataset whose
    teacher seed its variant never runs, are errors."""
    from ranmt.experiment.loading import load_experiment
    from ranmt.experiment.plan import plan_experiment

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["seeds"] = [1, 2, 3]
    config["variants"][1]["seeds"] = [2]
    path.write_text(yaml.safe_dump(config))
    grid = load_experiment(path)
    cells = [(c.variant.name, c.seed) for c in grid.cells()]
    assert cells == [("TransF", 1), ("TransF", 2), ("RAN-ALL", 2), ("TransF", 3)]
    assert [(c.variant.name, c.seed) for c in grid.select(["RAN-ALL"], None)] == \
        [("RAN-ALL", 2)]
    assert grid.select(["RAN-ALL"], [1]) == []
    planned = [(c["variant"], c["seed"])
               for c in plan_experiment(path, log=lambda *_: None)["cells"]]
    assert sorted(planned) == sorted(cells)
    config["variants"][1]["seeds"] = [4]
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"RAN-ALL: seeds \[4\]"):
        load_experiment(path)
    config["variants"][1]["seeds"] = [2]
    config["datasets"].append({"name": "distilled", "src": "src", "tgt": "tgt",
                               "distill": {"teacher": {"dataset": "reverse",
                                                       "variant": "RAN-ALL", "seed": 1}}})
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="does not run with seed 1"):
        load_experiment(path)
    # a distilled dataset is scored on its teacher dataset's test sets: all of them by
    # default, or those it lists, which must be among them
    config["datasets"][1]["distill"]["teacher"]["variant"] = "TransF"
    path.write_text(yaml.safe_dump(config))
    assert load_experiment(path).datasets[1].tests == {"test": "test"}
    config["datasets"][1]["tests"] = ["test", "test_2099"]
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"test sets \['test_2099'\] are not test sets"):
        load_experiment(path)
    # a WMT download without tests is scored on its official test set; a dataset with no
    # test set at all is an error
    config["datasets"][1].pop("tests")
    config["datasets"].append({"name": "wmt", "src": "en", "tgt": "de",
                               "download": {"dataset": "wmt14", "pair": "de-en"}})
    path.write_text(yaml.safe_dump(config))
    assert load_experiment(path).datasets[2].tests == {"newstest2014": "newstest2014"}
    config["datasets"][0].pop("tests")
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="dataset reverse lists no test sets"):
        load_experiment(path)


def test_unknown_variant_or_seed_selection_is_an_error(tmp_path):
    path = _grid(tmp_path)
    with pytest.raises(ConfigError, match="not in the grid"):
        run_experiment(path, variants=["RAN-X"])
    with pytest.raises(ConfigError, match="seeds"):
        run_experiment(path, seeds=[7])


def test_reuse_copies_the_same_training_from_another_grid_and_nothing_else(tmp_path,
                                                                           monkeypatch):
    """--reuse: a cell whose seed, resolved config and prepared data equal a finished cell of
    another grid is copied (whatever its variant is called there), a cell that differs in
    config is trained, and data that differs by one byte blocks the reuse."""
    import shutil

    from ranmt.experiment import Cell, find_reusable_cell, load_experiment

    path = _grid(tmp_path)
    main(["experiment", str(path), "--out", str(tmp_path / "first")])
    first = json.loads((tmp_path / "first" / "results.json").read_text())

    config = yaml.safe_load(path.read_text())
    config["name"], config["baseline"] = "ablations", "Baseline"
    config["variants"] = [{"name": "Baseline", "overrides": {"model.arch": "transf"}},
                          {"name": "RAN-ALL-fixed", "overrides": {
                              "model.arch": "ran-all", "model.ran.fixed_initial": True}}]
    second_path = tmp_path / "second.yaml"
    second_path.write_text(yaml.safe_dump(config))
    calls = _count_trainings(monkeypatch)
    out = tmp_path / "second"
    main(["experiment", str(second_path), "--out", str(out), "--reuse", str(tmp_path / "first")])
    assert len(calls) == 1 and "RAN-ALL-fixed" in calls[0]
    cell = json.loads((out / "runs/reverse/Baseline/seed1/cell.json").read_text())
    assert cell["variant"] == "Baseline"
    assert cell["reused_from"] == str(tmp_path / "first/runs/reverse/TransF/seed1")
    assert (out / "runs/reverse/Baseline/seed1/test.hyp").read_bytes() == \
        (tmp_path / "first/runs/reverse/TransF/seed1/test.hyp").read_bytes()
    second = json.loads((out / "results.json").read_text())
    assert second["complete"] is True
    scores = second["datasets"]["reverse"]["tests"]["test"]["scores"]
    assert scores["Baseline"] == first["datasets"]["reverse"]["tests"]["test"]["scores"]["TransF"]

    # the same config over data that differs by one byte is not the same training
    altered = tmp_path / "altered"
    shutil.copytree(out / "data" / "reverse", altered)
    with open(altered / "train.tgt.tokens.npy", "ab") as handle:
        handle.write(b"\0")
    experiment = load_experiment(second_path)
    dataset, baseline = experiment.datasets[0], experiment.variants[0]
    messages = []
    seed1, seed2 = Cell(experiment, dataset, baseline, 1), Cell(experiment, dataset, baseline, 2)
    assert find_reusable_cell(seed1, out / "data" / "reverse", [tmp_path / "first"],
                              messages.append) is not None
    assert find_reusable_cell(seed1, altered, [tmp_path / "first"], messages.append) is None
    assert any("train.tgt.tokens.npy differs" in m for m in messages)
    assert find_reusable_cell(seed2, out / "data" / "reverse", [tmp_path / "first"],
                              messages.append) is None  # other seed

    # the same training whose grid's data folder was never prepared here (data/ is not
    # committed with the cells): an error that says how to prepare it, not hours of training
    (tmp_path / "first" / "data").rename(tmp_path / "first-data")
    with pytest.raises(ConfigError, match=r"cannot be compared.*--tables-only"):
        find_reusable_cell(seed1, out / "data" / "reverse", [tmp_path / "first"],
                           messages.append)
    assert find_reusable_cell(seed2, out / "data" / "reverse", [tmp_path / "first"],
                              messages.append) is None  # no candidate: nothing to prepare


def test_warm_start_state_keeps_only_what_the_longer_training_would_hold():
    """The trainer state a warm-started cell takes over: the source's validations at the
    cell's own validation steps only; none when the source's best is not its last step or
    it skipped one of the cell's validations."""
    from ranmt.experiment import warm_start_state

    validations = [{"step": s, "valid_loss": 5.0 - s / 100} for s in (10, 20, 30, 40)]
    trainer = {"step": 40, "best_step": 40, "best_bleu": -4.6, "bad_validations": 0,
               "validations": validations}
    state = warm_start_state(trainer, 20)
    assert [v["step"] for v in state["validations"]] == [20, 40]
    assert state["best_step"] == 40 and state["bad_validations"] == 0
    assert warm_start_state(trainer, 40)["validations"] == [validations[3]]
    assert warm_start_state(trainer, 30) is None          # 40 is not a validation step of it
    assert warm_start_state({**trainer, "best_step": 30}, 10) is None  # best not at 40
    assert warm_start_state({**trainer, "validations": validations[1:]}, 10) is None


def test_reuse_warm_starts_a_longer_training_and_ends_where_training_from_scratch_does(
        tmp_path, monkeypatch):
    """--reuse DIR with a grid whose cells are DIR's cells trained on (more steps, sparser
    validation, patience): the cell resumes from DIR's checkpoint and ends bit-identical to
    the same cell trained from scratch (weights, validations, best step, hypotheses)."""
    from safetensors.torch import load_file

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["variants"] = config["variants"][:1]
    config["overrides"].update({"train.max_steps": 20, "train.validate_every": 10})
    short_path = tmp_path / "short.yaml"
    short_path.write_text(yaml.safe_dump(config))
    config["overrides"].update({"train.max_steps": 40, "train.validate_every": 20,
                                "train.patience": 5})
    long_path = tmp_path / "long.yaml"
    long_path.write_text(yaml.safe_dump(config))

    main(["experiment", str(short_path), "--out", str(tmp_path / "short")])
    main(["experiment", str(long_path), "--out", str(tmp_path / "scratch")])
    calls = _count_trainings(monkeypatch)
    main(["experiment", str(long_path), "--out", str(tmp_path / "warm"),
          "--reuse", str(tmp_path / "short")])
    assert len(calls) == 1  # trained (from step 20 on), not copied: it is not the same run

    cell_path = "runs/reverse/TransF/seed1"
    scratch = json.loads((tmp_path / "scratch" / cell_path / "cell.json").read_text())
    warm = json.loads((tmp_path / "warm" / cell_path / "cell.json").read_text())
    assert warm["warm_started_from"]["step"] == 20
    assert "warm_started_from" not in scratch
    assert warm["train"]["steps"] == scratch["train"]["steps"] == 40
    assert warm["train"]["best_step"] == scratch["train"]["best_step"]
    assert warm["train"]["validations"] == scratch["train"]["validations"]
    assert [v["step"] for v in warm["train"]["validations"]] == [20, 40]
    for folder in ("best", "checkpoints/step_00000040"):
        ours = load_file(tmp_path / "warm" / cell_path / "run" / folder / "model.safetensors")
        theirs = load_file(tmp_path / "scratch" / cell_path / "run" / folder /
                           "model.safetensors")
        assert ours.keys() == theirs.keys()
        assert all(ours[name].equal(theirs[name]) for name in ours)
    assert (tmp_path / "warm" / cell_path / "test.hyp").read_bytes() == \
        (tmp_path / "scratch" / cell_path / "test.hyp").read_bytes()
    assert "warm start: steps 1-20" in (tmp_path / "warm" / cell_path / "train.log").read_text()


def test_a_cell_stopped_by_sigterm_resumes_from_another_checkout_bit_identical(
        tmp_path, monkeypatch):
    """--work / $RANMT_WORK_DIR keep the run folders outside the grid's output folder: a
    cell SIGTERM'd mid-training in one checkout resumes from its checkpoint in another
    checkout (whose output folder has no run folder, as in a fresh clone) and ends
    bit-identical to the same cell trained without interruption."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["variants"] = config["variants"][:1]
    steps = 80
    last = f"step_{steps:08d}"
    config["overrides"].update({"train.max_steps": steps, "train.validate_every": 10,
                                "train.threads": 1})
    path.write_text(yaml.safe_dump(config))
    cell = "runs/reverse/TransF/seed1"

    def experiment(out, work):
        argv = [sys.executable, "-m", "ranmt", "experiment", str(path), "--out", str(out),
                "--work", str(work)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    straight = experiment(tmp_path / "straight" / "grid", tmp_path / "work-straight")
    assert straight.wait(timeout=600) == 0, straight.stderr.read().decode()

    work = tmp_path / "work"
    run_dir = work / "grid" / cell / "run"
    stopped = experiment(tmp_path / "checkout-a" / "grid", work)
    deadline = time.time() + 300
    while not (run_dir / "checkpoints/step_00000020/checkpoint.json").exists():
        assert time.time() < deadline and stopped.poll() is None
        time.sleep(0.02)
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=120) == 130, stopped.stderr.read().decode()
    assert not (tmp_path / "checkout-a" / "grid" / cell / "cell.json").exists()
    assert not (tmp_path / "checkout-a" / "grid" / cell / "run").exists()
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved and saved[-1] < last  # stopped before the end

    # Another checkout: the grid's committed files only (no run folder, no lock).
    shutil.copytree(tmp_path / "checkout-a" / "grid", tmp_path / "checkout-b" / "grid",
                    ignore=shutil.ignore_patterns("run", "lock"))
    calls = _count_trainings(monkeypatch)
    monkeypatch.setenv("RANMT_WORK_DIR", str(work))
    main(["experiment", str(path), "--out", str(tmp_path / "checkout-b" / "grid")])
    assert calls == [str(run_dir)]
    assert os.path.isfile(tmp_path / "checkout-b" / "grid" / cell / "cell.json")

    ours = json.loads((tmp_path / "checkout-b" / "grid" / cell / "cell.json").read_text())
    theirs = json.loads((tmp_path / "straight" / "grid" / cell / "cell.json").read_text())
    assert ours["train"]["steps"] == theirs["train"]["steps"] == steps
    assert ours["train"]["validations"] == theirs["train"]["validations"]
    assert ours["train"]["best_step"] == theirs["train"]["best_step"]
    straight_run = tmp_path / "work-straight" / "grid" / cell / "run"
    for folder in ("best", f"checkpoints/{last}"):
        a = load_file(run_dir / folder / "model.safetensors")
        b = load_file(straight_run / folder / "model.safetensors")
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert (tmp_path / "checkout-b" / "grid" / cell / "test.hyp").read_bytes() == \
        (tmp_path / "straight" / "grid" / cell / "test.hyp").read_bytes()
    assert "resum" in (tmp_path / "checkout-b" / "grid" / cell / "train.log").read_text()
    shutil.rmtree(work)  # the tables need only the checkout's cell.json and hypotheses
    main(["experiment", str(path), "--out", str(tmp_path / "checkout-b" / "grid"),
          "--tables-only"])


def test_seed_rule_marks_a_five_variant_three_seed_table_against_two_baselines(tmp_path,
                                                                             monkeypatch):
    """Hand-made scores, five variants x three seeds, tables against TransF and against
    TransF+AD: each cell of the SacreBLEU row shows mean ± std, the difference to that
    table's baseline and the marks the rule gives (Welch p of equal-variance seeds: delta 4
    -> 0.008, 3 -> 0.021, 2 -> 0.070, 1 -> 0.29)."""
    from dataclasses import replace

    from ranmt.experiment import Dataset, Experiment, build_tables

    means = {"TransF": 31.0, "TransF+AD": 32.0, "RAN-ALL": 35.0, "HC-SA": 33.0, "RAN-E": 30.0}
    weak = {("HC-SA", "TransF+AD", 2)}  # one seed's bootstrap not significant

    def cell(variant, seed):
        bleu = means[variant] + (seed - 2)  # seeds 1-3: mean - 1, mean, mean + 1 (std 1)
        return {"dataset": "d", "variant": variant, "seed": seed, "parameters": 1000,
                "tests": {"t": {"bleu": bleu, "sentences_per_s": 1.0,
                                "target_tokens_per_s": 1.0}},
                "train": {"steps": 10, "best_step": 5, "best_valid_bleu": bleu,
                          "wall_time_s": 1.0, "train_tokens_per_s": 1.0}}

    cells = [cell(v, s) for s in (1, 2, 3) for v in means]
    experiment = Experiment(
        name="five", out=tmp_path, datasets=[Dataset(name="d", src="s", tgt="t",
                                                     tests={"t": "t"}, task="translation")],
        variants=[{"name": v} for v in means], seeds=[1, 2, 3], baseline="TransF",
        base_config=None, overrides={}, decode={}, alpha=0.05)
    patch_tables(monkeypatch, "TASK_METRICS", {"translation": ["bleu"]})
    patch_tables(monkeypatch, "raw_text", lambda *a: ["ref"])
    patch_tables(monkeypatch, "read_hyps",
                        lambda e, c, t: [f"{c['variant']}|{c['seed']}"])

    def fake_bootstrap(systems, refs, metrics, samples):
        """One test per seed: the baseline, then every variant of that seed."""
        base, seed = systems[0][1][0].split("|")
        rows = [{}]
        for _, hyps in systems[1:]:
            variant, variant_seed = hyps[0].split("|")
            assert variant_seed == seed
            rows.append({"bleu_p": 0.2 if (variant, base, int(seed)) in weak else 0.01})
        return {"systems": rows}

    patch_tables(monkeypatch, "paired_bootstrap", fake_bootstrap)
    against_transf, _ = build_tables(experiment, cells)
    against_ad, results = build_tables(replace(experiment, baseline="TransF+AD"), cells)
    assert ("| SacreBLEU | 31.00 ± 1.00 | 32.00 ± 1.00 (+1.00) † | 35.00 ± 1.00 (+4.00) †‡ | "
            "33.00 ± 1.00 (+2.00) † | 30.00 ± 1.00 (-1.00) † |") in against_transf
    assert ("| SacreBLEU | 31.00 ± 1.00 (-1.00) † | 32.00 ± 1.00 | 35.00 ± 1.00 (+3.00) †‡ | "
            "33.00 ± 1.00 (+1.00) | 30.00 ± 1.00 (-2.00) † |") in against_ad
    welch = results["datasets"]["d"]["tests"]["t"]["significance"]["RAN-ALL"]["bleu"]
    assert abs(welch["welch_p"] - 0.0213) < 1e-3


def _check_valid_sweep(entry: dict, run: Path, data: Path, sources: list[str],
                       hyp_file: Path) -> None:
    """An ``also_decode`` sweep: each row is the valid split decoded with that value (the
    grid's beam 2 and the setting's max_len_b 2), the chosen value is the first of the best
    BLEU at two decimals, and the test hypotheses are the chosen value's."""
    from ranmt.data.corpus import raw_text
    from ranmt.evaluate import score
    from ranmt.inference.translator import Translator

    valid_src, valid_ref = raw_text(data, "valid", "src"), raw_text(data, "valid", "tgt")
    bleu = {}
    for a in (0.0, 0.5):
        hyps = Translator.load(run, device="cpu", beam=2, max_len_b=2,
                               max_len_a=a).translate(valid_src)
        bleu[a] = round(score(hyps, valid_ref, ["bleu"], "")["bleu"], 2)
    rows = entry["chosen"]["rows"]
    assert [(row["values"]["max_len_a"], round(row["bleu"], 2)) for row in rows] == \
        list(bleu.items())
    expected = 0.5 if bleu[0.5] > bleu[0.0] else 0.0
    assert entry["chosen"]["value"] == {"max_len_a": expected}
    assert entry["chosen"]["split"] == "valid" and entry["chosen"]["select"] == "bleu"
    at = {a: Translator.load(run, device="cpu", beam=2, max_len_b=2,
                             max_len_a=a).translate(sources) for a in (0.0, 0.5)}
    unswept = Translator.load(run, device="cpu", beam=2, max_len_b=2).translate(sources)
    assert at[0.0] != at[0.5] and unswept != at[expected]  # the choice shows in the outputs
    assert hyp_file.read_text().split("\n")[:-1] == at[expected]


def test_also_decode_scores_other_settings_and_fills_in_finished_cells(tmp_path, monkeypatch):
    """``also_decode``: a finished cell of a grid that gained the setting later is decoded
    with it without training again; its hypotheses are the translator's with those
    settings; a shortlist is built beside the checkpoint from the cell's training split;
    the table gives the difference to the grid's decode of the same checkpoint. A test set
    the grid gains later is prepared and decoded the same way."""
    import numpy as np

    from ranmt.data.corpus import extra_references, raw_text
    from ranmt.evaluate import score
    from ranmt.inference.shortlist import SHORTLIST_FILE, Shortlist, build_shortlist
    from ranmt.inference.translator import Translator

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["variants"] = config["variants"][:1]
    path.write_text(yaml.safe_dump(config))
    main(["experiment", str(path)])
    exp, calls = tmp_path / "exp", _count_trainings(monkeypatch)
    cell_file, run = exp / "runs/reverse/TransF/seed1/cell.json", \
        exp / "runs/reverse/TransF/seed1/run"
    assert "also_decode" not in json.loads(cell_file.read_text())
    config["also_decode"] = {"greedy": {"beam": 1},
                             "short-int8": {"shortlist": True, "quantize": "int8"},
                             "valid-len": {"sweep": {"max_len_a": [0, 0.5]}, "max_len_b": 2}}
    path.write_text(yaml.safe_dump(config))
    main(["experiment", str(path)])
    assert calls == []  # decoded, not trained again
    cell = json.loads(cell_file.read_text())
    assert list(cell["also_decode"]) == ["greedy", "short-int8", "valid-len"]
    data = exp / "data" / "reverse"
    sources, refs = raw_text(data, "test", "src"), raw_text(data, "test", "tgt")
    _check_valid_sweep(cell["also_decode"]["valid-len"], run, data, sources,
                       (exp / "runs/reverse/TransF/seed1/test.valid-len.hyp"))
    greedy = Translator.load(run, device="cpu", beam=1).translate(sources)
    assert cell["also_decode"]["greedy"]["tests"]["test"]["bleu"] == pytest.approx(
        score(greedy, refs, ["bleu"], "")["bleu"])
    assert (exp / "runs/reverse/TransF/seed1/test.greedy.hyp").read_text().split("\n")[:-1] \
        == greedy
    built = Shortlist.load(run / SHORTLIST_FILE)
    assert np.array_equal(built.candidates, build_shortlist(data).candidates)
    shortlisted = Translator.load(run, device="cpu", beam=2, quantize="int8",
                                  shortlist=True).translate(sources)
    assert (exp / "runs/reverse/TransF/seed1/test.short-int8.hyp").read_text() \
        .split("\n")[:-1] == shortlisted
    markdown = (exp / "results.md").read_text()
    main_bleu = cell["tests"]["test"]["bleu"]
    alt_bleu = cell["also_decode"]["greedy"]["tests"]["test"]["bleu"]
    assert "| TransF | greedy | 1 | " in markdown
    chosen_a = cell["also_decode"]["valid-len"]["chosen"]["value"]["max_len_a"]
    assert f"| TransF | valid-len (max_len_a {chosen_a:g}) | 1 | " in markdown
    assert "sweep: {max_len_a: [0.0, 0.5]}" in markdown
    assert f"{alt_bleu:.2f} ({alt_bleu - main_bleu:+.2f})" in markdown
    # a third run has nothing left to do: cell.json stays as it is
    before = cell_file.stat().st_mtime_ns
    main(["experiment", str(path)])
    assert cell_file.stat().st_mtime_ns == before and calls == []
    # a test set added to the dataset later is encoded into its prepared data (with its
    # SentencePiece models, the other splits untouched) and decoded both ways, untrained
    train_tokens = (data / "train.src.tokens.npy").read_bytes()
    src2, tgt2 = reverse_task(30, 7)
    write_parallel(tmp_path / "test2", src2, tgt2)
    (tmp_path / "test2.tgt2").write_text("".join(t + "\n" for t in tgt2))  # a 2nd reference
    config["datasets"][0]["tests"]["test2"] = str(tmp_path / "test2")
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(cells_module, "choose_on_valid",
                        lambda *a: pytest.fail("the value chosen on valid is chosen again"))
    main(["experiment", str(path)])
    assert calls == [] and (data / "train.src.tokens.npy").read_bytes() == train_tokens
    assert raw_text(data, "test2", "src") == src2
    assert extra_references(data, "test2") == [tgt2]  # (the same text: BLEU as with one)
    cell = json.loads(cell_file.read_text())
    beam2 = Translator.load(run, device="cpu", beam=2).translate(src2)
    assert cell["tests"]["test2"]["bleu"] == pytest.approx(score(beam2, tgt2, ["bleu"],
                                                                 "")["bleu"])
    assert (exp / "runs/reverse/TransF/seed1/test2.hyp").read_text().split("\n")[:-1] \
        == beam2
    assert [sorted(entry["tests"]) for entry in cell["also_decode"].values()] == \
        [["test", "test2"]] * 3
    swept = Translator.load(run, device="cpu", beam=2, max_len_b=2,
                            max_len_a=chosen_a).translate(src2)
    assert (exp / "runs/reverse/TransF/seed1/test2.valid-len.hyp").read_text() \
        .split("\n")[:-1] == swept
    assert "## reverse — test2" in (exp / "results.md").read_text()


def test_a_setting_that_cannot_decode_never_costs_a_cell_its_result(tmp_path, monkeypatch,
                                                                   capsys):
    """An ``also_decode`` setting whose copy cannot be loaded here is logged and left out:
    the cell is recorded with its grid decode and the other settings, and the next run
    tries the missing setting again."""
    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["variants"] = config["variants"][:1]
    config["also_decode"] = {"int8": {"quantize": "int8"}, "greedy": {"beam": 1}}
    path.write_text(yaml.safe_dump(config))
    real_load = cells_module.Translator.load

    def failing_load(checkpoint, **options):
        if options.get("quantize") == "int8":
            raise ValueError("no int8 kernels here")
        return real_load(checkpoint, **options)

    monkeypatch.setattr(cells_module.Translator, "load", failing_load)
    main(["experiment", str(path)])
    cell_file = tmp_path / "exp/runs/reverse/TransF/seed1/cell.json"
    assert list(json.loads(cell_file.read_text())["also_decode"]) == ["greedy"]
    assert "cannot decode as 'int8' here, left out: no int8 kernels here" in \
        "".join(capsys.readouterr())
    monkeypatch.setattr(cells_module.Translator, "load", real_load)
    calls = _count_trainings(monkeypatch)
    main(["experiment", str(path)])
    assert calls == [] and list(json.loads(cell_file.read_text())["also_decode"]) == \
        ["greedy", "int8"]


def test_also_decode_table_gives_per_seed_differences_and_marks(tmp_path, monkeypatch):
    """Hand-made cells: the setting's mean, the mean ± std of its per-seed differences to
    the grid's decode, † only where every seed's bootstrap is significant in one
    direction."""
    from ranmt.experiment import Dataset, Experiment, build_tables

    def cell(seed, bleu, alt_bleu):
        main_scores = {"bleu": bleu, "tok_bleu": bleu, "chrf": 50.0, "ter": 60.0,
                       "sentences_per_s": 1.0, "target_tokens_per_s": 1.0}
        alt = {**main_scores, "bleu": alt_bleu, "hyp_file": "x"}
        return {"dataset": "d", "variant": "S", "seed": seed, "parameters": 1,
                "tests": {"t": main_scores},
                "also_decode": {"sl": {"settings": {"shortlist": True}, "tests": {"t": alt}}},
                "train": {"steps": 1, "best_step": 1, "best_valid_bleu": bleu,
                          "wall_time_s": 1.0, "train_tokens_per_s": 1.0}}

    experiment = Experiment(name="hand", out=tmp_path, datasets=[Dataset(
        name="d", src="s", tgt="t", tests={"t": "t"})], variants=[{"name": "S"}],
        seeds=[1, 2, 3], baseline="S", base_config=None, overrides={}, decode={"beam": 4},
        also_decode={"sl": {"shortlist": True}})
    patch_tables(monkeypatch, "raw_text", lambda *a: ["ref"])
    patch_tables(monkeypatch, "read_hyps",
                        lambda e, c, t, recorded=None, setting=None: [str(c["seed"])])
    p_values = {"bleu": {1: 0.01, 2: 0.01, 3: 0.01}}

    def fake_bootstrap(systems, refs, metrics, samples):
        seed = int(systems[0][1][0])
        return {"systems": [{}, {f"{m}_p": p_values.get(m, {}).get(seed, 0.9)
                                 for m in metrics}]}

    patch_tables(monkeypatch, "paired_bootstrap", fake_bootstrap)
    cells = [cell(1, 30.0, 29.5), cell(2, 31.0, 30.7), cell(3, 32.0, 31.6)]
    markdown, results = build_tables(experiment, cells)
    # deltas -0.5, -0.3, -0.4: mean -0.40, sample std 0.10; BLEU (tokenized) unchanged
    assert ("| S | sl | 3 | 31.00 ± 1.00 (+0.00 ± 0.00) | 30.60 ± 1.05 (-0.40 ± 0.10) † | "
            "50.00 ± 0.00 (+0.00 ± 0.00) | 60.00 ± 0.00 (+0.00 ± 0.00) |") in markdown
    numbers = results["datasets"]["d"]["also_decode"]["t"]["S"]["sl"]["bleu"]
    assert numbers["per_seed_delta"] == pytest.approx({"1": -0.5, "2": -0.3, "3": -0.4})
    p_values["bleu"][2] = 0.2  # one seed not significant: no mark
    markdown, _ = build_tables(experiment, cells)
    row = next(line for line in markdown.split("\n") if line.startswith("| S | sl |"))
    assert "(-0.40 ± 0.10)" in row and "†" not in row


def _hand_cell(dataset: str, variant: str, seed: int, bleu: float) -> dict:
    """A finished cell made by hand: one test set "t", SacreBLEU ``bleu``, the rest fixed."""
    scores = {"bleu": bleu, "tok_bleu": bleu, "chrf": 50.0, "ter": 60.0,
              "sentences_per_s": 1.0, "target_tokens_per_s": 1.0}
    return {"dataset": dataset, "variant": variant, "seed": seed, "parameters": 1,
            "tests": {"t": scores},
            "train": {"steps": 1, "best_step": 1, "best_valid_bleu": bleu,
                      "wall_time_s": 1.0, "train_tokens_per_s": 1.0}}


def test_comparisons_across_datasets_give_per_seed_differences_and_marks(tmp_path,
                                                                        monkeypatch):
    """Hand-made cells: a student on distilled data against itself on the original (seed
    by seed; † and ‡ as in the main tables) and against one teacher run (†, never ‡: the
    teacher's seed spread is unknown); no cell against itself; a dataset whose references
    differ is left out."""
    from ranmt.experiment import Dataset, Experiment, build_tables
    from ranmt.experiment.spec import Comparison

    distill = {"teacher": {"dataset": "orig", "variant": "T", "seed": 1}}
    experiment = Experiment(
        name="hand", out=tmp_path, datasets=[
            Dataset(name="orig", src="s", tgt="t", tests={"t": "t"}),
            Dataset(name="dist", src="s", tgt="t", tests={"t": "t"}, distill=distill),
            Dataset(name="fr", src="s", tgt="t", tests={"t": "t"})],
        variants=[{"name": "T", "datasets": ("orig",), "seeds": (1,)}, {"name": "S"}],
        seeds=[1, 2, 3], baseline="S", base_config=None, overrides={}, decode={},
        comparisons=[Comparison("distillation", (("dataset", "orig"),), ("dist", "fr")),
                     Comparison("teacher", (("dataset", "orig"), ("seed", 1),
                                            ("variant", "T")))])
    patch_tables(monkeypatch, "raw_text",
                        lambda folder, *a: ["other ref" if Path(folder).name == "fr"
                                            else "ref"])
    patch_tables(monkeypatch, "read_hyps",
                        lambda e, c, t, recorded=None, setting=None:
                        [f"{c['dataset']} {c['variant']} {c['seed']}"])
    first_systems = set()

    def fake_bootstrap(systems, refs, metrics, samples):
        first_systems.add(systems[0][0])
        return {"systems": [{}, {f"{m}_p": 0.01 if m == "bleu" else 0.9 for m in metrics}]}

    patch_tables(monkeypatch, "paired_bootstrap", fake_bootstrap)
    cells = [_hand_cell("orig", "T", 1, 35.0)]
    for seed, original, distilled in ((1, 30.0, 31.5), (2, 31.0, 32.2), (3, 32.0, 33.3)):
        cells += [_hand_cell("orig", "S", seed, original),
                  _hand_cell("dist", "S", seed, distilled), _hand_cell("fr", "S", seed, 9.0)]
    markdown, results = build_tables(experiment, cells)
    rows = [line for line in markdown.split("\n") if line.startswith(("| orig |", "| dist |",
                                                                       "| fr |"))]
    # distillation: +1.5, +1.2, +1.3 -> +1.33 ± 0.15; Welch p ~ 0.17: † alone
    assert rows[0] == ("| dist | S | orig / S | 3 | 32.33 ± 0.91 (+1.33 ± 0.15) | "
                       "32.33 ± 0.91 (+1.33 ± 0.15) † | 50.00 ± 0.00 (+0.00 ± 0.00) | "
                       "60.00 ± 0.00 (+0.00 ± 0.00) |")
    # against the teacher (35.0): -5, -4, -3 and -3.5, -2.8, -1.7; Welch against a
    # constant would give p ~ 0.02 (‡): not drawn for one teacher run
    assert rows[1].startswith("| orig | S | orig / T / seed 1 | 3 | 31.00 ± 1.00 (-4.00 ± "
                              "1.00) | 31.00 ± 1.00 (-4.00 ± 1.00) † |")
    assert rows[2].startswith("| dist | S | orig / T / seed 1 | 3 | 32.33 ± 0.91 (-2.67 ± "
                              "0.91) | 32.33 ± 0.91 (-2.67 ± 0.91) † |")
    assert len(rows) == 3 and "‡" not in markdown.split("## teacher")[1]
    numbers = results["comparisons"]["distillation"]["t"]["dist"]["S"]["bleu"]
    assert numbers["per_seed_delta"] == pytest.approx({"1": 1.5, "2": 1.2, "3": 1.3})
    assert numbers["significance"]["dagger"] and not numbers["significance"]["double_dagger"]
    teacher = results["comparisons"]["teacher"]["t"]["orig"]["S"]["bleu"]["significance"]
    assert teacher["welch_p"] is None and teacher["dagger"]
    # (the main tables' bootstraps name the baseline, S, first)
    assert first_systems == {"S", "comparison distillation", "comparison teacher"}


@pytest.mark.parametrize("key, value, message", [
    ("comparisons", [{"against": {"dataset": "reverse"}}], "needs a name"),
    ("comparisons", [{"name": "a", "against": {"dataset": "reverse"}}] * 2, "two comparisons"),
    ("comparisons", [{"name": "a", "against": {}}], "against maps"),
    ("comparisons", [{"name": "a", "against": {"datset": "reverse"}}], "against maps"),
    ("comparisons", [{"name": "a", "against": {"dataset": "wmt"}}], "against.dataset 'wmt'"),
    ("comparisons", [{"name": "a", "against": {"seed": 4}}], "against.seed 4"),
    ("comparisons", [{"name": "a", "against": {"variant": "TransF"}, "variants": ["X"]}],
     r"variants \['X'\]"),
    ("comparisons", [{"name": "a", "against": {"variant": "TransF"}, "rows": 1}],
     "unknown key"),
    ("comparisons", {"name": "a"}, "comparisons lists"),
    ("also_decode", {"bad name": {"beam": 1}}, "letters, digits"),
    ("also_decode", {"x": {"beem": 1}}, "did you mean beam"),
    ("also_decode", {"x": {"quantize": "int4"}}, "not one of"),
    ("also_decode", {"x": {}}, "at least one option"),
    ("also_decode", {"x": {"beam": 0}}, "also_decode.x"),
    ("also_decode", {"x": {"quantize": "int8", "precision": "bf16"}}, "alternatives"),
    ("also_decode", {"x": {"sweep": {"lenpen": []}}}, "no values"),
    ("also_decode", {"x": {"sweep": {"beam": [0, 2]}}}, r"also_decode.x.sweep beam"),
    ("also_decode", {"x": {"sweep": {"lenpen": [1.0], "beam": [0]}}}, "sweep beam"),
    ("also_decode", {"x": {"sweep": {"lenpen": 1.0}}}, "maps fields"),
    ("also_decode", {"x": {"sweep": {}}}, "maps fields"),
    ("also_decode", {"x": {"sweep": {"lenpen": [1.0]}, "lenpen": 1.0}}, "both swept"),
    ("also_decode", {"x": {"sweep": {"topk": [1, 2]}}}, "cannot be swept"),
])
def test_also_decode_and_comparisons_are_checked_when_the_grid_loads(tmp_path, key, value,
                                                                     message):
    from ranmt.experiment.loading import load_experiment

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config[key] = value
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=message):
        load_experiment(path)


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_grid_workers_script_trains_cells_in_pinned_single_threaded_workers(tmp_path):
    """scripts/grid_workers.sh: two workers share the grid (each cell trained once), each
    pinned to one core with one torch thread."""
    root = Path(__file__).resolve().parent.parent
    path = _grid(tmp_path)
    env = {**os.environ, "WORKERS": "2", "BIN": str(Path(sys.executable).parent),
           "LOG": str(tmp_path / "worker")}
    subprocess.run(["bash", str(root / "scripts/grid_workers.sh"), str(path)], env=env,
                   check=True, timeout=600, capture_output=True)
    exp = tmp_path / "exp"
    for variant in ("TransF", "RAN-ALL"):
        machine = json.loads((exp / f"runs/reverse/{variant}/seed1/cell.json").read_text()
                             )["machine"]
        assert machine["cores"] == 1 and machine["threads"] == 1
    logs = [(tmp_path / f"worker.{n}.log").read_text() for n in (0, 1)]
    assert sum(log.count(": running") for log in logs) == 2, logs


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_grid_workers_script_stops_every_worker_on_sigint_with_checkpoints_saved(tmp_path):
    """SIGINT to scripts/grid_workers.sh reaches every worker: each saves its cell's
    checkpoint and exits, no cell is recorded, and the script exits non-zero."""
    from ranmt.checkpoint import step_checkpoints
    from ranmt.runtime.signals import honour_stop_signals
    from ranmt.serving.launcher import processes_below

    root = Path(__file__).resolve().parent.parent
    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["overrides"]["train.max_steps"] = 100_000  # never finishes on its own
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "WORKERS": "2", "BIN": str(Path(sys.executable).parent),
           "LOG": str(tmp_path / "worker")}
    # SIGINT as a terminal gives it: a test run started in the background of a script has
    # SIGINT ignored, which the script would inherit (and bash cannot trap)
    script = subprocess.Popen(["bash", str(root / "scripts/grid_workers.sh"), str(path)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=honour_stop_signals)
    started: set[int] = set()
    try:
        logs = [tmp_path / f"worker.{n}.log" for n in (0, 1)]
        deadline = time.monotonic() + 300
        while not all(log.is_file() and "step " in log.read_text() for log in logs):
            assert time.monotonic() < deadline and script.poll() is None, \
                "workers never trained"
            started |= processes_below(script.pid)
            time.sleep(0.5)
        started |= processes_below(script.pid)
        script.send_signal(signal.SIGINT)
        assert script.wait(timeout=120) != 0
    finally:  # pass or fail, nothing it started outlives the test
        signal_each(started | processes_below(script.pid) | {script.pid}, signal.SIGKILL)
        script.wait(timeout=30)
    runs = tmp_path / "exp" / "runs" / "reverse"
    for variant in ("TransF", "RAN-ALL"):
        assert not (runs / variant / "seed1" / "cell.json").exists()
        assert step_checkpoints(runs / variant / "seed1" / "run")
    for log in logs:
        assert "SIGINT received" in log.read_text()


def test_status_reads_every_cells_state_from_disk(tmp_path, capsys):
    """``--status``: done (its scores), training (a live lock holder), stopped (a step
    checkpoint, or a stale lock), not started; the best validation and the validations
    since, against the patience, parsed from train.log."""
    import socket

    from ranmt.experiment.loading import load_experiment
    from ranmt.experiment.status import grid_status

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["seeds"] = [1, 2]
    config["overrides"]["train.patience"] = 3
    path.write_text(yaml.safe_dump(config))
    grid = load_experiment(path)
    done, training, stopped, stale = grid.cells()[:4]
    done.dir.mkdir(parents=True)
    done.file.write_text(json.dumps({
        "tests": {"test": {"bleu": 12.345}},
        "train": {"steps": 40, "best_step": 20, "best_valid_bleu": 9.5}}))
    log = ("step 10 epoch 1 | loss 3.0 ppl 20.1 | lr 1e-3 | 1,234 tgt tok/s | fill 90%\n"
           "validate step 10: valid_loss 3.0, valid_bleu 5.0000 | best 5.0000 at step 10\n"
           "step 20 epoch 1 | loss 2.0 ppl 7.4 | lr 1e-3 | 1,300 tgt tok/s | fill 90%\n"
           "validate step 20: valid_loss 2.0, valid_bleu 7.5000 | best 7.5000 at step 10\n"
           "validate step 20: valid_loss 2.0, valid_bleu 7.5000 | best 7.5000 at step 10\n"
           "step 30 epoch 2 | loss 1.9 ppl 6.7 | lr 1e-3 | 1,310 tgt tok/s | fill 90%\n")
    for cell in (training, stopped, stale):
        cell.run_dir.mkdir(parents=True)
        (cell.run_dir / "train.log").write_text(log)
    (stopped.run_dir / "checkpoints/step_00000020").mkdir(parents=True)
    (stopped.run_dir / "checkpoints/step_00000020/checkpoint.json").write_text("{}")
    training.lock.parent.mkdir(parents=True, exist_ok=True)
    training.lock.write_text(f"{socket.gethostname()} {os.getpid()}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale.lock.parent.mkdir(parents=True, exist_ok=True)
    stale.lock.write_text(f"{socket.gethostname()} {dead.pid}")
    entries = grid_status(path)
    assert [e["state"] for e in entries] == ["done", "training", "stopped", "stopped"]
    assert entries[0]["tests"] == {"test": 12.345} and entries[0]["best_valid"] == 9.5
    assert entries[1]["step"] == 30 and entries[1]["tokens_per_s"] == 1310
    # the validation at step 20 logged twice (a resume) counts once
    assert (entries[1]["best_valid"], entries[1]["best_step"],
            entries[1]["validations_since_best"], entries[1]["patience"]) == (7.5, 10, 1, 3)
    assert entries[2]["checkpoint_step"] == 20 and entries[3]["holder"] is None
    out = capsys.readouterr().out
    assert "4 cells: 1 done, 1 training, 2 stopped, 0 not started" in out
    assert "SacreBLEU 12.35" in out and "1/3 validations without gain" in out
    assert "resumes from step 20" in out
    main(["experiment", str(path), "--status", "--json"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(entries))


def test_a_worker_resumes_stopped_cells_before_starting_new_ones(tmp_path):
    """``stopped_first``: unfinished cells with a step checkpoint come first, then the rest,
    each in grid order (finished cells, skipped anyway, stay behind)."""
    from ranmt.experiment import stopped_first
    from ranmt.experiment.loading import load_experiment

    path = _grid(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["seeds"] = [1, 2]
    path.write_text(yaml.safe_dump(config))
    cells = load_experiment(path).cells()  # TransF 1, RAN-ALL 1, TransF 2, RAN-ALL 2
    for cell in (cells[3], cells[2], cells[0]):
        (cell.run_dir / "checkpoints/step_00000010").mkdir(parents=True)
        (cell.run_dir / "checkpoints/step_00000010/checkpoint.json").write_text("{}")
    cells[0].dir.mkdir(parents=True, exist_ok=True)
    cells[0].file.write_text("{}")  # finished: its checkpoint does not make it "stopped"
    assert stopped_first(cells) == [cells[2], cells[3], cells[0], cells[1]]


def test_sweep_setting_label_names_each_seeds_choice():
    """A ``sweep`` setting's row names the values each seed chose on valid ('-': a seed
    without a choice recorded); a setting without a sweep keeps its name."""
    runs = [{"also_decode": {"t": {"chosen": {"value": {"beam": 4, "lenpen": 2.0}}}}},
            {"also_decode": {"t": {}}},
            {"also_decode": {"t": {"chosen": {"value": {"beam": 8, "lenpen": 0.6}}}}}]
    assert tables_module._setting_label("t", runs) == "t (beam, lenpen 4, 2 / - / 8, 0.6)"
    assert tables_module._setting_label("t", runs[1:2]) == "t"
