#!/usr/bin/env bash
# The GPU measurements of issue 44 as one prepared script for a lent GPU machine (about 9-10
# minutes on an H100; a session has 15 minutes of device time, start included).
#
# From a session that has a device (status: can_start_another), with the Multi30k data
# prepared here first (any converged-grid command prepares it, or `ranmt prepare`):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600,
#       carry=["docs/results/multi30k_converged/data/multi30k-en-de"])
# Everything it prints lands in $OUT/*.log (fetched back; commit them under
# docs/performance/gpu_<card>/ and fill PERFORMANCE.md "On a GPU"). Steps are ordered by
# value, each with its own time limit, so a slow step does not eat the rest.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
DATA=docs/results/multi30k_converged/data/multi30k-en-de
STEPS=${STEPS:-150}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    pip install -q --no-deps -e . 2>&1 | tail -1
    python -c "import sentencepiece, sacrebleu" 2>/dev/null \
        || pip install -q sentencepiece sacrebleu sacremoses safetensors pyyaml tqdm
} > "$OUT/env.log" 2>&1

# 1. correctness on CUDA: GPU = CPU, the sync-free search (auto on CUDA) = reference, compile
timeout 150 python -m pytest -q -m gpu tests/test_cuda.py -x > "$OUT/tests.log" 2>&1

# 2. training throughput: base, 25k tokens, fp32 (TF32) vs bf16 eager vs bf16 compiled over
#    shape buckets with CUDA graphs (reduce-overhead); same steps, valid loss at the end
train() {  # name arch extra-overrides...
    local name=$1 arch=$2
    shift 2
    timeout 120 ranmt train --data "$DATA" --out "/tmp/runs/$name" --config configs/base.yaml \
        model.arch="$arch" data.max_tokens=25000 train.max_steps="$STEPS" train.max_time=0 \
        train.validate_every=100000 train.validate_bleu=false train.progress=false \
        train.tensorboard=false train.log_every=100 "$@" 2>&1 | grep -v "^$" | tail -4
}
BUCKETS="data.shape_buckets=[12,16,20,24,28,32,40,48,64,128]"
{
    # the trainer reads losses at log steps only on CUDA (train.host_reads=auto -> log);
    # per-step reads, as before, for the ratio
    echo "== transf fp32, host reads every step"
    train transf-fp32-step transf train.precision=fp32 train.host_reads=step
    for arch in transf ran-all; do
        echo "== $arch fp32"; train "$arch-fp32" "$arch" train.precision=fp32
        echo "== $arch bf16"; train "$arch-bf16" "$arch" train.precision=bf16
        echo "== $arch bf16 compiled, buckets, reduce-overhead"
        train "$arch-bf16-graphs" "$arch" train.precision=bf16 train.compile=true \
            train.compile_mode=reduce-overhead "$BUCKETS"
    done
} > "$OUT/train.log" 2>&1

# 3. kernels and host time of a bare step (the profile the launch-bound diagnosis came from)
timeout 90 python benchmarks/profile_train.py --device cuda --preset base --arch transf \
    --sentences 1000 --length 24 --repeats 5 --no-profile > "$OUT/profile.log" 2>&1

# 4. decoding: syncs per step and speed of each search mode on the GPU (batch 32 and 100,
#    beam 4, fixed length 30 and own outputs), fp32 and bf16 copies; graphs/8: the decoder
#    step replayed as a CUDA graph
timeout 150 python benchmarks/decode_syncs.py --device cuda --preset base \
    --arch transf ran-all --batch 32 100 --beam 4 --sentences 400 --repeats 2 \
    --check-every 1 8 --graphs --quantize none bf16 --no-reference-speed \
    > "$OUT/decode.log" 2>&1

tail -n 3 "$OUT"/*.log
