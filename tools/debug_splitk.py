"""Diagnostics: which algorithm ids take split-K configurations, batched and unbatched (see tools/NOTES.md)."""
import dataclasses, sys
import numpy as np
sys.path.insert(0, ".")
from attn_lt.lt import algos, cublaslt
from attn_lt.lt.cublaslt import GemmKey
L = cublaslt._lt()
for batch in (16, 1):
    key = GemmKey("pv", "bf16", 128, 4, 65536, batch, False, False, 128, 131072, 128, 8388608, 524288, 512, 256, 256, 256)
    g = cublaslt.gemm(0, key, 32 << 20)
    print("== batch", batch)
    ids = L.matmul_algo_get_ids(g.handle, 68, 0, 14, 14, 14, 14, 24)
    for i in ids:
        try:
            caps = algos._Caps(g, int(i))
            cfgs = algos._explicit_configs(g, caps, int(i))
        except Exception as e:
            print(" id", i, "explicit failed", str(e)[:60]); continue
        cap, mask = caps.splitk, caps.schemes
        res = []
        for base in cfgs[:1]:
            for s, r in ((1, 0), (4, 1), (4, 2), (4, 4)):
                c = dataclasses.replace(base, splitk=s, reduction=r)
                try:
                    a = algos.make_algo(g, c)
                    out = np.zeros(1, dtype=L.matmul_heuristic_result_dtype)
                    L.matmul_algo_check(g.handle, g.desc, g.a, g.b, g.c, g.c, a.ctypes.data, out.ctypes.data)
                    res.append(f"{s}/{r}:ok")
                except Exception as e:
                    res.append(f"{s}/{r}:{str(e).split('(')[1][:24] if '(' in str(e) else str(e)[:30]}")
        print(" id", int(i), "splitk_cap", cap, "mask", mask, "base", cfgs[0] if cfgs else None, res)
