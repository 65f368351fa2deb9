"""One system of ``benchmarks/peers.py decode`` in a loop, for ``perf record -p`` (issue 99:
where CTranslate2's int8 time goes against ranmt's compiled int8 step, at Bergamot's
setting: greedy, batch 32, one thread, shortlist / vocabulary map, fixed output length).

    python docs/performance/engine/perf_profile.py RUN DATA {ct2,ranmt} FIXED_LENGTH READY

builds the system exactly as peers.py does (its own builders), decodes every batch once
(warm-up: ranmt compiles its graphs), touches the file READY, then decodes the batches
over and over until killed; the caller attaches ``perf record -p`` once READY exists
(docs/performance/engine/perf_profile.sh). A one-off measurement record, not a benchmark.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import peers  # noqa: E402  (benchmarks/peers.py)


def bergamot_args(run: str, data: str, fixed_length: int = 20,
                  compile_step: bool = True) -> Namespace:
    """peers.py decode's arguments at Bergamot's setting (greedy, batch 32, one thread,
    int8, shortlist / vmap, 320 test_2016 sentences at ``fixed_length``); also the other
    one-off scripts of this folder."""
    return Namespace(transf=run, ran=None, ran_name="RAN", data=data,
                     split="test_2016_flickr", sentences=320, batch=32, beam=1, lenpen=1.0,
                     max_len=200, fixed_length=fixed_length, threads=1, int8=True,
                     bf16=False, compile_step=compile_step, shortlist=True, no_hf=True)


def main() -> None:
    run, data, system, fixed, ready = sys.argv[1:6]
    torch.set_num_threads(1)
    args = bergamot_args(run, data, int(fixed), compile_step=system == "ranmt")
    out = Path(f"/tmp/perf_profile_{system}")
    out.mkdir(exist_ok=True)
    builders, transf = peers._decode_systems(args, out)
    name = "ranmt TransF int8 compiled + shortlist" if system == "ranmt" \
        else "CTranslate2 int8 + vmap"
    decode = builders[name]()
    _, batches = peers._source_batches(args, transf)
    with torch.inference_mode():
        for batch in batches:
            decode(batch)
        Path(ready).touch()
        rounds = 0
        while True:
            for batch in batches:
                decode(batch)
            rounds += 1
            print(f"round {rounds}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
