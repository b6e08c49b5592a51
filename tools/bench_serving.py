#!/usr/bin/env python3
"""attn_lt in a serving loop, side by side with PyTorch SDPA (issue 10's figures), on one GPU:

1. **decode loop**: B8 Hq32 Hkv8 D128 bf16, a KV cache of fixed capacity whose valid length grows by one key a
   step from 32768, ``--steps`` steps (default 1000), from a fresh algorithm cache with the default policy; each
   step's wall time (synchronised); the steady state (the same call repeated once tuned, CUDA events); total
   tuning time. SDPA's default backend runs the same loop, and so does ``attn_lt_preplanned``: every step's plan
   made before the loop, the loop calling ``plan.run`` only (what the loop costs without looking up a plan a step).
2. **repeated causal prefill**: B1 H32 S32768 D128 causal, called back to back from a fresh cache.
3. **host cost**: microseconds to issue one cached call (decode B8 Hq32 Hkv8 Sk 4k and 16k) through
   ``attention()``, ``plan.run`` and SDPA's default (their batches interleaved, so that a drifting host touches
   them alike), and a decode step's call (one key longer than the last: the compiled fast path runs it on the last
   call's plan, the Python path plans each length) through ``attention()``,
   GPU work queued behind a long kernel so that the host alone is timed; ``attention()`` also with its compiled
   fast path off (``python path``, attn_lt.fastpath).
4. **graph replay**: the decode call captured in a CUDA graph and replayed.

    python tools/bench_serving.py [--steps 1000] [--prefill-calls 6] [--out DIR] [--quick] [--host-only]

Prints a short table last; writes DIR/serving.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sdpa_call(q, k, v, causal=False):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def decode_loop(steps: int, provider: str, start: int = 32768):
    """Per-step wall ms of a decode loop whose cache grows one key a step; the steady-state ms at the end."""
    import torch

    import attn_lt
    from attn_lt.lt import algos
    from attn_lt.testing import events_ms

    B, Hq, Hkv, D = 8, 32, 8, 128
    cap = start + steps + 8
    kc = torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(B, Hkv, cap, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    tuned0 = dict(algos.stats)
    plans = {}
    if provider == "attn_lt_preplanned":  # every step's plan made before the loop: the loop pays launches only
        plans = {n: attn_lt.plan(q, kc[:, :, :n], vc[:, :, :n]) for n in range(start, start + steps)}
    calls = {"attn_lt": lambda q, k, v, n: attn_lt.attention(q, k, v),
             "attn_lt_preplanned": lambda q, k, v, n: plans[n].run(q, k, v),
             "sdpa_default": lambda q, k, v, n: sdpa_call(q, k, v)}
    call = calls[provider]

    def step(n: int) -> tuple[float, float]:
        """One loop step at length n: (wall ms, synchronised; ms from an event before the call to one after)."""
        k, v = kc[:, :, :n], vc[:, :, :n]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.record()
        call(q, k, v, n)
        e.record()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, s.elapsed_time(e)

    t_loop = time.perf_counter()
    measured = [step(start + i) for i in range(steps)]
    loop_s = time.perf_counter() - t_loop
    times = [w for w, _ in measured]
    gpu = [g for _, g in measured[1:]]  # event to event: the step's GPU work plus any host gap inside
    n = start + steps - 1
    k, v = kc[:, :, :n], vc[:, :, :n]
    steady = events_ms(lambda: call(q, k, v, n))
    # the loop's own steady state: the same step, code and timing alike, repeated at one length (plan cached)
    again = [step(n) for _ in range(50)]
    steady_wall = statistics.median(w for w, _ in again)
    steady_events = statistics.median(g for _, g in again)
    tuned = {x: algos.stats[x] - tuned0[x] for x in algos.stats}
    later = times[1:]
    route = "sdpa" if provider == "sdpa_default" else attn_lt.explain(q, k, v).decision.backend
    return {"provider": provider, "route": route, "steps": steps, "first_ms": round(times[0], 3),
            "median_ms": round(statistics.median(later), 4), "median_events_ms": round(statistics.median(gpu), 4),
            "worst_after_first_ms": round(max(later), 3),
            "steady_ms": round(steady, 4), "steady_wall_ms": round(steady_wall, 4),
            "steady_events_ms": round(steady_events, 4),
            "median_events_over_steady_events": round(statistics.median(gpu) / steady_events, 3),
            "median_over_steady": round(statistics.median(later) / steady, 3),
            "median_over_steady_wall": round(statistics.median(later) / steady_wall, 3),
            "worst_over_steady": round(max(later) / steady, 2), "loop_s": round(loop_s, 2), "resolve": tuned,
            "times_ms": [round(t, 4) for t in times]}


def prefill_calls(calls: int, provider: str, S: int = 32768):
    import torch

    import attn_lt

    q, k, v = (torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if provider == "attn_lt":
            attn_lt.attention(q, k, v, causal=True, backend="lt")
        else:
            sdpa_call(q, k, v, causal=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    steady = statistics.median(times[2:]) if len(times) > 3 else times[-1]
    return {"provider": provider, "calls_ms": [round(t, 2) for t in times], "steady_ms": round(steady, 2),
            "worst_after_first_over_steady": round(max(times[1:]) / steady, 3) if len(times) > 1 else None}


def python_path(fn, *args):
    """``fn(*args)`` with attn_lt's compiled fast path off (attn_lt.fastpath): the Python path's host cost, plus
    two switches (~0.2 µs)."""
    from attn_lt import fastpath

    on = fastpath.call is not None
    fastpath.set_enabled(False)
    try:
        return fn(*args)
    finally:
        fastpath.set_enabled(on)


def host_costs():
    """Host µs of a cached decode call (B8 Hq32 Hkv8, Sk 4k and 16k): ``attention()`` and ``plan.run`` on the
    path ``auto`` takes and on the long path, beside SDPA's default."""
    import torch

    import attn_lt
    from attn_lt.testing import host_us_each

    rows = []
    for Sk in (4096, 16384):
        q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(8, 8, Sk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row, fns = {"Sk": Sk}, {}
        for backend in ("auto", "lt"):
            p = attn_lt.plan(q, k, v, backend=backend).tune(q, k, v)
            attn_lt.attention(q, k, v, backend=backend)
            row[f"{backend}_route"] = p.backend
            fns[f"attention_{backend}_us"] = lambda backend=backend: attn_lt.attention(q, k, v, backend=backend)
            fns[f"plan_run_{backend}_us"] = lambda p=p: p.run(q, k, v)
        fns["attention_auto_python_us"] = lambda: python_path(attn_lt.attention, q, k, v)
        fns["sdpa_default_us"] = lambda: sdpa_call(q, k, v)
        row.update(host_us_each(fns))  # side by side: a host's speed drifts within a run
        # a decode step: each call one key longer than the last (views of one cache)
        kc, vc = (torch.randn(8, 8, Sk + 520, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        attn_lt.attention(q, kc[:, :, :Sk], vc[:, :, :Sk])
        steps = [iter([(kc[:, :, :n], vc[:, :, :n]) for n in range(Sk + 1, Sk + 512)]) for _ in range(2)]
        row.update(host_us_each({  # each its own walk over the lengths, the batches interleaved
            "attention_step_us": lambda: attn_lt.attention(q, *next(steps[0])),
            "attention_step_python_us": lambda: python_path(attn_lt.attention, q, *next(steps[1]))}))
        rows.append(row)
    return rows


def graph_replay():
    import torch

    import attn_lt
    from attn_lt.testing import events_ms, reference, rel_error

    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 8, 16384, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    attn_lt.attention(q, k, v, backend="lt")  # plan and tune outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn_lt.attention(q, k, v, backend="lt")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attn_lt.attention(q, k, v, backend="lt")
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    err = rel_error(out, reference(q, k, v)[0])
    return {"graph_replay_ms": round(events_ms(g.replay), 4),
            "eager_ms": round(events_ms(lambda: attn_lt.attention(q, k, v, backend="lt")), 4),
            "rel_error_after_new_values": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--prefill-calls", type=int, default=6)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true", help="200 decode steps, 4 prefill calls")
    ap.add_argument("--host-only", action="store_true", help="only the host cost of a cached call (3.)")
    a = ap.parse_args(argv)
    import torch

    import attn_lt

    if not torch.cuda.is_available():
        print("bench_serving: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    if a.quick:
        a.steps, a.prefill_calls = 200, 4
    os.environ["ATTN_LT_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn_lt_serving_")  # a fresh cache: cold start
    os.environ.pop("ATTN_LT_ALGO_POLICY", None)
    attn_lt.config.reload()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    loops = () if a.host_only else ("attn_lt", "attn_lt_preplanned", "sdpa_default")
    res["decode_loop"] = [decode_loop(a.steps, p) for p in loops]
    res["prefill"] = [prefill_calls(a.prefill_calls, p) for p in loops if p != "attn_lt_preplanned"]
    res["host"] = host_costs()
    res["graph"] = None if a.host_only else graph_replay()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serving.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\n== serving loop on {res['gpu']} ({res['date']})")
    print("steady: the call repeated back to back at one length, GPU time by CUDA events; st.wall: the loop's own "
          "step (synchronised, the same code and timing) repeated at one length, plan cached")
    print("events: the loop steps' median from an event before the call to one after it (GPU work and host gaps); "
          "ev/st.ev: that over the same events of the st.wall repeats")
    print(f"{'decode loop':<20}{'route':>6}{'first ms':>10}{'median':>10}{'events':>9}{'worst>1':>10}{'steady':>10}"
          f"{'st.wall':>9}{'med/st':>8}{'med/wall':>9}{'ev/st.ev':>9}{'worst/st':>9}{'loop s':>8}  resolve")
    for r in res["decode_loop"]:
        print(f"{r['provider']:<20}{r['route']:>6}{r['first_ms']:>10.2f}{r['median_ms']:>10.4f}"
              f"{r['median_events_ms']:>9.4f}{r['worst_after_first_ms']:>10.3f}{r['steady_ms']:>10.4f}{r['steady_wall_ms']:>9.4f}"
              f"{r['median_over_steady']:>8.3f}{r['median_over_steady_wall']:>9.3f}"
              f"{r['median_events_over_steady_events']:>9.3f}{r['worst_over_steady']:>9.2f}"
              f"{r['loop_s']:>8.2f}  {r['resolve'] if r['provider'] == 'attn_lt' else ''}")
    for r in res["prefill"]:
        print(f"prefill {r['provider'] + (' (lt)' if r['provider'] == 'attn_lt' else ''):<14} calls ms {r['calls_ms']}  steady {r['steady_ms']}  "
              f"worst-after-first/steady {r['worst_after_first_over_steady']}")
    for r in res["host"]:
        print(f"host us/call Sk={r['Sk']:<6} auto ({r['auto_route']}): attention {r['attention_auto_us']:>6} "
              f"(python path {r['attention_auto_python_us']:>6}; a step one key longer {r['attention_step_us']:>6}, "
              f"python path {r['attention_step_python_us']:>6}) "
              f"plan.run {r['plan_run_auto_us']:>6} | lt: attention {r['attention_lt_us']:>6} plan.run "
              f"{r['plan_run_lt_us']:>6} | sdpa default {r['sdpa_default_us']:>6}")
    if res["graph"] is not None:
        print(f"graph: {res['graph']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
