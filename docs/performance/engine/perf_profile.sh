#!/usr/bin/env bash
# Issue 99: where CTranslate2's int8 time goes against ranmt's compiled int8 step, by
# `perf record` on each system decoding peers.py's batches in a loop (Bergamot's setting:
# greedy, batch 32, one thread, shortlist / vmap; fixed length 1 = the encoder and one
# step, 20 = the encoder and 21 steps). Sampled for SECONDS after each system's warm-up;
# reports by shared object and by symbol beside this script.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine/perf
SECONDS_SAMPLED=${SECONDS_SAMPLED:-20}
mkdir -p $OUT
for FIXED in ${LENGTHS:-1 20}; do
  for SYSTEM in ${SYSTEMS:-ct2 ranmt}; do
    READY=/tmp/perf_ready_${SYSTEM}_$FIXED; rm -f $READY
    .venv/bin/python docs/performance/engine/perf_profile.py $RUN $DATA $SYSTEM $FIXED $READY \
      2> /tmp/perf_profile_$SYSTEM.err &
    PID=$!
    while [ ! -e $READY ]; do sleep 1; kill -0 $PID; done
    perf record -F 1999 -g -p $PID -o /tmp/perf_${SYSTEM}_$FIXED.data -- sleep $SECONDS_SAMPLED 2>/dev/null
    kill $PID; wait $PID 2>/dev/null || true
    rounds=$(grep -c round /tmp/perf_profile_$SYSTEM.err || true)
    { echo "# $SYSTEM, fixed length $FIXED: $rounds rounds of 320 sentences in ~$SECONDS_SAMPLED s sampled"
      echo "## by shared object ([JIT]: code generated at run time: oneDNN's kernels)"
      perf report -i /tmp/perf_${SYSTEM}_$FIXED.data --no-children --sort dso --stdio -g none \
        --percent-limit 0.3 2>/dev/null | grep '%'
      echo "## by symbol (outside [JIT]), over 0.3%"
      perf report -i /tmp/perf_${SYSTEM}_$FIXED.data --no-children --sort dso,sym --stdio -g none \
        --percent-limit 0.3 2>/dev/null | grep '%' | grep -v 'JIT' | cut -c1-160
    } > $OUT/${SYSTEM}_fixed$FIXED.txt
  done
done
