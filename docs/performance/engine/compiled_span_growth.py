"""One-off experiment (issue 99, 2026-12-05): the compiled step's span grown in steps of
``GROW`` slots (``CompiledStep.GROW``; 1000 = the whole capacity from the first step, as
before) against the eager shrinking search, on the trained int8 student: real outputs with
ranmt's own length limit, greedy, one thread, best of 4 alternating rounds, in one process
(every system's graphs compiled before the rounds). Not a maintained benchmark; the
outputs beside it are what the commits and the note report.

    python docs/performance/engine/compiled_span_growth.py RUN DATA SENTENCES BATCH 16,1000
"""

import sys
import time

import torch

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference import graphs
from ranmt.inference.decode import search
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_description


def main(run: str, data: str, sentences: int, batch: int, grows: list[int]) -> None:
    torch.set_num_threads(1)
    print(cpu_description(), torch.__version__, flush=True)
    translator = Translator.load(run, device="cpu", quantize="int8")
    lines = raw_text(data, "test_2016_flickr", "src")[:sentences]
    ids = sorted(translator.src_vocab.encode(lines), key=len)
    batches = [pad_sources(ids[i: i + batch]) for i in range(0, sentences, batch)]

    def decode(**options) -> tuple[list, float]:
        start = time.perf_counter()
        out = [h[0] for src in batches for h in search(translator.model, src, beam=1,
                                                       **options)]
        return out, time.perf_counter() - start

    reference, _ = decode()
    tokens = sum(len(hyp[0]) + 1 for hyp in reference)
    for grow in grows:
        graphs.CompiledStep.GROW = grow
        _, seconds = decode(compile_step=True)
        print(f"grow {grow}: compile pass {seconds:.1f} s", flush=True)
    best: dict[str, float] = {}
    for _ in range(4):
        for system in ["eager"] + [f"grow {grow}" for grow in grows]:
            if system == "eager":
                _, seconds = decode()
            else:
                graphs.CompiledStep.GROW = int(system.split()[1])
                _, seconds = decode(compile_step=True)
            best[system] = min(best.get(system, float("inf")), seconds)
    for system, seconds in best.items():
        print(f"batch {batch}: {system:10s} {tokens / seconds:8.0f} tok/s  "
              f"{1000 * seconds / sentences:6.2f} ms/sentence  "
              f"{best['eager'] / seconds:.2f}x eager shrinking")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
         [int(g) for g in sys.argv[5].split(",")])
