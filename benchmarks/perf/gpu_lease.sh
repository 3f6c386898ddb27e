#!/bin/bash
# GPU lease measurements for issue 31 (CIFAR throughput) and issue 33 (the LLM block step).
# The 2026-11-28 H200 lease ran steps 1, 2, 3a, 3b and 4 (benchmarks/perf/results/leases/
# 2026-11-28_h200_*): its processes, MPS, packed-convolution and im2col cells are committed, and
# step 4 failed there (the parent's preallocated memory starved its children; fixed since).
#
# The next lease, in the order that finishes the issues' items first (one lease is 900 s with the
# machine's start, about 45 s; leases are rare, so what closes an item goes first):
#   call 1: STEPS="4 5" (at most about 440 s: 160 s a dtype, 120 s step 5): issue 31 item 2's
#           GPU report (step 4) and issue 33 item 4's SparseGPT on the GPU (step 5);
#   calls 2-3 on the same warm machine: the SAFE / SAFE+ pieces of issue 33 (llm_gpu_lease.sh
#           receive, then run with RUN_S=330 DEADLINE_S=210 to fit what is left: about 2 pieces);
#   the lease after: STEPS="7 2 3c" (at most about 400 s: the measurements that name issue 31's
#           next layout), then more LLM pieces; 6 where time is left.
# What each step measures:
#   7. one lone run's step at batch 512 and 2048 beside 128 (float32): the images/s a step reaches
#      when its kernels are larger, the ceiling of any pack (a pack of N runs is N x 128 images a
#      step, in N times as many kernels or in grouped ones);
#   2. lone runs in 3 and 6 processes under NVIDIA's MPS daemon, bfloat16 first (only float32 3p was
#      measured under MPS), where the machine has the daemon;
#   3c. bfloat16 packs of the models' im2col convolutions (15 and 30): a float32 im2col pack of 15
#      gained over the lone run where XLA's grouped convolutions lost;
#   4. SAFE in float32 against bfloat16, 3 seeds, a few epochs of real CIFAR-10 (issue 31 item 2's
#      GPU report), each in the layout the committed and this call's cells say trains the cell
#      soonest (cifar_table.py --layout auto);
#   5. SparseGPT on the LLaMA-2-7B-shaped block (SAFE and SAFE+ are in
#      results/leases/2026-11-27_h200_llm_7b_block.log);
#   6. SAFE's LLM block step with the calibration windows on the device against minibatches sent
#      from the host (llm_safe_step.py) on the 7B-shaped block, about 2 minutes (SmolLM2's block,
#      and its pack of 3 calibration seeds, are in llm_safe_step_gpu.json since the 2026-11-28
#      lease; S6=SECONDS times it again).
# Steps done on the 2026-11-28 lease, kept for a rerun: 1 (processes without MPS), 3a (one packed
# convolution three ways), 3b (the models' im2col convolutions, lone and in packs of 15), 3
# (bfloat16 packs of 15 and 30).
# Each step has its own timeout and writes its JSON as it goes, so a step cut short keeps its cells.
#
# Prepare here once: `bash benchmarks/perf/gpu_lease.sh prepare` fills .gpu/ (git-excluded) with the
# wheels the device image lacks (ml_collections, tensorboardX, at the versions installed here) and
# CIFAR-10 as cifar10_jpg.tar.gz (the loader's JPEG archive, about 20 MB, found through
# safe_optax.data_paths).
# Then: run(command="bash benchmarks/perf/gpu_lease.sh", carry=[".gpu"], timeout_s=480) runs the
# default STEPS, "4 5" (call 1 above); each step has its own timeout (S1..S6B, seconds). All steps
# together take longer than one call: STEPS picks some, e.g. STEPS="7 2 3c" on the next lease.
# Check it on a CPU first: DRY=1 bash benchmarks/perf/gpu_lease.sh (dry-run cells, no 7B block).
set -u
export PYTHONUNBUFFERED=1
STEPS=" ${STEPS:-4 5} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
if [ "${1:-}" = prepare ]; then
  mkdir -p .git/info && { grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude; }
  rm -rf .gpu && mkdir -p .gpu
  for name in ml_collections tensorboardX; do
    version=$(python3 -c "import importlib.metadata as m; print(m.version('$name'))") || exit 2
    python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu "$name==$version" || exit 2
  done
  cifar=$(python3 -c "from safe_optax import data_paths; print(data_paths.require('cifar10/cifar10_jpg.tar.gz'))") || exit 2
  cp "$cifar" .gpu/cifar10_jpg.tar.gz && du -sh .gpu && ls .gpu
  exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
