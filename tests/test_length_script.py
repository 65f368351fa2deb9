"""scripts/length_penalty.py: output length ratios of a grid's hypotheses (against a hand
count) and the length-penalty exponent chosen on valid (the best valid BLEU, ties to the
exponent listed first, the grid's own; the test hypotheses written score as reported)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from conftest import load_script


def _script():
    return load_script("scripts/length_penalty.py")


def _write_cell(grid: Path, dataset: str, variant: str, seed: int, data: Path,
                tests: dict, hyps: dict[str, list[str]] | None = None) -> Path:
    folder = grid / "runs" / dataset / variant / f"seed{seed}"
    folder.mkdir(parents=True)
    cell = {"dataset": dataset, "variant": variant, "seed": seed, "tests": tests,
            "config": {"data": {"dir": str(data)}, "decode": {"lenpen": 0.6}}}
    (folder / "cell.json").write_text(json.dumps(cell))
    for name, lines in (hyps or {}).items():
        (folder / name).write_text("".join(line + "\n" for line in lines))
    return folder


def test_output_lengths_are_hypothesis_over_reference_words(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "t.tgt.txt").write_text("a b c d\ne f\n")  # 6 reference words
    grid = tmp_path / "grid"
    scores = {"t": {"bleu": 0.0, "chrf": 0.0, "ter": 0.0}}
    _write_cell(grid, "d", "V", 1, data, scores,
                {"t.hyp": ["a b c", "e f"], "t.greedy.hyp": ["a b c d e", "e f"]})
    _write_cell(grid, "d", "V", 2, data, scores, {"t.hyp": ["a b c d", "e f"]})
    table = _script().output_lengths(grid)
    beam, greedy = table["d"]["V"]["beam"]["t"], table["d"]["V"]["greedy"]["t"]
    assert beam["per_seed"] == {"1": round(5 / 6, 4), "2": 1.0}
    assert beam["mean"] == pytest.approx((5 / 6 + 1) / 2, abs=1e-4)
    assert greedy["per_seed"] == {"1": round(7 / 6, 4)}
    markdown = _script().lengths_markdown(table)
    assert "| d | V | 2 | 0.917 | 1.167 | - |" in markdown


def test_the_chosen_exponent_is_the_best_on_valid(tmp_path, reverse_run, reverse_data):
    script = _script()
    grid, work = tmp_path / "grid", tmp_path / "work"
    _write_cell(grid, "rev", "Tiny", 1, reverse_data,
                {"test": {"bleu": 1.0, "chrf": 2.0, "ter": 3.0}})
    run = work / "runs" / "rev" / "Tiny" / "seed1" / "run"
    run.parent.mkdir(parents=True)
    run.symlink_to(reverse_run, target_is_directory=True)
    lenpens = [0.6, 0.0, 3.0]
    (row,) = script.valid_chosen_lenpen(grid, work, lenpens, tmp_path / "out")
    valid = {float(lp): scores["bleu"] for lp, scores in row["valid"].items()}
    best = max(valid.values())
    first_best = next(lp for lp in lenpens if valid[lp] == best)
    assert row["chosen_lenpen"] == first_best
    assert row["tests"]["test"]["grid"] == {"bleu": 1.0, "chrf": 2.0, "ter": 3.0}
    hyps = (tmp_path / "out" / "rev" / "Tiny" / "seed1" / "test.hyp").read_text().splitlines()
    refs = (reverse_data / "test.tgt.txt").read_text().splitlines()
    assert len(hyps) == len(refs) == 200
    bleu = BLEU().corpus_score(hyps, [refs])
    chosen = row["tests"]["test"]["chosen"]
    assert chosen["bleu"] == pytest.approx(bleu.score, abs=0.006)
    assert chosen["ratio"] == pytest.approx(bleu.sys_len / bleu.ref_len, abs=1e-4)
    assert "| rev | Tiny | 1 |" in script.lenpen_markdown([row])


def test_a_rerun_keeps_the_rows_of_cells_whose_checkpoints_are_gone(tmp_path):
    """A grid that outlived its machines: the rows this run measured, plus the earlier
    run's rows of the cells it could not decode; a measured row replaces its earlier one,
    and an earlier row with other exponents is dropped."""
    def row(variant, seed, valid_bleu, exponents=("0.6", "2.0")):
        return {"dataset": "d", "variant": variant, "seed": seed,
                "valid": {lp: {"bleu": valid_bleu} for lp in exponents}}

    earlier = tmp_path / "lenpen.json"
    earlier.write_text(json.dumps([row("A", 2, 1.0), row("B", 1, 2.0),
                                   row("C", 1, 3.0, exponents=("0.6",))]))
    rows = _script().keep_earlier_rows([row("B", 1, 9.0), row("A", 3, 4.0)], earlier)
    assert [(r["variant"], r["seed"], r["valid"]["0.6"]["bleu"]) for r in rows] == \
        [("A", 2, 1.0), ("A", 3, 4.0), ("B", 1, 9.0)]
    assert _script().keep_earlier_rows([row("B", 1, 9.0)], tmp_path / "none.json") == \
        [row("B", 1, 9.0)]
