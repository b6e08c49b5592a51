"""The attention variants' cost (sliding window, softcap, sinks) beside the plain call and whatever else runs the
same variant in the same run: PyTorch SDPA with the equivalent dense mask, and FlexAttention (compiled) where it
compiles. Every call is timed in two turns (the second in the reverse order), each time after 200 ms of the same
call, and the better median kept. Prints a table; ``--out DIR`` writes variants.json.

    python tools/bench_variants.py [--seq 32768] [--window 4096] [--no-flex] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attn_lt  # noqa: E402
from attn_lt.testing import time_turns, window_mask  # noqa: E402


def flex_calls(q, k, v, window: int, softcap: float):
    """FlexAttention's sliding-window and softcap calls (compiled), or a reason they could not be built."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        S = q.shape[2]
        flex = torch.compile(flex_attention, dynamic=False)

        def local(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < window)

        def causal(b, h, qi, ki):
            return qi >= ki

        def cap(score, b, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

        win_mask = create_block_mask(local, None, None, S, S, device="cuda")
        causal_mask = create_block_mask(causal, None, None, S, S, device="cuda")
        gqa = q.shape[1] != k.shape[1]
        calls = {"window": lambda: flex(q, k, v, block_mask=win_mask, enable_gqa=gqa),
                 "causal": lambda: flex(q, k, v, block_mask=causal_mask, enable_gqa=gqa),
                 "softcap": lambda: flex(q, k, v, block_mask=causal_mask, score_mod=cap, enable_gqa=gqa)}
        for f in calls.values():
            f()
        torch.cuda.synchronize()
        return calls, None
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {}, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096, help="keys a row sees (left edge window - 1, causal)")
    ap.add_argument("--heads", default="32,8", help="query heads, kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--rep-ms", type=float, default=300.0)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_variants: no CUDA GPU visible", file=sys.stderr)
        return 2
    Hq, Hkv = map(int, args.heads.split(","))
    S, D, W = args.seq, args.head_dim, args.window
    torch.manual_seed(0)
    q = torch.randn(1, Hq, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, Hkv, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, Hkv, S, D, dtype=torch.bfloat16, device="cuda")
    sinks = torch.randn(Hq, device="cuda")
    win = (W - 1, 0)
    calls = {}  # name -> call: timed in turns below
    att = attn_lt.attention
    calls["attn_lt causal"] = lambda: att(q, k, v, causal=True)
    calls["attn_lt full (not causal)"] = lambda: att(q, k, v)
    calls["attn_lt window"] = lambda: att(q, k, v, causal=True, window=win)
    calls["attn_lt sinks"] = lambda: att(q, k, v, causal=True, sinks=sinks)
    calls["attn_lt softcap"] = lambda: att(q, k, v, causal=True, softcap=args.softcap)
    calls["attn_lt window+sinks"] = lambda: att(q, k, v, causal=True, window=win, sinks=sinks)
    calls["attn_lt window+softcap"] = lambda: att(q, k, v, causal=True, window=win, softcap=args.softcap)
    gqa = Hq != Hkv
    mask = window_mask(S, S, win, causal=True, device="cuda")
    F = torch.nn.functional.scaled_dot_product_attention
    calls["sdpa causal"] = lambda: F(q, k, v, is_causal=True, enable_gqa=gqa)
    calls["sdpa window (dense bool mask)"] = lambda: F(q, k, v, attn_mask=mask, enable_gqa=gqa)  # (S^2 bytes, kept)
    flex_why = "not asked (--no-flex)"
    if not args.no_flex:
        flex, flex_why = flex_calls(q, k, v, W, args.softcap)
        for name, fn in flex.items():
            calls[f"flex {name}"] = fn
    # decode: gpt-oss's shape (64/8 heads, D 64), window 128 and sinks, against the plain call at the same keys
    dq = torch.randn(8, 64, 1, 64, dtype=torch.bfloat16, device="cuda")
    dk = torch.randn(8, 8, S, 64, dtype=torch.bfloat16, device="cuda")
    dv = torch.randn(8, 8, S, 64, dtype=torch.bfloat16, device="cuda")
    ds = torch.randn(64, device="cuda")
    calls["decode plain (B8 64/8 D64)"] = lambda: att(dq, dk, dv, causal=True)
    calls["decode window 128 + sinks"] = lambda: att(dq, dk, dv, causal=True, window=(127, 0), sinks=ds)
    calls["decode plain at 128 keys"] = lambda: att(dq, dk[:, :, -128:], dv[:, :, -128:], causal=True)
    # each call after 200 ms of itself (a GPU's clocks settle under its load), in two turns, the better median kept
    rows = time_turns(calls, warmup_ms=200, rep_ms=args.rep_ms)

    full = rows["attn_lt causal"]
    flops = 4 * S * S / 2 * Hq * D  # causal
    print(f"== attention variants on {torch.cuda.get_device_name()} (B1 Hq{Hq} Hkv{Hkv} S{S} D{D} bf16, window {W},"
          f" softcap {args.softcap:g}); flex: {flex_why or 'compiled'}")
    print(f"{'call':<34}{'ms':>10}{'vs causal':>11}")
    for name, ms in rows.items():
        ratio = "" if ms is None or name.startswith("decode") else f"{ms / full:.3f}x"
        shown = "OOM" if ms is None else f"{ms:.3f}"
        print(f"{name:<34}{shown:>10}{ratio:>11}")
    # score pairs a row block computes: causal S^2 / 2, the window about S W - W^2 / 2
    print(f"causal attn_lt: {flops / full / 1e9:.1f} TFLOP/s; the window's pairs are {W / S * (2 - W / S):.3f} of "
          f"the causal call's, {W / S * (1 - W / S / 2):.3f} of the full call's")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "variants.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "seq": S, "window": W, "heads": [Hq, Hkv], "D": D,
                       "softcap": args.softcap, "flex": flex_why, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