if compgen -G ".gpu/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
python3 -c "import jax,flax,optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())" || exit 4
B=benchmarks/perf/cifar_pack_throughput.py
DRY_FLAG=${DRY:+--dry-run}
# a timeout kills the benchmark, not the --processes children it started: end those too. $OUT is
# empty on each call: the measured JSONs are also kept in $KEEP for a later call's step 4
KEEP=${KEEP:-/tmp/gpu_lease_keep}; mkdir -p "$KEEP"
reap() { pkill -9 -f "cifar_pack_throughpu[t].py" 2>/dev/null; cp "$OUT"/cifar_*_gpu.json "$KEEP" 2>/dev/null; true; }
if want 7; then
echo "== 7. one lone run at larger batches, at ${SECONDS}s"
for b in 128 ${S7_BATCHES:-512 2048}; do
  timeout -s KILL ${S7:-45} python3 $B --models resnet20x2 --dtypes float32 --packs 1 --batch $b \
    $DRY_FLAG --out "$OUT/cifar_batch${b}_gpu.json" || echo "step 7 batch $b: rc $?"
done
fi
if want 1; then
echo "== 1. processes, no MPS, at ${SECONDS}s"
timeout -s KILL ${S1:-120} python3 $B --models resnet20x2 --packs 1 --processes 3 6 $DRY_FLAG \
  --deadline-s ${D1:-80} --out "$OUT/cifar_processes_gpu.json" || echo "step 1: rc $?"
reap
fi
if want 2; then
echo "== 2. processes under MPS at ${SECONDS}s"
fi
if want 2 && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  timeout -s KILL ${S2:-150} python3 $B --models resnet20x2 --dtypes ${S2_DTYPES:-bfloat16 float32} \
    --packs --processes 3 6 $DRY_FLAG \
    --deadline-s ${D2:-100} --out "$OUT/cifar_processes_mps_gpu.json" || echo "step 2: rc $?"
  reap
  echo quit | nvidia-cuda-mps-control
elif want 2; then
  echo "no MPS daemon here"
fi
if want 3a; then
echo "== 3a. packed convolutions: grouped, im2col, loop, at ${SECONDS}s"
timeout -s KILL ${S3A:-60} python3 -m benchmarks.perf.packed_conv --runs 3 15 \
  ${DRY:+--batch 8 --steps 1} --out "$OUT/packed_conv_gpu.json" || echo "step 3a: rc $?"
fi
if want 3b; then
echo "== 3b. the models' im2col convolutions, lone and packed, at ${SECONDS}s"
timeout -s KILL ${S3B:-120} python3 $B --models resnet20x2 --conv-impls im2col xla --packs 1 15 \
  $DRY_FLAG --deadline-s ${D3B:-90} --out "$OUT/cifar_im2col_gpu.json" || echo "step 3b: rc $?"
reap
fi
if want 3c; then
echo "== 3c. bfloat16 packs of im2col convolutions at ${SECONDS}s"
timeout -s KILL ${S3C:-110} python3 $B --models resnet20x2 --dtypes bfloat16 --conv-impls im2col xla \
  --packs 1 15 30 $DRY_FLAG --deadline-s ${D3C:-80} --out "$OUT/cifar_im2col_bf16_gpu.json" \
  || echo "step 3c: rc $?"
reap
fi
if want 3; then
echo "== 3. bfloat16 packs at ${SECONDS}s"
timeout -s KILL ${S3:-45} python3 $B --models resnet20x2 --dtypes bfloat16 --packs 15 30 $DRY_FLAG \
  --out "$OUT/cifar_bf16_packs_gpu.json" || echo "step 3: rc $?"
