"""CUDA correctness: the CPU invariants hold on a GPU, and a GPU run matches a CPU run.

Every test here is marked ``gpu`` and skips without CUDA (CI has none; ``pytest -m gpu``
on a machine with a GPU runs them). What they check:

- the forward pass of every architecture on CUDA equals the CPU's (same weights, fp32,
  TF32 off), and incremental decoding equals the full pass on CUDA;
- the fast search (static caches, tensorised beams) equals the reference search on CUDA,
  and beam 1 equals greedy; the search step replayed as a CUDA graph equals it eager;
- training on CUDA: deferred host reads give per-step reads' losses without a sync inside
  the steps, ``torch.compile`` gives eager's losses, a one-process ``torchrun``
  (NCCL) gives a plain run's weights, a checkpoint written on the GPU translates the
  same on the CPU, and bf16 decoding on the GPU agrees with fp32.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    assert_same_hypotheses,
    graphs_compiled,
    logged_losses,
    random_batch,
    tiny_model,
)
from ranmt.config import load_config
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator
from ranmt.training.train import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARCHS = ["transf", "ran-e", "ran-d", "ran-all", "syn-r", "hc-sa", "hc-all", "sh-x", "aan-d",
         "ssru-d"]
CROSS = ["concat-prev-context", "expand-kv", "coverage-subtract"]

TRAIN = {"model.preset": "tiny", "model.dropout": "0.0", "train.lr": "0.003",
         "train.warmup_steps": "10", "train.seed": "3", "train.progress": "false",
         "train.tensorboard": "false", "train.validate_bleu": "false",
         "data.max_tokens": "300", "train.log_every": "1", "train.device": "cuda",
         "train.precision": "fp32"}


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 products in full fp32 (no TF32) while a test compares with the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _valid_loss(run) -> float:
    """The validation loss of the last ``validate step`` line of a run's train.log."""
    lines = [line for line in (run / "train.log").read_text().splitlines()
             if line.startswith("validate step")]
    return float(lines[-1].split("valid_loss ")[1].split(",")[0])


@pytest.mark.parametrize("overrides", [{"model.arch": arch} for arch in ARCHS]
                         + [{"model.decoder.cross_attention": cross} for cross in CROSS],
                         ids=ARCHS + CROSS)
