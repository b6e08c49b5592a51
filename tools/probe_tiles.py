"""Ad-hoc: the long path at 512k causal with other row-block / tile sizes (monkeypatched planner constants)."""
import os, sys, statistics
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_lt
import importlib
P = importlib.import_module('attn_lt.plan')

def timed(fn, reps=3):
    t = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); t.append(a.elapsed_time(b))
    return statistics.median(t)

B, H, S = 1, 4, 524288
q, k, v = (torch.randn(B, H, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for rows, tmax, lanes in [(1024, 0, 2), (2048, 0, 2), (4096, 0, 2), (2048, 32768, 2), (1024, 0, 1), (4096, 32768, 2)]:
    P.CAUSAL_ROW_BLOCK = rows
    os.environ["ATTN_LT_LANES"] = str(lanes)
    base = P.__dict__.setdefault("_orig_key_tiling", P._key_tiling)
    def capped(case, scores, m, _b=base, _t=tmax):
        r, t = _b(case, scores, m)
        if _t and t > _t:
            t = _t - _t % r if _t >= r else t
        return r, t
    P._key_tiling = capped
    P._make_plan.cache_clear()
    p = attn_lt.plan(q, k, v, causal=True, backend="lt", workspace_bytes=(1 << 30) + rows + tmax + lanes)
    for _ in range(3):
        p.run(q, k, v); torch.cuda.synchronize()
        if not p.program.pending: break
    ms = timed(lambda: p.run(q, k, v))
    scores = H * S * S / 2
    print(f"rows {rows} tile cap {tmax} lanes {lanes}: {ms:.1f} ms, {4*scores*128/ms/1e9:.0f} TFLOP/s; {p.chunks.summary()[:110]}", flush=True)
