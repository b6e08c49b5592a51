#!/usr/bin/env python3
"""FP8 KV caches for decode on one GPU, in one run: the same batches from a bf16 cache and from an FP8 (e4m3,
per-kv-head factors) cache, varlen and paged, with the roofline of the bytes each reads at the copy rate measured
in the same run, and the FP8 call's error.

1. **equal lengths**: B 64, Hq 32 / Hkv 8, D 128, every request 8k keys: ``attention()`` on a dense cache (PyTorch
   SDPA's cuDNN and FLASH beside it on the bf16 cache), and the batch calls.
2. **ragged decode**: B 64, lengths uniform in [256, 8192]; and B 16, lengths in [4k, 64k] (the serving issue's).
   Paged caches in vLLM's layout (num_blocks, block_size, Hkv, D) with blocks of 16 and 64, and blocks of 16 in
   FlashInfer's HND layout (a block's rows of one head contiguous; the same logical tensor, other strides).
3. **error**: the FP8 call against the FP64 attention of the cache's FP8 values (the kernel's own error) and of the
   bf16 values it was quantized from (what quantizing costs), beside the bf16 call's error against the latter.
4. **prefill chunks** (chunked prefill against an FP8 cache, which the batch calls convert to bf16 first): 4
   chunks of 2048 rows against prefixes of 8k-32k keys, blocks of 16, permuted tables; the same batch from the bf16
   cache, and the conversion's floor (the FP8 bytes of the blocks the requests use read once, their bf16 written
   once, at the copy rate).
5. **MLA decode** (Hopper): DeepSeek's paged latent cache (blocks of 64, one latent head of 576, v its first 512
   columns) in bf16 and in FP8 (one factor), Hq 128 and 16 query heads a request, equal and ragged lengths, with
   the roofline of the latent's bytes read once, PyTorch SDPA (efficient, math) on the equal-length batches gathered
   dense, and the same errors.

    python tools/bench_fp8_kv.py [--out DIR] [--only dense,batches,prefill,mla]

Prints a short table last; writes DIR/fp8_kv.json. Medians of CUDA-event timings (``attn_lt.testing.time_ms``, L2
flushed by a read).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import attn_lt  # noqa: E402
from attn_lt.testing import (cu_seqlens, fp8_kv, fp8_values, paged_gather, paged_reference, random_pages,  # noqa: E402
                             rel_error, sdpa, time_ms, varlen_reference)
from torch.nn.attention import SDPBackend  # noqa: E402

DT = torch.bfloat16
HQ, HKV, D = 32, 8, 128


def copy_rate() -> float:
    """Device copy rate (bytes read + written per second) of a 2 GiB buffer."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) * 1e3


def decode_batch(lengths: list[int]) -> tuple:
    """One query row a request and packed keys of ``lengths``: q, cu_q, cu_k, k, v (bf16) and their FP8 copies
    k8, kd, v8, vd."""
    B, total = len(lengths), sum(lengths)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    k, v = torch.randn(total, HKV, D, dtype=DT, device="cuda"), torch.randn(total, HKV, D, dtype=DT, device="cuda")
    return (q, cu_q, cu_seqlens(lengths), k, v) + fp8_kv(k) + fp8_kv(v)


def batch(lengths: list[int], rate: float) -> dict:
    B, total, smax = len(lengths), sum(lengths), max(lengths)
    q, cu_q, cu_k, k, v, k8, kd, v8, vd = decode_batch(lengths)
    res = {"B": B, "lengths": [min(lengths), smax], "keys": total}
    for name, kk, vv, kw, width in (("bf16", k, v, {}, 2), ("fp8", k8, v8, dict(k_descale=kd, v_descale=vd), 1)):
        res[f"roofline_{name}_ms"] = total * HKV * D * 2 * width / rate * 1e3
        res[f"varlen_{name}_ms"] = time_ms(lambda: attn_lt.varlen_attention(q, kk, vv, cu_q, cu_k, max_seqlen_q=1,
                                                                            max_seqlen_k=smax, **kw))
    for bs, hnd in ((16, False), (64, False), (16, True)):
        kc, vc, table, seqlens = random_pages(lengths, bs, HKV, D, DT)
        if hnd:  # FlashInfer's HND layout: a block's rows of one head contiguous (the same logical cache)
            kc, vc = (t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (kc, vc))
        kc8, kcd = fp8_kv(kc)
        vc8, vcd = fp8_kv(vc)
        if hnd:
            kc8, vc8 = (t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in (kc8, vc8))
        name = f"paged{bs}" + ("_hnd" if hnd else "")
        res[f"{name}_bf16_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc, vc, table, seqlens))
        res[f"{name}_fp8_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc8, vc8, table, seqlens,
                                                                        k_descale=kcd, v_descale=vcd))
    for name in ("varlen", "paged16", "paged64", "paged16_hnd"):
        res[f"{name}_speedup"] = res[f"{name}_bf16_ms"] / res[f"{name}_fp8_ms"]  # tokens a second, FP8 / bf16
        res[f"{name}_fp8_roofline"] = res["roofline_fp8_ms"] / res[f"{name}_fp8_ms"]
        res[f"{name}_bf16_roofline"] = res["roofline_bf16_ms"] / res[f"{name}_bf16_ms"]
    return res


