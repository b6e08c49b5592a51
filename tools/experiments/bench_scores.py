#!/usr/bin/env python3
"""The long path's Q@K^T alone: cuBLASLt (the heuristic's algorithm and the tuner's best) against the Hopper kernel
of native/scores_sm90.cu, on the chunk shapes the long path runs; FP32 scores written, in TB/s of those writes,
beside the GPU's write (fill) and copy rates measured in the same run.

    python3 tools/experiments/bench_scores.py [--shapes rows:cols:batch:D,...] [--tune-ms 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tools/
from attn_lt import native  # noqa: E402
from bench import ceilings  # noqa: E402
from attn_lt.lt import algos, cublaslt  # noqa: E402
from attn_lt.lt.cublaslt import GemmKey  # noqa: E402
from attn_lt.testing import rel_error, scores_args, time_ms  # noqa: E402
from attn_lt.validate import address_alignment  # noqa: E402

#: B1 H16 S16k D128 and D64 chunks at the default budget (2048 rows x 16384 keys, 3 heads), a causal chunk's
#: shorter rows, GQA decode-like few rows, a long prefill tile.
SHAPES = "2048:16384:3:128,4096:16384:3:64,2048:8192:3:128,64:32768:8:128,3072:28160:2:128"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--tune-ms", type=float, default=3000.0, help="cuBLASLt tuning budget a shape")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    dev = torch.cuda.current_device()
    copy_tbs = ceilings()["copy_tbs"]  # the suite's device-to-device copy, read + write
    big = torch.empty(1 << 28, device="cuda")  # 1 GiB
    write_tbs = big.nbytes / time_ms(lambda: big.fill_(1.0)) / 1e9
    del big
    print(f"{torch.cuda.get_device_name()}: fill {write_tbs:.2f} TB/s, copy {copy_tbs:.2f} TB/s (read + write)")
    print(f"{'rows':>6} {'cols':>6} {'b':>2} {'D':>4} | {'heur ms':>8} {'tuned ms':>8} {'native ms':>9} | "
          f"{'heur':>5} {'tuned':>5} {'native':>6} TB/s | native/tuned  err")
    results = []
    stream = torch.cuda.current_stream().cuda_stream
    ws = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    for spec in a.shapes.split(","):
        rows, cols, batch, D = map(int, spec.split(":"))
        q = torch.randn(batch, rows, D, device="cuda", dtype=dt)
        k = torch.randn(batch, cols, D, device="cuda", dtype=dt)
        s = torch.full((batch, rows, cols), math.nan, device="cuda")
        alpha = 1 / math.sqrt(D)
        key = GemmKey("qk", a.dtype, m=cols, n=rows, k=D, batch=batch, trans_a=True, trans_b=False, lda=D, ldb=D,
                      ldc=cols, stride_a=cols * D, stride_b=rows * D, stride_c=rows * cols,
                      align_a=address_alignment(k.data_ptr()), align_b=address_alignment(q.data_ptr()),
                      align_c=address_alignment(s.data_ptr()))
        g = cublaslt.gemm(dev, key)
        al = np.array([alpha], dtype=np.float32)
        ops = (k.data_ptr(), q.data_ptr(), s.data_ptr(), al.ctypes.data, ws.data_ptr(), ws.nbytes, stream)
        algo, wsz = g.heuristic_top(ws.nbytes)
        g.use(algo, wsz, "heuristic", True)
        heur = time_ms(lambda: g.run(*ops))
        entry = algos.tune(g, ws.nbytes, ops, a.tune_ms)
        tuned = min(entry.median_ms, heur)
        ref = s.clone()
        args = scores_args(q, k, s, alpha)
        s.fill_(math.nan)
        native.scores_sm90(args, stream)
        torch.cuda.synchronize()
        err = rel_error(s, ref)
        nat = time_ms(lambda: native.scores_sm90(args, stream))
        gb = s.nbytes / 1e9
        row = dict(rows=rows, cols=cols, batch=batch, D=D, heuristic_ms=round(heur, 4), tuned_ms=round(tuned, 4),
                   native_ms=round(nat, 4), heuristic_tbs=round(gb / heur, 3), tuned_tbs=round(gb / tuned, 3),
                   native_tbs=round(gb / nat, 3), native_over_tuned=round(tuned / nat, 3), rel_err_vs_cublaslt=err)
        results.append(row)
        print(f"{rows:>6} {cols:>6} {batch:>2} {D:>4} | {heur:>8.4f} {tuned:>8.4f} {nat:>9.4f} | "
              f"{gb / heur:>5.2f} {gb / tuned:>5.2f} {gb / nat:>6.2f}      | {tuned / nat:>11.3f}×  {err:.1e}")
        del q, k, s, ref
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), fill_tbs=write_tbs, copy_tbs=copy_tbs,
                           shapes=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
