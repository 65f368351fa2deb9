"""One int8 checkpoint decoded under PyTorch's two x86 quantized engines (and without the
fused feed-forward ReLU), side by side. Not a test.

``--quantize int8`` prepacks its dynamic int8 layers under PyTorch's default quantized
engine (``x86``, which runs them with fbgemm). The ``onednn`` engine packs the same int8
weights for oneDNN, whose kernels use AVX512-VNNI where the CPU has it and, in
``benchmarks/linear_kernels.py --onednn-int8``, beat fbgemm on some of a student's encoder
shapes. This script loads one run twice with ``quantize="int8"`` — once per engine — and
decodes the same length-sorted batches with each, alternating the order round by round
(round 0 is a warm-up), at a fixed output length so both do the same work. Printed: seconds
per round, the ratio of the best rounds, and the share of identical outputs (the engines
quantize activations differently, so outputs may differ a little).

``--systems x86 x86-unfused`` compares instead ranmt's int8 model with the same model
quantized without fusing the feed-forward's first layer and ReLU into one fbgemm kernel
(``ranmt.inference.quantize.fuse_relu_feed_forwards``): the same outputs, so the ratio is
what the fusion saves.

    python benchmarks/int8_engines.py --run RUN --data DATA --batch 32 --beam 1 --threads 1
    python benchmarks/int8_engines.py --run RUN --data DATA --systems x86 x86-unfused
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from unittest import mock

import numpy as np
import torch

from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference import quantize
from ranmt.inference.decode import search
from ranmt.inference.quantize import quantized_engine
from ranmt.inference.shortlist import RestrictedOutput
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description

SYSTEMS = {"x86": ("x86", True), "onednn": ("onednn", True), "x86-unfused": ("x86", False)}
"""name -> (quantized engine, feed-forward ReLU fused into the first layer's kernel)."""


def load_under(system: str, run: str, shortlist: bool) -> Translator:
    """The run's int8 translator, its layers prepacked under the system's quantized engine
    (and with its feed-forward ReLUs unfused for ``x86-unfused``)."""
    engine, fused = SYSTEMS[system]
    unfused = mock.patch.object(quantize, "fuse_relu_feed_forwards", lambda model: 0)
    with quantized_engine(engine), (nullcontext() if fused else unfused):
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
    parser.add_argument("--systems", nargs=2, choices=list(SYSTEMS), default=["x86", "onednn"],
                        help="the two int8 systems to compare (default: the two engines)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    systems = tuple(args.systems)
    translators = {name: load_under(name, args.run, args.shortlist) for name in systems}
    sources = raw_text(args.data, args.split, "src")[:args.sentences]
    ids = [s for s in translators[systems[0]].src_vocab.encode(sources) if s]
    lengths = np.array([len(s) for s in ids])
    batches = [[ids[i] for i in rows]
               for rows in make_batches(lengths, lengths, 10 ** 9, args.batch)]
    seconds = {name: [] for name in systems}
    outputs = {}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            for name in (systems if round_ % 2 == 0 else systems[::-1]):
                start = time.perf_counter()
                outputs[name] = decode_all(translators[name], batches, args.beam,
                                           args.fixed_length)
                if round_:
                    seconds[name].append(time.perf_counter() - start)
    print(f"{cpu_description()}; torch {torch.__version__}; {len(ids)} sentences of "
          f"{args.split}, batch {args.batch}, beam {args.beam}, {args.threads} thread(s), "
          f"fixed length {args.fixed_length}, shortlist {args.shortlist}")
    for name in systems:
        rounds = " ".join(f"{s:.3f}" for s in seconds[name])
        print(f"{name:11s} seconds per round: {rounds} (best {min(seconds[name]):.3f})")
    first, second = systems
    same = sum(a == b for a, b in zip(outputs[first], outputs[second])) / len(ids)
    print(f"{first} / {second} time, best rounds: "
          f"{min(seconds[first]) / min(seconds[second]):.2f}x; identical outputs "
          f"{100 * same:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
