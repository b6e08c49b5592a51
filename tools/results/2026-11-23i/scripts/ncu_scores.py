"""One chunk's Q@K^T (2048 rows x 16384 keys x 3 heads, D 128, bf16) by cuBLASLt's heuristic algorithm and by
native/scores_sm90.cu, twice each, for ncu:
    ncu --kernel-name regex:'scores_sm90|nvjet' --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 ncu_scores.py
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from attn_lt import native  # noqa: E402
from attn_lt.lt import cublaslt  # noqa: E402
from attn_lt.lt.cublaslt import GemmKey  # noqa: E402

rows, cols, batch, D = 2048, 16384, 3, 128
q = torch.randn(batch, rows, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(batch, cols, D, device="cuda", dtype=torch.bfloat16)
s = torch.full((batch, rows, cols), math.nan, device="cuda")
ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
key = GemmKey("qk", "bf16", m=cols, n=rows, k=D, batch=batch, trans_a=True, trans_b=False, lda=D, ldb=D, ldc=cols,
              stride_a=cols * D, stride_b=rows * D, stride_c=rows * cols, align_a=256, align_b=256, align_c=256)
g = cublaslt.gemm(torch.cuda.current_device(), key)
algo, wsz = g.heuristic_top(ws.nbytes)
g.use(algo, wsz, "heuristic", True)
al = np.array([1 / math.sqrt(D)], dtype=np.float32)
stream = torch.cuda.current_stream().cuda_stream
a = native.ScoresArgs()
a.q, a.k, a.s = q.data_ptr(), k.data_ptr(), s.data_ptr()
a.rows, a.cols, a.batch, a.D = rows, cols, batch, D
a.q_ld, a.q_bs, a.k_ld, a.k_bs, a.s_ld, a.s_bs = D, rows * D, D, cols * D, cols, rows * cols
a.alpha, a.dtype = float(al[0]), native.DTYPE_CODES["bf16"]
for _ in range(4):
    g.run(k.data_ptr(), q.data_ptr(), s.data_ptr(), al.ctypes.data, ws.data_ptr(), ws.nbytes, stream)
    native.scores_sm90(a, stream)
torch.cuda.synchronize()
print("ok")
