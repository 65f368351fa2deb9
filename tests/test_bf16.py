"""bf16 training on a CPU: precision selection, every attention variant close to fp32 under
bf16, exact resume, fp32 master weights, and the fused loss against PyTorch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import random_batch, tiny_model
from ranmt.attention.registry import names_for
from ranmt.config import load_config
from ranmt.runtime import precision as precision_module
from ranmt.runtime.precision import (
    PrecisionError,
    bf16_activations,
    cpu_bf16_support,
    legacy_precision,
    resolve_precision,
)
from ranmt.training.loss import label_smoothed_loss
from ranmt.training.train import train

CPU = torch.device("cpu")
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE = "flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"
OLD = "flags\t\t: fpu sse2 avx2 fma\n"


def test_cpu_bf16_detection_from_the_flags():
    assert cpu_bf16_support(ZEN4) == (True, "the CPU has avx512_bf16")
    assert cpu_bf16_support(SAPPHIRE)[0] is True
    supported, reason = cpu_bf16_support(OLD)
    assert supported is False and "neither AVX512-BF16 nor AMX-BF16" in reason


@pytest.mark.parametrize(("native", "requested", "expected"), [
    (True, "auto", "bf16"), (False, "auto", "fp32"), (True, "bf16", "bf16"),
    (True, "fp32", "fp32"), (False, "fp32", "fp32"), (False, "fp16", "fp16"),
])
def test_precision_selection(monkeypatch, native, requested, expected):
    monkeypatch.setattr(precision_module, "cpu_bf16_support",
                        lambda: (native, "the CPU has avx512_bf16" if native else "no bf16"))
    resolved, reason = resolve_precision(requested, CPU)
    assert resolved == expected
    assert reason


def test_explicit_bf16_on_a_cpu_without_it_is_an_error(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (False, "no bf16 here"))
    with pytest.raises(PrecisionError, match="no bf16 here; use fp32"):
        resolve_precision("bf16", CPU)


def test_legacy_auto_was_fp32_on_a_cpu():
    assert legacy_precision("auto", CPU) == "fp32"
    assert legacy_precision("bf16", CPU) == "bf16"


def _variants() -> list[dict]:
    """Every attention of the registry in each place it can take."""
    both_names = set(names_for("encoder_self")) & set(names_for("decoder_self"))
    cross_names = sorted(names_for("cross"))
    variants = [{"model.encoder.self_attention": name, "model.decoder.self_attention": name}
                for name in sorted(both_names)]
    variants += [{"model.decoder.self_attention": name} for name in names_for("decoder_self")
                 if name not in both_names]
    variants += [{"model.decoder.cross_attention": name} for name in cross_names]
    return variants


def _loss_and_grads(model, src, tgt, bf16: bool):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks in both runs (RAN's, Syn-R's own dropout)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), bf16_activations(bf16):
        logits = model(src, tgt[:, :-1])
    loss, _ = label_smoothed_loss(logits, tgt[:, 1:], 0.1)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.item(), grads, logits.dtype


@pytest.mark.parametrize("overrides", _variants(), ids=lambda o: "-".join(o.values()))
def test_every_variant_trains_in_bf16_close_to_fp32(overrides):
    """Same weights, same batch, same dropout masks: the bf16 loss within 2% of fp32, the gradient
    finite and pointing the same way (cosine > 0.99, norm within 10%), the weights fp32."""
    model, _ = tiny_model(seed=3, **overrides)
    model.train()
    src, tgt = random_batch(batch=4, src_len=9, tgt_len=8, seed=3)
    loss32, grads32, _ = _loss_and_grads(model, src, tgt, bf16=False)
    loss16, grads16, dtype = _loss_and_grads(model, src, tgt, bf16=True)
    assert dtype == torch.bfloat16  # the model really ran in bf16
    assert torch.isfinite(grads16).all()
    assert loss16 == pytest.approx(loss32, rel=0.02)
    cosine = F.cosine_similarity(grads16.double(), grads32.double(), dim=0)
    assert float(cosine) > 0.99
    assert float(grads16.norm() / grads32.norm()) == pytest.approx(1.0, abs=0.1)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_fused_loss_equals_pytorchs_in_value_and_gradient():
    torch.manual_seed(0)
    target = torch.randint(0, 50, (3, 5))
    target[0, 3:] = 0  # padding
    for dtype in (torch.float32, torch.bfloat16):
        for eps in (0.0, 0.1):
            logits = torch.randn(3, 5, 50, dtype=dtype, requires_grad=True)
            loss, nll = label_smoothed_loss(logits, target, eps)
            (grad,) = torch.autograd.grad(loss, logits)
            reference = F.cross_entropy(logits.float().reshape(-1, 50), target.reshape(-1),
                                        ignore_index=0, label_smoothing=eps, reduction="sum")
            (expected,) = torch.autograd.grad(reference, logits)
            assert float(loss) == pytest.approx(float(reference), rel=1e-5)
            assert grad.dtype == dtype
            assert torch.allclose(grad.float(), expected.float(), atol=1e-6)
            assert not nll.requires_grad
    logits = torch.randn(4, 6, 30, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 30, (4, 6))
    assert torch.autograd.gradcheck(lambda x: label_smoothed_loss(x, target, 0.1)[0], (logits,))


def _cfg(**extra):
    values = {"model.preset": "tiny", "train.lr": 0.003, "train.warmup_steps": 20,
              "train.validate_every": 1000, "train.log_every": 1000, "train.progress": "false",
              "train.tensorboard": "false", "train.validate_bleu": "false",
              "data.max_tokens": 400, "train.precision": "bf16", "train.device": "cpu"}
    values.update({k: str(v) for k, v in extra.items()})
    return load_config(None, values)


@pytest.fixture()
def native_bf16(monkeypatch):
    """Let explicit bf16 run on any CPU (emulated where there is no native bf16)."""
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (True, "test"))


def test_bf16_resume_is_exact_and_keeps_fp32_weights(reverse_data, tmp_path, native_bf16):
    """12 steps at once == 6, stop, resume to 12, bit for bit; checkpoints hold fp32."""
    straight = train(_cfg(**{"train.max_steps": 12}), reverse_data, tmp_path / "straight")
    train(_cfg(**{"train.max_steps": 6}), reverse_data, tmp_path / "split")
    resumed = train(_cfg(**{"train.max_steps": 12}), reverse_data, tmp_path / "split")
    assert straight["precision"] == resumed["precision"] == "bf16"
    assert (resumed["resumed_from_step"], resumed["steps_this_run"]) == (6, 6)
    a = load_file(str(tmp_path / "straight/checkpoints/step_00000012/model.safetensors"))
    b = load_file(str(tmp_path / "split/checkpoints/step_00000012/model.safetensors"))
    for key in a:
        assert a[key].dtype == torch.float32, key
        assert torch.equal(a[key], b[key]), key


def test_a_run_resumes_in_the_precision_it_started_in(reverse_data, tmp_path, monkeypatch):
    """Started as auto on a bf16 CPU, resumed where auto would mean fp32: still bf16."""
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (True, "test"))
    train(_cfg(**{"train.max_steps": 4, "train.precision": "auto"}), reverse_data,
          tmp_path / "run")
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (False, "test"))
    summary = train(_cfg(**{"train.max_steps": 8, "train.precision": "auto"}), reverse_data,
                    tmp_path / "run")
    assert summary["precision"] == "bf16"
    log = (tmp_path / "run/train.log").read_text()
    assert "precision bf16 (as the run started)" in log


# ------------------------------------------------------------------------------ decoding

DECODERS = ([{"model.decoder.self_attention": name} for name in names_for("decoder_self")]
            + [{"model.decoder.cross_attention": name} for name in names_for("cross")
               if name != "dot"])


@pytest.mark.parametrize("overrides", DECODERS, ids=lambda o: "-".join(o.values()))
def test_bf16_fast_decoding_equals_the_bf16_reference(overrides):
    """The fast decoder in bf16 (packed bf16 linears, static caches) against the reference
    path in bf16: the same hypotheses, scores within bf16 rounding."""
    from ranmt.inference.decode import search

    model, _ = tiny_model(seed=5, **overrides)
    model = model.to(torch.bfloat16)
    src, _ = random_batch(batch=4, seed=5)
    for beam in (1, 3):
        fast = search(model, src, beam=beam, max_len_a=1.0, max_len_b=4, nbest=beam)
        reference = search(model, src, beam=beam, max_len_a=1.0, max_len_b=4, nbest=beam,
                           reference=True)
        agree = sum(f[0][0] == r[0][0] for f, r in zip(fast, reference))
        assert agree >= 3  # bf16 ties may break differently in a rare row
        for f, r in zip(fast, reference):
            if f[0][0] == r[0][0]:
                assert f[0][1] == pytest.approx(r[0][1], rel=0.01, abs=0.02)


def test_bf16_translator_needs_native_bf16_and_no_int8(runs, monkeypatch):
    from ranmt.inference.translator import Translator

    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (False, "no bf16 here"))
    with pytest.raises(ValueError, match="no bf16 here"):
        Translator.load(runs["transf"], device="cpu", precision="bf16")
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: (True, "test"))
    with pytest.raises(ValueError, match="alternatives"):
        Translator.load(runs["transf"], device="cpu", precision="bf16", quantize="int8")
    translator = Translator.load(runs["transf"], device="cpu", precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in translator.model.parameters())
    out = translator.translate(["a b c", ""])
    assert len(out) == 2 and out[1] == ""
    scores = translator.score(["a b c"], ["c b a"])
    assert scores[0] is not None and scores[0].total < 0


def test_cpu_description_names_the_model_and_the_matrix_flags():
    """Benchmark records name the CPU and the flags that set bf16/int8 product speed."""
    intel = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
             "flags\t\t: fpu avx512f avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_int8\n")
    assert precision_module.cpu_description(intel) == (
        "Intel(R) Xeon(R) Processor; avx512_bf16 amx_bf16 avx512_vnni avx_vnni amx_int8")
    zen4 = "model name\t: AMD EPYC 9R14\n" + ZEN4.split("\n", 1)[1]
    assert precision_module.cpu_description(zen4) == "AMD EPYC 9R14; avx512_bf16 avx512_vnni"
    assert precision_module.cpu_description(OLD).endswith("; no bf16/VNNI/AMX flags")


def test_the_loss_of_bf16_logits_is_the_same_in_row_chunks(monkeypatch):
    """Chunks of 7 rows (of 30, the last short) give the loss, NLL and gradient of one pass
    over all rows, and no fp32 copy of all the logits is made (nor kept for backward)."""
    from ranmt.training import loss as loss_module

    torch.manual_seed(1)
    target = torch.randint(0, 50, (5, 6))
    target[1, 4:] = 0
    logits = torch.randn(5, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    whole, whole_nll = label_smoothed_loss(logits, target, 0.1)
    (whole_grad,) = torch.autograd.grad(whole, logits)
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)
    casts = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self: casts.append(self.shape[0]) or real_float(self))
    chunked, chunked_nll = label_smoothed_loss(logits, target, 0.1)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)
    assert torch.equal(chunked, whole) and torch.equal(chunked_nll, whole_nll)
    assert torch.equal(chunked_grad, whole_grad)
    assert max(casts) == 7 and sum(casts) == 2 * 30  # forward and backward, chunk by chunk
