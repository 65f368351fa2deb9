"""The last words of ``make demo`` (issue 101): what the two demo models reached, read as a
result — each model's SacreBLEU on test_2016_flickr with the paired bootstrap's mark
against the first, its steps in the budget, its translation of the demo sentence — and
how far that is from the converged models of docs/RESULTS.md (their BLEU read from the
committed grid, ``docs/results/multi30k_converged/results.json``), so that nobody takes a
model of a few minutes for the toolkit's quality.

    python scripts/demo_summary.py --scores SCORES.json --budget 3m \\
        --model TransF RUN TRANSLATION --model RAN-ALL RUN TRANSLATION \\
        [--converged docs/results/multi30k_converged/results.json]

``SCORES.json``: ``ranmt score --json`` of the models' test outputs, in the same order (the
first is the baseline); ``RUN``: the model's training folder (its train.log gives the
steps); ``TRANSLATION``: a file holding its translation of the demo sentence.
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERGED = ROOT / "docs/results/multi30k_converged/results.json"
ALPHA = 0.05
_STEPS = re.compile(r"done: .*?; (\d+) steps")


def trained_steps(run: Path) -> int | None:
    """Optimizer steps of a finished ``ranmt train`` run (its train.log's last line)."""
    log = run / "train.log"
    found = _STEPS.findall(log.read_text()) if log.is_file() else []
    return int(found[-1]) if found else None


def converged_bleu(path: Path, variant: str, test: str = "test_2016_flickr"
                   ) -> tuple[float, int] | None:
    """(mean SacreBLEU over seeds, seeds) of ``variant`` in a committed grid, or None."""
    if not path.is_file():
        return None
    results = json.loads(path.read_text())
    for dataset in results["datasets"].values():
        score = dataset["tests"].get(test, {}).get("scores", {}).get(variant)
        if score is not None:
            return score["bleu"]["mean"], len(score["bleu"]["per_seed"])
    return None


def summary(scores: dict, models: list[tuple[str, Path, str]], budget: str,
            converged: Path = CONVERGED) -> str:
    """The summary's lines (see the module docstring)."""
    systems = scores["systems"]
    if len(systems) != len(models):
        raise ValueError(f"{len(systems)} scored systems for {len(models)} models")
    width = max(len(name) for name, _, _ in models)
    lines = [f"== the demo's models after {budget} of training each "
             f"(test_2016_flickr, SacreBLEU)"]
    for (name, run, translation), system in zip(models, systems):
        p = system.get("bleu_p")
        mark = "†" if p is not None and p < ALPHA else " "
        steps = trained_steps(run)
        lines.append(f"  {name:<{width}}  {system['bleu']:5.1f} {mark}  "
                     f"{'?' if steps is None else f'{steps:,}'} steps   {translation}")
    baseline = models[0][0]
    for (name, _, _), system in zip(models[1:], systems[1:]):
        p = system["bleu_p"]
        verdict = "a significant difference" if p < ALPHA else "no significant difference"
        lines.append(f"  {name} against {baseline}: paired bootstrap p = {p:.3f}, "
                     f"{verdict} († p < {ALPHA})")
    reached = [(name, converged_bleu(converged, name)) for name, _, _ in models]
    known = [f"{name} {found[0]:.1f}" for name, found in reached if found is not None]
    if known:
        seeds = max(found[1] for _, found in reached if found is not None)
        lines += textwrap.wrap(
            f"Trained to convergence (docs/RESULTS.md: the same data and model size, "
            f"thousands of steps, mean of {seeds} seeds) they reach {' and '.join(known)} "
            f"on this test set: a demo of minutes shows the pipeline and the first of "
            f"learning, not the models' quality.", width=92, initial_indent="  ",
            subsequent_indent="  ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scores", required=True, help="ranmt score --json of the test outputs")
    p.add_argument("--model", nargs=3, action="append", required=True,
                   metavar=("NAME", "RUN", "TRANSLATION"))
    p.add_argument("--budget", required=True, help="the training budget of each model")
    p.add_argument("--converged", default=str(CONVERGED), help="a converged grid's results.json")
    args = p.parse_args(argv)
    models = [(name, Path(run), Path(text).read_text().strip())
              for name, run, text in args.model]
    print(summary(json.loads(Path(args.scores).read_text()), models, args.budget,
                  Path(args.converged)))


if __name__ == "__main__":
    main()
