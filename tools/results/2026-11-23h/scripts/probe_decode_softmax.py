"""Decode on the long path: which softmax kernel, with and without the attention mass (ATTN_LT_SOFTMAX forced)."""
import os, sys, statistics, torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import attn_lt
from bench import Timer, warm_up
from attn_lt.testing import reference, rel_error

warm_up(2.0)
timer = Timer(200, 5)
variants = os.environ.get("VARIANTS", "auto,pipe").split(",")
for spec in os.environ.get("SHAPES", "2:32:8:32768,4:32:8:32768,8:32:8:32768,16:32:8:32768,8:32:8:30000,8:32:32:32768,1:32:32:32768,8:32:8:16384").split(","):
    B, Hq, Hkv, Sk = (int(x) for x in spec.split(":"))
    q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Sk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fns = {}
    for var in variants:
        for mass in (False, True):
            kern, _, exp = var.partition("+")
            os.environ["ATTN_LT_SOFTMAX"] = kern
            p = attn_lt.plan(q, k, v, backend="lt", return_key_mass=mass)
            def fn(p=p, exp=exp):
                                return p.run(q, k, v)
            try:
                r = fn()
            except Exception as e:
                print(f"  {var} mass={mass}: {type(e).__name__}", flush=True)
                continue
            finally:
                os.environ.pop("ATTN_LT_SOFTMAX", None)
            o = r[0] if mass else r
            err = rel_error(o, reference(q, k, v, dtype=torch.float32)[0])
            fns[(var, mass)] = (fn, err)
    samples = {key: [] for key in fns}
    for rnd in range(5):
        for key in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            samples[key] += timer.samples(fns[key][0])
    base = statistics.median(samples[("auto", False)])
    for var in variants:
        if (var, False) not in samples or (var, True) not in samples:
            continue
        a, b = statistics.median(samples[(var, False)]), statistics.median(samples[(var, True)])
        print(f"B{B} Hq{Hq} Hkv{Hkv} Sk{Sk} {var:>9}: {a*1e3:7.1f} us  +mass {b*1e3:7.1f} us ({100*(b/base-1):+5.1f} % over auto)  "
              f"err {fns[(var, False)][1]:.2e}", flush=True)
    os.environ.pop("ATTN_LT_SOFTMAX", None)
