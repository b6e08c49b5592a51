#!/usr/bin/env python3
"""Time the fused path's decode kernel (native/flash.cu, split over the keys) on a few shapes with forced split
counts, beside SDPA's cuDNN and flash backends: ms and effective TB/s (K+V bytes), each the median of 7 batches of
20 back-to-back calls between two CUDA events. Calls whose GPU work is shorter than their host cost (B1 at 8k keys,
about 30 µs) measure the host's launch rate, not the kernels. ``ATTN_LT_LIB`` selects another build of the library
(A/B runs).

    python tools/probe_decode.py [--cases B,Hq,Hkv,Sq,Sk;...] [--splits 1,2,4,8,16] [--json FILE]

For profiling with ncu:

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:flash_fwd -c 1 \\
        python tools/probe_decode.py --once
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attn_lt.testing import forced_flash  # noqa: E402
from attn_lt.validate import check_tensors  # noqa: E402
from attn_lt.wmma import fused_launch  # noqa: E402

CASES = "8,32,8,1,32768;8,32,32,1,32768;8,32,8,16,32768;1,32,8,1,32768"


def batch_ms(fn, calls: int = 20, batches: int = 7) -> float:
    """Median over ``batches`` of the mean milliseconds of ``calls`` back-to-back calls (after a warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true",
                    help="one launch of the first of --cases (default B8 H32/8 Sq1 Sk32k), for ncu")
    ap.add_argument("--cases", default=CASES, help=f"B,Hq,Hkv,Sq,Sk;... (default {CASES})")
    ap.add_argument("--splits", default="1,2,4,8,16", help="split counts to force, besides the rule's")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if a.once:
        B, Hq, Hkv, Sq, Sk = (int(x) for x in a.cases.split(";")[0].split(","))
        q, k, v = (torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in
                   ((B, Hq, Sq, 128), (B, Hkv, Sk, 128), (B, Hkv, Sk, 128)))
        forced_flash(q, k, v, splits=fused_launch(check_tensors(q, k, v)).splits)[0]()
        torch.cuda.synchronize()
        return 0
    print(f"{torch.cuda.get_device_name()}, library {os.environ.get('ATTN_LT_LIB', 'built')}", flush=True)
    rows = []
    for spec in a.cases.split(";"):
        B, Hq, Hkv, Sq, Sk = (int(x) for x in spec.split(","))
        q = torch.randn(B, Hq, Sq, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(B, Hkv, Sk, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        gb = 2 * k.numel() * 2 / 1e9
        auto = fused_launch(check_tensors(q, k, v)).splits
        row = {"case": f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk}", "auto_splits": auto, "tbps": {}}
        for splits in sorted({auto, *(int(s) for s in a.splits.split(","))}):
            row["tbps"][f"s{splits}"] = gb / batch_ms(forced_flash(q, k, v, splits=splits)[0])
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def f(be=be):
                with sdpa_kernel(be):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
            try:
                row["tbps"][name] = gb / batch_ms(f)
            except RuntimeError:
                row["tbps"][name] = None
        rows.append(row)
        cells = " ".join(f"{n} {'n/a' if r is None else f'{r:.2f}'}" for n, r in row["tbps"].items())
        print(f"{row['case']} (auto s{auto}): {cells} TB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "lib": os.environ.get("ATTN_LT_LIB"), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
