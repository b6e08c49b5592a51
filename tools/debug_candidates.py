#!/usr/bin/env python3
"""Diagnostics: what cuBLASLt offers for one GEMM of a case (heuristic configs, capabilities, split-K checks)."""
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
import attn_lt  # noqa: E402
from attn_lt.lt import algos, cublaslt  # noqa: E402
from attn_lt.lt.path import gemm_keys  # noqa: E402
from attn_lt.plan import chunk_layout  # noqa: E402

q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 8, 65536, 128, device="cuda", dtype=torch.bfloat16)
e = attn_lt.explain(q, k, k)
lay = chunk_layout(e.case, e.plan, e.plan.chunks[0])
ptrs = (q.data_ptr(), k.data_ptr(), k.data_ptr(), q.data_ptr(), 1 << 40)
for key in gemm_keys(e.case, lay, ptrs):
    g = cublaslt.gemm(0, key, 32 << 20)
    print("==", key)
    L = cublaslt._lt()
    C = L.MatmulAlgoCapAttribute
    for h in g.heuristic(32 << 20, 8):
        a = np.zeros(1, dtype=L.matmul_algo_dtype)
        a[0] = h["algo"]
        cfg = algos.read_config(a)
        print("  heur", cfg, "ws", int(h["workspace_size"]), "splitk_cap", algos._cap(a, C.SPLITK_SUPPORT),
              "red_mask", algos._cap(a, C.REDUCTION_SCHEME_MASK))
        for s in (2, 8):
            for r in (1, 2, 4):
                import dataclasses
                c2 = dataclasses.replace(cfg, splitk=s, reduction=r)
                try:
                    al = algos.make_algo(g, c2)
                    L.matmul_algo_check(g.handle, g.desc, g.a, g.b, g.c, g.c, al.ctypes.data,
                                        np.zeros(1, dtype=L.matmul_heuristic_result_dtype).ctypes.data)
                    print("     ok", s, r)
                except Exception as ex:
                    print("     no", s, r, str(ex)[:80])
    print("  ids", L.matmul_algo_get_ids(g.handle, 68, 0, 14, 14, 0 if key.role == "qk" else 14,
                                        0 if key.role == "qk" else 14, 16))
    print("  candidates", [(c.algo_id, c.splitk, c.reduction) for c, _, _ in algos.candidates(g, 32 << 20)])
