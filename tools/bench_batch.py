#!/usr/bin/env python3
"""Serving batches (varlen and paged) side by side with what a server has without them, on one GPU, in one run:

1. **ragged decode**: B requests of one query row, Hq 32 / Hkv 8, D 128, bf16, lengths uniform in a range: attn_lt
   varlen, paged (block sizes 16 and 64, permuted tables); against the padded cache with a (B, 1, 1, Sk) key-padding
   mask through SDPA's cuDNN backend and attn_lt's dense call; the roofline of the bytes the requests own (their
   K and V) at the copy rate measured in the same run.
2. **packed prefill**: 16 documents of 256-16k tokens, causal, GQA 32/8, D 128: TFLOP/s of varlen_attention,
   against the fused dense kernel on one sequence of the FLOP-weighted length, SDPA called per document, and
   torch.nn.attention.varlen where the installed torch has it.
3. **mixed batch**: 4 prefill chunks of 2048 tokens against prefixes of 8k-32k plus 60 decode rows of 1k-32k from a
   paged cache (block size 16), one call, against the prefill-only and decode-only calls.
4. **graph replay**: the ragged decode call captured once and replayed with new lengths.
5. **speculative decoding**: B 64 requests of 5 query rows (20 rows a kv head) against 8k keys each, paged (block
   sizes 16 and 64): the same step with one row a request, the roofline of the cache's bytes, attn_lt's dense call
   on the contiguous cache and SDPA's cuDNN backend with the bottom-right causal mask; the paged call on the same
   cache in FP8.
6. **small batches**: decode batches with few (request, kv head) pairs (B 1-16, GQA 4-32, one or 5 query rows, 8k-128k
   keys, equal and ragged), paged (blocks of 16) from bf16 and FP8 caches: with the planner's parts and with the parts
   of its waves rule alone (attn_lt.batch.PART_KEYS 0: many short parts); SDPA's cuDNN backend on the dense cache
   beside the equal lengths.
7. **MLA decode** (Hopper): q (B, Hq, 576) against a paged latent cache (block size 64, v its first 512 columns):
   ragged lengths against the roofline of the latent bytes the requests own; equal lengths against attn_lt's dense
   MLA decode on a contiguous cache and SDPA on the padded cache (where a backend takes D 576); the key-split
   sizes around the planned one.

    python tools/bench_batch.py [--out DIR] [--quick | --only PART[,PART]]

Prints a short table last; writes DIR/batch.json. Medians of CUDA-event timings (``attn_lt.testing.time_ms``, L2
flushed by a read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import attn_lt  # noqa: E402
from attn_lt.fused import device_facts  # noqa: E402
from attn_lt.testing import cu_seqlens, fp8_kv, random_pages, time_ms  # noqa: E402

DT = torch.bfloat16
HQ, HKV, D = 32, 8, 128


PARTS = ("decode", "mixed", "spec", "small", "mla", "host", "prefill", "graph")


def copy_rate_tbs() -> float:
    """Device copy rate (bytes read + written per second) of a 2 GiB buffer."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e9


cu = cu_seqlens


def torch_varlen():
    """(torch.nn.attention.varlen.varlen_attn, keywords for a causal call, whether it takes GQA and block tables),
    or None where the installed torch has none."""
    import inspect

    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)} if "window_size" in params \
        else None
    return fn, causal, "enable_gqa" in params, "block_table" in params


def peer(res: dict, name: str, fn) -> None:
    """res[name + "_ms"] = the median of fn, or res[name] = why it did not run."""
    try:
        res[name + "_ms"] = time_ms(fn)
    except Exception as e:  # a peer that refuses the case: say why, keep going
        res[name] = f"unavailable: {type(e).__name__}: {str(e)[:160]}"


