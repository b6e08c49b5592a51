#!/usr/bin/env python3
"""The attention variants (sliding window, softcap, sinks) on small shapes through every kernel that runs them —
native/flash.cu's prefill rows and split decode (forced), the Hopper prefill kernel (through attention(), where
the GPU has it) and a varlen and a paged batch — each run once, for compute-sanitizer. Exits 1 when an output is
wrong, 2 without a GPU.

    compute-sanitizer --tool memcheck python3 tools/dev/sanitize_variants.py
"""

from __future__ import annotations

import sys

import torch

import attn_lt
from attn_lt.testing import cu_seqlens, forced_flash, reference, rel_error


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bad = 0

    def report(name, out, ref):
        nonlocal bad
        err = rel_error(out, ref)
        ok = err < 2e-2 and not torch.isnan(out).any()
        bad += not ok
        print(f"{name}: error {err:.2e}{'' if ok else '  WRONG'}")

    for Sq, splits in ((1, 5), (3, 2), (90, 1)):
        q = torch.randn(2, 8, Sq, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(2, 2, 700, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        kw = dict(window=(100, 0), softcap=6.0, sinks=torch.randn(8, device="cuda"))
        run, out, lse = forced_flash(q, k, v, causal=True, splits=splits, **kw)
        run()
        torch.cuda.synchronize()
        report(f"flash.cu Sq {Sq} splits {splits}", out, reference(q, k, v, causal=True, **kw)[0])
    q = torch.randn(1, 4, 300, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(1, 2, 500, 64, dtype=torch.float16, device="cuda") for _ in range(2))
    kw = dict(window=(70, 70), softcap=5.0, sinks=torch.randn(4, device="cuda"))
    report("attention() prefill", attn_lt.attention(q, k, v, **kw), reference(q, k, v, **kw)[0])
    lens = [130, 1, 0, 64]
    cu = cu_seqlens(lens)
    qp = torch.randn(sum(lens), 4, 128, dtype=torch.bfloat16, device="cuda")
    kp, vp = (torch.randn(sum(lens), 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    sinks = torch.randn(4, device="cuda")
    out = attn_lt.varlen_attention(qp, kp, vp, cu, cu, max_seqlen_q=130, max_seqlen_k=130, causal=True,
                                   window=(31, 0), sinks=sinks, check=True)
    ref = reference(qp[:130].transpose(0, 1)[None], kp[:130].transpose(0, 1)[None], vp[:130].transpose(0, 1)[None],
                    causal=True, window=(31, 0), sinks=sinks)[0][0].transpose(0, 1)
    report("varlen batch", out[:130], ref)
    cache_k, cache_v = (torch.randn(8, 64, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    table = torch.tensor([[3, 1, 6], [0, 2, 5]], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([150, 7], dtype=torch.int32, device="cuda")
    qd = torch.randn(2, 4, 128, dtype=torch.bfloat16, device="cuda")
    out = attn_lt.paged_attention(qd, cache_k, cache_v, table, seqlens, window=(40, 0), softcap=7.0, sinks=sinks,
                                  check=True)
    keys = torch.cat([cache_k[i] for i in (3, 1, 6)])[:150]
    vals = torch.cat([cache_v[i] for i in (3, 1, 6)])[:150]
    ref = reference(qd[:1].transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], causal=True,
                    window=(40, 0), softcap=7.0, sinks=sinks)[0][0].transpose(0, 1)
    report("paged decode", out[:1], ref)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