def test_forward_on_cuda_equals_cpu(overrides):
    model, _ = tiny_model(**overrides)
    src, tgt = random_batch(batch=4, src_len=9, tgt_len=7)
    with torch.no_grad():
        on_cpu = model(src, tgt)  # (B, T, V)
        on_gpu = model.cuda()(src.cuda(), tgt.cuda()).cpu()
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["ran-all", "syn-r"])
def test_fused_bias_kernel_on_cuda_equals_explicit_on_cpu(arch):
    """Training mode on CUDA takes the matrix + padding as one bias into
    scaled_dot_product_attention (``model.ran.kernel=auto``); its outputs and gradients are
    the CPU's explicit softmax path's (dropout off, fp32, TF32 off), padded sources."""
    results = []
    for device in ("cpu", "cuda"):
        model, _ = tiny_model(**{"model.arch": arch, "model.dropout": "0.0",
                                 "model.ran.attention_dropout": "0.0",
                                 "model.synthesizer.attention_dropout": "0.0"})
        model.to(device).train()
        src, tgt = (t.to(device) for t in random_batch(batch=4, src_len=9, tgt_len=7))
        logits = model(src, tgt)  # (B, T, V)
        logits.log_softmax(-1)[..., 5].sum().backward()
        results.append((logits.detach().cpu(), [p.grad.cpu() for p in model.parameters()
                                                if p.grad is not None]))
    (cpu_logits, cpu_grads), (gpu_logits, gpu_grads) = results
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-4, rtol=1e-4)
    for got, expected in zip(gpu_grads, cpu_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_equals_full_forward_on_cuda(arch):
    model, _ = tiny_model(**{"model.arch": arch})
    model = model.cuda()
    src, tgt = (t.cuda() for t in random_batch())
    with torch.no_grad():
        full = torch.log_softmax(model(src, tgt), -1)  # (B, T, V)
        memory, pad_mask, _ = model.encode(src)
        cache = model.init_cache(memory, pad_mask)
        steps = [model.decode_step(tgt[:, t: t + 1], cache) for t in range(tgt.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-sa", "syn-r"])
def test_fast_search_equals_reference_on_cuda(arch):
    model, _ = tiny_model(seed=1, **{"model.arch": arch})
    model = model.cuda()
    src, _ = random_batch(batch=6, src_len=9, seed=1)
    src = src.cuda()
    with torch.no_grad():
        for beam in (1, 4):
            fast = search(model, src, beam=beam, lenpen=0.6, lenpen_style="gnmt", max_len_a=1.2,
                          max_len_b=6, nbest=beam)
            reference = search(model, src, beam=beam, lenpen=0.6, lenpen_style="gnmt",
                               max_len_a=1.2, max_len_b=6, nbest=beam,
                               reference=True)
            assert_same_hypotheses(fast, reference, 1e-4)
        greedy = search(model, src, beam=1, lenpen=0.6, lenpen_style="gnmt", max_len_a=1.2,
                        max_len_b=6)
        on_cpu = search(model.cpu(), src.cpu(), beam=1, lenpen=0.6, lenpen_style="gnmt",
                        max_len_a=1.2, max_len_b=6)
    assert [hyps[0][0] for hyps in greedy] == [hyps[0][0] for hyps in on_cpu]


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-all"])
def test_sync_free_search_on_cuda_equals_shrinking_and_does_not_sync(arch):
    """On CUDA the search picks the sync-free mode by itself; it equals the shrinking
    search and reads device values on the host only every check_every steps."""
    from ranmt.runtime.host_syncs import SyncCounter

    model, _ = tiny_model(seed=2, **{"model.arch": arch})
    model = model.cuda()
    src = random_batch(batch=6, src_len=9, seed=2)[0].cuda()
    for beam in (1, 4):
        assert_same_hypotheses(search(model, src, beam=beam, nbest=beam),
                               search(model, src, beam=beam, nbest=beam, sync_free=False), 1e-4)
        counts = []
        for length in (16, 48):
            with SyncCounter() as counter:
                search(model, src, beam=beam, fixed_length=length, check_every=64)
            counts.append(counter.total)
        assert counts[0] == counts[1], counts  # no sync inside the 32 extra steps


@pytest.mark.parametrize("arch", ["transf", "ran-all", "hc-sa", "syn-r"])
def test_cuda_graph_decoding_equals_eager(arch, monkeypatch):
    """The search step recorded as a CUDA graph and replayed (``search(cuda_graphs=True)``)
    gives the eager sync-free search's hypotheses and scores, greedy and beam, and the
    graph was recorded (not an eager fallback)."""
    from ranmt.inference import graphs

    made = []

    class Noting(graphs.RecordedStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("ranmt.inference.decode.RecordedStep", Noting)
    model, _ = tiny_model(seed=4, **{"model.arch": arch})
    model = model.cuda()
    src = random_batch(batch=6, src_len=9, seed=4)[0].cuda()
    for beam in (1, 4):
        for fixed in (None, 20):
            assert_same_hypotheses(
                search(model, src, beam=beam, nbest=beam, fixed_length=fixed, cuda_graphs=True),
                search(model, src, beam=beam, nbest=beam, fixed_length=fixed, sync_free=True),
                1e-4)
    # the eager searches (graphs=False) make steps too, with recording off
    recording = [step for step in made if step.record]
    assert recording and all(step.recorded for step in recording)


def test_resume_on_cuda_restores_the_cuda_generator(reverse_data, tmp_path):
    """With dropout on CUDA, a run stopped at step 6 and resumed to 12 logs the losses of the
    uninterrupted run: the checkpoint saved the CUDA generator and the resume restored it
    (without it, steps 7-12 would draw other dropout masks)."""
    from ranmt.checkpoint import load_training_state

    values = {**TRAIN, "model.dropout": "0.3", "train.max_steps": "12"}
    train(load_config(None, values), reverse_data, tmp_path / "straight")
    train(load_config(None, {**values, "train.max_steps": "6"}), reverse_data,
          tmp_path / "split")
    _, extra = load_training_state(tmp_path / "split/checkpoints/step_00000006")
    assert "cuda_rng" in extra and "cpu_rng" in extra
    summary = train(load_config(None, values), reverse_data, tmp_path / "split")
    assert summary["resumed_from_step"] == 6
    straight, split = logged_losses(tmp_path / "straight"), logged_losses(tmp_path / "split")
    assert len(straight) == len(split) == 12
    assert split[6:] == pytest.approx(straight[6:], rel=1e-4)


def test_deferred_host_reads_on_cuda(reverse_data, tmp_path):
    """On CUDA the trainer reads losses at log steps only (train.host_reads=auto): the
    losses of per-step reads, and no host read inside the steps between log steps."""
    from ranmt.runtime.host_syncs import SyncCounter

    values = {**TRAIN, "train.max_steps": "20", "train.log_every": "10"}
    train(load_config(None, {**values, "train.host_reads": "step"}), reverse_data,
          tmp_path / "step")
    train(load_config(None, values), reverse_data, tmp_path / "auto")
    assert "host reads losses every 10" in (tmp_path / "auto/train.log").read_text()
    assert logged_losses(tmp_path / "auto") == pytest.approx(logged_losses(tmp_path / "step"),
                                                             rel=2e-3)
    counts = []
    for steps in (10, 20):
        with SyncCounter() as counter:
            train(load_config(None, {**values, "train.max_steps": str(steps),
                                     "train.log_every": "1000"}), reverse_data,
                  tmp_path / f"count{steps}")
        counts.append(counter.total)
    assert counts[0] == counts[1], counts

def test_compiled_training_on_cuda_gives_eager_losses(reverse_data, tmp_path):
    # no dropout anywhere: Inductor draws its masks from another generator than eager
    values = {**TRAIN, "model.arch": "ran-all", "model.ran.attention_dropout": "0.0",
              "train.max_steps": "6"}
    assert graphs_compiled(
        lambda: train(load_config(None, values), reverse_data, tmp_path / "eager")) == 0
    assert graphs_compiled(lambda: train(load_config(None, {**values, "train.compile": "true"}),
                                         reverse_data, tmp_path / "compiled")) >= 1
    eager, compiled = logged_losses(tmp_path / "eager"), logged_losses(tmp_path / "compiled")
    assert len(eager) == 6
    assert compiled == pytest.approx(eager, rel=2e-3)  # TF32 products in both


def test_bf16_compiled_training_on_cuda_matches_fp32_eager(reverse_data, tmp_path):
    """bf16 autocast through torch.compile learns as well as fp32 eager in 60 steps."""
    values = {**TRAIN, "model.arch": "ran-all", "train.max_steps": "60",
              "train.validate_every": "60", "train.log_every": "20"}
    fp32 = train(load_config(None, values), reverse_data, tmp_path / "fp32")
    bf16 = train(load_config(None, {**values, "train.precision": "bf16",
                                    "train.compile": "true"}), reverse_data, tmp_path / "bf16")
    assert fp32["steps"] == 60
    assert bf16["steps"] == 60 and bf16["nonfinite_skipped"] == 0
    assert _valid_loss(tmp_path / "bf16") == pytest.approx(_valid_loss(tmp_path / "fp32"),
                                                           rel=0.05)


def test_one_process_torchrun_on_cuda_equals_a_plain_run(reverse_data, tmp_path):
    """torchrun with one process joins an NCCL group and wraps the model in DDP; the
    weights after 4 steps must be a plain run's (DDP with one rank averages nothing)."""
    overrides = [f"{key}={value}" for key, value in {**TRAIN, "train.max_steps": "4",
                                                     "train.validate_every": "4"}.items()]
    for name, launcher in (("plain", [sys.executable]),
                           ("torchrun", [sys.executable, "-m", "torch.distributed.run",
                                         "--standalone", "--nproc-per-node=1"])):
        result = subprocess.run(launcher + ["-m", "ranmt", "train", "--data", str(reverse_data),
                                            "--out", str(tmp_path / name), *overrides],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    plain = load_file(str(tmp_path / "plain/checkpoints/step_00000004/model.safetensors"))
    ddp = load_file(str(tmp_path / "torchrun/checkpoints/step_00000004/model.safetensors"))
    assert plain.keys() == ddp.keys()
    for key in plain:
        torch.testing.assert_close(ddp[key], plain[key], atol=1e-5, rtol=1e-4, msg=key)


def test_checkpoint_trained_on_cuda_translates_alike_on_cpu(reverse_data, tmp_path):
    values = {**TRAIN, "model.arch": "ran-all", "train.max_steps": "150",
              "train.log_every": "50"}
    train(load_config(None, values), reverse_data, tmp_path / "run")
    sources = ["a b c d", "p o n m l", "e f g h i j k"]
    torch.backends.cuda.enable_cudnn_sdp(True)  # the trainer turned it off
    on_gpu = Translator.load(tmp_path / "run", device="cuda", beam=4)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # a plan per key length otherwise
    on_cpu = Translator.load(tmp_path / "run", device="cpu", beam=4)
    in_bf16 = Translator.load(tmp_path / "run", device="cuda", beam=4, precision="bf16")
    gpu_out = on_gpu.translate(sources)
    assert gpu_out == on_cpu.translate(sources)
    # bf16 decoding rounds the weights; on a model this sure of itself the words agree
    assert sum(a == b for a, b in zip(in_bf16.translate(sources), gpu_out)) >= 2
    assert next(on_gpu.model.parameters()).device.type == "cuda"
