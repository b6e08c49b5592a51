"""Decode through native/flash.cu (dense attention(), varlen and paged batches, bf16 and FP8 KV caches) with this
tree's library against another build of libattn_lt.so, in one process: both libraries' attn_lt_flash_fwd and
attn_lt_batch_fwd run the same calls (the other build must share this tree's attn_lt.h), timed in turns (four, every
other one in reverse order, the best median kept). Checks first that every call fills its output and that the two
builds' paged FP8 call has about the same error against FP64.

    python3 tools/experiments/ab_decode.py --other OLD/libattn_lt.so --out DIR

Batches: B64 every request 8k keys; B64 lengths uniform in [256, 8192]; B16 in [4k, 64k]; B16 in [256, 8192]; B4 in
[1k, 32k]; Hq 32 / Hkv 8, D 128.
Prints a line a call (microseconds and the ratio this / other); writes DIR/ab_decode.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attn_lt  # noqa: E402
from attn_lt import fastpath, native  # noqa: E402
from attn_lt.testing import (cu_seqlens, fp8_kv, fp8_values, paged_reference, random_pages, rel_error,  # noqa: E402
                             time_turns)

HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16


def other_library(path: str) -> ctypes.CDLL:
    """The other build, its launchers typed as native.load() types this tree's."""
    lib = ctypes.CDLL(path)
    for name, args in (("attn_lt_batch_fwd", native.BatchArgs), ("attn_lt_flash_fwd", native.FlashArgs)):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.POINTER(args), ctypes.c_void_p]
    lib.attn_lt_error_string.restype = ctypes.c_char_p
    lib.attn_lt_error_string.argtypes = [ctypes.c_int]
    return lib


def calls_for(lengths: list[int], dense: bool) -> tuple[dict, tuple]:
    """name -> call of one batch, and the paged FP8 call's cache of 16-key blocks (for the error check)."""
    B, total, smax = len(lengths), sum(lengths), max(lengths)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    calls = {}
    if dense:  # transformers' (B, S, Hkv, D) cache seen as (B, Hkv, S, D)
        kd = torch.randn(B, smax, HKV, D, dtype=DT, device="cuda")
        vd = torch.randn_like(kd)
        k8, kf = fp8_kv(kd)
        v8, vf = fp8_kv(vd)
        qd, kb, vb, k8, v8 = q.view(B, HQ, 1, D), kd.transpose(1, 2), vd.transpose(1, 2), k8.transpose(1, 2), \
            v8.transpose(1, 2)
        calls["dense_bf16"] = lambda: attn_lt.attention(qd, kb, vb)
        calls["dense_fp8"] = lambda: attn_lt.attention(qd, k8, v8, k_descale=kf, v_descale=vf)
    k = torch.randn(total, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    pk8, pkd = fp8_kv(k)
    pv8, pvd = fp8_kv(v)
    cu_q, cu_k = torch.arange(B + 1, dtype=torch.int32, device="cuda"), cu_seqlens(lengths)
    calls["varlen_bf16"] = lambda: attn_lt.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=smax)
    calls["varlen_fp8"] = lambda: attn_lt.varlen_attention(q, pk8, pv8, cu_q, cu_k, max_seqlen_q=1, max_seqlen_k=smax,
                                                           k_descale=pkd, v_descale=pvd)
    for bs in (16, 64):
        kc, vc, table, seqlens = random_pages(lengths, bs, HKV, D, DT)
        kc8, kcd = fp8_kv(kc)
        vc8, vcd = fp8_kv(vc)
        if bs == 16:
            checked = (q, kc8, vc8, table, seqlens, kcd, vcd)
        calls[f"paged{bs}_bf16"] = (lambda kc=kc, vc=vc, t=table, s=seqlens: attn_lt.paged_attention(q, kc, vc, t, s))
        calls[f"paged{bs}_fp8"] = (lambda kc8=kc8, vc8=vc8, t=table, s=seqlens, kd=kcd, vd=vcd:
                                   attn_lt.paged_attention(q, kc8, vc8, t, s, k_descale=kd, v_descale=vd))
    return calls, checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other build's libattn_lt.so")
    ap.add_argument("--out", default="bench-results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    os.makedirs(a.out, exist_ok=True)
    fastpath.set_enabled(False)  # (the compiled fast path would keep this library's launcher)
    libs = {"this": native.load(), "other": other_library(a.other)}
    load = native.load

    def on(which, fn):
        def run():
            native.load = lambda: libs[which]
            return fn()
        return run

    random.seed(0)
    batches = {"B64_8k": ([8192] * 64, True), "B64_ragged": ([random.randint(256, 8192) for _ in range(64)], False),
               "B16_64k": ([random.randint(4096, 65536) for _ in range(16)], False),
               "B16_ragged": ([random.randint(256, 8192) for _ in range(16)], False),
               "B4_32k": ([random.randint(1024, 32768) for _ in range(4)], False)}
    res = {"gpu": torch.cuda.get_device_name(), "other": a.other, "rows": []}
    ok = True
    try:
        for name, (lengths, dense) in batches.items():
            torch.manual_seed(len(lengths))
            calls, (q, kc8, vc8, table, seqlens, kcd, vcd) = calls_for(lengths, dense)
            ref, _ = paged_reference(q, fp8_values(kc8, kcd), fp8_values(vc8, vcd), table, seqlens)
            err = {}
            for which in libs:
                for call in calls.values():
                    out = on(which, call)()
                    out.fill_(float("nan"))
                    ok &= not torch.isnan(on(which, call)()).any().item()
                err[which] = rel_error(on(which, calls["paged16_fp8"])(), ref)
            ok &= err["this"] <= 1.5 * err["other"] + 1e-4
            t = time_turns({f"{n}|{w}": on(w, c) for n, c in calls.items() for w in libs}, rep_ms=150, turns=4)
            for n in calls:
                this, other = t[f"{n}|this"] * 1e3, t[f"{n}|other"] * 1e3
                res["rows"].append(dict(batch=name, call=n, this_us=this, other_us=other))
                print(f"{name:10s} {n:13s} this {this:8.1f} us  other {other:8.1f} us  this/other {this / other:.3f}",
                      flush=True)
            print(f"{name}: paged FP8 error this {err['this']:.3e}, other {err['other']:.3e}", flush=True)
            res[f"{name}_error"] = err
    finally:
        native.load = load
    with open(os.path.join(a.out, "ab_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
