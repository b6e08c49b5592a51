"""The attention mass of every row against the plain call, on the issue's three all-rows shapes (B1 S16k: H32/8 D 128
causal, H32 D 64 and D 256 not causal), in one process: each call timed twice, the second turn in the reverse order,
each time after 200 ms of the same call, and the better median kept. Run it once a library (``ATTN_LT_LIB=...``) to
compare builds.

    python3 tools/experiments/ab_key_mass.py --tag NAME [--out DIR]

Prints a line a shape; with ``--out``, writes DIR/key_mass_NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import attn_lt  # noqa: E402
from attn_lt.testing import time_turns  # noqa: E402

SHAPES = [("S16k causal D128 H32/8", 32, 8, 16384, True, 128), ("S16k full D64 H32", 32, 32, 16384, False, 64),
          ("S16k full D256 H32", 32, 32, 16384, False, 256)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_key_mass: no CUDA GPU visible", file=sys.stderr)
        return 2
    rows = []
    for name, Hq, Hkv, S, causal, D in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(1, Hq, S, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        calls = {"plain": lambda: attn_lt.attention(q, k, v, causal=causal),
                 "all": lambda: attn_lt.attention(q, k, v, causal=causal, return_key_mass=True)}
        ms = time_turns(calls, warmup_ms=200, rep_ms=300)
        rows.append(dict(shape=name, **ms))
        print(f"{a.tag:6s} {name:24s} plain {ms['plain']:7.3f} ms  every row {ms['all']:7.3f} ms "
              f"({ms['all'] / ms['plain']:.3f}x)", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"key_mass_{a.tag}.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
