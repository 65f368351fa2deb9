"""A whole search step compiled with ``torch.compile`` on a CPU against the eager searches,
side by side, on trained checkpoints
(``--run``) or on the ``student`` preset with random weights (``--random-student``).

Issue 70's last open speed goal (ranmt's fastest student >= 1.2x CTranslate2 int8 + vmap
at greedy, batch 32, one thread) is held back on the Zen 5 by what lies *between* a step's
int8 products: layer norms, softmaxes, small attention products, the search's bookkeeping
and Python's dispatch of a few hundred operators per step (docs/PERFORMANCE.md, "Where the
deployed setting's time goes now"). A compiled step should remove that dispatch. This
script measures how much it does, for trained checkpoints:

* ``eager shrinking``: the CPU default (``search``: finished sentences leave the batch);
* ``eager static``: the sync-free search with the static decoder of
  ``ranmt.inference.graphs`` (every row kept, fixed shapes; what CUDA graphs replay);
* ``compiled static``: the same sync-free step, the whole of it (decoder, arg-max or beam
  selection, reorder), through ``torch.compile(fullgraph=True)`` with inductor.

The compiled system is ranmt's ``decode.compile_step`` (``ranmt.inference.graphs.
CompiledStep``); its int8 layers trace as ``torch._int_mm`` with per-row activation scales
(``ranmt.inference.quantize``) where the eager systems run fbgemm's kernel with one scale
per activation tensor. The lexical shortlist is not covered here (``benchmarks/peers.py
--compile-step --shortlist`` measures it). The compiled search also compiles the encoder,
grows its span and, greedy, moves its rows into smaller buckets as sentences end
(``CompiledStep``'s docstring).

Printed: the one-off compile time, target tokens/s of each system (best of ``--rounds``
after a warm-up, systems alternating), the ratio to eager shrinking, and how many best
hypotheses equal eager shrinking's (eager int8 quantizes each activation tensor with one
scale, so a static search's extra rows flip near-ties, and the compiled int8 step scales
each row; ``--precision fp32`` isolates the compiler's share).

    python benchmarks/compiled_step.py --run RUN [RUN ...] --data DATA --batch 32 --beam 1 \\
        --threads 1 --fixed-length 20 [--precision int8|fp32|bf16] [--json OUT]
    python benchmarks/compiled_step.py --random-student --sentences 320 [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch._dynamo

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description

SYSTEMS = {"eager shrinking": {"sync_free": False},
           "eager static": {"sync_free": True},
           "compiled static": {"compile_step": True}}


def _decode(model, batches, args, system: str) -> tuple[list, float]:
    """(best hypothesis per sentence, seconds) of ``system`` over ``batches``."""
    options = {"beam": args.beam, "fixed_length": args.fixed_length or None,
               **SYSTEMS[system]}
    start = time.perf_counter()
    hyps = [h[0] for src in batches for h in search(model, src, **options)]
    return hyps, time.perf_counter() - start


def _trained(run: str, args) -> tuple[torch.nn.Module, list, str]:
    """A trained checkpoint at ``args.precision`` and its length-sorted source batches."""
    quantize = "int8" if args.precision == "int8" else "none"
    precision = "bf16" if args.precision == "bf16" else "fp32"
    translator = Translator.load(run, device="cpu", quantize=quantize, precision=precision)
    lines = raw_text(args.data, args.split, "src")[: args.sentences]
    ids = sorted(translator.src_vocab.encode(lines), key=len)
    batches = [pad_sources(ids[i: i + args.batch]) for i in range(0, len(ids), args.batch)]
    return translator.model, batches, translator.config.model.arch


def _random_student(args) -> tuple[torch.nn.Module, list, str]:
    """The ``student`` preset (TransF, 8k vocabularies) with random weights, and
    ``args.sentences`` random sources of 16 tokens in batches: no checkpoint or data."""
    from ranmt.config import load_config
    from ranmt.inference.quantize import quantize_model
    from ranmt.model import EOS_ID
    from ranmt.model.seq2seq import build_model

    torch.manual_seed(0)
    cfg = load_config("configs/multi30k_small.yaml", [
        "model.preset=student", "model.arch=transf", "model.src_vocab_size=8000",
        "model.tgt_vocab_size=8000"])
    model = build_model(cfg.model).eval()
    if args.precision == "int8":
        model = quantize_model(model, "int8")
    batches = []
    for start in range(0, args.sentences, args.batch):
        src = torch.randint(4, 8000, (min(args.batch, args.sentences - start), 16))
        src[:, -1] = EOS_ID
        batches.append(src)
    return model, batches, "transf (random student)"


def measure(run: str | None, args) -> dict:
    """One checkpoint's systems (``run`` None: the random student), side by side (see the
    module docstring)."""
    model, batches, arch = _trained(run, args) if run else _random_student(args)
    for system in SYSTEMS:  # warm-up of the eager systems, first: an eager pass can leave
        if not system.startswith("compiled"):  # state (RAN's cached matrices) a graph guards
            _decode(model, batches, args, system)
    start = time.perf_counter()
    _decode(model, batches, args, "compiled static")
    compile_seconds = time.perf_counter() - start
    best, outputs = dict.fromkeys(SYSTEMS, float("inf")), {}
    for round_index in range(args.rounds):
        order = list(SYSTEMS) if round_index % 2 == 0 else list(reversed(SYSTEMS))
        for system in order:
            outputs[system], seconds = _decode(model, batches, args, system)
            best[system] = min(best[system], seconds)
    reference = outputs["eager shrinking"]
    tokens = sum(len(tokens) + 1 for tokens, _ in reference)
    result = {"run": run, "arch": arch,
              "compile_and_first_pass_s": round(compile_seconds, 1), "tokens": tokens,
              "systems": {}}
    for system in SYSTEMS:
        same = sum(a[0] == b[0] for a, b in zip(reference, outputs[system]))
        result["systems"][system] = {
            "tokens_per_s": round(tokens / best[system], 1),
            "vs_eager_shrinking": round(best["eager shrinking"] / best[system], 3),
            "identical_to_eager_shrinking": f"{same}/{len(reference)}"}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs="+", help="trained runs or checkpoints")
    p.add_argument("--data", help="prepared data directory (with --run)")
    p.add_argument("--random-student", action="store_true",
                   help="the student preset with random weights and random 16-token "
                        "sources instead of trained runs (no data needed)")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=320)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--fixed-length", type=int, default=20,
                   help="every hypothesis exactly this long (equal work for every system); "
                        "0: the outputs the model writes (limit a*|src|+b, 1.2 and 10)")
    p.add_argument("--precision", choices=("int8", "fp32", "bf16"), default="int8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if bool(args.run) == args.random_student or (args.run and not args.data):
        p.error("give --run RUN ... --data DATA, or --random-student")
    if args.random_student and args.precision == "bf16":
        p.error("--random-student measures int8 or fp32 (bf16: a trained --run)")
    torch.set_num_threads(args.threads)
    header = {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
              "batch": args.batch, "beam": args.beam, "fixed_length": args.fixed_length,
              "precision": args.precision, "sentences": args.sentences, "rounds": args.rounds}
    print(json.dumps(header))
    results = []
    for run in args.run or [None]:
        result = measure(run, args)
        results.append(result)
        print(f"{result['arch']} {args.precision}: compile + first pass "
              f"{result['compile_and_first_pass_s']} s")
        for system, row in result["systems"].items():
            print(f"  {system:16s} {row['tokens_per_s']:>9,.0f} tok/s  "
                  f"{row['vs_eager_shrinking']:.2f}x eager shrinking  identical "
                  f"{row['identical_to_eager_shrinking']}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({**header, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
