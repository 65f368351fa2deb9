"""What a new batch shape costs each scaled dot-product attention kernel on a GPU.

Training batches change shape nearly every step (sentences x longest side). A kernel that
prepares itself per shape (cuDNN's attention builds an execution plan) pays that on every
new shape. For each SDPA backend this times, in bf16 with a key padding mask like the
model's, a forward + backward of ``--shapes`` new shapes (B, L) of about ``--tokens``
tokens each, first call and a repeated call, medians in milliseconds:

    python benchmarks/sdpa_shapes.py --device cuda

On a CPU only the math backend exists; the script says so and times it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ranmt.benchmark import synchronize

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def timed_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               device: torch.device) -> float:
    """Milliseconds of one forward + backward. q, k, v: (B, H, L, D); mask: (B, 1, 1, L)."""
    synchronize(device)
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    synchronize(device)
    return (time.perf_counter() - start) * 1000


def run(backend: str, args, device: torch.device) -> tuple[float, float]:
    """(median first-call ms, median repeat ms) over the shapes for ``backend``."""
    first, again = [], []
    gen = torch.Generator().manual_seed(0)
    for index in range(args.shapes):
        length = args.min_length + index  # a new (B, L) every time
        batch = max(1, args.tokens // length)
        q, k, v = (torch.randn(batch, args.heads, length, args.head_dim, generator=gen)
                   .to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
                   .requires_grad_() for _ in range(3))
        lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
        mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :].to(device)
        with sdpa_kernel(BACKENDS[backend]):
            first.append(timed_call(q, k, v, mask, device))
            again.append(timed_call(q, k, v, mask, device))
    return statistics.median(first), statistics.median(again)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", type=int, default=16)
    p.add_argument("--min-length", type=int, default=12)
    p.add_argument("--tokens", type=int, default=25000)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    backends = list(BACKENDS) if device.type == "cuda" else ["math"]
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
          + f", {args.shapes} shapes of ~{args.tokens} tokens, forward + backward")
    run(backends[-1], args, device)  # CUDA's lazy initialisation off the clock
    for backend in backends:
        try:
            first, again = run(backend, args, device)
        except RuntimeError as error:  # a backend this GPU / build lacks
            print(f"{backend:>10}: not available ({str(error).splitlines()[0][:80]})")
            continue
        print(f"{backend:>10}: first call on a new shape {first:8.2f} ms, "
              f"repeat {again:7.2f} ms (median)")


if __name__ == "__main__":
    main()
