"""One-off experiment (issue 99, 2026-12-05): what a compiled step's call costs around its
graph at batch 1, on the trained int8 student (real outputs, ranmt's own length limit,
greedy, one thread). Each configuration in its own process (``CONFIG``):

* ``default``: ``decode.compile_step`` as shipped (inductor, freezing, Python wrapper);
* ``cpp_wrapper``: the same graphs with inductor's C++ wrapper (the generated code that
  calls the kernels is C++ instead of Python);
* ``skip_guards``: as shipped, but the timed rounds run under
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (only the guards that tell
  the compiled graphs apart are checked: an upper bound on what a guard-free call buys;
  unsafe in general, correct here because the warm-up compiled every shape first and the
  outputs are compared).

The eager shrinking search runs in the same process as the baseline; best of 4 alternating
rounds. Not a maintained benchmark; the outputs beside it are what the note reports.

    python docs/performance/engine/compiled_call_overhead.py RUN DATA SENTENCES CONFIG
"""

import contextlib
import sys
import time

import torch

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference import graphs
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description


def main(run: str, data: str, sentences: int, config: str) -> None:
    torch.set_num_threads(1)
    print(cpu_description(), torch.__version__, config, flush=True)
    if config == "cpp_wrapper":
        options = {"freezing": True, "cpp_wrapper": True}
        graphs.CompiledStep._runner = torch.compile(graphs._run_body, fullgraph=True,
                                                    dynamic=False, options=options)
        graphs.CompiledStep._encoder = torch.compile(graphs._encode, fullgraph=True,
                                                     dynamic=False, options=options)
    translator = Translator.load(run, device="cpu", quantize="int8")
    lines = raw_text(data, "test_2016_flickr", "src")[:sentences]
    batches = [pad_sources([ids]) for ids in translator.src_vocab.encode(lines)]

    def decode(**options) -> tuple[list, float]:
        start = time.perf_counter()
        out = [h[0] for src in batches for h in search(translator.model, src, beam=1,
                                                       **options)]
        return out, time.perf_counter() - start

    reference, _ = decode()
    tokens = sum(len(hyp[0]) + 1 for hyp in reference)
    compiled, seconds = decode(compile_step=True)
    print(f"compile pass {seconds:.1f} s; same tokens as eager: "
          f"{sum(a[0] == b[0] for a, b in zip(compiled, reference))}/{sentences}", flush=True)
    stance = (torch.compiler.set_stance(skip_guard_eval_unsafe=True)
              if config == "skip_guards" else contextlib.nullcontext())
    best = {"eager": float("inf"), config: float("inf")}
    with stance:
        for _ in range(4):
            _, seconds = decode()
            best["eager"] = min(best["eager"], seconds)
            out, seconds = decode(compile_step=True)
            best[config] = min(best[config], seconds)
            assert [h[0] for h in out] == [h[0] for h in compiled]
    for system, seconds in best.items():
        print(f"batch 1: {system:12s} {tokens / seconds:8.0f} tok/s  "
              f"{1000 * seconds / sentences:6.2f} ms/sentence  "
              f"{best['eager'] / seconds:.2f}x eager shrinking")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
