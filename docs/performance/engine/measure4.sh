#!/usr/bin/env bash
# Issue 99 item 5: the four student shapes (TransF, RAN-D, AAN, SSRU) with the compiled
# step, at equal work (fixed length 20), Bergamot's setting (greedy, batch 32, 1 thread):
# (1) every student side by side in one process (freshly initialised: equal work makes
# trained and untrained weights decode at the same speed), (2) the trained TransF student
# against CTranslate2 at the same setting, each system and round in a fresh process.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
PART=${1:-all}  # all | students | peers
if [ "$PART" != peers ]; then
  # each student in its own process: Dynamo's cache (and its shape limit, 64) is a
  # process's, shared by every compiled model in it
  for STUDENT in TransF RAN-D AAN SSRU; do
    .venv/bin/python benchmarks/students.py --data $DATA --split test_2016_flickr --sentences 320 \
      --fixed-length 20 --settings deployed --systems "$STUDENT int8" --compile-step --repeats 3 \
      --json $OUT/students_bergamot_fixed20_compiled_$STUDENT.json 2> $OUT/students_bergamot_fixed20_compiled_$STUDENT.err \
      | tee $OUT/students_bergamot_fixed20_compiled_$STUDENT.txt
  done
fi
[ "$PART" = students ] && exit 0
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --fixed-length 20 --int8 --shortlist \
  --compile-step --no-hf --repeats 3 --out /tmp/peers_bergamot_fixed20_2 \
  --json $OUT/peers_bergamot_fixed20_compiled.json 2> $OUT/peers_bergamot_fixed20_compiled.err \
  | tee $OUT/peers_bergamot_fixed20_compiled.md
# The same at fixed length 1 (one step: the encoder and a batch's fixed costs), against the
# fixed-length-20 run above: time(L) = encoder + L x step, solved for both systems.
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --fixed-length 1 --int8 --shortlist \
  --compile-step --no-hf --repeats 3 --out /tmp/peers_bergamot_fixed1 \
  --json $OUT/peers_bergamot_fixed1_compiled.json 2> $OUT/peers_bergamot_fixed1_compiled.err \
  | tee $OUT/peers_bergamot_fixed1_compiled.md
