"""Small long-path cases for compute-sanitizer: the softmax (every variant) and the key tiles' LSE merge, with and
without masks and causal masking, GQA, fp16 and bf16; the attention mass per key written by the softmax (decode,
odd key counts) and added by it (prefill chunks on the PIPE kernel: a ragged tail, a window, a mask, two lanes).

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_lt.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import attn_lt  # noqa: E402
from attn_lt import config  # noqa: E402
from attn_lt.testing import random_qkv, reference, rel_error  # noqa: E402

CASES = [  # B, Hq, Hkv, Sq, Sk, D, causal, dtype, mask, workspace bytes (small ones force key tiles)
    (1, 2, 2, 300, 2100, 64, True, torch.bfloat16, None, 1 << 20),
    (2, 4, 2, 257, 1500, 80, False, torch.float16, "bool", 1 << 20),
    (1, 4, 1, 500, 499, 128, True, torch.bfloat16, "float", 2 << 20),
    (1, 2, 2, 97, 4097, 64, False, torch.bfloat16, None, 64 << 20),  # whole rows
    (1, 4, 2, 200, 15001, 64, True, torch.float16, None, 256 << 20),  # PIPE_REGS where AUTO takes it (H200)
]


def main() -> int:
    worst = 0.0
    for B, Hq, Hkv, Sq, Sk, D, causal, dt, mask, ws in CASES:
        for variant in ("auto", "row", "two_pass"):
            q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, dt)
            m = None
            if mask == "bool":
                m = torch.rand(B, 1, Sq, Sk, device="cuda") > 0.3
            elif mask == "float":
                m = torch.randn(1, 1, Sq, Sk, device="cuda", dtype=dt)
            with config.override(softmax=variant):
                out = attn_lt.attention(q, k, v, attn_mask=m, causal=causal, backend="lt", workspace_bytes=ws,
                                        algo_policy="heuristic")
            err = rel_error(out, reference(q, k, v, m, causal)[0])
            worst = max(worst, err)
    for variant in ("auto", "row", "two_pass"):  # the mass written by the softmax: a ragged tail, whole groups
        for Sk in (1001, 4096):
            q, k, v = random_qkv(2, 8, 2, 1, Sk, 64, torch.bfloat16)
            with config.override(softmax=variant):
                out, mass = attn_lt.attention(q, k, v, backend="lt", return_key_mass=True, algo_policy="heuristic")
            worst = max(worst, rel_error(out, reference(q, k, v)[0]), (mass.sum(-1) - 1).abs().max().item())
    for window, mask in ((None, None), (37, "bool")):  # the mass added by PIPE, chunk by chunk on two lanes
        q, k, v = random_qkv(1, 4, 2, 300, 4102, 64, torch.bfloat16)
        m = torch.rand(1, 1, 300, 4102, device="cuda") > 0.3 if mask else None
        out, mass = attn_lt.attention(q, k, v, attn_mask=m, backend="lt", return_key_mass=True,
                                      key_mass_window=window, workspace_bytes=8 << 20, algo_policy="heuristic")
        rows = 300 if window is None else window
        worst = max(worst, rel_error(out, reference(q, k, v, m)[0]), (mass.sum(-1) / rows - 1).abs().max().item())
    torch.cuda.synchronize()
    print(f"{len(CASES) * 3} long-path runs, 6 decode masses and 2 added masses, worst error {worst:.2e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
