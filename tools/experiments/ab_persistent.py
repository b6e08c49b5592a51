"""The Hopper prefill kernel's default launch (persistent CTAs) against its grid variant (a CTA a query block and
head) and PyTorch SDPA's cuDNN and FLASH backends, on FlashAttention-3's protocol (bf16, B * S = 16k, H * D = 2048),
in one process: each case's four calls are timed in turns, twice (the second time in the reverse order), and the
better of the two medians kept. Checks first that the two launches give the same bits and the default's error against
an FP32 reference.

    python3 tools/experiments/ab_persistent.py --out DIR [--dims 64,128,256] [--lengths 512,1024,2048,4096,16384]
                                               [--causal 0,1] [--rep-ms 40]

Prints a line a case; writes DIR/ab_persistent.json (docs/perf/h200/flash_sm90.json is one such file).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_flash_sm90 import (HIDDEN, TOKENS, protocol_cases, protocol_line, protocol_parser,  # noqa: E402
                              protocol_rates, protocol_start, sdpa_call, sm90_call)

from attn_lt.testing import reference, rel_error  # noqa: E402


def main(argv=None) -> int:
    ap = protocol_parser(__doc__, "ab_persistent.json", "64,128,256", "512,1024,2048,4096,16384")
    ap.set_defaults(rep_ms=40.0)
    a = protocol_start(ap, argv, "ab_persistent")
    if a is None:
        return 2
    rows = []
    for D, S, causal in protocol_cases(a):
        H, B = HIDDEN // D, TOKENS // S
        torch.manual_seed(S + D + causal)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        run, out, _ = sm90_call(q, k, v, causal=causal)
        run_grid, out_grid, _ = sm90_call(q, k, v, causal=causal, variant="grid")
        out.fill_(float("nan"))
        run()
        run_grid()
        torch.cuda.synchronize()
        ref, _ = reference(q[-1:, -2:], k[-1:, -2:], v[-1:, -2:], causal=causal)
        err, same = rel_error(out[-1:, -2:], ref), torch.equal(out, out_grid)
        calls = {"pers": run, "grid": run_grid, "cudnn": sdpa_call(q, k, v, causal, "cudnn"),
                 "flash": sdpa_call(q, k, v, causal, "flash")}
        tf = protocol_rates(calls, B, H, S, D, causal, a.rep_ms)
        rows.append(dict(D=D, S=S, causal=int(causal), **{f"tf_{n}": x for n, x in tf.items()}, err=err,
                         same=same))
        print(protocol_line(D, S, causal, tf, [("pers", "grid"), ("pers", "cudnn"), ("grid", "cudnn")],
                            f" err {err:.1e} same {same}"), flush=True)
        del q, k, v, out, out_grid
    with open(os.path.join(a.out, "ab_persistent.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
