#!/usr/bin/env bash
# Issue 99: batch-1 latency with the compiled step (span growth, CPU check every step,
# compiled encoder), same trained student as measure2.sh.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 100 --batch 1 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --out /tmp/peers_b1c --json $OUT/peers_batch1_greedy_t1_real_compiled.json 2> $OUT/peers_batch1_greedy_t1_real_compiled.err | tee $OUT/peers_batch1_greedy_t1_real_compiled.md
# Bergamot's setting, real outputs, with the compiled step's span growth, row buckets and
# compiled encoder (2026-12-05, later the same day as measure.sh).
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --out /tmp/peers_bergamot_real2 --json $OUT/peers_bergamot_real_compiled.json 2> $OUT/peers_bergamot_real_compiled.err | tee $OUT/peers_bergamot_real_compiled.md
# After Int8Linear.rows_t (the shortlist gather fix), the same batch-1 run again:
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 100 --batch 1 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --out /tmp/peers_b1d --json $OUT/peers_batch1_greedy_t1_real_compiled_rows_t.json 2> $OUT/peers_batch1_greedy_t1_real_compiled_rows_t.err | tee $OUT/peers_batch1_greedy_t1_real_compiled_rows_t.md
