#!/usr/bin/env bash
# A/B of the softmax that skips loading scores past a row's causal limit: the causal rows of bench_lt with main's
# library (ab_old/libattn_lt.so.xz unpacked to /tmp/ab_old.so, through ATTN_LT_LIB) and this tree's, in alternating processes.
#   OUT=dir ROUNDS=2 bash tools/results/2026-11-23k/scripts/ab_causal.sh
set -u
OUT=${OUT:-results}/ab
[ -f /tmp/ab_old.so ] || xz -dc ab_old/libattn_lt.so.xz > /tmp/ab_old.so
mkdir -p "$OUT"
ONLY=${ONLY:-mla-prefill,overlap-d128-causal,overlap-d64-causal}
for i in $(seq 1 "${ROUNDS:-2}"); do
  for build in old new; do
    if [ $build = old ]; then lib=/tmp/ab_old.so; else lib=; fi
    ATTN_LT_LIB=$lib timeout 200 python3 tools/bench_lt.py --only "$ONLY" --rounds 3 --rep-ms 100 --warm-up-s 1 \
      --no-profile --out "$OUT/$build-$i" > "$OUT/$build-$i.log" 2>&1
    echo "$build-$i: exit $?"
  done
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os, statistics
out = sys.argv[1]
by = {}
for f in sorted(glob.glob(f"{out}/*/lt.json")):
    build = os.path.basename(os.path.dirname(f)).split("-")[0]
    for r in json.load(open(f))["rows"]:
        if r.get("status") == "ok":
            by.setdefault((r["case"], r["provider"]), {}).setdefault(build, []).append(r["ms"])
print(f"{'case':22s} {'provider':10s} {'old ms':>16s} {'new ms':>16s} new/old")
for (case, p), d in sorted(by.items()):
    o, n = d.get("old", []), d.get("new", [])
    ratio = f"{statistics.median(n) / statistics.median(o):.3f}" if o and n else "-"
    print(f"{case:22s} {p:10s} {' '.join(f'{x:.3f}' for x in o):>16s} {' '.join(f'{x:.3f}' for x in n):>16s} {ratio}")
PY
