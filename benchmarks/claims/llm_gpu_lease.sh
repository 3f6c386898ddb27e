#!/bin/bash
# SAFE / SAFE+ rows of the standard protocol (issue 33 item 2) on a GPU lease.
#
# The SmolLM2-135M GGUF (about 98 MB) is more than a device call carries (64 MiB with the tree),
# so it travels in two halves, on two calls to the same warm machine (the second within its 30 s
# idle window), and is checked against its SHA-256 there:
#
#   bash benchmarks/claims/llm_gpu_lease.sh prepare           # here, once: .llm/a, .llm/b
#   run(command="bash benchmarks/claims/llm_gpu_lease.sh receive", carry=[".llm/a"], timeout_s=60)
#   run(command="bash benchmarks/claims/llm_gpu_lease.sh run", carry=[".llm/b"], timeout_s=560)
#   then here: tar xzf <files_at>/pieces.tar.gz; python -m benchmarks.report
#
# After a gpu_lease.sh call on the same lease (its header's plan), `run` gets what is left of the
# lease's 900 s: e.g. RUN_S=330 DEADLINE_S=210 bash benchmarks/claims/llm_gpu_lease.sh run.
#
# Optional, on any call of the lease (it needs no model): SAFE's block step with the calibration
# on the device against minibatches from the host (docs/performance.md), about a minute there:
#   run(command="python3 -m benchmarks.perf.llm_safe_step --out $OUT/llm_safe_step_gpu.json",
#       timeout_s=150)
#
# Where the pack steps each calibration seed at least PACK_MIN (1.2) times as fast as a lone prune,
# the prunes run packed (llm_standard.py --pack: one command for a method's 3 seeds). `run` reads
# that from the committed H200 timing, benchmarks/perf/results/llm_safe_step_gpu.json
# (device_over_pack), when the device is the one it was measured on; on another device it first
# times SAFE's block step alone and in a pack of 3 (llm_safe_step.py --packs 3, about a minute and
# a half; its JSON comes back as llm_safe_step_gpu.json). PACK=0 or PACK=1 decides without either.
# It then works through llm_standard.py's pending SAFE+ and SAFE pieces (3 calibration seeds each,
# lr / lambda / steps from the committed selection; NM=2:4 for the 2:4 pieces, from the 2:4 study), starts none past DEADLINE_S (380) and stops the
# last at RUN_S (500); the finished pieces' JSON comes back in pieces.tar.gz. Another `run` call on
# the same warm machine continues a prune stopped part-way from its next block (its work folder is
# under $STAGE); a later lease resumes with the pieces still pending, and a piece stopped part-way
# there starts over (its state goes with the machine).
# `DRY=1 bash benchmarks/claims/llm_gpu_lease.sh receive && DRY=1 ... run` checks it here: the
# halves join to the same file, the GGUF loads, and the pieces are listed instead of run.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGE=${STAGE:-/tmp/safe_optax_llm_lease}
case "${1:-}" in
prepare)
  model=$(python3 -c "from benchmarks.claims import llm_results; print(llm_results.gguf_path())") || exit 2
  grep -qx "/.llm/" .git/info/exclude 2>/dev/null || echo "/.llm/" >> .git/info/exclude
  rm -rf .llm; mkdir -p .llm/a .llm/b/data/wikitext-2-raw .llm/b/data/wikitext-2 .llm/b/wheels
  half=$(( ($(stat -c %s "$model") + 1) / 2 ))
  head -c $half "$model" > .llm/a/model.part
  tail -c +$(( half + 1 )) "$model" > .llm/b/model.part
  sha256sum < "$model" | cut -d' ' -f1 > .llm/b/model.sha256
  python3 - <<'PY' || exit 2
import shutil
from benchmarks.claims import llm_results
shutil.copy(llm_results.EVALS["wikitext2"], ".llm/b/data/wikitext-2-raw/wiki.test.raw")
shutil.copy(llm_results.CALIB, ".llm/b/data/wikitext-2/valid.txt")
PY
  version=$(python3 -c "import importlib.metadata as m; print(m.version('gguf'))")
  python3 -m pip download -q --no-deps --only-binary=:all: -d .llm/b/wheels "gguf==$version" || exit 2
  du -sh .llm/a .llm/b
  ;;
receive)
  mkdir -p "$STAGE" && cp .llm/a/model.part "$STAGE/model.part_a" && ls -l "$STAGE"
  ;;
run)
  [ -f "$STAGE/model.part_a" ] || { echo "no $STAGE/model.part_a: the receive call went to another machine (or was not made)"; exit 3; }
  cat "$STAGE/model.part_a" .llm/b/model.part > "$STAGE/model.gguf"
  [ "$(sha256sum < "$STAGE/model.gguf" | cut -d' ' -f1)" = "$(cat .llm/b/model.sha256)" ] \
    || { echo "the joined GGUF does not match its SHA-256"; exit 4; }
  if [ -z "${DRY:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" .llm/b/wheels/*.whl || exit 5
    export PYTHONPATH=$STAGE/site:$PWD
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  fi
  export SAFE_OPTAX_DATA=$PWD/.llm/b/data SAFE_OPTAX_REQUIRE_DATA=1
  pack=${PACK:-}
  decide() { python3 -m benchmarks.perf.llm_safe_step --pack-decision "$1" --pack-min "${PACK_MIN:-1.2}" 2>/dev/null; }
  TIMED=benchmarks/perf/results/llm_safe_step_gpu.json
  if [ -z "$pack" ] && [ -z "${DRY:-}" ] && [ -f "$TIMED" ]; then
    pack=$(decide "$TIMED")  # the committed timing, where this device is the one it was measured on
    [ -n "$pack" ] && echo "pack decided from $TIMED"
  fi
  if [ -z "$pack" ]; then
    timeout -s KILL ${PACK_S:-120} python3 -m benchmarks.perf.llm_safe_step --layouts device --packs 3 --repeats 1 \
      --epochs 1,3 ${DRY:+--windows 4 --seqlen 16 --batch-size 2 --epochs 1,2} \
      --out "$OUT/llm_safe_step_gpu.json" > "$OUT/llm_safe_step.log" 2>&1 || echo "llm_safe_step.py: rc $?"
    tail -6 "$OUT/llm_safe_step.log"
    pack=$(decide "$OUT/llm_safe_step_gpu.json")
    pack=${pack:-0}
  fi
  echo "packed prunes: $pack"
  [ "$pack" = 1 ] && packflag=--pack || packflag=
  python3 -c "import jax, gguf; from safe_optax.llm import checkpoints; c, _ = checkpoints.load_gguf('$STAGE/model.gguf'); print(jax.__version__, jax.devices(), c.num_layers, 'layers')" || exit 6
  # a piece started just before the deadline may outrun the call: the timeout keeps time for the tar
  timeout -s KILL ${RUN_S:-500} python3 -m benchmarks.claims.llm_standard --methods ${METHODS:-safe-plus safe} ${NM:+--nm "$NM"} \
    --model "$STAGE/model.gguf" --work "$STAGE/work" --deadline-s ${DEADLINE_S:-380} $packflag ${DRY:+--list} \
    > "$OUT/llm_standard.log" 2>&1 || echo "llm_standard.py: rc $?"
  tail -5 "$OUT/llm_standard.log"
  tar czf "$OUT/pieces.tar.gz" results/llm_pruning/standard
  echo "done at ${SECONDS}s"
  ;;
*)
  echo "usage: $0 prepare|receive|run"; exit 1
  ;;
esac
