"""Training step time with the full pass's fused projections and shared masks against the
same model without them (one Q/K/V product per projection, masks built in every layer),
interleaved in one process so that the machine's drift falls on both alike.

The change cuts the kernels a step launches (``benchmarks/count_ops.py``), which is what a
launch-bound GPU step pays for; on a CPU it must at least not cost time. Each repetition
times one optimizer step (forward, the trainer's loss, backward, Adam) of each variant of
the code in turn; medians and their ratio are printed.

    python benchmarks/fused_projections.py --arch transf ran-all hc-sa --preset small
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from ranmt.attention import base, dot_product
from ranmt.config import load_config
from ranmt.model import build_model
from ranmt.runtime.precision import PrecisionPolicy, bf16_activations
from ranmt.training.loss import label_smoothed_loss


@contextlib.contextmanager
def plain_full_pass():
    """Within: separate Q/K/V products and masks built per layer (the code before)."""
    saved = dot_product.DotProductAttention._full_pass_projection
    base.PassMasks.share = False
    dot_product.DotProductAttention._full_pass_projection = (
        lambda self, x, name, projections: [p(x) for p in projections])
    try:
        yield
    finally:
        base.PassMasks.share = True
        dot_product.DotProductAttention._full_pass_projection = saved


def step_times(arch: str, args) -> dict[str, list[float]]:
    cfg = load_config(None, {"model.preset": args.preset, "model.arch": arch,
                             "model.src_vocab_size": str(args.vocab),
                             "model.tgt_vocab_size": str(args.vocab),
                             "model.joint_vocab": "true"})
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    policy = PrecisionPolicy(args.precision, "cpu")
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(4, args.vocab, (args.sentences, args.length), generator=gen)
    tgt = torch.randint(4, args.vocab, (args.sentences, args.length + 1), generator=gen)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=policy.autocast_dtype,
                            enabled=policy.autocast_dtype is not None), \
                bf16_activations(policy.bf16_residual_stream):
            logits = model(src, tgt[:, :-1])
        loss, _ = label_smoothed_loss(logits, tgt[:, 1:], 0.1)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"fused": [], "plain": []}
    for repeat in range(args.repeats + 1):
        for name in ("fused", "plain"):
            with plain_full_pass() if name == "plain" else contextlib.nullcontext():
                seconds = step()
            if repeat:  # the first round warms up
                times[name].append(seconds)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all", "hc-sa"])
    p.add_argument("--preset", default="small")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--sentences", type=int, default=160)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.preset}, "
          f"{args.precision}, batch {args.sentences} x {args.length} tokens per side")
    print("| arch | fused s/step | plain s/step | plain / fused |")
    print("| --- | ---: | ---: | ---: |")
    for arch in args.arch:
        times = step_times(arch, args)
        fused, plain = statistics.median(times["fused"]), statistics.median(times["plain"])
        print(f"| {arch} | {fused:.3f} | {plain:.3f} | {plain / fused:.2f}x |")


if __name__ == "__main__":
    main()
