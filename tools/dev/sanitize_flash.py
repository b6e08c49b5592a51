#!/usr/bin/env python3
"""A few small shapes through native/flash.cu (the mma.sync kernel: GQA folded into rows, the key range split and
merged by LSE, dense masks of several broadcast shapes, read by strides or staged with the K/V tiles; D 64/128/256; fp16/bf16; tails; causal with Sq != Sk; a
(B, S, H, D) view), each run once, for compute-sanitizer. Exits 1 when an output is wrong, 2 without a GPU.

    compute-sanitizer --tool memcheck  python3 tools/dev/sanitize_flash.py
    compute-sanitizer --tool racecheck python3 tools/dev/sanitize_flash.py
"""

from __future__ import annotations

import sys

import torch

from attn_lt.testing import forced_flash_error, random_qkv

# (B, Hq, Hkv, Sq, Sk, D, dtype, causal, layout, mask, splits)
CASES = [
    (1, 4, 1, 1, 700, 128, torch.bfloat16, False, "bhsd", None, 3),
    (2, 8, 2, 3, 333, 64, torch.float16, True, "bhsd", None, 2),
    (1, 2, 2, 97, 130, 128, torch.bfloat16, True, "bshd", None, 1),
    (1, 2, 1, 100, 200, 64, torch.bfloat16, False, "bhsd", None, 1),  # 200 rows: two m16 tiles a warp
    (1, 2, 2, 5, 300, 256, torch.float16, False, "bhsd", "bool-B1SqSk", 2),
    (2, 4, 2, 16, 257, 128, torch.bfloat16, False, "bhsd", "fp32-11SqSk", 4),
    # the merge: several splits a warp, and more than 32 a warp with many empty ones
    (1, 8, 2, 1, 4160, 128, torch.bfloat16, False, "bhsd", None, 37),
    (1, 4, 4, 1, 1000, 64, torch.float16, False, "bhsd", None, 133),
    (2, 4, 4, 40, 90, 64, torch.bfloat16, True, "bhsd", "bool-B11Sk", 1),
    # decode blocks staging aligned mask rows with the K/V tiles (key tails inside the last tile, rows past the end)
    (2, 4, 1, 4, 272, 128, torch.bfloat16, False, "bhsd", "bool-B1SqSk", 3),
    (1, 2, 2, 3, 200, 256, torch.float16, False, "bhsd", "fp32-11SqSk", 2),
    (2, 4, 4, 1, 520, 64, torch.bfloat16, False, "bhsd", "q-B11Sk", 1),
    # 64-row blocks staging one mask row per query position (a group of 4, and of 6 straddling positions)
    (1, 8, 2, 30, 272, 128, torch.bfloat16, False, "bhsd", "bool-B1SqSk", 2),
    (1, 12, 2, 20, 200, 64, torch.float16, True, "bhsd", "q-11SqSk", 1),
    # 64-row blocks staging their own 64 mask rows (bool and q's dtype; a key tail; causal)
    (1, 2, 2, 100, 208, 128, torch.bfloat16, True, "bhsd", "q-B1SqSk", 1),
    (2, 2, 1, 70, 144, 64, torch.float16, False, "bhsd", "bool-B1SqSk", 1),
]


def make_mask(spec, B, Hq, Sq, Sk, dt):
    if spec is None:
        return None
    kind, shape = spec.split("-")
    full = {"B1SqSk": (B, 1, Sq, Sk), "11SqSk": (1, 1, Sq, Sk), "B11Sk": (B, 1, 1, Sk)}[shape]
    if kind == "bool":
        return torch.rand(full, device="cuda") > 0.3
    return torch.randn(full, device="cuda").to(dt if kind == "q" else torch.float32)


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_flash: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bad = 0
    for B, Hq, Hkv, Sq, Sk, D, dt, causal, layout, mspec, splits in CASES:
        q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dt, layout)
        m = make_mask(mspec, B, Hq, Sq, Sk, dt)
        err, ok = forced_flash_error(q, k, v, m, causal, splits)
        bad += not ok
        print(f"B{B} Hq{Hq} Hkv{Hkv} Sq{Sq} Sk{Sk} D{D} {str(dt)[6:]} causal={causal} {layout} mask={mspec} "
              f"splits={splits}: rel err {err:.2e} {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
