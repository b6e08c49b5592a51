# Sourced at the start of each device command: the carried nvmath wheel, this tree's library unpacked from
# ab_new/ (the carry limit leaves no room for the plain .so beside the results), nothing rebuilt.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p attn_lt/_native && xz -dc ab_new/libattn_lt.so.xz > attn_lt/_native/libattn_lt.so
touch build/native/*.o && touch attn_lt/_native/libattn_lt.so
make native 2>&1 | tail -1
