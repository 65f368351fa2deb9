"""Post-training int8 quantization for CPU inference (``--quantize int8``), without
``torch.ao.quantization``.

Every linear layer (attention projections, feed-forward, output projection; the decoder's
fused QKV and KV products of dot-product attention as one layer each) becomes an
:class:`Int8Linear`: its weight W (out, in) stored as int8 with one symmetric scale per
output row, s_w[o] = max_i |W[o, i]| / 127, W_q = round(W / s_w); the bias stays float32.
Activations are quantized on the fly, and the layer runs one of two kernels on the same
int8 weight:

* **eager** (the default search): ATen's fbgemm dynamic int8 product
  (``quantized::linear_dynamic``, the kernel ``quantize_dynamic`` wraps) on the weight
  packed once with its per-row scales; the activations get one scale per call (7-bit,
  ``reduce_range``), quantized and dequantized inside the kernel;
* **traced** (``decode.compile_step``, or :func:`int8_kernel` ``"int_mm"``): per-row
  activation scales s_x[r] = max_i |x[r, i]| / 127, x_q = round(x / s_x), the int32
  product ``torch._int_mm(x_q, W_q^T)`` (oneDNN's s8 x s8 -> s32; the op torchao's dynamic
  int8 lowers to), y = acc * s_x s_w + b -- plain tensor operations that inductor fuses
  around the product, so a compiled step has no opaque call.

The fbgemm kernel stays the eager default because it is faster called layer by layer
(1.4-1.8x the traced form's time at a decoder step's shapes, one thread, Zen 4;
docs/PERFORMANCE.md, "int8 without torch.ao"); it is ATen's own operator, not the
deprecated ``torch.ao.quantization`` API, but its weight goes through a quantized tensor,
which torch 2.13 also marks deprecated (warning silenced). Where a build has no fbgemm
kernel -- or drops quantized tensors -- the traced form runs everywhere. Embeddings, layer
norms, attention weights (RAN's learned matrices included) and the softmax stay float32,
so every registry variant quantizes the same way.
A tied output projection is given its own (quantized) copy of the target embedding.
CTranslate2's ``int8`` (per-row weight and activation scales) is the peer this is measured
against (``benchmarks/peers.py decode``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ranmt.runtime.int8 import int8_product
from ranmt.runtime.packed import plain_linears

QUANTIZE_MODES = ("none", "int8")
INT8_KERNELS = ("auto", "int_mm")
_kernel = "auto"  # "int_mm": the traced form in eager mode too (tests, benchmarks)


def _has_fbgemm_kernel() -> bool:
    engines = torch.backends.quantized.supported_engines
    return (hasattr(torch, "_make_per_channel_quantized_tensor")
            and hasattr(torch.ops.quantized, "linear_dynamic")
            and any(e in engines for e in ("fbgemm", "x86", "onednn")))


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight (per-row scales) and dynamically quantized
    activations: x (..., in) -> (..., out). Made from a float ``nn.Linear``; inference only.

    Buffers: ``weight_t`` (in, out) int8 = W_q^T, ``weight_scale`` (out,) float32 = s_w,
    ``bias`` (out,) float32 or None."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # (out,)
        quantized = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("weight_t", quantized.t())  # (in, out), a view of (out, in)
        self.register_buffer("weight_scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self._packed = _fbgemm_pack(quantized, scale, bias) if _has_fbgemm_kernel() else None

    def _fbgemm(self) -> bool:
        """Whether this call runs the fbgemm kernel (eager, kernel ``auto``, packed)."""
        if torch.compiler.is_compiling():  # first: a traced graph guards on nothing here
            return False
        return self._packed is not None and _kernel == "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fbgemm():
            return torch.ops.quantized.linear_dynamic(x, self._packed, True)
        return int8_product(x, self.weight_t, self.weight_scale, self.bias)

    def restricted(self, rows: torch.Tensor):
        """x (..., in) -> this layer's outputs at ``rows`` (R,) only, from the same int8 rows
        and scales (equal to ``self(x)[..., rows]`` up to float summation order; a lexical
        shortlist's output layer at R/out of the cost)."""
        weight_t = self.rows_t(rows)
        scale = self.weight_scale.index_select(0, rows)
        bias = None if self.bias is None else self.bias.index_select(0, rows)
        if self._packed is None:
            return lambda x: int8_product(x, weight_t, scale, bias)
        packed = _fbgemm_pack(weight_t.t(), scale, bias)
        return lambda x: (torch.ops.quantized.linear_dynamic(x, packed, True)
                          if self._fbgemm() else int8_product(x, weight_t, scale, bias))

    def rows_t(self, rows: torch.Tensor) -> torch.Tensor:
        """The int8 weight's rows ``rows`` (R,), transposed: (in, R), a view of (R, in) as
        ``weight_t`` is of (out, in). Gathering whole rows of the stored matrix is a copy
        of R contiguous runs; ``weight_t.index_select(1, rows)`` gathered it element by
        element into the transposed layout (1.9 ms of a one-sentence search's 13 ms with a
        shortlist, student, Zen 4)."""
        return self.weight_t.t().index_select(0, rows).t()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def _fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """int8 weight (out, in) with per-row scales (out,) -> ATen's packed weight for
    ``quantized::linear_dynamic`` (under the quantized engine in effect)."""
    zero = torch.zeros(scale.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # quantized tensors are deprecated (torch 2.13): see above
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(weight.contiguous(), scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(q, bias)


@contextmanager
def int8_kernel(kernel: str) -> Iterator[None]:
    """Within the block, eager :class:`Int8Linear` layers run ``kernel``: ``auto`` (fbgemm
    where the build has it) or ``int_mm`` (the traced form, which a compiled step runs).
    Restored on exit."""
    global _kernel
    if kernel not in INT8_KERNELS:
        raise ValueError(f"unknown int8 kernel '{kernel}' (choose from {', '.join(INT8_KERNELS)})")
    previous, _kernel = _kernel, kernel
    try:
        yield
    finally:
        _kernel = previous


def quantize_model(model: nn.Module, mode: str = "none") -> nn.Module:
    """Return ``model`` quantized for CPU inference (``mode`` int8) or unchanged (none).

    In place: the model's linear layers are replaced; it stays usable for inference only.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization '{mode}' (choose from {', '.join(QUANTIZE_MODES)})")
    if mode == "none":
        return model
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError("int8 quantization runs on the CPU only (use --device cpu)")
    model.eval()
    decoder = getattr(model, "decoder", None)
    if decoder is not None and decoder.output is None:  # tied: give the projection its own copy
        weight = decoder.embedder.tokens.weight
        output = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            output.weight.copy_(weight)
        decoder.output = output
    from ranmt.attention.dot_product import DotProductAttention

    for module in list(model.modules()):  # fused QKV / KV products, quantized as one each
        if isinstance(module, DotProductAttention):
            module.fuse_for_quantization()
    plain_linears(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child))
    return model


@contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """Within the block, PyTorch's quantized engine is ``engine`` (e.g. ``onednn``): layers
    quantized there are prepacked for its kernels and keep them. Restored on exit."""
    if engine not in torch.backends.quantized.supported_engines:
        raise ValueError(f"this PyTorch build has no quantized engine '{engine}' (it has "
                         f"{', '.join(torch.backends.quantized.supported_engines)})")
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is int8-quantized."""
    return any(isinstance(m, Int8Linear) for m in model.modules())
