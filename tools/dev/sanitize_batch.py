#!/usr/bin/env python3
"""A few small serving batches (varlen and paged, the decode blocks split and merged, the row blocks on each kernel,
the mass per key, FP8 caches, a block id past the cache and lengths past the table) run once each, for compute-sanitizer.
Exits 1 when an output is wrong or a bad block id is not reported, 2 without a GPU.

    compute-sanitizer --tool memcheck  python3 tools/dev/sanitize_batch.py
    compute-sanitizer --tool racecheck python3 tools/dev/sanitize_batch.py
"""

from __future__ import annotations

import sys

import torch

import attn_lt
from attn_lt.testing import (cu_seqlens, fp8_kv, fp8_values, paged_reference, random_pages, rel_error,
                             varlen_reference)


cu = cu_seqlens


def reported(what: str) -> int:
    """1 when the bad metadata of the last call was not reported, else 0."""
    try:
        attn_lt.check_batch_errors()
    except ValueError as e:
        print(f"reported: {e}")
        return 0
    print(f"{what} not reported")
    return 1


def off(what: str, o, ref) -> int:
    """1 when the output is off its reference (the rows the reference owns: not NaN), else 0; prints the error."""
    owned = ~torch.isnan(ref[:, 0, 0])
    err = rel_error(o[owned], ref[owned])
    print(f"{what}: error {err:.2e}")
    return int(err > 2e-2)


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    bad = 0
    dt = torch.bfloat16
    for D, Hq, Hkv in ((64, 4, 1), (128, 8, 2), (256, 4, 4)):
        q_lens, k_lens = [1, 40, 0, 2, 130], [700, 40, 9, 0, 300]
        q = torch.randn(sum(q_lens), Hq, D, dtype=dt, device="cuda")
        k = torch.randn(sum(k_lens), Hkv, D, dtype=dt, device="cuda")
        v = torch.randn_like(k)
        o = attn_lt.varlen_attention(q, k, v, cu(q_lens), cu(k_lens), max_seqlen_q=130, max_seqlen_k=700,
                                     causal=True)
        ref, _ = varlen_reference(q, k, v, cu(q_lens), cu(k_lens), causal=True)
        bad += off(f"varlen D{D} Hq{Hq}/Hkv{Hkv}", o, ref)
        kc, vc, table, sk = random_pages([300, 1, 17, 0], 16, Hkv, D, dt)
        qp = torch.randn(4, Hq, D, dtype=dt, device="cuda")
        o = attn_lt.paged_attention(qp, kc, vc, table, sk)
        ref, _ = paged_reference(qp, kc, vc, table, sk)
        bad += off(f"paged D{D}", o, ref)
        # the mass per key of both (a window of 8 rows; every row), then with the bad metadata below
        attn_lt.varlen_attention(q, k, v, cu(q_lens), cu(k_lens), max_seqlen_q=130, max_seqlen_k=700, causal=True,
                                 return_key_mass=True, key_mass_window=8)
        attn_lt.paged_attention(qp, kc, vc, table, sk, return_key_mass=True)
        table[0, 5] = kc.shape[0] + 7  # past the cache: not read, reported
        sk[2] = table.shape[1] * 16 + 3  # past the table
        attn_lt.paged_attention(qp, kc, vc, table, sk)
        bad += reported("bad metadata")
        attn_lt.paged_attention(qp, kc, vc, table, sk, return_key_mass=True)
        bad += reported("bad metadata (with the mass)")
        # an FP8 cache: decode and speculative rows (varlen), paged decode with a bad block
        k8, kd = fp8_kv(k)
        v8, vd = fp8_kv(v)
        q8_lens = [1, 1, 0, 2, 1]
        q8 = torch.randn(sum(q8_lens), Hq, D, dtype=dt, device="cuda")
        o = attn_lt.varlen_attention(q8, k8, v8, cu(q8_lens), cu(k_lens), max_seqlen_q=2, max_seqlen_k=700,
                                     causal=True, k_descale=kd, v_descale=vd)
        ref, _ = varlen_reference(q8, fp8_values(k8, kd), fp8_values(v8, vd), cu(q8_lens), cu(k_lens), causal=True)
        bad += off(f"varlen FP8 D{D}", o, ref)
        kc8, kcd = fp8_kv(kc)
        attn_lt.paged_attention(qp, kc8, fp8_kv(vc)[0], table, sk, k_descale=kcd, return_key_mass=True)
        bad += reported("bad metadata (FP8 cache)")
        # prefill rows against an FP8 cache (converted first): packed keys; paged, with the bad metadata above
        o = attn_lt.varlen_attention(q, k8, v8, cu(q_lens), cu(k_lens), max_seqlen_q=130, max_seqlen_k=700,
                                     causal=True, k_descale=kd, v_descale=vd)
        ref, _ = varlen_reference(q, fp8_values(k8, kd), fp8_values(v8, vd), cu(q_lens), cu(k_lens), causal=True)
        bad += off(f"varlen FP8 prefill rows D{D}", o, ref)
        qc_lens = [40, 1, 17, 0]
        qc = torch.randn(sum(qc_lens), Hq, D, dtype=dt, device="cuda")
        attn_lt.paged_attention(qc, kc8, fp8_kv(vc)[0], table, sk, cu_seqlens_q=cu(qc_lens), max_seqlen_q=40,
                                k_descale=kcd)
        bad += reported("bad metadata (FP8 cache, prefill rows)")
    from attn_lt.fused import device_facts
    if device_facts().hopper:  # MLA decode on a paged latent cache: one part, several parts, a bad block
        kc, _, table, sk = random_pages([2100, 1, 0, 70], 64, 1, 576, dt)
        qp = torch.randn(4, 16, 576, dtype=dt, device="cuda")
        o = attn_lt.paged_attention(qp, kc, kc[..., :512], table, sk)
        ref, _ = paged_reference(qp, kc, kc[..., :512], table, sk)
        bad += off("MLA paged", o, ref)
        table[0, 3] = -1
        attn_lt.paged_attention(qp, kc, kc[..., :512], table, sk)
        bad += reported("bad MLA block")
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
