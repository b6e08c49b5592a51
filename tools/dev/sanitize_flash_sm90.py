#!/usr/bin/env python3
"""A few small shapes through the Hopper fused kernels (native/flash_sm90.cu), each run once, for compute-sanitizer
(both pipeline variants; D 64/128/256, MLA prefill's q/k 192 with v 128, MLA decode's q/k 576 with v = k[..., :512]
in parts, the decode kernel's 64-row blocks in parts, with and without a mask; fp16/bf16; key and query tails; causal
with Sq != Sk both ways; GQA; a (B, S, H, D) view; dense masks read by TMA: bool and additive, shared by the heads,
per head, one row for every query, a padded view; the FP8 prefill: e4m3 q, k, v through attention(), key and query
tails, causal, GQA, a window with sinks; MLA decode on an FP8 latent cache, dense through attention() and paged
through paged_attention(), lengths 0 and past a tile, a bad block id). Exits 1 when an output is wrong, 2 when the
kernels cannot run here. "persistent": shapes of more (query block, head) items than SMs, so that persistent CTAs
take several (reusing the Q and O tiles and the ring from item to item). "wide": calls on the wide key tiles.

    compute-sanitizer --tool memcheck  python3 tools/dev/sanitize_flash_sm90.py
    compute-sanitizer --tool racecheck python3 tools/dev/sanitize_flash_sm90.py
    compute-sanitizer --tool synccheck python3 tools/dev/sanitize_flash_sm90.py
    compute-sanitizer --tool racecheck python3 tools/dev/sanitize_flash_sm90.py fp8   # one group (names: GROUPS)
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_flash_sm90 import sm90_call  # noqa: E402

import attn_lt  # noqa: E402
from attn_lt import native  # noqa: E402
from attn_lt.testing import (forced_flash_error, fp8_kv, fp8_values, paged_reference, random_pages,  # noqa: E402
                             random_qkv, reference, rel_error, tolerance)

# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, layout, variant)
CASES = [
    (1, 1, 1, 128, 128, 64, torch.bfloat16, False, "bhsd", "plain"),
    (1, 1, 1, 128, 128, 64, torch.bfloat16, False, "bhsd", "default"),
    (1, 2, 1, 97, 333, 64, torch.float16, True, "bhsd", "default"),
    (2, 2, 2, 200, 130, 128, torch.bfloat16, True, "bhsd", "default"),
    (1, 4, 2, 300, 517, 128, torch.float16, False, "bshd", "plain"),
    (1, 2, 2, 1, 700, 128, torch.bfloat16, False, "bhsd", "default"),
    (1, 2, 1, 160, 150, 256, torch.bfloat16, True, "bhsd", "default"),
    (1, 1, 1, 64, 200, 256, torch.float16, False, "bshd", "plain"),
]
# more items than SMs: persistent CTAs take several (O staged in its own tile at D <= 128, in Q's at D 256)
PERSISTENT = [
    (4, 8, 2, 1100, 700, 128, torch.bfloat16, True, "bhsd", "default"),
    (2, 8, 4, 1030, 300, 256, torch.float16, False, "bhsd", "default"),
    (3, 16, 16, 500, 500, 64, torch.bfloat16, False, "bhsd", "plain"),
]
# wide key tiles (native/flash_sm90.cu's Cfg: 192 keys at D 64 from 8192 keys, 176 at D 128 from 4096; causal
# from 8192), key tails inside a tile
WIDE = [
    (1, 2, 1, 97, 8321, 64, torch.bfloat16, False, "bhsd", "default"),
    (1, 2, 2, 130, 4225, 128, torch.float16, False, "bshd", "default"),
    (1, 2, 1, 200, 8200, 128, torch.bfloat16, True, "bhsd", "default"),
    (3, 16, 4, 300, 8300, 64, torch.bfloat16, False, "bhsd", "default"),  # more items than SMs
]
# MLA prefill, q/k head dim 192 and v's 128: (B, Hq, Hkv, Sq, Sk, dtype, causal, variant)
# the FP8 prefill: (B, Hq, Hkv, Sq, Sk, D, causal, window)
FP8 = [
    (1, 2, 1, 130, 300, 128, True, None),
    (2, 2, 2, 97, 97, 256, False, None),
    (1, 4, 2, 257, 129, 128, False, (40, 3)),
    (2, 4, 2, 200, 300, 64, True, None),
    (1, 2, 1, 130, 2113, 128, True, None),  # wide key tiles (Cfg's kFp8WideFrom)
    (1, 2, 2, 97, 2304, 128, False, None),
    (1, 2, 1, 70, 4200, 64, True, None),
    (1, 2, 2, 100, 2500, 64, False, None),
]
MLA = [
    (1, 2, 1, 200, 333, torch.bfloat16, True, "default"),
    (1, 2, 2, 130, 97, torch.float16, False, "plain"),
    (2, 2, 2, 1, 300, torch.bfloat16, False, "default"),
]
# MLA decode, v = k[..., :512]: (B, Hq, Hkv, Sk, dtype, parts of the keys)
MLA_DECODE = [
    (2, 128, 1, 333, torch.bfloat16, 1),
    (1, 96, 1, 1000, torch.float16, 3),  # a partial second block of heads
    (2, 16, 2, 130, torch.bfloat16, 5),  # parts without a key
    (2, 128, 1, 4000, torch.bfloat16, 2),  # two parts, as B 32 takes them
    (2, 128, 1, 2000, torch.bfloat16, 12),  # more parts than the wide merge takes (native/common.cuh)
]
# MLA decode on an FP8 latent cache (one factor): (Hq, dtype, key lengths a request, paged: blocks of 64)
MLA_FP8 = [
    (128, torch.bfloat16, [333, 333], False),
    (96, torch.float16, [1000], False),
    (64, torch.bfloat16, [0, 65, 700, 1], True),
]
# the decode kernel (64-row blocks of positions x heads, keys in parts): (B, Hq, Hkv, Sq, Sk, dtype, causal, parts,
# layout, mask kind: None, "bool" or "add", (B, 1, Sq, Sk)[, head dim: 128 unless given])
DECODE = [
    (2, 32, 8, 16, 1000, torch.bfloat16, True, 3, "bhsd", None),
    (1, 48, 4, 5, 300, torch.float16, False, 1, "bshd", None),
    (1, 8, 8, 1, 129, torch.bfloat16, True, 2, "bhsd", None),
    (2, 32, 8, 16, 1000, torch.bfloat16, True, 3, "bhsd", "bool"),
    (1, 48, 4, 5, 300, torch.float16, False, 2, "bhsd", "add"),
    (2, 32, 8, 16, 700, torch.bfloat16, True, 2, "bhsd", "bool", 64),
]
# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, mask kind, mask shape): the default pipeline, masks in rows padded to 16
MASKED = [
    (1, 2, 1, 200, 333, 64, torch.bfloat16, True, "bool", "B1SqSk"),
    (2, 4, 2, 300, 260, 128, torch.bfloat16, False, "add", "11SqSk"),  # one group of heads side by side
    (1, 12, 4, 260, 300, 128, torch.bfloat16, True, "bool", "B1SqSk"),  # groups of 8 heads, the last one of 4
    (1, 2, 2, 150, 517, 128, torch.float16, True, "add", "BHSqSk"),
    (2, 2, 1, 160, 150, 256, torch.bfloat16, False, "bool", "B11Sk"),  # one mask row
    (1, 2, 1, 200, 270, 256, torch.bfloat16, True, "bool", "B1SqSk"),  # 64-byte swizzle, every row's phase
    (1, 2, 2, 130, 200, 256, torch.float16, True, "add", "11SqSk"),
]


def padded_mask(kind, shape, dtype):
    """A random mask of ``shape``, a view into rows of Sk rounded up to 16 elements (16-byte aligned rows)."""
    *lead, Sk = shape
    full = torch.rand(*lead, -(-Sk // 16) * 16, device="cuda")
    m = full > 0.3 if kind == "bool" else (full * 4 - 2).to(dtype)
    return m[..., :Sk]


#: The groups by name: ``sanitize_flash_sm90.py fp8 masked`` runs those alone (racecheck's time).
GROUPS = {"plain": CASES, "persistent": PERSISTENT, "wide": WIDE, "mla": MLA, "mla_decode": MLA_DECODE,
          "decode": DECODE, "masked": MASKED, "fp8": FP8, "mla_fp8": MLA_FP8}


def only(group: list) -> list:
    """The group's cases, or none when the command line names other groups."""
    names = sys.argv[1:]
    return group if not names or any(GROUPS.get(n) is group for n in names) else []


