#!/usr/bin/env python3
"""Softmax kernel alone: achieved HBM bandwidth of each variant on chunk-shaped FP32 scores (read 4 B, write
P 2 B per score, plus the mask), out of place so every run sees the same random scores. ``--mass`` adds a
column: PIPE summing P over the rows into the attention mass per key (``return_key_mass``), where it can.

    python tools/bench_softmax.py [--cols 4096,16384,...] [--mib 768] [--mass]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from attn_lt import native  # noqa: E402
from attn_lt.testing import time_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cols", default="1024,4096,8192,16384,28160,32768,65536,131072")
    ap.add_argument("--mib", type=int, default=768, help="score block size")
    ap.add_argument("--heads", type=int, default=6, help="batch entries sharing a (rows, cols) mask")
    ap.add_argument("--pad", type=int, default=0, help="extra floats of row stride (ld = cols + pad)")
    ap.add_argument("--mass", action="store_true", help="also time PIPE adding the attention mass per key")
    a = ap.parse_args(argv)
    variants = ("pipe", "pipe_regs", "row", "two_pass") + (("pipe+mass",) if a.mass else ())
    print(f"{'cols':>7} {'mask':>5} " + "".join(f"{v:>10}" for v in variants) + "   TB/s")
    for cols in map(int, a.cols.split(",")):
        ld = cols + a.pad
        rows = max(1, (a.mib << 20) // (4 * ld * a.heads))
        s = torch.randn(a.heads, rows, ld, device="cuda") * 3
        p = torch.empty(a.heads, rows, 2 * ld, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(a.heads * rows, device="cuda")
        mass = torch.zeros(a.heads, cols, device="cuda") if a.mass else None
        for mask in (None, "bf16"):
            m = torch.randn(rows, cols, device="cuda").to(torch.bfloat16) if mask else None
            args = native.SoftmaxArgs()
            args.scores, args.probs, args.lse = s.data_ptr(), p.data_ptr(), lse.data_ptr()
            args.rows, args.cols, args.batch = rows, cols, a.heads
            args.ld_s, args.bs_s, args.ld_p, args.bs_p = ld, rows * ld, 2 * ld, 2 * rows * ld
            args.Sq, args.Sk, args.g, args.Hkv, args.Hq = rows, cols, 1, a.heads, a.heads
            args.out_dtype = native.DTYPE_CODES["bf16"]
            if m is not None:
                args.mask, args.mask_dtype = m.data_ptr(), native.DTYPE_CODES["bf16"]
                args.m_sb, args.m_sh, args.m_sq, args.m_sk = 0, 0, cols, 1
            bytes_ = a.heads * rows * cols * 6 + (rows * cols * 2 if m is not None else 0)
            cells = ""
            stream = torch.cuda.current_stream().cuda_stream
            for v in variants:
                if v == "row" and cols > 32768:
                    cells += f"{'-':>10}"
                    continue
                args.variant = native.SOFTMAX_VARIANTS[v.split("+")[0]]
                if v == "pipe+mass":
                    args.mass, args.mass_add, args.mass_q0 = mass.data_ptr(), 1, 0
                    if not native.softmax_adds_mass(args):
                        args.mass = args.mass_add = 0
                        cells += f"{'n/a':>10}"
                        continue
                try:
                    ms = time_ms(lambda: native.softmax(args, stream), warmup_ms=25, rep_ms=200)
                except native.CudaError:  # this variant cannot take the row (e.g. the ring does not fit)
                    cells += f"{'n/a':>10}"
                    continue
                finally:
                    args.mass = args.mass_add = 0
                cells += f"{bytes_ / ms / 1e9:>10.2f}"
            print(f"{cols:>7} {mask or '-':>5} {cells}   (ld {ld})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