reap
fi
if want 4; then
S4=${S4:-$([ -n "${DRY:-}" ] && echo 420 || echo 160)}  # seconds for each dtype
EPOCHS=${EPOCHS:-$([ -n "${DRY:-}" ] && echo 1 || echo 2)}
echo "== 4. SAFE float32 against bfloat16, 3 seeds, $EPOCHS epochs, at ${SECONDS}s"
fi
if want 4 && [ -f .gpu/cifar10_jpg.tar.gz ]; then
  # a CPU step of ResNet-20x2 at batch 128 takes about 18 s (results/cifar_batch128_cpu.json):
  # the dry run trains one step a run
  TX=${DRY:+--train-subset 128 --test-subset 256}
  THROUGHPUT=benchmarks/perf/results/cifar_pack_throughput_${DRY:+cpu_dry_run}.json
  [ -z "${DRY:-}" ] && THROUGHPUT=benchmarks/perf/results/cifar_pack_throughput_gpu.json
  # with steps 1-2's cells, --layout auto may take lone runs in processes (under MPS where it runs)
  [ -z "${DRY:-}" ] && THROUGHPUT="$THROUGHPUT $(ls benchmarks/perf/results/cifar_processes*_gpu.json | tr '\n' ' ')"
  THROUGHPUT="$THROUGHPUT $(ls "$KEEP"/cifar_*_gpu.json 2>/dev/null | tr '\n' ' ')"
  MPS_ON=""
  # a lone bfloat16 2-epoch run on the H200 spent 63 s outside its steps (2026-11-28, leases/
  # 2026-11-28_h200_table_safe_bfloat16_partial.json: wall 68.6 s, 5 s of steady steps)
  FINISH4=20; START4=45  # a CPU dry run starts and finishes its tiny runs sooner
  [ -n "${DRY:-}" ] && FINISH4=5 && START4=5
  if [ -z "${DRY:-}" ] && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
    MPS_ON=1
  fi
  for dtype in float32 bfloat16; do
    timeout -s KILL $S4 python3 -m benchmarks.claims.cifar_table \
      --data-dir .gpu/cifar10_jpg.tar.gz --runs /tmp/runs_$dtype --methods safe \
      --throughput $THROUGHPUT --epochs $EPOCHS \
      --dtype $dtype --deadline-s $(( S4 - 15 )) --finish-s $FINISH4 --start-s $START4 $TX \
      --table "$OUT/table_safe_$dtype.json" || echo "step 4 $dtype: rc $?"
    pkill -9 -f "cifar_tabl[e].py" 2>/dev/null  # a --layout processes child the timeout left
  done
  [ -n "$MPS_ON" ] && echo quit | nvidia-cuda-mps-control
  # bfloat16 - float32 per seed, under the evidence report's rules ("level": within seed noise)
  if [ -f "$OUT/table_safe_bfloat16.json" ] && [ -f "$OUT/table_safe_float32.json" ]; then
    python3 -m benchmarks.claims.cifar_table --compare "$OUT/table_safe_bfloat16.json" \
      "$OUT/table_safe_float32.json" | tee "$OUT/precision_compare.json" || echo "compare: rc $?"
  else
    echo "compare skipped: a table is missing (see the step's rc above)"
  fi
elif want 4; then
  echo "no .gpu/cifar10_jpg.tar.gz: step 4 skipped"
fi
if want 5 && [ -z "${DRY:-}" ]; then
  echo "== 5. 7B block at ${SECONDS}s"
  timeout -s KILL ${S5:-120} python3 -m benchmarks.perf.llm_7b_block --windows 2 --seqlen 2048 \
    --steps 10,210 --sparsegpt-windows 8 --methods sparsegpt --out "$OUT/llm_7b_block_gpu.json" \
    || echo "step 5: rc $?"
  # the timeout kills the script, not its --worker, which would hold the GPU through the LLM calls
  pkill -9 -f "llm_7b_block.p[y]" 2>/dev/null
fi
if want 6; then
  echo "== 6. LLM SAFE step, calibration on the device or from the host, at ${SECONDS}s"
  L=benchmarks/perf/llm_safe_step.py
  # SmolLM2's block is committed (llm_safe_step_gpu.json): S6=SECONDS times it again
  if [ -n "${S6:-}" ] || [ -n "${DRY:-}" ]; then
    timeout -s KILL ${S6:-180} python3 $L --packs 3 ${DRY:+--windows 4 --seqlen 16 --batch-size 2 --epochs 1,2 --repeats 1} \
      --out "$OUT/llm_safe_step_gpu.json" || echo "step 6 smollm2: rc $?"
  fi
  [ -z "${DRY:-}" ] && { timeout -s KILL ${S6B:-120} python3 $L --shape llama7b --windows 2 \
    --seqlen 2048 --batch-size 2 --epochs 10,60 --repeats 2 --out "$OUT/llm_safe_step_7b_gpu.json" \
    || echo "step 6 llama7b: rc $?"; }
fi
echo "== done at ${SECONDS}s"