def mla_fp8_error(Hq, dt, lengths, paged):
    """MLA decode on an FP8 latent cache against FP64 on its values: (relative error, ok); a paged batch with one
    block id past the cache (its keys hidden, reported), compared on the other requests."""
    B = len(lengths)
    q = torch.randn(B, Hq, 576, device="cuda").to(dt)
    if not paged:
        lat8, kd = fp8_kv(torch.randn(B, lengths[0], 1, 576, device="cuda"))
        k8, kf = lat8.transpose(1, 2), fp8_values(lat8, kd).transpose(1, 2)
        out = attn_lt.attention(q[:, :, None], k8, k8[..., :512], k_descale=kd, v_descale=kd)
        ref = reference(q[:, :, None], kf, kf[..., :512], dtype=torch.float64)[0]
        err = rel_error(out, ref)
        return err, err < 2e-2
    k_cache, _, table, seqlens = random_pages(lengths, 64, 1, 576, dt)
    k8, kd = fp8_kv(k_cache)
    bad_table = table.clone()
    bad_table[B - 2, 0] = k8.shape[0] + 5  # request B - 2's first block: outside the cache
    out = attn_lt.paged_attention(q, k8, k8[..., :512], bad_table, seqlens, k_descale=kd, v_descale=kd)
    try:
        attn_lt.check_batch_errors()
        reported = False
    except ValueError:
        reported = True
    kf = fp8_values(k8, kd)
    ref = paged_reference(q, kf, kf[..., :512], table, seqlens, causal=False)[0]
    keep = [b for b in range(B) if b != B - 2 and lengths[b] > 0]
    err = rel_error(out[keep], ref[keep])
    return err, err < 2e-2 and reported and bool(torch.isfinite(out).all())


