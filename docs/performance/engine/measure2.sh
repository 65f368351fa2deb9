#!/usr/bin/env bash
# Issue 99 item 5 (part 2): the same trained student at beam 4 / batch 100 / 2 threads, and
# batch-1 latency (greedy, 1 thread), real outputs.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 100 --beam 4 --threads 2 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --out /tmp/peers_beam4 --json $OUT/peers_beam4_b100_t2_real.json 2> $OUT/peers_beam4_b100_t2_real.err | tee $OUT/peers_beam4_b100_t2_real.md
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 100 --batch 1 --beam 1 --threads 1 --int8 --shortlist --no-hf \
  --repeats 3 --out /tmp/peers_b1 --json $OUT/peers_batch1_greedy_t1_real.json 2> $OUT/peers_batch1_greedy_t1_real.err | tee $OUT/peers_batch1_greedy_t1_real.md
