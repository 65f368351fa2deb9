"""docs/RESULTS.md's hand-kept ablation table states what the committed grids hold.

The "Ablations at convergence" table of RESULTS.md (issue 100) is edited by hand each time a
cell lands, from three committed result files: the converged ablation grid's results.json
(means ± std over the seeds run so far, the Δ against TransF with the seed rule's marks, each
seed's steps and best step), the 1,000-step ablation grid's results.json (its Δ) and the
papers' numbers under ``reported``. Every number of a row is read back here and compared with
those files at the table's precision, so a doc left behind by a new cell (or a typo) fails.

Row shape: ``| model | seeds | steps / best, per seed | test_2016 | Δ TransF | test_2017 |
Δ TransF | 1,000 steps: Δ TransF | paper: Δ TransF |``. A Δ cell is ``−8.77 †‡``, optionally
followed by ``(chrF −0.63 †)``: the chrF Δ and its marks, checked as well.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "RESULTS.md"
CONVERGED = ROOT / "docs" / "results" / "multi30k_ablations_converged" / "results.json"
EARLY = ROOT / "docs" / "results" / "multi30k_ablations" / "results.json"
SECTION = "## Ablations at convergence"
DATASET = "multi30k-en-de"
TESTS = ("test_2016_flickr", "test_2017_flickr")
DELTA = re.compile(r"^([+−-]\d+\.\d\d) ?([†‡]*)(?: \(chrF ([+−-]\d+\.\d\d) ?([†‡]*)\))?$")


def _number(text: str) -> float:
    """A signed figure as the doc writes it (U+2212 minus, bold stripped)."""
    return float(text.replace("**", "").replace("−", "-").strip())


def _ablation_rows() -> list[list[str]]:
    """The cells of each row of the section's first table (header and rule left out)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    lines = text[start:].splitlines()[1:]
    first = next(i for i, line in enumerate(lines) if line.startswith("| model | seeds |"))
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip("|").split("|")])
    return rows


def _marks(entry: dict) -> str:
    return ("†" if entry["dagger"] else "") + ("‡" if entry["double_dagger"] else "")


def _check_delta(cell: str, significance: dict, where: str) -> None:
    """``cell`` (``+2.23 †`` or ``−0.05 (chrF −0.63 †)``) against a test set's significance
    entry of one variant: the BLEU Δ and marks, and the chrF ones when the cell names them."""
    match = DELTA.match(cell)
    assert match, f"{where}: unreadable Δ cell {cell!r}"
    delta, marks, chrf_delta, chrf_marks = match.groups()
    assert _number(delta) == pytest.approx(significance["bleu"]["delta"], abs=0.005), where
    assert marks == _marks(significance["bleu"]), f"{where}: marks {marks!r}"
    if chrf_delta is not None:
        assert _number(chrf_delta) == pytest.approx(significance["chrf"]["delta"], abs=0.005), where
        assert chrf_marks == _marks(significance["chrf"]), f"{where}: chrF marks {chrf_marks!r}"


def _check_score(cell: str, scores: dict, where: str) -> None:
    """``26.66 ± 0.93`` (several seeds) or ``37.65`` (one) against the SacreBLEU entry."""
    mean, _, std = cell.partition("±")
    assert _number(mean) == pytest.approx(scores["mean"], abs=0.005), where
    if len(scores["per_seed"]) > 1:
        assert std, f"{where}: {len(scores['per_seed'])} seeds but no ± std"
        assert _number(std) == pytest.approx(scores["std"], abs=0.005), where
    else:
        assert not std, f"{where}: one seed has no std"


def _steps_cell(cells: list[dict], variant: str) -> str:
    """What the steps column must say: ``steps / best`` per seed in seed order, ``; ``-joined."""
    runs = sorted((cell for cell in cells if cell["variant"] == variant), key=lambda c: c["seed"])
    return "; ".join(f"{run['train']['steps']:,} / {run['train']['best_step']:,}" for run in runs)


def _name(row_name: str) -> str:
    return row_name.replace("−", "-")


def test_the_ablation_sections_heading_counts_the_committed_cells():
    """``(issue 100, in progress: 11 of 30 cells, 5 of them trained)``: cells in results.json,
    variants x seeds of the grid file, and the cells not copied from the converged grid."""
    converged = json.loads(CONVERGED.read_text(encoding="utf-8"))
    config = converged["experiment_config"]
    heading = next(line for line in DOC.read_text(encoding="utf-8").splitlines()
                   if line.startswith(SECTION))
    match = re.search(r"(\d+) of (\d+) cells, (\d+) of them trained", heading)
    assert match, f"unreadable heading {heading!r}"
    landed, planned, trained = map(int, match.groups())
    assert landed == len(converged["cells"])
    assert planned == len(config["variants"]) * len(config["seeds"])
    reused = ("TransF", "RAN-ALL")
    assert trained == sum(cell["variant"] not in reused for cell in converged["cells"])


def test_the_ablation_table_of_results_md_states_the_committed_cells():
    converged = json.loads(CONVERGED.read_text(encoding="utf-8"))
    early = json.loads(EARLY.read_text(encoding="utf-8"))
    tests = converged["datasets"][DATASET]["tests"]
    early_tests = early["datasets"][DATASET]["tests"]
    paper = {name: entry["reported_delta"]
             for table in converged["reported"] for name, entry in table["variants"].items()
             if table["baseline"] == "TransF" and entry["reported_delta"] is not None}
    rows = _ablation_rows()
    trained = {cell["variant"] for cell in converged["cells"]} - {"TransF", "RAN-ALL"}
    assert {_name(row[0]) for row in rows} == trained, "a trained variant is missing a row"
    for row in rows:
        variant = _name(row[0])
        name, seeds, steps, score16, delta16, score17, delta17, early16, paper_delta = row
        scores = {test: tests[test]["scores"][variant]["bleu"] for test in TESTS}
        assert int(seeds) == len(scores[TESTS[0]]["per_seed"]), f"{name}: seeds"
        assert steps == _steps_cell(converged["cells"], variant), f"{name}: steps / best"
        for test, score, delta in zip(TESTS, (score16, score17), (delta16, delta17)):
            _check_score(score, scores[test], f"{name} {test}")
            _check_delta(delta, tests[test]["significance"][variant], f"{name} {test} Δ")
        _check_delta(early16, early_tests[TESTS[0]]["significance"][variant],
                     f"{name} 1,000 steps Δ")
        assert _number(paper_delta) == pytest.approx(paper[variant], abs=0.005), f"{name}: paper"
