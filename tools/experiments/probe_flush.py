#!/usr/bin/env python3
"""How the suite's L2 flush weighs on a timed call: the same calls timed after a flush that reads a 256 MiB buffer
and after one that zeroes it (triton's do_bench), interleaved round by round so that the GPU's drift falls on both.

    python3 tools/experiments/probe_flush.py [--cases decode-sq1-sk8k-gqa,...] [--providers auto,cudnn] [--rounds 15]
                                [--json FILE]

A zeroing flush leaves the L2 full of dirty lines; the timed call's first reads evict them, and the write-back
to HBM is charged to the call. Prints, per case and provider, the median microseconds under each flush and their
difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench  # noqa: E402
import bench_suite as suite  # noqa: E402
from attn_lt.testing import L2_FLUSHES  # noqa: E402

DEFAULT_CASES = ("decode-sq1-sk8k-gqa,decode-sq1-sk8k-gqa-mask,decode-sq16-sk8k-gqa,decode-sq16-sk32k-gqa,"
                 "decode-sq1-sk8k-mha,decode-sq1-sk128k-gqa")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated suite case names")
    ap.add_argument("--providers", default="auto,cudnn")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rep-ms", type=float, default=40.0, help="timing budget of a provider a round (ms)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_flush: no CUDA GPU", file=sys.stderr)
        return 2
    by_name = {c.name: c for c in suite.sweep()}
    unknown = [n for n in a.cases.split(",") if n not in by_name]
    if unknown:
        print(f"probe_flush: unknown cases {', '.join(unknown)}", file=sys.stderr)
        return 2
    bench.warm_up(3.0)
    timers = {f: bench.Timer(a.rep_ms, 1, flush=f) for f in L2_FLUSHES}
    print(f"{torch.cuda.get_device_name()}, {a.rounds} interleaved rounds; median us after a read / write flush")
    out = []
    for name in a.cases.split(","):
        c = by_name[name]
        tensors = bench.make_inputs(c)
        calls = {p: bench.make_call(p, c, *tensors)[0] for p in a.providers.split(",")}
        for fn in calls.values():
            fn()
        times = {(p, f): [] for p in calls for f in timers}
        for i in range(a.rounds):
            for f in (L2_FLUSHES if i % 2 == 0 else L2_FLUSHES[::-1]):
                for p, fn in calls.items():
                    times[p, f] += timers[f].samples(fn)
        cells = []
        for p in calls:
            r, w = (1e3 * statistics.median(times[p, f]) for f in ("read", "write"))
            out.append({"case": name, "provider": p, "read_us": round(r, 2), "write_us": round(w, 2)})
            cells.append(f"{p} {r:.1f} / {w:.1f} ({w - r:+.1f})")
        print(f"{name:30s} " + "   ".join(cells), flush=True)
        del tensors, calls
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
