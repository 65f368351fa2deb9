"""One int8 checkpoint decoded under PyTorch's two x86 quantized engines, side by side. Not a
test.

``--quantize int8`` prepacks its dynamic int8 layers under PyTorch's default quantized
engine (``x86``, which runs them with fbgemm). The ``onednn`` engine packs the same int8
weights for oneDNN, whose kernels use AVX512-VNNI where the CPU has it and, in
``benchmarks/linear_kernels.py --onednn-int8``, beat fbgemm on some of a student's encoder
shapes. This script loads one run twice with ``quantize="int8"`` — once per engine — and
decodes the same length-sorted batches with each, alternating the order round by round
(round 0 is a warm-up), at a fixed output length so both do the same work. Printed: seconds
per round, the ratio of the best rounds, and the share of identical outputs (the engines
quantize activations differently, so outputs may differ a little).

    python benchmarks/int8_engines.py --run RUN --data DATA --batch 32 --beam 1 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.quantize import quantized_engine
from ranmt.inference.shortlist import RestrictedOutput
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description

ENGINES = ("x86", "onednn")


def load_under(engine: str, run: str, shortlist: bool) -> Translator:
    """The run's int8 translator, its layers prepacked under quantized ``engine``."""
    with quantized_engine(engine):
        return Translator.load(run, device="cpu", quantize="int8", shortlist=shortlist)


def decode_all(translator: Translator, batches: list, beam: int, fixed_length: int) -> list:
    """Best hypothesis per sentence (with the run's shortlist when it was loaded with one)."""
    lists = translator.lexical_shortlist() if translator.decode_config.shortlist else None
    best = []
    for batch in batches:
        src, model, ids = pad_sources(batch), translator.model, None
        if lists is not None:
            vocabulary = lists.vocabulary(src)
            model, ids = RestrictedOutput(model, vocabulary), vocabulary.tolist()
        hyps = search(model, src, beam=beam, lenpen=0.6, max_len_a=0.0,
                      max_len_b=fixed_length, nbest=1, fixed_length=fixed_length)
        best += [h[0][0] if ids is None else [ids[t] for t in h[0][0]] for h in hyps]
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a trained run folder")
    parser.add_argument("--data", required=True, help="its prepared data")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--sentences", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fixed-length", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per engine")
    parser.add_argument("--shortlist", action="store_true", help="decode with the run's list")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    translators = {engine: load_under(engine, args.run, args.shortlist) for engine in ENGINES}
    sources = raw_text(args.data, args.split, "src")[:args.sentences]
    ids = [s for s in translators["x86"].src_vocab.encode(sources) if s]
    lengths = np.array([len(s) for s in ids])
    batches = [[ids[i] for i in rows]
               for rows in make_batches(lengths, lengths, 10 ** 9, args.batch)]
    seconds = {engine: [] for engine in ENGINES}
    outputs = {}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            for engine in (ENGINES if round_ % 2 == 0 else ENGINES[::-1]):
                start = time.perf_counter()
                outputs[engine] = decode_all(translators[engine], batches, args.beam,
                                             args.fixed_length)
                if round_:
                    seconds[engine].append(time.perf_counter() - start)
    print(f"{cpu_description()}; torch {torch.__version__}; {len(ids)} sentences of "
          f"{args.split}, batch {args.batch}, beam {args.beam}, {args.threads} thread(s), "
          f"fixed length {args.fixed_length}, shortlist {args.shortlist}")
    for engine in ENGINES:
        rounds = " ".join(f"{s:.3f}" for s in seconds[engine])
        print(f"{engine:7s} seconds per round: {rounds} (best {min(seconds[engine]):.3f})")
    same = sum(a == b for a, b in zip(outputs["x86"], outputs["onednn"])) / len(ids)
    print(f"x86 (fbgemm) / onednn time, best rounds: "
          f"{min(seconds['x86']) / min(seconds['onednn']):.2f}x; identical outputs "
          f"{100 * same:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
