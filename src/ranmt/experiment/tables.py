"""The result tables of a grid: per test set the RAN paper's Table 1 layout (mean +- std
over seeds, difference to the baseline, the seed rule's marks, :func:`compare_over_seeds`),
the other decodings of the same checkpoints, the main metric per seed (every test set side
by side), the training table, and the comparisons across datasets (a student on distilled
data against itself on the original, against its teacher).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ranmt.data.corpus import raw_text
from ranmt.evaluate import compare_over_seeds, marks_suffix
from ranmt.experiment.comparison_tables import comparison_tables
from ranmt.experiment.spec import Dataset, Experiment, flow
from ranmt.experiment.table_parts import (
    ROW_NAMES,
    best_valid_score,
    format_score,
    mean_std,
    metrics_in_order,
    paired_p_values,
    read_hyps,
    scored_on,
    valid_metric_name,
    with_difference,
)


def _bootstrap_p_values(experiment: Experiment, test: str, refs: list[str],
                        base_cells: dict[int, dict], variants: dict[str, list[dict]],
                        metrics: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """variant -> metric -> seed -> paired-bootstrap p of the variant against the same seed's
    baseline. One sacreBLEU test per seed holds the baseline and every variant of that seed:
    each system is resampled with the same indices (sacreBLEU reseeds per system), so the
    p-values are those of one test per pair, without the baseline's statistics and
    confidence interval computed again for every variant."""
    sig_metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    pvalues: dict[str, dict[str, dict[int, float]]] = {
        name: {m: {} for m in sig_metrics} for name in variants}
    if not sig_metrics:
        return pvalues
    for seed, base in base_cells.items():
        entries = [(name, cell) for name, cells in variants.items() for cell in cells
                   if cell["seed"] == seed]
        if not entries:
            continue
        rows = paired_p_values(
            [(experiment.baseline, read_hyps(experiment, base, test))]
            + [(name, read_hyps(experiment, cell, test)) for name, cell in entries],
            refs, sig_metrics, experiment.bootstrap_samples)
        for (name, _), row in zip(entries, rows):
            for metric in sig_metrics:
                pvalues[name][metric][seed] = row[metric]
    return pvalues


def _test_table(experiment: Experiment, dataset: Dataset, test: str,
                by_variant: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """One test set's table (metric rows, variant columns) and its numbers; no table where
    no cell has scored the test set yet."""
    metrics = metrics_in_order(dataset.task)
    present = [n for n, cells in by_variant.items() if cells]
    if not present:
        return [], {"scores": {}, "significance": {}}
    scores = {name: {metric: {c["seed"]: c["tests"][test][metric] for c in by_variant[name]}
                     for metric in metrics} for name in present}
    refs = raw_text(Path(experiment.out) / "data" / dataset.references_from, test, "tgt")
    base_cells = {c["seed"]: c for c in by_variant.get(experiment.baseline, [])}
    comparisons: dict = {}
    variants = {name: by_variant[name] for name in present if name != experiment.baseline}
    if base_cells and variants:
        pvalues = _bootstrap_p_values(experiment, test, refs, base_cells, variants, metrics)
        for name, by_metric in pvalues.items():
            comparisons[name] = {
                metric: compare_over_seeds(scores[experiment.baseline][metric],
                                           scores[name][metric], seeds, experiment.alpha)
                for metric, seeds in by_metric.items()}
    lines = [f"## {dataset.name} — {test}", "",
             "| metric | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
    for metric in metrics:
        row = []
        for name in present:
            text = format_score(*mean_std(list(scores[name][metric].values())))
            comparison = comparisons.get(name, {}).get(metric)
            if name != experiment.baseline and experiment.baseline in scores:
                base_mean = statistics.mean(scores[experiment.baseline][metric].values())
                delta = statistics.mean(scores[name][metric].values()) - base_mean
                text += f" ({delta:+.2f})" + marks_suffix(comparison)
            row.append(text)
        lines.append(f"| {ROW_NAMES.get(metric, metric)} | " + " | ".join(row) + " |")
    lines.append("")
    numbers = {"scores": {n: {m: {"mean": mean_std(list(v.values()))[0],
                                  "std": mean_std(list(v.values()))[1],
                                  "per_seed": {str(k): x for k, x in v.items()}}
                              for m, v in t.items()} for n, t in scores.items()},
               "significance": comparisons}
    return lines, numbers


def _also_decode_p_values(experiment: Experiment, test: str, refs: list[str], runs: list[dict],
                          setting: str, metrics: list[str]) -> dict[str, dict[int, float]]:
    """metric -> seed -> paired-bootstrap p of a setting's hypotheses against the grid
    decode's of the same cell (the first system, named "decode")."""
    pvalues: dict[str, dict[int, float]] = {m: {} for m in metrics}
    for cell in runs if metrics else []:
        recorded = cell["also_decode"][setting]["tests"][test]["hyp_file"]
        [row] = paired_p_values(
            [("decode", read_hyps(experiment, cell, test)),
             (setting, read_hyps(experiment, cell, test, recorded, setting))],
            refs, metrics, experiment.bootstrap_samples)
        for metric in metrics:
            pvalues[metric][cell["seed"]] = row[metric]
    return pvalues


