"""One-off experiment (issue 99, 2026-12-05): the SHRINKING search (the CPU default) with
the model's decoder step compiled with dynamic shapes (rows leave the batch, the history
grows), against the same search eager, on the trained int8 student: real outputs with
ranmt's own length limit, greedy, batch 32, one thread, best of 3 alternating rounds.
Not a maintained benchmark; the output beside it is what the note reports.

    python docs/performance/engine/compiled_shrinking_step.py RUN DATA
"""

import sys
import time

import torch

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description

torch.set_num_threads(1)
run, data = sys.argv[1], sys.argv[2]
translator = Translator.load(run, device="cpu", quantize="int8")
model = translator.model
ids = sorted(translator.src_vocab.encode(raw_text(data, "test_2016_flickr", "src")[:320]), key=len)
batches = [pad_sources(ids[i: i + 32]) for i in range(0, len(ids), 32)]
eager_step = model.decode_step
compiled_step = torch.compile(eager_step, dynamic=True, options={"freezing": True})


def decode(step) -> tuple[list, float]:
    model.decode_step = step
    start = time.perf_counter()
    with torch.inference_mode():
        hyps = [h[0][0] for src in batches for h in search(model, src, beam=1)]
    return hyps, time.perf_counter() - start


decode(eager_step)
_, first = decode(compiled_step)
print(f"{cpu_description()}, torch {torch.__version__}: first compiled pass {first:.1f} s")
best = {"eager": float("inf"), "compiled": float("inf")}
outputs = {}
for round_index in range(3):
    for name in (["eager", "compiled"] if round_index % 2 == 0 else ["compiled", "eager"]):
        outputs[name], seconds = decode(eager_step if name == "eager" else compiled_step)
        best[name] = min(best[name], seconds)
tokens = sum(len(h) + 1 for h in outputs["eager"])
same = sum(a == b for a, b in zip(outputs["eager"], outputs["compiled"]))
for name, seconds in best.items():
    print(f"  {name:9s} {tokens / seconds:8,.0f} tok/s  {best['eager'] / seconds:.2f}x eager")
print(f"  identical outputs: {same}/{len(outputs['eager'])}")
