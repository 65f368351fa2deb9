#!/usr/bin/env bash
# The GPU measurements of issue 44 as one prepared script for a lent GPU machine, every
# step under its own time limit. All steps together take ~11 minutes, more than one
# 600-second call: name the steps a call should run (a session has 15 minutes of device
# time, each machine start ~30-60 s of it). The H200 session of 2026-11-27 ran all but
# `profile` (docs/PERFORMANCE.md "Measured on an NVIDIA H200"); next (~3 minutes):
#   RUNS="transf-fp32 transf-bf16 transf-bf16-expandable" bash benchmarks/gpu_session.sh \
#       profile train
#
# From a session that has a device (status: can_start_another), with the Multi30k data
# prepared here first (any converged-grid command prepares it, or `ranmt prepare`):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600,
#       carry=["docs/results/multi30k_converged/data/multi30k-en-de"])
# Everything it prints lands in $OUT/*.log (fetched back; commit them under
# docs/performance/gpu_<card>/ and fill PERFORMANCE.md "On a GPU"). The machine's image has
# PyTorch, transformers, sentencepiece and sacrebleu but no network: the package runs from
# src/ (PYTHONPATH), nothing is installed. Steps by name run only those, e.g.
#   bash benchmarks/gpu_session.sh tests sdpa train
# (steps: env tests train marian decode latency profile sdpa issue68; env always runs; STEPS, RUNS choose the
# training steps and runs: RUNS="transf-fp32 transf-bf16" for two of them)
# Issue 68 (2026-11-28): `bash benchmarks/gpu_session.sh issue68` is the one prepared call
# (gpu_step.json and issue68.log; fits one 600-second call with the machine's start).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
DATA=docs/results/multi30k_converged/data/multi30k-en-de
STEPS=${STEPS:-100}
# what every speed run here shares: base, 25k tokens a step, no budget but steps, one
# validation (loss only) at the end, no progress bar or TensorBoard
SPEED_RUN=(--config configs/base.yaml data.max_tokens=25000 train.max_time=0
    train.validate_every=100000 train.validate_bleu=false train.progress=false
    train.tensorboard=false)

env_step() {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__)"
    nproc
}

# 1. correctness on CUDA of what no GPU has run yet: the sync-free searches, CUDA-graph
#    decoding = eager, deferred host reads in the trainer, the precision policy's SDPA
#    choice (the rest ran on an H100)
tests_step() {
    timeout 70 python -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider \
        -k "sync_free or cuda_graph or deferred"
}

# 2. training throughput of the trainer itself: base, 25k tokens per step, STEPS steps,
#    tokens/s of the whole run and of each log window (the last: steady state), valid loss
#    at the end; fp32 (TF32) vs bf16 autocast; host reads every step vs deferred (the
#    default on CUDA); bf16 compiled over 3 shape buckets with CUDA graphs (reduce-overhead)
train() {  # name seconds arch extra-overrides...
    local name=$1 limit=$2 arch=$3
    shift 3
    case " ${RUNS:-all} " in *" all "*|*" $name "*) ;; *) return ;; esac
    echo "== $name"
    timeout "$limit" python -m ranmt train --data "$DATA" --out "/tmp/runs/$name" \
        "${SPEED_RUN[@]}" model.arch="$arch" train.max_steps="$STEPS" \
        train.log_every=$((STEPS / 4)) "$@" 2>&1 | tee "$OUT/train_$name.log" | grep -v "^$" \
        | grep -v "^{" | tail -7
}
train_step() {
    train transf-fp32 45 transf train.precision=fp32
    train transf-bf16 45 transf train.precision=bf16
    train transf-bf16-16k 45 transf train.precision=bf16 data.max_tokens=16000
    train ran-all-fp32 45 ran-all train.precision=fp32
    train ran-all-bf16 45 ran-all train.precision=bf16
    train hc-sa-fp32 45 hc-sa train.precision=fp32
    train hc-sa-bf16 45 hc-sa train.precision=bf16
    train transf-fp32-step-reads 45 transf train.precision=fp32 train.host_reads=step
    # the caching allocator with 19 shapes of ~0.8 GB logits: growable segments instead
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        train transf-bf16-expandable 45 transf train.precision=bf16
    train transf-bf16-graphs 120 transf train.precision=bf16 train.compile=true \
        train.compile_mode=reduce-overhead "data.shape_buckets=[20,32,128]" \
        train.max_steps=$((STEPS * 2))  # compilation first: twice the steps
}

