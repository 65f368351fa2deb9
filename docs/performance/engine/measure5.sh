#!/usr/bin/env bash
# Issue 99, after the compiled encoder went dynamic (a batch encoded at its own length, the
# memory padded to the step's bucket after): the trained TransF student compiled + shortlist
# against CTranslate2 int8 + vmap, each system and round in a fresh process (peers.py),
# at Bergamot's setting (greedy, batch 32, one thread) at fixed length 20 and 1, and at
# batch 1 on real outputs.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
SYSTEMS="ranmt TransF int8 compiled + shortlist,CTranslate2 int8 + vmap"
for FIXED in 20 1; do
  .venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
    --sentences 320 --batch 32 --beam 1 --threads 1 --fixed-length $FIXED --int8 --shortlist \
    --compile-step --no-hf --repeats 3 --systems "$SYSTEMS" --out /tmp/peers5_fixed$FIXED \
    --json $OUT/peers_bergamot_fixed${FIXED}_dynamic_encoder.json \
    2> $OUT/peers_bergamot_fixed${FIXED}_dynamic_encoder.err \
    | tee $OUT/peers_bergamot_fixed${FIXED}_dynamic_encoder.md
done
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 100 --batch 1 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --systems "$SYSTEMS" --out /tmp/peers5_b1 \
  --json $OUT/peers_batch1_greedy_t1_real_dynamic_encoder.json \
  2> $OUT/peers_batch1_greedy_t1_real_dynamic_encoder.err \
  | tee $OUT/peers_batch1_greedy_t1_real_dynamic_encoder.md
