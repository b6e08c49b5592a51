#!/usr/bin/env python3
"""The fused path's attention mass per key (native/flash.cu's attn_lt_key_mass, and native/mass_sm90.cu's pass on
sm_90 for 128 summed rows a head and more) on small shapes — every head dim, every column padding (2, 4, 8 columns
a head and whole tiles), causal with Sq != Sk, a window, a strided mask, softcap and sinks, the key tail, several
tiles a head — each run once, for compute-sanitizer. Exits 1 when a mass is wrong, 2 without a GPU.

    compute-sanitizer --tool memcheck python3 tools/dev/sanitize_mass.py
"""

from __future__ import annotations

import sys

import torch

import attn_lt
from attn_lt.testing import key_mass_reference


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bad = 0
    cases = [dict(D=64, Sq=1, Sk=97), dict(D=128, Sq=1, Sk=300, causal=True, window=(50, 0)),
             dict(D=128, Sq=3, Sk=300, causal=True), dict(D=256, Sq=7, Sk=129),
             dict(D=128, Sq=70, Sk=200, causal=True, window=(20, 0), sinks=True, kmw=33),
             dict(D=64, Sq=150, Sk=100, causal=True, softcap=5.0), dict(D=128, Sq=40, Sk=190, mask=True),
             dict(D=64, Sq=300, Sk=260, causal=True), dict(D=128, Sq=200, Sk=333, window=(40, 7)),
             dict(D=256, Sq=150, Sk=130, causal=True, kmw=140)]
    for c in cases:
        D, Sq, Sk = c["D"], c["Sq"], c["Sk"]
        q = torch.randn(2, 8, Sq, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(2, 2, Sk, D, dtype=torch.bfloat16, device="cuda")
        mask = (torch.rand(2, 1, Sq, Sk + 8, device="cuda") > 0.2)[..., :Sk] if c.get("mask") else None
        kw = dict(attn_mask=mask, causal=c.get("causal", False), window=c.get("window"), softcap=c.get("softcap"),
                  sinks=torch.randn(8, device="cuda") if c.get("sinks") else None)
        _, mass = attn_lt.attention(q, k, k, return_key_mass=True, key_mass_window=c.get("kmw"), backend="wmma",
                                    **kw)
        torch.cuda.synchronize()
        ref = key_mass_reference(q, k, kw["attn_mask"], kw["causal"], key_mass_window=c.get("kmw"),
                                 window=kw["window"], softcap=kw["softcap"], sinks=kw["sinks"])
        err = ((mass.double() - ref).abs() / (ref + 1e-6)).max().item()
        ok = err < 5e-3 and not torch.isnan(mass).any()
        bad += not ok
        print(f"{c}: worst relative error {err:.2e}{'' if ok else '  WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
