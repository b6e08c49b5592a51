#!/usr/bin/env python3
"""Time the fused path's decode kernel (native/flash.cu, split over the keys) on a few shapes with forced split
counts, beside SDPA's cuDNN and flash backends: ms and effective TB/s (K+V bytes). For profiling with ncu:

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:flash_fwd -c 1 \\
        python tools/probe_decode.py --once
"""

from __future__ import annotations

import argparse
import sys

import torch

from attn_lt.testing import events_ms, forced_flash
from attn_lt.validate import check_tensors
from attn_lt.wmma import fused_launch


def launcher(q, k, v, splits):
    return forced_flash(q, k, v, splits=splits)[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true", help="one launch of B8 H32/8 Sq1 Sk32k (for ncu)")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shapes = [(8, 32, 8, 1, 32768), (8, 32, 32, 1, 32768), (8, 32, 8, 16, 32768), (1, 32, 8, 1, 32768)]
    if a.once:
        q, k, v = (torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in
                   ((8, 32, 1, 128), (8, 8, 32768, 128), (8, 8, 32768, 128)))
        f = launcher(q, k, v, fused_launch(check_tensors(q, k, v)).splits)
        f()
        torch.cuda.synchronize()
        return 0
    for B, Hq, Hkv, Sq, Sk in shapes:
        q = torch.randn(B, Hq, Sq, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(B, Hkv, Sk, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        gb = 2 * k.numel() * 2 / 1e9
        auto = fused_launch(check_tensors(q, k, v)).splits
        row = [f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} (auto splits {auto}):"]
        for splits in sorted({1, 2, 4, 8, 16, auto}):
            ms = events_ms(launcher(q, k, v, splits))
            row.append(f"s{splits} {gb / ms:.2f}")
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                def f():
                    with sdpa_kernel(be):
                        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
                ms = events_ms(f)
                row.append(f"{name} {gb / ms:.2f}")
            except RuntimeError:
                row.append(f"{name} n/a")
        print(" ".join(row), "TB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
