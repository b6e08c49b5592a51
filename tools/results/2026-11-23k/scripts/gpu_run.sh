#!/usr/bin/env bash
# One loan: the softmax and long-path GPU tests, memcheck on the softmax kernels, the causal A/B (ab_causal.sh),
# bench_lt --quick with and without --settle-ms; everything under $OUT/$NAME, packed into one tarball.
#   NAME=h200-1 AB_ROUNDS=2 QUICK="100 0 100" [HOST_AB=1] [SUITE=1] [TESTS=...] [MEMCHECK=]
#     bash tools/results/2026-11-23k/scripts/gpu_run.sh
set -u
source tools/results/2026-11-23k/scripts/setup.sh > /dev/null
O=$OUT/$NAME
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
t=$SECONDS
timeout 300 python3 -m pytest -q -m gpu -rfs ${TESTS:-tests/test_softmax_gpu.py tests/test_lt_gpu.py tests/test_lt_features_gpu.py} > "$O/tests.log" 2>&1
echo "tests: exit $? $((SECONDS - t)) s; $(tail -1 "$O/tests.log")"
if [ -n "${MEMCHECK-1}" ]; then
  timeout 120 compute-sanitizer --tool memcheck --kernel-name kns=softmax --error-exitcode 9 python3 tools/sanitize_lt.py \
    > "$O/memcheck.log" 2>&1
  echo "memcheck (softmax kernels): exit $?; $(tail -1 "$O/memcheck.log")"
fi
if [ -n "${HOST_AB:-}" ]; then  # lt's decode call without / with the mass: host and GPU time
  timeout 200 python3 tools/results/2026-11-23j/scripts/decode_lt_host.py > "$O/decode_lt_host.log" 2>&1
  echo "decode_lt_host: exit $?"; grep -E "host .* gpu" "$O/decode_lt_host.log"
fi
if [ -n "${SUITE:-}" ]; then  # the suite's quick run with the default protocol (settling included)
  t=$SECONDS
  timeout 420 python3 tools/bench.py run --quick --out "$O/suite" > "$O/suite.log" 2>&1
  echo "suite --quick: exit $? $((SECONDS - t)) s"; tail -4 "$O/suite.log" | cut -c1-200
fi
if [ "${AB_ROUNDS:-0}" -gt 0 ]; then OUT=$O ROUNDS=$AB_ROUNDS bash tools/results/2026-11-23k/scripts/ab_causal.sh | tail -12; fi
i=0
for st in ${QUICK:-100}; do
  i=$((i + 1))
  t=$SECONDS
  timeout 240 python3 tools/bench_lt.py --quick --settle-ms "$st" --out "$O/lt-$i-settle$st" > "$O/lt-$i-settle$st.log" 2>&1
  echo "bench_lt --quick --settle-ms $st ($i): exit $? $((SECONDS - t)) s"
  grep -h "MISSED\|met:" "$O/lt-$i-settle$st.log" | sed 's/ (B[^)]*)//' | cut -c1-150
done
tar -C "$OUT" -czf "$OUT/$NAME.tgz" "$NAME" && rm -rf "${O:?}"