def dense(B: int, Sk: int, rate: float) -> dict:
    """attention() on a dense (B, Hkv, Sk, D) cache, bf16 against FP8, with PyTorch SDPA's cuDNN and FLASH on the
    bf16 cache."""
    q = torch.randn(B, HQ, 1, D, dtype=DT, device="cuda")
    k = torch.randn(B, HKV, Sk, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    k8, kd = fp8_kv(k.transpose(1, 2))
    v8, vd = fp8_kv(v.transpose(1, 2))
    k8, v8 = k8.transpose(1, 2).contiguous(), v8.transpose(1, 2).contiguous()
    res = {"B": B, "lengths": [Sk, Sk], "keys": B * Sk}
    for name, kk, vv, kw, width in (("bf16", k, v, {}, 2), ("fp8", k8, v8, dict(k_descale=kd, v_descale=vd), 1)):
        res[f"roofline_{name}_ms"] = B * Sk * HKV * D * 2 * width / rate * 1e3
        res[f"dense_{name}_ms"] = time_ms(lambda: attn_lt.attention(q, kk, vv, **kw))
    res["dense_speedup"] = res["dense_bf16_ms"] / res["dense_fp8_ms"]
    # speculative decoding's 5 rows a request (x GQA 4: 20 a kv head): two 16-row decode blocks a kv head on the
    # FP8 bytes
    q5 = torch.randn(B, HQ, 5, D, dtype=DT, device="cuda")
    res["spec5_bf16_ms"] = time_ms(lambda: attn_lt.attention(q5, k, v, causal=True))
    res["spec5_fp8_ms"] = time_ms(lambda: attn_lt.attention(q5, k8, v8, causal=True, k_descale=kd, v_descale=vd))
    for name in ("bf16", "fp8"):
        res[f"dense_{name}_roofline"] = res[f"roofline_{name}_ms"] / res[f"dense_{name}_ms"]
    sdpa_peers(res, q, k, v, (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)))
    return res


