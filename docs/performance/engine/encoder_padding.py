"""How much of the compiled int8 encoder's time is padding (issue 99; one-off record).

CTranslate2 runs its encoder's position-wise layers on the batch's real tokens only (its
oneDNN int8 GEMMs have M = the batch's token count), at the same ~205 G multiply-adds a
second per core as ranmt's ``torch._int_mm`` (ONEDNN_VERBOSE; docs/performance/engine/perf/).
ranmt's compiled search pads the source to a multiple of 8 columns, so its encoder
computes 6,400 positions for the 4,664 real ones of the 320 test_2016 sentences in
batches of 32 (1.37x), the eager search 5,216 (padding to the batch's longest, 1.12x).
This times the encoder of the trained int8 TransF student over the same 10 batches:

    python docs/performance/engine/encoder_padding.py RUN DATA

* eager, padded to the longest; eager with the feed-forward sublayers on real tokens only;
* compiled, static shapes, padded to a multiple of 8 (today's ``CompiledStep.encode``);
* compiled, static shapes, padded to the longest (a graph per length);
* compiled with the source length dynamic (one graph), padded to the longest;
* compiled, dynamic, with the feed-forward sublayers on real tokens only.

Each variant: a warm-up round, then the median of 5 rounds; one thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import peers  # noqa: E402

from ranmt.data.batching import pad_sources  # noqa: E402
from ranmt.inference.translator import Translator  # noqa: E402
from ranmt.model import PAD_ID  # noqa: E402
from ranmt.model.layers import EncoderLayer  # noqa: E402

_original_forward = EncoderLayer.forward


def _packed_ffn_forward(self, x, pad_mask, state=None, need_weights=False, masks=None):
    """EncoderLayer.forward with its feed-forward sublayer on the real positions only."""
    weights = None
    if self.self_attention is not None:
        from ranmt.model.layers import _attend
        x, state, weights = _attend(self.attn_sub, self.self_attention, x, None, pad_mask,
                                    False, state, None, need_weights, masks)
    if self.ffn is not None:
        keep = (~pad_mask).reshape(-1).nonzero().squeeze(1)  # (T,) real positions
        torch._check(keep.shape[0] > 0)  # traced: T is data-dependent (an unbacked size)
        flat = x.reshape(-1, x.shape[-1])  # (B * S, d)
        real = flat.index_select(0, keep)  # (T, d)
        real = self.ffn_sub.residual(real, self.ffn(self.ffn_sub.normed_input(real)))
        x = flat.index_copy(0, keep, real).view_as(x)
    return x, state, weights


def _encode(model, src):
    return model.encode(src)


def _encode_packed(model, src):
    """The same as :func:`_encode`, a code object of its own: Dynamo caches graphs by the
    code it compiles, and would give this variant the graph of the plain one."""
    return model.encode(src)


def _encode_static_longest(model, src):
    """The same again (its own graph cache): static shapes at the batch's longest."""
    return model.encode(src)


def main() -> None:
    run, data = sys.argv[1:3]
    torch.set_num_threads(1)
    translator = Translator.load(run, device="cpu", quantize="int8")
    model = translator.model.eval()
    args = Namespace(data=data, split="test_2016_flickr", sentences=320, batch=32)
    _, batches = peers._source_batches(args, translator)
    longest = [pad_sources(batch) for batch in batches]
    bucketed = [F.pad(s, (0, -s.shape[1] % 8), value=PAD_ID) for s in longest]
    static = torch.compile(_encode, fullgraph=True, dynamic=False, options={"freezing": True})
    dynamic = torch.compile(_encode, fullgraph=True, dynamic=True, options={"freezing": True})
    static_longest = torch.compile(_encode_static_longest, fullgraph=True, dynamic=False,
                                   options={"freezing": True})
    dynamic_packed = torch.compile(_encode_packed, fullgraph=True, dynamic=True,
                                   options={"freezing": True})
    variants = {
        "eager, longest": (lambda s: model.encode(s), longest, _original_forward),
        "eager, longest, FFN on real tokens": (lambda s: model.encode(s), longest,
                                               _packed_ffn_forward),
        "compiled static, bucket 8 (today)": (lambda s: static(model, s), bucketed,
                                              _original_forward),
        "compiled static, longest (a graph per length)": (
            lambda s: static_longest(model, s), longest, _original_forward),
        "compiled dynamic, longest": (lambda s: dynamic(model, s), longest, _original_forward),
        "compiled dynamic, longest, FFN on real tokens": (
            lambda s: dynamic_packed(model, s), longest, _packed_ffn_forward),
    }
    reference = None
    with torch.inference_mode(), torch._dynamo.config.patch(
            recompile_limit=64, capture_dynamic_output_shape_ops=True):
        for name, (encode, sources, forward) in variants.items():
            EncoderLayer.forward = forward
            start = time.perf_counter()
            outputs = [encode(s)[0] for s in sources]  # warm-up (compiles)
            warm = time.perf_counter() - start
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for s in sources:
                    encode(s)
                rounds.append(time.perf_counter() - start)
            rows = sum(s.numel() for s in sources)
            real = [o[:, : ref.shape[1]] for o, ref in zip(outputs, reference or outputs)]
            mask = [s[:, : r.shape[1]].ne(PAD_ID) for s, r in zip(longest, real)]
            if reference is None:
                reference = [o * m[..., None] for o, m in zip(real, mask)]
            diff = max(float(((o * m[..., None]) - r).abs().max())
                       for o, m, r in zip(real, mask, reference))
            print(f"{name:48s} {1000 * statistics.median(rounds):7.1f} ms a round of 10 "
                  f"batches ({rows} positions; first round {warm:.1f} s; max |diff| at real "
                  f"positions vs eager {diff:.2e})", flush=True)
    EncoderLayer.forward = _original_forward


if __name__ == "__main__":
    main()
