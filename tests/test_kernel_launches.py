"""Kernel launches of a training step (issue 44, item 3): what a launch-bound GPU step pays.

Counted on the CPU by dispatched aten operator (``benchmarks/count_ops.py``): the counts
are the same on any device. A full pass makes one product for the self-attention's Q, K, V
and one for the cross-attention's K, V; masks (and HC-SA's Gaussian weights) are built once
per pass and shared by the layers (``ranmt.attention.base.PassMasks``); and neither
changes what the model computes.
"""

from __future__ import annotations

import pytest
import torch

from ranmt.attention import base
from ranmt.attention.dot_product import DotProductAttention
from ranmt.config import load_config
from ranmt.model import build_model
from ranmt.runtime.host_syncs import OpCounter

VOCAB = 40


def _model(arch: str, layers: int, seed: int = 0):
    cfg = load_config(None, {"model.preset": "tiny", "model.arch": arch,
                             "model.encoder.layers": str(layers),
                             "model.decoder.layers": str(layers),
                             "model.src_vocab_size": str(VOCAB),
                             "model.tgt_vocab_size": str(VOCAB), "model.joint_vocab": "true"})
    torch.manual_seed(seed)
    return build_model(cfg.model)


def _batch():
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, VOCAB, (3, 7), generator=gen)
    src[0, 5:] = 0  # padding (PAD_ID 0) in one sentence
    tgt = torch.randint(4, VOCAB, (3, 6), generator=gen)
    return src, tgt


def _forward_ops(model, train: bool = True):
    src, tgt = _batch()
    model.train(train)
    with OpCounter() as ops, torch.set_grad_enabled(train):
        model(src, tgt)
    return ops.names


@pytest.mark.parametrize("layers", [2, 3])
def test_a_training_pass_makes_one_product_for_qkv_and_one_for_kv(layers):
    ops = _forward_ops(_model("transf", layers))
    # encoder layer: QKV, out, 2 FFN; decoder layer: QKV, out, Q, KV, out, 2 FFN
    assert ops["addmm"] == 4 * layers + 7 * layers


def test_masks_are_built_once_per_pass_whatever_the_depth():
    shallow, deep = _forward_ops(_model("transf", 2)), _forward_ops(_model("transf", 4))
    for name in ("bitwise_not", "arange", "le", "masked_fill_", "where", "scalar_tensor"):
        assert shallow[name] == deep[name], name
    assert deep["bitwise_not"] <= 3 and deep["arange"] == 2


def test_hard_coded_weights_are_built_once_per_pass_and_role():
    shallow, deep = _forward_ops(_model("hc-sa", 2)), _forward_ops(_model("hc-sa", 4))
    assert shallow["exp"] == deep["exp"] == 2  # encoder self, decoder self


def test_masks_are_shared_within_a_pass_only():
    """Two passes over batches with different padding: each gets its own masks (a mask of
    the first pass reused by the second would give the second the first's logits)."""
    model = _model("transf", 2).eval()
    src, tgt = _batch()
    other = src.clone()
    other[1, 4:] = 0  # more padding in another sentence
    with torch.no_grad():
        model(src, tgt)
        shared = model(other, tgt)
        base.PassMasks.share = False
        try:
            plain = model(other, tgt)
        finally:
            base.PassMasks.share = True
    torch.testing.assert_close(shared, plain)


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-sa"])
@pytest.mark.parametrize("train", [True, False])
def test_fused_projections_and_shared_masks_compute_what_the_plain_model_does(
        arch, train, monkeypatch):
    """Logits, loss and every gradient equal those of the model with separate projections and
    masks built per layer (the path before the change)."""
    src, tgt = _batch()

    def run():
        model = _model(arch, 2, seed=3).train(train)
        logits = model(src, tgt)
        if not train:
            return logits.detach(), []
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(5)
    fused_logits, fused_grads = run()
    monkeypatch.setattr(base.PassMasks, "share", False)
    monkeypatch.setattr(
        DotProductAttention, "_full_pass_projection",
        lambda self, x, name, projections: [p(x) for p in projections])
    torch.manual_seed(5)
    plain_logits, plain_grads = run()
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert len(fused_grads) == len(plain_grads)
    for fused, plain in zip(fused_grads, plain_grads):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
