#!/usr/bin/env bash
# Issue 99 item 5: every student against CTranslate2 in one peers.py run at ranmt's usual
# setting (beam 4, batch 100, two threads), each system and round in a fresh process, at
# fixed length 20 (equal work: the RAN-D, AAN and SSRU students are freshly initialised,
# untrained_students.py). Eager int8 + shortlist: at beam 4 / batch 100 the compiled step
# is not faster than the eager search (0.98x, PERFORMANCE.md).
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
STUDENTS=/tmp/students_untrained
OUT=docs/performance/engine
[ -d $STUDENTS/Student-SSRU ] || .venv/bin/python $OUT/untrained_students.py $DATA $RUN $STUDENTS
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
