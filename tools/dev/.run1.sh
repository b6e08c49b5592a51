python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
python native/build.py > $OUT/build.txt 2>&1 || { tail -30 $OUT/build.txt; exit 1; }
tail -1 $OUT/build.txt
timeout 260 python -m pytest -x -q -p no:cacheprovider tests/test_batch_gpu.py 2>&1 | tail -40 | tee $OUT/test_batch.txt
timeout 150 python tools/bench_batch.py --quick --out $OUT 2>&1 | tail -15
