"""What one linear layer costs in each of PyTorch's CPU kernels ranmt decodes with, at the
shapes of a distilled student (``student`` preset: d 256, FFN 1536; a shortlist of ~3,300
target tokens): the ceiling the matrix products put on a decoder step, whatever else is
removed around them.

Kernels, each on the same input, interleaved, best of ``--rounds`` (median of ``--calls``
calls each):

* ``fp32``: ``F.linear`` (MKL);
* ``fp32 packed``: ranmt's oneDNN prepacked layer (``ranmt.runtime.packed``), what
  ``ranmt translate`` runs in fp32;
* ``int8``: PyTorch's dynamic int8 layer (fbgemm: the activations quantized per call, int8
  products, fp32 out), what ``--quantize int8`` runs.

Rows: M = the rows of one call (32 = one greedy step of a 32-sentence batch; 1,000 ~ the
encoder over 32 sentences of ~30 subwords), K x N the layer. Printed: microseconds per call
and multiply-accumulates per second.

    python benchmarks/linear_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from ranmt.inference.quantize import quantize_model
from ranmt.runtime.packed import PackedLinear

SHAPES = ((32, 256, 256), (32, 256, 1536), (32, 1536, 256), (32, 256, 3300),
          (1000, 256, 768), (1000, 256, 1536), (1000, 1536, 256))
"""(M, K, N): one decoder step's projections, feed-forward and shortlisted output layer at
batch 32; the encoder's fused q/k/v projection and feed-forward over 1,000 rows."""


def _kernels(in_features: int, out_features: int) -> dict[str, nn.Module]:
    plain = nn.Linear(in_features, out_features)
    packed = PackedLinear(in_features, out_features)
    packed.load_state_dict(plain.state_dict())
    # the layer --quantize int8 makes (in place: of a copy)
    int8 = quantize_model(nn.Sequential(copy.deepcopy(plain)), "int8")[0]
    return {"fp32": plain, "fp32 packed": packed, "int8": int8}


def _seconds_per_call(layer: nn.Module, x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s); microseconds per call "
          "(GMAC/s)")
    names = ("fp32", "fp32 packed", "int8")
    print("| M x K x N | " + " | ".join(names) + " |")
    print("|---" * (1 + len(names)) + "|")
    with torch.inference_mode():
        for rows, in_features, out_features in SHAPES:
            kernels = _kernels(in_features, out_features)
            x = torch.randn(rows, in_features)
            for layer in kernels.values():  # warm-up: packing, oneDNN primitives
                for _ in range(5):
                    layer(x)
            best = {name: float("inf") for name in kernels}
            for _ in range(args.rounds):
                for name, layer in kernels.items():
                    best[name] = min(best[name], _seconds_per_call(layer, x, args.calls))
            macs = rows * in_features * out_features
            cells = [f"{1e6 * best[n]:,.0f} ({macs / best[n] / 1e9:.0f})" for n in names]
            print(f"| {rows} x {in_features} x {out_features} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
