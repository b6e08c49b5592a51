#!/usr/bin/env bash
# One GPU-machine session: carried wheels, the build, then the phases named in PHASES, each logged under
# ${OUT:-results}/<phase>.log with its last lines printed (a short table last).
#   PHASES="tests sanitize calibrate sm90 serving lt suite generate cp" bash tools/dev/gpu_session.sh
#   tests      GPU tests (pytest -m gpu $TEST_ARGS, default tests) sanitize  compute-sanitizer on both fused kernels
#   sanitize-flash  compute-sanitizer on native/flash.cu only     sanitize-lt  on the long path (softmax, merge)
#   tiles      long keys: key tiles vs whole rows vs SDPA (bench_key_tiles)
#   calibrate  attn-lt calibrate --ship attn_lt/calibrations       sm90      the FA3 protocol vs SDPA (bench_flash_sm90)
#   serving    decode loop, prefill, host cost (bench_serving)     lt        the long path's figures (bench_lt)
#   suite      tools/bench.py run $SUITE_ARGS (default --quick)    generate  Hugging Face generate() (bench_generate)
#   decode     the suite's decode group (masks too) vs cuDNN       masked    the masked fa3 and long rows vs cuDNN
#   cp         context parallelism on every GPU (tests + bench_cp)
#   probe      the long path's key tiles under several caps (probe_long_rows $PROBE_ARGS)
#   scores     Q@K^T alone: cuBLASLt against native/scores_sm90.cu (bench_scores $SCORES_ARGS)
#   sanitize-scores  compute-sanitizer on native/scores_sm90.cu
#   batch      serving batches (bench_batch $BATCH_ARGS)          variants  window, sinks, softcap (bench_variants)
#   mass       the attention mass per key (bench_key_mass)        sanitize-serving  memcheck: batches, mass, variants
#   fp8        FP8 KV caches against bf16 (bench_fp8_kv)
#   fp8-prefill  the FP8 prefill (e4m3 q, k, v) against bf16 and SDPA (bench_fp8_prefill)
#   figures-prefill / figures-serving / figures-variants  the figures the open issues ask of each GPU, each within
#              one device call of 10 minutes: sm90 fp8-prefill / fp8 batch / variants mass
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to a machine without a package index
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
make native 2>&1 | tail -1
python3 -m attn_lt info > "$OUT/info.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader

phase() {  # phase NAME TIMEOUT COMMAND...: run, log, print the tail
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$OUT/$name.log" | cut -c1-220
}

PHASES=${PHASES:-tests}
PHASES=${PHASES//figures-prefill/sm90 fp8-prefill}
PHASES=${PHASES//figures-serving/fp8 batch}
PHASES=${PHASES//figures-variants/variants mass}
for p in $PHASES; do
  case $p in
    tests) phase tests 300 python3 -m pytest -q -m gpu -rfs ${TEST_ARGS:-tests} ;;
    sanitize)
      phase memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_flash_sm90.py
      phase racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/dev/sanitize_flash_sm90.py
      ;&
    sanitize-flash)
      phase memcheck-flash 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_flash.py
      phase racecheck-flash 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/dev/sanitize_flash.py ;;
    calibrate) phase calibrate 200 python3 -m attn_lt calibrate --ship attn_lt/calibrations
      cp attn_lt/calibrations/*.json "$OUT/" 2>/dev/null ;;
    sm90) phase sm90 240 python3 tools/bench_flash_sm90.py --out "$OUT/sm90" ;;
    serving) phase serving 200 python3 tools/bench_serving.py ${SERVING_ARGS:---steps 1000} --out "$OUT/serving" ;;
    host) phase host 120 python3 tools/experiments/host_breakdown.py --sk 4096 --growth 300 --json "$OUT/host.json" ;;
    sanitize-lt)
      phase memcheck-lt 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_lt.py
      phase racecheck-lt 200 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/dev/sanitize_lt.py ;;
    tiles) phase tiles 420 python3 tools/experiments/bench_key_tiles.py ${TILES_ARGS:-} --out "$OUT/tiles" ;;
    scores) phase scores 300 python3 tools/experiments/bench_scores.py ${SCORES_ARGS:-} --json "$OUT/scores.json" ;;
    sanitize-scores)
      phase memcheck-scores 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_scores.py
      phase racecheck-scores 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/dev/sanitize_scores.py ;;
    probe) phase probe 400 python3 tools/experiments/probe_long_rows.py ${PROBE_ARGS:-} ;;
    lt) phase lt 260 python3 tools/bench_lt.py ${LT_ARGS:-} --out "$OUT/lt" ;;
    suite) phase suite 560 python3 tools/bench.py run ${SUITE_ARGS:---quick} --out "$OUT/suite" ;;
    decode) phase decode 400 python3 tools/bench.py run --groups decode --providers auto,lt,wmma,cudnn,flash,efficient \
      --rep-ms 60 --rounds 5 --out "$OUT/decode" ;;
    masked) phase masked 400 python3 tools/bench.py run --groups fa3,long --providers auto,lt,wmma,cudnn \
      --cases mask --rep-ms 60 --rounds 3 --out "$OUT/masked" ;;
    generate) phase generate 300 python3 tools/bench_generate.py ${GENERATE_ARGS:-} --out "$OUT/generate" ;;
    batch) phase batch 200 python3 tools/bench_batch.py ${BATCH_ARGS:-} --out "$OUT/batch" ;;
    variants) phase variants 200 python3 tools/bench_variants.py --out "$OUT/variants" ;;
    mass) phase mass 200 python3 tools/bench_key_mass.py --out "$OUT/mass" ;;
    fp8) phase fp8 200 python3 tools/bench_fp8_kv.py --out "$OUT/fp8" ;;
    fp8-prefill) phase fp8-prefill 300 python3 tools/bench_fp8_prefill.py --out "$OUT/fp8_prefill" ;;
    sanitize-serving)
      phase memcheck-batch 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_batch.py
      phase memcheck-mass 120 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_mass.py
      phase memcheck-variants 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 tools/dev/sanitize_variants.py ;;
    cp)
      n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      phase cp-tests 200 python3 -m pytest -q -m gpu -rfs tests/test_distributed.py
      phase cp 420 torchrun --nproc-per-node "$n" tools/bench_cp.py ${CP_ARGS:-} --out "$OUT/cp" ;;
    *) echo "unknown phase $p" ;;
  esac
done
