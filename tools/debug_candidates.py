#!/usr/bin/env python3
"""Diagnostics: what cuBLASLt offers for one GEMM of a case (heuristic configs, capabilities, split-K checks)."""
import sys


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
    cands = algos.candidates(g, 32 << 20)
    print("  ids", L.matmul_algo_get_ids(g.handle, 68, 0, 14, 14, 0 if key.role == "qk" else 14,
                                        0 if key.role == "qk" else 14, 24))
    print("  explicit configs of id 21:", algos._explicit_configs(g, algos._Caps(g, 21), 21) if 21 in L.matmul_algo_get_ids(
        g.handle, 68, 0, 14, 14, 0 if key.role == "qk" else 14, 0 if key.role == "qk" else 14, 24) else "-")
    print("  %d candidates:" % len(cands), [(c.algo_id, c.tile, c.stages, c.splitk, c.reduction) for c, _, _ in cands])
    print("  with split-K:", sum(c.splitk > 1 for c, _, _ in cands))
