"""Dropout with masks drawn from bulk random bits (``train.dropout_masks=fast``).

PyTorch's CPU dropout draws one Bernoulli sample per element (``bernoulli_``), a loop that
fills ~160 million elements a second on this project's 2-core AMD machine whatever the
dtype: 24 ms for a (3840, 1024) tensor, 12% of a bf16 training step of TransF ``small`` and
17% of RAN-ALL's (``benchmarks/profile_train.py``; docs/performance/train_bf16/).

``fast`` draws 64 random bits per four elements (``Tensor.random_`` on int64, which the
CPU generator fills from two 32-bit draws) and reads them as four signed 16-bit lanes s:
an element is dropped where u = s + 32768 (uniform in [0, 65536)) is below
``n = round(p * 65536)``. So the drop probability is n / 65536 (``p`` rounded to a multiple
of 2^-16: 0.1 -> 0.1000061), kept elements are scaled by 65536 / (65536 - n) (the output's
expectation is the input exactly), and a mask costs ~4.7x less than ``bernoulli_``. The
masks come from PyTorch's default generator, so seeding (``torch.manual_seed``), the
trainer's saved RNG state and exact resume work as with ``torch``; the masks differ from
``torch``'s, so a run is not bit-identical to one trained with the other setting (why
``torch`` stays the default: every committed grid cell was trained with it).

Only training on a CPU uses the fast masks (:func:`fast_masks` switches them on for the
training loop); evaluation, decoding and other devices call ``F.dropout`` unchanged. Every
dropout of the model goes through :func:`dropout` (:class:`Dropout` for the modules); the
attention-weight dropout that ``scaled_dot_product_attention`` would draw itself is computed
outside that kernel when the fast masks are on (``ranmt.attention.dot_product``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_fast = False
"""Set by :func:`fast_masks` (a module variable, like ``ranmt.runtime.precision``'s)."""

_LANES = 65536  # values of one 16-bit lane


@contextlib.contextmanager
def fast_masks(enabled: bool = True):
    """Within: training-mode dropout on CPU tensors uses :func:`keep_mask` (the training
    loop's thread; not meant to be entered from several threads at once)."""
    global _fast
    previous = _fast
    _fast = enabled
    try:
        yield
    finally:
        _fast = previous


def fast_masks_on() -> bool:
    """Whether :func:`fast_masks` is on (for kernels with their own dropout, which must then
    be computed another way: ``ranmt.attention.dot_product``)."""
    return _fast


def keep_mask(shape: torch.Size | tuple[int, ...], p: float,
              generator: torch.Generator | None = None) -> tuple[Tensor, float]:
    """A bool mask of ``shape`` (True = keep) with each element dropped with probability
    round(p * 65536) / 65536, and the scale 65536 / (65536 - round(p * 65536)) of the
    kept elements (CPU)."""
    count = math.prod(shape)
    dropped = round(p * _LANES)
    bits = torch.empty((count + 3) // 4, dtype=torch.int64)
    bits.random_(-2 ** 63, 2 ** 63 - 1, generator=generator)
    lanes = bits.view(torch.int16)[:count]  # s; u = s + 32768
    keep = lanes.ge(dropped - _LANES // 2).view(shape)
    return keep, _LANES / (_LANES - dropped)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)``; with fast masks on (:func:`fast_masks`), in training,
    on a CPU tensor and 0 < p < 1: ``x * mask * scale`` from :func:`keep_mask` (the scale
    applied as a float scalar, so a bf16 x is rounded once, as by ``F.dropout``; autograd
    keeps only the bool mask for the backward)."""
    if not (_fast and training and 0.0 < p < 1.0 and x.device.type == "cpu"):
        return F.dropout(x, p, training)
    keep, scale = keep_mask(x.shape, p)
    return (x * keep).mul_(scale)


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same repr, no parameters) through :func:`dropout`."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)
