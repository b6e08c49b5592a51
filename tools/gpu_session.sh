#!/usr/bin/env bash
# One GPU-machine session: build, every test (GPU ones included), the demo, the long-context benchmark.
# Usage (on the device, from the repo root): bash tools/gpu_session.sh [bench args...]
# Writes logs and results under ${OUT:-results}; prints the benchmark table last.
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried to a machine without a package index
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
make native 2>&1 | tail -1
python3 -m attn_lt info | tee "$OUT/info.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfs tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
[ "${SKIP_DEMO:-0}" = 1 ] || timeout 120 python3 -m attn_lt demo 2>&1 | tee "$OUT/demo.log" | tail -8
timeout "${BENCH_TIMEOUT:-300}" python3 tools/bench_long_context.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
