python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
python native/build.py > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
timeout 100 python -m pytest -x -q -p no:cacheprovider tests/test_batch_gpu.py 2>&1 | tail -5
timeout 120 python tools/bench_batch.py --out $OUT 2>&1 | tail -12
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python tools/dev/sanitize_batch.py > $OUT/memcheck.txt 2>&1; echo memcheck rc=$?; tail -4 $OUT/memcheck.txt
timeout 200 python -m pytest -q -p no:cacheprovider tests/ -m gpu --deselect tests/test_batch_gpu.py 2>&1 | tail -8 | tee $OUT/gpu_suite.txt