def prefill(lengths: list[int], chunk: int, rate: float) -> dict:
    """Prefill chunks of ``chunk`` rows ending requests of ``lengths`` keys (their prefixes cached), paged in blocks
    of 16: the bf16 cache against its FP8 copy (converted first)."""
    bs = 16
    kc, vc, table, seqlens = random_pages(lengths, bs, HKV, D, DT)
    kc8, kcd = fp8_kv(kc)
    vc8, vcd = fp8_kv(vc)
    q = torch.randn(chunk * len(lengths), HQ, D, dtype=DT, device="cuda")
    cq = cu_seqlens([chunk] * len(lengths))
    kw = dict(cu_seqlens_q=cq, max_seqlen_q=chunk, causal=True)
    blocks = sum(-(-n // bs) for n in lengths)
    res = {"B": len(lengths), "lengths": [min(lengths), max(lengths)], "chunk": chunk,
           "conversion_floor_ms": blocks * bs * HKV * D * 2 * 3 / rate * 1e3}
    res["bf16_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc, vc, table, seqlens, **kw))
    res["fp8_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc8, vc8, table, seqlens, k_descale=kcd,
                                                            v_descale=vcd, **kw))
    res["fp8_over_bf16"] = res["fp8_ms"] / res["bf16_ms"]
    flops = sum(4 * chunk * HQ * D * (n - chunk + (chunk + 1) / 2) for n in lengths)  # causal: the chunk's triangle
    res["bf16_tflops"] = flops / res["bf16_ms"] / 1e9
    return res


def sdpa_peers(res: dict, q, k, v, backends) -> None:
    """PyTorch SDPA's ``backends`` ((name, SDPBackend) pairs) on the bf16 cache: res["sdpa_NAME_ms"], or
    res["sdpa_NAME_error"] where a backend refuses the shape."""
    for name, backend in backends:
        try:
            res[f"sdpa_{name}_ms"] = time_ms(lambda: sdpa(q, k, v, backend=backend))
        except RuntimeError as e:
            res[f"sdpa_{name}_error"] = str(e).splitlines()[0]


def errors(rng: random.Random) -> dict:
    """Errors on a batch small enough for the FP64 reference (8 requests, up to 8k keys)."""
    lengths = [rng.randrange(256, 8193) for _ in range(8)]
    q, cu_q, cu_k, k, v, k8, kd, v8, vd = decode_batch(lengths)
    kw = dict(max_seqlen_q=1, max_seqlen_k=max(lengths))
    out8 = attn_lt.varlen_attention(q, k8, v8, cu_q, cu_k, k_descale=kd, v_descale=vd, **kw)
    out16 = attn_lt.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    ref_fp8_values = varlen_reference(q, fp8_values(k8, kd), fp8_values(v8, vd), cu_q, cu_k)[0]
    ref_bf16 = varlen_reference(q, k, v, cu_q, cu_k)[0]
    return error_report(out8, out16, ref_fp8_values, ref_bf16)


def error_report(out8, out16, ref_fp8_values, ref_bf16) -> dict:
    """The FP8 call's error against the FP64 attention of its cache's values and of the bf16 values they were
    quantized from, the bf16 call's against the latter, and the quantization's alone."""
    return {"fp8_vs_its_values": rel_error(out8, ref_fp8_values), "fp8_vs_bf16_values": rel_error(out8, ref_bf16),
            "bf16_vs_bf16_values": rel_error(out16, ref_bf16),
            "quantization_alone": rel_error(ref_fp8_values, ref_bf16)}


def mla(lengths: list[int], Hq: int, rate: float) -> dict:
    """MLA decode on a paged latent cache, bf16 against FP8 (paged_attention)."""
    kc, _, table, seqlens = random_pages(lengths, 64, 1, 576, DT)
    kc8, kd = fp8_kv(kc)
    q = torch.randn(len(lengths), Hq, 576, dtype=DT, device="cuda")
    keys = sum(lengths)
    res = {"B": len(lengths), "Hq": Hq, "lengths": [min(lengths), max(lengths)], "keys": keys}
    for name, c, kw, width in (("bf16", kc, {}, 2), ("fp8", kc8, dict(k_descale=kd, v_descale=kd), 1)):
        res[f"roofline_{name}_ms"] = keys * 576 * width / rate * 1e3
        ms = res[f"mla_{name}_ms"] = time_ms(lambda: attn_lt.paged_attention(q, c, c[..., :512], table, seqlens, **kw))
        res[f"mla_{name}_roofline"] = res[f"roofline_{name}_ms"] / ms
        res[f"mla_{name}_tflops"] = 2 * Hq * keys * (576 + 512) / ms / 1e9
    res["mla_speedup"] = res["mla_bf16_ms"] / res["mla_fp8_ms"]
    if min(lengths) == max(lengths):  # PyTorch SDPA beside it, on the same latent gathered dense (B, 1, Sk, 576)
        k = paged_gather(kc, kc, table, seqlens)[0].view(len(lengths), lengths[0], 1, 576).transpose(1, 2)
        sdpa_peers(res, q[:, :, None], k, k[..., :512],
                   (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)))
    return res


def mla_errors(rng: random.Random) -> dict:
    """MLA decode's errors (4 requests of up to 4k keys, Hq 128), as :func:`errors`."""
    lengths = [rng.randrange(256, 4097) for _ in range(4)]
    kc, _, table, seqlens = random_pages(lengths, 64, 1, 576, DT)
    kc8, kd = fp8_kv(kc)
    kf = fp8_values(kc8, kd)
    q = torch.randn(len(lengths), 128, 576, dtype=DT, device="cuda")
    out8 = attn_lt.paged_attention(q, kc8, kc8[..., :512], table, seqlens, k_descale=kd, v_descale=kd)
    out16 = attn_lt.paged_attention(q, kc, kc[..., :512], table, seqlens)
    ref_fp8_values = paged_reference(q, kf, kf[..., :512], table, seqlens, causal=False)[0]
    ref_bf16 = paged_reference(q, kc, kc[..., :512], table, seqlens, causal=False)[0]
    return error_report(out8, out16, ref_fp8_values, ref_bf16)


def peers(r: dict, names) -> str:
    """The SDPA peers' times of a result (bf16, gathered dense where the cache is paged)."""
    said = "; ".join(f"SDPA {n} {r[f'sdpa_{n}_ms']:.3f} ms" if f"sdpa_{n}_ms" in r
                     else f"SDPA {n} refused: {r[f'sdpa_{n}_error']}" for n in names
                     if f"sdpa_{n}_ms" in r or f"sdpa_{n}_error" in r)
    return f" {said} (bf16, dense)" if said else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--only", default="dense,batches,prefill,mla", help="parts to run (comma-separated)")
    a = ap.parse_args()
    parts = set(a.only.split(","))
    rng = random.Random(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    rate = copy_rate()
    res["copy_TBs"] = rate / 1e12
    if "dense" in parts:
        res["dense8k"] = dense(64, 8192, rate)
    if "batches" in parts:
        res["equal8k"] = batch([8192] * 64, rate)
        res["ragged64"] = batch([rng.randrange(256, 8193) for _ in range(64)], rate)
        res["ragged16"] = batch([65536] + [rng.randrange(4096, 65537) for _ in range(15)], rate)
        res["errors"] = errors(rng)
    if "prefill" in parts:
        res["prefill"] = prefill([8192, 16384, 24576, 32768], 2048, rate)
    if "mla" in parts:
        res["mla_equal"] = mla([4096] * 64, 128, rate)
        res["mla_ragged"] = mla([rng.randrange(256, 8193) for _ in range(64)], 128, rate)
        res["mla_h16"] = mla([8192] * 64, 16, rate)
        res["mla_errors"] = mla_errors(rng)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_kv.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['gpu']}: copy rate {res['copy_TBs']:.2f} TB/s; FP8 KV decode, bf16 q")
    print("| batch | call | bf16 ms (roofline) | FP8 ms (roofline) | FP8 speed-up |")
    if "dense8k" in res:
        r = res["dense8k"]
        print(f"| B{r['B']} {r['lengths']} Hq {HQ} / Hkv {HKV} D {D} | attention() | {r['dense_bf16_ms']:.3f} "
              f"({r['dense_bf16_roofline']:.0%}) | {r['dense_fp8_ms']:.3f} ({r['dense_fp8_roofline']:.0%}) | "
              f"{r['dense_speedup']:.2f}x |{peers(r, ('cudnn', 'flash'))}")
        print(f"| B{r['B']} 5 rows a request (speculative decoding) | attention() | {r['spec5_bf16_ms']:.3f} | "
              f"{r['spec5_fp8_ms']:.3f} | {r['spec5_bf16_ms'] / r['spec5_fp8_ms']:.2f}x |")
    for name in ("equal8k", "ragged64", "ragged16") if "batches" in parts else ():
        r = res[name]
        for call in ("varlen", "paged16", "paged64", "paged16_hnd"):
            print(f"| B{r['B']} {r['lengths']} Hq {HQ} / Hkv {HKV} D {D} | {call} | {r[f'{call}_bf16_ms']:.3f} "
                  f"({r[f'{call}_bf16_roofline']:.0%}) | {r[f'{call}_fp8_ms']:.3f} ({r[f'{call}_fp8_roofline']:.0%}) | "
                  f"{r[f'{call}_speedup']:.2f}x |")
    if "prefill" in res:
        r = res["prefill"]
        print(f"| B{r['B']} chunks of {r['chunk']} rows, prefixes {r['lengths']} | paged16 | {r['bf16_ms']:.3f} "
              f"({r['bf16_tflops']:.0f} TFLOP/s) | {r['fp8_ms']:.3f} (conversion floor {r['conversion_floor_ms']:.3f}) "
              f"| {1 / r['fp8_over_bf16']:.2f}x |")
    for name in ("mla_equal", "mla_ragged", "mla_h16") if "mla" in parts else ():
        r = res[name]
        print(f"| B{r['B']} {r['lengths']} Hq {r['Hq']} MLA 576/512 | paged64 | {r['mla_bf16_ms']:.3f} "
              f"({r['mla_bf16_roofline']:.0%}, {r['mla_bf16_tflops']:.0f} TFLOP/s) | {r['mla_fp8_ms']:.3f} "
              f"({r['mla_fp8_roofline']:.0%}, {r['mla_fp8_tflops']:.0f} TFLOP/s) | {r['mla_speedup']:.2f}x |"
              + peers(r, ('efficient', 'math')))
    for key, what in (("errors", "8 ragged requests, D 128"), ("mla_errors", "MLA, 4 requests, Hq 128")):
        if key in res:
            e = res[key]
            print(f"error (relative, {what}): FP8 vs FP64 of its values {e['fp8_vs_its_values']:.2e}; FP8 vs FP64 "
                  f"of the bf16 cache {e['fp8_vs_bf16_values']:.2e} (quantization alone "
                  f"{e['quantization_alone']:.2e}); bf16 call vs the same {e['bf16_vs_bf16_values']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
