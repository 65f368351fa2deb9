"""The training loss: label-smoothed cross-entropy, fused by hand for speed on a CPU.

For logits x (N, V), targets y (N,) (PAD rows ignored) and smoothing eps, with
``lse = logsumexp(x)``:

    nll_i     = lse_i - x_{i, y_i}                       (= -log p_{i, y_i})
    uniform_i = lse_i - mean_v x_{i, v}                  (= mean_v -log p_{i, v})
    loss      = sum_i (1 - eps) * nll_i + eps * uniform_i

— what ``F.cross_entropy(x, y, ignore_index=PAD, label_smoothing=eps, reduction="sum")``
gives. Its gradient is ``dloss/dx_i = p_i - eps / V - (1 - eps) * onehot(y_i)`` for kept
rows (0 for PAD rows). Written as one autograd function, the (N, V) work is a cast to fp32,
a log-sum-exp and a mean forward, and ``exp``, one fused multiply-add and the cast back
backward: about half the passes over the (N, V) logits of log-softmax + two reductions
(the output layer's 8k-32k classes make this the largest elementwise work of a step). The
sums are in fp32 whatever the logits' dtype (bf16 under autocast); bf16/fp16 logits are cast
in row chunks (:data:`CHUNK_ROWS`), so the batch's logits never exist in fp32 at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAD = 0


CHUNK_ROWS = 4096
"""Rows of bf16/fp16 logits cast to fp32 at a time: the loss never holds the whole batch's
logits in fp32 (25k target tokens x a 32k vocabulary are 3.2 GB in fp32; a chunk is 0.5 GB),
forward or backward. A traced (compiled) loss takes all rows at once: the compiler fuses the
cast into the reductions, and a loop over a symbolic row count would specialise on it."""


def _row_chunks(rows: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most CHUNK_ROWS rows (one range when compiling)."""
    step = rows if torch.compiler.is_compiling() else CHUNK_ROWS
    return [(start, min(start + step, rows)) for start in range(0, rows, max(step, 1))]


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float):
        low = logits.dtype in (torch.bfloat16, torch.float16)
        keep = target.ne(PAD)
        if low:  # fp32 in row chunks; the bf16/fp16 logits are what backward keeps
            lse, picked, mean = (logits.new_empty(logits.shape[0], dtype=torch.float32)
                                 for _ in range(3))
            for start, end in _row_chunks(logits.shape[0]):
                x = logits[start:end].float()  # (n, V)
                lse[start:end] = torch.logsumexp(x, dim=-1)
                picked[start:end] = x.gather(1, target[start:end, None]).squeeze(1)
                if smoothing:
                    mean[start:end] = x.mean(dim=-1)
        else:  # fp32/fp64 logits as they are
            lse = torch.logsumexp(logits, dim=-1)  # (N,)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            mean = logits.mean(dim=-1) if smoothing else None
        nll = (lse - picked).masked_fill(~keep, 0.0).sum()
        loss = nll.clone()  # a tensor of its own: nll is marked non-differentiable
        if smoothing:
            uniform = (lse - mean).masked_fill(~keep, 0.0).sum()
            loss = (1.0 - smoothing) * nll + smoothing * uniform
        ctx.save_for_backward(logits, lse, target, keep)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        logits, lse, target, keep = ctx.saved_tensors
        eps, vocab = ctx.smoothing, logits.shape[-1]
        scale = (grad_loss * keep.to(lse.dtype))[:, None]  # (N, 1): 0 on PAD rows
        if logits.dtype not in (torch.bfloat16, torch.float16):
            return _gradient(logits - lse[:, None], target, scale, eps, vocab), None, None
        grad = torch.empty_like(logits)
        for start, end in _row_chunks(logits.shape[0]):
            # in place on the chunk's fp32 copy: a new (n, V) buffer per step costs a
            # pass of page faults on a CPU besides the arithmetic
            rows = logits[start:end].float().sub_(lse[start:end, None])
            grad[start:end] = _gradient(rows, target[start:end], scale[start:end], eps, vocab)
        return grad, None, None


def _gradient(shifted: Tensor, target: Tensor, scale: Tensor, eps: float, vocab: int
              ) -> Tensor:
    """The loss's gradient ``scale * (p - eps/V - (1 - eps) * onehot(y))`` (n, V) from the
    logits minus their log-sum-exp (n, V), computed in place on them."""
    grad = shifted.exp_().sub_(eps / vocab).mul_(scale)
    return grad.scatter_add_(1, target[:, None], scale * -(1.0 - eps))


def label_smoothed_loss(logits: Tensor, target: Tensor, smoothing: float
                        ) -> tuple[Tensor, Tensor]:
    """(summed smoothed loss, summed NLL (no gradient)) over non-pad tokens; logits
    (B, T, V) of any float dtype, target (B, T)."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    return _SmoothedCrossEntropy.apply(flat_logits, target.reshape(-1), float(smoothing))


def teacher_forced_loss(model: torch.nn.Module, src: Tensor, tgt_in: Tensor, tgt_out: Tensor,
                        smoothing: float) -> tuple[Tensor, Tensor]:
    """A training step's forward: the teacher-forced pass src (B, S), tgt_in (B, T) -> logits
    (B, T, V) and their :func:`label_smoothed_loss` against tgt_out (B, T). One function, so
    that ``torch.compile`` traces forward and loss as one graph (``fullgraph=True``: no graph
    break in any registered variant) and AOTAutograd derives one backward graph for both."""
    return label_smoothed_loss(model(src, tgt_in), tgt_out, smoothing)

