"""EXPERIMENT: the long path's two lanes with the SMs split between the GEMMs and the softmax.

cuBLASLt's CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET (ATTN_LT_EXP_SMS_QK / _PV, read when a GEMM's descriptor is made)
and a cap on the persistent softmax grid (ATTN_LT_EXP_SOFTMAX_SMS, read at each launch). Without them each
persistent kernel takes every SM and the lanes overlap only in kernel tails. Configurations are planned side by
side in one process and timed in interleaved, settled rounds; % of the floor is 12 B a visible score at the copy
rate measured in the same process.

    python sm_split.py [shape,...] [--rounds 5] [--configs name,...]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
import attn_lt  # noqa: E402
from attn_lt.lt import cublaslt  # noqa: E402

SHAPES = {  # B, H, S, D, Dv, causal
    "d128": (1, 16, 16384, 128, 128, False),
    "d64": (1, 32, 16384, 64, 64, False),
    "d128c": (1, 16, 16384, 128, 128, True),
    "mla": (1, 128, 8192, 192, 128, True),
}
CONFIGS = {  # policy, qk SMs, pv SMs, softmax SMs (0: all)
    "base": ("tune", 0, 0, 0), "heur": ("heuristic", 0, 0, 0),
    "g120s12": ("heuristic", 120, 120, 12), "g112s20": ("heuristic", 112, 112, 20),
    "g100s32": ("heuristic", 100, 100, 32), "g88s44": ("heuristic", 88, 88, 44),
    "g66s66": ("heuristic", 66, 66, 66), "q100s32": ("heuristic", 100, 0, 32),
    "g100": ("heuristic", 100, 100, 0), "s32": ("heuristic", 0, 0, 32),
}


def copy_tbs() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(15):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return 2 * n / statistics.median(ts[3:]) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="?", default="d128,d64,d128c,mla")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["ATTN_LT_CACHE_DIR"] = f"/tmp/smsplit-cache-{os.getpid()}"
    rate = copy_tbs()
    print(f"{torch.cuda.get_device_name()}: copy {rate:.2f} TB/s", flush=True)
    rows = []
    for sname in args.shapes.split(","):
        B, H, S, D, Dv, causal = SHAPES[sname]
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, H, S, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
        scores = B * H * (S * (S + 1) // 2 if causal else S * S)
        floor_ms = 12 * scores / (rate * 1e12) * 1e3
        ref = None
        runs = {}
        for cname in args.configs.split(","):
            policy, qk, pv, smx = CONFIGS[cname]
            for role, n in (("QK", qk), ("PV", pv)):
                os.environ[f"ATTN_LT_EXP_SMS_{role}"] = str(n)
            cublaslt.gemm.cache_clear()
            p = attn_lt.plan(q, k, v, causal=causal, backend="lt", algo_policy=policy)
            ws = torch.empty(p.workspace_bytes, dtype=torch.uint8, device="cuda")
            out = torch.empty(B, H, S, Dv, device="cuda", dtype=torch.bfloat16)

            def fn(p=p, ws=ws, out=out, smx=smx):
                os.environ["ATTN_LT_EXP_SOFTMAX_SMS"] = str(smx)
                return p.run(q, k, v, out=out, workspace=ws)

            t0 = time.perf_counter()
            o = fn().float()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            if ref is None:
                ref = o
            err = ((o - ref).norm() / ref.norm()).item()
            runs[cname] = (fn, [], err, first_s)
        os.environ["ATTN_LT_EXP_SMS_QK"] = os.environ["ATTN_LT_EXP_SMS_PV"] = "0"
        names = list(runs)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for cname in order:
                fn, ts, _, _ = runs[cname]
                t_end = time.perf_counter() + 0.1
                while time.perf_counter() < t_end:  # settle: 100 ms of its own calls
                    fn()
                    torch.cuda.synchronize()
                for _ in range(4):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    fn()
                    e.record()
                    e.synchronize()
                    ts.append(s.elapsed_time(e))
        base = statistics.median(runs[names[0]][1])
        for cname in names:
            _, ts, err, first_s = runs[cname]
            med = statistics.median(ts)
            row = {"shape": sname, "config": cname, "ms": med, "floor_pct": 100 * floor_ms / med,
                   "vs_first": med / base, "spread_pct": 100 * (max(ts) - min(ts)) / med, "err_vs_first": err,
                   "first_call_s": first_s, "copy_tbs": rate}
            rows.append(row)
            print(f"{sname:6s} {cname:8s} {med:8.3f} ms  {row['floor_pct']:5.1f} % floor  x{row['vs_first']:.3f}"
                  f"  spread {row['spread_pct']:4.1f} %  err {err:.1e}", flush=True)
        del q, k, v, runs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_tbs": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
