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

# name: (B, H, S, D, causal, mask, providers)
ROWS = {
    "d128": (1, 16, 16384, 128, False, None, ["lt", "naive", "cudnn", "efficient"]),
    "d64": (1, 32, 16384, 64, False, None, ["lt", "naive", "cudnn", "efficient"]),
    "s32k": (1, 32, 32768, 128, False, None, ["lt", "cudnn"]),
    "s32k-causal": (1, 32, 32768, 128, True, None, ["lt", "cudnn"]),
    "d512": (1, 4, 16384, 512, False, None, ["lt", "efficient", "math"]),
    "mask": (1, 16, 16384, 128, False, "float", ["lt", "efficient", "cudnn"]),
    "s128k-causal": (1, 32, 131072, 128, True, None, ["lt", "cudnn"]),
}


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
    if provider == "lt":
        return lambda: attn_lt.attention(q, k, v, attn_mask=mask, causal=causal, backend="lt",
                                         workspace_bytes=budget)
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
        B, H, S, D, causal, mask_kind, providers = ROWS[name]
        variant = budget if isinstance(budget, str) else None
        os.environ["ATTN_LT_SOFTMAX"] = variant or "auto"
        budget = None if variant else budget
        if budget is not None or variant:
            providers = ["lt"]
        dt = torch.bfloat16
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dt) for _ in range(3))
        mask = torch.randn(1, 1, S, S, device="cuda", dtype=dt) if mask_kind == "float" else None
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        tag = f"@{budget >> 20}MiB" if budget else (f"/{variant}" if variant else "")
        row = {"row": name + tag, "B": B, "H": H, "S": S, "D": D,
               "causal": causal, "mask": mask_kind}
        for p in providers:
            t0 = time.time()
            try:
                ms, peak = measure(call(p, q, k, v, mask, causal, budget), slow=S >= 131072)
                row[p] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "peak_mib": round(peak)}
            except Exception as e:  # a provider that cannot run the case is reported, not dropped
                row[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
            print(f"  {row['row']:<18} {p:<10} {row[p]} ({time.time() - t0:.1f}s)", flush=True)
            torch.cuda.empty_cache()
        if a.breakdown and budget is None and not variant:
            row["lt_kernels_ms"] = kernel_breakdown(call("lt", q, k, v, mask, causal, None))
            print(f"  {row['row']:<18} kernels    {row['lt_kernels_ms']}", flush=True)
        results.append(row)
        del q, k, v, mask
        torch.cuda.empty_cache()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "attn_lt": attn_lt.__version__}
    with open(os.path.join(a.out, "long_context.json"), "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=1)
    provs = ["lt", "naive", "cudnn", "efficient", "math"]
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
            if p != "lt" and x and "tflops" in x and "tflops" in r.get("lt", {}):
                ratios.append(f"{p} {r['lt']['tflops'] / x['tflops']:.2f}x")
        print(f"{r['row']:<18}{cells}   {', '.join(ratios)}")
    lt = {r["row"]: r["lt"] for r in results if "ms" in r.get("lt", {})}
    if "s32k" in lt and "s32k-causal" in lt:
        print(f"causal speed-up at S=32k: {lt['s32k']['ms'] / lt['s32k-causal']['ms']:.2f}x")
    for r in results:
        if r["row"] == "s128k-causal":
            print("S=128k causal peak MiB: " + ", ".join(f"{p} {r[p].get('peak_mib', 'n/a')}" for p in r
                                                         if isinstance(r[p], dict)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
