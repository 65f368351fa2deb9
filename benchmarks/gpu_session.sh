#!/usr/bin/env bash
# The GPU measurements of issue 44 as one prepared script for a lent GPU machine: about
# 8-9 minutes of work, every step under its own time limit, so that the whole call fits one
# 600-second command (a session has 15 minutes of device time, the machine's start included).
#
# From a session that has a device (status: can_start_another), with the Multi30k data
# prepared here first (any converged-grid command prepares it, or `ranmt prepare`):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600,
#       carry=["docs/results/multi30k_converged/data/multi30k-en-de"])
# Everything it prints lands in $OUT/*.log (fetched back; commit them under
# docs/performance/gpu_<card>/ and fill PERFORMANCE.md "On a GPU"). The machine's image has
# PyTorch, transformers, sentencepiece and sacrebleu but no network: the package runs from
# src/ (PYTHONPATH), nothing is installed.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
DATA=docs/results/multi30k_converged/data/multi30k-en-de
STEPS=${STEPS:-100}
ranmt() { python -m ranmt "$@"; }

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__)"
    nproc
} > "$OUT/env.log" 2>&1

# 1. correctness on CUDA of what no GPU has run yet: the sync-free searches, CUDA-graph
#    decoding = eager, deferred host reads in the trainer (the rest ran on an H100)
timeout 70 python -m pytest -q -m gpu tests/test_cuda.py -p no:cacheprovider \
    -k "sync_free or cuda_graph or deferred" > "$OUT/tests.log" 2>&1

# 2. training throughput of the trainer itself: base, 25k tokens per step, STEPS steps,
#    tokens/s of the whole run and of the last log window (steady state), valid loss at the
#    end; fp32 (TF32) vs bf16 autocast; host reads every step vs deferred (the default on
#    CUDA); bf16 compiled over 3 shape buckets with CUDA graphs (reduce-overhead)
train() {  # name seconds arch extra-overrides...
    local name=$1 limit=$2 arch=$3
    shift 3
    echo "== $name"
    timeout "$limit" python -m ranmt train --data "$DATA" --out "/tmp/runs/$name" \
        --config configs/base.yaml model.arch="$arch" data.max_tokens=25000 \
        train.max_steps="$STEPS" train.max_time=0 train.validate_every=100000 \
        train.validate_bleu=false train.progress=false train.tensorboard=false \
        train.log_every=50 "$@" 2>&1 | grep -v "^$" | grep -v "^{" | tail -5
}
{
    train transf-fp32 45 transf train.precision=fp32
    train transf-bf16 45 transf train.precision=bf16
    train ran-all-fp32 45 ran-all train.precision=fp32
    train ran-all-bf16 45 ran-all train.precision=bf16
    train transf-fp32-step-reads 45 transf train.precision=fp32 train.host_reads=step
    train transf-bf16-graphs 120 transf train.precision=bf16 train.compile=true \
        train.compile_mode=reduce-overhead "data.shape_buckets=[20,32,128]"
} > "$OUT/train.log" 2>&1

# 3. the bare step at 25k target tokens (1000 x 25) against Hugging Face MarianMTModel of
#    the same shape (SDPA, fused AdamW, same loss), fp32 (TF32) and bf16 autocast
timeout 70 python benchmarks/profile_train.py --device cuda --preset base \
    --arch transf ran-all --sentences 1000 --length 25 --repeats 5 --marian --no-profile \
    > "$OUT/marian.log" 2>&1

# 4. decoding: syncs per step and speed of the searches on the GPU (batch 32 and 100, beam 4,
#    fixed length 30), fp32 and bf16 copies; graphs/8: the step replayed as a CUDA graph
timeout 110 python benchmarks/decode_syncs.py --device cuda --preset base \
    --arch transf ran-all --batch 32 100 --beam 4 --sentences 200 --repeats 1 \
    --check-every 8 --graphs --quantize none bf16 --no-reference-speed --fixed-only \
    > "$OUT/decode.log" 2>&1

date -u >> "$OUT/env.log"
tail -n 4 "$OUT"/*.log
