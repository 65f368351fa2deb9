"""docs/RESULTS.md's hand-kept ablation tables state what the committed grids hold.

The "Ablations at convergence" tables of RESULTS.md (issue 100) are edited by hand each time
a cell lands, from three committed result files: the converged ablation grid's results.json
(means ± std over the seeds run so far, the Δ against the baseline with the seed rule's
marks, each seed's steps and best step), the 1,000-step ablation grid's results.json (its Δ)
and the papers' numbers under ``reported``. Every number of a row is read back here and
compared with those files at the table's precision, so a doc left behind by a new cell (or a
typo) fails.

A table's baseline is the name in its header's first ``Δ`` column (``Δ TransF``; a Table 3
table's ``Δ RAN-ALL`` reads the grids' results.vs-RAN-ALL.json). Row shape:
``| model | seeds | steps / best, per seed | test_2016 | Δ | test_2017 | Δ | 1,000 steps: Δ |
paper: Δ |``. A Δ cell is ``−8.77 †‡``, optionally followed by ``(chrF −0.63 †)``: the chrF
Δ and its marks, checked as well. A paper Δ cell lists one Δ per ``reported`` table of the
baseline that has the variant, ``/``-joined in the grid file's order (HC-ALL: IWSLT16 / WMT14).
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


def _ablation_tables() -> list[tuple[str, list[list[str]]]]:
    """Each table of the section whose header starts ``| model | seeds |``: its baseline (the
    name after the header's first ``Δ``) and the cells of each row (header and rule left
    out)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    lines = text[start:end if end >= 0 else None].splitlines()
    tables = []
    for index, line in enumerate(lines):
        if not line.startswith("| model | seeds |"):
            continue
        baseline = re.search(r"\| Δ (\S+)", line).group(1)
        rows = []
        for row in lines[index + 2:]:
            if not row.startswith("|"):
                break
            rows.append([cell.strip().replace("**", "") for cell in row.strip("|").split("|")])
        tables.append((baseline, rows))
    return tables


def _results(path: Path, baseline: str) -> dict:
    """A grid's results.json, or its results.vs-BASELINE.json for another baseline."""
    if baseline != json.loads(path.read_text(encoding="utf-8"))["experiment_config"]["baseline"]:
        path = path.with_name(f"results.vs-{baseline}.json")
    return json.loads(path.read_text(encoding="utf-8"))


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
    assert trained == sum(not cell.get("reused_from") for cell in converged["cells"])


def test_the_ablation_tables_of_results_md_state_the_committed_cells():
    tables = _ablation_tables()
    assert tables, f"no '| model | seeds |' table under {SECTION!r}"
    main_results = json.loads(CONVERGED.read_text(encoding="utf-8"))
    cells = main_results["cells"]
    trained = {cell["variant"] for cell in cells if not cell.get("reused_from")}
    named = [_name(row[0]) for _, rows in tables for row in rows]
    assert sorted(named) == sorted(trained), "a trained variant is missing a row (or has two)"
    for baseline, rows in tables:
        _check_rows(rows, baseline, main_results)


def _check_rows(rows: list[list[str]], baseline: str, main_results: dict) -> None:
    """One table's rows against the grids' results written against ``baseline``
    (``main_results``: the converged grid's results.json, read once: its cells and the
    papers' numbers)."""
    converged = _results(CONVERGED, baseline)
    tests = converged["datasets"][DATASET]["tests"]
    early_tests = _results(EARLY, baseline)["datasets"][DATASET]["tests"]
    paper: dict[str, list[float]] = {}  # HC-ALL / SH-X: two papers' tables, in file order
    for table in main_results["reported"]:
        for name, entry in table["variants"].items():
            if table["baseline"] == baseline and entry["reported_delta"] is not None:
                paper.setdefault(name, []).append(entry["reported_delta"])
    for row in rows:
        variant = _name(row[0])
        name, seeds, steps, score16, delta16, score17, delta17, early16, paper_delta = row
        scores = {test: tests[test]["scores"][variant]["bleu"] for test in TESTS}
        assert int(seeds) == len(scores[TESTS[0]]["per_seed"]), f"{name}: seeds"
        assert steps == _steps_cell(main_results["cells"], variant), f"{name}: steps / best"
        for test, score, delta in zip(TESTS, (score16, score17), (delta16, delta17)):
            _check_score(score, scores[test], f"{name} {test}")
            _check_delta(delta, tests[test]["significance"][variant], f"{name} {test} Δ")
        _check_delta(early16, early_tests[TESTS[0]]["significance"][variant],
                     f"{name} 1,000 steps Δ {baseline}")
        stated = [_number(delta) for delta in paper_delta.split(" / ")]
        assert stated == pytest.approx(paper[variant], abs=0.005), f"{name}: paper Δ"
