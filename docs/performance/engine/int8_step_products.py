"""One-off micro-benchmark (issue 99, 2026-12-05): the thirteen int8 products of a student
decoder step (2 layers: fused q/k/v, self-attention out, cross-attention q and out, the
feed-forward pair; then the 8,000-row output layer) as torch._int_mm on distinct weights in
turn, at 1 and 32 rows, one thread. Printed: 94 us and 848 us a step on the 2-core AMD EPYC
Zen 4, torch 2.13.0 CPU.

    python docs/performance/engine/int8_step_products.py
"""

import time

import torch

SHAPES = [(256, 768), (256, 256), (256, 256), (256, 256), (256, 1536), (1536, 256)] * 2 \
    + [(256, 8000)]  # (in, out) of each product, in a step's order


def per_step(rows: int, weights: list[torch.Tensor], repeats: int) -> float:
    """Microseconds for one pass over every product at ``rows`` rows."""
    inputs = {k: torch.randint(-127, 127, (rows, k), dtype=torch.int8) for k in (256, 1536)}

    def step() -> None:
        for (width, _), weight in zip(SHAPES, weights):
            torch._int_mm(inputs[width], weight)

    for _ in range(20):
        step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(1)
    # (in, out) views of (out, in) int8 matrices, as Int8Linear stores them
    weights = [torch.randint(-127, 127, (n, k), dtype=torch.int8).t() for k, n in SHAPES]
    print(f"13 one-row int8 products (a decoder step's, distinct weights): "
          f"{per_step(1, weights, 500):.0f} us")
    print(f"the same at 32 rows: {per_step(32, weights, 200):.0f} us")


if __name__ == "__main__":
    main()
