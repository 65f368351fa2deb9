"""One-off probe (issue 99, 2026-12-05, night): the server's step-level decoder
(``ContinuousDecoder``, eager today) with ``model.decode_step`` wrapped in
``torch.compile(dynamic=True)`` (graph breaks allowed; ``dynfrz``: with freezing), on the
trained int8 TransF student, greedy, one thread: 40 lines one at a time (each decoded
alone, a server at low load) and 60 lines queued at once (a burst). Not a maintained
benchmark: it asks whether compiling the continuous decoder's step as it stands is worth
an option, before a static-slot design. Output: continuous_compiled_probe.txt.

    python docs/performance/engine/continuous_compiled_probe.py {eager,dyn,dynfrz}
"""
# ruff: noqa
import sys, time, torch, statistics
from ranmt.data.corpus import raw_text
from ranmt.inference.translator import Translator
torch.set_num_threads(1)
run = "/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run"
data = "/tmp/stud/out/data/multi30k-en-de-distilled"
mode = sys.argv[1]
t = Translator.load(run, device="cpu", quantize="int8")
lines = t.src_vocab.encode(raw_text(data, "test_2016_flickr", "src")[:60])
dec, _ = t.continuous_decoder(beam=1)
if mode != "eager":
    import torch._dynamo
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = True
    t.model.decode_step = torch.compile(t.model.decode_step, dynamic=True, fullgraph=(mode=="full"), options={"freezing": True} if "frz" in mode else None)
def one_by_one(ls):
    out = []
    for i, ids in enumerate(ls):
        dec.add(i, ids)
        out += dec.run()
    return out
def burst(ls):
    for i, ids in enumerate(ls): dec.add(i, ids)
    return dec.run()
with torch.inference_mode():
    s = time.perf_counter(); first = one_by_one(lines[:20]); print(mode, "warm", round(time.perf_counter()-s, 1), flush=True)
    s = time.perf_counter(); burst(lines[:32]); print(mode, "warm burst", round(time.perf_counter()-s, 1), flush=True)
    for r in range(2):
        s = time.perf_counter(); a = one_by_one(lines[20:60]); b1 = (time.perf_counter()-s)/40*1000
        s = time.perf_counter(); b = burst(lines); b32 = (time.perf_counter()-s)/60*1000
        print(mode, f"one at a time {b1:.2f} ms/line; 60 at once {b32:.2f} ms/line", flush=True)
    print(mode, [h[0][0][:8] for _, h in sorted(a)[:3]])
