"""The pieces every table of a grid shares (``ranmt.experiment.tables``,
``ranmt.experiment.comparison_tables``): row names, mean ± std over seeds, a cell's
hypotheses, the metrics in the RAN paper's order, paired-bootstrap p-values (through the
bootstrap cache) and scores with their per-seed differences."""

from __future__ import annotations

import statistics
from pathlib import Path

from ranmt.config import VALID_METRIC_NAMES
from ranmt.evaluate import BOOTSTRAP_SEED, TASK_METRICS, paired_bootstrap
from ranmt.experiment import bootstrap_cache
from ranmt.experiment.spec import Experiment

ROW_NAMES = {"tok_bleu": "BLEU", "bleu": "SacreBLEU", "chrf": "chrF", "ter": "TER",
             "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}


def best_valid_score(train: dict) -> float | None:
    """The best validation score of a cell's training summary (``train.valid_metric``;
    cells from before the field: their BLEU); None where it chose by the loss."""
    return train["best_valid_score"] if "best_valid_score" in train \
        else train.get("best_valid_bleu")


def valid_metric_name(cells: list[dict]) -> str:
    """How a table names the best validation scores of these cells: "BLEU", "ROUGE-L"...,
    "score" where they chose by different metrics."""
    names = {c["train"].get("valid_metric", "bleu") for c in cells} - {"loss"}
    if len(names) != 1:
        return "score"
    return VALID_METRIC_NAMES[names.pop()]


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1) over seeds; std None for one seed."""
    if len(values) == 1:
        return values[0], None
    return statistics.mean(values), statistics.stdev(values)


def format_score(mean: float, std: float | None) -> str:
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def read_hyps(experiment: Experiment, cell: dict, test: str, recorded: str | None = None,
               setting: str | None = None) -> list[str]:
    """A cell's hypotheses for ``test`` (``setting``: of that ``also_decode`` setting), from
    its cell directory (so that a results folder that was moved or checked out elsewhere
    still works), else the ``recorded`` path (default: the grid decode's)."""
    name = f"{test}.hyp" if setting is None else f"{test}.{setting}.hyp"
    path = experiment.cell_dir(cell["dataset"], cell["variant"], cell["seed"]) / name
    if not path.is_file():
        path = Path(recorded or cell["tests"][test]["hyp_file"])
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def scored_on(by_variant: dict[str, list[dict]], test: str) -> dict[str, list[dict]]:
    """The cells that have scored ``test``, per variant (a test set added to the grid after
    a cell finished is scored once its checkpoint is decoded: ``cells.missing_tests``)."""
    return {name: [c for c in cells if test in c["tests"]] for name, cells in by_variant.items()}


def metrics_in_order(task: str) -> list[str]:
    """The metrics in the RAN paper's row order (BLEU, SacreBLEU, chrF, TER), then the rest."""
    return sorted(TASK_METRICS[task],
                  key=lambda m: list(ROW_NAMES).index(m) if m in ROW_NAMES else 99)


def paired_p_values(systems: list[tuple[str, list[str]]], refs: list[str],
                     metrics: list[str], samples: int) -> list[dict[str, float]]:
    """metric -> paired-bootstrap p of each of ``systems[1:]`` against ``systems[0]``:
    through the active :mod:`.bootstrap_cache` (:func:`~.bootstrap_cache.cached_bootstraps`,
    which :func:`~ranmt.experiment.results.write_results` opens), else computed."""
    cache = bootstrap_cache.active()
    if cache is not None:
        return cache.p_values(systems, refs, metrics, samples, BOOTSTRAP_SEED,
                              paired_bootstrap)
    result = paired_bootstrap(systems, refs, metrics, samples)
    return [{metric: row[f"{metric}_p"] for metric in metrics}
            for row in result["systems"][1:]]


def with_difference(scores: dict[int, float], reference: dict[int, float]
                     ) -> tuple[str, list[float]]:
    """"mean (±d ± std)": the mean ± std of ``scores`` (seed -> score) and of their per-seed
    differences to ``reference`` (seed -> score, every seed of ``scores``); and those
    differences, in ``scores``' seed order."""
    deltas = [scores[seed] - reference[seed] for seed in scores]
    delta_mean, delta_std = mean_std(deltas)
    return (f"{format_score(*mean_std(list(scores.values())))} ({delta_mean:+.2f}"
            + ("" if delta_std is None else f" ± {delta_std:.2f}") + ")"), deltas
