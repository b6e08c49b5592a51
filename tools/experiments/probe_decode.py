#!/usr/bin/env python3
"""Time the fused path's decode kernels (native/flash.cu, and on Hopper native/flash_sm90.cu's decode kernel:
``--kernels``, each split over the keys) on a few shapes with forced split counts (columns ``s<n>`` for flash.cu,
``w<n>`` for the wgmma decode kernel, ``p1`` for the wgmma prefill kernel, ``auto`` for the rule's kernel and
splits), beside SDPA's cuDNN and flash backends: ms and effective TB/s (K+V bytes), each the median of 7 replays of
a CUDA graph of 20 back-to-back calls (``--eager``: 7 batches of 20 calls launched from Python, which measure the
host's launch rate wherever a call's GPU work is shorter than its host cost, e.g. B1 at 8k keys). ``--mask`` adds a
(B, 1, Sq, Sk) additive bf16 mask (the decode suite's). ``ATTN_LT_LIB`` selects another build of the library (A/B
runs).

    python3 tools/experiments/probe_decode.py [--cases B,Hq,Hkv,Sq,Sk;...] [--splits 1,2,4,8,16] [--kernels flash,sm90_decode]
                                 [--mask] [--eager] [--json FILE]

For profiling with ncu:

    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:flash_fwd -c 1 \\
        python3 tools/experiments/probe_decode.py --once
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from attn_lt.testing import forced_flash  # noqa: E402
from attn_lt.validate import check_tensors  # noqa: E402
from attn_lt.fused import fused_launch  # noqa: E402

CASES = "8,32,8,1,32768;8,32,32,1,32768;8,32,8,16,32768;1,32,8,1,32768"


def batch_ms(fn, calls: int = 20, batches: int = 7, graph: bool = True) -> float:
    """Median over ``batches`` of the mean milliseconds of ``calls`` back-to-back calls (after a warm-up), the
    calls captured in one CUDA graph and replayed (``graph``; eager launches where capture fails) or launched one by
    one from Python."""
    fn()
    torch.cuda.synchronize()
    launch = None
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                fn()  # warm-up on the capture stream (libraries set up their per-stream state outside capture)
                side.synchronize()
                with torch.cuda.graph(g, stream=side):
                    for _ in range(calls):
                        fn()
            launch = g.replay
            launch()
            torch.cuda.synchronize()
        except RuntimeError:  # a call that cannot be captured: time it eagerly
            torch.cuda.synchronize()
    if launch is None:
        def launch():
            for _ in range(calls):
                fn()
    # the clocks settle first: replays for at least 50 ms (a GPU left idle by the capture starts slower)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    launch()
    e.record()
    e.synchronize()
    for _ in range(min(200, int(50 / max(s.elapsed_time(e), 1e-3)))):
        launch()
    times = []
    for _ in range(batches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch()
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
    ap.add_argument("--kernels", default="flash",
                    help="kernels to force the split counts on: flash (native/flash.cu), sm90_decode, sm90 (Hopper)")
    ap.add_argument("--dim", type=int, default=128, help="head dim D (default 128)")
    ap.add_argument("--mask", action="store_true", help="with a (B, 1, Sq, Sk) additive bf16 mask")
    ap.add_argument("--eager", action="store_true", help="launch each call from Python instead of graph replay")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    graph = not a.eager

    def mask_for(B: int, Sq: int, Sk: int):
        return torch.randn(B, 1, Sq, Sk, dtype=torch.bfloat16, device="cuda") if a.mask else None

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if a.once:
        B, Hq, Hkv, Sq, Sk = (int(x) for x in a.cases.split(";")[0].split(","))
        q, k, v = (torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in
                   ((B, Hq, Sq, a.dim), (B, Hkv, Sk, a.dim), (B, Hkv, Sk, a.dim)))
        m = mask_for(B, Sq, Sk)
        auto = fused_launch(check_tensors(q, k, v, m))
        forced_flash(q, k, v, m, splits=auto.splits, kernel=auto.kernel)[0]()
        torch.cuda.synchronize()
        return 0
    print(f"{torch.cuda.get_device_name()}, library {os.environ.get('ATTN_LT_LIB', 'built')}, "
          f"{'masked, ' if a.mask else ''}{'graph replay' if graph else 'eager launches'}", flush=True)
    rows = []
    for spec in a.cases.split(";"):
        B, Hq, Hkv, Sq, Sk = (int(x) for x in spec.split(","))
        q = torch.randn(B, Hq, Sq, a.dim, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(B, Hkv, Sk, a.dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        m = mask_for(B, Sq, Sk)
        gb = (2 * k.numel() * 2 + (0 if m is None else m.numel() * 2)) / 1e9  # K, V and mask bytes
        auto = fused_launch(check_tensors(q, k, v, m))
        row = {"case": f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} D{a.dim}" + (" mask" if a.mask else ""),
               "auto_splits": auto.splits, "auto_kernel": auto.kernel, "tbps": {}}
        row["tbps"]["auto"] = gb / batch_ms(forced_flash(q, k, v, m, splits=auto.splits, kernel=auto.kernel)[0],
                                            graph=graph)
        for kernel in a.kernels.split(","):
            # the prefill kernel ("sm90", column p1) takes no split
            for splits in [1] if kernel == "sm90" else sorted(int(s) for s in a.splits.split(",")):
                run = forced_flash(q, k, v, m, splits=splits, kernel=kernel)[0]
                name = {"flash": "s", "sm90_decode": "w", "sm90": "p"}[kernel]
                row["tbps"][f"{name}{splits}"] = gb / batch_ms(run, graph=graph)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def f(be=be):
                with sdpa_kernel(be):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=Hq != Hkv)
            try:
                row["tbps"][name] = gb / batch_ms(f, graph=graph)
            except RuntimeError:
                row["tbps"][name] = None
        rows.append(row)
        cells = " ".join(f"{n} {'n/a' if r is None else f'{r:.2f}'}" for n, r in row["tbps"].items())
        print(f"{row['case']} (auto {auto.kernel} s{auto.splits}): {cells} TB/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "lib": os.environ.get("ATTN_LT_LIB"), "mask": a.mask,
                       "graph": graph, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
