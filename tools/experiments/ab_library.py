"""The Hopper prefill kernel of this tree's library against another build of libattn_lt.so, in one process, on
FlashAttention-3's protocol (bf16, B * S = 16k, H * D = 2048): both libraries' attn_lt_flash_sm90_fwd run on the same
arguments (the other build must share this tree's attn_lt.h), with cuDNN beside them, timed in turns (twice, the
second time in the reverse order, the better median kept). Checks first that the two give the same bits.

    python3 tools/experiments/ab_library.py --other OLD/libattn_lt.so --out DIR [--dims 64,128,256]
                                            [--lengths 512,1024,2048,4096,16384] [--causal 0,1] [--variant default]
                                            [--fp8]

Prints a line a case (TFLOP/s and ratios); writes DIR/ab_library.json. Separate processes differ by several percent
on the same build; calls in turns in one process share the machine's drift.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_flash_sm90 import (HIDDEN, TOKENS, protocol_cases, protocol_line, protocol_parser,  # noqa: E402
                              protocol_rates, protocol_start, sdpa_call, sm90_call)

from attn_lt import native  # noqa: E402


def other_launch(path: str):
    """``launch(args, stream)`` through the attn_lt_flash_sm90_fwd of the library at ``path``."""
    fn = ctypes.CDLL(path).attn_lt_flash_sm90_fwd
    fn.restype = ctypes.c_int

    def launch(args, stream):
        rc = fn(ctypes.byref(args), ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"{path}: attn_lt_flash_sm90_fwd returned {rc}")

    return launch


def main(argv=None) -> int:
    ap = protocol_parser(__doc__, "ab_library.json", "64,128,256", "512,1024,2048,4096,16384")
    ap.add_argument("--other", required=True, help="the other build's libattn_lt.so")
    ap.add_argument("--variant", default="default", choices=sorted(native.FLASH_SM90_VARIANTS))
    ap.add_argument("--fp8", action="store_true", help="the FP8 prefill (e4m3 q, k, v; cuDNN on their bf16 values)")
    ap.set_defaults(rep_ms=40.0)
    a = protocol_start(ap, argv, "ab_library")
    if a is None:
        return 2
    other = other_launch(a.other)
    rows = []
    for D, S, causal in protocol_cases(a):
        H, B = HIDDEN // D, TOKENS // S
        torch.manual_seed(S + D + causal)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        x = [t.to(torch.float8_e4m3fn) for t in (q, k, v)] if a.fp8 else (q, k, v)
        run, out, _ = sm90_call(*x, causal=causal, variant=a.variant)
        run_other, out_other, _ = sm90_call(*x, causal=causal, variant=a.variant, launch=other)
        out.fill_(float("nan"))
        out_other.fill_(float("nan"))
        run()
        run_other()
        torch.cuda.synchronize()
        same = torch.equal(out, out_other)
        calls = {"other": run_other, "this": run, "cudnn": sdpa_call(q, k, v, causal, "cudnn")}
        tf = protocol_rates(calls, B, H, S, D, causal, a.rep_ms)
        rows.append(dict(D=D, S=S, causal=int(causal), **{f"tf_{n}": x for n, x in tf.items()}, same=same))
        print(protocol_line(D, S, causal, tf, [("this", "other"), ("this", "cudnn"), ("other", "cudnn")],
                            f" same {same}"), flush=True)
        del q, k, v, x, out, out_other
    with open(os.path.join(a.out, "ab_library.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "other": a.other, "variant": a.variant, "fp8": a.fp8,
                   "rows": rows}, f, indent=1)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
