"""ranmt at WMT scale on one machine: ``ranmt prepare`` and the trainer's start-up on
synthetic WMT-length corpora, and batch planning at WMT14 En-Fr's 36M pairs.

No WMT corpus can be fetched here, so the corpora are made of Multi30k: every line joins two
random Multi30k training sentences of its language with the words shuffled (about 28-30
subwords a side, the length of WMT news text; word order is nonsense, which costs
SentencePiece and the encoder nothing extra). For each ``--sizes N`` it reports:

* ``prepare``: wall time, pairs/s and the peak RSS of the whole process tree (``ranmt
  prepare`` and its workers, sampled from /proc every 0.1 s);
* ``first step``: ``seconds_to_first_step`` of ``ranmt train``'s summary (small model, one
  step): loading the memory-mapped splits, building the model, batch planning of the first
  epoch and the step itself; in parentheses the whole process, imports, the end-of-run
  validation (valid loss on 1,000 pairs) and checkpoint included;

then times batch planning (:func:`ranmt.data.batching.make_batches`, one training epoch's
plan, ``max_tokens`` 4096) at ``--plan-size`` pairs with lengths drawn from the largest
prepared corpus, and, side by side at ``--reference-size`` pairs, against ranmt 0.1's
planner (a Python loop over every example; the test suite checks both give the same
batches).

    python benchmarks/scale.py --work /tmp/ranmt-scale --sizes 300000 1000000 4500000
    python benchmarks/scale.py --work /tmp/ranmt-scale --sizes 300000 --plan-size 36000000

Needs ``$RANMT_DATA_DIR/multi30k/train.{en,de}.gz`` and disk: ~330 MB per million pairs of
text plus ~250 MB per million prepared.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_corpus(prefix: Path, pairs: int, multi30k: Path, seed: int = 0) -> None:
    """Write PREFIX.en / PREFIX.de: ``pairs`` lines of two shuffled Multi30k sentences."""
    if Path(f"{prefix}.en").is_file() and Path(f"{prefix}.de").is_file():
        return
    sides = {}
    for lang in ("en", "de"):
        with gzip.open(multi30k / f"train.{lang}.gz", "rt", encoding="utf-8") as handle:
            sides[lang] = [line.split() for line in handle.read().splitlines()]
    rng = random.Random(seed)
    count = len(sides["en"])
    with open(f"{prefix}.en.tmp", "w", encoding="utf-8") as en, \
            open(f"{prefix}.de.tmp", "w", encoding="utf-8") as de:
        for _ in range(pairs):
            first, second = rng.randrange(count), rng.randrange(count)
            for lang, handle in (("en", en), ("de", de)):
                words = sides[lang][first] + sides[lang][second]
                rng.shuffle(words)
                handle.write(" ".join(words) + "\n")
    for lang in sides:
        os.replace(f"{prefix}.{lang}.tmp", f"{prefix}.{lang}")


def _tree_rss_kb(root: int) -> int:
    """Resident set size (kB) of process ``root`` and all its descendants."""
    parents: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss[int(entry)] = int(line.split()[1])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(parents.get(pid, []))
    return total


def run_measured(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS of the process tree in MB) of a command."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _tree_rss_kb(process.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{process.stderr.read().decode()}")
    return seconds, peak / 1024


def plan_seconds(src: np.ndarray, tgt: np.ndarray, planner) -> float:
    start = time.perf_counter()
    planner(src, tgt, 4096, 0, 1, 0, 1.0)
    return time.perf_counter() - start


def reference_planner(src_lens, tgt_lens, max_tokens, max_sentences, seed, epoch, noise):
    """ranmt 0.1's planner (a Python loop over every example), for the ratio."""
    src_lens = np.asarray(src_lens) + 1
    tgt_lens = np.asarray(tgt_lens) + 1
    rng = np.random.default_rng([seed, epoch])
    jitter = rng.uniform(0, noise, len(src_lens))
    order = np.lexsort((src_lens + jitter, tgt_lens + jitter))
    batches, start, longest = [], 0, 0
    for pos in range(len(order)):
        index = order[pos]
        width = max(longest, src_lens[index], tgt_lens[index])
        size = pos - start + 1
        if (width * size > max_tokens or (max_sentences and size > max_sentences)) \
                and pos > start:
            batches.append(order[start:pos])
            start, longest = pos, max(src_lens[index], tgt_lens[index])
        else:
            longest = width
    batches.append(order[start:])
    return [batches[i] for i in rng.permutation(len(batches))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the corpora")
    parser.add_argument("--sizes", type=int, nargs="+", default=[300_000, 1_000_000])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--plan-size", type=int, default=36_000_000)
    parser.add_argument("--reference-size", type=int, default=2_000_000)
    parser.add_argument("--no-train", action="store_true", help="skip the first-step runs")
    parser.add_argument("--plan-only", action="store_true",
                        help="only batch planning, on the already prepared largest size")
    args = parser.parse_args()
    from ranmt.data.corpus import load_split

    multi30k = Path(os.environ.get("RANMT_DATA_DIR", "../shared/data")) / "multi30k"
    args.work.mkdir(parents=True, exist_ok=True)
    valid = args.work / "valid"
    make_corpus(valid, 1000, multi30k, seed=1)
    print(f"{'pairs':>10} {'prepare s':>10} {'pairs/s':>9} {'peak RSS MB':>12} "
          f"{'first step s':>14}")
    for size in [] if args.plan_only else args.sizes:
        prefix = args.work / f"train{size}"
        make_corpus(prefix, size, multi30k)
        out = args.work / f"prepared{size}"
        seconds, peak = run_measured([
            sys.executable, "-m", "ranmt", "prepare", "--src", "en", "--tgt", "de",
            "--train", str(prefix), "--valid", str(valid), "--vocab-size", "8000",
            "--workers", str(args.workers), "--quiet", "--out", str(out)])
        first_step = ""
        if not args.no_train:
            run = args.work / f"run{size}"
            subprocess.run(["rm", "-rf", str(run)], check=True)
            process_seconds, _ = run_measured([
                sys.executable, "-m", "ranmt", "train", "--data", str(out), "--out", str(run),
                "model.preset=small", "train.max_steps=1", "train.validate_bleu=false",
                "train.progress=false", "train.tensorboard=false", "data.max_tokens=4096"])
            summary = json.loads((run / "summary.json").read_text())
            first_step = f"{summary['seconds_to_first_step']:.1f} ({process_seconds:.0f})"
        print(f"{size:>10,} {seconds:>10.1f} {size / seconds:>9,.0f} {peak:>12,.0f} "
              f"{first_step:>14}", flush=True)

    from ranmt.data.batching import make_batches

    src, tgt = load_split(args.work / f"prepared{max(args.sizes)}", "train").lengths()
    rng = np.random.default_rng(0)
    for label, size in (("vectorised", args.plan_size), ("reference", args.reference_size)):
        picks = rng.integers(0, len(src), size)
        src_big, tgt_big = np.asarray(src)[picks], np.asarray(tgt)[picks]
        ours = plan_seconds(src_big, tgt_big, make_batches)
        line = f"batch planning, {size:,} pairs: {ours:.2f} s"
        if label == "reference":
            theirs = plan_seconds(src_big, tgt_big, reference_planner)
            line += f"; ranmt 0.1's loop {theirs:.2f} s ({theirs / ours:.1f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
