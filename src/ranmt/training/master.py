"""bf16 compute weights with fp32 master weights (``train.precision=bf16-weights``).

Autocast keeps the weights in fp32 and casts each one to bf16 where an operator uses it, in
every step, and casts its gradient back: on a `base` TransF 516 of a step's 1,146 kernels
(``benchmarks/count_ops.py``). Here, as in NVIDIA's fairseq recipe (``--amp-level O2``) and
fairseq's ``--bf16``, the model's parameters *are* bf16 — the compute copy — and the
optimizer updates fp32 master weights:

* every parameter is a view into one flat bf16 buffer ``weights`` (N,), its gradient a view
  into one flat bf16 buffer ``grads`` (N,) that backward accumulates into in place;
* the fp32 masters are one flat tensor ``master`` (N,), the only parameter the optimizer
  sees (one Adam update over one tensor);
* a step casts twice, whatever the model's size: the gradients up (:meth:`to_master`) and
  the updated masters down (:meth:`to_model`).

Checkpoints, validation and decoding see fp32 weights: :meth:`fp32_weights` gives every
parameter an fp32 copy of its master for the time of the ``with`` block. Buffers (position
tables) stay as they are. The master's optimizer state (Adam's moments, (N,)) is one tensor,
so a run keeps this precision when it resumes (the trainer records its precision).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn


class MasterWeights:
    """fp32 masters for the parameters of ``model``, which become ``dtype`` views of one flat
    buffer (and their gradients views of another)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numels = [p.numel() for p in self.params]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])  # (N,)
        self.master = nn.Parameter(flat)
        self.weights = flat.detach().to(dtype)  # (N,) the compute copy
        self.grads = torch.zeros_like(self.weights)  # (N,) backward accumulates here
        self._point_params_at(self.weights, self.grads)

    def _point_params_at(self, weights: Tensor, grads: Tensor | None) -> None:
        """Every parameter a view of its slice of ``weights`` (and its gradient of
        ``grads``; None: no gradient)."""
        offset = 0
        for param, count in zip(self.params, self.numels):
            param.data = weights[offset: offset + count].view_as(param)
            param.grad = None if grads is None else grads[offset: offset + count].view_as(param)
            offset += count

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: the fp32 masters, one flat tensor."""
        return [self.master]

    def zero_grad(self) -> None:
        """Zero the compute copy's gradients (one kernel; the views stay in place)."""
        self.grads.zero_()

    def to_master(self) -> None:
        """The accumulated gradients (bf16) into the masters' gradient (fp32): one cast."""
        self.master.grad = self.grads.to(torch.float32)

    def to_model(self) -> None:
        """The updated masters (fp32) into the compute copy (bf16): one cast."""
        with torch.no_grad():
            self.weights.copy_(self.master)

    @contextlib.contextmanager
    def fp32_weights(self):
        """Within: every parameter an fp32 copy of its master, each with storage of its own
        (a checkpoint's tensors must not share memory), no gradient; afterwards the bf16
        views and their gradients again."""
        with torch.no_grad():
            copies = self.master.detach().clone()
        offset = 0
        for param, count in zip(self.params, self.numels):
            param.data = copies[offset: offset + count].view_as(param).clone()
            param.grad = None
            offset += count
        try:
            yield
        finally:
            self._point_params_at(self.weights, self.grads)
