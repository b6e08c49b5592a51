#!/usr/bin/env python3
"""The attention mass per key (``return_key_mass``) against the same call without it: the fused call and its mass
pass over every query row and over the last 64 rows (SnapKV's observation window), the long path's mass, and eager
PyTorch where it fits (softmax(q kᵀ) summed over the rows: its time and peak memory); then serving batches
(:func:`run_serving`). ``auto`` takes the faster of
the first and the long path by ``attn_lt.fused.prefers_fused_mass``. A case's attn_lt calls (and each serving
batch's pair) are timed call by call in rounds (:func:`attn_lt.testing.time_interleaved`, an L2 flush before each
call), so that their ratios share the GPU's clocks; the eager calls, whose power draw would slow whatever follows
them, are timed after them, each alone (:func:`attn_lt.testing.time_ms`). Each call's peak memory from one more
call.
Prints a table; ``--out DIR`` writes key_mass.json.

    python tools/bench_key_mass.py [--quick] [--rep-ms 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attn_lt  # noqa: E402
from attn_lt.testing import causal_mask, time_interleaved, time_ms  # noqa: E402

#: (name, B, Hq, Hkv, Sq, Sk, D, causal)
CASES = [("S16k causal D128", 1, 32, 8, 16384, 16384, 128, True),
         ("S64k causal D128", 1, 32, 8, 65536, 65536, 128, True),
         ("S16k full D64 MHA", 1, 32, 32, 16384, 16384, 64, False),
         ("S16k full D256 MHA", 1, 32, 32, 16384, 16384, 256, False),
         ("decode B8 Sk32k D128", 8, 32, 8, 1, 32768, 128, False)]
WINDOW = 64


def eager_mass(q, k, causal: bool, rows: int | None):
    """softmax(scale q kᵀ) summed over the (last ``rows``) query rows, as eager PyTorch code writes it."""
    Sq, Sk = q.shape[2], k.shape[2]
    qq = q if rows is None else q[:, :, -rows:]
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (qq @ kk.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~causal_mask(Sq, Sk, q.device)[-qq.shape[2]:], -math.inf)
    return s.softmax(-1).sum(2)


def peak_gib(fn) -> float:
    """Peak GiB of one call above the memory in use before it, or nan when it runs out of memory."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        fn()
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return math.nan
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def ms_or_nan(ms: float | None) -> float:
    return math.nan if ms is None else ms  # the timers' None: out of memory


def run_case(name: str, B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, causal: bool, *, with_lt: bool,
             rep_ms: float = 200) -> dict:
    """One case's row: each call's median ms, peak GiB and ratio to the plain call."""
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def call(**kw):
        return lambda: attn_lt.attention(q, k, v, causal=causal, **kw)

    calls = {"plain": call(),
             "fused, all rows": call(return_key_mass=True, backend="wmma"),
             f"fused, last {WINDOW}": call(return_key_mass=True, key_mass_window=WINDOW, backend="wmma")}
    if with_lt:
        calls["lt, all rows"] = call(return_key_mass=True, backend="lt")
    times = time_interleaved(calls, rep_ms=rep_ms)
    eager = {"eager, all rows": lambda: eager_mass(q, k, causal, None),
             f"eager, last {WINDOW}": lambda: eager_mass(q, k, causal, WINDOW)}
    for label, fn in eager.items():
        try:
            times[label] = time_ms(fn)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            times[label] = None
    calls.update(eager)
    row = {"case": name, "shape": f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D}{' causal' if causal else ''}"}
    for label, fn in calls.items():
        row[label] = {"ms": ms_or_nan(times[label]), "peak_gib": peak_gib(fn)}
    for label in calls:
        row[label]["over_plain"] = row[label]["ms"] / row["plain"]["ms"]
    return row


def run_serving(rep_ms: float = 200) -> list[dict]:
    """Serving batches (varlen_attention / paged_attention with ``return_key_mass``) against the same call without
    it: ragged decode (B64, lengths U[256, 8192], Hq 32 / Hkv 8, D 128) on packed keys and on a paged cache of
    16-key blocks (permuted), and a packed prefill of 8 documents of 1k-8k tokens with the mass of each one's last
    64 rows (SnapKV during serving)."""
    from attn_lt.testing import cu_seqlens, random_pages

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(256, 8193, (64,), generator=g).tolist()
    cu = cu_seqlens(lens)
    ones = torch.arange(65, dtype=torch.int32, device="cuda")
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc, vc, table, seqlens = random_pages(lens, 16, 8, 128, torch.bfloat16, generator=g)
    docs = torch.randint(1024, 8193, (8,), generator=g).tolist()
    cd = cu_seqlens(docs)
    pq = torch.randn(sum(docs), 32, 128, device="cuda", dtype=torch.bfloat16)
    pk = torch.randn(sum(docs), 8, 128, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn_like(pk)
    cases = {
        "ragged decode B64, varlen": lambda **kw: attn_lt.varlen_attention(
            q, k, v, ones, cu, max_seqlen_q=1, max_seqlen_k=8192, **kw),
        "ragged decode B64, paged 16": lambda **kw: attn_lt.paged_attention(q, kc, vc, table, seqlens, **kw),
        "packed prefill 8 docs, causal": lambda **kw: attn_lt.varlen_attention(
            pq, pk, pv, cd, cd, max_seqlen_q=8192, max_seqlen_k=8192, causal=True, **kw),
    }
    rows = []
    for name, fn in cases.items():
        t = time_interleaved({"plain": fn, "mass": lambda: fn(return_key_mass=True, key_mass_window=WINDOW)},
                             rep_ms=rep_ms)
        plain, mass = ms_or_nan(t["plain"]), ms_or_nan(t["mass"])
        rows.append({"case": name, "plain_ms": plain, "mass_ms": mass, "over_plain": mass / plain})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first and last cases only")
    ap.add_argument("--no-lt", action="store_true", help="skip the long path's mass")
    ap.add_argument("--rep-ms", type=float, default=200.0,
                    help="milliseconds of the calls themselves that a case's timing covers (pauses and flushes on top)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    cases = [CASES[0], CASES[-1]] if a.quick else CASES
    rows = []
    for case in cases:
        rows.append(run_case(*case, with_lt=not a.no_lt, rep_ms=a.rep_ms))
        torch.cuda.empty_cache()
    serving = run_serving(a.rep_ms)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "dtype": "bf16", "timing": "time_interleaved"}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "key_mass.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "serving": serving}, f, indent=1)
    labels = [lbl for lbl in rows[0] if lbl not in ("case", "shape")]
    print(f"{gpu}, bf16; ms (over the plain call); eager: ms, peak GiB")
    print("| case | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for r in rows:
        cells = []
        for lbl in labels:
            c = r[lbl]
            if math.isnan(c["ms"]):
                cells.append("out of memory")
            elif lbl.startswith("eager"):
                cells.append(f"{c['ms']:.3f} ({c['over_plain']:.2f}x), {c['peak_gib']:.1f} GiB")
            else:
                cells.append(f"{c['ms']:.3f} ({c['over_plain']:.3f}x)")
        print(f"| {r['case']} | " + " | ".join(cells) + " |")
    print(f"serving batches, mass of each request's last {WINDOW} rows (decode: its one row):")
    for r in serving:
        print(f"  {r['case']:<32} plain {r['plain_ms']:.3f} ms, with the mass {r['mass_ms']:.3f} ms "
              f"({r['over_plain']:.3f}x)")


if __name__ == "__main__":
    main()
