"""One-off probe (issue 99, 2026-12-05, before ``CompiledStep.shape_limit``): at batch 1
with the compiled step, what Dynamo's config patch costs when entered at every step (as
``CompiledStep._run`` did) and what the guard check of the step's cache entries costs (the
trained int8 student, 40 test_2016 sentences, greedy, one thread). Its output is in
compiled_call_overhead.txt.

    python docs/performance/engine/compiled_guard_probe.py RUN DATA
"""

import sys
import time

import torch
import torch._dynamo.eval_frame as eval_frame

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference import graphs
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator


def main(run: str, data: str) -> None:
    torch.set_num_threads(1)
    translator = Translator.load(run, device="cpu", quantize="int8")
    lines = raw_text(data, "test_2016_flickr", "src")[:40]
    batches = [pad_sources([ids]) for ids in translator.src_vocab.encode(lines)]

    def decode() -> float:
        start = time.perf_counter()
        for src in batches:
            search(translator.model, src, beam=1, compile_step=True)
        return (time.perf_counter() - start) / len(batches) * 1000

    decode(), decode()
    print(f"as shipped: {min(decode() for _ in range(3)):.2f} ms/sentence")
    shipped = graphs.CompiledStep.__dict__["_run"]
    graphs.CompiledStep._run = classmethod(lambda cls, compiled, eager, *args:
                                           compiled(*args))
    print(f"without config.patch per call: {min(decode() for _ in range(3)):.2f} ms/sentence")
    graphs.CompiledStep._run = shipped
    calls, step = [0], graphs.CompiledStep.__call__

    def probe(self):  # at the 60th step: every cache entry's guard check, in lookup order
        calls[0] += 1
        if calls[0] == 60:
            entries = eval_frame._debug_get_cache_entry_list(graphs._run_body.__code__)
            f_locals = {"body": self.body}
            print(f"{len(entries)} cache entries for the step")
            total = 0.0
            for index, entry in enumerate(entries):
                passes = entry.guard_manager.check(f_locals)
                start = time.perf_counter()
                for _ in range(200):
                    entry.guard_manager.check(f_locals)
                micros = (time.perf_counter() - start) / 200 * 1e6
                total += micros
                print(f"  entry {index}: passes {passes}, check {micros:.1f} us")
                if passes:
                    break
            print(f"  lookup up to the passing entry: {total:.1f} us")
        return step(self)

    graphs.CompiledStep.__call__ = probe
    decode()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