def main() -> int:
    if not torch.cuda.is_available() or not native.flash_sm90_supported():
        print("sanitize_flash_sm90: needs a compute capability 9.0 GPU and the sm_90a kernel", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bad = 0
    for B, Hq, Hkv, Sq, Sk, D, dt, causal, layout, variant in only(CASES) + only(PERSISTENT) + only(WIDE):
        q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dt, layout)
        out = torch.full((B, Hq, Sq, D), math.nan, dtype=dt, device="cuda")
        lse = torch.full((B, Hq, Sq), math.nan, device="cuda")
        run, out, lse = sm90_call(q, k, v, causal, variant=variant, out=out, lse=lse)
        run()
        torch.cuda.synchronize()
        ref, _ = reference(q, k, v, causal=causal)
        err = rel_error(out, ref)
        ok = err < 2e-2 and not torch.isnan(lse).any()
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} {str(dt)[6:]} causal={int(causal)} {layout} "
              f"{variant}: rel error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for B, Hq, Hkv, Sq, Sk, dt, causal, variant in only(MLA):
        q, k, _ = random_qkv(B, Hq, Hkv, Sq, Sk, 192, dt, "bhsd")
        v = torch.randn(B, Hkv, Sk, 128, device="cuda").to(dt)
        out = torch.full((B, Hq, Sq, 128), math.nan, dtype=dt, device="cuda")
        lse = torch.full((B, Hq, Sq), math.nan, device="cuda")
        run, out, lse = sm90_call(q, k, v, causal, variant=variant, out=out, lse=lse)
        run()
        torch.cuda.synchronize()
        err = rel_error(out, reference(q, k, v, causal=causal)[0])
        ok = err < 2e-2 and not torch.isnan(lse).any()
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D=192 Dv=128 {str(dt)[6:]} causal={int(causal)} {variant}: "
              f"rel error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for B, Hq, Hkv, Sk, dt, parts in only(MLA_DECODE):
        q, k, _ = random_qkv(B, Hq, Hkv, 1, Sk, 576, dt, "bhsd")
        err, ok = forced_flash_error(q, k, k[..., :512], splits=parts, kernel="sm90")
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sk={Sk} D=576 Dv=512 (v in k) {str(dt)[6:]} parts={parts}: "
              f"rel error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for B, Hq, Hkv, Sq, Sk, dt, causal, parts, layout, kind, *dim in only(DECODE):
        D = dim[0] if dim else 128
        q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dt, layout)
        m = None if kind is None else padded_mask(kind, (B, 1, Sq, Sk), dt)
        err, ok = forced_flash_error(q, k, v, m, causal, splits=parts, kernel="sm90_decode")
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} {str(dt)[6:]} causal={int(causal)} {layout} decode "
              f"parts={parts} mask={kind}: rel error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for B, Hq, Hkv, Sq, Sk, D, dt, causal, kind, shape in only(MASKED):
        q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dt, "bhsd")
        dims = {"B1SqSk": (B, 1, Sq, Sk), "11SqSk": (1, 1, Sq, Sk), "BHSqSk": (B, Hq, Sq, Sk), "B11Sk": (B, 1, 1, Sk)}
        m = padded_mask(kind, dims[shape], dt)
        err, ok = forced_flash_error(q, k, v, m, causal, kernel="sm90")
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} {str(dt)[6:]} causal={int(causal)} {kind} mask "
              f"{shape}: rel error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for B, Hq, Hkv, Sq, Sk, D, causal, window in only(FP8):
        # quantized on the CPU: racecheck reports PyTorch's own max reduction (amax) on the GPU at these sizes
        g = torch.Generator().manual_seed(Sq + Sk)
        cpu = (fp8_kv(torch.randn(B, H, S, D, generator=g).transpose(1, 2), Hkv)
               for H, S in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))
        (q8, qd), (k8, kd), (v8, vd) = ((x.cuda(), d.cuda()) for x, d in cpu)
        vals = [fp8_values(x, d).transpose(1, 2) for x, d in ((q8, qd), (k8, kd), (v8, vd))]
        q8, k8, v8 = (x.transpose(1, 2).contiguous() for x in (q8, k8, v8))  # (B, H, S, D)
        sinks = torch.randn(Hq, device="cuda") if window else None
        out = attn_lt.attention(q8, k8, v8, causal=causal, window=window, sinks=sinks, q_descale=qd, k_descale=kd,
                                v_descale=vd)
        kw = dict(causal=causal, window=window, sinks=sinks, dtype=torch.float64)
        ref, emu = reference(*vals, **kw)[0], reference(*vals, p_e4m3=True, **kw)[0]
        err = rel_error(out, ref)
        ok = err <= tolerance(rel_error(emu.to(torch.bfloat16), ref))
        bad += not ok
        print(f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} e4m3 causal={int(causal)} window={window}: rel error "
              f"{err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    for Hq, dt, lengths, paged in only(MLA_FP8):
        err, ok = mla_fp8_error(Hq, dt, lengths, paged)
        bad += not ok
        print(f"MLA decode FP8 latent Hq={Hq} {str(dt)[6:]} lengths={lengths} paged={int(paged)}: rel error "
              f"{err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    total = sum(len(only(g)) for g in GROUPS.values())
    print(f"{total - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
