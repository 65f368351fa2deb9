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
sums are in fp32 whatever the logits' dtype (bf16 under autocast).
"""

from __future__ import annotations

import torch
from torch import Tensor

PAD = 0


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float):
        # (N, V) in fp32 (a copy of bf16/fp16 logits); fp32/fp64 logits as they are
        x = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        lse = torch.logsumexp(x, dim=-1)  # (N,)
        keep = target.ne(PAD)
        nll_tokens = lse - x.gather(1, target[:, None]).squeeze(1)
        nll = nll_tokens.masked_fill(~keep, 0.0).sum()
        loss = nll.clone()  # a tensor of its own: nll is marked non-differentiable
        if smoothing:
            uniform = (lse - x.mean(dim=-1)).masked_fill(~keep, 0.0).sum()
            loss = (1.0 - smoothing) * nll + smoothing * uniform
        ctx.save_for_backward(x, lse, target, keep)
        ctx.smoothing = smoothing
        ctx.logits_dtype = logits.dtype
        ctx.own_copy = x is not logits  # then backward may overwrite it
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor):
        x, lse, target, keep = ctx.saved_tensors
        eps, vocab = ctx.smoothing, x.shape[-1]
        scale = (grad_loss * keep.to(x.dtype))[:, None]  # (N, 1): 0 on PAD rows
        # In place on the fp32 copy when there is one: every new (N, V) buffer costs a pass
        # of page faults on a CPU besides the arithmetic.
        grad = x.sub_(lse[:, None]) if ctx.own_copy else x - lse[:, None]
        grad.exp_().sub_(eps / vocab).mul_(scale)  # scale * (p - eps/V)
        grad.scatter_add_(1, target[:, None], scale * -(1.0 - eps))
        return grad.to(ctx.logits_dtype), None, None


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

