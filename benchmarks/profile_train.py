"""Where a CPU training step spends its time, in fp32 and in bf16: torch.profiler per op.

Builds ``small`` models (8k joint vocabulary, like the Multi30k grid), and times a full
optimizer step (forward, label-smoothed loss, backward, clipping-free AdamW update) on a
fixed synthetic batch of ``--sentences`` x ``--length`` tokens per side, each precision
mode side by side in this process (interleaved repetitions; medians), then profiles a few
steps of each and writes the per-op tables (self CPU time) to ``--out``.

Precision modes: ``fp32``; ``bf16-autocast`` (``torch.autocast("cpu", torch.bfloat16)``
around the forward); and ``bf16`` (what the trainer does: the same autocast with bf16
residual streams, ``ranmt.runtime.precision.bf16_activations``). ``--compile`` adds
``fp32-compiled`` and ``bf16-compiled``: the same steps with forward and loss through
``torch.compile`` as one graph (``fullgraph=True``, inductor; backward by AOTAutograd), as
``train.compile=true`` does; ``--bf16-weights`` adds ``bf16-weights`` (a bf16 compute copy of
fp32 master weights, ``ranmt.training.master``; compiled too with ``--compile``); the
one-off compile time (the warm-up steps) is printed apart. ``--fast-masks`` adds
``fp32+fast`` and ``bf16+fast``: the same steps with ``train.dropout_masks=fast``
(``ranmt.runtime.dropout``). All modes use the trainer's fused
loss (``ranmt.training.loss``) and, unless ``--default-allocator``, its malloc tuning
(``ranmt.runtime.memory``).

    python benchmarks/profile_train.py --arch transf ran-all --out docs/performance
    python benchmarks/profile_train.py --arch transf ran-all --compile --no-profile
    python benchmarks/profile_train.py --arch transf ran-all --fast-masks --no-profile
    python benchmarks/profile_train.py --device cuda --preset base --sentences 640 --out DIR
    python benchmarks/profile_train.py --device cuda --preset base --marian --no-profile

An ``--arch`` may carry model overrides after commas, so two settings of one variant run
side by side: ``--arch ran-all,model.ran.kernel=explicit ran-all,model.ran.kernel=sdpa``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ranmt.config import load_config
from ranmt.model import build_model
from ranmt.runtime.dropout import fast_masks
from ranmt.runtime.memory import retain_freed_memory
from ranmt.runtime.precision import PrecisionPolicy
from ranmt.training.loss import label_smoothed_loss, teacher_forced_loss
from ranmt.training.master import MasterWeights
from ranmt.training.train import allow_recompiles

MODES = ("fp32", "bf16-autocast", "bf16")
COMPILED_MODES = ("fp32-compiled", "bf16-compiled")
FAST_MASK_MODES = ("fp32+fast", "bf16+fast")
MARIAN_MODES = ("marian-fp32", "marian-bf16")
WEIGHTS_MODES = ("bf16-weights",)
COMPILED_WEIGHTS_MODES = ("bf16-weights-compiled",)


def marian_forward(model_config, device: torch.device):
    """A Hugging Face ``MarianMTModel`` shaped like ``model_config`` (a ranmt ``model``
    section), returned as ``forward(src, tgt_in) -> logits`` and its parameters.
    src: (B, S), tgt_in: (B, T) -> logits (B, T, V)."""
    from transformers import MarianMTModel

    from ranmt.inference.export import marian_config

    config = marian_config(model_config, dropout=model_config.dropout,
                           attn_implementation="sdpa")
    marian = MarianMTModel(config).to(device).train()

    def forward(src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        return marian(input_ids=src, attention_mask=src.ne(0),
                      decoder_input_ids=tgt_in).logits

    return forward, marian.parameters()


def model_overrides(arch: str, preset: str, vocab: int) -> dict[str, str]:
    """The config overrides of ``arch`` = ``NAME[,KEY=VALUE...]`` at ``preset`` with a
    joint vocabulary of ``vocab``."""
    name, *settings = arch.split(",")
    overrides = {"model.preset": preset, "model.arch": name,
                 "model.src_vocab_size": str(vocab), "model.tgt_vocab_size": str(vocab),
                 "model.joint_vocab": "true"}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise ValueError(f"--arch {arch}: '{setting}' is not KEY=VALUE")
        overrides[key] = value
    return overrides


def make_step(arch: str, mode: str, sentences: int, length: int, vocab: int, seed: int = 0,
              preset: str = "small", device: torch.device | None = None,
              backend: str = "inductor"):
    """A closure running one optimizer step of a fresh ``preset`` model in ``mode`` on
    ``device`` (on CUDA the step ends with a synchronize, so a wall clock times it);
    compiled modes through ``torch.compile`` with ``backend``."""
    device = device or torch.device("cpu")
    cfg = load_config(None, model_overrides(arch, preset, vocab))
    torch.manual_seed(seed)
    fast = mode.endswith("+fast")
    marian = mode.startswith("marian-")
    precision = mode.removesuffix("+fast").removesuffix("-compiled").removeprefix("marian-")
    if marian:  # plain autocast for bf16: Marian has no residual-stream option
        forward, parameters = marian_forward(cfg.model, device)
        precision = "bf16-autocast" if precision == "bf16" else precision
    else:
        model = build_model(cfg.model).to(device).train()
        parameters = model.parameters()
    policy = PrecisionPolicy(precision.removesuffix("-autocast"), device.type)
    masters = None
    if not marian and policy.weights_dtype is not None:  # bf16-weights: fp32 masters
        masters = MasterWeights(model, policy.weights_dtype)
        parameters = masters.parameters()
    if not marian:  # forward + loss, compiled as the trainer compiles them (one graph)
        compiled = mode.endswith("-compiled")
        loss_of = (torch.compile(teacher_forced_loss, fullgraph=True, dynamic=False,
                                 backend=backend) if compiled else teacher_forced_loss)

        def forward_loss(src, tgt_in, tgt_out):
            return loss_of(model, src, tgt_in, tgt_out, 0.1)[0]
    else:
        def forward_loss(src, tgt_in, tgt_out):
            return label_smoothed_loss(forward(src, tgt_in), tgt_out, 0.1)[0]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, betas=(0.9, 0.98),
                                  fused=policy.fused_optimizer or None)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (sentences, length), generator=gen)
    tgt = torch.randint(4, vocab, (sentences, length + 1), generator=gen)
    src, tgt = src.to(device), tgt.to(device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    # fp32, bf16: as the trainer runs them (ranmt.runtime.precision.PrecisionPolicy: on a CPU bf16
    # residual streams too); bf16-autocast: autocast alone
    plain_autocast = precision == "bf16-autocast"

    def context():
        if plain_autocast:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return policy.forward()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        if masters is not None:
            masters.zero_grad()
        with context(), fast_masks(fast):
            loss = forward_loss(src, tgt_in, tgt_out)
        (loss / tgt_out.numel()).backward()
        if masters is not None:
            masters.to_master()
        optimizer.step()
        if masters is not None:
            masters.to_model()
        return loss.item()  # .item() waits for the GPU

    return step


def time_modes(arch: str, modes: tuple[str, ...], args) -> tuple[dict[str, float], dict]:
    """Median seconds per step of each mode, repetitions interleaved across modes, and the
    seconds of each mode's two warm-up steps (a compiled mode compiles in them)."""
    steps = {mode: make_step(arch, mode, args.sentences, args.length, args.vocab,
                             preset=args.preset, device=torch.device(args.device))
             for mode in modes}
    warm_up = {}
    for mode, step in steps.items():  # warm-up (allocator, oneDNN kernels, compilation)
        start = time.perf_counter()
        step()
        step()
        warm_up[mode] = time.perf_counter() - start
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(values) for mode, values in seconds.items()}, warm_up


