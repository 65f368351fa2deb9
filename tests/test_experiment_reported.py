"""A paper's numbers beside the grid's own (``reported`` in a grid file,
ranmt.experiment.reported): the file's entries are checked, and each table puts the grid's
mean ± std, its difference to the entry's baseline with the seed rule's marks, and the
paper's score with its own difference side by side. The committed converged ablation grid's
tables (tests/test_committed_results.py) rebuild it from the cells end to end."""

from __future__ import annotations

import pytest
import yaml

from ranmt.config import ConfigError
from ranmt.experiment import load_experiment
from ranmt.experiment.reported import reported_table
from ranmt.experiment.spec import Reported


def _grid_file(tmp_path, reported) -> object:
    config = {"name": "g", "baseline": "TransF", "reported": reported,
              "datasets": [{"name": "d", "src": "en", "tgt": "de", "tests": ["t1", "t2"]}],
              "variants": [{"name": n} for n in ("TransF", "RAN-ALL", "-Pos-E")]}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_reported_entries_are_checked_and_take_the_grids_defaults(tmp_path):
    [entry] = load_experiment(_grid_file(tmp_path, [
        {"name": "Table 2", "source": "Zeng et al. (2021)",
         "scores": {"TransF": 27.12, "-Pos-E": 12.9}}])).reported
    assert entry == Reported("Table 2", "Zeng et al. (2021)", "d", "TransF",
                             (("TransF", 27.12), ("-Pos-E", 12.9)), "bleu")
    bad = {
        "needs a name and a source": {"name": "x", "scores": {"TransF": 1}},
        "unknown key": {"name": "x", "source": "s", "scores": {"TransF": 1}, "table": 2},
        "the baseline RAN-ALL among them": {"name": "x", "source": "s", "baseline": "RAN-ALL",
                                            "scores": {"TransF": 1}},
        "maps variants to numbers": {"name": "x", "source": "s", "scores": {"TransF": "27"}},
        "['HC-ALL'] are not variants": {"name": "x", "source": "s",
                                        "scores": {"TransF": 1, "HC-ALL": 2}},
        "metric rouge1 is not one of": {"name": "x", "source": "s", "metric": "rouge1",
                                        "scores": {"TransF": 1}},
        "dataset e is not in the grid": {"name": "x", "source": "s", "dataset": "e",
                                         "scores": {"TransF": 1}},
    }
    for message, reported in bad.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_experiment(_grid_file(tmp_path, [reported]))
    with pytest.raises(ConfigError, match="two entries have this name"):
        load_experiment(_grid_file(tmp_path, [{"name": "x", "source": "s",
                                               "scores": {"TransF": 1}}] * 2))


def _scores(**means):
    """variant -> {"bleu": mean/std/per_seed} with one or three seeds."""
    return {variant: {"bleu": {"mean": values[0] if len(values) == 1 else sum(values) / 3,
                               "std": None if len(values) == 1 else 0.5,
                               "per_seed": {str(i + 1): v for i, v in enumerate(values)}}}
            for variant, values in means.items()}


def test_reported_table_sets_ours_and_the_papers_differences_side_by_side():
    entry = Reported("Table 2", "Zeng et al. (2021), WMT14", "d", "TransF",
                     (("TransF", 27.12), ("-Pos-E", 12.90), ("RAN-ALL", 27.87)))
    tests = {"t1": {"scores": _scores(TransF=(35.0, 35.5, 36.0), **{"-Pos-E": (26.0,)})},
             "t2": {"scores": _scores(TransF=(27.0, 27.5, 28.0), **{"-Pos-E": (20.0,)})}}
    significance = {"t1": {"-Pos-E": {"bleu": {"dagger": True, "double_dagger": False}}},
                    "t2": {"-Pos-E": {"bleu": {"dagger": False, "double_dagger": False}}}}
    lines, numbers = reported_table(entry, tests, significance)
    assert lines[0] == "## d — beside Table 2"
    assert lines[4] == ("| variant | seeds | t1 | Δ TransF | t2 | Δ TransF | reported | "
                        "Δ TransF (reported) | reading (t1 / t2) |")
    assert lines[6:] == [
        "| TransF | 3 | 35.50 ± 0.50 |  | 27.50 ± 0.50 |  | 27.12 |  |  |",
        "| -Pos-E | 1 | 26.00 | -9.50 † | 20.00 | -7.50 | 12.90 | -14.22 | "
        "as the paper, one mark / n.s. |",
        "| RAN-ALL | - | - | - | - | - | 27.87 | +0.75 | - |",
        ""]
    assert numbers["variants"]["-Pos-E"] == {
        "reported": 12.90, "seeds": 1, "reported_delta": pytest.approx(-14.22),
        "reading": {"t1": "as the paper, one mark", "t2": "n.s."}}
    assert numbers["variants"]["TransF"]["reading"] is None
    assert numbers["variants"]["RAN-ALL"]["reading"] is None


def test_a_reading_holds_or_reverses_only_with_both_marks():
    """The seed rule's answer to a paper's difference: both marks and the paper's sign
    (holds) or the other (reversed); one mark is not a difference across seeds."""
    from ranmt.experiment.reported import reading

    both = {"dagger": True, "double_dagger": True}
    assert reading(-8.8, -14.2, both) == "holds"
    assert reading(+2.2, -0.3, both) == "reversed"
    assert reading(+1.0, 0.0, both) == "differs"
    assert reading(+1.0, +0.3, {"dagger": True, "double_dagger": False}) == \
        "as the paper, one mark"
    assert reading(-1.0, +0.3, {"dagger": False, "double_dagger": True}) == \
        "against the paper, one mark"
    assert reading(-1.0, +0.3, {"dagger": False, "double_dagger": False}) == "n.s."
    assert reading(-1.0, +0.3, None) == "n.s."
