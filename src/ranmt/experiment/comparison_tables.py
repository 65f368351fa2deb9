"""The comparisons across datasets of a grid (``comparisons:`` in its file,
:class:`ranmt.experiment.spec.Comparison`): a student on distilled data against itself on
the original, against its teacher: per comparison and test set a table of each row's mean
and its per-seed differences to its counterparts, with the seed rule's marks."""

from __future__ import annotations

from pathlib import Path

from ranmt.data.corpus import raw_text
from ranmt.evaluate import compare_over_seeds, marks_suffix
from ranmt.experiment.spec import Comparison, Experiment
from ranmt.experiment.table_parts import (
    ROW_NAMES,
    metrics_in_order,
    paired_p_values,
    read_hyps,
    with_difference,
)


def _comparison_pairs(experiment: Experiment, comparison: Comparison, cells: list[dict]
                      ) -> dict[tuple[str, str], list[tuple[dict, dict]]]:
    """(dataset, variant) -> [(cell, the cell it is compared with)], seed by seed, for the
    finished cells the comparison covers whose counterpart has finished too (a cell is
    never compared with itself)."""
    finished = {(c["dataset"], c["variant"], c["seed"]): c for c in cells}
    pairs: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for dataset in experiment.datasets:
        for variant in experiment.variants:
            if not comparison.covers(dataset.name, variant.name):
                continue
            for seed in experiment.seeds:
                own = finished.get((dataset.name, variant.name, seed))
                other = finished.get(comparison.against_cell(dataset.name, variant.name, seed))
                if own is not None and other is not None and other is not own:
                    pairs.setdefault((dataset.name, variant.name), []).append((own, other))
    return pairs


def _shared_references(experiment: Experiment, own: str, other: str, test: str
                       ) -> list[str] | None:
    """The references of ``test`` when both datasets have it with the same references
    (a distilled dataset and its teacher's), else None."""
    by_name = {d.name: d for d in experiment.datasets}
    if test not in by_name[own].tests or test not in by_name[other].tests:
        return None
    root = Path(experiment.out) / "data"
    refs = raw_text(root / by_name[own].references_from, test, "tgt")
    if by_name[other].references_from != by_name[own].references_from and \
            raw_text(root / by_name[other].references_from, test, "tgt") != refs:
        return None
    return refs


def _comparison_p_values(experiment: Experiment, comparison: Comparison, test: str,
                         refs: list[str], variant: str, pairs: list[tuple[dict, dict]],
                         metrics: list[str]) -> dict[str, dict[int, float]]:
    """metric -> seed -> paired-bootstrap p of a row's cells against their counterparts
    (the first system, named "comparison NAME")."""
    pvalues: dict[str, dict[int, float]] = {m: {} for m in metrics}
    for own, other in pairs if metrics else []:
        [row] = paired_p_values(
            [(f"comparison {comparison.name}", read_hyps(experiment, other, test)),
             (variant, read_hyps(experiment, own, test))],
            refs, metrics, experiment.bootstrap_samples)
        for metric in metrics:
            pvalues[metric][own["seed"]] = row[metric]
    return pvalues


def _comparison_row(experiment: Experiment, comparison: Comparison, test: str,
                    refs: list[str], variant: str, pairs: list[tuple[dict, dict]],
                    metrics: list[str]) -> tuple[list[str], dict]:
    """One row's cells (per metric: the row's mean, the mean ± std of the per-seed
    differences to the counterparts, † by the seed rule; ‡ only where both sides have
    their own seeds) and its numbers."""
    sig_metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    pvalues = _comparison_p_values(experiment, comparison, test, refs, variant, pairs,
                                   sig_metrics)
    texts, entry = [], {}
    for metric in metrics:
        own = {a["seed"]: a["tests"][test][metric] for a, _ in pairs}
        other = {a["seed"]: b["tests"][test][metric] for a, b in pairs}
        text, deltas = with_difference(own, other)
        significance = None
        if metric in pvalues:
            # one counterpart run (fixed_seed): its seed spread is unknown, no Welch's test
            significance = compare_over_seeds(other, own, pvalues[metric], experiment.alpha,
                                              seed_spread=not comparison.fixed_seed)
            text += marks_suffix(significance)
        texts.append(text)
        entry[metric] = {"per_seed": {str(k): v for k, v in own.items()},
                         "against_per_seed": {str(k): v for k, v in other.items()},
                         "per_seed_delta": dict(zip(map(str, own), deltas)),
                         "significance": significance}
    return texts, entry


def _comparison_table(experiment: Experiment, comparison: Comparison, test: str,
                      pairs: dict[tuple[str, str], list[tuple[dict, dict]]]
                      ) -> tuple[list[str], dict]:
    """One comparison's table on one test set: a row per (dataset, variant)."""
    tasks = {d.task for d in experiment.datasets}
    metrics = metrics_in_order(next(iter(tasks)) if len(tasks) == 1 else "translation")
    lines, numbers = [], {}
    for (dataset, variant), row_pairs in pairs.items():
        row_pairs = [(a, b) for a, b in row_pairs if test in a["tests"] and test in b["tests"]]
        if not row_pairs:
            continue
        other_dataset, other_variant, other_seed = comparison.against_cell(
            dataset, variant, row_pairs[0][0]["seed"])
        refs = _shared_references(experiment, dataset, other_dataset, test)
        if refs is None:
            continue
        against = f"{other_dataset} / {other_variant}" + (
            f" / seed {other_seed}" if comparison.fixed_seed else "")
        texts, entry = _comparison_row(experiment, comparison, test, refs, variant,
                                       row_pairs, metrics)
        lines.append(f"| {dataset} | {variant} | {against} | {len(row_pairs)} | "
                     + " | ".join(texts) + " |")
        numbers.setdefault(dataset, {})[variant] = {"against": against, **entry}
    if not lines:
        return [], {}
    header = [f"## {comparison.name} — {test}", "",
              "| dataset | variant | against | seeds | "
              + " | ".join(ROW_NAMES.get(m, m) for m in metrics) + " |",
              "|---|---|---|---|" + "---|" * len(metrics)]
    seeds = ("each seed against the one run named" if comparison.fixed_seed
             else "each seed against the same seed")
    footer = ["", f"(±x): the row's score minus its counterpart's ({seeds}; mean ± std of "
              f"the per-seed differences); † every seed's paired bootstrap has p < "
              f"{experiment.alpha} in the same direction"
              + ("." if comparison.fixed_seed else f"; ‡ Welch's t-test over the seed "
                 f"scores has p < {experiment.alpha}."), "", ""]
    return header + lines + footer, numbers


def comparison_tables(experiment: Experiment, cells: list[dict]) -> tuple[list[str], dict]:
    """The grid's ``comparisons`` (:class:`~ranmt.experiment.spec.Comparison`): per
    comparison and test set a table, over the test sets its rows share with their
    counterparts; comparison -> test -> dataset -> variant -> numbers."""
    lines: list[str] = []
    numbers: dict = {}
    for comparison in experiment.comparisons:
        pairs = _comparison_pairs(experiment, comparison, cells)
        tests = list(dict.fromkeys(t for d in experiment.datasets for t in d.tests))
        for test in tests if pairs else []:
            test_lines, test_numbers = _comparison_table(experiment, comparison, test, pairs)
            lines += test_lines
            if test_numbers:
                numbers.setdefault(comparison.name, {})[test] = test_numbers
    return lines, numbers
