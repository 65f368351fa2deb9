"""Host syncs per step of each search mode, and their speeds side by side.

On a GPU every host read of a device value (``bool(tensor)``, ``.item()``, ``nonzero()``,
boolean-mask indexing, ...) makes the host wait for the device: each one stalls the GPU.
This script counts them with :class:`ranmt.runtime.host_syncs.SyncCounter` for

* ``reference``: the reference searches (the tests' oracle);
* ``shrinking``: the fast searches, finished sentences leave the batch (the CPU default);
* ``sync-free/K``: every row kept to the end, masks instead of a shrinking batch, whether
  everyone is done read every K steps (the GPU default, ``check_every=8``);
* ``graphs/K`` (with ``--graphs``): the same search with its whole step at fixed
  addresses, recorded once as a CUDA graph and replayed (on a CPU the same step eagerly).

Syncs per step are the difference between a search of ``--fixed-length`` L and of 2L
tokens, divided by L (what a search does once, before and after its steps, cancels out);
the once-per-search count is printed beside. Then the modes decode the same batches side by
side (interleaved, rotating order, ``--repeats`` rounds after a warm-up): fixed length and
the models' own outputs (``--real``: untrained models write until the length limit, so
that is the real-output case only for checkpoints given with ``--checkpoint``). Speeds are
tokens/s and ratios to ``shrinking``. On a GPU:

    python benchmarks/decode_syncs.py --device cuda --preset base --batch 32 100 --beam 4 \
        --graphs

On the CPU (counts are device-independent; speeds are the CPU's):

    python benchmarks/decode_syncs.py --preset small --batch 100 --beam 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ranmt.benchmark import load_systems, synchronize
from ranmt.data.batching import pad_sources
from ranmt.inference.decode import search
from ranmt.runtime.host_syncs import SyncCounter


def modes(check_every: list[int], graphs: bool = False) -> dict[str, dict]:
    """Mode name -> keyword arguments of :func:`ranmt.inference.decode.search`."""
    table = {"reference": {"reference": True}, "shrinking": {"sync_free": False}}
    for k in check_every:
        table[f"sync-free/{k}"] = {"sync_free": True, "check_every": k}
    if graphs:
        for k in check_every:
            table[f"graphs/{k}"] = {"cuda_graphs": True, "check_every": k}
    return table


def syncs_per_step(model, src, beam: int, length: int, options: dict) -> tuple[float, int]:
    """(syncs per step, syncs once per search) of ``search`` with ``options``."""
    counts = []
    for fixed in (length, 2 * length):
        with SyncCounter() as counter:
            search(model, src, beam=beam, fixed_length=fixed, **options)
        counts.append(counter.total)
    per_step = (counts[1] - counts[0]) / length
    return per_step, round(counts[0] - per_step * (length + 1))


def speeds(model, batches, beam: int, fixed_length: int | None, table: dict, repeats: int,
           device: torch.device) -> dict[str, tuple[float, list[float]]]:
    """Mode -> (median tokens/s, per-round seconds), tokens = best hypotheses + EOS."""
    seconds: dict[str, list[float]] = {name: [] for name in table}
    tokens: dict[str, int] = {}
    names = list(table)
    for repeat in range(repeats + 1):
        for shift in range(len(names)):
            name = names[(repeat + shift) % len(names)]
            synchronize(device)
            start = time.perf_counter()
            produced = 0
            for src in batches:
                results = search(model, src, beam=beam, fixed_length=fixed_length, **table[name])
                produced += sum(len(hyps[0][0]) + 1 for hyps in results)
            synchronize(device)
            if repeat:
                seconds[name].append(time.perf_counter() - start)
                tokens[name] = produced
    return {name: (tokens[name] / statistics.median(seconds[name]), seconds[name])
            for name in names}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all"])
    p.add_argument("--checkpoint", nargs="*", default=[], help="trained runs to decode with")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "bf16"],
                   help="copies of each model to run (bf16: weights and activations)")
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--batch", type=int, nargs="+", default=[100])
    p.add_argument("--beam", type=int, nargs="+", default=[1, 4])
    p.add_argument("--fixed-length", type=int, default=30)
    p.add_argument("--check-every", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-reference-speed", action="store_true",
                   help="count the reference's syncs but do not time it (it is slow)")
    p.add_argument("--fixed-only", action="store_true",
                   help="time fixed-length decoding only (an untrained model's own outputs "
                        "run to the length limit: the same work, longer)")
    p.add_argument("--graphs", action="store_true",
                   help="add graphs/K: the sync-free search with its whole step at fixed "
                        "addresses, replayed as a CUDA graph on CUDA (eager elsewhere)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    sources = [rng.integers(4, args.vocab_size, rng.integers(6, 25)).tolist()
               for _ in range(args.sentences)]
    table = modes(args.check_every, args.graphs)
    print(f"{args.preset}, device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.sentences} sentences")
    systems = load_systems(args.checkpoint, [] if args.checkpoint else args.arch,
                           args.preset, args.vocab_size, device, tuple(args.quantize))
    for label, _, model, _ in systems:
        sync_lines = []
        for beam in args.beam:
            src = pad_sources(sources[:8]).to(device)
            for name, options in table.items():
                per_step, once = syncs_per_step(model, src, beam, args.fixed_length, options)
                sync_lines.append(f"{label:>10} beam {beam}: {name:<14} {per_step:5.3f} syncs "
                                  f"per step, {once} per search")
            timed = {name: options for name, options in table.items()
                     if not (args.no_reference_speed and name == "reference")}
            for batch in args.batch:
                batches = [pad_sources(sources[i: i + batch]).to(device)
                           for i in range(0, len(sources), batch)]
                cases = [(args.fixed_length, f"fixed length {args.fixed_length}")]
                if not args.fixed_only:
                    cases.append((None, "own outputs"))
                for fixed, what in cases:
                    result = speeds(model, batches, beam, fixed, timed, args.repeats, device)
                    base_speed, base_seconds = result["shrinking"]
                    cells = []
                    for name, (speed, rounds) in result.items():
                        ratios = [b / s for b, s in zip(base_seconds, rounds)]
                        cells.append(f"{name} {speed:,.0f} tok/s ({speed / base_speed:.2f}x;"
                                     f" {min(ratios):.2f}-{max(ratios):.2f})")
                    print(f"{label:>10} beam {beam} batch {batch}, {what}: " + ", ".join(cells))
        print("\n".join(sync_lines))  # the syncs last


if __name__ == "__main__":
    main()
