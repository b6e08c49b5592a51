"""What a zeroing L2 flush charges a ragged decode call: B64 requests of U[256, 8192] keys (Hq 32 / Hkv 8, D 128,
bf16), attn_lt's varlen call on a bf16 and an FP8 cache and SDPA cuDNN on the padded cache with its key-padding mask
(tools/bench_batch.py's), each timed by ``attn_lt.testing.time_ms`` with its L2 flushed by a zero-fill (triton's
do_bench: L2 left dirty) and by a read (L2 left clean, the timers' default); the better of two turns.

    python3 tools/experiments/probe_batch_flush.py

Prints a line a call: microseconds by each flush.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attn_lt  # noqa: E402
import bench_batch  # noqa: E402
from attn_lt.testing import L2_FLUSHES, cu_seqlens, fp8_kv, time_ms  # noqa: E402

HQ, HKV, D, DT = bench_batch.HQ, bench_batch.HKV, bench_batch.D, bench_batch.DT


def calls() -> dict:
    """name -> call of the ragged batch."""
    random.seed(0)
    lengths = [random.randint(256, 8192) for _ in range(64)]
    B, smax = len(lengths), max(lengths)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(sum(lengths), HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    k8, kd = fp8_kv(k)
    v8, vd = fp8_kv(v)
    cu_q, cu_k = torch.arange(B + 1, dtype=torch.int32, device="cuda"), cu_seqlens(lengths)
    kw = dict(max_seqlen_q=1, max_seqlen_k=smax)
    k_pad, v_pad, mask = bench_batch.padded_cache(k, v, lengths)
    q4 = q.view(B, HQ, 1, D)

    def cudnn():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, k_pad, v_pad, attn_mask=mask, enable_gqa=True)

    return {"attn_lt varlen bf16": lambda: attn_lt.varlen_attention(q, k, v, cu_q, cu_k, **kw),
            "attn_lt varlen FP8": lambda: attn_lt.varlen_attention(q, k8, v8, cu_q, cu_k, k_descale=kd, v_descale=vd,
                                                                   **kw),
            "SDPA cuDNN, padded": cudnn}


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_batch_flush: no CUDA GPU visible", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name())
    for name, fn in calls().items():
        us = {mode: min(time_ms(fn, rep_ms=150, flush=mode) * 1e3 for _ in range(2)) for mode in L2_FLUSHES}
        print(f"{name:20s} " + "   ".join(f"{mode} flush {t:7.1f} us" for mode, t in us.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
