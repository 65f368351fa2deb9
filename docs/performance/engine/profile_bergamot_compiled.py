"""One-off profile (issue 99, 2026-12-05): the compiled int8 + shortlist search of the trained
TransF student at Bergamot's setting (greedy, batch 32, 1 thread, fixed length 20, 160
test_2016 sentences), through torch.profiler with inductor's kernel profiling (each fused
C++ kernel a row). Output: profile_bergamot_compiled.txt.

    python docs/performance/engine/profile_bergamot_compiled.py RUN DATA
"""

import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference.decode import search
from ranmt.inference.shortlist import RestrictedOutput, bucketed_vocabulary
from ranmt.inference.translator import Translator


def main(run: str, data: str) -> None:
    inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(1)
    translator = Translator.load(run, device="cpu", quantize="int8")
    shortlist = translator.lexical_shortlist()
    lines = raw_text(data, "test_2016_flickr", "src")[:160]
    ids = sorted(translator.src_vocab.encode(lines), key=len)
    batches = [pad_sources(ids[i: i + 32]) for i in range(0, 160, 32)]

    def decode() -> int:
        tokens = 0
        for src in batches:
            vocabulary, blocked = bucketed_vocabulary(shortlist.vocabulary(src),
                                                      shortlist.target_vocab_size)
            hyps = search(RestrictedOutput(translator.model, vocabulary, blocked), src,
                          beam=1, fixed_length=20, compile_step=True)
            tokens += sum(len(h[0][0]) + 1 for h in hyps)
        return tokens

    decode(), decode()
    start = time.perf_counter()
    tokens = decode()
    seconds = time.perf_counter() - start
    print(f"{tokens / seconds:.0f} tok/s; {seconds / (len(batches) * 21) * 1000:.2f} ms/step",
          flush=True)
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        decode()
    print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                        max_name_column_width=70))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
