#!/usr/bin/env bash
# `make demo`: Multi30k En->De end to end on a CPU in about 15 minutes, then a service.
#   1. Multi30k task 1 (the local copy under $RANMT_DATA_DIR when present, else the official
#      files), SentencePiece, encoded splits;
#   2. `small` TransF and RAN-ALL, $BUDGET of training each (resumes when run again:
#      a larger BUDGET continues the same runs);
#   3. both evaluated on test_2016_flickr (BLEU, chrF, TER) with paired bootstrap significance;
#   4. one sentence translated by both;
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
    # A few minutes means a few hundred steps: a warm-up of 150 steps reaches the peak
    # learning rate in time; validation only at the end.
    "$RANMT" train --data "$DATA" --out "$DEMO/$arch" --config configs/multi30k_small.yaml \
        "model.arch=$arch" "train.max_time=$BUDGET" train.warmup_steps=150 \
        train.validate_every=100000 train.valid_max_sentences=200 $TRAIN_FLAGS
done

echo "== 3/5 test_2016_flickr: BLEU, chrF, TER and paired bootstrap (RAN-ALL against TransF)"
for arch in transf ran-all; do
    "$RANMT" evaluate --checkpoint "$DEMO/$arch" --data "$DATA" --split test_2016_flickr \
        --output "$DEMO/$arch.test_2016_flickr.hyp" --quiet $EVAL_FLAGS
done
"$RANMT" score --ref "$DATA/test_2016_flickr.tgt.txt" \
    --hyp "$DEMO/transf.test_2016_flickr.hyp" --hyp "$DEMO/ran-all.test_2016_flickr.hyp" \
    --metrics bleu chrf ter

echo "== 4/5 one sentence"
for arch in transf ran-all; do
    printf "%-8s " "$arch:"
    echo "A man in an orange hat starring at something." | "$RANMT" translate --checkpoint "$DEMO/$arch"
done

if [ "$SERVE" = "1" ]; then
    echo "== 5/5 serving both: open http://127.0.0.1:$PORT/ (API: POST /translate; Ctrl-C stops)"
    exec "$RANMT" serve --checkpoint "TransF=$DEMO/transf" --checkpoint "RAN-ALL=$DEMO/ran-all" \
        --port "$PORT"
fi
