#!/usr/bin/env python3
"""Long-path benchmark: attn_lt's cuBLASLt path side by side with PyTorch SDPA (backends forced) and the plain
PyTorch unfused chain (bmm to FP32 -> softmax -> bmm), in one run on one GPU. Protocol: ../shared/BENCHMARKS.md
(median of CUDA-event timings, fresh random inputs, FLOPs = 4 B Hq Sq Sk D, halved when causal).

    python tools/bench_long_context.py [--rows NAME,...] [--out DIR]

Prints a table (last) and writes DIR/long_context.json and .csv.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_lt  # noqa: E402
from attn_lt.testing import sdpa, time_ms  # noqa: E402

SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

# name: (B, Hq, Hkv, Sq, Sk, D, causal, mask, providers)
ROWS = {
    "d128": (1, 16, 16, 16384, 16384, 128, False, None, ["lt", "naive", "cudnn", "efficient"]),
    "d64": (1, 32, 32, 16384, 16384, 64, False, None, ["lt", "naive", "cudnn", "efficient"]),
    "s32k": (1, 32, 32, 32768, 32768, 128, False, None, ["lt", "cudnn"]),
    "s32k-causal": (1, 32, 32, 32768, 32768, 128, True, None, ["lt", "cudnn"]),
    "d512": (1, 4, 4, 16384, 16384, 512, False, None, ["lt", "efficient", "math"]),
    "mask": (1, 16, 16, 16384, 16384, 128, False, "float", ["lt", "efficient", "cudnn"]),
    "s128k-causal": (1, 32, 32, 131072, 131072, 128, True, None, ["lt", "cudnn"]),
}
for _d in (64, 128):
    for _s in (512, 1024, 2048, 4096):
        for _c in (False, True):
            ROWS[f"fa-d{_d}-s{_s}{'-causal' if _c else ''}"] = (16384 // _s, 2048 // _d, 2048 // _d, _s, _s, _d, _c,
                                                                 None, ["wmma", "flash", "cudnn"])
for _sk in (8192, 65536, 131072):
    for _hkv, _tag in ((32, "mha"), (8, "gqa")):
        ROWS[f"dec-{_tag}-{_sk // 1024}k"] = (8, 32, _hkv, 1, _sk, 128, False, None, ["lt", "lt-heur", "cudnn"])


def naive(q, k, v, mask=None, causal=False):
    """The same unfused algorithm in plain PyTorch: FP32 scores, torch.softmax, P in the input dtype."""
    B, H, S, D = q.shape
    qb, kb, vb = q.reshape(B * H, S, D), k.reshape(B * H, -1, D), v.reshape(B * H, -1, D)
    try:
        s = torch.bmm(qb, kb.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        s = torch.bmm(qb, kb.transpose(1, 2)).float()
    s.mul_(D**-0.5)
    if mask is not None:
        s = s.view(B, H, S, -1).add_(mask).view(B * H, S, -1)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    del s
    return torch.bmm(p, vb).view(B, H, S, D)


def call(provider, q, k, v, mask, causal, budget):
    if provider in ("lt", "lt-heur"):
        policy = "heuristic" if provider == "lt-heur" else None
        return lambda: attn_lt.attention(q, k, v, attn_mask=mask, causal=causal, backend="lt",
                                         workspace_bytes=budget, algo_policy=policy)
    if provider == "wmma":
        return lambda: attn_lt.attention(q, k, v, attn_mask=mask, causal=causal, backend="wmma")
    if provider == "naive":
        return lambda: naive(q, k, v, mask, causal)
    return lambda: sdpa(q, k, v, mask, causal, backend=SDPA[provider])


def measure(fn, slow: bool):
    """(median ms, peak extra MiB) or raises; slow cases time 3 runs after one warm-up."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = time_ms(fn, warmup_ms=1, rep_ms=1) if slow else time_ms(fn, warmup_ms=50, rep_ms=400)
    return ms, peak


