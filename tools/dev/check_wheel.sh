#!/usr/bin/env bash
# Build a wheel of this checkout, install it into a clean folder, and run the demo and the GPU tests from the
# installed package (not from the checkout): what a user who installs the wheel on a GPU machine gets.
#   bash tools/dev/check_wheel.sh [PYTEST_ARGS...]        (default: -q -m gpu tests)
# WORK (default /tmp/attn_lt_wheel) holds dist/, the install (site/) and a copy of tests/ and tools/. Offline
# machines: the build uses the installed setuptools (--no-build-isolation); extra packages the tests need (such
# as nvmath-python) come from PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/attn_lt_wheel}
rm -rf "$WORK" && mkdir -p "$WORK"
t0=$SECONDS
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" . || exit 1
whl=$(ls "$WORK"/dist/*.whl)
echo "== wheel: $(basename "$whl"), $(du -h "$whl" | cut -f1), built in $((SECONDS - t0)) s"
python3 -m zipfile -l "$whl" | grep -E "_native/|BUILD" | awk '{print "   ", $1, $NF}'
python3 -m pip install -q --no-deps --no-index --target "$WORK/site" "$whl" || exit 1
for so in "$WORK"/site/attn_lt/_native/*.so; do
  echo "== $(basename "$so"): $(readelf -d "$so" | grep -cE 'RPATH|RUNPATH') rpath entries," \
       "$(strings "$so" | grep -cE "$PWD|/tmp/|pip-build-env") strings naming build paths"
done
mkdir -p "$WORK/run" && cp -r tests tools pyproject.toml "$WORK/run/"  # pyproject.toml: the test markers
export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
cd "$WORK/run" || exit 1
python3 -c "import attn_lt, sys; assert attn_lt.__file__.startswith('$WORK/site'), attn_lt.__file__; print('== attn_lt from', attn_lt.__file__)"
python3 -m attn_lt info | grep -E "native|fast path|GPU" | sed 's/^/   /'
echo "== demo"; python3 -m attn_lt demo; echo "== demo exit $?"
if [ $# -eq 0 ]; then set -- -q -m gpu tests; fi
echo "== pytest $*"; python3 -m pytest -p no:cacheprovider "$@"