# 3. the bare step at 25k target tokens (1000 x 25) against Hugging Face MarianMTModel of
#    the same shape (SDPA, fused AdamW, same loss), fp32 (TF32) and bf16 autocast
marian_step() {
    timeout 70 python benchmarks/profile_train.py --device cuda --preset base \
        --arch transf ran-all --sentences 1000 --length 25 --repeats 5 --marian --no-profile
    # the same bare step compiled (fp32-compiled, bf16-compiled; not measured on a GPU yet)
    timeout 180 python benchmarks/profile_train.py --device cuda --preset base \
        --arch transf --sentences 1000 --length 25 --repeats 5 --compile --no-profile
}

# 4. decoding: syncs per step and speed of the searches on the GPU (batch 32 and 100, beam
#    4, fixed length 30), fp32 and bf16 copies; graphs/8: the step replayed as a CUDA graph
decode_step() {
    timeout 110 python benchmarks/decode_syncs.py --device cuda --preset base \
        --arch transf ran-all --batch 32 100 --beam 4 --sentences 200 --repeats 1 \
        --check-every 8 --graphs --quantize none bf16 --no-reference-speed --fixed-only
}

# 4b. batch-1 latency (beam 4, fixed length 30): ms per sentence = (30 + EOS) / tok/s
latency_step() {
    timeout 140 python benchmarks/decode_syncs.py --device cuda --preset base \
        --arch transf ran-all --batch 1 --beam 4 --sentences 8 --repeats 2 --check-every 8 \
        --graphs --quantize none bf16 --no-reference-speed --fixed-only
}

# 5. where the trainer's host time goes (its step is host-bound at ~100 ms against the bare
#    step's 53 ms): Python's profile of 60 bf16 TransF steps, by own time
profile_step() {
    timeout 60 python -m cProfile -s tottime -m ranmt train --data "$DATA" \
        --out /tmp/runs/profiled "${SPEED_RUN[@]}" train.max_steps=60 \
        train.precision=bf16 2>&1 | head -60
    # did reduce-overhead really replay CUDA graphs? (Inductor says why it skips them)
    TORCH_LOGS=perf_hints timeout 100 python -m ranmt train --data "$DATA" \
        --out /tmp/runs/hints "${SPEED_RUN[@]}" train.max_steps=40 \
        train.precision=bf16 train.compile=true train.compile_mode=reduce-overhead \
        "data.shape_buckets=[20,32,128]" 2>&1 | grep -i -m 20 "cudagraph\|graph break\|done:"
}

# 6. what a new batch shape costs each SDPA kernel (cuDNN plans per shape)
sdpa_step() {
    timeout 40 python benchmarks/sdpa_shapes.py --device cuda
}

# 7. issue 68 in one call (~8 minutes on an H200): the bare step eager vs compiled (forward +
#    loss as one graph) at 25k / 50k / 100k tokens, TransF and RAN-ALL, fp32 / bf16 autocast /
#    bf16-weights, the big preset, Marian's step and generate of the same shape, the top-20
#    kernels: JSON in $OUT/gpu_step.json (raw rows printed to the log as they come); then the
#    trainer's fill and tok/s (its log line), bf16 and bf16-weights, 60 steps each.
#    Dry run on any machine: python benchmarks/gpu_step.py --dry-run --device cpu
issue68_step() {
    # RAN's fused bias kernel (model.ran.kernel=auto: sdpa on CUDA) = the explicit path
    timeout 30 python -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider \
        -k fused_bias_kernel
    timeout 420 python benchmarks/gpu_step.py --device cuda --out "$OUT/gpu_step.json"
    STEPS=60 RUNS="transf-bf16 transf-bf16w transf-bf16-auto8" train_issue68
}
train_issue68() {
    train transf-bf16 45 transf train.precision=bf16
    train transf-bf16w 45 transf train.precision=bf16-weights
    # last (a time-out here loses nothing else): CUDA graphs over 8 (source, target) shapes
    # chosen from the data (data.auto_shape_buckets, 2026-11-29) against the square buckets
    # of transf-bf16-graphs: the log's "(shape buckets)" line has the fill
    train transf-bf16-auto8 60 transf train.precision=bf16 train.compile=true \
        train.compile_mode=reduce-overhead data.auto_shape_buckets=8
}

STEPS_TO_RUN=${*:-tests train profile marian decode sdpa}
env_step > "$OUT/env.log" 2>&1
for step in $STEPS_TO_RUN; do
    "${step}_step" > "$OUT/$step.log" 2>&1
done
date -u >> "$OUT/env.log"
tail -n 4 "$OUT"/*.log
