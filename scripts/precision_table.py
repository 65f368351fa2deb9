"""bf16 against fp32 at equal steps: the same variants and seeds of two grids, side by side.

Reads the finished cells (``runs/DATASET/VARIANT/seedN/cell.json``) of an fp32 grid and a
bf16 grid and prints, per variant, test set and metric, each grid's mean +- sample std over
its seeds, the difference of the means, whether the bf16 mean lies within the fp32 seeds'
range (min..max) — the check the bf16 issue asks for before anything is trained in bf16 —
and, for the seeds both grids have, the same-seed differences; and each bf16 cell's
precision as its summary recorded it. (Training
speeds are not compared here: the grids ran at different times; see
benchmarks/profile_train.py for side-by-side ratios.)

    python scripts/precision_table.py docs/results/multi30k_en_de_1k \\
        docs/results/multi30k_en_de_1k_bf16 --variants TransF RAN-ALL

``--labels`` names the two grids otherwise (default ``fp32 bf16``), e.g. PyTorch's dropout
masks against ``train.dropout_masks=fast`` in bf16:

    python scripts/precision_table.py docs/results/multi30k_en_de_1k_bf16 \\
        docs/results/multi30k_en_de_1k_bf16_fast_masks --variants TransF RAN-ALL \\
        --labels "bf16, torch masks" "bf16, fast masks"
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = (("bleu", "SacreBLEU"), ("tok_bleu", "BLEU"), ("chrf", "chrF"), ("ter", "TER"))


def cells(grid: Path, variant: str) -> dict[int, dict]:
    found = {}
    for path in sorted(grid.glob(f"runs/*/{variant}/seed*/cell.json")):
        cell = json.loads(path.read_text(encoding="utf-8"))
        found[int(cell["seed"])] = cell
    return found


def mean_std(values: list[float]) -> str:
    if len(values) > 1:
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
    return f"{values[0]:.2f}" if values else "-"


def precision_of(cell: dict) -> str:
    return cell.get("train", {}).get("precision") or "fp32 (before it was recorded)"


def masks_of(cell: dict) -> str:
    return cell.get("config", {}).get("train", {}).get("dropout_masks", "torch")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32_grid", type=Path)
    p.add_argument("bf16_grid", type=Path)
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--labels", nargs=2, default=["fp32", "bf16"], metavar=("FIRST", "SECOND"),
                   help="names of the two grids in the table (default: fp32 bf16)")
    args = p.parse_args(argv)
    first_name, second_name = args.labels
    rows = []
    for variant in args.variants:
        full, half = cells(args.fp32_grid, variant), cells(args.bf16_grid, variant)
        if not full or not half:
            print(f"{variant}: missing in one of the grids")
            continue
        shared = sorted(set(full) & set(half))
        kinds = sorted({f"{precision_of(cell)}, {masks_of(cell)} dropout masks"
                        for cell in half.values()})
        print(f"{variant}: {first_name} seeds {sorted(full)}, {second_name} seeds "
              f"{sorted(half)}; {second_name} grid cells: {'; '.join(kinds)}")
        first = next(iter(full.values()))
        for test in first["tests"]:
            for key, label in METRICS:
                if key not in first["tests"][test]:
                    continue
                a = [cell["tests"][test][key] for cell in full.values()]
                b = [cell["tests"][test][key] for cell in half.values()]
                paired = [half[s]["tests"][test][key] - full[s]["tests"][test][key]
                          for s in shared]
                inside = min(a) <= statistics.mean(b) <= max(a)
                rows.append(f"| {variant} | {test} | {label} | {mean_std(a)} | {mean_std(b)} | "
                            f"{statistics.mean(b) - statistics.mean(a):+.2f} | "
                            f"{min(a):.2f}-{max(a):.2f}: {'yes' if inside else 'no'} | "
                            + " ".join(f"{d:+.2f}" for d in paired) + " |")
    a, b = first_name, second_name
    print(f"| variant | test set | metric | {a}, all its seeds (mean ± std) | {b} (mean ± std) "
          f"| {b} - {a} | {a} seeds' range: {b} mean inside? | same seed, {b} - {a} |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