def padded_cache(k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> tuple:
    """The packed keys and values (total, Hkv, D) of requests of ``lengths`` as a padded cache (B, Hkv, max, D) and
    its (B, 1, 1, max) key-padding mask: what a server without varlen calls."""
    B, smax = len(lengths), max(lengths)
    kp = torch.zeros(B, k.shape[1], smax, k.shape[2], dtype=k.dtype, device=k.device)
    vp = torch.zeros_like(kp)
    mask = torch.zeros(B, 1, 1, smax, dtype=torch.bool, device=k.device)
    at = 0
    for b, n in enumerate(lengths):
        kp[b, :, :n] = k[at:at + n].transpose(0, 1)
        vp[b, :, :n] = v[at:at + n].transpose(0, 1)
        mask[b, :, :, :n] = True
        at += n
    return kp, vp, mask


def ragged_decode(lengths: list[int], rate: float) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, total, smax = len(lengths), sum(lengths), max(lengths)
    owned = total * HKV * D * 2 * 2  # K and V bytes the requests own
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(total, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    cu_k = cu(lengths)
    res = {"B": B, "lengths": [min(lengths), smax], "owned_GB": owned / 1e9, "roofline_ms": owned / rate * 1e3}
    res["varlen_ms"] = time_ms(lambda: attn_lt.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=1,
                                                                max_seqlen_k=smax))
    tv = torch_varlen()
    if tv is not None and tv[2]:  # torch's FlashAttention varlen, GQA in place
        peer(res, "torch_varlen", lambda: tv[0](q, k, v, cu_q, cu_k, 1, smax, enable_gqa=True))
    for bs in (16, 64):
        pages = random_pages(lengths, bs, HKV, D, DT)
        res[f"paged{bs}_ms"] = time_ms(lambda: attn_lt.paged_attention(q, *pages))
        if tv is not None and tv[2] and tv[3]:
            kc, vc, table, seqlens = pages
            peer(res, f"torch_paged{bs}", lambda: tv[0](q, kc, vc, cu_q, None, 1, smax, enable_gqa=True,
                                                         seqused_k=seqlens, block_table=table))
    kp, vp, mask = padded_cache(k, v, lengths)
    qd = q[:, :, None]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        try:
            res["padded_cudnn_ms"] = time_ms(lambda: F.scaled_dot_product_attention(qd, kp, vp, attn_mask=mask,
                                                                                    enable_gqa=True))
        except RuntimeError as e:
            res["padded_cudnn_ms"], res["cudnn_error"] = None, str(e)[:200]
    res["padded_attn_lt_ms"] = time_ms(lambda: attn_lt.attention(qd, kp, vp, attn_mask=mask))
    for name in ("varlen", "paged16", "paged64"):
        res[f"{name}_roofline"] = res["roofline_ms"] / res[f"{name}_ms"]
    if res.get("padded_cudnn_ms"):
        res["varlen_vs_cudnn"] = res["padded_cudnn_ms"] / res["varlen_ms"]
    return res


def flops(lens_q, lens_k, causal=True) -> float:
    total = 0.0
    for lq, lk in zip(lens_q, lens_k):
        pairs = sum(min(lk, lk - lq + i + 1) for i in range(lq)) if causal else lq * lk
        total += 4 * D * HQ * pairs
    return total


def packed_prefill(rng: random.Random) -> dict:
    import torch.nn.functional as F

    lens = [256, 16384] + [rng.randrange(256, 16385) for _ in range(14)]
    total = sum(lens)
    q = torch.randn(total, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(total, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    c = cu(lens)
    fl = flops(lens, lens)
    res = {"docs": len(lens), "tokens": total}
    ms = time_ms(lambda: attn_lt.varlen_attention(q, k, v, c, c, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
                                                  causal=True))
    res["varlen_ms"], res["varlen_tflops"] = ms, fl / ms / 1e9
    # one dense sequence of the FLOP-weighted length
    S = int(round((sum(n * n for n in lens) / len(lens)) ** 0.5 / 128) * 128)
    qd = torch.randn(1, HQ, S, D, dtype=DT, device="cuda")
    kd = torch.randn(1, HKV, S, D, dtype=DT, device="cuda")
    vd = torch.randn_like(kd)
    ms = time_ms(lambda: attn_lt.attention(qd, kd, vd, causal=True))
    res["dense_S"], res["dense_tflops"] = S, flops([S], [S]) / ms / 1e9
    res["varlen_vs_dense"] = res["varlen_tflops"] / res["dense_tflops"]
    views = [(q[c[i]:c[i + 1]].transpose(0, 1)[None], k[c[i]:c[i + 1]].transpose(0, 1)[None],
              v[c[i]:c[i + 1]].transpose(0, 1)[None]) for i in range(len(lens))]

    def per_doc():
        for a, b, cc in views:
            F.scaled_dot_product_attention(a, b, cc, is_causal=True, enable_gqa=True)

    ms = time_ms(per_doc)
    res["sdpa_per_doc_ms"], res["sdpa_per_doc_tflops"] = ms, fl / ms / 1e9
    tv = torch_varlen()
    if tv is None or tv[1] is None:
        res["torch_varlen"] = "unavailable: no causal torch.nn.attention.varlen in this torch"
    else:
        fn, causal, gqa, _ = tv
        kk, vv = (k, v) if gqa else (k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1))
        extra = {"enable_gqa": True} if gqa else {}
        peer(res, "torch_varlen", lambda: fn(q, kk, vv, c, c, max(lens), max(lens), **causal, **extra))
        if "torch_varlen_ms" in res:
            res["torch_varlen_tflops"] = fl / res["torch_varlen_ms"] / 1e9
    return res


def mixed_lengths(rng: random.Random, chunk: int = 2048) -> list[int]:
    """Keys of the mixed batch's requests: 4 prefill chunks' (their prefix and the chunk), then 60 decode rows'."""
    return [rng.randrange(8192, 32769) + chunk for _ in range(4)] + [rng.randrange(1024, 32769) for _ in range(60)]


def mixed_batch(seqlens: list[int]) -> dict:
    chunk = 2048
    q_lens = [chunk] * 4 + [1] * 60
    kc, vc, table, sk = random_pages(seqlens, 16, HKV, D, DT)
    q = torch.randn(sum(q_lens), HQ, D, dtype=DT, device="cuda")
    cq = cu(q_lens)
    res = {}
    res["mixed_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc, vc, table, sk, cu_seqlens_q=cq,
                                                              max_seqlen_q=chunk))
    qp, cqp = q[:4 * chunk], cu(q_lens[:4])
    res["prefill_ms"] = time_ms(lambda: attn_lt.paged_attention(qp, kc, vc, table[:4], sk[:4], cu_seqlens_q=cqp,
                                                                max_seqlen_q=chunk))
    qdec = q[4 * chunk:]
    res["decode_ms"] = time_ms(lambda: attn_lt.paged_attention(qdec, kc, vc, table[4:], sk[4:]))
    res["mixed_vs_sum"] = res["mixed_ms"] / (res["prefill_ms"] + res["decode_ms"])
    return res


def speculative_decode(rate: float, B: int = 64, rows: int = 5, keys: int = 8192) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(B * rows, HQ, D, dtype=DT, device="cuda")
    cq = cu([rows] * B)
    owned = B * keys * HKV * D * 2 * 2
    res = {"B": B, "rows": rows, "keys": keys, "roofline_ms": owned / rate * 1e3}
    for bs in (16, 64):
        kc, vc, table, sk = random_pages([keys] * B, bs, HKV, D, DT)
        res[f"paged{bs}_ms"] = time_ms(lambda: attn_lt.paged_attention(q, kc, vc, table, sk, cu_seqlens_q=cq,
                                                                        max_seqlen_q=rows))
        res[f"one_row{bs}_ms"] = time_ms(lambda: attn_lt.paged_attention(q[:B], kc, vc, table, sk))
        res[f"paged{bs}_roofline"] = res["roofline_ms"] / res[f"paged{bs}_ms"]
        if bs == 16:  # the same cache in FP8 (e4m3, a factor a kv head)
            (k8, kd), (v8, vd) = fp8_kv(kc), fp8_kv(vc)
            res["fp8_paged16_ms"] = time_ms(lambda: attn_lt.paged_attention(
                q, k8, v8, table, sk, cu_seqlens_q=cq, max_seqlen_q=rows, k_descale=kd, v_descale=vd))
            res["fp8_one_row16_ms"] = time_ms(lambda: attn_lt.paged_attention(q[:B], k8, v8, table, sk, k_descale=kd,
                                                                                v_descale=vd))
    kd = torch.randn(B, HKV, keys, D, dtype=DT, device="cuda")
    vd = torch.randn_like(kd)
    qd = q.view(B, rows, HQ, D).transpose(1, 2)
    res["dense_attn_lt_ms"] = time_ms(lambda: attn_lt.attention(qd, kd, vd, causal=True))
    # bottom-right causal: row i sees keys j <= keys - rows + i
    mask = torch.ones(rows, keys, dtype=torch.bool, device="cuda").tril(keys - rows)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        peer(res, "sdpa_cudnn", lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
    return res


@contextlib.contextmanager
def planner_setting(name: str, value):
    """attn_lt.batch's planner constant ``name`` set to ``value`` inside the block (plans made again)."""
    from attn_lt import batch

    saved = getattr(batch, name)
    setattr(batch, name, value)
    batch.clear_plan_cache()
    try:
        yield
    finally:
        setattr(batch, name, saved)
        batch.clear_plan_cache()


def small_batches(rate: float, rng: random.Random) -> dict:
    """Decode batches of few (request, kv head) pairs, paged 16, bf16 and FP8, with the planner's parts and with
    the parts of its waves rule alone; SDPA cuDNN on the dense cache for equal lengths."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attn_lt import batch

    cases = (("B1 32k", 32, 8, 1, [32768]), ("B1 128k", 32, 8, 1, [131072]), ("B8 32k", 32, 8, 1, [32768] * 8),
             ("B8 32k GQA 16", 32, 2, 1, [32768] * 8), ("B64 8k MQA", 32, 1, 1, [8192] * 64),
             ("B8 8k 5 rows", 32, 8, 5, [8192] * 8),
             ("B4 U[1k, 32k]", 32, 8, 1, [rng.randrange(1024, 32769) for _ in range(4)]),
             ("B16 U[256, 8192]", 32, 8, 1, [rng.randrange(256, 8193) for _ in range(16)]))
    out = {}
    for name, Hq, Hkv, rows, lengths in cases:
        B, total = len(lengths), sum(lengths)
        q = torch.randn(B * rows, Hq, D, dtype=DT, device="cuda")
        kw = dict(cu_seqlens_q=cu([rows] * B), max_seqlen_q=rows) if rows > 1 else {}
        kc, vc, table, sk = random_pages(lengths, 16, Hkv, D, DT)
        (k8, kd), (v8, vd) = fp8_kv(kc), fp8_kv(vc)
        calls = {"bf16": lambda: attn_lt.paged_attention(q, kc, vc, table, sk, **kw),
                 "fp8": lambda: attn_lt.paged_attention(q, k8, v8, table, sk, k_descale=kd, v_descale=vd, **kw)}
        r = {"B": B, "Hq": Hq, "Hkv": Hkv, "rows": rows, "lengths": [min(lengths), max(lengths)],
             "roofline_ms": total * Hkv * D * 2 * 2 / rate * 1e3}
        plan = batch.plan_batch(B, Hq, Hkv, D, max_seqlen_q=rows, max_seqlen_k=max(lengths), block_size=16)
        r["split_keys"] = plan.split_keys
        for c, f in calls.items():
            r[f"{c}_ms"] = time_ms(f)
        with planner_setting("PART_KEYS", 0):
            r["waves_split_keys"] = batch.plan_batch(B, Hq, Hkv, D, max_seqlen_q=rows, max_seqlen_k=max(lengths),
                                                     block_size=16).split_keys
            for c, f in calls.items():
                r[f"waves_{c}_ms"] = time_ms(f)
        del kc, vc, k8, v8
        if rows == 1 and len(set(lengths)) == 1:
            kdn = torch.randn(B, Hkv, lengths[0], D, dtype=DT, device="cuda")
            vdn = torch.randn_like(kdn)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                peer(r, "sdpa_cudnn", lambda: F.scaled_dot_product_attention(q[:, :, None], kdn, vdn, enable_gqa=True))
            del kdn, vdn
        out[name] = r
    return out


def graph_replay(lengths: list[int]) -> dict:
    B, cap = len(lengths), max(lengths)
    kc, vc, table, sk = random_pages([cap] * B, 16, HKV, D, DT)
    sk.copy_(torch.tensor(lengths, dtype=torch.int32))
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    call = lambda: attn_lt.paged_attention(q, kc, vc, table, sk, out=out)  # noqa: E731
    eager = time_ms(call)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    return {"eager_ms": eager, "replay_ms": time_ms(g.replay)}


def mla_decode(lengths: list[int], Hq: int, rate: float, sweep: bool = False) -> dict:
    """MLA decode on a paged latent cache (block size 64); with equal lengths also the dense peers."""
    import torch.nn.functional as F

    from attn_lt import batch

    B, total, smax = len(lengths), sum(lengths), max(lengths)
    owned = total * 576 * 2
    kc, _, table, seqlens = random_pages(lengths, 64, 1, 576, DT, spare_blocks=0)
    vc = kc[..., :512]
    del _
    q = torch.randn(B, Hq, 576, dtype=DT, device="cuda")
    res = {"B": B, "Hq": Hq, "lengths": [min(lengths), smax], "owned_GB": owned / 1e9,
           "roofline_ms": owned / rate * 1e3}
    call = lambda: attn_lt.paged_attention(q, kc, vc, table, seqlens, scale=0.1)  # noqa: E731
    res["paged_ms"] = time_ms(call)
    res["paged_roofline"] = res["roofline_ms"] / res["paged_ms"]
    plan = batch.plan_batch(B, Hq, 1, 576, Dv=512, max_seqlen_q=1, max_seqlen_k=table.shape[1] * 64, block_size=64)
    res["split_keys"], res["parts"] = plan.split_keys, plan.parts
    if sweep:  # the part sizes around the planned one
        for waves in (1, 4, 8):
            with planner_setting("MLA_SPLIT_WAVES", waves):
                res[f"waves{waves}_ms"] = time_ms(call)
    if len(set(lengths)) == 1:  # equal lengths: the dense cache
        kd = torch.randn(B, 1, smax, 576, dtype=DT, device="cuda")
        qd = q[:, :, None]
        res["dense_attn_lt_ms"] = time_ms(lambda: attn_lt.attention(qd, kd, kd[..., :512], scale=0.1))
        kx = kd.expand(B, Hq, smax, 576)
        peer(res, "sdpa_default", lambda: F.scaled_dot_product_attention(qd, kx, kx[..., :512], scale=0.1))
        res["paged_vs_dense"] = res["dense_attn_lt_ms"] / res["paged_ms"]
    return res


def host_costs() -> dict:
    """Host time per call (median of 200, no sync between calls): BatchStep.plan for 64 requests and run per layer,
    the one-call paged_attention, attn_lt's dense decode call and SDPA's on a cache of the same size."""
    import time

    import torch.nn.functional as F

    def host_us(fn, n=200):
        for _ in range(n):  # warm: allocator, launch paths and the CPU's clocks settled before timing
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return sorted(times)[n // 2] * 1e6

    B, Sk, bs = 64, 4096, 16
    kc, vc, table, seqlens = random_pages([Sk] * B, bs, HKV, D, DT)
    q = torch.randn(B, HQ, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    step = attn_lt.BatchStep(B, HQ, HKV, D, max_seqlen_k=Sk, block_size=bs, dtype=DT)
    res = {"B": B, "Sk": Sk}
    res["step_plan_us"] = host_us(lambda: step.plan(None, seqlens, table))
    res["step_run_us"] = host_us(lambda: step.run(q, kc, vc, out=out))
    res["paged_attention_us"] = host_us(lambda: attn_lt.paged_attention(q, kc, vc, table, seqlens, out=out))
    kd = torch.randn(B, HKV, Sk, D, dtype=DT, device="cuda")
    qd = q[:, :, None]
    res["dense_attn_lt_us"] = host_us(lambda: attn_lt.attention(qd, kd, kd))
    res["sdpa_us"] = host_us(lambda: F.scaled_dot_product_attention(qd, kd, kd, enable_gqa=True))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="ragged decode and mixed batch only")
    ap.add_argument("--only", default=None, help=f"comma-separated parts of {', '.join(PARTS)}")
    a = ap.parse_args()
    parts = set(PARTS) if a.only is None else set(a.only.split(","))
    if a.quick:
        parts &= {"decode", "mixed"}
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    rate = res["copy_TBs"] = copy_rate_tbs()
    # Lengths are drawn from one generator in the full run's order whichever parts run, so that each part measures
    # the lengths of the published runs (the graph part's: when the prefill part runs before it).
    rng = random.Random(0)
    dec64 = [rng.randrange(256, 8193) for _ in range(64)]
    dec16 = [65536] + [rng.randrange(4096, 65537) for _ in range(15)]
    mixed = mixed_lengths(rng)
    mla64 = [rng.randrange(256, 8193) for _ in range(64)]
    mla32 = [rng.randrange(4096, 32769) for _ in range(32)]
    if "decode" in parts:
        res["decode64"] = ragged_decode(dec64, rate * 1e12)
        res["decode16"] = ragged_decode(dec16, rate * 1e12)
    if "mixed" in parts:
        res["mixed"] = mixed_batch(mixed)
    if "spec" in parts:
        res["spec"] = speculative_decode(rate * 1e12)
    if "small" in parts:  # (lengths of its own, so that the other parts' stay those of the published runs)
        res["small"] = small_batches(rate * 1e12, random.Random(1))
    if "mla" in parts and device_facts().hopper:
        res["mla64"] = mla_decode(mla64, 128, rate * 1e12, sweep=True)
        res["mla_equal"] = mla_decode([4096] * 64, 128, rate * 1e12)
        res["mla32_tp8"] = mla_decode(mla32, 16, rate * 1e12, sweep=True)
    if "host" in parts:
        res["host"] = host_costs()
    if "prefill" in parts:
        res["prefill"] = packed_prefill(rng)
    if "graph" in parts:
        res["graph"] = graph_replay([rng.randrange(256, 8193) for _ in range(64)])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "batch.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['gpu']}: copy rate {rate:.2f} TB/s")
    for name in ("decode64", "decode16"):
        if name not in res:
            continue
        r = res[name]
        cud = r.get("padded_cudnn_ms")
        print(f"ragged decode B{r['B']} lengths {r['lengths']}: roofline {r['roofline_ms']:.3f} ms | varlen "
              f"{r['varlen_ms']:.3f} ({r['varlen_roofline']:.0%}) | paged16 {r['paged16_ms']:.3f} "
              f"({r['paged16_roofline']:.0%}) | paged64 {r['paged64_ms']:.3f} ({r['paged64_roofline']:.0%}) | "
              f"padded cuDNN {cud if cud is None else round(cud, 3)} | padded attn_lt {r['padded_attn_lt_ms']:.3f} | "
              f"varlen/cuDNN {r.get('varlen_vs_cudnn', float('nan')):.2f}x | torch varlen "
              f"{r.get('torch_varlen_ms')} paged16 {r.get('torch_paged16_ms')}")
    for name in ("mla64", "mla_equal", "mla32_tp8"):
        if name in res:
            r = res[name]
            sweep = " ".join(f"{k}={v:.3f}" for k, v in r.items() if k.startswith("waves"))
            dense = (f" | dense attn_lt {r['dense_attn_lt_ms']:.3f} ({r['paged_vs_dense']:.2f}x) | SDPA "
                     f"{r.get('sdpa_default_ms', r.get('sdpa_default'))}" if "dense_attn_lt_ms" in r else "")
            print(f"MLA decode {name} B{r['B']} Hq{r['Hq']} lengths {r['lengths']}: roofline {r['roofline_ms']:.3f} ms"
                  f" | paged64 {r['paged_ms']:.3f} ({r['paged_roofline']:.0%}; parts of {r['split_keys']}, "
                  f"{r['parts']}){dense} {sweep}")
    if "spec" in res:
        r = res["spec"]
        cud = r.get("sdpa_cudnn_ms")
        print(f"speculative decoding B{r['B']} x {r['rows']} rows, {r['keys']} keys: roofline {r['roofline_ms']:.3f} ms"
              f" | paged16 {r['paged16_ms']:.3f} ({r['paged16_roofline']:.0%}; one row {r['one_row16_ms']:.3f}) | "
              f"paged64 {r['paged64_ms']:.3f} ({r['paged64_roofline']:.0%}; one row {r['one_row64_ms']:.3f}) | dense "
              f"attn_lt {r['dense_attn_lt_ms']:.3f} | SDPA cuDNN (mask) {cud if cud is None else round(cud, 3)} | "
              f"FP8 paged16 {r['fp8_paged16_ms']:.3f} (one row {r['fp8_one_row16_ms']:.3f})")
    for name, r in res.get("small", {}).items():
        cud = r.get("sdpa_cudnn_ms")
        print(f"small batch {name} (Hq {r['Hq']} / Hkv {r['Hkv']}, {r['rows']} row(s)): roofline {r['roofline_ms']:.3f} ms"
              f" | paged16 bf16 {r['bf16_ms']:.3f} ({r['roofline_ms'] / r['bf16_ms']:.0%}; parts of {r['split_keys']}) "
              f"vs waves rule {r['waves_bf16_ms']:.3f} (parts of {r['waves_split_keys']}) | FP8 {r['fp8_ms']:.3f} vs "
              f"{r['waves_fp8_ms']:.3f} | SDPA cuDNN dense {cud if cud is None else round(cud, 3)}")
    h = res.get("host")
    if h:
        print(f"host us/call (B{h['B']} Sk{h['Sk']}): step.plan {h['step_plan_us']:.1f} | step.run "
              f"{h['step_run_us']:.1f} | paged_attention {h['paged_attention_us']:.1f} | dense attention() "
              f"{h['dense_attn_lt_us']:.1f} | SDPA {h['sdpa_us']:.1f}")
    m = res.get("mixed")
    if m:
        print(f"mixed batch: {m['mixed_ms']:.3f} ms vs prefill {m['prefill_ms']:.3f} + decode {m['decode_ms']:.3f} "
              f"({m['mixed_vs_sum']:.2f}x the sum)")
    if "prefill" in res:
        p = res["prefill"]
        tv = p.get("torch_varlen_tflops")
        print(f"packed prefill ({p['docs']} docs, {p['tokens']} tokens): varlen {p['varlen_tflops']:.0f} TFLOP/s | "
              f"dense S{p['dense_S']} {p['dense_tflops']:.0f} ({p['varlen_vs_dense']:.2f}x) | SDPA per doc "
              f"{p['sdpa_per_doc_tflops']:.0f} | torch varlen {tv if tv is None else round(tv)}")
    if "graph" in res:
        g = res["graph"]
        print(f"graph: eager {g['eager_ms']:.3f} ms, replay {g['replay_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
