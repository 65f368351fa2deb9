"""A paper's reported numbers beside the grid's own (``reported`` in the grid file): per
entry one results.md table whose rows are the variants the paper reports, with the grid's
mean ± std over seeds on every test set, its difference to the entry's baseline with the
seed rule's marks (those of the main tables, or of the comparison against that baseline),
and the paper's score with its difference to the paper's baseline. The paper's numbers come
from another corpus and model size: the table sets directions side by side, not values.
Its last column reads each test set's difference against the paper's by the seed rule
(:func:`reading`): the paper's direction holds, is reversed, or is not established here.

Rebuilt with every other table from the finished cells, so a document quoting it (e.g.
RESULTS.md's ablations at convergence) never copies a number by hand.
"""

from __future__ import annotations

from ranmt.evaluate import marks_suffix
from ranmt.experiment.spec import Experiment, Reported
from ranmt.experiment.table_parts import ROW_NAMES, format_score


def _ours(scores: dict, significance: dict, variant: str, baseline: str,
          metric: str) -> tuple[str, str]:
    """(mean ± std, difference to ``baseline`` with marks) of one variant on one test set;
    "-" where it has no finished cell."""
    numbers = scores.get(variant, {}).get(metric)
    if numbers is None:
        return "-", "-"
    text = format_score(numbers["mean"], numbers["std"])
    base = scores.get(baseline, {}).get(metric)
    if variant == baseline or base is None:
        return text, ""
    delta = f"{numbers['mean'] - base['mean']:+.2f}"
    return text, delta + marks_suffix(significance.get(variant, {}).get(metric))


def reading(ours: float, paper: float, comparison: dict | None) -> str:
    """One test set's answer to the paper's difference ``paper`` (variant minus baseline):
    "holds" / "reversed" where ours (``ours``) has both of the seed rule's marks (every
    seed's bootstrap and Welch's test over the seeds: a difference that holds across seeds)
    in the paper's / the other direction, "differs" where the paper reports no difference;
    with one mark "as the paper, one mark" / "against the paper, one mark" (one seed can
    earn † only); "n.s." with none."""
    marks = (bool(comparison and comparison["dagger"]),
             bool(comparison and comparison["double_dagger"]))
    if not any(marks):
        return "n.s."
    direction = ("differs" if paper == 0 else
                 "holds" if (ours > 0) == (paper > 0) else "reversed")
    if all(marks):
        return direction
    side = {"holds": "as the paper", "reversed": "against the paper"}.get(direction, direction)
    return f"{side}, one mark"


def _readings(entry: Reported, tests: dict, significance_by_test: dict, variant: str,
              paper_delta: float) -> dict[str, str] | None:
    """Test set -> the :func:`reading` of the variant's difference; None for the baseline
    or where the variant (or the baseline) has no finished cell."""
    if variant == entry.baseline:
        return None
    answers = {}
    for test, numbers in tests.items():
        scores = numbers["scores"]
        ours, base = (scores.get(name, {}).get(entry.metric) for name in (variant,
                                                                          entry.baseline))
        if ours is None or base is None:
            return None
        comparison = significance_by_test.get(test, {}).get(variant, {}).get(entry.metric)
        answers[test] = reading(ours["mean"] - base["mean"], paper_delta, comparison)
    return answers


def reported_table(entry: Reported, tests: dict, significance_by_test: dict
                   ) -> tuple[list[str], dict]:
    """The lines of one entry's table and its numbers for results.json (the entry, and
    per variant the paper's score, its difference and our readings per test set).
    ``tests``: results.json's ``datasets[D]["tests"]`` (test -> scores);
    ``significance_by_test``: test -> variant -> metric -> the comparison against
    ``entry.baseline``."""
    names = list(tests)
    metric = ROW_NAMES.get(entry.metric, entry.metric)
    reported = dict(entry.scores)
    seeds = {variant: max((len(tests[test]["scores"].get(variant, {}).get(entry.metric, {})
                                .get("per_seed", {})) for test in names), default=0)
             for variant in reported}
    lines = [f"## {entry.dataset} — beside {entry.name}", "",
             f"{entry.source}. Ours: {metric}, mean ± std over seeds, and its difference to "
             f"{entry.baseline} (the seed rule's marks); reported: the source's score (its "
             f"metric) and its difference to its {entry.baseline}; reading, per test set: the "
             "reported direction holds or is reversed with both of the seed rule's marks "
             "(one seed earns † only), n.s. without a mark.", "",
             "| variant | seeds | " + " | ".join(f"{test} | Δ {entry.baseline}" for test in names)
             + f" | reported | Δ {entry.baseline} (reported) | reading ({' / '.join(names)}) |",
             "|---|---|" + "---|---|" * len(names) + "---|---|---|"]
    rows = {}
    for variant, score in reported.items():
        cells = []
        for test in names:
            cells += _ours(tests[test]["scores"], significance_by_test.get(test, {}), variant,
                           entry.baseline, entry.metric)
        paper_delta = score - reported[entry.baseline]
        delta_text = "" if variant == entry.baseline else f"{paper_delta:+.2f}"
        answers = _readings(entry, tests, significance_by_test, variant, paper_delta)
        answer = " / ".join(answers.values()) if answers else \
            "" if variant == entry.baseline else "-"
        lines.append(f"| {variant} | {seeds[variant] or '-'} | " + " | ".join(cells)
                     + f" | {score:.2f} | {delta_text} | {answer} |")
        rows[variant] = {"reported": score, "seeds": seeds[variant],
                         "reported_delta": None if variant == entry.baseline else paper_delta,
                         "reading": answers}
    numbers = {"name": entry.name, "source": entry.source, "dataset": entry.dataset,
               "metric": entry.metric, "baseline": entry.baseline, "variants": rows}
    return lines + [""], numbers


def reported_tables(experiment: Experiment, results: dict, against: dict[str, dict]
                    ) -> tuple[str, list[dict]]:
    """Every ``reported`` entry's table (:func:`reported_table`) for results.md, and their
    numbers for results.json (``reported``); ``results``:
    the main tables' numbers (:func:`~ranmt.experiment.tables.build_tables`), ``against``:
    baseline -> the numbers of the tables against that baseline, for entries whose baseline
    is not the grid's."""
    parts, numbers = [], []
    for entry in experiment.reported:
        dataset = results.get("datasets", {}).get(entry.dataset)
        if not dataset or not dataset.get("tests"):
            continue
        source = results if entry.baseline == experiment.baseline else against[entry.baseline]
        tests = source["datasets"][entry.dataset]["tests"]
        significance = {test: tests[test].get("significance", {}) for test in tests}
        lines, entry_numbers = reported_table(entry, dataset["tests"], significance)
        parts.append("\n".join(lines))
        numbers.append(entry_numbers)
    return "\n".join(parts), numbers
