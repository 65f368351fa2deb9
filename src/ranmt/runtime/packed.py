"""Linear layers for CPU inference through oneDNN, with weights prepacked once.

Profiling the decoder (batch 100, beam 4, ``small``) put two thirds of the time in matrix
products, and PyTorch's default CPU GEMM (MKL) ran them at 60-110 GFLOP/s per core on this
project's AMD EPYC machines, against 160-260 GFLOP/s for oneDNN's AVX-512 kernels on the same
shapes (``benchmarks/fast_vs_reference.py`` and the commit that added this module). So at
inference (eval mode, no gradient, float32 or bfloat16 on the CPU) every linear layer multiplies
with a
copy of its weight reordered for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``, the
op PyTorch's own compiler uses for frozen CPU graphs), cached per weight and rebuilt when the
weight changes (its version counter or storage). Training and every other device or dtype
(bf16 on a CPU whose oneDNN cannot pack it) use ``F.linear`` unchanged.

``RANMT_ONEDNN=0`` in the environment (or :func:`set_enabled`) turns the packed path off.
Results differ from ``F.linear`` by float rounding only (~1e-6 relative).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_enabled = os.environ.get("RANMT_ONEDNN", "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turn the oneDNN inference path on or off; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def available() -> bool:
    """Whether this PyTorch build has the oneDNN linear ops."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_AVAILABLE = available()


def _packs_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses otherwise (an AMD Zen 3 has AVX2 only); bf16 products then
    go through ``F.linear``."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


_DTYPES = (torch.float32, torch.bfloat16) if _AVAILABLE and _packs_bf16() else (torch.float32,)


def _applies(x: Tensor, weight: Tensor) -> bool:
    return (_enabled and _AVAILABLE and not torch.is_grad_enabled()
            and x.device.type == "cpu" and x.dtype in _DTYPES
            and weight.dtype == x.dtype and not weight.is_mkldnn)


def inference_linear(x: Tensor, weight: Tensor, bias: Tensor | None, cache: dict,
                     name: str) -> Tensor:
    """``F.linear(x, weight, bias)``: x (..., in) -> (..., out); through oneDNN with the
    weight packed once (kept in ``cache[name]``) where that applies."""
    if torch.compiler.is_compiling() or not _applies(x, weight):
        # Under torch.compile the compiler packs frozen weights for oneDNN itself.
        return F.linear(x, weight, bias)
    # The same tensor, storage and version (inference tensors have none: they cannot change
    # outside inference mode, and the callers make new ones rather than write into them).
    version = 0 if weight.is_inference() else weight._version
    entry = cache.get(name)
    if entry is None or entry[0] is not weight or entry[1] != (weight.data_ptr(), version):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        entry = (weight, (weight.data_ptr(), version), packed)
        cache[name] = entry
    return torch.ops.mkldnn._linear_pointwise(x, entry[2], bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference goes through
    :func:`inference_linear`. ``use_packed_linears`` turns a model's linears into these."""

    _packed: dict

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            return F.linear(x, self.weight, self.bias)
        if "_packed" not in self.__dict__:
            self._packed = {}
        return inference_linear(x, self.weight, self.bias, self._packed, "weight")


def use_packed_linears(model: nn.Module) -> nn.Module:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`PackedLinear` (in place; the
    parameters, names and initialisation are untouched). Returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
    return model


def plain_linears(model: nn.Module) -> nn.Module:
    """Undo :func:`use_packed_linears` (for tools that want exact ``nn.Linear`` types, e.g.
    dynamic quantization). In place; returns the model."""
    for module in model.modules():
        if type(module) is PackedLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("_packed", None)
    return model
