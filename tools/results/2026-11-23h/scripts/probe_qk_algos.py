"""Every heuristic configuration cuBLASLt offers for the long path's GEMMs of one call (B1 H16 S16k D128 by
default), timed alone on the chunk's own shapes, against the one the tuner chose."""
import os, sys, statistics, torch, numpy as np
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt
from attn_lt.validate import check_tensors
from attn_lt.plan import make_plan
from attn_lt.lt.path import plan_gemm_keys
from attn_lt.lt import cublaslt, algos
from bench import warm_up

H, S, D = (int(x) for x in os.environ.get("SHAPE", "16:16384:128").split(":"))
q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
attn_lt.attention(q, k, v, backend="lt")  # tunes
warm_up(2.0)
case = check_tensors(q, k, v)
plan = make_plan(case)
ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
alpha = np.ones(1, dtype=np.float32)
stream = torch.cuda.current_stream().cuda_stream
for qk, pv in plan_gemm_keys(case, plan)[:1]:
    for key in (qk, pv):
        g = cublaslt.gemm(torch.cuda.current_device(), key)
        esz = 2
        na = (key.stride_a * key.batch + key.lda * max(key.m, key.k)) * esz
        nb = (key.stride_b * key.batch + key.ldb * max(key.n, key.k)) * esz
        nc = (key.stride_c * key.batch + key.ldc * key.n) * (4 if key.out_dtype == "fp32" else 2)
        A = torch.randn(na // 2 + 1024, device="cuda").to(torch.bfloat16)
        B = torch.randn(nb // 2 + 1024, device="cuda").to(torch.bfloat16)
        C = torch.empty(nc + 4096, dtype=torch.uint8, device="cuda")
        ops = (A.data_ptr(), B.data_ptr(), C.data_ptr(), alpha.ctypes.data, ws.data_ptr(), 32 << 20, stream)
        byts = key.batch * key.m * key.n * (4 if key.out_dtype == 'fp32' else 2) + 0.0
        res = g.heuristic(32 << 20, 64)
        print(f"{key}: {len(res)} heuristic results; tuned: {g.algo_source}", flush=True)
        rows = []
        chosen = algos.time_algo(g, None, ops, reps=10)
        for i, r in enumerate(res):
            a = np.zeros(1, dtype=cublaslt.lib().matmul_algo_dtype); a[0] = r["algo"]
            try:
                t = statistics.median(algos.time_algo(g, a, ops, reps=10) for _ in range(3))
            except Exception as e:
                print(f"  #{i}: {type(e).__name__}"); continue
            rows.append((t, i, algos.read_config(a)))
        chosen2 = algos.time_algo(g, None, ops, reps=10)
        rows.sort(key=lambda x: x[0])
        print(f"  chosen {chosen:.3f}/{chosen2:.3f} ms ({byts / min(chosen, chosen2) / 1e9:.0f} GB/s of output)", flush=True)
        for t, i, cfg in rows[:8]:
            print(f"  #{i:2d} {t:.3f} ms  {cfg.describe() if hasattr(cfg, 'describe') else cfg}", flush=True)
        print(f"  worst #{rows[-1][1]} {rows[-1][0]:.3f} ms", flush=True)
