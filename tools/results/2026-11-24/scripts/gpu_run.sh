#!/usr/bin/env bash
# One loan: bench_lt's GPU tests, its MLA decode section in full (Hq 128 at 8k-64k keys, Hq 16/32/64 at 32k, with
# the roofline columns), then bench_lt --quick; everything under $OUT/$NAME, packed into one tarball.
#   NAME=h100-2 [QUICK=1] bash tools/results/2026-11-24/scripts/gpu_run.sh
set -u
source tools/results/2026-11-24/scripts/setup.sh > /dev/null
O=$OUT/$NAME
mkdir -p "$O"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
t=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -rfs tests/test_bench_lt.py > "$O/tests.log" 2>&1
echo "tests: exit $? $((SECONDS - t)) s; $(tail -1 "$O/tests.log")"
t=$SECONDS
timeout 300 python3 tools/bench_lt.py --sections mla_decode --out "$O/mla-decode" > "$O/mla-decode.log" 2>&1
echo "bench_lt --sections mla_decode: exit $? $((SECONDS - t)) s"
if [ -n "${QUICK:-}" ]; then
  t=$SECONDS
  timeout 240 python3 tools/bench_lt.py --quick --out "$O/quick" > "$O/quick.log" 2>&1
  echo "bench_lt --quick: exit $? $((SECONDS - t)) s"
  grep -h "MISSED\|met:" "$O/quick.log" | sed 's/ (B[^)]*)//' | cut -c1-150
fi
tar -C "$OUT" -czf "$OUT/$NAME.tgz" "$NAME"
grep -A12 "^MLA decode" "$O/mla-decode.log" | cut -c1-260
rm -rf "${O:?}"
