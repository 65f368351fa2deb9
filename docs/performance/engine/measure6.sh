#!/usr/bin/env bash
# Issue 99: BLEU of the compiled int8 decodings again after the compiled encoder went
# dynamic (a batch encoded at its own length), beside measure.sh's fp32 eager run.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
mkdir -p /tmp/q
for mode in "int8-compiled:--quantize int8 --compile-step" "int8-compiled-shortlist:--quantize int8 --compile-step --shortlist"; do
  name=${mode%%:*}; flags=${mode#*:}
  /usr/bin/time -f "%e s wall" .venv/bin/ranmt evaluate --checkpoint $RUN --data $DATA --split test_2016_flickr \
     --beam 1 $flags --json --output /tmp/q/hyp6_$name.txt 2> $OUT/bleu_greedy_${name}_dynamic_encoder.err \
     > $OUT/bleu_greedy_${name}_dynamic_encoder.json
done
ls /tmp/q/
