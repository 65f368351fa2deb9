"""Where a fast beam-search step spends its time, measured with wall-clock timers.

``torch.profiler`` inflates memory-bound CPU ops in decoding (it attributed ~11 ms a call to
a cast that takes 0.16 ms outside it), so this script wraps the decoder's parts in
``time.perf_counter`` timers instead: the encoder, each decoder sublayer kind (self-attention,
cross-attention, feed-forward, summed over layers), the output projection, the fp32
log-softmax, the per-row top-k, the per-step constraints and the cache reorders. It decodes
a random ``small`` model (weights do not matter at a fixed output length: every system does
the same work), ``--sentences`` sources of ``--source-length`` tokens in one batch, beam 4,
fixed output length 30, after two warm-up searches:

    python benchmarks/decode_parts.py --precision bf16 --arch transf
    python benchmarks/decode_parts.py --precision fp32 bf16 --arch transf ran-all

Parts nest (the sublayers and the output projection run inside ``decode_step``), so the
shares do not add up to 100%; the timers cost a few microseconds per call. Run it on a
quiet CPU.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import ranmt.inference.decode as decode
import ranmt.inference.selection as selection
from ranmt.config import load_config
from ranmt.model import EOS_ID, build_model
from ranmt.runtime.memory import retain_freed_memory


def _timed(owner, attribute: str, label: str, totals: collections.Counter) -> None:
    """Replace ``owner.attribute`` (a function) by one that adds its wall time to
    ``totals[label]``."""
    function = getattr(owner, attribute)

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        totals[label] += time.perf_counter() - start
        return result

    setattr(owner, attribute, wrapped)


def _instrument(model, totals: collections.Counter) -> list:
    """Timers around the parts of ``model`` and of the search; returns what to restore."""
    saved = [(torch, "log_softmax", torch.log_softmax),
             (selection, "row_topk", selection.row_topk),
             (decode, "apply_processors", decode.apply_processors)]
    _timed(torch, "log_softmax", "log-softmax (fp32)", totals)
    _timed(selection, "row_topk", "top-k per row", totals)
    _timed(decode, "apply_processors", "constraints (step processors)", totals)
    _timed(model, "reorder_cache", "cache reorder", totals)
    _timed(model.decoder, "project", "output projection", totals)
    _timed(model, "encode", "encoder", totals)
    _timed(model, "decode_step", "decode_step (all of the decoder)", totals)
    for layer in model.decoder.layers:
        for module, label in ((layer.self_attention, "self-attention sublayers"),
                              (layer.cross_attention, "cross-attention sublayers"),
                              (layer.ffn, "feed-forward sublayers")):
            if module is not None:
                _timed(module, "forward", label, totals)
    return saved


def measure(arch: str, precision: str, sentences: int, source_length: int, repeats: int,
            fixed_length: int = 30, beam: int = 4) -> tuple[float, dict[str, float]]:
    """(seconds per search, {part: seconds per search}) for a random ``small`` model."""
    torch.manual_seed(0)
    cfg = load_config("configs/multi30k_small.yaml", [
        f"model.arch={arch}", "model.src_vocab_size=8000", "model.tgt_vocab_size=8000"])
    model = build_model(cfg.model).eval()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    src = torch.randint(4, 8000, (sentences, source_length))
    src[:, -1] = EOS_ID
    totals: collections.Counter = collections.Counter()
    saved = _instrument(model, totals)
    try:
        for _ in range(2):
            decode.beam_search(model, src, beam=beam, fixed_length=fixed_length)
        totals.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            decode.beam_search(model, src, beam=beam, fixed_length=fixed_length)
        seconds = (time.perf_counter() - start) / repeats
    finally:
        for owner, attribute, function in saved:
            setattr(owner, attribute, function)
    return seconds, {part: total / repeats for part, total in totals.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=["transf"])
    parser.add_argument("--precision", nargs="+", default=["bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--source-length", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    retain_freed_memory()  # as Translator.load does on a CPU
    for precision in args.precision:
        for arch in args.arch:
            seconds, parts = measure(arch, precision, args.sentences, args.source_length,
                                     args.repeats)
            print(f"{arch} {precision}: {1000 * seconds:.0f} ms per search of "
                  f"{args.sentences} x beam 4, fixed length 30, {args.threads} threads")
            for part, total in sorted(parts.items(), key=lambda item: -item[1]):
                print(f"  {part:<34} {1000 * total:8.1f} ms {100 * total / seconds:6.1f}%")


if __name__ == "__main__":
    main()