def kernel_breakdown(fn) -> dict:
    """GPU time per kernel family over one call (CUPTI sees cuBLASLt's kernels and ours)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fam = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith("cudaLaunch"):
            continue
        name = "softmax" if "softmax" in e.key else ("gemm" if ("gemm" in e.key.lower() or "sm90" in e.key
                                                                  or "cutlass" in e.key.lower()) else e.key[:40])
        fam[name] = fam.get(name, 0) + t / 1000
    return {k: round(v, 3) for k, v in sorted(fam.items(), key=lambda x: -x[1])}


def chosen_algorithms(q, k, v, mask, causal) -> list:
    """For the GEMMs of this case: cached winner's split-K, tuned and heuristic ms (from the cache)."""
    from attn_lt.cache import current_env, default_cache, key_string
    from attn_lt.cli import _plan_gemms

    e = attn_lt.explain(q, k, v, attn_mask=mask, causal=causal, backend="lt")
    env = current_env()
    out = []
    for key in _plan_gemms(e.case, e.plan)[:4]:
        hit = default_cache().get(env, key)
        out.append({"gemm": key_string(key), "splitk": hit.config.splitk if hit else None,
                    "tuned_ms": hit.median_ms if hit else None, "heuristic_ms": hit.heuristic_ms if hit else None})
    return out


