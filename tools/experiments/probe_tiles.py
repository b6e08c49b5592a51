"""Probe: the long path's key tiles at other row-block and tile sizes than the planner's (its constants replaced
for the probe), on one causal shape. How ``TILE_ROWS`` and ``KEY_TILE_MAX`` in attn_lt/chunks.py were chosen.

    python3 tools/experiments/probe_tiles.py [--heads 4] [--seq 524288]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attn_lt  # noqa: E402
from attn_lt import config  # noqa: E402
from attn_lt.testing import events_ms  # noqa: E402

planner = importlib.import_module("attn_lt.chunks")  # the planner of the long path's chunks

#: (rows a row block, longest tile (0: as long as the budget allows), lanes)
VARIANTS = [(1024, 0, 2), (2048, 0, 2), (4096, 0, 2), (2048, 32768, 2), (1024, 0, 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=524288)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_tiles needs a CUDA GPU", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, a.heads, a.seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * a.heads * a.seq * a.seq / 2 * 128
    for i, (rows, longest, lanes) in enumerate(VARIANTS):
        planner.TILE_ROWS, planner.KEY_TILE_MAX = rows, longest or 1 << 40
        # a budget a few bytes apart: neither the planner's cache nor attention()'s sees the constants
        with config.override(lanes=lanes):
            p = attn_lt.plan(q, k, v, causal=True, backend="lt", workspace_bytes=(1 << 30) - 256 * i)
        for _ in range(3):  # the first calls tune
            p.run(q, k, v)
            torch.cuda.synchronize()
            if not p.program.pending:
                break
        ms = events_ms(lambda: p.run(q, k, v), 3)
        print(f"rows {rows} longest tile {longest or '-'} lanes {lanes}: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s; "
              f"{p.chunks.summary()[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