def _also_decode_table(experiment: Experiment, dataset: Dataset, test: str,
                       by_variant: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """One test set's table of the ``also_decode`` settings: per variant and setting the
    metrics' means and the difference to the grid's decode of the same checkpoints (mean ±
    std of the per-seed differences), † where every seed's paired bootstrap against that
    decode has p < alpha in the same direction. Empty where no cell has such a setting."""
    metrics = metrics_in_order(dataset.task)
    sig_metrics = [m for m in metrics if m in ("bleu", "chrf", "ter")]
    refs = None
    lines: list[str] = []
    numbers: dict = {}
    for name, cells in by_variant.items():
        settings = [s for s in experiment.also_decode
                    if any(s in c.get("also_decode", {}) for c in cells)]
        for setting in settings:
            runs = [c for c in cells
                    if test in c.get("also_decode", {}).get(setting, {}).get("tests", {})]
            if not runs:
                continue
            refs = refs if refs is not None else raw_text(
                Path(experiment.out) / "data" / dataset.references_from, test, "tgt")
            pvalues = _also_decode_p_values(experiment, test, refs, runs, setting, sig_metrics)
            row, entry = [], {}
            for metric in metrics:
                main = {c["seed"]: c["tests"][test][metric] for c in runs}
                alt = {c["seed"]: c["also_decode"][setting]["tests"][test][metric] for c in runs}
                text, deltas = with_difference(alt, main)
                comparison = None
                if metric in pvalues:
                    comparison = compare_over_seeds(main, alt, pvalues[metric], experiment.alpha)
                    text += " †" if comparison["dagger"] else ""
                row.append(text)
                entry[metric] = {"per_seed": {str(k): v for k, v in alt.items()},
                                 "per_seed_delta": dict(zip(map(str, main), deltas)),
                                 "significance": comparison}
            lines.append(f"| {name} | {_setting_label(setting, runs)} | {len(runs)} | "
                         + " | ".join(row) + " |")
            numbers.setdefault(name, {})[setting] = entry
    if not lines:
        return [], {}
    header = [f"## {dataset.name} — {test}: other decodings of the same checkpoints", "",
              "| variant | decoding | seeds | "
              + " | ".join(ROW_NAMES.get(m, m) for m in metrics) + " |",
              "|---|---|---|" + "---|" * len(metrics)]
    settings_text = "; ".join(f"{name}: {flow(options)}"
                              for name, options in experiment.also_decode.items())
    footer = ["", f"Settings over the grid's decode {flow(experiment.decode)}: {settings_text}. "
              "(±x): the difference to the grid's decode of the same checkpoint (mean ± std "
              f"of the per-seed differences); † every seed's paired bootstrap has p < "
              f"{experiment.alpha} in the same direction."
              + (f" sweep: each cell's value chosen on the valid split by {metrics[0]} "
                 "(per seed in brackets); no test set takes part."
                 if any("sweep" in options for options in experiment.also_decode.values())
                 else ""), "", ""]
    return header + lines + footer, numbers


def _setting_label(setting: str, runs: list[dict]) -> str:
    """An ``also_decode`` setting's name, with the values its cells chose on valid (a
    ``sweep`` setting; per seed): ``valid-lenpen (lenpen 2 / 2.5 / 4)``, ``tuned (beam,
    lenpen 4, 2 / 8, 1)``."""
    chosen = [run["also_decode"][setting].get("chosen") for run in runs]
    if not any(chosen):
        return setting
    fields = list(next(c for c in chosen if c)["value"])
    values = " / ".join(", ".join(f"{c['value'][f]:g}" for f in fields) if c else "-"
                        for c in chosen)
    return f"{setting} ({', '.join(fields)} {values})"


def _steps_text(cells: list[dict]) -> tuple[str, str]:
    """'steps' and 'best step' columns: per seed, '*' where the best checkpoint is the last."""
    steps = [c["train"]["steps"] for c in cells]
    steps_text = f"{steps[0]:,}" if len(set(steps)) == 1 else " / ".join(f"{x:,}" for x in steps)
    best = []
    for cell in cells:
        best_step = cell["train"].get("best_step")
        still_improving = best_step is not None and best_step == cell["train"]["steps"]
        best.append(f"{best_step:,}" + ("*" if still_improving else "")
                    if best_step is not None else "-")
    return steps_text, " / ".join(best)


def _per_seed_table(experiment: Experiment, dataset: Dataset,
                    by_variant: dict[str, list[dict]]) -> list[str]:
    """The main metric (SacreBLEU; ROUGE-L for summarization) of every cell: a row per seed,
    a column per variant, the test sets side by side ("-" where a cell has not run)."""
    metric = "rougeL" if dataset.task == "summarization" else "bleu"
    present = [name for name, cells in by_variant.items() if cells]
    if not present:
        return []
    tests = list(dataset.tests)
    lines = [f"## {dataset.name} — {ROW_NAMES.get(metric, metric)} per seed "
             f"({' / '.join(tests)})", "",
             "| seed | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
    by_seed = {name: {c["seed"]: c for c in by_variant[name]} for name in present}
    for seed in experiment.seeds:  # the grid's cells only have the grid's seeds
        if not any(seed in cells for cells in by_seed.values()):
            continue
        row = ["-" if seed not in by_seed[name] else
               " / ".join(f"{by_seed[name][seed]['tests'][test][metric]:.2f}"
                          if test in by_seed[name][seed]["tests"] else "-" for test in tests)
               for name in present]
        lines.append(f"| {seed} | " + " | ".join(row) + " |")
    return lines + [""]


def _training_table(experiment: Experiment, dataset: Dataset,
                    by_variant: dict[str, list[dict]]) -> tuple[list[str], dict]:
    """Per variant: seeds, optimizer steps, best step (still improving?), cost, speed."""
    every_cell = [c for runs in by_variant.values() for c in runs]
    lines = [f"## {dataset.name} — training and cost per variant", "",
             f"| variant | seeds | steps | best step | best valid {valid_metric_name(every_cell)}"
             " | parameters | "
             "training time (min) | train tgt tok/s | decode sent/s | decode tgt tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    numbers = {}
    first_test = next(iter(dataset.tests), None)
    for name, runs in by_variant.items():
        if not runs:
            continue
        timed = scored_on({name: runs}, first_test)[name] if first_test else []
        steps_text, best_text = _steps_text(runs)
        best_scores = [best_valid_score(c["train"]) for c in runs
                       if best_valid_score(c["train"]) is not None]
        train_min = mean_std([c["train"]["wall_time_s"] / 60 for c in runs])
        train_tok = mean_std([c["train"]["train_tokens_per_s"] for c in runs])
        sent = mean_std([c["tests"][first_test]["sentences_per_s"] for c in timed]) \
            if timed else (0.0, None)
        tok = mean_std([c["tests"][first_test]["target_tokens_per_s"] for c in timed]) \
            if timed else (0.0, None)
        best_text_score = format_score(*mean_std(best_scores)) if best_scores else "-"
        lines.append(f"| {name} | {len(runs)} | {steps_text} | {best_text} | {best_text_score} | "
                     f"{runs[0]['parameters']:,} | {format_score(*train_min)} | "
                     f"{format_score(*train_tok)} | {format_score(*sent)} | {format_score(*tok)} |")
        numbers[name] = {
            "parameters": runs[0]["parameters"], "seeds": [c["seed"] for c in runs],
            "steps": [c["train"]["steps"] for c in runs],
            "best_step": [c["train"].get("best_step") for c in runs],
            "still_improving": [c["train"].get("best_step") == c["train"]["steps"]
                                for c in runs],
            "stop_reason": [c["train"].get("stop_reason") for c in runs],
            "training_minutes": train_min, "train_tokens_per_s": train_tok,
            "decode_sentences_per_s": sent, "decode_tokens_per_s": tok}
    return lines, numbers


def _legend(alpha: float) -> list[str]:
    return ["", "Scores: mean ± sample std over seeds (one seed: the score alone); (±x) is "
            "the difference of the means to the baseline. BLEU: tokenized (sacremoses) as "
            "multi-bleu.perl; SacreBLEU: detokenized, 13a.",
            f"† every seed's paired bootstrap against the baseline's run with the same seed "
            f"has p < {alpha} and all seeds differ in the same direction; ‡ Welch's t-test "
            f"over the seed scores has p < {alpha} (needs two or more seeds per side).",
            "steps: optimizer steps each cell ran (one number when all seeds ran the same); "
            "best step: the step of the checkpoint that was evaluated, per seed, * where it "
            "is the last validated one (still improving when training stopped). Decoding "
            "speed on the first test set.", ""]


def build_tables(experiment: Experiment, cells: list[dict]) -> tuple[str, dict]:
    """results.md text and the results dict (with significance against the baseline)."""
    names = [v.name for v in experiment.variants]
    lines = [f"# Results: {experiment.name}", ""]
    results: dict = {"experiment": experiment.name, "alpha": experiment.alpha, "datasets": {}}
    for dataset in experiment.datasets:
        by_variant = {name: [c for c in cells if c["dataset"] == dataset.name
                             and c["variant"] == name] for name in names}
        dataset_result: dict = {"tests": {}, "variants": {}}
        for test in dataset.tests:
            test_lines, dataset_result["tests"][test] = _test_table(
                experiment, dataset, test, scored_on(by_variant, test))
            lines += test_lines
        for test in dataset.tests:
            also_lines, also = _also_decode_table(experiment, dataset, test,
                                                  scored_on(by_variant, test))
            if also:
                dataset_result.setdefault("also_decode", {})[test] = also
            lines += also_lines
        lines += _per_seed_table(experiment, dataset, by_variant)
        training_lines, dataset_result["variants"] = _training_table(experiment, dataset,
                                                                     by_variant)
        lines += training_lines + _legend(experiment.alpha)
        results["datasets"][dataset.name] = dataset_result
    across_lines, across = comparison_tables(experiment, cells)
    if across:
        lines += across_lines
        results["comparisons"] = across
    return "\n".join(lines), results
