#!/usr/bin/env python3
"""Host microseconds a call of this tree's attn_lt against another commit's, interleaved in one process (the lent
hosts' speed drifts by tens of percent between processes and minutes; rounds that alternate share the drift).

The other commit's package is exported (``git archive``) and imported as ``attn_lt_base``, loading this tree's
native library. Timed, each queued behind a sleep kernel so that only the host counts (``testing.host_us_rounds``):
``attention()`` and the transformers adapter on a cached decode call (B8 Hq32 Hkv8 Sk4096 D128), a ``generate()``
step of 8 layers through the adapter whose caches grow one key a step (B1, each layer its own contiguous K/V, as
transformers' dynamic cache makes them), and SDPA (cuDNN off: its best setting in such a loop) beside them.

    python3 tools/experiments/host_ab.py --base HEAD~1|DIR [--rounds 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def export_base(base: str, into: str) -> None:
    """The attn_lt package of commit ``base`` (or of the source tree at directory ``base``, e.g. on a machine
    without the git history) as ``attn_lt_base`` under ``into``, its torch custom op renamed to match."""
    if os.path.isdir(base):
        shutil.copytree(os.path.join(base, "attn_lt"), os.path.join(into, "attn_lt"),
                        ignore=shutil.ignore_patterns("_native", "__pycache__"))
    else:
        data = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", base, "attn_lt"], check=True,
                              capture_output=True).stdout
        tmp = os.path.join(into, "export.tar")
        with open(tmp, "wb") as f:
            f.write(data)
        with tarfile.open(tmp) as t:
            t.extractall(into, filter="data")
    os.rename(os.path.join(into, "attn_lt"), os.path.join(into, "attn_lt_base"))
    api = os.path.join(into, "attn_lt_base", "api.py")
    with open(api) as f:
        text = f.read()
    with open(api, "w") as f:
        f.write(text.replace("attn_lt::attention", "attn_lt_base::attention").replace(
            "torch.ops.attn_lt.attention", "torch.ops.attn_lt_base.attention"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~1), or a directory holding "
                    "its source tree")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="attn_lt_base_")
    export_base(a.base, tmp)
    sys.path.append(tmp)
    import torch
    import torch.nn.functional as F

    import attn_lt
    import attn_lt_base
    from attn_lt import native
    from attn_lt.integrations import transformers as hf_new
    from attn_lt.testing import host_us_rounds

    os.environ.setdefault("ATTN_LT_LIB", str(native.library_path()))  # both packages load this tree's library
    from attn_lt_base.integrations import transformers as hf_base

    torch.backends.cuda.enable_cudnn_sdp(False)
    bf = torch.bfloat16
    layer = type("Layer", (), {"is_causal": True})()
    q8 = torch.randn(8, 32, 1, 128, device="cuda", dtype=bf)
    k8 = torch.randn(8, 8, 4096, 128, device="cuda", dtype=bf)
    v8 = torch.randn_like(k8)
    q1 = torch.randn(1, 32, 1, 128, device="cuda", dtype=bf)
    layers, start = 8, 4096
    bufs = [torch.randn(8 * (start + 40000) * 128, device="cuda", dtype=bf) for _ in range(2 * layers)]

    def stepper(forward):
        n = [start]

        def step():
            n[0] += 1
            m = n[0]
            for i in range(layers):  # each layer its own K/V, contiguous (1, 8, m, 128): strides follow m
                k = bufs[2 * i][: 8 * m * 128].view(1, 8, m, 128)
                v = bufs[2 * i + 1][: 8 * m * 128].view(1, 8, m, 128)
                forward(layer, q1, k, v, None, dropout=0.0, scaling=None, position_ids=None)

        return step

    def sdpa_forward(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):  # transformers' sdpa, its core
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).contiguous(), None

    cases = {}
    for name, mod, hf in (("this tree", attn_lt, hf_new), (a.base, attn_lt_base, hf_base)):
        cases[f"attention() B8 Sk4k [{name}]"] = (lambda mod=mod: mod.attention(q8, k8, v8), 200, 1)
        cases[f"adapter B8 Sk4k [{name}]"] = (
            lambda hf=hf: hf.attention_forward(layer, q8, k8, v8, None, dropout=0.0, scaling=None), 200, 1)
        cases[f"adapter, generate step B1, per call [{name}]"] = (stepper(hf.attention_forward), 25, layers)
    cases["sdpa (no cuDNN) B8 Sk4k"] = (lambda: F.scaled_dot_product_attention(q8, k8, v8, enable_gqa=True), 200, 1)
    cases["sdpa adapter, generate step B1, per call"] = (stepper(sdpa_forward), 25, layers)
    raw = host_us_rounds({k: c[0] for k, c in cases.items()}, {k: c[1] for k, c in cases.items()}, a.rounds)
    rounds = {k: [us / cases[k][2] for us in v] for k, v in raw.items()}  # a generate step: µs per layer's call
    med = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
    print(f"host µs a call, median of {a.rounds} interleaved rounds, {torch.cuda.get_device_name()}:")
    for k, v in med.items():
        print(f"  {k:<52}{v:>8.2f}   (rounds {min(rounds[k]):.1f}-{max(rounds[k]):.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"base": a.base, "median_us": med, "rounds_us": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
