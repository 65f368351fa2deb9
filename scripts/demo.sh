#!/usr/bin/env bash
# `make demo`: Multi30k En->De end to end on a CPU in about 10 minutes, then a service.
#   1. Multi30k task 1 (the local copy under $RANMT_DATA_DIR when present, else the official
#      files), SentencePiece, encoded splits;
#   2. `small` TransF and RAN-ALL, $BUDGET of training each with configs/multi30k_demo.yaml
#      (resumes when run again: a larger BUDGET continues the same runs);
#   3. both evaluated on test_2016_flickr (SacreBLEU) with paired bootstrap significance;
#   4. one sentence translated by both, and what they reached beside the converged models
#      of docs/RESULTS.md (scripts/demo_summary.py);
#   5. `ranmt serve` on both, the attention explorer at http://127.0.0.1:$PORT/ (Ctrl-C stops).
# Variables: BUDGET (train.max_time per model: 4m, 90s, 1h; default 3m), DEMO (output folder, default demo), PORT (8080),
# SERVE=0 to stop after step 4; EVAL_FLAGS: extra decoding flags of step 3 (e.g. "--beam 1");
# TRAIN_FLAGS: extra key=value overrides of step 2 (e.g. "decode.max_len_b=4").
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET="${BUDGET:-3m}"
DEMO="${DEMO:-demo}"
PORT="${PORT:-8080}"
SERVE="${SERVE:-1}"
EVAL_FLAGS="${EVAL_FLAGS:-}"
TRAIN_FLAGS="${TRAIN_FLAGS:-}"
SENTENCE="A man in an orange hat starring at something."
BIN="${BIN:-.venv/bin}"
RANMT="$BIN/ranmt"
DATA="$DEMO/data"

echo "== 1/5 data: Multi30k En-De -> $DATA"
if [ ! -f "$DATA/meta.json" ]; then
    "$RANMT" download multi30k --pair en-de --out "$DEMO/multi30k"
    "$RANMT" prepare --src en --tgt de --train "$DEMO/multi30k/train" \
        --valid "$DEMO/multi30k/val" --test "test_2016_flickr=$DEMO/multi30k/test_2016_flickr" \
        --vocab-size 8000 --joint --out "$DATA"
fi

for arch in transf ran-all; do
    echo "== 2/5 training small $arch for $BUDGET -> $DEMO/$arch"
    # configs/multi30k_demo.yaml: a recipe for a budget of minutes (1,024-token batches,
    # no dropout, a warm-up of 100 updates; measured by scripts/demo_sweep.py)
    "$RANMT" train --data "$DATA" --out "$DEMO/$arch" --config configs/multi30k_demo.yaml \
        "model.arch=$arch" "train.max_time=$BUDGET" $TRAIN_FLAGS
done

echo "== 3/5 test_2016_flickr: SacreBLEU and paired bootstrap (RAN-ALL against TransF)"
for arch in transf ran-all; do
    "$RANMT" evaluate --checkpoint "$DEMO/$arch" --data "$DATA" --split test_2016_flickr \
        --output "$DEMO/$arch.test_2016_flickr.hyp" --quiet $EVAL_FLAGS
done
"$RANMT" score --ref "$DATA/test_2016_flickr.tgt.txt" \
    --hyp "$DEMO/transf.test_2016_flickr.hyp" --hyp "$DEMO/ran-all.test_2016_flickr.hyp" \
    --metrics bleu --json > "$DEMO/scores.json"

echo "== 4/5 one sentence: $SENTENCE"
for arch in transf ran-all; do
    echo "$SENTENCE" | "$RANMT" translate --checkpoint "$DEMO/$arch" > "$DEMO/$arch.sentence.txt"
done
"$BIN/python" scripts/demo_summary.py --scores "$DEMO/scores.json" --budget "$BUDGET" \
    --model TransF "$DEMO/transf" "$DEMO/transf.sentence.txt" \
    --model RAN-ALL "$DEMO/ran-all" "$DEMO/ran-all.sentence.txt"

if [ "$SERVE" = "1" ]; then
    echo "== 5/5 serving both: open http://127.0.0.1:$PORT/ (API: POST /translate; Ctrl-C stops)"
    exec "$RANMT" serve --checkpoint "TransF=$DEMO/transf" --checkpoint "RAN-ALL=$DEMO/ran-all" \
        --port "$PORT"
fi
