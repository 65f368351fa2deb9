"""Decoding speed of distilled-student shapes side by side (issue 70): the decoder
self-attentions a student may use (TransF's, RAN-D's learned matrices, AAN, SSRU) in the
``student`` preset (6 encoder / 2 decoder layers, d 256, FFN 1536), with and without the
lexical shortlist, fp32 and int8 (and bf16 with ``--bf16``, on a CPU with native bf16;
int8 through ``decode.compile_step`` too with ``--compile-step``), against the teacher's
shape (``small`` TransF).

Speed only: every system decodes the same source sentences (a prepared split of real
data, so that a shortlist sees real source words) to exactly ``--fixed-length`` tokens
(``search(fixed_length=L)``), so trained or not, every system does identical work; the
models are freshly initialised with the data's vocabulary (untrained weights decode as
fast as trained ones at a fixed length). The shortlist is built from the data's training
split (``--k`` candidates per source token, ``--frequent`` always in).

Two settings: Bergamot's deployed one (greedy, batches of 32 sentences, 1 thread) and
ranmt's usual one (beam 4, batches of 100, 2 threads). Systems run interleaved in rotating
order, ``--repeats`` rounds after a warm-up; the median target tokens/s (EOS included) is
reported with the ratio to the teacher shape.

    python benchmarks/students.py --data DATA --split test_2016_flickr --fixed-length 20 \\
        --json docs/performance/students/speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ranmt.config import load_config
from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import fill_config_from_data, load_split
from ranmt.inference.decode import search
from ranmt.inference.quantize import quantize_model
from ranmt.inference.shortlist import RestrictedOutput, bucketed_vocabulary, build_shortlist
from ranmt.model import build_model
from ranmt.runtime.precision import cpu_bf16_support, cpu_description

DECODERS = {"TransF": "transf", "RAN-D": "ran-d", "AAN": "aan-d", "SSRU": "ssru-d"}
SETTINGS = {"deployed": {"beam": 1, "batch": 32, "threads": 1},
            "usual": {"beam": 4, "batch": 100, "threads": 2}}


def build(data: str, preset: str, arch: str, copy: str):
    """A freshly initialised model; ``copy``: fp32, int8 (dynamic quantization) or bf16
    (weights and activations, as ``Translator.load(precision="bf16")``)."""
    cfg = load_config(None, {"model.preset": preset, "model.arch": arch})
    fill_config_from_data(cfg, data)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    if copy == "bf16":
        return model.to(torch.bfloat16)
    return quantize_model(model, "int8" if copy == "int8" else "none")


def systems(data: str, shortlist, bf16: bool = False, compiled: bool = False) -> dict:
    """name -> (model, shortlist or None, compile_step); with ``compiled`` also every int8
    student through ``decode.compile_step``."""
    copies = ("fp32", "int8", "bf16") if bf16 else ("fp32", "int8")
    out = {"teacher small TransF": (build(data, "small", "transf", "fp32"), None, False)}
    if bf16:
        out["teacher small TransF bf16"] = (build(data, "small", "transf", "bf16"), None,
                                            False)
    for name, arch in DECODERS.items():
        for copy in copies:
            model = build(data, "student", arch, copy)
            suffix = "" if copy == "fp32" else f" {copy}"
            out[f"student {name}{suffix}"] = (model, None, False)
            out[f"student {name}{suffix} + shortlist"] = (model, shortlist, False)
            if compiled and copy == "int8":
                out[f"student {name}{suffix} compiled"] = (model, None, True)
                out[f"student {name}{suffix} + shortlist compiled"] = (model, shortlist, True)
    return out


def decode_all(model, shortlist, batches, beam: int, length: int,
               compiled: bool = False) -> tuple[int, int]:
    """Decode every batch; (target tokens generated incl. EOS, summed shortlist size).
    ``compiled``: ``decode.compile_step``, a shortlist's vocabulary padded to its buckets
    as ``ranmt translate`` pads it (a few graphs instead of one a batch)."""
    tokens = vocabulary_sizes = 0
    for src in batches:
        runner = model
        if shortlist is not None:
            vocabulary, blocked = shortlist.vocabulary(src), None
            vocabulary_sizes += vocabulary.numel()
            if compiled:
                vocabulary, blocked = bucketed_vocabulary(vocabulary,
                                                          shortlist.target_vocab_size)
            runner = RestrictedOutput(model, vocabulary, blocked)
        hyps = search(runner, src, beam=beam, nbest=1, fixed_length=length,
                      compile_step=compiled)
        tokens += sum(len(h[0][0]) + 1 for h in hyps)
    return tokens, vocabulary_sizes


def run(args) -> dict:
    encoded = load_split(args.data, args.split)
    sources = [list(map(int, encoded.src[i])) for i in range(min(len(encoded.src),
                                                                  args.sentences))]
    if args.bf16:
        supported, why = cpu_bf16_support()
        if not supported:
            raise SystemExit(f"--bf16: {why}")
    shortlist = build_shortlist(args.data, args.k, args.frequent)
    models = systems(args.data, shortlist, args.bf16, args.compile_step)
    if args.systems:  # the teacher (the ratios' base) and the systems named
        models = {name: value for name, value in models.items() if name.startswith("teacher")
                  or any(part in name for part in args.systems)}
    report: dict = {"machine": cpu_description(),
                    "torch": torch.__version__, "fixed_length": args.fixed_length,
                    "sentences": len(sources), "shortlist": {"k": args.k,
                                                             "frequent": args.frequent},
                    "settings": {}}
    for setting in args.settings:
        options = SETTINGS[setting]
        torch.set_num_threads(options["threads"])
        lengths = torch.tensor([len(s) for s in sources]).numpy()
        batches = [pad_sources([sources[i] for i in batch])
                   for batch in make_batches(lengths, lengths, 10**9, options["batch"])]
        names = list(models)
        speeds: dict[str, list[float]] = {name: [] for name in names}
        vocabulary: dict[str, float] = {}
        with torch.inference_mode():
            for round_ in range(args.repeats + 1):
                order = names[round_ % len(names):] + names[: round_ % len(names)]
                for name in order:
                    model, shortlist_, compiled = models[name]
                    started = time.perf_counter()
                    tokens, sizes = decode_all(model, shortlist_, batches, options["beam"],
                                               args.fixed_length, compiled)
                    seconds = time.perf_counter() - started
                    if round_ > 0:  # the first round warms up
                        speeds[name].append(tokens / seconds)
                    if sizes:
                        vocabulary[name] = sizes / len(batches)
        medians = {name: statistics.median(values) for name, values in speeds.items()}
        teacher = medians["teacher small TransF"]
        report["settings"][setting] = {
            **options, "tokens_per_s": {n: round(v, 1) for n, v in medians.items()},
            "ratio_to_teacher": {n: round(v / teacher, 3) for n, v in medians.items()},
            "mean_shortlist_size": {n: round(v, 1) for n, v in vocabulary.items()}}
        print(f"\n{setting}: beam {options['beam']}, batch {options['batch']}, "
              f"{options['threads']} thread(s), fixed length {args.fixed_length}")
        for name in names:
            print(f"  {name:<40} {medians[name]:>9,.0f} tok/s  {medians[name] / teacher:5.2f}x")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="prepared data (vocabulary, shortlist)")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--fixed-length", type=int, default=20)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--frequent", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true",
                        help="also bf16 copies of every system (a CPU with native bf16)")
    parser.add_argument("--compile-step", action="store_true",
                        help="also every int8 student with decode.compile_step (the warm-up "
                             "round compiles each batch shape: minutes)")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS),
                        help="which settings to measure")
    parser.add_argument("--systems", nargs="+",
                        help="only the systems whose names hold one of these (and the teacher)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
