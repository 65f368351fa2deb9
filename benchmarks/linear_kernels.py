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
  bf16, what ``--precision bf16`` runs;
* ``--maintained-int8`` (torchao installed): the int8 paths PyTorch maintains in place of
  the deprecated ``torch.ao.quantization.quantize_dynamic`` behind ``int8``: torchao's
  ``Int8DynamicActivationInt8WeightConfig`` through ``torch.compile`` (``torchao dyn``),
  and PT2E with torchao's ``X86InductorQuantizer`` (oneDNN int8 with fused epilogues),
  exported at the row count, compiled with freezing, dynamic (per-call activation scale:
  ``pt2e dyn``) and static (activation scale calibrated on two random inputs: ``pt2e
  static``).

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


def _maintained_int8(plain: nn.Module, rows: int) -> dict[str, nn.Module]:
    """The layer through torchao's int8 and PT2E's x86 int8 (see the module docstring),
    each compiled for inputs of ``rows`` rows (torch's inductor with freezing)."""
    import torch._inductor.config as inductor_config
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    inductor_config.freezing = True  # weights folded and prepacked as constants
    layers = {}
    dynamic = copy.deepcopy(plain)
    quantize_(dynamic, Int8DynamicActivationInt8WeightConfig())
    layers["torchao dyn"] = torch.compile(dynamic)
    in_features = plain.in_features if isinstance(plain, nn.Linear) else 256
    example = torch.randn(rows, in_features)
    for name, is_dynamic in (("pt2e dyn", True), ("pt2e static", False)):
        quantizer = x86.X86InductorQuantizer()
        quantizer.set_global(x86.get_default_x86_inductor_quantization_config(
            is_dynamic=is_dynamic))
        with torch.no_grad():
            exported = torch.export.export(copy.deepcopy(plain), (example,)).module()
            prepared = prepare_pt2e(exported, quantizer)
            for _ in range(2):  # calibration (static) / observer warm-up (dynamic)
                prepared(torch.randn(rows, in_features))
            layers[name] = torch.compile(convert_pt2e(prepared))
    return layers


class DecoderProducts(nn.Module):
    """The 13 matrix products of one greedy step of a ``student`` decoder (2 layers: fused
    q/k/v, output, cross-attention query and output, feed-forward in and out; then the
    output layer over a shortlist of 3,300), chained with residual sums in place of the
    attention itself: what one compiled graph around a step's int8 products costs, against
    the eager layers one call each."""

    def __init__(self, d_model: int = 256, ffn: int = 1536, vocabulary: int = 3300):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(d_model, 3 * d_model), "out": nn.Linear(d_model, d_model),
            "cross_q": nn.Linear(d_model, d_model), "cross_out": nn.Linear(d_model, d_model),
            "ffn_in": nn.Linear(d_model, ffn), "ffn_out": nn.Linear(ffn, d_model)})
            for _ in range(2))
        self.output = nn.Linear(d_model, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        for layer in self.layers:
            x = x + layer["out"](layer["qkv"](x)[:, :width])
            x = x + layer["cross_out"](layer["cross_q"](x))
            x = x + layer["ffn_out"](torch.relu(layer["ffn_in"](x)))
        return self.output(x)


def _kernels(in_features: int, out_features: int, onednn_int8: bool,
             bf16: bool, maintained_int8: int = 0) -> dict[str, nn.Module]:
    plain = nn.Linear(in_features, out_features)
    packed = PackedLinear(in_features, out_features)
    packed.load_state_dict(plain.state_dict())
    kernels = {"fp32": plain, "fp32 packed": packed, "int8": _int8(plain)}
    if onednn_int8:
        with quantized_engine("onednn"):
            kernels["int8 onednn"] = _int8(plain)
    if bf16:
        kernels["bf16 packed"] = _Bf16(copy.deepcopy(packed))
    if maintained_int8:  # the row count the compiled layers are made for
        kernels.update(_maintained_int8(plain, maintained_int8))
    return kernels


def _chain(rows: int, maintained_int8: bool) -> dict[str, nn.Module]:
    """:class:`DecoderProducts` in fp32, with ``--quantize int8``'s layers, and (optionally)
    the maintained int8 paths compiled as one graph."""
    plain = DecoderProducts().eval()
    systems = {"fp32": plain, "int8": quantize_model(copy.deepcopy(plain), "int8")}
    systems["fp32 compiled"] = torch.compile(copy.deepcopy(plain))
    if maintained_int8:
        systems.update(_maintained_int8(plain, rows))
    return systems


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
    p.add_argument("--decoder-step", action="store_true",
                   help="also the 13 products of a greedy student step, chained as one graph")
    p.add_argument("--maintained-int8", action="store_true",
                   help="also torchao's int8 and PT2E's x86 int8, compiled (needs torchao)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{cpu_description()}; torch {torch.__version__}, {args.threads} thread(s); "
          "microseconds per call (GMAC/s)")
    with torch.inference_mode():
        shapes = ([tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
                  if args.shapes else SHAPES)
        for index, (rows, in_features, out_features) in enumerate(shapes):
            kernels = _kernels(in_features, out_features, args.onednn_int8, args.bf16,
                               rows if args.maintained_int8 else 0)
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
        if args.decoder_step:
            _print_chain(args)


def _on_a_copy(layer: nn.Module):
    """``layer`` called on a copy of its input."""
    return lambda inputs: layer(inputs.clone())


def _print_chain(args) -> None:
    """One table row per system: the 13 products of a greedy student step, batch 32."""
    systems = _chain(32, args.maintained_int8)
    x = torch.randn(32, 256)
    # every system gets a fresh copy of the input: the PT2E graphs compiled with freezing
    # wrote their first residual sum into their input (torch 2.13, torchao 0.18)
    copied = {name: _on_a_copy(layer) for name, layer in systems.items()}
    for call in copied.values():
        for _ in range(5):
            call(x)
    best = {name: float("inf") for name in systems}
    for _ in range(args.rounds):
        for name, call in copied.items():
            best[name] = min(best[name], _seconds_per_call(call, x, args.calls))
    print("\nThe 13 products of a greedy student step at batch 32 (DecoderProducts), "
          "microseconds per step (x fp32 eager):")
    print("| " + " | ".join(systems) + " |")
    print("|---" * len(systems) + "|")
    print("| " + " | ".join(f"{1e6 * best[n]:,.0f} ({best['fp32'] / best[n]:.2f}x)"
                            for n in systems) + " |")


if __name__ == "__main__":
    main()
