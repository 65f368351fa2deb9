"""One-off micro-benchmark (issue 99, 2026-12-05): the thirteen int8 products of a student
decoder step (2 layers: fused q/k/v, self-attention out, cross-attention q and out, the
feed-forward pair; then the 8,000-row output layer) as torch._int_mm on distinct weights in
turn, at 1 and 32 rows, one thread. Printed: 94 us and 848 us a step on the 2-core AMD EPYC
Zen 4, torch 2.13.0 CPU.

    python docs/performance/engine/int8_step_products.py
"""

import time

import torch

torch.set_num_threads(1)
shapes = [(256, 768), (256, 256), (256, 256), (256, 256), (256, 1536), (1536, 256)] * 2 + [(256, 8000)]
ws = [torch.randint(-127, 127, (n, k), dtype=torch.int8).t() for k, n in shapes]  # (K, N) col-major views
xs = {k: torch.randint(-127, 127, (1, k), dtype=torch.int8) for k in (256, 1536)}
def step():
    for (k, n), w in zip(shapes, ws):
        torch._int_mm(xs[k], w)
for _ in range(20): step()
t = time.perf_counter()
for _ in range(500): step()
print(f"13 one-row int8 products (a decoder step's, distinct weights): {(time.perf_counter()-t)/500*1e6:.0f} us")
x32 = {k: torch.randint(-127, 127, (32, k), dtype=torch.int8) for k in (256, 1536)}
def step32():
    for (k, n), w in zip(shapes, ws):
        torch._int_mm(x32[k], w)
for _ in range(20): step32()
t = time.perf_counter()
for _ in range(200): step32()
print(f"the same at 32 rows: {(time.perf_counter()-t)/200*1e6:.0f} us")
