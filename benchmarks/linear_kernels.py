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
  products, fp32 out), what ``--quantize int8`` runs;
* ``--onednn-int8``: the same dynamic int8 layer prepacked under PyTorch's ``onednn``
  quantized engine (oneDNN's int8 kernels, which use AVX512-VNNI where the CPU has it);
* ``--bf16`` (a CPU whose oneDNN packs bf16): the packed layer in bf16, input and output
  bf16, what ``--precision bf16`` runs.

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

from ranmt.inference.quantize import quantize_model, quantized_engine
from ranmt.runtime.packed import PackedLinear
from ranmt.runtime.precision import cpu_description

SHAPES = ((32, 256, 256), (32, 256, 1536), (32, 1536, 256), (32, 256, 3300),
          (1000, 256, 768), (1000, 256, 1536), (1000, 1536, 256))
"""(M, K, N): one decoder step's projections, feed-forward and shortlisted output layer at
batch 32; the encoder's fused q/k/v projection and feed-forward over 1,000 rows."""


class _Bf16(nn.Module):
    """A packed layer in bf16 fed the fp32 input cast once, outside the timing."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer.to(torch.bfloat16)
        self.cached: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cached is None or self.cached[0] is not x:
            self.cached = (x, x.to(torch.bfloat16))
        return self.layer(self.cached[1])


def _int8(plain: nn.Module) -> nn.Module:
    """The layer ``--quantize int8`` makes of ``plain`` (in place: of a copy)."""
    return quantize_model(nn.Sequential(copy.deepcopy(plain)), "int8")[0]


def _kernels(in_features: int, out_features: int, onednn_int8: bool,
             bf16: bool) -> dict[str, nn.Module]:
    plain = nn.Linear(in_features, out_features)
    packed = PackedLinear(in_features, out_features)
    packed.load_state_dict(plain.state_dict())
    kernels = {"fp32": plain, "fp32 packed": packed, "int8": _int8(plain)}
    if onednn_int8:
        with quantized_engine("onednn"):
            kernels["int8 onednn"] = _int8(plain)
    if bf16:
        kernels["bf16 packed"] = _Bf16(copy.deepcopy(packed))
    return kernels


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
    p.add_argument("--shapes", nargs="+", metavar="MxKxN",
                   help="the shapes to measure (default: a student's, see SHAPES)")
    p.add_argument("--onednn-int8", action="store_true",
                   help="also the int8 layer under PyTorch's onednn quantized engine")
    p.add_argument("--bf16", action="store_true", help="also the packed layer in bf16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{cpu_description()}; torch {torch.__version__}, {args.threads} thread(s); "
          "microseconds per call (GMAC/s)")
    with torch.inference_mode():
        shapes = ([tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
                  if args.shapes else SHAPES)
        for index, (rows, in_features, out_features) in enumerate(shapes):
            kernels = _kernels(in_features, out_features, args.onednn_int8, args.bf16)
            if index == 0:  # the table's header, named after the kernels built
                print("| M x K x N | " + " | ".join(kernels) + " |")
                print("|---" * (1 + len(kernels)) + "|")
            x = torch.randn(rows, in_features)
            for layer in kernels.values():  # warm-up: packing, oneDNN primitives
                for _ in range(5):
                    layer(x)
            best = {name: float("inf") for name in kernels}
            for _ in range(args.rounds):
                for name, layer in kernels.items():
                    best[name] = min(best[name], _seconds_per_call(layer, x, args.calls))
            macs = rows * in_features * out_features
            cells = [f"{1e6 * best[n]:,.0f} ({macs / best[n] / 1e9:.0f})" for n in kernels]
            print(f"| {rows} x {in_features} x {out_features} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
