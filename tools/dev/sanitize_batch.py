#!/usr/bin/env python3
"""A few small serving batches (varlen and paged, the decode blocks split and merged, the row blocks on each kernel,
the mass per key, a block id past the cache and lengths past the table) run once each, for compute-sanitizer.
Exits 1 when an output is wrong or a bad block id is not reported, 2 without a GPU.

    compute-sanitizer --tool memcheck  python3 tools/dev/sanitize_batch.py
    compute-sanitizer --tool racecheck python3 tools/dev/sanitize_batch.py
"""

from __future__ import annotations

import sys

import torch

import attn_lt
from attn_lt.testing import cu_seqlens, paged_reference, random_pages, rel_error, varlen_reference


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
        owned = ~torch.isnan(ref[:, 0, 0])
        err = rel_error(o[owned], ref[owned])
        print(f"varlen D{D} Hq{Hq}/Hkv{Hkv}: error {err:.2e}")
        bad += err > 2e-2
        kc, vc, table, sk = random_pages([300, 1, 17, 0], 16, Hkv, D, dt)
        qp = torch.randn(4, Hq, D, dtype=dt, device="cuda")
        o = attn_lt.paged_attention(qp, kc, vc, table, sk)
        ref, _ = paged_reference(qp, kc, vc, table, sk)
        err = rel_error(o, ref)
        print(f"paged D{D}: error {err:.2e}")
        bad += err > 2e-2
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
    from attn_lt.fused import device_facts
    if device_facts().hopper:  # MLA decode on a paged latent cache: one part, several parts, a bad block
        kc, _, table, sk = random_pages([2100, 1, 0, 70], 64, 1, 576, dt)
        qp = torch.randn(4, 16, 576, dtype=dt, device="cuda")
        o = attn_lt.paged_attention(qp, kc, kc[..., :512], table, sk)
        ref, _ = paged_reference(qp, kc, kc[..., :512], table, sk)
        err = rel_error(o, ref)
        print(f"MLA paged: error {err:.2e}")
        bad += err > 2e-2
        table[0, 3] = -1
        attn_lt.paged_attention(qp, kc, kc[..., :512], table, sk)
        bad += reported("bad MLA block")
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
