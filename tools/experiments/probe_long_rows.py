"""Probe: how long the long path's key tiles should be. Each shape runs under several tile caps, interleaved over
two rounds at the default 1 GiB budget: ``whole`` (no row is tiled unless the budget forces it), ``rule`` (the
shipped rule: :func:`attn_lt.chunks.long_rows` and :func:`attn_lt.chunks.tile_keys`), or a number N (calls of at
least ``TILE_MIN_ROWS`` rows tile keys past N into balanced tiles of at most N, masked calls too). How
``ONE_CTA_KEYS`` and the per-mask lengths in attn_lt/chunks.py were put to use. A variant ``rbN`` instead keeps the
shipped tile rule and plans whole-row chunks of at most N query rows (``ROW_BLOCK``, ``CAUSAL_ROW_BLOCK``).

    python3 tools/experiments/probe_long_rows.py [--caps whole,rule,16384,8192] [--shapes 16:16384:16384:128,16:32768:32768:128:c]
    python3 tools/experiments/probe_long_rows.py --caps rb1024,rb512 --shapes 128:8192:8192:192/128:c

A shape is H:Sq:Sk:D (or D_qk/D_v), B = 1 and Hq = Hkv, with ``:c`` for causal and ``:m`` (bf16) or ``:b`` (bool)
for a dense mask (1, 1, Sq, Sk) that hides every row's last 1/16 of the keys.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tools/
import attn_lt  # noqa: E402
from attn_lt.testing import events_ms  # noqa: E402

planner = importlib.import_module("attn_lt.chunks")  # the planner of the long path's chunks

SHAPES = ("16:32768:32768:128,16:32768:32768:128:c,16:65536:65536:128,16:65536:65536:128:c,32:131072:131072:128:c,"
          "4:65536:65536:512,16:1024:65536:128")


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool, str]:
    parts = text.split(":")
    H, Sq, Sk = (int(x) for x in parts[:3])
    D, _, Dv = parts[3].partition("/")
    return (H, Sq, Sk, int(D), int(Dv or D), "c" in parts[4:],
            "m" if "m" in parts[4:] else "b" if "b" in parts[4:] else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="whole,rule",
                    help="comma-separated: whole, rule, or a tile cap in keys; /pN pads score rows by N floats")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated H:Sq:Sk:D[/Dv][:c][:m|:b]")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="also print where one call of each variant spends its GPU time (bench_lt's kernel profile), "
                         "after the shape's timed rounds; a profiler session may tax the launches of the shapes "
                         "timed after it, so profile one shape a run where their times matter")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_long_rows needs a CUDA GPU", file=sys.stderr)
        return 2
    shipped, shipped_ld = planner.tile_keys, planner.score_ld
    shipped_rb = planner.ROW_BLOCK, planner.CAUSAL_ROW_BLOCK
    caps = args.caps.split(",")
    for H, Sq, Sk, D, Dv, causal, masked in (parse_shape(s) for s in args.shapes.split(",")):
        q = torch.randn(1, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, H, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, H, Sk, Dv, device="cuda", dtype=torch.bfloat16)
        mask = None
        if masked == "m":
            mask = torch.zeros(1, 1, Sq, Sk, device="cuda", dtype=torch.bfloat16)
            mask[..., Sk - Sk // 16:] = float("-inf")
        elif masked == "b":
            mask = torch.ones(1, 1, Sq, Sk, device="cuda", dtype=torch.bool)
            mask[..., Sk - Sk // 16:] = False
        flops = 2 * H * Sq * Sk * (D + Dv) / (2 if causal else 1)
        plans = {}
        for i, variant in enumerate(caps):
            cap, _, pad = variant.partition("/p")
            try:  # the planner patched for this variant, restored however the variant ends
                if cap.startswith("rb"):  # row blocks of that many rows, the shipped tile rule
                    planner.ROW_BLOCK = planner.CAUSAL_ROW_BLOCK = int(cap[2:])
                    cap = "rule"
                planner.tile_keys = (shipped if cap == "rule" else
                                     (lambda case: 1 << 40) if cap == "whole" else (lambda case, n=int(cap): n))
                if pad:  # score rows padded by that many floats
                    planner.score_ld = lambda n, pad=int(pad): shipped_ld(n) + pad
                # a budget a few bytes above 1 GiB (never below: a lane that loses its last bytes may lose an
                # entry), so that neither the planner's cache nor attention()'s sees the patch
                p = attn_lt.plan(q, k, v, causal=causal, attn_mask=mask, backend="lt",
                                 workspace_bytes=(1 << 30) + 512 * (i + 1))
                for _ in range(3):  # the first calls build the program (under the patch) and tune
                    p.run(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                    if not p.program.pending:
                        break
            finally:
                planner.tile_keys, planner.score_ld = shipped, shipped_ld
                planner.ROW_BLOCK, planner.CAUSAL_ROW_BLOCK = shipped_rb
            plans[variant] = p
        times = {n: [] for n in plans}
        for _ in range(2):
            for n, p in plans.items():
                times[n].append(events_ms(lambda p=p: p.run(q, k, v, attn_mask=mask), args.reps))
        best = {n: min(t) for n, t in times.items()}
        base = best[caps[0]]
        cells = " | ".join(f"{n} " + "/".join(f"{ms:.2f}" for ms in t) + f" ms {flops / best[n] / 1e9:.0f} TF "
                           f"x{best[n] / base:.3f}" for n, t in times.items())
        kind = (" causal" if causal else "") + {"m": " masked", "b": " bool-masked"}.get(masked, "")
        print(f"H{H} Sq{Sq} Sk{Sk} D{D}{f'/{Dv}' if Dv != D else ''}{kind}: {cells}", flush=True)
        for n, p in plans.items():
            print(f"    {n}: {p.chunks.summary()[:150]}")
            if args.profile:  # after the timed rounds: a profiler session may tax later launches
                from bench_lt import profile_call

                prof = profile_call(lambda p=p: p.run(q, k, v, attn_mask=mask), None)
                print(f"      profile: {prof}")
        del q, k, v, mask, plans
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
