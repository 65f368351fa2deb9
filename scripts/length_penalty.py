"""How long do a grid's systems write, and what does a length penalty chosen on valid change?

Two parts, both over a finished ``ranmt experiment`` grid (``OUT/runs/DATASET/VARIANT/seedN``):

1. **Output lengths** (needs only the committed hypotheses): for every cell and decoding
   (``TEST.hyp`` is the grid's beam, ``TEST.NAME.hyp`` its ``also_decode`` entries), the
   ratio of hypothesis to reference words as sacreBLEU counts them for BLEU (13a tokens;
   BLEU's brevity penalty is ``exp(1 - 1/ratio)`` below 1), mean over seeds.
2. **Length penalty on valid** (needs the cells' checkpoints, ``WORK/OUT-NAME/runs/...``):
   each checkpoint decodes the valid split with every ``--lenpens`` exponent (the grid's
   beam and penalty style otherwise), keeps the exponent of the best valid SacreBLEU, and
   decodes the test sets with it: SacreBLEU, chrF, TER and length ratio beside the grid's
   own numbers (cell.json). Nothing is chosen on a test set.

    python scripts/length_penalty.py docs/results/multi30k_students \\
        --work ~/ranmt-work/multi30k_students --out docs/results/multi30k_students/length

writes ``OUT/lengths.md``/``.json`` (part 1) and ``OUT/lenpen.md``/``.json`` with the chosen
exponent's test hypotheses in ``OUT/DATASET/VARIANT/seedN/`` (part 2; skipped with
``--lengths-only``). Part 2 keeps the rows of an earlier ``OUT/lenpen.json`` whose cells'
checkpoints are no longer under ``--work`` (a grid that outlived its machines). References
are the cells' prepared data (``config.data.dir`` of each cell.json, read from the
repository root).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ranmt.data.corpus import load_meta, raw_text
from ranmt.data.text import write_lines
from ranmt.evaluate import score


def _cells(grid: Path) -> list[tuple[str, str, int, Path, dict]]:
    """(dataset, variant, seed, cell folder, cell.json) of every finished cell."""
    found = []
    for cell_json in sorted(grid.glob("runs/*/*/seed*/cell.json")):
        cell = json.loads(cell_json.read_text())
        found.append((cell["dataset"], cell["variant"], int(cell["seed"]), cell_json.parent,
                      cell))
    return found


def _references(cell: dict, split: str) -> list[str]:
    return raw_text(cell["config"]["data"]["dir"], split, "tgt")


def output_lengths(grid: Path) -> dict:
    """{dataset: {variant: {decoding: {test: {"per_seed": {seed: ratio}, "mean": ratio}}}}}."""
    table: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for dataset, variant, seed, folder, cell in _cells(grid):
        for test in cell["tests"]:
            refs = _references(cell, test)
            for hyp_file in sorted(folder.glob(f"{test}*.hyp")):
                decoding = hyp_file.name[len(test) + 1:-len(".hyp")] or "beam"
                hyps = hyp_file.read_text(encoding="utf-8").splitlines()
                ratio = score(hyps, refs, ("bleu",), length_ratio=True)["length_ratio"]
                entry = table[dataset][variant][decoding].setdefault(test, {"per_seed": {}})
                entry["per_seed"][seed] = ratio
    for variants in table.values():
        for decodings in variants.values():
            for tests in decodings.values():
                for entry in tests.values():
                    entry["mean"] = round(statistics.mean(entry["per_seed"].values()), 4)
    return json.loads(json.dumps(table))


def lengths_markdown(table: dict, decodings=("beam", "greedy", "deployed")) -> str:
    tests = sorted({t for v in table.values() for d in v.values() for x in d.values() for t in x})
    lines = ["| dataset | variant | seeds | " + " | ".join(
        f"{d} {t}" for d in decodings for t in tests) + " |",
        "|---|---|---|" + "---:|" * (len(decodings) * len(tests))]
    for dataset, variants in table.items():
        for variant, by_decoding in variants.items():
            seeds = len(by_decoding["beam"][tests[0]]["per_seed"])
            cells = [f"{by_decoding[d][t]['mean']:.3f}" if d in by_decoding else "-"
                     for d in decodings for t in tests]
            lines.append(f"| {dataset} | {variant} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rounded(row: dict) -> dict:
    """A decode's scores as the tables show them."""
    return {"bleu": round(row["bleu"], 2), "chrf": round(row["chrf"], 2),
            "ter": round(row["ter"], 2), "ratio": round(row["length_ratio"], 4),
            "seconds": round(row["seconds"], 1)}


def _split_text(cell: dict, split: str) -> tuple[list[str], list[str], str]:
    """(sources, references, target language) of a cell's prepared ``split``."""
    data = cell["config"]["data"]["dir"]
    return raw_text(data, split, "src"), _references(cell, split), \
        load_meta(data).get("tgt_lang", "")


