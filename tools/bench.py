#!/usr/bin/env python3
"""attn_lt's benchmark suite: attn_lt (auto, lt, wmma) side by side with PyTorch SDPA (each backend forced, and
its default) and the plain-PyTorch unfused chain, on one GPU in one run. Protocol: the README's "Benchmarks"
section; cases, formulas and writers: tools/bench_suite.py.

    python tools/bench.py run [--quick] [--groups fa3,long,decode] [--no-masks] [--providers auto,lt,...]
                              [--cases SUBSTR,...] [--out DIR] [--rep-ms 150] [--rounds 7] [--warm-up-s 5]
                              [--time-limit-s N] [--lt-details] [--flush read|write] [--no-clock]
                              [--settle-ms 100]
    python tools/bench.py list [--quick] [--groups ...]        the cases of a run, with FLOPs and bytes (no GPU)
    python tools/bench.py report DIR/results.json [--readme docs/performance.md]   summary.md, plots (and that
                                                               file's results block) again (no GPU)
    python tools/bench.py compare A/results.json B/results.json [--tolerance-pct 5]

``run`` writes DIR/results.json, results.csv and summary.md after every case (a run stopped early keeps what it
measured), rate.png and memory.png at the end, and prints the table last. Every provider's output is checked
against an FP32 reference on sampled rows; a wrong result is reported as an error, never timed as a result.
Exit codes: 0 ok; 1 a provider failed or gave a wrong result (run), or the runs disagree (compare); 2 no GPU or
bad arguments.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # attn_lt from this checkout
import bench_suite as suite  # noqa: E402
from attn_lt.testing import L2_FLUSH_MIB, L2_FLUSHES, event_ms, l2_flusher  # noqa: E402

#: Relative L2 error on the sampled rows above which a provider's output counts as wrong (bf16 is ~4e-3).
CHECK_TOL = 2e-2
#: A case whose first timed round (every provider once) takes longer than this gets three rounds, not --rounds.
SLOW_ROUND_MS = 1000.0
#: Calls shorter than this (ms) may take more rounds (:func:`timed_rounds`' ``fast_rounds``): a median of few short
#: rounds moves with the machine's brief disturbances (H100, decode mass: +3.1 and +6.0 % in two runs on one machine).
FAST_CALL_MS = 1.0
#: Free GPU memory the unfused chains may plan to use.
MEMORY_FRACTION = 0.9


# ---- the providers' calls --------------------------------------------------------------------------------------

def unfused(q, k, v, mask, causal):
    """The plain-PyTorch unfused chain: bmm to FP32 scores, softmax, P in the input dtype, bmm. GQA folds the
    query heads of a kv head into the rows (no K/V copies); ``mask`` is (B or 1, 1, Sq, Sk)."""
    import torch

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qg, kg, vg = q.reshape(B * Hkv, g * Sq, D), k.reshape(B * Hkv, Sk, D), v.reshape(B * Hkv, Sk, D)
    try:
        s = torch.bmm(qg, kg.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, RuntimeError) as e:  # torch without out_dtype for bmm
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        s = torch.bmm(qg, kg.transpose(1, 2)).float()
    s5 = s.view(B, Hkv, g, Sq, Sk).mul_(D**-0.5)
    if mask is not None:
        s5.add_(mask.unsqueeze(2))
    if causal:
        from attn_lt.testing import causal_mask

        s5.masked_fill_(~causal_mask(Sq, Sk, q.device), -math.inf)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    del s, s5
    return torch.bmm(p, vg).view(B, Hq, Sq, D)


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def make_call(provider, c, q, k, v, mask):
    """(a no-argument function running ``provider`` on the case, the path attn_lt takes or None), or ValueError
    with why the provider cannot run it."""
    import torch
    import torch.nn.functional as F

    import attn_lt

    if provider in suite.ATTN_LT:  # explain raises with every reason when a forced backend cannot run the case
        route = attn_lt.explain(q, k, v, attn_mask=mask, causal=c.causal, backend=provider).decision.backend
        return lambda: attn_lt.attention(q, k, v, attn_mask=mask, causal=c.causal, backend=provider), route
    if provider == "unfused":
        return lambda: unfused(q, k, v, mask, c.causal), None
    if c.causal and c.Sq != c.Sk:
        raise ValueError("SDPA's is_causal is top-left aligned when Sq != Sk; the sweep has no such case")
    ctx = (lambda: torch.nn.attention.sdpa_kernel(sdpa_backends()[provider])) if provider != "default" \
        else contextlib.nullcontext

    def call():
        with ctx():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=c.causal,
                                                  enable_gqa=c.Hkv != c.Hq)
    return call, None


# ---- measuring -------------------------------------------------------------------------------------------------

#: Untimed calls of a provider before each of its timed rounds (``Timer.settle``), ms: about what the GPU's clock
#: controller takes to follow a change of load (docs/performance-log.md).
SETTLE_MS = 100.0


class Timer:
    """CUDA-event timings with the L2 flushed before each call (``attn_lt.testing.l2_flusher``: ``flush`` one of
    ``L2_FLUSHES``), taken in rounds."""

    def __init__(self, rep_ms: float, rounds: int, slow_rounds: int = 3, flush: str = "read",
                 settle_ms: float = 0.0):
        if rounds < 1 or rep_ms <= 0 or slow_rounds < 1 or settle_ms < 0:
            raise ValueError(f"--rounds and --slow-rounds must be >= 1, --rep-ms > 0 and --settle-ms >= 0, got "
                             f"{rounds}, {slow_rounds}, {rep_ms} and {settle_ms}")
        self.rep_ms, self.rounds, self.slow_rounds, self.settle_ms = rep_ms, rounds, slow_rounds, settle_ms
        self.flush = l2_flusher(flush)

    def once(self, fn) -> float:
        self.flush()
        return event_ms(fn)

    def settle(self, fn) -> None:
        """Untimed calls of ``fn`` (as timed: L2 flushed before each) for ``settle_ms``, at least one when it is
        not 0, before a round's samples: a GPU at its power limit runs a kernel faster right after a lighter one
        (H100, MLA decode at 64k keys: 0.98-1.01 ms after lt's calls or an idle pause, 1.03-1.09 after its own), and
        the clock's controller takes about 0.1 s to follow, so each provider is timed at its own sustained clock."""
        if self.settle_ms <= 0:
            return
        end = time.perf_counter() + self.settle_ms / 1e3
        self.once(fn)
        while time.perf_counter() < end:
            self.once(fn)

    def samples(self, fn) -> list[float]:
        """One round: at least one call, as many as fit in rep_ms / rounds, at most 100 / rounds."""
        times = [self.once(fn)]
        more = min(100 // self.rounds, int(self.rep_ms / self.rounds / max(times[0], 1e-3))) - 1
        return times + [self.once(fn) for _ in range(max(0, more))]


def host_us(fn, ms: float, calls: int = 10) -> float | None:
    """Median host microseconds to issue one call (the GPU keeps the queue busy meanwhile), for calls of at most
    2 ms of GPU time: where a call's host time passes its GPU time, the host sets the pace."""
    import torch

    if ms > 2.0:
        return None
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def peak_mib(fn):
    """(output, extra MiB allocated at the peak of one call, output included)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20


def reference_rows(c, q, k, v, mask, n=16):
    """(row indices, FP32 reference (B, Hq, rows, D)) on ``n`` query rows spread over Sq."""
    import torch

    from attn_lt.testing import reference

    rows = torch.unique(torch.linspace(0, c.Sq - 1, min(c.Sq, n), device=q.device).round().long())
    return rows, reference(q, k, v, mask, c.causal, rows=rows)[0]


def warm_up(seconds: float) -> None:
    """Sustained bf16 GEMMs until the GPU's clocks and power have settled, before anything is measured."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def ceilings() -> dict:
    """This GPU's bf16 GEMM rate (8192^3 through torch) and HBM bandwidth, the better of a device-to-device copy
    (bytes read + written) and a read-only reduction, measured now."""
    import torch

    from attn_lt.testing import time_ms

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    gemm = 2 * 8192**3 / time_ms(lambda: a @ b) / 1e9
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / time_ms(lambda: y.copy_(x)) / 1e9
    read = x.numel() / time_ms(lambda: x.view(torch.float32).sum()) / 1e9
    return {"gemm_tflops": round(gemm, 1), "copy_tbs": round(copy, 3), "read_tbs": round(read, 3),
            "hbm_tbs": round(max(copy, read), 3)}


def first_line(text, limit: int = 160) -> str:
    """The first ``limit`` characters of ``text`` with its whitespace collapsed (for one-line reasons)."""
    return " ".join(str(text).split())[:limit]


def sdpa_reasons(caught, exc) -> str:
    """SDPA says why a backend refused in warnings before it raises "No available kernel": keep those reasons,
    without the headers, the source locations and the notes on backends that the forcing context disabled."""
    said: list[str] = []
    for w in caught:
        m = first_line(str(w.message).split("(Triggered internally")[0], 140)
        if m and not m.endswith(":") and "runtime disabled" not in m and m not in said:
            said.append(m)
    return "; ".join(said[:3]) or first_line(exc)


def first_call(p, c, tensors, ref):
    """A provider's first call on a case (warm-up, peak memory, for lt and auto the tuning of every GEMM shape of
    the case, and the check against the reference): (fn, route, peak MiB, error) when it ran right, else its final
    row."""
    import torch

    from attn_lt import config
    from attn_lt.testing import rel_error

    q, k, v, mask = tensors
    try:
        fn, route = make_call(p, c, q, k, v, mask)
    except ValueError as e:  # attn_lt's declared limits, with every reason
        return suite.row(c, p, "n/a", first_line(e, 240))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with config.tuning_budget(60000):
                    out, peak = peak_mib(fn)
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:
                if suite.PROVIDERS[p].family != "sdpa":
                    raise
                return suite.row(c, p, "n/a", sdpa_reasons(caught, e))
        rows, expected = ref
        err = rel_error(out[:, :, rows], expected)
    except torch.cuda.OutOfMemoryError as e:
        return suite.row(c, p, "skipped", f"out of memory: {first_line(e, 100)}")
    except Exception as e:  # a provider that fails unexpectedly is reported, not dropped
        return suite.row(c, p, "error", f"{type(e).__name__}: {first_line(e)}")
    if not err <= CHECK_TOL:
        return suite.row(c, p, "error", f"wrong result: relative error {err:.3g} on sampled rows (bound {CHECK_TOL})",
                         rel_err=err if math.isfinite(err) else None)
    return fn, route, peak, err


def round_order(providers: list, i: int) -> list:
    """The providers' order in timed round ``i``: reversed every other round and shifted by one every two, so that
    no provider always follows the same one (a GPU at its power limit runs slower right after the hottest
    kernel)."""
    order = list(providers)[::-1] if i % 2 else list(providers)
    shift = (i // 2) % max(1, len(order))
    return order[shift:] + order[:shift]


def run_case(c, providers, tensors, ref, timer, ceil, bar, monitor: GpuMonitor | None = None) -> list[dict]:
    """Every provider on one case, a row each: first calls, then ``timer.rounds`` timed rounds in which each
    provider that ran takes its turn (so a drifting clock touches all of them alike) in :func:`round_order`.
    ``ms`` is the median of all timed calls, ``spread_pct`` the range of the rounds' medians over it; with a
    ``monitor``, the ``gpu_*`` fields say what the GPU's clock did while the provider was timed."""
    import torch

    rows, ready = {}, {}
    free, need = torch.cuda.mem_get_info()[0], suite.unfused_peak_bytes(c)
    for p in providers:
        bar.step(f"{c.name} {p}")
        if suite.PROVIDERS[p].path == "unfused" and p != "lt" and need > MEMORY_FRACTION * free:
            rows[p] = suite.row(c, p, "skipped", f"needs about {need / 2**30:.0f} GiB at once for its score "
                                                 f"matrices; {free / 2**30:.0f} GiB free")
            continue
        got = first_call(p, c, tensors, ref)
        if isinstance(got, dict):
            rows[p] = got
        else:
            ready[p] = got
        torch.cuda.empty_cache()
    timed, failed = timed_rounds({p: got[0] for p, got in ready.items()}, timer, monitor)
    for p, (status, reason) in failed.items():
        rows[p] = suite.row(c, p, status, reason)
    for p, t in timed.items():
        fn, route, peak, err = ready[p]
        rows[p] = suite.row(c, p, "ok", route=route, peak_mib=round(peak, 1), rel_err=float(f"{err:.3g}"),
                            host_us=host_us(fn, t["ms"]), **t, **suite.metrics(c, suite.provider_path(p, route),
                                                                                t["ms"], ceil))
    return [rows[p] for p in providers]


def timed_rounds(calls: dict, timer: Timer, monitor: GpuMonitor | None = None,
                 fast_rounds: int = 0) -> tuple[dict, dict]:
    """Both benchmarks' timed rounds of ``calls`` ({provider: call}): every provider once a round, in
    :func:`round_order` (so a drifting clock touches all of them alike), settled before each of its rounds
    (:meth:`Timer.settle`); ``timer.rounds`` rounds, ``timer.slow_rounds`` where the first round's calls take over
    :data:`SLOW_ROUND_MS` together (three rounds show a drift), at least ``fast_rounds`` where every one of them took
    under :data:`FAST_CALL_MS`. Returns ({provider: ``ms`` (the median of all its timed calls), ``reps``, ``rounds``,
    ``spread_pct`` (the range of its rounds' medians over ``ms``) and, with a ``monitor``, the ``gpu_*`` fields of
    the clock while it was timed}, {provider: (status, reason)} of those that failed while timed: "skipped" when out
    of memory, else "error")."""
    import torch

    ready, samples, windows, failed = dict(calls), {p: [] for p in calls}, {}, {}
    n_rounds, i = timer.rounds, 0
    while i < n_rounds:
        for p in round_order(list(ready), i):
            if p not in ready:
                continue
            try:
                timer.settle(ready[p])
                t0 = time.monotonic()
                samples[p].append(timer.samples(ready[p]))
                windows.setdefault(p, []).append((t0, time.monotonic()))
            except torch.cuda.OutOfMemoryError as e:
                failed[p] = ("skipped", f"out of memory: {first_line(e, 100)}")
                del ready[p]
            except Exception as e:
                failed[p] = ("error", f"{type(e).__name__}: {first_line(e)}")
                del ready[p]
        first = [statistics.median(r[0]) for r in samples.values() if r] if i == 0 else []
        if first and sum(first) > SLOW_ROUND_MS:
            n_rounds = min(timer.rounds, timer.slow_rounds)
        elif first and fast_rounds and max(first) < FAST_CALL_MS:
            n_rounds = max(n_rounds, fast_rounds)
        i += 1
    timed = {}
    for p in ready:
        times = [t for r in samples[p] for t in r]
        ms = statistics.median(times)
        meds = [statistics.median(r) for r in samples[p]]
        clock = monitor.summary(windows.get(p, [])) if monitor is not None else {}
        timed[p] = {"ms": round(ms, 5), "reps": len(times), "rounds": len(meds),
                    "spread_pct": round(100 * (max(meds) - min(meds)) / ms, 2),
                    **{f"gpu_{k}": v for k, v in clock.items()}}
    return timed, failed


def lt_details(c, q, k, v, mask) -> dict:
    """For ``--lt-details``: GPU time per kernel family over one lt call (CUPTI sees cuBLASLt's kernels and ours),
    and each GEMM shape class of the plan with where its algorithm came from."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import attn_lt

    def call():
        return attn_lt.attention(q, k, v, attn_mask=mask, causal=c.causal, backend="lt")

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    fam: dict = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and not e.key.startswith("cuda"):
            name = "softmax" if "softmax" in e.key else "gemm" if any(
                x in e.key.lower() for x in ("gemm", "sm90", "cutlass")) else e.key[:40]
            fam[name] = round(fam.get(name, 0) + t / 1000, 3)
    p = attn_lt.plan(q, k, v, attn_mask=mask, causal=c.causal, backend="lt")
    p.run(q, k, v, mask)
    gemms = [{"gemm": g["example"], "class": g["class"], "shapes": g["gemms"], "algorithm": g["algorithm"]}
             for g in p.explain().gemms[:4]]
    return {"kernels_ms": fam, "gemms": gemms}


def host_cost() -> dict:
    """Host microseconds to issue one cached decode call (B8 Hq32 Hkv8 Sk4096 D128) through ``attention()`` and
    ``plan.run``, and SDPA's default beside them, the GPU kept busy so that only the host is timed."""
    import torch
    import torch.nn.functional as F

    import attn_lt
    from attn_lt import testing

    q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    p = attn_lt.plan(q, k, v, backend="lt").tune(q, k, v)

    return {"attention_us": testing.host_us(lambda: attn_lt.attention(q, k, v, backend="lt")),
            "plan_run_us": testing.host_us(lambda: p.run(q, k, v)),
            "sdpa_default_us": testing.host_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))}


def make_inputs(c):
    """Fresh random inputs for a case (seeded by its name), the same for every provider."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[c.dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(c.name.encode()))

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=gen)

    q, k, v = rnd(c.B, c.Hq, c.Sq, c.D), rnd(c.B, c.Hkv, c.Sk, c.D), rnd(c.B, c.Hkv, c.Sk, c.D)
    return q, k, v, (rnd(c.B, 1, c.Sq, c.Sk) if c.mask else None)


def source_hash() -> str:
    """12 hex digits of sha256 over attn_lt/, native/ and tools/bench*.py: names the code a run measured, also on
    a copy of the tree without (or with a stale) .git. ``python tools/bench.py list`` prints it here."""
    import glob
    import hashlib

    h = hashlib.sha256()
    files = [*glob.glob("attn_lt/**/*.py", root_dir=REPO, recursive=True), *glob.glob("native/*", root_dir=REPO),
             *glob.glob("tools/bench*.py", root_dir=REPO)]
    for rel in sorted(files):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(REPO, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def smi_gpu() -> str | None:
    """The current CUDA device as nvidia-smi names it (its PCI address: nvidia-smi's own indices need not match
    CUDA's under ``CUDA_VISIBLE_DEVICES`` or its ordering), or None where torch does not give the address."""
    import torch

    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except AttributeError:
        return None


def gpu_state() -> str:
    """SM clock, its maximum, power draw and temperature of the current GPU now (clocks move with power and heat on
    these GPUs)."""
    gpu = smi_gpu()
    try:
        return subprocess.run(["nvidia-smi", *(["-i", gpu] if gpu else []),
                               "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip().split("\n")[0] or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: nvidia-smi's clock event reasons (a bitmask) that mean the GPU held its SM clock down while it was busy.
CLOCK_HELD = {0x4: "power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake"}
#: The sample query of :class:`GpuMonitor`.
MONITOR_QUERY = "clocks.sm,clocks.max.sm,power.draw,clocks_throttle_reasons.active"
#: A provider timed at a median SM clock below this share of the GPU's maximum ran on a clock held down.
CLOCK_HELD_BELOW = 0.97


def parse_sample(line: str) -> tuple[float, float, float, int] | None:
    """(SM MHz, its maximum, watts, clock event reasons) of one ``nvidia-smi --format=csv,noheader,nounits`` line of
    :data:`MONITOR_QUERY`; the power is NaN where nvidia-smi has none (``[N/A]``); None for a line that is not a
    sample (a header, an error)."""
    try:
        mhz, top, watts, reasons = (x.strip() for x in line.split(","))
        return float(mhz), float(top), math.nan if watts.startswith("[") else float(watts), int(reasons, 16)
    except ValueError:
        return None


def summarize_samples(samples: list[tuple[float, float, float, int]]) -> dict:
    """What the GPU did while samples ``(SM MHz, max MHz, watts, reasons)`` were taken: the (upper) median and the
    lowest SM clock, the GPU's rated maximum, the highest power (nvidia-smi's, averaged over its own window; absent
    where it gives none), and, when the median clock was below :data:`CLOCK_HELD_BELOW` of the maximum, each reason
    that held it (:data:`CLOCK_HELD`) with the share of samples it was reported in (the power-cap reason is also
    reported at full clock, so alone it means nothing); empty without samples."""
    if not samples:
        return {}
    mhz = sorted(m for m, *_ in samples)
    top = max(t for _, t, _, _ in samples)
    watts = [w for _, _, w, _ in samples if not math.isnan(w)]
    out = {"sm_mhz": mhz[len(mhz) // 2], "sm_mhz_min": mhz[0], "sm_mhz_rated": top,
           "power_w_max": max(watts) if watts else None, "samples": len(samples), "clock_held": ""}
    if out["sm_mhz"] < CLOCK_HELD_BELOW * top:
        shares = {name: sum(1 for *_, r in samples if r & bit) / len(samples) for bit, name in CLOCK_HELD.items()}
        out["clock_held"] = ", ".join(f"{name} {100 * f:.0f} %" for name, f in shares.items() if f > 0) or \
            "no reason given"
    return out


class GpuMonitor:
    """The SM clock, power draw and clock event reasons of the current GPU, sampled by ``nvidia-smi -lms`` in the
    background while a run lasts. Timings on these GPUs move with the clock, and a kernel that holds the GPU at its
    power limit runs at a lower one (H100, MLA decode at 64k keys called back to back: 80 % of the copy rate in its
    first calls, 68-70 % once the 700 W cap holds the SM clock at 1.3-1.6 GHz). :meth:`summary` says what was seen
    between ``time.monotonic()`` readings: samples are stamped when read, a few ms after nvidia-smi took them, and
    its power is its own running average, so a window of a few tens of ms may show a neighbour's power. Where
    nothing can be sampled (no nvidia-smi, no PCI address, a query it refuses), every summary is empty and
    :attr:`problem` says why; with ``enabled`` false (the benchmarks' ``--no-clock``) nothing is started."""

    def __init__(self, interval_ms: int = 20, enabled: bool = True):
        import threading

        self.samples: list[tuple[float, tuple[float, float, float, int]]] = []
        self.problem: str | None = None
        self.enabled = enabled
        self._proc = None
        if not enabled:
            return
        gpu = smi_gpu()
        if gpu is None:
            self.problem = "torch gives no PCI address for the device, so nvidia-smi cannot be pointed at it"
            return
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "-i", gpu, f"--query-gpu={MONITOR_QUERY}",
                                           "--format=csv,noheader,nounits", f"-lms={interval_ms}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as e:
            self.problem = f"nvidia-smi did not start: {e}"
            return
        atexit.register(self.close)  # never leave nvidia-smi sampling after the run, however it ends
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._proc.stdout:
                got = parse_sample(line)
                if got is not None:
                    self.samples.append((time.monotonic(), got))
                elif line.strip() and self.problem is None:  # nvidia-smi's own complaint, kept for the report
                    self.problem = f"nvidia-smi: {line.strip()[:200]}"
        except (OSError, ValueError):  # the pipe closed under the reader
            pass

    def status(self) -> str:
        """A line for the run's metadata: how many samples, or why there are none."""
        if not self.enabled:
            return "off (--no-clock)"
        if self.samples:
            return f"{len(self.samples)} samples"
        return f"no samples: {self.problem or 'nvidia-smi gave none'}"

    def summary(self, windows: list[tuple[float, float]]) -> dict:
        """:func:`summarize_samples` of the samples taken within any of ``windows`` ((start, end) monotonic s)."""
        return summarize_samples([x for t, x in list(self.samples) if any(a <= t <= b for a, b in windows)])

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def metadata(argv) -> dict:
    """Where and with what a run is made: ``attn-lt info``'s environment plus the driver, the GPU's state, the
    versions of the peers and of the tools, and the sources' hash."""
    import torch

    from attn_lt.maintenance import environment

    env = environment()
    versions = {"attn_lt": env["attn_lt"], "torch": env["torch"], "CUDA": env["torch_cuda"],
                "cuDNN": torch.backends.cudnn.version(), "cuBLASLt": env["cublasLt"],
                "nvmath": env.get("nvmath", "unavailable")}
    for name in ("triton", "cupy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = "unavailable"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": env["gpu"], "driver": driver or "unknown", "gpu_state_at_start": gpu_state(),
            "source_sha": source_hash(), "versions": versions, "python": sys.version.split()[0],
            "native_library": env["native_library"], "algo_policy": env["algo_policy"],
            "threshold": env["threshold"], "algo_cache": env["cache"], "dtype": "bf16",
            "command": "python tools/bench.py " + " ".join(shlex.quote(a) for a in argv)}


# ---- commands --------------------------------------------------------------------------------------------------

def _select(a) -> tuple[list, list]:
    groups = [g for g in a.groups.split(",") if g]
    cases = suite.sweep(quick=a.quick, groups=groups, with_masks=not a.no_masks)
    if a.cases:
        wanted = [w for w in a.cases.split(",") if w]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
    providers = [p for p in a.providers.split(",") if p]
    unknown = [p for p in providers if p not in suite.PROVIDERS]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; choose from {', '.join(suite.PROVIDERS)}")
    if not cases:
        raise ValueError("no case matches --groups/--cases")
    return cases, providers


def cmd_list(a) -> int:
    cases, providers = _select(a)
    print(f"{'case':<32} {'shape':<28} {'GFLOP':>10} {'fused MB':>10} {'unfused MB':>11}")
    for c in cases:
        print(f"{c.name:<32} {c.shape:<28} {suite.flops(c) / 1e9:>10.1f} {suite.path_bytes(c, 'fused') / 1e6:>10.1f}"
              f" {suite.path_bytes(c, 'unfused') / 1e6:>11.1f}")
    print(f"{len(cases)} cases x {len(providers)} providers ({', '.join(providers)}); sources {source_hash()}")
    return 0


def cmd_run(a, argv) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench: no CUDA GPU visible, nothing to measure; `python tools/bench.py list` shows the cases",
              file=sys.stderr)
        return 2
    cases, providers = _select(a)
    timer = Timer(a.rep_ms, a.rounds, a.slow_rounds, a.flush, a.settle_ms)  # bad arguments: exit 2 before warm-up
    os.makedirs(a.out, exist_ok=True)
    meta = metadata(argv)
    warm_up(a.warm_up_s)
    meta["ceilings"] = ceil = ceilings()
    meta.update(rep_ms=a.rep_ms, rounds=a.rounds, slow_rounds=a.slow_rounds, warm_up_s=a.warm_up_s,
                check_tol=CHECK_TOL, quick=a.quick, flush=a.flush, settle_ms=a.settle_ms)
    monitor = GpuMonitor(enabled=not a.no_clock)
    rows: list[dict] = []
    bar = suite.Progress(len(cases) * len(providers))
    t0 = time.monotonic()

    def save():
        meta["elapsed_s"] = round(time.monotonic() - t0, 1)
        suite.add_ratios(rows)
        suite.write_json(os.path.join(a.out, "results.json"), meta, rows)
        suite.write_csv(os.path.join(a.out, "results.csv"), rows)
        with open(os.path.join(a.out, "summary.md"), "w") as f:
            f.write(suite.render_markdown(meta, rows))

    for c in cases:
        if a.time_limit_s and time.monotonic() - t0 > a.time_limit_s:
            for p in providers:
                bar.step(f"{c.name} {p}")
                rows.append(suite.row(c, p, "skipped", f"the run's time limit ({a.time_limit_s} s) was reached"))
            continue
        tensors = make_inputs(c)
        ref = reference_rows(c, *tensors)
        case_rows = run_case(c, providers, tensors, ref, timer, ceil, bar, monitor)
        rows += case_rows
        lt = next((r for r in case_rows if r["provider"] == "lt" and r["status"] == "ok"), None)
        if a.lt_details and lt:
            lt["details"] = lt_details(c, *tensors)
        del tensors, ref
        torch.cuda.empty_cache()
        save()
    bar.close()
    monitor.close()
    meta["clock_monitor"] = monitor.status()
    meta["gpu_state_at_end"] = gpu_state()
    if a.lt_details:
        meta["host_cost"] = host_cost()
    save()
    try:
        made = suite.plot(rows, a.out)
    except ImportError as e:
        made = []
        print(f"bench: no plots ({e}); run `python tools/bench.py report {a.out}/results.json` where matplotlib is "
              f"installed", file=sys.stderr)
    print(f"\n{suite.describe(meta)}")
    print(f"files: {', '.join(sorted(os.listdir(a.out)))} in {a.out}" + (" (plots made)" if made else ""))
    print(suite.render_text(rows), end="")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def read_results(path) -> tuple[dict, list[dict]]:
    """``suite.read_json`` with every failure a ValueError that names the file."""
    try:
        meta, rows = suite.read_json(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a results file of this suite (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a results file of this suite (not JSON: {e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it: {e.strerror or e}") from None
    except RecursionError:
        raise ValueError(f"{path}: not a results file of this suite (nested too deeply)") from None
    if not isinstance(meta, dict) or not all(isinstance(r, dict) and {"case", "provider", "status"} <= set(r)
                                             for r in rows):
        raise ValueError(f"{path}: not a results file of this suite (a row lacks case, provider or status)")
    return meta, rows


def cmd_report(a) -> int:
    """summary.md and the plots again from a results file; with --readme, that file's results block too."""
    meta, rows = read_results(a.results)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench report: the plots need matplotlib, which is not installed: pip install matplotlib "
              "(or pip install -e '.[bench]')", file=sys.stderr)
        return 2
    out = a.out or os.path.dirname(os.path.abspath(a.results))
    try:
        summary = suite.render_markdown(meta, rows)
        text_table = suite.render_text(rows)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"{a.results}: not a results file of this suite (a row is incomplete: "
                         f"{type(e).__name__}: {e})") from None
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    made = suite.plot(rows, out)
    if a.readme:
        where = os.path.dirname(os.path.abspath(a.readme))
        images = " ".join(f"![{os.path.basename(p)}]({os.path.relpath(p, where)})" for p in made)
        with open(a.readme) as f:
            text = f.read()
        with open(a.readme, "w") as f:
            f.write(suite.splice(text, images + "\n\n" + summary))
    print(text_table, end="")
    return 0


def cmd_compare(a) -> int:
    (_, ra), (_, rb) = read_results(a.a), read_results(a.b)
    d = suite.compare(ra, rb)
    if not d["n"]:
        print("compare: the two runs share no ratio", file=sys.stderr)
        return 1
    print(f"{d['n']} ratios in both runs: median difference {d['median_pct']}%, max {d['max_pct']}%; "
          f"{d['within_3pct']} within 3%, {d['within_5pct']} within 5%")
    for w in d["worst"]:
        print(f"  {w['case']:<32} {w['ratio']:<18} {w['a']:>8.3f} {w['b']:>8.3f}  {w['diff_pct']:>6.2f}%")
    return 0 if d["max_pct"] <= a.tolerance_pct else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "list"):
        p = sub.add_parser(name)
        p.add_argument("--quick", action="store_true", help="a subset that runs in about a minute and a half")
        p.add_argument("--groups", default=",".join(suite.GROUPS), help="comma-separated: fa3, long, decode")
        p.add_argument("--no-masks", action="store_true", help="leave out the dense-mask variants")
        p.add_argument("--cases", default="", help="only cases whose name contains one of these (comma-separated)")
        p.add_argument("--providers", default=",".join(suite.PROVIDERS), help="comma-separated subset of: "
                       + ", ".join(suite.PROVIDERS))
        if name == "run":
            p.add_argument("--out", default="bench-results", help="output directory (default bench-results)")
            p.add_argument("--rep-ms", type=float, default=150.0, help="timing budget of a provider on a case (ms)")
            p.add_argument("--rounds", type=int, default=7, help="timed rounds a case, every provider in each "
                           "(--slow-rounds where one round takes over a second)")
            p.add_argument("--slow-rounds", type=int, default=3, help="rounds of a case whose first round takes "
                           "over a second (more: finer comparisons of long calls, at their cost)")
            p.add_argument("--warm-up-s", type=float, default=5.0, help="seconds of GEMMs before measuring, "
                           "for the clocks to settle")
            p.add_argument("--lt-details", action="store_true", help="per-kernel GPU time and chosen GEMM "
                           "algorithms of each lt row, and the host cost of a cached GEMM, in results.json")
            p.add_argument("--flush", choices=L2_FLUSHES, default="read", help="how the L2 is emptied before each "
                           f"timed call: by reading a {L2_FLUSH_MIB} MiB buffer (default), or by zeroing it as "
                           "triton's do_bench does, which leaves the L2 full of dirty lines for the call to write back")
            p.add_argument("--time-limit-s", type=float, default=0, help="stop measuring after this long; the "
                           "cases left are recorded as skipped (0: no limit)")
            p.add_argument("--no-clock", action="store_true", help="leave out the SM clock's samples (nvidia-smi "
                           "in the background) beside the timings")
            p.add_argument("--settle-ms", type=float, default=SETTLE_MS, help="untimed calls of a provider before "
                           f"each of its rounds, ms, so that it is timed at its own sustained clock, not at the one "
                           f"the provider before it left (default {SETTLE_MS:g}; 0: none, the protocol before "
                           f"2026-11-24)")
    p = sub.add_parser("report")
    p.add_argument("results")
    p.add_argument("--out", default=None, help="directory for summary.md and the PNGs (default: beside the results)")
    p.add_argument("--readme", default=None, help=f"also replace the block between {suite.README_BEGIN} and "
                   f"{suite.README_END} in this file")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tolerance-pct", type=float, default=5.0, help="largest ratio difference accepted (exit 1)")
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "run":
            return cmd_run(a, argv)
        return {"list": cmd_list, "report": cmd_report, "compare": cmd_compare}[a.cmd](a)
    except (ValueError, OSError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