def profile_mode(arch: str, mode: str, args) -> str:
    device = torch.device(args.device)
    step = make_step(arch, mode, args.sentences, args.length, args.vocab, preset=args.preset,
                     device=device)
    step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
    return prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=args.rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all"])
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cpu", help="cpu | cuda (fp32 on CUDA uses TF32)")
    p.add_argument("--sentences", type=int, default=160)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--out", help="write the per-op tables here (profile_train_ARCH_MODE.txt)")
    p.add_argument("--no-profile", action="store_true", help="timings only")
    p.add_argument("--compile", action="store_true",
                   help="also time fp32 and bf16 steps through torch.compile")
    p.add_argument("--fast-masks", action="store_true",
                   help="also time fp32 and bf16 steps with train.dropout_masks=fast")
    p.add_argument("--bf16-weights", action="store_true",
                   help="also time train.precision=bf16-weights (a bf16 compute copy, fp32 "
                        "masters; compiled too with --compile)")
    p.add_argument("--marian", action="store_true",
                   help="also time Hugging Face MarianMTModel steps of the same shape "
                        "(fp32 and bf16 autocast, SDPA)")
    p.add_argument("--default-allocator", action="store_true",
                   help="leave glibc's malloc as it is (the trainer tunes it, "
                        "ranmt.runtime.memory)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="time only these of the modes the flags choose, e.g. fp32 fp32+fast "
                        "(bf16 on a CPU without native bf16 is ~30x slower than fp32)")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.default_allocator:
        retain_freed_memory()
    if args.device.startswith("cuda"):
        PrecisionPolicy("fp32", "cuda").configure_matmuls()  # TF32, as the trainer sets it
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch "
          f"{args.sentences} x {args.length} tokens per side, vocabulary {args.vocab}, "
          f"{'default' if args.default_allocator else 'tuned'} malloc")
    modes = (MODES + (COMPILED_MODES if args.compile else ())
             + (WEIGHTS_MODES if args.bf16_weights else ())
             + (COMPILED_WEIGHTS_MODES if args.bf16_weights and args.compile else ())
             + (FAST_MASK_MODES if args.fast_masks else ())
             + (MARIAN_MODES if args.marian else ()))
    if args.modes:
        unknown = set(args.modes) - set(modes)
        if unknown:
            p.error(f"--modes {sorted(unknown)}: not among {modes}")
        modes = tuple(m for m in modes if m in args.modes)
    if args.compile:  # every mode and arch compiles the same function: a graph each
        allow_recompiles(4 * len(modes) * len(args.arch))
    first, faster = modes[0], modes[1:]
    print("| arch | " + " | ".join(f"{m} s/step" for m in modes) + " | "
          + " | ".join(f"{m} / {first}" for m in faster) + " |")
    print("|---" * (1 + len(modes) + len(faster)) + "|")
    for arch in args.arch:
        t, warm_up = time_modes(arch, modes, args)
        print(f"| {arch} | " + " | ".join(f"{t[m]:.3f}" for m in modes) + " | "
              + " | ".join(f"{t[first] / t[m]:.2f}x" for m in faster) + " |")
        if args.compile:
            print(f"  {arch} warm-up (2 steps, compilation included): " + ", ".join(
                f"{m} {warm_up[m]:.1f} s" for m in modes))
        tokens = args.sentences * args.length  # target tokens a step (no padding)
        print(f"  {arch} target tokens/s: " + ", ".join(
            f"{m} {tokens / t[m]:,.0f}" for m in modes))
        if args.marian and not args.modes:
            print(f"  {arch} ranmt / Hugging Face Marian (same shape, same step): fp32 "
                  f"{t['marian-fp32'] / t['fp32']:.2f}x, bf16 "
                  f"{t['marian-bf16'] / t['bf16']:.2f}x")
    if args.no_profile:
        return
    for arch in args.arch:
        for mode in (m for m in MODES if m in modes):
            table = profile_mode(arch, mode, args)
            if args.out:
                path = Path(args.out) / f"profile_train_{arch}_{mode}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{arch}, {mode}, {args.profile_steps} steps of "
                                f"{args.sentences} x {args.length}, torch {torch.__version__}, "
                                f"{torch.get_num_threads()} threads\n{table}\n",
                                encoding="utf-8")
            else:
                print(f"\n{arch} {mode}\n{table}")


if __name__ == "__main__":
    main()
