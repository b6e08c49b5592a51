"""How fast a decode block of native/flash.cu runs a key tile with 1, 2, 3 and 4 blocks an SM: n x SMs requests of
one query row and ``--keys`` keys each (Hq 4 / Hkv 1, D 128, so one block a request), their keys not split into parts
(the planner's least part size raised past them), through ``varlen_attention`` on a bf16 cache and on its FP8 copy.
With one block an SM, a block runs alone; the last blocks of a ragged batch do.

    python3 tools/experiments/probe_decode_blocks.py [--keys 8192] [--out DIR]

Prints a line per blocks an SM: microseconds a 64-key tile (a block's time over its tiles) and the K/V bytes read
per second; writes DIR/decode_blocks_per_sm.json with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import attn_lt  # noqa: E402
from attn_lt import batch  # noqa: E402
from attn_lt.testing import cu_seqlens, fp8_kv, time_ms  # noqa: E402

HQ, HKV, D, TILE = 4, 1, 128, 64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=8192)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_blocks: no CUDA GPU visible", file=sys.stderr)
        return 2
    least = batch.SPLIT_MIN_KEYS
    batch.SPLIT_MIN_KEYS = a.keys + TILE  # one part a request
    batch.clear_plan_cache()
    try:
        rows = run(a.keys)
    finally:
        batch.SPLIT_MIN_KEYS = least
        batch.clear_plan_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "decode_blocks_per_sm.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "keys": a.keys, "rows": rows}, f, indent=1)
    return 0


def run(S: int) -> list[dict]:
    """A row per blocks an SM: each cache's milliseconds, microseconds a tile and TB/s."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for per_sm in (1, 2, 3, 4):
        B = per_sm * sms
        q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B * S, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        k8, kd = fp8_kv(k)
        v8, vd = fp8_kv(v)
        cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        cu_k = cu_seqlens([S] * B)
        row = {"blocks_per_sm": per_sm}
        for name, kk, vv, kw, es in (("bf16", k, v, {}, 2), ("fp8", k8, v8, dict(k_descale=kd, v_descale=vd), 1)):
            ms = time_ms(lambda: attn_lt.varlen_attention(q, kk, vv, cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=S,
                                                          **kw), rep_ms=100)
            row[name] = {"ms": ms, "us_per_tile": ms * 1e3 / (S // TILE), "tb_s": B * S * HKV * D * 2 * es / ms / 1e9}
        rows.append(row)
        print(f"{per_sm} blocks an SM: bf16 {row['bf16']['us_per_tile']:.3f} us a tile ({row['bf16']['tb_s']:.2f} "
              f"TB/s), FP8 {row['fp8']['us_per_tile']:.3f} us a tile ({row['fp8']['tb_s']:.2f} TB/s)", flush=True)
        del q, k, v, k8, v8
    return rows


if __name__ == "__main__":
    sys.exit(main())
