"""``torch.compile`` of the decoder step against the eager fast decoder, in one process.

Issue 19 asked whether compiling ``Seq2Seq.decode_step`` (dynamic shapes: the cache grows
every step and finished sentences leave the batch) speeds decoding up. This script answers
it for trained checkpoints or freshly initialised models of ``--arch``:

* ``eager``: the fast decoder as ``ranmt translate`` runs it (oneDNN prepacked linears);
* ``compiled``: the same search with ``model.decode_step`` replaced by
  ``torch.compile(decode_step, dynamic=True)``; with the inductor backend, ``freezing`` lets
  the compiler treat the weights as constants (its own oneDNN packing, folded
  concatenations of the fused projections). The beam bookkeeping stays eager. Input-
  agnostic matrices (RAN's A_l, Syn-R's) enter the compiled step as constants from the
  eager pass before it: computed inside the compiled step by inductor (torch 2.13, CPU),
  RAN-ALL's outputs differed from eager ones (265 of 300 identical; ``aot_eager``: all).

It prints the one-off compile time (the first compiled pass, recompilations included),
the tokens/s of both (best of ``--repeats`` passes after it) and their ratio, and whether
the compiled step gives the eager outputs: identical best hypotheses out of all, and the
largest score difference. ``--backend aot_eager`` traces without inductor's code generation
(to tell a tracing problem from a code-generation one).

    python benchmarks/compile_decode.py --checkpoint RUN_T RUN_R --data DATA \\
        --split test_2016_flickr --sentences 300
    python benchmarks/compile_decode.py --arch transf ran-all --fixed-length 30
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ranmt.benchmark import load_systems
from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search


def _sources(args, translator) -> list[list[int]]:
    """Token ids of the sentences to decode, sorted by length (as ``translate`` batches)."""
    if args.data:
        if translator is None:
            raise SystemExit("--data needs --checkpoint (its SentencePiece model)")
        lines = raw_text(args.data, args.split, "src")[: args.sentences]
        return sorted(translator.src_vocab.encode(lines), key=len)
    rng = np.random.default_rng(0)
    return sorted((rng.integers(4, args.vocab_size, rng.integers(6, 25)).tolist()
                   for _ in range(args.sentences)), key=len)


def _decode(model, batches, args) -> tuple[list, float, int]:
    """(best hypothesis per sentence, seconds, generated tokens incl. EOS)."""
    start = time.perf_counter()
    hyps = [h[0] for src in batches
            for h in search(model, src, beam=args.beam, fixed_length=args.fixed_length)]
    return hyps, time.perf_counter() - start, sum(len(tokens) + 1 for tokens, _ in hyps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", nargs="*", default=[], help="trained runs/checkpoints")
    p.add_argument("--arch", nargs="*", default=[], help="freshly initialised models")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--data", help="prepared data directory: decode its --split (real outputs)")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--fixed-length", type=int, help="every hypothesis exactly this long")
    p.add_argument("--backend", default="inductor", help="inductor | aot_eager")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.preset}, batch {args.batch}, beam {args.beam}, "
          f"{'fixed length ' + str(args.fixed_length) if args.fixed_length else 'real outputs'}, "
          f"{args.threads} threads, torch {torch.__version__}, backend {args.backend}")
    systems = load_systems(args.checkpoint, args.arch, args.preset, args.vocab_size,
                           torch.device("cpu"))
    for label, translator, model, _ in systems:
        ids = _sources(args, translator)
        batches = [pad_sources(ids[i: i + args.batch]) for i in range(0, len(ids), args.batch)]
        _decode(model, batches, args)  # warm-up (oneDNN packing, allocator)
        eager = [_decode(model, batches, args) for _ in range(args.repeats)]
        eager_step = model.decode_step
        options = {"freezing": True} if args.backend == "inductor" else None
        model.decode_step = torch.compile(eager_step, dynamic=True, backend=args.backend,
                                          options=options)
        try:
            first = _decode(model, batches, args)
            compiled = [_decode(model, batches, args) for _ in range(args.repeats)]
        finally:
            model.decode_step = eager_step
        reference = eager[0][0]
        same = sum(a[0] == b[0] for a, b in zip(reference, compiled[0][0]))
        diff = max(abs(a[1] - b[1]) for a, b in zip(reference, compiled[0][0]))
        eager_tps = max(tokens / seconds for _, seconds, tokens in eager)
        compiled_tps = max(tokens / seconds for _, seconds, tokens in compiled)
        print(f"{label}: compile {first[1]:.1f} s; eager {eager_tps:,.0f} tok/s, compiled "
              f"{compiled_tps:,.0f} tok/s ({compiled_tps / eager_tps:.2f}x); identical "
              f"{same}/{len(reference)}, largest score difference {diff:.2g}")


if __name__ == "__main__":
    main()
