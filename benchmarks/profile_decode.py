"""Where beam-search decoding spends its time: torch.profiler over TransF and RAN-ALL.

Decodes the same sentences (batch ``--batch``, beam ``--beam``) with each checkpoint under
``torch.profiler`` (CPU) and prints, per system, the operators by self CPU time and the
share of the step spent in the output projection, the attention sublayers and the rest,
with the multiply-accumulate count per generated token of each part (from the shapes), so
that the ceiling on what RAN's cheaper self-attention can buy is visible next to the
measurement.

    python benchmarks/profile_decode.py --checkpoint RUN_TRANSF --checkpoint RUN_RAN_ALL \\
        --data DATA --split test_2016_flickr --sentences 200

``--precision bf16`` / ``int8`` profile the bf16 or int8-quantized decoder (a checkpoint may
be given once per precision with ``--precision`` listing several: every checkpoint is
profiled in each); ``--fixed-length 30`` makes every hypothesis 30 tokens long, as in the
speed comparisons against CTranslate2; ``--shortlist`` restricts the output layer to each
batch's lexical shortlist (the checkpoint's ``shortlist.safetensors``), as ``ranmt translate
--shortlist`` does; ``--threads`` sets PyTorch's intra-op threads (Bergamot's deployed
setting: ``--beam 1 --batch 32 --threads 1``); ``--encoder-only`` profiles the encoder
alone over the same batches (its operators and milliseconds per batch).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ranmt.data.batching import make_batches, pad_sources
from ranmt.data.corpus import load_split
from ranmt.inference.decode import search
from ranmt.inference.shortlist import RestrictedOutput
from ranmt.inference.translator import Translator


def decoder_macs_per_token(config) -> dict[str, int]:
    """Multiply-accumulates per generated token and beam row (history/source length
    terms left out: at Multi30k lengths they are < 2% of the total)."""
    m = config.model
    d, f, layers, vocab = m.d_model, m.ffn_dim, m.decoder.layers, m.tgt_vocab_size
    self_proj = (4 if m.decoder.self_attention == "dot" else 2) * d * d  # RAN: W_v, W_o only
    cross_proj = 2 * d * d  # W_q, W_o (the source keys/values are computed once)
    return {"self-attention projections": layers * self_proj,
            "cross-attention projections": layers * cross_proj,
            "feed-forward": layers * 2 * d * f, "output projection": d * vocab}


PARTS = ("encoder", "decoder self-attention", "cross-attention", "feed-forward",
         "output projection", "cache reorder")


def label_parts(model: torch.nn.Module) -> None:
    """Named profiler ranges (``PARTS``) around the encoder and the decoder's sublayers."""

    def hook(module: torch.nn.Module, label: str) -> None:
        ranges = []

        def enter(*_):
            ranges.append(record_function(label))
            ranges[-1].__enter__()

        def leave(*_):
            ranges.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    def wrap(owner, attribute: str, label: str) -> None:
        function = getattr(owner, attribute)

        def wrapped(*args, **kwargs):
            with record_function(label):
                return function(*args, **kwargs)

        setattr(owner, attribute, wrapped)

    hook(model.encoder, "encoder")
    for layer in model.decoder.layers:
        for module, label in ((layer.self_attention, "decoder self-attention"),
                              (layer.cross_attention, "cross-attention"),
                              (layer.ffn, "feed-forward")):
            if module is not None:
                hook(module, label)
    wrap(model.decoder, "project", "output projection")
    wrap(model, "reorder_cache", "cache reorder")


def profile_encoder(model: torch.nn.Module, batches: list, name: str, top: int) -> None:
    """The encoder alone over ``batches`` (padded (B, S) sources): ms per batch (best of a
    timed pass after a warm-up) and its operators by self CPU time under the profiler."""
    with torch.inference_mode():
        for src in batches:  # warm-up
            model.encode(src)
        start = time.perf_counter()
        for src in batches:
            model.encode(src)
        seconds = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for src in batches:
                model.encode(src)
    print(f"\n== encoder of {name}: {1000 * seconds / len(batches):.1f} ms per batch "
          f"({len(batches)} batches, unprofiled)")
    print_top_operators(prof.key_averages(), top, width=50)


def print_top_operators(events, top: int, width: int = 40) -> None:
    """The ``top`` operators of a profile by self CPU time: share and calls."""
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'operator':<{width}} {'self CPU %':>10} {'calls':>8}")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{event.key:<{width}} {100 * event.self_cpu_time_total / total:>9.1f}% "
              f"{event.count:>8}")


