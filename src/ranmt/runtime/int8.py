"""The int8 product a compiled step traces (``ranmt.inference.quantize.Int8Linear``'s
traced kernel, and a compiled shortlist's restricted int8 output layer): per-row symmetric
activation scales s_x[r] = max_i |x[r, i]| / 127, x_q = round(x / s_x), the int32 product
``torch._int_mm(x_q, W_q^T)`` (oneDNN's s8 x s8 -> s32 on a CPU), y = acc * s_x s_w + b.
Plain tensor operations, so inductor fuses the quantization and dequantization around
the product."""

from __future__ import annotations

import torch


def int8_product(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float -> (..., out): per-row symmetric int8 activations times the int8
    weight ``weight_t`` (in, out) with its per-column scales, accumulated in int32."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.shape[0] == 0:  # an empty batch: no product to run
        out = rows.new_zeros(0, weight_t.shape[1])
    else:
        row_scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127  # (N, 1)
        quantized = torch.round(rows / row_scale).to(torch.int8)
        product = torch._int_mm(quantized, weight_t).float()  # (N, out) int32 -> float
        out = (product * (row_scale * weight_scale) if bias is None
               else torch.addcmul(bias, product, row_scale * weight_scale))
    return out.reshape(*x.shape[:-1], weight_t.shape[1]).to(x.dtype)
