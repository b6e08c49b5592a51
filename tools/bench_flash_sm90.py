#!/usr/bin/env python3
"""The Hopper fused kernel (native/flash_sm90.cu) on the FlashAttention-3 protocol, side by side in one run with
PyTorch SDPA's FLASH and cuDNN backends and attn_lt's `wmma` kernel (native/flash.cu, D 64/128); sm90 is the default
(persistent) launch, sm90_grid its grid variant (a CTA a query block and head), sm90_plain the unoverlapped pipeline
(on 128-key tiles, where the default pipeline takes wider ones for long rows at D 64 and 128).

bf16, B * S = 16384 tokens, H * D = 2048, D in {64, 128, 256}, S = 512 ... 16384, causal and not. Every output is
checked against an FP32 reference (sampled rows of two heads) before it is timed. Median milliseconds by CUDA
events (``attn_lt.testing.time_ms``, L2 flushed by a read), TFLOP/s = 4 * B * H * S^2 * D / time (halved when
causal), ratios to each other provider, and the fraction of a bf16 GEMM ceiling (8192^3 torch.matmul) measured in
the same run.
A short table is printed last; the full results go to DIR/bench_flash_sm90.json.

    python tools/bench_flash_sm90.py --out DIR [--dims 64,128,256] [--lengths 512,...,16384] [--rep-ms 100]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_lt  # noqa: E402
from attn_lt import native  # noqa: E402
from attn_lt.fused import fp8_prefill_launch  # noqa: E402
from attn_lt.testing import reference, rel_error, time_ms, time_turns, tolerance  # noqa: E402
from attn_lt.validate import Case  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
PROVIDERS = ("sm90", "sm90_grid", "sm90_plain", "flash", "cudnn", "wmma")


def sm90_call(q, k, v, causal=False, scale=None, variant="default", out=None, lse=None, launch=None):
    """A ready-to-run launch of the Hopper kernel on (B, Hq, Sq, D) q, (B, Hkv, Sk, D) k and (B, Hkv, Sk, Dv) v:
    returns ``(run, out, lse)`` where ``run()`` launches on the current stream (no allocation, no
    synchronisation). ``launch(args, stream)``: the entry point (default ``native.flash_sm90``)."""
    B, Hq, Sq, D = q.shape
    fp8 = q.dtype == torch.float8_e4m3fn  # the FP8 prefill: o bf16, V transposed into a workspace (descale 1)
    o_dtype = torch.bfloat16 if fp8 else q.dtype
    out = torch.empty(B, Hq, Sq, v.shape[3], dtype=o_dtype, device=q.device) if out is None else out
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device) if lse is None else lse
    a = native.FlashArgs()
    a.q, a.k, a.v, a.o, a.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D, a.Dv = B, Hq, k.shape[1], Sq, k.shape[2], D, v.shape[3]
    a.q_sb, a.q_sh, a.q_ss = q.stride()[:3]
    a.k_sb, a.k_sh, a.k_ss = k.stride()[:3]
    a.v_sb, a.v_sh, a.v_ss = v.stride()[:3]
    a.o_sb, a.o_sh, a.o_ss = out.stride()[:3]
    a.scale = D**-0.5 if scale is None else scale
    a.causal = int(causal)
    a.dtype = native.DTYPE_CODES["e4m3" if fp8 else "bf16" if q.dtype == torch.bfloat16 else "fp16"]
    a.kv_dtype = native.DTYPE_CODES["e4m3"] if fp8 else 0
    a.variant = native.FLASH_SM90_VARIANTS[variant]
    workspace = None
    if fp8:  # the workspace attention() would take (V transposed)
        case = Case.contiguous(B, Hq, k.shape[1], Sq, k.shape[2], D, Dv=v.shape[3])
        workspace = torch.empty(fp8_prefill_launch(case).workspace_bytes, dtype=torch.uint8, device=q.device)
        a.o_part = workspace.data_ptr()
    stream = torch.cuda.current_stream().cuda_stream
    launch = native.flash_sm90 if launch is None else launch

    def run():
        launch(a, stream)
        return workspace  # kept alive with the call

    return run, out, lse


def sdpa_call(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def providers(q, k, v, causal, D):
    """name -> a callable returning the output (B, H, S, D), or a string saying why it cannot run."""
    out = {}
    run, o, _ = sm90_call(q, k, v, causal)
    out["sm90"] = (run, o)
    run_g, o_g, _ = sm90_call(q, k, v, causal, variant="grid")
    out["sm90_grid"] = (run_g, o_g)
    run_p, o_p, _ = sm90_call(q, k, v, causal, variant="plain")
    out["sm90_plain"] = (run_p, o_p)
    out["flash"] = sdpa_call(q, k, v, causal, "flash")
    out["cudnn"] = sdpa_call(q, k, v, causal, "cudnn")
    out["wmma"] = (lambda: attn_lt.attention(q, k, v, causal=causal, backend="wmma")) if D in (64, 128) \
        else "wmma runs D 64/128 only"
    return out


def output_of(p):
    """Run provider ``p`` once and return its output tensor."""
    if isinstance(p, tuple):
        run, o = p
        run()
        return o
    return p()


def gemm_ceiling(rep_ms: float) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, rep_ms=rep_ms)
    return 2 * n**3 / ms / 1e9


def bench_case(D, S, causal, rep_ms):
    H, B = HIDDEN // D, TOKENS // S
    torch.manual_seed(S * 1000 + D * 2 + causal)  # fresh random inputs, reproducible per case
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    # Reference: two heads of the first batch entry, up to 256 sampled query rows (always the first and last).
    rows = torch.unique(torch.cat([torch.tensor([0, S - 1]), torch.randint(0, S, (254,))])).cuda() \
        if S > 256 else None
    qs, ks, vs = q[:1, :2], k[:1, :2], v[:1, :2]
    ref, _ = reference(qs, ks, vs, causal=causal, rows=rows)
    row = {"D": D, "S": S, "B": B, "H": H, "causal": causal, "gflop": flops / 1e9}
    errs = {}
    for name, p in providers(q, k, v, causal, D).items():
        if isinstance(p, str):
            row[name] = {"status": "n/a", "reason": p}
            continue
        try:
            o = output_of(p)
            torch.cuda.synchronize()
        except (RuntimeError, ValueError, native.CudaError) as e:  # e.g. an SDPA backend refusing the shape
            row[name] = {"status": "n/a", "reason": str(e).splitlines()[0][:200]}
            continue
        got = o[:1, :2] if rows is None else o[:1, :2][:, :, rows]
        errs[name] = rel_error(got, ref)
        fn = (lambda p=p: p[0]()) if isinstance(p, tuple) else p
        ms = time_ms(fn, warmup_ms=25, rep_ms=rep_ms)
        row[name] = {"status": "ok", "ms": ms, "tflops": flops / ms / 1e9, "rel_error": errs[name]}
    # Correct = within the FA tolerance of the best SDPA backend's own error (2x + floor).
    base = min([errs[n] for n in ("flash", "cudnn") if n in errs] or [math.nan])
    tol = tolerance(base) if math.isfinite(base) else 2e-2
    for name, e in errs.items():
        row[name]["correct"] = bool(e <= tol)
    row["tolerance"] = tol
    del q, k, v
    return row


def fmt(row, name, key="tflops"):
    c = row.get(name, {})
    if c.get("status") != "ok":
        return "n/a"
    return f"{c[key]:.0f}" + ("" if c["correct"] else "!WRONG")


def ratio(row, a, b):
    ca, cb = row.get(a, {}), row.get(b, {})
    if ca.get("status") != "ok" or cb.get("status") != "ok":
        return "-"
    return f"{cb['ms'] / ca['ms']:.2f}"


def protocol_parser(doc: str, results: str, dims: str, lengths: str) -> argparse.ArgumentParser:
    """The command line of a benchmark on the FA3 protocol: --out (the directory of ``results``), --dims,
    --lengths, --causal and --rep-ms, with these defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help=f"directory for {results}")
    ap.add_argument("--dims", default=dims)
    ap.add_argument("--lengths", default=lengths)
    ap.add_argument("--causal", default="0,1", help="0, 1 or 0,1")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="timing budget of one measurement")
    return ap