def host_cost() -> dict:
    """Host microseconds of (a) the per-call lookup of a resolved GEMM and (b) a GEMM's first use in a process
    when the cache has it (descriptors, heuristic fallback, cache lookup, algorithm check)."""
    from attn_lt.cache import current_env, default_cache, parse_key
    from attn_lt.lt import algos, cublaslt

    env = current_env().key()
    keys = [parse_key(k) for e, k, _ in default_cache().items() if e == env]
    if not keys:
        return {}
    key, ws = keys[0], 32 << 20
    g = cublaslt.gemm(0, key, ws, "cache")
    algos.resolve(g, "cache", ws, None)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        g = cublaslt.gemm(0, key, ws, "cache")
        if not g.resolved:
            raise RuntimeError("unresolved")
    hit_us = (time.perf_counter() - t0) / n * 1e6
    firsts = []
    for _ in range(20):
        cublaslt.gemm.cache_clear()
        t0 = time.perf_counter()
        g = cublaslt.gemm(0, key, ws, "cache")
        algos.resolve(g, "cache", ws, None)
        firsts.append((time.perf_counter() - t0) * 1e6)
    return {"resolved_lookup_us": round(hit_us, 2), "first_use_with_cache_hit_us": round(sorted(firsts)[10], 1),
            "source": g.algo_source}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    ap.add_argument("--budgets-mib", default="", help="extra lt runs of row d128 at these workspace budgets")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel GPU time of lt on each row")
    ap.add_argument("--softmax-variants", default="", help="extra lt runs of each row with ATTN_LT_SOFTMAX=each")
    ap.add_argument("--out", default="results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_long_context: no CUDA GPU visible; nothing to measure", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    results = []
    jobs = [(r, None) for r in a.rows.split(",") if r]
    jobs += [("d128", int(b) << 20) for b in a.budgets_mib.split(",") if b]
    jobs += [(r, v) for v in a.softmax_variants.split(",") if v for r in a.rows.split(",") if r]
    for name, budget in jobs:
        B, H, Hkv, Sq, Sk, D, causal, mask_kind, providers = ROWS[name]
        variant = budget if isinstance(budget, str) else None
        os.environ["ATTN_LT_SOFTMAX"] = variant or "auto"
        budget = None if variant else budget
        if budget is not None or variant:
            providers = ["lt"]
        dt = torch.bfloat16
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=dt)
        k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dt) for _ in range(2))
        mask = torch.randn(1, 1, Sq, Sk, device="cuda", dtype=dt) if mask_kind == "float" else None
        flops = 4 * B * H * Sq * Sk * D * (0.5 if causal else 1.0)
        kv_bytes = 2 * B * Hkv * Sk * D * 2
        tag = f"@{budget >> 20}MiB" if budget else (f"/{variant}" if variant else "")
        row = {"row": name + tag, "B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "S": Sk, "D": D,
               "causal": causal, "mask": mask_kind}
        for p in providers:
            t0 = time.time()
            try:
                fn = call(p, q, k, v, mask, causal, budget)
                if p == "lt":  # tune every GEMM shape of the case before timing (the cache keeps them)
                    os.environ["ATTN_LT_TUNE_CALL_MS"] = "60000"
                    try:
                        fn()
                    finally:
                        os.environ.pop("ATTN_LT_TUNE_CALL_MS")
                ms, peak = measure(fn, slow=Sk >= 131072 and Sq > 1)
                row[p] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "peak_mib": round(peak),
                          "kv_tbs": round(kv_bytes / ms / 1e9, 2)}
            except Exception as e:  # a provider that cannot run the case is reported, not dropped
                row[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
            print(f"  {row['row']:<18} {p:<10} {row[p]} ({time.time() - t0:.1f}s)", flush=True)
            torch.cuda.empty_cache()
        if a.breakdown and "lt" in providers and budget is None and not variant:
            row["lt_kernels_ms"] = kernel_breakdown(call("lt", q, k, v, mask, causal, None))
            print(f"  {row['row']:<18} kernels    {row['lt_kernels_ms']}", flush=True)
        if "lt" in providers and budget is None and not variant:
            row["lt_gemms"] = chosen_algorithms(q, k, v, mask, causal)
        results.append(row)
        del q, k, v, mask
        torch.cuda.empty_cache()
    hc = host_cost()
    meta = {"host_cost": hc, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "attn_lt": attn_lt.__version__}
    with open(os.path.join(a.out, "long_context.json"), "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=1)
    provs = ["lt", "lt-heur", "wmma", "naive", "flash", "cudnn", "efficient", "math"]
    with open(os.path.join(a.out, "long_context.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["row", "B", "H", "S", "D", "causal", "mask"] + [f"{p}_{m}" for p in provs
                                                                     for m in ("ms", "tflops", "peak_mib")])
        for r in results:
            w.writerow([r[x] for x in ("row", "B", "H", "S", "D", "causal", "mask")] +
                       [r.get(p, {}).get(m, "") for p in provs for m in ("ms", "tflops", "peak_mib")])
    print(f"\n{meta['gpu']}, torch {meta['torch']}, {meta['date']} -- bf16, TFLOP/s (median), lt/peer ratios")
    print(f"{'row':<18}" + "".join(f"{p:>11}" for p in provs) + "   ratios")
    for r in results:
        cells, ratios = "", []
        for p in provs:
            x = r.get(p)
            cells += f"{'':>11}" if x is None else (f"{'n/a':>11}" if "error" in x else f"{x['tflops']:>11.1f}")
            own = "wmma" if "wmma" in r else "lt"
            if p != own and x and "tflops" in x and "tflops" in r.get(own, {}):
                ratios.append(f"{p} {r[own]['tflops'] / x['tflops']:.2f}x")
        print(f"{r['row']:<18}{cells}   {', '.join(ratios)}")
    lt = {r["row"]: r["lt"] for r in results if "ms" in r.get("lt", {})}
    if "s32k" in lt and "s32k-causal" in lt:
        print(f"causal speed-up at S=32k: {lt['s32k']['ms'] / lt['s32k-causal']['ms']:.2f}x")
    dec = [r for r in results if r["row"].startswith("dec-")]
    if dec:
        print("\ndecode (B8 Hq32 Sq1 D128): K/V read TB/s and ratio to SDPA cuDNN; split-K (qk, pv) chosen")
        for r in dec:
            lt, hr, cd = r.get("lt", {}), r.get("lt-heur", {}), r.get("cudnn", {})
            sk = [g["splitk"] for g in r.get("lt_gemms", [])]
            ratio = f"{cd['ms'] / lt['ms']:.2f}x" if "ms" in lt and "ms" in cd else "n/a"
            print(f"{r['row']:<14} lt {lt.get('ms', 'n/a')} ms {lt.get('kv_tbs', 'n/a')} TB/s | heuristic "
                  f"{hr.get('ms', 'n/a')} ms | cudnn {cd.get('ms', 'n/a')} ms {cd.get('kv_tbs', 'n/a')} TB/s | "
                  f"lt/cudnn {ratio} | split-K {sk}")
    if hc:
        print(f"host cost: resolved GEMM lookup {hc['resolved_lookup_us']} us a GEMM; first use with a cache hit "
              f"{hc['first_use_with_cache_hit_us']} us")
    for r in results:
        if r["row"] == "s128k-causal":
            print("S=128k causal peak MiB: " + ", ".join(f"{p} {r[p].get('peak_mib', 'n/a')}" for p in r
                                                         if isinstance(r[p], dict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
