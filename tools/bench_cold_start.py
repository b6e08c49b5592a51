#!/usr/bin/env python3
"""A fresh process's first attention call: attn_lt against PyTorch SDPA, each in new processes, alternating.

    python tools/bench_cold_start.py [--rounds 5] [--shape 1,32,8,8192,128] [--profile] [--json FILE]

Each process imports torch and makes its inputs on the GPU first (the CUDA context is not counted), then times
(wall clock, the GPU synchronised) the import of the library (attn_lt, or torch.nn.functional for SDPA) and its
first call: attn_lt.attention(q, k, v, causal=True) against F.scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True). ``--profile`` adds one more attn_lt process under cProfile and prints where its import and first
call spend their time. ``--tree DIR`` runs another checkout's attn_lt (an A/B of two versions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
B, Hq, Hkv, S, D = {shape}
q = torch.randn(B, Hq, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
torch.cuda.synchronize()
prof = None
if {profile}:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t0 = time.perf_counter()
if "{provider}" == "attn_lt":
    import attn_lt
    fn = lambda: attn_lt.attention(q, k, v, causal=True)
else:
    import torch.nn.functional as F
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
t1 = time.perf_counter()
out = fn()
torch.cuda.synchronize()
t2 = time.perf_counter()
if prof is not None:
    prof.disable()
    import io, pstats
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    sys.stderr.write(s.getvalue())
t3 = time.perf_counter()
fn(); torch.cuda.synchronize()
t4 = time.perf_counter()
print(json.dumps({{"import_ms": (t1 - t0) * 1e3, "first_ms": (t2 - t1) * 1e3, "second_ms": (t4 - t3) * 1e3}}))
"""


def run_child(provider: str, shape: tuple, profile: bool, tree: str | None) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    code = CHILD.format(shape=shape, profile=profile, provider=provider)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    if proc.returncode != 0:
        raise RuntimeError(f"{provider} process failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if profile:
        res["profile"] = proc.stderr
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="1,32,8,8192,128", help="B,Hq,Hkv,S,D (bf16, causal)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tree", default=None, help="import attn_lt from this checkout instead")
    ap.add_argument("--label", default="attn_lt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    shape = tuple(int(x) for x in a.shape.split(","))
    rows: dict[str, list[dict]] = {"attn_lt": [], "sdpa": []}
    for _ in range(a.rounds):
        for provider in rows:
            rows[provider].append(run_child(provider, shape, False, a.tree))
    out = {"shape": shape, "label": a.label, "rounds": rows}
    print(f"cold start, B,Hq,Hkv,S,D = {shape} bf16 causal, {a.rounds} fresh processes each (ms: median [min-max])")
    med = {}
    for provider, rs in rows.items():
        cells = []
        for key in ("import_ms", "first_ms", "second_ms"):
            xs = [r[key] for r in rs]
            med[provider, key] = statistics.median(xs)
            cells.append(f"{key[:-3]} {statistics.median(xs):8.1f} [{min(xs):.1f}-{max(xs):.1f}]")
        print(f"  {a.label if provider == 'attn_lt' else 'sdpa':<12} " + "   ".join(cells))
    total = med["attn_lt", "import_ms"] + med["attn_lt", "first_ms"]
    print(f"  {a.label} import + first call {total:.1f} ms = {total / med['sdpa', 'first_ms']:.2f}x SDPA's first "
          f"call ({med['sdpa', 'first_ms']:.1f} ms; goal <= 2x)")
    out["ratio"] = total / med["sdpa", "first_ms"]
    if a.profile:
        prof = run_child("attn_lt", shape, True, a.tree)
        out["profile"] = prof["profile"]
        print(prof["profile"][:6000])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
