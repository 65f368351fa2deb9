"""The compiled training step (issue 68, item 1): forward and loss trace as one graph with no
graph break for every family of attention, compile once per shape (not per batch), and
give eager's losses.

Dynamo's behaviour is what is tested here, so the graphs are counted with Dynamo's own
``explain`` and a counting backend (``CompileCounter``: no kernels are generated, which
keeps the tests to seconds); ``tests/test_shape_buckets.py`` runs the same step through
Inductor over an epoch of bucketed batches against eager losses.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from conftest import tiny_model
from ranmt.training.loss import teacher_forced_loss

VOCAB = 40
# One of each family: dot product, RAN (learned matrices refined up the stack, both
# stacks; either kernel), hard-coded Gaussian, and a recurrent cross-attention (a loop over
# target steps).
VARIANTS = {
    "transf": {"model.arch": "transf"},
    "ran-all": {"model.arch": "ran-all"},
    # the matrix + padding as one bias into scaled_dot_product_attention (CUDA's default)
    "ran-all-sdpa": {"model.arch": "ran-all", "model.ran.kernel": "sdpa"},
    "hc-sa": {"model.arch": "hc-sa"},
    "concat-prev-context": {"model.arch": "transf",
                            "model.decoder.cross_attention": "concat-prev-context"},
}


def _batch(sentences: int, length: int, seed: int):
    """src (B, S) with some padding, tgt_in / tgt_out (B, S) shifted, PAD-padded alike."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, VOCAB, (sentences, length), generator=gen)
    tgt = torch.randint(4, VOCAB, (sentences, length + 1), generator=gen)
    cut = torch.randint(length // 2, length + 1, (sentences,), generator=gen)
    keep = torch.arange(length)[None, :] < cut[:, None]
    src = src.masked_fill(~keep, 0)
    tgt_in, tgt_out = tgt[:, :-1].masked_fill(~keep, 0), tgt[:, 1:].masked_fill(~keep, 0)
    return src, tgt_in, tgt_out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_and_loss_trace_as_one_graph_without_breaks(variant):
    model, _ = tiny_model(seed=0, **VARIANTS[variant])
    model.train()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(teacher_forced_loss)(model, *_batch(3, 7, 0), 0.1)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("variant", ["transf", "ran-all"])
def test_one_graph_per_shape_and_no_recompile_per_batch(variant):
    """Batches of two shapes, three batches each with different padding and content (and a
    second model of the same variant, as a benchmark building several): two graphs, whatever
    the batches hold; the losses and gradients those graphs give are eager's."""
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(teacher_forced_loss, backend=counter, fullgraph=True, dynamic=False)
    for model_seed in (0, 1):
        model, _ = tiny_model(seed=model_seed, **VARIANTS[variant])
        model.train()
        for shape in ((4, 8), (2, 16)):
            for seed in range(3):
                batch = _batch(*shape, seed)
                torch.manual_seed(seed)
                loss, nll = step(model, *batch, 0.1)
                loss.backward()
                compiled_grads = [p.grad.clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                eager_loss, eager_nll = teacher_forced_loss(model, *batch, 0.1)
                eager_loss.backward()
                torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(nll, eager_nll, rtol=1e-5, atol=1e-5)
                for got, expected in zip(compiled_grads, model.parameters()):
                    torch.testing.assert_close(got, expected.grad, rtol=1e-4, atol=1e-5)
                model.zero_grad(set_to_none=True)
    assert counter.frame_count == 2