def valid_chosen_lenpen(grid: Path, work: Path, lenpens: list[float], out: Path) -> list[dict]:
    """One row per cell whose checkpoint is under ``work``: valid BLEU per exponent, the
    chosen exponent (:func:`ranmt.inference.sweep.sweep`: best valid SacreBLEU at two
    decimals, ties to the exponent listed first), and the tests at it beside the grid's own
    scores (their hypotheses in ``out/DATASET/VARIANT/seedN/TEST.hyp``, for ``ranmt
    score``'s paired bootstrap)."""
    from ranmt.inference.sweep import sweep
    from ranmt.inference.translator import Translator

    metrics = ["bleu", "chrf", "ter"]
    rows = []
    for dataset, variant, seed, _, cell in _cells(grid):
        run = work / "runs" / dataset / variant / f"seed{seed}" / "run"
        if not (run / "best").exists():
            continue
        translator = Translator.load(run, device="cpu")
        sources, refs, tgt_lang = _split_text(cell, "valid")
        valid = sweep(translator, sources, refs, {"lenpen": lenpens}, metrics, tgt_lang)
        chosen = valid["best"]["lenpen"]
        tests = {}
        for test in cell["tests"]:
            hyp_file = out / dataset / variant / f"seed{seed}" / f"{test}.hyp"
            sources, refs, tgt_lang = _split_text(cell, test)
            at_chosen = sweep(translator, sources, refs, {"lenpen": [chosen]}, metrics,
                              tgt_lang)
            hyp_file.parent.mkdir(parents=True, exist_ok=True)
            write_lines(hyp_file, at_chosen["hypotheses"][0])
            tests[test] = {"grid": {m: cell["tests"][test][m] for m in metrics},
                           "chosen": _rounded(at_chosen["rows"][0])}
        rows.append({"dataset": dataset, "variant": variant, "seed": seed,
                     "grid_lenpen": cell["config"]["decode"]["lenpen"],
                     "valid": {str(row["values"]["lenpen"]): _rounded(row)
                               for row in valid["rows"]},
                     "chosen_lenpen": chosen, "tests": tests})
        print(f"{dataset} {variant} seed {seed}: valid "
              + ", ".join(f"{row['values']['lenpen']}: {row['bleu']:.2f} "
                          f"({row['length_ratio']:.3f})"
                          for row in valid["rows"]) + f" -> {chosen}", file=sys.stderr)
    return rows


def keep_earlier_rows(rows: list[dict], earlier_file: Path) -> list[dict]:
    """``rows`` and, from an earlier run's ``lenpen.json``, the rows of cells this run did
    not decode (their checkpoints gone with an earlier machine; their test hypotheses are
    still in ``out``), in (dataset, variant, seed) order. A row this run measured replaces
    the earlier one; an earlier row with other exponents is dropped (one table, one set)."""
    if not earlier_file.is_file():
        return rows
    measured = {(row["dataset"], row["variant"], row["seed"]) for row in rows}
    exponents = list(rows[0]["valid"]) if rows else None
    kept = [row for row in json.loads(earlier_file.read_text())
            if (row["dataset"], row["variant"], row["seed"]) not in measured
            and (exponents is None or list(row["valid"]) == exponents)]
    return sorted(rows + kept, key=lambda row: (row["dataset"], row["variant"], row["seed"]))


def lenpen_markdown(rows: list[dict]) -> str:
    if not rows:
        return "no checkpoints found\n"
    tests = list(rows[0]["tests"])
    lenpens = list(rows[0]["valid"])
    head = ("| dataset | variant | seed | " + " | ".join(f"valid {lp}" for lp in lenpens)
            + " | chosen | " + " | ".join(f"{t} BLEU (grid → chosen)" for t in tests)
            + " | " + " | ".join(f"{t} TER (grid → chosen)" for t in tests)
            + " | " + " | ".join(f"{t} ratio" for t in tests) + " |")
    lines = [head, "|---|---|---:|" + "---:|" * (len(lenpens) + 1 + 3 * len(tests))]
    for row in rows:
        valid = " | ".join(f"{row['valid'][lp]['bleu']:.2f} ({row['valid'][lp]['ratio']:.3f})"
                           for lp in lenpens)
        bleu = " | ".join(f"{row['tests'][t]['grid']['bleu']:.2f} → "
                          f"{row['tests'][t]['chosen']['bleu']:.2f}" for t in tests)
        ter = " | ".join(f"{row['tests'][t]['grid']['ter']:.2f} → "
                         f"{row['tests'][t]['chosen']['ter']:.2f}" for t in tests)
        ratio = " | ".join(f"{row['tests'][t]['chosen']['ratio']:.3f}" for t in tests)
        lines.append(f"| {row['dataset']} | {row['variant']} | {row['seed']} | {valid} | "
                     f"{row['chosen_lenpen']} | {bleu} | {ter} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", type=Path, help="a grid's output folder (runs/ inside)")
    parser.add_argument("--work", type=Path, help="the grid's work folder (checkpoints)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables")
    parser.add_argument("--lenpens", type=float, nargs="+", default=[0.6, 1.0, 1.5, 2.0],
                        help="GNMT exponents tried on valid; the first is the grid's")
    parser.add_argument("--lengths-only", action="store_true", help="skip part 2")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    table = output_lengths(args.grid)
    (args.out / "lengths.json").write_text(json.dumps(table, indent=1) + "\n")
    (args.out / "lengths.md").write_text(lengths_markdown(table))
    print(lengths_markdown(table))
    if args.lengths_only or args.work is None:
        return
    rows = keep_earlier_rows(valid_chosen_lenpen(args.grid, args.work, args.lenpens, args.out),
                             args.out / "lenpen.json")
    (args.out / "lenpen.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "lenpen.md").write_text(lenpen_markdown(rows))
    print(lenpen_markdown(rows))


if __name__ == "__main__":
    main()
