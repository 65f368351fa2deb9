#!/usr/bin/env bash
# Issue 99 item 5: every student against CTranslate2 in one peers.py run, each system and
# round in a fresh process: the trained TransF student and the RAN-D, AAN and SSRU students
# (freshly initialised, untrained_students.py: equal work at a fixed length), int8 compiled
# + shortlist, against CTranslate2 int8 + vmap on the TransF student, at Bergamot's setting
# (greedy, batch 32, one thread, fixed length 20); then the same students eager int8 +
# shortlist at ranmt's usual setting (beam 4, batch 100, two threads, fixed length 20:
# there the compiled step is not faster than the eager search, 0.98x, PERFORMANCE.md).
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
STUDENTS=/tmp/students_untrained
OUT=docs/performance/engine
[ -d $STUDENTS/Student-SSRU ] || .venv/bin/python $OUT/untrained_students.py $DATA $RUN $STUDENTS
SYSTEMS="ranmt TransF int8 compiled + shortlist,ranmt RAN-D int8 compiled + shortlist"
SYSTEMS="$SYSTEMS,ranmt AAN int8 compiled + shortlist,ranmt SSRU int8 compiled + shortlist"
SYSTEMS="$SYSTEMS,CTranslate2 int8 + vmap"
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --fixed-length 20 --int8 --shortlist \
  --compile-step --no-hf --repeats 3 --systems "$SYSTEMS" --out /tmp/peers7 \
  --student RAN-D=$STUDENTS/Student-RAN-D/best --student AAN=$STUDENTS/Student-AAN/best \
  --student SSRU=$STUDENTS/Student-SSRU/best \
  --json $OUT/peers_bergamot_fixed20_every_student.json \
  2> $OUT/peers_bergamot_fixed20_every_student.err \
  | tee $OUT/peers_bergamot_fixed20_every_student.md

SYSTEMS="ranmt TransF int8 + shortlist,ranmt RAN-D int8 + shortlist"
SYSTEMS="$SYSTEMS,ranmt AAN int8 + shortlist,ranmt SSRU int8 + shortlist,CTranslate2 int8 + vmap"
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 100 --beam 4 --threads 2 --fixed-length 20 --int8 --shortlist \
  --no-hf --repeats 3 --systems "$SYSTEMS" --out /tmp/peers8 \
  --student RAN-D=$STUDENTS/Student-RAN-D/best --student AAN=$STUDENTS/Student-AAN/best \
  --student SSRU=$STUDENTS/Student-SSRU/best \
  --json $OUT/peers_beam4_b100_t2_fixed20_every_student.json \
  2> $OUT/peers_beam4_b100_t2_fixed20_every_student.err \
  | tee $OUT/peers_beam4_b100_t2_fixed20_every_student.md
