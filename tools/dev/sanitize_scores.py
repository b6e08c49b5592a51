"""Small cases of the long path's Hopper Q@K^T (native/scores_sm90.cu) for compute-sanitizer: ragged rows and keys,
strided operands, padded score rows, both head dims and dtypes, more tiles than SMs.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/dev/sanitize_scores.py
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from attn_lt import native  # noqa: E402
from attn_lt.testing import rel_error, scores_args  # noqa: E402

CASES = [(1, 1, 1, 64), (2, 97, 300, 128), (3, 129, 1029, 64), (1, 1100, 2100, 128)]  # batch, rows, cols, D


def main() -> int:
    worst = 0.0
    for batch, rows, cols, D in CASES:
        for dt in (torch.bfloat16, torch.float16):
            q = torch.randn(rows, batch, D, device="cuda", dtype=dt).transpose(0, 1)
            k = torch.randn(batch, cols, D, device="cuda", dtype=dt)
            ld = -(-cols // 4) * 4 + 4
            s = torch.full((batch, rows, ld), math.nan, device="cuda")
            native.scores_sm90(scores_args(q, k, s, 0.5), torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            err = rel_error(s[..., :cols], 0.5 * (q.double() @ k.double().transpose(1, 2)))
            worst = max(worst, err)
            assert torch.isnan(s[..., -(-cols // 4) * 4:]).all()  # whole 16-byte chunks are stored
    print(f"scores_sm90: {len(CASES) * 2} cases, worst relative error {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
