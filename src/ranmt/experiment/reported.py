"""A paper's reported numbers beside the grid's own (``reported`` in the grid file): per
entry one results.md table whose rows are the variants the paper reports, with the grid's
mean ± std over seeds on every test set, its difference to the entry's baseline with the
seed rule's marks (those of the main tables, or of the comparison against that baseline),
and the paper's score with its difference to the paper's baseline. The paper's numbers come
from another corpus and model size: the table sets directions side by side, not values.

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


def reported_table(entry: Reported, tests: dict, significance_by_test: dict) -> list[str]:
    """The lines of one entry's table. ``tests``: results.json's ``datasets[D]["tests"]``
    (test -> scores); ``significance_by_test``: test -> variant -> metric -> the comparison
    against ``entry.baseline``."""
    names = list(tests)
    metric = ROW_NAMES.get(entry.metric, entry.metric)
    reported = dict(entry.scores)
    seeds = {variant: max((len(tests[test]["scores"].get(variant, {}).get(entry.metric, {})
                                .get("per_seed", {})) for test in names), default=0)
             for variant in reported}
    lines = [f"## {entry.dataset} — beside {entry.name}", "",
             f"{entry.source}. Ours: {metric}, mean ± std over seeds, and its difference to "
             f"{entry.baseline} (the seed rule's marks); reported: the source's score (its "
             f"metric) and its difference to its {entry.baseline}.", "",
             "| variant | seeds | " + " | ".join(f"{test} | Δ {entry.baseline}" for test in names)
             + f" | reported | Δ {entry.baseline} (reported) |",
             "|---|---|" + "---|---|" * len(names) + "---|---|"]
    for variant, score in reported.items():
        cells = []
        for test in names:
            cells += _ours(tests[test]["scores"], significance_by_test.get(test, {}), variant,
                           entry.baseline, entry.metric)
        paper_delta = "" if variant == entry.baseline else \
            f"{score - reported[entry.baseline]:+.2f}"
        lines.append(f"| {variant} | {seeds[variant] or '-'} | " + " | ".join(cells)
                     + f" | {score:.2f} | {paper_delta} |")
    return lines + [""]


def reported_tables(experiment: Experiment, results: dict, against: dict[str, dict]) -> str:
    """Every ``reported`` entry's table (:func:`reported_table`) for results.md; ``results``:
    the main tables' numbers (:func:`~ranmt.experiment.tables.build_tables`), ``against``:
    baseline -> the numbers of the tables against that baseline, for entries whose baseline
    is not the grid's."""
    parts = []
    for entry in experiment.reported:
        dataset = results.get("datasets", {}).get(entry.dataset)
        if not dataset or not dataset.get("tests"):
            continue
        source = results if entry.baseline == experiment.baseline else against[entry.baseline]
        tests = source["datasets"][entry.dataset]["tests"]
        significance = {test: tests[test].get("significance", {}) for test in tests}
        parts.append("\n".join(reported_table(entry, dataset["tests"], significance)))
    return "\n".join(parts)
