#!/bin/bash
# One GPU lease: throughput benchmark, then short 3-seed packs (pipeline check, SAFE fp32 vs bf16, then ADMM/GMP).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
BUDGET=${BUDGET:-555}; EPOCHS=${EPOCHS:-10}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
python3 -c "import jax,flax,optax,orbax.checkpoint as o; print(jax.__version__, flax.__version__, optax.__version__, o.__version__, jax.devices())" || exit 4
python3 -c "from safe_optax.vision import packing, sweeps; import ml_collections, tensorboardX" || exit 5
DATA=$PWD/.gpu/cifar10_jpg.tar.gz
# decode the JPEGs once (cached as .npz) while the benchmark runs
( python3 -c "from safe_optax.vision import input_pipeline as p; import time; t=time.time(); p.load_cifar('$DATA'); print('decoded in', round(time.time()-t,1), 's')" ) &
DECODE=$!
DRY=${DRY:-}
if [ -n "$DRY" ]; then BX="--dry-run"; TX="--train-subset 256 --test-subset 256"; else BX=""; TX=""; fi
left() { echo $(( BUDGET - SECONDS )); }
echo "== benchmark at ${SECONDS}s"
python3 benchmarks/perf/cifar_pack_throughput.py --models resnet20x2 vgg19 --deadline-s ${BENCH_S:-185} $BX --out "$OUT/cifar_pack_throughput_gpu.json"
wait $DECODE
# issue 33 item 4: the LLaMA-2-7B-shaped block, one method a call so that a timeout keeps the others
if [ -z "${NO_LLM:-}" ]; then
  echo "== 7B block at ${SECONDS}s"
  for m in safe safe-plus sparsegpt; do
    timeout -s KILL ${LLM_S:-75} python3 benchmarks/perf/llm_7b_block.py --methods $m \
      --windows ${LLM_WINDOWS:-8} --seqlen ${LLM_SEQLEN:-2048} --steps ${LLM_STEPS:-2,12} \
      --sparsegpt-windows ${LLM_SGPT_WINDOWS:-16} --out "$OUT/llm_7b_block_gpu.json" || echo "7B block $m: rc $?"
    pkill -9 -f "llm_7b_block.py --worker" 2>/dev/null
  done
  echo "== 7B block done at ${SECONDS}s"
fi
# epochs that fit half of what is left, from the measured pack-of-3 step (capped at EPOCHS)
if [ -z "$DRY" ]; then
EPOCHS=$(python3 -c "
import json; d=json.load(open('$OUT/cifar_pack_throughput_gpu.json'))
c=[c for c in d['cells'] if c.get('model')=='resnet20x2' and c.get('dtype')=='float32' and c.get('runs')==3 and 'mean_step_ms' in c]
half=($BUDGET-$SECONDS-20)/2-50
print(max(1, min($EPOCHS, int(half/(391*c[0]['mean_step_ms']*1e-3))) if c else 1))")
fi
echo "== epochs per table run: $EPOCHS"
runs() {  # name dtype methods deadline
  echo "== table $1 ($2, $3) at ${SECONDS}s, deadline $4 s"
  python3 benchmarks/claims/cifar_table.py --data-dir "$DATA" --runs /tmp/runs_$1 \
    --throughput "$OUT/cifar_pack_throughput_gpu.json" --table "$OUT/table_$1.json" \
    --deadline-s "$4" --epochs $EPOCHS --dtype $2 --methods $3 --finish-s 20 $TX
}
if [ $(left) -lt 120 ]; then echo "== no time left for table runs at ${SECONDS}s"; else
runs safe_f32 float32 safe $(( ($(left) - 20) / 2 ))
runs safe_bf16 bfloat16 safe $(( $(left) - 15 ))
[ $(left) -gt 90 ] && runs admm_gmp_f32 float32 "admm gmp" $(( $(left) - 20 ))
fi
echo "== packing outputs at ${SECONDS}s"
tar czf "$OUT/runs.tar.gz" --exclude=checkpoints --exclude='*.safetensors' --exclude=tensorboard /tmp/runs_* 2>/dev/null
echo "== done at ${SECONDS}s"
