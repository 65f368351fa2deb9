#!/usr/bin/env bash
# Issue 99 item 5 (part): the trained Student-TransF (2,000 steps on the distilled corpus)
# decoded by ranmt (eager int8, compiled int8, int8 + shortlist) against CTranslate2 int8
# and int8 + vocabulary map; BLEU of each ranmt decoding against fp32 eager.
set -euo pipefail
cd /work/main
RUN=/tmp/stud/out/runs/multi30k-en-de-distilled/Student-TransF/seed1/run
DATA=/tmp/stud/out/data/multi30k-en-de-distilled
OUT=docs/performance/engine
lscpu | grep -E "Model name|^CPU\(s\)" > $OUT/machine.txt
.venv/bin/python -c "import torch, ctranslate2; print('torch', torch.__version__, 'ctranslate2', ctranslate2.__version__)" >> $OUT/machine.txt
[ -f $RUN/shortlist.safetensors ] || .venv/bin/ranmt shortlist --data $DATA --out $RUN
for mode in "fp32:--quantize none" "int8:--quantize int8" "int8-compiled:--quantize int8 --compile-step" "int8-shortlist:--quantize int8 --shortlist" "int8-compiled-shortlist:--quantize int8 --compile-step --shortlist"; do
  name=${mode%%:*}; flags=${mode#*:}
  /usr/bin/time -f "%e s wall" .venv/bin/ranmt evaluate --checkpoint $RUN --data $DATA --split test_2016_flickr \
     --beam 1 $flags --json --output /tmp/q/hyp_$name.txt 2> $OUT/bleu_greedy_$name.err > $OUT/bleu_greedy_$name.json || true
done
python3 -c "
a = open('/tmp/q/hyp_fp32.txt').read().splitlines()
for n in ('int8', 'int8-compiled', 'int8-shortlist', 'int8-compiled-shortlist'):
    b = open(f'/tmp/q/hyp_{n}.txt').read().splitlines()
    print(f'{n}: {sum(x == y for x, y in zip(a, b))} of {len(a)} outputs identical to fp32 eager')
c = open('/tmp/q/hyp_int8.txt').read().splitlines(); d = open('/tmp/q/hyp_int8-compiled.txt').read().splitlines()
print(f'int8-compiled vs int8 eager: {sum(x == y for x, y in zip(c, d))} of {len(c)} identical')
e = open('/tmp/q/hyp_int8-shortlist.txt').read().splitlines(); f = open('/tmp/q/hyp_int8-compiled-shortlist.txt').read().splitlines()
print(f'int8-compiled-shortlist vs int8-shortlist eager: {sum(x == y for x, y in zip(e, f))} of {len(e)} identical')
" > $OUT/identical_outputs.txt
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --repeats 3 --out /tmp/peers_bergamot_real --json $OUT/peers_bergamot_real.json 2> $OUT/peers_bergamot_real.err | tee $OUT/peers_bergamot_real.md
.venv/bin/python benchmarks/peers.py decode --transf $RUN --data $DATA --split test_2016_flickr \
  --sentences 320 --batch 32 --beam 1 --threads 1 --int8 --shortlist --compile-step --no-hf \
  --fixed-length 20 --repeats 3 --out /tmp/peers_bergamot_fixed --json $OUT/peers_bergamot_fixed20.json 2> $OUT/peers_bergamot_fixed20.err | tee $OUT/peers_bergamot_fixed20.md