def sorted_batches(data: str, split: str, sentences: int, batch: int) -> list[torch.Tensor]:
    """The first ``sentences`` encoded sources of a prepared ``split``, as padded (B, S)
    batches of at most ``batch`` sentences of similar length (as ``ranmt translate``
    batches them)."""
    encoded = load_split(data, split)
    sources = [list(map(int, s)) for s in encoded.src[:sentences]]
    lengths = np.array([len(s) for s in sources])
    return [pad_sources([sources[i] for i in rows])
            for rows in make_batches(lengths, lengths, 10 ** 9, batch)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--reference", action="store_true",
                        help="profile the reference searches with PyTorch's default matrix "
                             "products (the decoder before the fast path), for before/after")
    parser.add_argument("--precision", nargs="+", default=["fp32"],
                        choices=["fp32", "bf16", "int8"],
                        help="decoder precision(s) to profile, each checkpoint in each")
    parser.add_argument("--fixed-length", type=int, default=None,
                        help="every hypothesis exactly this many tokens (EOS forced there)")
    parser.add_argument("--shortlist", action="store_true",
                        help="restrict the output layer to each batch's lexical shortlist")
    parser.add_argument("--threads", type=int, default=None,
                        help="PyTorch intra-op threads (default: PyTorch's)")
    parser.add_argument("--encoder-only", action="store_true",
                        help="profile the encoder alone over the same batches")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reference:
        from ranmt.runtime import packed

        packed.set_enabled(False)
    batches = sorted_batches(args.data, args.split, args.sentences, args.batch)
    totals = {}
    systems = [(checkpoint, precision) for precision in args.precision
               for checkpoint in args.checkpoint]
    for checkpoint, precision in systems:
        translator = Translator.load(checkpoint, device="cpu",
                                     quantize="int8" if precision == "int8" else "none",
                                     precision="bf16" if precision == "bf16" else "fp32")
        model, cfg = translator.model.eval(), translator.config
        name = f"{cfg.model.arch} {precision}:{checkpoint}"
        if args.encoder_only:
            profile_encoder(model, batches, name, args.top)
            continue
        label_parts(model)

        def decode(src, model=model, translator=translator):
            if args.shortlist:
                model = RestrictedOutput(model, translator.lexical_shortlist().vocabulary(src))
            return search(model, src, beam=args.beam, lenpen=0.6, lenpen_style="gnmt",
                          max_len_a=1.2, max_len_b=10, nbest=1,
                          fixed_length=args.fixed_length, reference=args.reference)

        with torch.inference_mode():
            for src in batches:  # warm-up (RAN's inference matrices, allocator)
                decode(src)
            tokens = 0  # generated target tokens incl. EOS (the systems' lengths differ)
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for src in batches:
                    with record_function("beam_search"):
                        hyps = decode(src)
                    tokens += sum(len(h[0][0]) + 1 for h in hyps)
            seconds = time.perf_counter() - start
        events = prof.key_averages()
        print(f"\n== {name}: {seconds:.2f} s under the profiler, {tokens:,} target tokens, "
              f"{1000 * seconds / tokens:.2f} ms per token")
        print_top_operators(events, args.top)
        macs = decoder_macs_per_token(cfg)
        totals[name] = (seconds / tokens, sum(macs.values()))
        inclusive = {e.key: e.cpu_time_total for e in events}
        search_total = inclusive["beam_search"]
        print("share of the search (inclusive CPU time; the rest is embedding, layer norms, "
              "log-softmax, top-k and bookkeeping):")
        for part in PARTS:
            print(f"  {part:<30} {100 * inclusive.get(part, 0) / search_total:>5.1f}%")
        print("decoder MACs per generated token and beam row:")
        for part, count in macs.items():
            print(f"  {part:<30} {count:>10,} ({100 * count / sum(macs.values()):.0f}%)")
    if len(totals) > 1:
        (first, (s0, m0)), *rest = totals.items()
        for name, (s, m) in rest:
            print(f"\n{name} vs {first}: time-per-token ratio {s0 / s:.2f}x, MAC ratio "
                  f"{m0 / m:.2f}x (the speed-up that fewer multiply-accumulates alone would "
                  "give)")


if __name__ == "__main__":
    main()
