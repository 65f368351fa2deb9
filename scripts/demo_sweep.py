"""The demo's recipe chosen by measurement (issue 101): train a few recipes for the same
wall-time budget, one after another, and print what each reached.

``make demo`` trains TransF and RAN-ALL for a few minutes each on a CPU. What a budget of
minutes allows is a number of optimizer updates, and the recipe (batch size, warm-up, peak
learning rate, model size, vocabulary) decides what those updates make of it. Each recipe
here is a list of ``ranmt train`` overrides on ``configs/multi30k_small.yaml`` and a
prepared data folder (the vocabulary is the data's); every run gets the same budget and
the same final validation (greedy BLEU on the whole validation set, never the test sets),
one at a time (two trainings at once measure the machine, not the recipe).

    python scripts/demo_sweep.py --data8000 DATA8K --data4000 DATA4K --out DIR \\
        [--budget 3m] [--precision fp32] [--arch transf] [--only NAME ...]

Printed (and written to ``DIR/sweep.md``): per recipe the steps it trained, its target
tokens/s, and its validation BLEU and loss at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (vocabulary of the data, overrides on configs/multi30k_small.yaml)
RECIPES: dict[str, tuple[int, list[str]]] = {
    "today (4096 tok, warm-up 150)": (8000, ["data.max_tokens=4096", "train.warmup_steps=150"]),
    "2048 tok, warm-up 100": (8000, ["data.max_tokens=2048", "train.warmup_steps=100"]),
    "1024 tok, warm-up 100": (8000, ["data.max_tokens=1024", "train.warmup_steps=100"]),
    "2048 tok, lr 2e-3": (8000, ["data.max_tokens=2048", "train.warmup_steps=100",
                                 "train.lr=0.002"]),
    "2048 tok, vocab 4000": (4000, ["data.max_tokens=2048", "train.warmup_steps=100"]),
    "2048 tok, no dropout": (8000, ["data.max_tokens=2048", "train.warmup_steps=100",
                                    "model.dropout=0.0"]),
    "2048 tok, fast masks": (8000, ["data.max_tokens=2048", "train.warmup_steps=100",
                                    "train.dropout_masks=fast"]),
    "2048 tok, 2+2 layers": (8000, ["data.max_tokens=2048", "train.warmup_steps=100",
                                    "model.encoder.layers=2", "model.decoder.layers=2"]),
    # round 2: 1024 tokens (the best batch of round 1) with what else helped there
    "1024 tok, no dropout": (8000, ["data.max_tokens=1024", "train.warmup_steps=100",
                                    "model.dropout=0.0"]),
    "1024 tok, no dropout, vocab 4000": (4000, ["data.max_tokens=1024",
                                                "train.warmup_steps=100", "model.dropout=0.0"]),
    "512 tok, no dropout, vocab 4000": (4000, ["data.max_tokens=512", "train.warmup_steps=100",
                                               "model.dropout=0.0"]),
    "1024 tok, no dropout, vocab 4000, lr 2e-3": (4000, [
        "data.max_tokens=1024", "train.warmup_steps=100", "model.dropout=0.0",
        "train.lr=0.002"]),
    "1024 tok, no dropout, vocab 4000, no smoothing": (4000, [
        "data.max_tokens=1024", "train.warmup_steps=100", "model.dropout=0.0",
        "train.label_smoothing=0.0"]),
}

_DONE = re.compile(r"done: .*?; (\d+) steps, ([\d,]+) target tokens/s")
_VALID = re.compile(r"validate step (\d+): valid_loss ([\d.]+).*valid_bleu ([\d.]+)")


def outcome(log: str) -> dict:
    """steps, target tokens/s and the last validation's loss and BLEU of a train.log."""
    done = _DONE.findall(log)
    valid = _VALID.findall(log)
    if not done or not valid:
        raise ValueError("the run did not finish with a validation")
    steps, speed = done[-1]
    _, loss, bleu = valid[-1]
    return {"steps": int(steps), "tgt_tok_s": int(speed.replace(",", "")),
            "valid_loss": float(loss), "valid_bleu": float(bleu)}


def train(name: str, vocab: int, overrides: list[str], args) -> dict:
    """Train one recipe for the budget; its outcome (see :func:`outcome`)."""
    run = Path(args.out) / re.sub(r"[^\w]+", "_", name).strip("_")
    data = args.data8000 if vocab == 8000 else args.data4000
    command = [str(Path(sys.executable).parent / "ranmt"), "train", "--data", data,
               "--out", str(run), "--config", str(ROOT / "configs/multi30k_small.yaml"),
               f"model.arch={args.arch}", f"train.max_time={args.budget}",
               f"train.precision={args.precision}", "train.validate_every=100000",
               "train.valid_max_sentences=0", *overrides]
    started = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = outcome((run / "train.log").read_text())
    return {"recipe": name, "vocab": vocab, "overrides": overrides,
            "wall_s": round(time.monotonic() - started, 1), **result}


def table(rows: list[dict], header: dict) -> str:
    lines = [f"{header['arch']}, {header['precision']}, budget {header['budget']} "
             f"({header['cpu']}, torch {header['torch']})", "",
             "| recipe | vocab | steps | tgt tok/s | valid loss | valid BLEU (greedy) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['recipe']} | {row['vocab']} | {row['steps']} | "
                     f"{row['tgt_tok_s']:,} | {row['valid_loss']:.3f} | {row['valid_bleu']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import torch

    from ranmt.runtime.precision import cpu_description

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data8000", required=True, help="Multi30k prepared, --vocab-size 8000")
    p.add_argument("--data4000", required=True, help="Multi30k prepared, --vocab-size 4000")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", default="3m")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--arch", default="transf")
    p.add_argument("--only", nargs="+", choices=list(RECIPES), help="these recipes only")
    args = p.parse_args(argv)
    header = {"arch": args.arch, "precision": args.precision, "budget": args.budget,
              "cpu": cpu_description(), "torch": torch.__version__}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.only or RECIPES:
        vocab, overrides = RECIPES[name]
        rows.append(train(name, vocab, overrides, args))
        print(json.dumps(rows[-1]), flush=True)
    report = table(rows, header)
    print(report)
    (Path(args.out) / "sweep.md").write_text(report + "\n")
    (Path(args.out) / "sweep.json").write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
