"""The long path at very long keys: key tiles (the default) against whole-row chunks (the ``key_tiles=False``
option) and SDPA's backends, side by side in one process on one GPU.

    python3 tools/experiments/bench_key_tiles.py [--shapes 1x4x262144,1x4x524288c,1x2x1048576c] [--reps 3] [--out DIR]
                                    [--profile]

A shape is BxHxS (D 128, bf16), ``c`` for causal. Per provider: median ms of ``--reps`` calls after warm-up calls
(until the long path has no GEMM left to tune), TFLOP/s, and for the long path the floor of its design, 12 bytes a
computed score at the copy rate measured in the same run. The outputs are compared with each other and with
SDPA's (relative error), so a fast wrong answer cannot pass. ``--profile``: where one call's GPU time goes
(torch.profiler, per kernel family: Q@K^T, softmax, P@V, the tiles' merge), for both long-path plans.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tools/
import attn_lt  # noqa: E402
from attn_lt import config  # noqa: E402
from attn_lt.testing import events_ms, rel_error  # noqa: E402
from bench import ceilings  # noqa: E402


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    causal = text.endswith("c")
    b, h, s = (int(x) for x in text.rstrip("c").split("x"))
    return b, h, s, causal


def run_lt(q, k, v, causal: bool, tiles: bool, reps: int, profile: bool = False):
    with config.override(key_tiles=tiles):
        p = attn_lt.plan(q, k, v, causal=causal, backend="lt")
    warm = 0
    while warm < 4:  # tuning happens in the first calls; time the steady state
        out = p.run(q, k, v)
        torch.cuda.synchronize()
        warm += 1
        if p.program is not None and not p.program.pending:
            break
    ms = events_ms(lambda: p.run(q, k, v), reps)
    where = None
    if profile:
        from bench_lt import profile_call

        where = profile_call(lambda: p.run(q, k, v), None)
    return out, ms, p.chunks.summary(), warm, where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x4x262144,1x4x524288c,1x2x1048576c")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="where the GPU time of one long-path call goes")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_key_tiles needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    rate = ceilings()["copy_tbs"] * 1e12
    rows = []
    for text in a.shapes.split(","):
        B, H, S, causal = parse_shape(text)
        D = 128
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scores = B * H * S * S * (0.5 if causal else 1.0)
        flops = 4 * scores * D
        results = {}
        outs = {}
        for name, tiles in (("lt key tiles", True), ("lt whole rows", False)):
            out, ms, summary, warm, where = run_lt(q, k, v, causal, tiles, a.reps, a.profile)
            outs[name] = out
            results[name] = {"ms": ms, "plan": summary, "warm_calls": warm, "profile": where}
        for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    outs[name] = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    torch.cuda.synchronize()
                    results[name] = {"ms": events_ms(
                        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), a.reps)}
            except RuntimeError as e:
                results[name] = {"ms": None, "error": str(e).splitlines()[0][:120]}
        ref_name = "sdpa flash" if "sdpa flash" in outs else "sdpa cudnn"
        floor_ms = 12 * scores / rate * 1e3
        for name, r in results.items():
            if r["ms"] is not None:
                r["tflops"] = flops / (r["ms"] / 1e3) / 1e12
            if name in outs and ref_name in outs and name != ref_name:
                r["rel_err_vs_" + ref_name.replace(" ", "_")] = rel_error(outs[name].float(), outs[ref_name].float())
            if name.startswith("lt") and r["ms"] is not None:
                r["floor_ms"] = floor_ms
                r["of_floor"] = floor_ms / r["ms"]
        rows.append({"shape": text, "B": B, "H": H, "S": S, "D": D, "causal": causal, "results": results})
        q = k = v = outs = None  # free before the next shape
        torch.cuda.empty_cache()
    doc = {"gpu": gpu, "copy_rate_GBps": rate / 1e9, "rows": rows}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "key_tiles.json"), "w") as f:
            json.dump(doc, f, indent=2)
    print(f"{gpu}, copy rate {rate / 1e9:.0f} GB/s; floor of the long path: 12 B a computed score at that rate")
    print(f"{'shape':<16}{'provider':<16}{'ms':>10}{'TFLOP/s':>9}{'of floor':>9}{'ms/tiles':>9}  err / plan")
    for row in rows:
        base = row["results"]["lt key tiles"]["ms"]
        for name, r in row["results"].items():
            if r["ms"] is None:
                print(f"{row['shape']:<16}{name:<16}{'-':>10}  {r.get('error', '')}")
                continue
            err = next((f"{v:.2e}" for k_, v in r.items() if k_.startswith("rel_err")), "")
            of = f"{r['of_floor']:.0%}" if "of_floor" in r else ""
            ratio = r["ms"] / base
            print(f"{row['shape']:<16}{name:<16}{r['ms']:>10.1f}{r['tflops']:>9.0f}{of:>9}{ratio:>9.2f}  {err}")
        print(f"{'':<16}plan: {row['results']['lt key tiles']['plan'][:150]}")
        for name in ("lt key tiles", "lt whole rows"):
            w = row["results"][name].get("profile")
            if w:
                parts = ", ".join(f"{k_} {v:.1f}" for k_, v in w["kernels_ms"].items())
                pair = f"; Q@K^T {w['qk_ms']:.1f}, P@V {w['pv_ms']:.1f}" if "qk_ms" in w else ""
                print(f"{'':<16}{name}: GPU ms by kernel: {parts}{pair}; busy {w['busy_ms']:.1f} over a span of "
                      f"{w['span_ms']:.1f} ({w['streams']} streams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