def protocol_start(ap: argparse.ArgumentParser, argv, name: str) -> argparse.Namespace | None:
    """A protocol benchmark's arguments parsed and its output directory made; None (said on stderr) without a
    CUDA GPU."""
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name}: no CUDA GPU visible", file=sys.stderr)
        return None
    os.makedirs(a.out, exist_ok=True)
    return a


def protocol_cases(a: argparse.Namespace) -> list[tuple[int, int, bool]]:
    """The (D, S, causal) cases of a protocol command line, head dims outermost, then lengths, then causal."""
    return [(D, S, bool(int(c))) for D in map(int, a.dims.split(",")) for S in map(int, a.lengths.split(","))
            for c in a.causal.split(",")]


def protocol_rates(calls: dict, B: int, H: int, S: int, D: int, causal: bool, rep_ms: float) -> dict:
    """TFLOP/s of each of ``calls`` (name -> callable) on one protocol case, timed in turns
    (attn_lt.testing.time_turns)."""
    ms = time_turns(calls, rep_ms=rep_ms)
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    return {name: flops / t / 1e9 for name, t in ms.items()}


def protocol_line(D: int, S: int, causal: bool, tf: dict, pairs, tail: str = "") -> str:
    """A protocol case's line: each call's TFLOP/s, then the ratio a / b of each (a, b) of ``pairs``."""
    return (f"D{D:<4}S{S:<6}{'causal' if causal else 'full  '} " + " ".join(f"{n} {x:4.0f}" for n, x in tf.items()) +
            " | " + " ".join(f"{a}/{b} {tf[a] / tf[b]:.3f}" for a, b in pairs) + tail)


