"""The fast decoder against the reference one, side by side in one process.

Three configurations decode the same random source sentences with the same freshly
initialised model of ``--preset`` (per ``--arch``):

* ``reference``: the reference searches (growing caches, per-sentence Python bookkeeping)
  with PyTorch's default CPU matrix products (``F.linear``: MKL);
* ``reference+oneDNN``: the same searches, linear layers through oneDNN with prepacked
  weights (``ranmt.runtime.packed``);
* ``fast``: the fast searches (static caches, fused projections, tensorised bookkeeping)
  with oneDNN, what ``ranmt translate`` runs.

Fixed-length mode (every hypothesis exactly ``--fixed-length`` tokens) makes the work
identical whatever the weights. The configurations run interleaved, in a rotating order,
``--repeats`` times after a warm-up; the median tokens/s of each and the ratio to
``reference`` are printed (with the range of the per-round ratios).

    python benchmarks/fast_vs_reference.py --arch transf ran-all --batch 100 --beam 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ranmt.benchmark import load_systems
from ranmt.data.batching import pad_sources
from ranmt.inference.decode import search
from ranmt.runtime import packed

CONFIGURATIONS = {"reference": (True, False), "reference+oneDNN": (True, True),
                  "fast": (False, True)}  # name -> (reference search, oneDNN)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all"])
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--fixed-length", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    sources = [rng.integers(4, args.vocab_size, rng.integers(6, 25)).tolist()
               for _ in range(args.sentences)]
    batches = [pad_sources(sources[i: i + args.batch])
               for i in range(0, len(sources), args.batch)]
    tokens = args.sentences * (args.fixed_length + 1)  # best hypotheses incl. EOS
    print(f"{args.preset}, batch {args.batch}, beam {args.beam}, fixed length "
          f"{args.fixed_length}, {args.sentences} sentences, {args.threads} threads, "
          f"torch {torch.__version__}, oneDNN available: {packed.available()}")
    names = list(CONFIGURATIONS)
    for arch in args.arch:
        (_, _, model, _), = load_systems([], [arch], args.preset, args.vocab_size,
                                         torch.device("cpu"))
        seconds: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(args.repeats + 1):
            for shift in range(len(names)):
                name = names[(repeat + shift) % len(names)]
                reference, onednn = CONFIGURATIONS[name]
                previous = packed.set_enabled(onednn)
                start = time.perf_counter()
                for src in batches:
                    search(model, src, beam=args.beam, fixed_length=args.fixed_length,
                           reference=reference)
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
                packed.set_enabled(previous)
        base = seconds["reference"]
        cells = []
        for name in names:
            ratios = [b / s for b, s in zip(base, seconds[name])]
            median = statistics.median(seconds[name])
            cells.append(f"{name} {tokens / median:,.0f} tok/s "
                         f"({statistics.median(base) / median:.2f}x; "
                         f"{min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{arch:>8}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
