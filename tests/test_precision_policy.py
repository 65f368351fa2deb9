"""The precision policy: what each precision means on each device, picked as documented for
a CPU without bf16, a CPU with bf16 and a CUDA GPU (capabilities faked), and one numeric
regime for the training step and validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ranmt.runtime.precision as precision_module
from conftest import tiny_model
from ranmt.data.corpus import EncodedSplit
from ranmt.runtime.precision import (
    CUDA_AUTO_REASON,
    CUDA_NO_BF16_REASON,
    PrecisionError,
    PrecisionPolicy,
    activation_dtype,
)
from ranmt.training.train import validate

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _fake_cpu(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(precision_module, "cpu_bf16_support",
                        lambda: (native, "the CPU has avx512_bf16" if native else "no bf16"))


def _fake_gpu(monkeypatch, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


def test_cpu_without_bf16(monkeypatch):
    _fake_cpu(monkeypatch, native=False)
    policy = PrecisionPolicy.resolve("auto", CPU)
    assert (policy.name, policy.autocast_dtype, policy.bf16_residual_stream) == \
        ("fp32", None, False)
    assert not policy.fused_optimizer and not policy.tf32 and "no bf16" in policy.describe()
    with pytest.raises(PrecisionError, match="no bf16"):
        PrecisionPolicy.resolve("bf16", CPU)


def test_cpu_with_bf16(monkeypatch):
    _fake_cpu(monkeypatch, native=True)
    for requested in ("auto", "bf16"):
        policy = PrecisionPolicy.resolve(requested, CPU)
        assert (policy.name, policy.autocast_dtype, policy.bf16_residual_stream) == \
            ("bf16", torch.bfloat16, True)
        assert not policy.fused_optimizer and "avx512_bf16" in policy.reason
    assert PrecisionPolicy.resolve("fp32", CPU).autocast_dtype is None


def test_cuda(monkeypatch):
    """auto on CUDA: bf16 autocast on a GPU with bf16 (measured faster than fp32/TF32),
    fp32 with TF32 on one without; bf16: plain autocast (fused SDPA kernels), no bf16
    residual stream; fused Adam either way."""
    _fake_gpu(monkeypatch, bf16=True)
    auto = PrecisionPolicy.resolve("auto", CUDA)
    assert (auto.name, auto.reason, auto.autocast_dtype, auto.bf16_residual_stream,
            auto.fused_optimizer) == ("bf16", CUDA_AUTO_REASON, torch.bfloat16, False, True)
    assert PrecisionPolicy.resolve("fp32", CUDA).tf32
    bf16 = PrecisionPolicy.resolve("bf16", CUDA)
    assert (bf16.name, bf16.autocast_dtype, bf16.bf16_residual_stream, bf16.fused_optimizer) \
        == ("bf16", torch.bfloat16, False, True)
    assert PrecisionPolicy.resolve("fp16", CUDA).loss_scaling
    _fake_gpu(monkeypatch, bf16=False)
    with pytest.raises(PrecisionError, match="without bf16"):
        PrecisionPolicy.resolve("bf16", CUDA)
    no_bf16 = PrecisionPolicy.resolve("auto", CUDA)
    assert (no_bf16.name, no_bf16.reason, no_bf16.tf32) == ("fp32", CUDA_NO_BF16_REASON, True)


def test_unknown_precision_is_an_error():
    with pytest.raises(PrecisionError):
        PrecisionPolicy("bf8", "cpu")
    with pytest.raises(PrecisionError):
        PrecisionPolicy.resolve("half", CPU)


def test_forward_context_on_a_cpu():
    model, _ = tiny_model()
    src = torch.tensor([[5, 6, 7, 3]])
    tgt_in = torch.tensor([[2, 8, 9]])
    for name, residual, logits_dtype in (("fp32", None, torch.float32),
                                         ("bf16", torch.bfloat16, torch.bfloat16)):
        with PrecisionPolicy(name, "cpu").forward():
            assert activation_dtype() == residual
            logits = model(src, tgt_in)
        assert logits.dtype == logits_dtype
    assert activation_dtype() is None


def test_validation_runs_in_the_training_regime():
    """bf16 training on a CPU has bf16 residual streams; validation must run the same
    regime (it once ran autocast alone, fp32 residual streams): the embedders' outputs seen
    during validate() are bf16 and its loss is the one computed in the policy's context."""
    model, cfg = tiny_model(**{"model.dropout": 0.0})
    rng = np.random.default_rng(0)
    valid = EncodedSplit([rng.integers(4, 40, size=n) for n in (5, 7, 4)],
                         [rng.integers(4, 40, size=n) for n in (6, 3, 5)])
    seen = []
    hook = model.encoder.embedder.register_forward_hook(
        lambda module, args, output: seen.append(output.dtype))
    policy = PrecisionPolicy("bf16", "cpu")
    result = validate(model, valid, cfg, CPU, policy, None, [])
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    fp32 = validate(model, valid, cfg, CPU, PrecisionPolicy("fp32", "cpu"), None, [])
    autocast_only = _loss_under_plain_autocast(model, valid, cfg)
    assert abs(result["valid_loss"] - fp32["valid_loss"]) > 1e-4
    # bf16 residual streams round differently from autocast alone: 3.4e-5 apart on an AMD
    # EPYC without native bf16 (emulated), more where oneDNN runs bf16 natively
    assert abs(result["valid_loss"] - autocast_only) > 1e-5
    assert abs(fp32["valid_loss"] - _loss_under_plain_autocast(model, valid, cfg, False)) < 1e-6


def _loss_under_plain_autocast(model, valid, cfg, enabled: bool = True) -> float:
    from ranmt.data.batching import batch_from_split
    from ranmt.training.loss import label_smoothed_loss

    batch = batch_from_split(valid, np.arange(len(valid)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        logits = model.eval()(batch.src, batch.tgt_in)
    loss, _ = label_smoothed_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
    return float(loss) / batch.target_tokens


def test_cuda_policy_turns_cudnn_attention_off_and_a_cpu_policy_leaves_it():
    """On CUDA, configure_matmuls leaves SDPA to flash / memory-efficient attention (cuDNN's
    plans per shape stall training on changing batch shapes); a CPU policy changes nothing."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        PrecisionPolicy("bf16", "cpu").configure_matmuls()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        PrecisionPolicy("bf16", "cuda").configure_matmuls()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