def main(argv=None) -> int:
    ap = protocol_parser(__doc__, "bench_flash_sm90.json", "64,128,256", "512,1024,2048,4096,8192,16384")
    a = protocol_start(ap, argv, "bench_flash_sm90")
    if a is None:
        return 2
    if not native.flash_sm90_supported():
        print(f"bench_flash_sm90: the sm_90a kernel cannot run here ({torch.cuda.get_device_name()}, "
              f"cc {torch.cuda.get_device_capability()})", file=sys.stderr)
        return 2
    t0 = time.time()
    ceiling = gemm_ceiling(a.rep_ms)
    print(f"bf16 GEMM 8192^3: {ceiling:.0f} TFLOP/s", flush=True)
    rows = []
    for D, S, causal in protocol_cases(a):
        row = bench_case(D, S, causal, a.rep_ms)
        if row["sm90"].get("status") == "ok":
            row["sm90"]["of_gemm_ceiling"] = row["sm90"]["tflops"] / ceiling
        rows.append(row)
        print(f"D={D} S={S} causal={int(causal)}: " + " ".join(f"{n}={fmt(row, n)}" for n in PROVIDERS), flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "native_sources": native.load().attn_lt_source_hash().decode(),
        "gemm_bf16_8192_tflops": ceiling, "protocol": f"bf16, B*S={TOKENS}, H*D={HIDDEN}",
        "seconds": round(time.time() - t0, 1),
    }
    path = os.path.join(a.out, "bench_flash_sm90.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta['gpu']}, {meta['protocol']}, TFLOP/s (x = speed-up of sm90 over the provider), "
          f"GEMM ceiling {ceiling:.0f}; {path}")
    hdr = f"{'D':>4} {'S':>6} {'causal':>6} | {'sm90':>6} {'grid':>6} {'plain':>6} {'flash':>6} {'cudnn':>6} " \
          f"{'wmma':>6} | {'xgrid':>6} {'xflash':>6} {'xcudnn':>6} {'xwmma':>6} {'%gemm':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        g = r["sm90"].get("of_gemm_ceiling")
        print(f"{r['D']:>4} {r['S']:>6} {int(r['causal']):>6} | " + " ".join(f"{fmt(r, n):>6}" for n in PROVIDERS)
              + f" | {ratio(r, 'sm90', 'sm90_grid'):>6} {ratio(r, 'sm90', 'flash'):>6} {ratio(r, 'sm90', 'cudnn'):>6} "
              + f"{ratio(r, 'sm90', 'wmma'):>6} "
              + f"{'-' if g is None else f'{100 * g:.0f}%':>6}")
    wrong = [(r["D"], r["S"], r["causal"], n) for r in rows for n in PROVIDERS
             if r.get(n, {}).get("status") == "ok" and not r[n]["correct"]]
    if wrong:
        print(f"WRONG outputs (error above tolerance): {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
