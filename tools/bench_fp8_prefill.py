#!/usr/bin/env python3
"""The FP8 prefill (q, k, v float8 e4m3, one descale factor a head, output bf16: native/flash_sm90.cu in e4m3)
against attn_lt's own bf16 call of the same values and PyTorch SDPA's cuDNN and FLASH backends (bf16), in one run.

FlashAttention-3's protocol: B * S = 16384 tokens, H * D = 2048, D in {128, 256}, S = 4096 ... 16384, causal and
not. attn_lt FP8 is the whole ``attention()`` call (V's transpose into the workspace included); its split into the
transpose and the attention kernel comes from the profiler, on one case a head dim. Every provider's output is
checked against an FP64 reference of the FP8 inputs' values (sampled rows of two heads) before it is timed; the
FP8 errors are reported beside the bf16 calls' and beside PyTorch's at the FP8 path's precision (P rounded to
e4m3). Median milliseconds by CUDA events (``attn_lt.testing.time_ms``, L2 flushed by a read), TFLOP/s =
4 B H S^2 D / time (halved when causal). A short table is printed last; the full results go to
DIR/bench_fp8_prefill.json.

    python tools/bench_fp8_prefill.py --out DIR [--dims 128,256] [--lengths 4096,8192,16384] [--rep-ms 100]
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_lt  # noqa: E402
from bench_flash_sm90 import (HIDDEN, TOKENS, protocol_cases, protocol_parser, protocol_start,  # noqa: E402
                              sdpa_call)
from attn_lt.testing import fp8_kv, fp8_values, reference, rel_error, time_ms  # noqa: E402

PROVIDERS = ("fp8", "bf16", "cudnn", "flash")


def kernel_split(fn) -> dict:
    """Device milliseconds of one call of ``fn`` by kernel (the profiler's CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and ("transpose_v_e4m3" in e.key or "flash_sm90_fwd" in e.key):
            name = "transpose" if "transpose_v_e4m3" in e.key else "attention"
            out[name] = out.get(name, 0.0) + t / 1e3 / 5
    return out


def bench_case(D, S, causal, rep_ms, split: bool):
    H, B = HIDDEN // D, TOKENS // S
    g = torch.Generator(device="cuda").manual_seed(S * 1000 + D * 2 + causal)
    raw = [torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(3)]
    (q8, qd), (k8, kd), (v8, vd) = (fp8_kv(x.transpose(1, 2)) for x in raw)  # one factor a head
    del raw
    qf, kf, vf = (fp8_values(x8, d).transpose(1, 2) for x8, d in ((q8, qd), (k8, kd), (v8, vd)))
    q8, k8, v8 = (x8.transpose(1, 2).contiguous() for x8 in (q8, k8, v8))
    qb, kb, vb = (x.to(torch.bfloat16) for x in (qf, kf, vf))  # the FP8 values, exactly, in bf16
    del qf, kf, vf
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    rows = torch.unique(torch.cat([torch.tensor([0, S - 1]), torch.randint(0, S, (254,))])).cuda()
    sub = [x[:1, :2].float() for x in (qb, kb, vb)]
    ref, _ = reference(*sub, causal=causal, rows=rows, dtype=torch.float64)
    emu, _ = reference(*sub, causal=causal, rows=rows, dtype=torch.float64, p_e4m3=True)
    row = {"D": D, "S": S, "B": B, "H": H, "causal": causal, "gflop": flops / 1e9,
           "e4m3_p_error": rel_error(emu.to(torch.bfloat16), ref)}
    fp8 = lambda: attn_lt.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,  # noqa: E731
                                    v_descale=vd)
    calls = {"fp8": fp8, "bf16": lambda: attn_lt.attention(qb, kb, vb, causal=causal, backend="wmma"),
             "cudnn": sdpa_call(qb, kb, vb, causal, "cudnn"), "flash": sdpa_call(qb, kb, vb, causal, "flash")}
    for name, fn in calls.items():
        try:
            o = fn()
            torch.cuda.synchronize()
        except (RuntimeError, ValueError) as e:
            row[name] = {"status": "n/a", "reason": str(e).splitlines()[0][:200]}
            continue
        err = rel_error(o[:1, :2][:, :, rows], ref)
        ms = time_ms(fn, warmup_ms=25, rep_ms=rep_ms)
        row[name] = {"status": "ok", "ms": ms, "tflops": flops / ms / 1e9, "rel_error": err}
    if split and row["fp8"].get("status") == "ok":
        row["fp8_kernels_ms"] = kernel_split(fp8)
    return row


def main(argv=None) -> int:
    a = protocol_start(protocol_parser(__doc__, "bench_fp8_prefill.json", "128,256", "4096,8192,16384"), argv,
                       "bench_fp8_prefill")
    if a is None:
        return 2
    rows = []
    first_length = int(a.lengths.split(",")[0])  # (each head dim's kernel split is measured there, not causal)
    for D, S, causal in protocol_cases(a):
        rows.append(bench_case(D, S, causal, a.rep_ms, split=S == first_length and not causal))
        torch.cuda.empty_cache()
    doc = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "protocol": f"B*S={TOKENS}, H*D={HIDDEN}, TFLOP/s", "rows": rows}
    with open(os.path.join(a.out, "bench_fp8_prefill.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{doc['gpu']}: TFLOP/s (medians), errors vs FP64 of the FP8 values")
    print(f"{'D':>4} {'S':>6} {'c':>2} | {'fp8':>6} {'bf16':>6} {'cudnn':>6} {'flash':>6} | {'fp8/bf16':>8} "
          f"{'fp8/cudnn':>9} | {'err fp8':>8} {'e4m3 P':>8} {'bf16':>8}")
    for r in rows:
        t = {n: r[n]["tflops"] if r.get(n, {}).get("status") == "ok" else float("nan") for n in PROVIDERS}
        e = {n: r[n]["rel_error"] if r.get(n, {}).get("status") == "ok" else float("nan") for n in PROVIDERS}
        print(f"{r['D']:>4} {r['S']:>6} {int(r['causal']):>2} | {t['fp8']:6.0f} {t['bf16']:6.0f} {t['cudnn']:6.0f} "
              f"{t['flash']:6.0f} | {t['fp8'] / t['bf16']:8.2f} {t['fp8'] / t['cudnn']:9.2f} | {e['fp8']:8.2e} "
              f"{r['e4m3_p_error']:8.2e} {e['bf16']:8.2e}")
    for r in rows:
        if "fp8_kernels_ms" in r:
            print(f"D{r['D']} S{r['S']}: kernels {r['fp8_kernels_ms']} ms (whole call {r['fp8']['ms']:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
