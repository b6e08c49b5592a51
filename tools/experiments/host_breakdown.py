#!/usr/bin/env python3
"""Where the host time of one cached attn_lt call goes (decode B8 Hq32 Hkv8 D128 bf16, Sk 4096): each piece of
the call timed alone in a loop while the GPU is kept busy, so that only host time is measured.

    python3 tools/experiments/host_breakdown.py [--sk 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def growth_profile(steps: int) -> dict:
    """Host cost of a call that meets a new shape (a decode loop growing one key a call): wall microseconds per
    call (synchronised) and cProfile's top functions by cumulative time."""
    import cProfile
    import io
    import pstats

    import torch

    import attn_lt

    kc = torch.randn(8, 8, 32768 + 2 * steps + 8, 128, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for n in range(32768, 32768 + 16):  # classes resolved (tuned) before measuring
        attn_lt.attention(q, kc[:, :, :n], kc[:, :, :n])
    torch.cuda.synchronize()
    start = 32768 + 16
    t0 = time.perf_counter()
    for n in range(start, start + steps):
        attn_lt.attention(q, kc[:, :, :n], kc[:, :, :n])
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - t0) / steps * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for n in range(start + steps, start + 2 * steps):
        attn_lt.attention(q, kc[:, :, :n], kc[:, :, :n])
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(28)
    text = s.getvalue()
    print(f"new-shape call: {per_call:.1f} us a call (host + GPU, unsynchronised loop)")
    print(text[-6000:])
    return {"new_shape_call_us": round(per_call, 1), "profile": text}


def raw_cublaslt(g, ops):
    """cublasLtMatmul called through ctypes on the same handle and descriptors (no nvmath binding), or None."""
    import ctypes
    import glob

    try:
        import nvidia.cublas as nc

        path = sorted(glob.glob(os.path.join(list(nc.__path__)[0], "lib", "libcublasLt.so*")))[0]
        lib = ctypes.CDLL(path)
    except Exception:
        return None
    fn = lib.cublasLtMatmul
    fn.restype = ctypes.c_int
    vp = ctypes.c_void_p
    fn.argtypes = [vp] * 14 + [ctypes.c_size_t, vp]
    a, b, c, alpha, ws, ws_size, stream = ops
    args = (g.handle, g.desc, alpha, a, g.a, b, g.b, g.beta_ptr, c, g.c, c, g.c, g.algo_ptr, ws, ws_size, stream)
    return lambda: fn(*args)


def kernel_us(fn, reps=20) -> dict:
    """GPU microseconds per call of each kernel ``fn`` launches (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count >= reps:
            out[e.key] = round(t / reps, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sk", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--growth", type=int, default=0, help="also profile N calls of a decode loop whose cache grows "
                    "one key a call (a new plan each call), cProfile's top functions")
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import attn_lt
    from attn_lt import native
    from attn_lt.integrations import transformers as hf
    from attn_lt.testing import host_us

    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 8, a.sk, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    p = attn_lt.plan(q, k, v, backend="lt")
    p.run(q, k, v)
    prog = p.program
    step = prog.steps[0]
    out = torch.empty(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(8, 32, 1, device="cuda", dtype=torch.float32)
    ws = torch.empty(p.workspace_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    gws = p.chunks.gemm_workspace
    scores = ws.data_ptr() + gws
    import numpy as np

    one = np.ones(1, dtype=np.float32)
    rows = {
        "attention() total": lambda: attn_lt.attention(q, k, v, backend="lt"),
        "plan.run total": lambda: p.run(q, k, v),
        "program.run (no allocation)": lambda: prog.run(q, k, v, None, out, lse, ws, stream),
        "qk GEMM launch": lambda: step.qk.run(k.data_ptr(), q.data_ptr(), scores, one.ctypes.data, ws.data_ptr(),
                                              gws, stream),
        "pv GEMM launch": lambda: step.pv.run(v.data_ptr(), scores, out.data_ptr(), one.ctypes.data,
                                              ws.data_ptr(), gws, stream),
        "softmax launch": lambda: native.softmax(step.args, stream),
        "torch.empty x3": lambda: (torch.empty(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16),
                                   torch.empty(8, 32, 1, device="cuda"),
                                   torch.empty(p.workspace_bytes, dtype=torch.uint8, device="cuda")),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(q.device).cuda_stream,
        "torch.cuda.device(ctx)": lambda: torch.cuda.device(0).__enter__(),
        "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "sdpa default": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "torch.bmm (qk-sized)": lambda: torch.bmm(q.view(64, 4, 128), k.view(64, a.sk, 128).transpose(1, 2)),
    }
    fused = attn_lt.plan(q, k, v)  # what "auto" takes for this case (decode: the fused kernel)
    rows[f"attention() auto ({fused.backend})"] = lambda: attn_lt.attention(q, k, v)
    rows[f"plan.run auto ({fused.backend})"] = lambda: fused.run(q, k, v)
    layer = type("Layer", (), {"is_causal": True})()  # the adapter needs no transformers
    rows["transformers adapter (auto)"] = lambda: hf.attention_forward(layer, q, k, v, None, dropout=0.0,
                                                                        scaling=None, position_ids=None)
    raw = raw_cublaslt(step.qk, (k.data_ptr(), q.data_ptr(), scores, one.ctypes.data, ws.data_ptr(), gws,
                                 stream))
    if raw is not None:
        rows["qk GEMM, cublasLtMatmul by ctypes"] = raw
    res = {name: host_us(fn) for name, fn in rows.items()}
    kernels = kernel_us(lambda: p.run(q, k, v))
    print(f"host microseconds per call on {torch.cuda.get_device_name()}, decode B8 Hq32 Hkv8 Sk{a.sk} D128:")
    for name, us in res.items():
        print(f"  {name:<32}{us:>9.2f}")
    print("GPU microseconds per kernel of plan.run:")
    for name, us in kernels.items():
        print(f"  {name[:70]:<72}{us:>9.2f}")
    growth = growth_profile(a.growth) if a.growth else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sk": a.sk, "us": res, "kernels_us": kernels, "growth": growth}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
