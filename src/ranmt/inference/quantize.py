"""Post-training int8 quantization for CPU inference (``--quantize int8``).

Dynamic quantization (PyTorch's ``quantize_dynamic``): the weights of every linear layer
(attention projections, feed-forward, output projection; the decoder's fused QKV and KV
products of dot-product attention as one layer each) are stored as int8 with one scale
per tensor; activations are quantized on the fly per batch, the products run in int8 and
are accumulated in int32. Embeddings, layer norms, attention weights (RAN's learned
matrices included) and the softmax stay float32, so every registry variant quantizes the
same way. A tied output projection is given its own (quantized) copy of the target
embedding, since the embedding lookup itself stays float.

PyTorch marks ``torch.ao.quantization`` as deprecated in favour of torchao; it still ships
and runs in the versions this project supports (2.4 to 2.13), and its warnings are
silenced here. CTranslate2's ``int8`` is the peer this is measured against
(``benchmarks/peers.py decode``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ranmt.runtime.packed import plain_linears

QUANTIZE_MODES = ("none", "int8")


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
    plain_linears(model)  # quantize_dynamic maps exact nn.Linear types only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
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
    return any("quantized" in type(m).__module__ for m in model.modules())



# ------------------------------------------------------------------ int8 inside a compiled step
#
# Dynamo cannot trace a dynamic int8 layer: its fbgemm packed weight is a TorchScript
# object ("Failed to convert args/kwargs to proxy"). For ``decode.compile_step`` each such
# layer becomes a :class:`TraceableInt8Linear`, which calls the same kernel through a custom
# operator that names its packed weight by a number: the compiled graph holds the operator
# as an opaque call (the products run as in eager int8; what is compiled is everything
# between them).

_PACKED: list = []  # number -> (fbgemm packed weight and bias, output features)


@torch.library.custom_op("ranmt::int8_linear", mutates_args=())
def _int8_linear(x: torch.Tensor, layer: int) -> torch.Tensor:
    """x (..., in) -> (..., out): dynamic int8 layer number ``layer`` (fbgemm's kernel)."""
    return torch.ops.quantized.linear_dynamic(x, _PACKED[layer][0], True)


@_int8_linear.register_fake
def _int8_linear_shape(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PACKED[layer][1])


class TraceableInt8Linear(nn.Module):
    """A dynamic int8 linear layer (``quantize_dynamic``'s) as an operator dynamo can put in
    a graph; the same kernel and outputs."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.number = len(_PACKED)
        _PACKED.append((layer._packed_params._packed_params, layer.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ranmt.int8_linear(x, self.number)


def traceable_int8(model: nn.Module) -> int:
    """Replace every dynamic int8 layer of a :func:`quantize_model`'d ``model`` by a
    :class:`TraceableInt8Linear` (in place); returns how many. The packed weights stay
    referenced for the life of the process."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is DynamicLinear:
                setattr(module, name, TraceableInt8Linear(child))
                replaced += 1
    return replaced
