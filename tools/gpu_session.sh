#!/usr/bin/env bash
# One GPU-machine session: build, every test (GPU ones included), the demo, then the benchmark suite.
# Usage (on the device, from the repo root): bash tools/gpu_session.sh [tools/bench.py run arguments...]
#   SKIP_TESTS=1 / SKIP_DEMO=1 leave those out; with no arguments no benchmark runs.
# Writes logs under ${OUT:-results} and the benchmark's files where its --out says; prints its table last.
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
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfs tests ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  tail -3 "$OUT/pytest.log"
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  timeout 120 python3 -m attn_lt demo > "$OUT/demo.log" 2>&1
  tail -2 "$OUT/demo.log"
fi
[ $# -eq 0 ] || timeout "${BENCH_TIMEOUT:-560}" python3 tools/bench.py run "$@"
