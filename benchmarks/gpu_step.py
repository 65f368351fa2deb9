"""Issue 68's GPU measurements in one process, written as JSON: the bare training step
eager vs compiled, precisions, batch sizes, the ``big`` preset, Hugging Face Marian's step
and ``generate`` of the same shape, and the step's top kernels.

Sections (each a key of the JSON; ``--sections`` picks some):

* ``step``: one optimizer step (forward + label-smoothed loss + backward + AdamW, fused on
  CUDA) of a fresh model on a fixed batch of ``tokens / 25`` sentences x 25 tokens per side,
  for every arch x precision (fp32 = TF32 on CUDA, bf16 autocast, bf16-weights: a bf16
  compute copy of fp32 masters) x tokens, eager, and compiled (forward + loss as one graph,
  ``fullgraph=True``, as ``train.compile``) at ``--compiled-tokens`` (25k: each compiled
  row compiles); seconds per step (median of
  ``--repeats`` after two warm-up steps; compilation is in the warm-up, reported apart),
  target tokens/s and MFU = 6 x parameters x target tokens/s / the device's dense peak
  (bf16 peak for every precision, as issue 44 counted it; no peak known: null);
* ``big``: ``model.preset=big`` (Vaswani et al.'s big; MLPerf's Transformer), TransF bf16,
  eager and compiled, at the first token count;
* ``marian``: Hugging Face ``MarianMTModel`` of the same shape as ``base`` TransF (SDPA),
  its step in fp32 and bf16 autocast at the first token count;
* ``decode``: ranmt's search (fast path) against Marian's ``generate`` with the same
  weights (``ranmt.inference.export.build_marian``; post-norm TransF, as Marian), beam 4,
  a fixed output length of 30, batches of 1 / 32 / 100 sentences: target tokens/s of each
  and the ratio;
* ``profile``: the top-20 kernels (CUDA time on a GPU, CPU time elsewhere) of the bare
  bf16 TransF step, eager and compiled;
* ``ran_kernel``: RAN-ALL's bf16 step with ``model.ran.kernel=explicit`` (softmax, dropout
  and product apart), eager and compiled, at the first token count: against ``step``'s
  RAN-ALL rows, which take ``auto`` = the matrix and padding as one bias into
  ``scaled_dot_product_attention`` on CUDA (last: a time-out loses nothing else).

``--dry-run`` runs every section at test sizes (``tiny``, 2 repeats, 200 tokens, TransF only,
compiled rows through ``aot_eager``: Dynamo and AOTAutograd, no kernel generation) on the
device given (the CPU in CI, ``tests/test_gpu_step.py``), so a lent GPU's minutes go to
measuring. On a GPU (``benchmarks/gpu_session.sh issue68``):

    python benchmarks/gpu_step.py --device cuda --out $OUT/gpu_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ranmt.config import load_config
from ranmt.model import build_model, count_parameters
from ranmt.runtime.precision import PrecisionPolicy
from ranmt.training.train import allow_recompiles

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_train import make_step, model_overrides  # noqa: E402  (a sibling script)

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
"""Dense bf16 peak (FLOP/s) by a name in ``torch.cuda.get_device_name()``: NVIDIA's data
sheets (SXM parts)."""
SECTIONS = ("step", "big", "marian", "decode", "profile", "ran_kernel")


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def parameters_of(preset: str, arch: str, vocab: int) -> int:
    cfg = load_config(None, model_overrides(arch, preset, vocab))
    return count_parameters(build_model(cfg.model))["total"]


def time_step(step, repeats: int, device: torch.device) -> dict:
    """Warm-up (two steps: allocation, compilation) then the median of ``repeats`` steps."""
    start = time.perf_counter()
    step()
    step()
    warm_up = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()  # ends with .item(): waits for the device
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"seconds_per_step": statistics.median(seconds), "warm_up_seconds": warm_up}


def step_rows(args, preset: str, archs: list[str], precisions: list[str],
              token_counts: list[int], peak: float | None) -> list[dict]:
    device, rows = torch.device(args.device), []
    for arch in archs:
        params = parameters_of(preset, arch, args.vocab)
        for tokens in token_counts:
            for precision in precisions:
                for compiled in (False, True) if tokens in args.compiled_tokens else (False,):
                    mode = precision + ("-compiled" if compiled else "")
                    sentences = max(1, tokens // args.length)
                    try:
                        step = make_step(arch, mode, sentences, args.length, args.vocab,
                                         preset=preset, device=device, backend=args.backend)
                        row = time_step(step, args.repeats, device)
                    except Exception as err:  # noqa: BLE001 - a row says why it has no number
                        rows.append({"preset": preset, "arch": arch, "mode": mode,
                                     "tokens": tokens, "error": f"{type(err).__name__}: {err}"})
                        continue
                    tok_s = sentences * args.length / row["seconds_per_step"]
                    rows.append({"preset": preset, "arch": arch, "mode": mode, "tokens": tokens,
                                 "parameters": params, **row, "target_tokens_per_s": tok_s,
                                 "mfu": 6 * params * tok_s / peak if peak else None})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def marian_rows(args, tokens: int, peak: float | None) -> list[dict]:
    device, rows = torch.device(args.device), []
    params = parameters_of(args.preset, "transf", args.vocab)
    for mode in ("marian-fp32", "marian-bf16"):
        sentences = max(1, tokens // args.length)
        step = make_step("transf", mode, sentences, args.length, args.vocab,
                         preset=args.preset, device=device)
        row = time_step(step, args.repeats, device)
        tok_s = sentences * args.length / row["seconds_per_step"]
        rows.append({"preset": args.preset, "mode": mode, "tokens": tokens, **row,
                     "target_tokens_per_s": tok_s,
                     "mfu": 6 * params * tok_s / peak if peak else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_rows(args) -> list[dict]:
    """ranmt's fast search against Marian's generate, same weights, fixed length."""
    from ranmt.inference.decode import search
    from ranmt.inference.export import build_marian
    from ranmt.model import EOS_ID, PAD_ID

    device = torch.device(args.device)
    cfg = load_config(None, {"model.preset": args.preset, "model.arch": "transf",
                             "model.src_vocab_size": str(args.vocab),
                             "model.tgt_vocab_size": str(args.vocab),
                             "model.joint_vocab": "true", "model.norm": "post"})  # as Marian
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).eval()
    marian = build_marian(model, cfg).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.decode_batches:
        src = torch.randint(4, args.vocab, (batch, args.length), generator=gen)
        src[:, -1] = EOS_ID
        src = src.to(device)

        def ours(src=src):
            return search(model, src, beam=args.beam, fixed_length=args.decode_length)

        def theirs(src=src):  # new tokens: the fixed length, then the EOS Marian forces
            return marian.generate(input_ids=src, attention_mask=src.ne(PAD_ID),
                                   num_beams=args.beam, do_sample=False,
                                   min_new_tokens=args.decode_length,
                                   max_new_tokens=args.decode_length + 1)

        speeds = {}
        with torch.inference_mode():
            for name, run in (("ranmt", ours), ("marian", theirs)):
                run()  # warm-up
                start = time.perf_counter()
                for _ in range(args.repeats):
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds = (time.perf_counter() - start) / args.repeats
                speeds[name] = batch * (args.decode_length + 1) / seconds
        rows.append({"batch": batch, "beam": args.beam, "length": args.decode_length,
                     "tokens_per_s": speeds, "ranmt_over_marian": speeds["ranmt"] /
                     speeds["marian"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile_rows(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    precision = "bf16" if cuda else "fp32"
    tables = {}
    for mode in (precision, precision + "-compiled"):
        step = make_step("transf", mode, max(1, args.tokens[0] // args.length), args.length,
                         args.vocab, preset=args.preset, device=device, backend=args.backend)
        step()
        step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
        tables[mode] = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=20)
        print(tables[mode], flush=True)
    return tables


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu_step.json")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--preset", default="base")
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all"])
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16", "bf16-weights"])
    p.add_argument("--tokens", type=int, nargs="+", default=[25000, 50000, 100000])
    p.add_argument("--compiled-tokens", type=int, nargs="+", default=[25000],
                   help="token counts that also get compiled rows (each compiled row "
                        "compiles: ~30-60 s for base)")
    p.add_argument("--length", type=int, default=25)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--decode-length", type=int, default=30)
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 100])
    p.add_argument("--backend", default="inductor",
                   help="torch.compile's backend for the compiled rows")
    p.add_argument("--dry-run", action="store_true",
                   help="every section at test sizes (tiny preset, one token count, compiled "
                        "rows through aot_eager: no kernel generation), e.g. on the CPU")
    args = p.parse_args(argv)
    big = "big"
    if args.dry_run:
        args.preset, big, args.vocab, args.repeats = "tiny", "tiny", 200, 2
        args.tokens, args.length, args.decode_length = [200], 10, 5
        args.compiled_tokens = [200]
        args.backend, args.arch = "aot_eager", ["transf"]  # RAN-ALL: the same code
        args.decode_batches = [1, 4]
    device = torch.device(args.device)
    if device.type == "cuda":
        PrecisionPolicy("fp32", "cuda").configure_matmuls()  # TF32, as the trainer sets it
    allow_recompiles(256)  # every row compiles the same function once
    peak = peak_flops(device)
    result = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "peak_bf16_flops": peak, "dry_run": args.dry_run,
              "mfu_formula": "6 x parameters x target tokens/s / peak_bf16_flops"}
    sections = {
        "step": lambda: step_rows(args, args.preset, args.arch, args.precision, args.tokens,
                                  peak),
        "big": lambda: step_rows(args, big, ["transf"], ["bf16"], args.tokens[:1], peak),
        "marian": lambda: marian_rows(args, args.tokens[0], peak),
        "decode": lambda: decode_rows(args),
        "profile": lambda: profile_rows(args),
        "ran_kernel": lambda: step_rows(args, args.preset, ["ran-all,model.ran.kernel=explicit"],
                                        ["bf16"], args.tokens[:1], peak),
    }
    for name in args.sections:
        start = time.perf_counter()
        try:
            result[name] = sections[name]()
        except Exception as err:  # noqa: BLE001 - one failed section leaves the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        result[f"{name}_seconds"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
