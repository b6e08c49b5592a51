#!/usr/bin/env python3
"""The long path at its roofline and where fused kernels cannot go (issue 13): attn_lt's ``lt`` path beside every
SDPA backend that runs the case, on one GPU in one run, with the ceilings measured in the same run.

    python tools/bench_lt.py [--quick] [--out DIR] [--sections overlap,wide,mla_prefill,mla_decode,mass]
                             [--only NAME,...] [--max-seq N] [--workspace-mb N] [--rep-ms 200] [--rounds 5]
                             [--warm-up-s 3] [--settle-ms 100] [--no-profile] [--no-clock] [--time-limit-s N]
                             [--list]

Sections (bf16; ``--quick`` keeps the rows marked *):
  overlap      lt with lanes=1 and =2 (two plans in one process, timed in interleaved rounds): B1 H16
               S16k D128* and B1 H32 S16k D64*, both also causal, and D128 with a (1,1,S,S) additive mask. Median
               ms, TFLOP/s, % of the floor, and where the GPU time goes (torch.profiler, at the end of the run: Q@K^T
               and P@V GEMM kernels, softmax, in all and per chunk, the span of the call and how much of it two
               kernels shared; chunks and lanes from the plan's explain()).
  wide         head dims no fused SDPA kernel runs: B1, H*D = 2048, S16k, D 512* and 1024*; also D 256 (H8) and 192
               (H16, the shape of BENCHMARKS.md; 2048/192 is no whole number): lt vs SDPA cuDNN, flash, efficient,
               math, and lt over the best of them.
  mla_prefill  B1 H128 S8k D_qk 192 D_v 128 causal*: lt, attn_lt's fused path (wmma: the Hopper kernel) and auto
               (what attention() picks) vs SDPA efficient, cuDNN, flash, math.
  mla_decode   B32 Hq128 Hkv1 Sq1 D_qk 576 D_v 512, V = K[..., :512] (a view), Sk 8k*, 16k, 32k, 64k*, and
               Hq 16, 32, 64 at Sk 32k (one GPU's heads under tensor parallelism; no target): lt, the fused MLA
               decode kernel (wmma) and auto: ms, the latent cache read rate (B Sk 576 2 bytes / time) as % of the
               copy rate, TFLOP/s as % of the GEMM rate, and the roofline (the longer of the cache read at the
               copy rate and the FLOPs at the GEMM rate) as % of the time; SDPA backends attempted under a memory
               guard (a provider whose planned memory exceeds the free memory is skipped, and says so).
  mass         the attention mass per key (return_key_mass): B1 H32 S16k D128 with all rows* and the last 64 rows,
               and decode B8 Hq32 Hkv8 Sk32k*: lt without and with the mass (overhead %), beside eager PyTorch
               (softmax(q @ k^T * scale) in FP32, then .sum(-2); chunked over kv heads to fit): time and peak memory.

Protocol (as tools/bench.py): a few seconds of GEMMs first for the clocks; every provider's first calls (lt's
GEMM tuning) and a check of its output against an FP32 reference on sampled rows (the mass against an FP32
reference on sampled heads, and lt's mass against eager's) before any timing — a wrong result is ERR, never a
time; then interleaved rounds (every provider once a round, in ``bench.round_order``; ``--settle-ms`` of its own
untimed calls before each provider's round, so that no provider is timed at the clock a lighter one before it left
headroom for; at least seven rounds where every call takes under 1 ms, at most three where a round takes over a
second), CUDA events, the L2 flushed (256 MiB read, ``bench.Timer``) before each call; ``ms`` is the median
of all timed calls, ``spread_pct`` the range of the rounds' medians over it. ``nvidia-smi`` samples the SM clock,
power and clock event reasons every 20 ms (``bench.GpuMonitor``; ``--no-clock`` leaves it out): each timed
provider's row gets the clock it ran at (``gpu_sm_mhz``, the median, ``gpu_sm_mhz_min``, ``gpu_sm_mhz_rated``,
``gpu_power_w_max``, ``gpu_samples``, ``gpu_clock_held``; none for a provider timed for less than a sample's
interval), the metadata how many samples came (or why none did), and the table names every provider timed at a
median clock below 97 % of the GPU's rated maximum (on the H100, MLA prefill at its power cap: every provider
but lt at 1.62-1.70 GHz of 1.98).

Floor of the long path: max(FLOPs / GEMM rate, (Q, K, V, O and mask bytes + 12 B per score) / copy rate), with the
bf16 GEMM rate (8192^3) and the device-to-device copy rate (bytes read + written) measured at the start of the run;
scores count as in the FLOP convention (B Hq Sq Sk, halved when causal); ``floor_plan_pct`` counts the scores the
plan really computes instead. FLOPs = 2 (D_qk + D_v) per score (4 D when D_v = D).

Writes DIR/lt.json and DIR/summary.md after every row (a run stopped early keeps what it measured) and prints the
table last. Exit codes: 0 ok (targets missed are reported, not failures); 1 a provider failed or gave a wrong
result (ERR); 2 no GPU or bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shlex
import sys
import time
import warnings
import zlib
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from bench import (FAST_CALL_MS, SETTLE_MS, SLOW_ROUND_MS, GpuMonitor, Timer, ceilings, first_line,  # noqa: E402
                   gpu_state, peak_mib, sdpa_reasons, source_hash, timed_rounds, warm_up)
from bench_suite import clock_section, markdown_tables  # noqa: E402
from attn_lt import config  # noqa: E402
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SECTIONS = ("overlap", "wide", "mla_prefill", "mla_decode", "mass")
DTYPE_BYTES = {"bf16": 2, "fp16": 2}
#: HBM bytes a score costs the long path at least: FP32 write 4, softmax read 4, P write 2, P read 2.
SCORE_BYTES = 12
#: Relative L2 error above which a provider's output counts as wrong (bf16 rounding is ~4e-3).
CHECK_TOL = 2e-2
#: Share of the free GPU memory a provider may plan to use (SDPA math, eager PyTorch).
MEMORY_FRACTION = 0.85
#: Bytes a score costs eager PyTorch at its peak: bf16 scores (2) and their FP32 softmax (4) at once.
EAGER_SCORE_BYTES = 6
#: Rounds of a row whose every call takes under ``bench.FAST_CALL_MS`` (``bench.timed_rounds``): three short rounds
#: move with the machine's brief disturbances.
FAST_ROUNDS = 7
SCHEMA = "attn_lt.bench_lt"

#: The issue's targets.
OVERLAP_FLOOR_PCT = 90.0
WIDE_RATIO = 2.5
MLA_PREFILL_RATIO = 1.0
DECODE_CACHE_PCT = 80.0
MASS_OVERHEAD_PCT = 15.0
MASS_DECODE_OVERHEAD_PCT = 5.0

SDPA_PROVIDERS = ("cudnn", "flash", "efficient", "math")


# ---- shapes and formulas (pure) --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One row's attention shape. ``mask``: a dense additive (1, 1, Sq, Sk) mask in the input dtype; ``v_view``: v
    is ``k[..., :Dv]`` (a latent cache); ``window``: the mass section's ``key_mass_window`` (None: every row)."""

    section: str
    name: str
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int = 0
    causal: bool = False
    mask: bool = False
    v_view: bool = False
    window: int | None = None
    dtype: str = "bf16"

    def __post_init__(self):
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)
        if self.section not in SECTIONS or self.dtype not in DTYPE_BYTES:
            raise ValueError(f"section must be one of {SECTIONS} and dtype one of {tuple(DTYPE_BYTES)}: {self}")
        if min(self.B, self.Hq, self.Hkv, self.Sq, self.Sk, self.D, self.Dv) < 1 or self.Hq % self.Hkv:
            raise ValueError(f"sizes must be positive and Hq a multiple of Hkv: {self}")
        if self.v_view and self.Dv > self.D:
            raise ValueError(f"v = k[..., :Dv] needs Dv <= D: {self}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be positive or None: {self}")

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv

    @property
    def desc(self) -> str:
        kv = f"/{self.Hkv}" if self.Hkv != self.Hq else ""
        s = f"S{self.Sk}" if self.Sq == self.Sk else f"Sq{self.Sq} Sk{self.Sk}"
        d = f"D{self.D}" if self.Dv == self.D else f"Dqk{self.D} Dv{self.Dv}"
        extra = (" causal" if self.causal else "") + (" mask" if self.mask else "")
        extra += f" V=K[..,:{self.Dv}]" if self.v_view else ""
        extra += f" W{self.window}" if self.window is not None else ""
        return f"B{self.B} H{self.Hq}{kv} {s} {d}{extra}"


def scores(s: Shape) -> float:
    """Score elements by the FLOP convention: B Hq Sq Sk, halved when causal."""
    return float(s.B * s.Hq * s.Sq * s.Sk) * (0.5 if s.causal else 1.0)


def flops(s: Shape) -> float:
    """Forward FLOPs: 2 D_qk for Q K^T and 2 D_v for P V per score (4 D B Hq Sq Sk when D_v = D; causal halved)."""
    return 2.0 * (s.D + s.Dv) * scores(s)


def io_bytes(s: Shape) -> int:
    """Bytes any path moves at least: Q and O, K and V (K alone when V is a view of it), the mask once."""
    e = DTYPE_BYTES[s.dtype]
    kv = s.D if s.v_view else s.D + s.Dv
    return e * (s.B * s.Hq * s.Sq * (s.D + s.Dv) + s.B * s.Hkv * s.Sk * kv + (s.Sq * s.Sk if s.mask else 0))


def lt_bytes(s: Shape, n_scores: float | None = None) -> float:
    """The long path's HBM floor: :func:`io_bytes` plus 12 bytes a score (``n_scores``: a plan's computed count)."""
    return io_bytes(s) + SCORE_BYTES * (scores(s) if n_scores is None else n_scores)


def roofline_ms(flop: float, nbytes: float, gemm_tflops: float, copy_tbs: float) -> float:
    """``flop`` at the GEMM rate or ``nbytes`` at the copy rate, whichever takes longer (ms)."""
    if gemm_tflops <= 0 or copy_tbs <= 0:
        raise ValueError(f"ceilings must be positive, got {gemm_tflops} TFLOP/s and {copy_tbs} TB/s")
    return max(flop / (gemm_tflops * 1e9), nbytes / (copy_tbs * 1e9))


def floor_ms(s: Shape, gemm_tflops: float, copy_tbs: float, n_scores: float | None = None) -> float:
    """The long path's floor time: its FLOPs at the GEMM rate or its bytes at the copy rate, whichever is longer."""
    return roofline_ms(flops(s), lt_bytes(s, n_scores), gemm_tflops, copy_tbs)


def cache_bytes(s: Shape) -> int:
    """Bytes of the KV cache a decode step must read once: K (the latent cache when V is a view of it) and V."""
    kv = s.D if s.v_view else s.D + s.Dv
    return DTYPE_BYTES[s.dtype] * s.B * s.Hkv * s.Sk * kv


def decode_roofline_ms(s: Shape, gemm_tflops: float, copy_tbs: float) -> float:
    """Any decode kernel's floor: the cache read once at the copy rate or the FLOPs at the GEMM rate, whichever is
    longer. MLA decode with 128 query heads a latent head (279 kFLOP a 1152-byte key) is bound by its FLOPs
    wherever the GEMM rate is below 242 times the copy rate."""
    return roofline_ms(flops(s), cache_bytes(s), gemm_tflops, copy_tbs)


def math_bytes(s: Shape) -> float:
    """What SDPA's math backend allocates at once, about: q, k, v upcast to FP32 with K and V repeated over the query
    heads, FP32 scores, their softmax and its FP32 output (12 bytes a score, every score: math masks, it does not
    skip), the output."""
    full = float(s.B * s.Hq * s.Sq * s.Sk)
    upcast = 4.0 * s.B * s.Hq * (s.Sq * s.D + s.Sk * (s.D + s.Dv) + s.Sq * s.Dv)
    return upcast + 12.0 * full + (s.Sq * s.Sk if (s.causal or s.mask) else 0)


def eager_rows(s: Shape) -> int:
    """Query rows the eager mass computes per head: the window's, or all."""
    return s.Sq if s.window is None else min(s.window, s.Sq)


def eager_bytes_per_kv_head(s: Shape) -> float:
    """Peak bytes of eager PyTorch's mass for one kv head (its group of query heads) over the batch."""
    return float(EAGER_SCORE_BYTES * s.B * s.group * eager_rows(s) * s.Sk)


def eager_kv_per_chunk(s: Shape, free_bytes: float) -> int | None:
    """kv heads per chunk that fit ``MEMORY_FRACTION`` of ``free_bytes``, or None when not even one fits."""
    per = eager_bytes_per_kv_head(s)
    n = int(MEMORY_FRACTION * free_bytes // per) if per else s.Hkv
    return min(s.Hkv, n) if n >= 1 else None


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def cases(quick: bool = False) -> list[Shape]:
    """Every row of a run, in order; ``quick`` keeps the issue's target rows (about a minute and a half)."""
    S = 16384
    out = []
    for D, H in ((128, 16), (64, 32)):
        out.append(Shape("overlap", f"overlap-d{D}", 1, H, H, S, S, D))
    if not quick:
        for D, H in ((128, 16), (64, 32)):
            out.append(Shape("overlap", f"overlap-d{D}-causal", 1, H, H, S, S, D, causal=True))
        out.append(Shape("overlap", "overlap-d128-mask", 1, 16, 16, S, S, 128, mask=True))
    for D in ((512, 1024) if quick else (192, 256, 512, 1024)):
        H = 16 if D == 192 else 2048 // D
        out.append(Shape("wide", f"wide-d{D}", 1, H, H, S, S, D))
    out.append(Shape("mla_prefill", "mla-prefill", 1, 128, 128, 8192, 8192, 192, 128, causal=True))
    for Sk in ((8192, 65536) if quick else (8192, 16384, 32768, 65536)):
        out.append(Shape("mla_decode", f"mla-decode-sk{_k(Sk)}", 32, 128, 1, 1, Sk, 576, 512, v_view=True))
    if not quick:  # the query heads of one GPU under tensor parallelism over 8, 4 and 2 GPUs (no target)
        for Hq in (16, 32, 64):
            out.append(Shape("mla_decode", f"mla-decode-hq{Hq}-sk32k", 32, Hq, 1, 1, 32768, 576, 512, v_view=True))
    out.append(Shape("mass", "mass-s16k", 1, 32, 32, S, S, 128))
    if not quick:
        out.append(Shape("mass", "mass-s16k-w64", 1, 32, 32, S, S, 128, window=64))
    out.append(Shape("mass", "mass-decode-sk32k", 8, 32, 8, 1, 32768, 128))
    return out


def select(all_cases: list[Shape], sections=SECTIONS, only=(), max_seq: int = 0) -> list[Shape]:
    """The rows of ``sections`` whose name is one of ``only`` or contains it (all when empty), their lengths capped
    at ``max_seq`` (0: no cap; decode keeps Sq = 1), rows that the cap makes equal kept once."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if max_seq < 0:
        raise ValueError(f"--max-seq must be >= 0, got {max_seq}")
    chosen, seen = [], set()
    for c in all_cases:
        if c.section not in sections:
            continue
        if only and not any(w == c.name or w in c.name for w in only):
            continue
        if max_seq:
            fields = asdict(c)
            fields.update(Sq=min(c.Sq, max_seq), Sk=min(c.Sk, max_seq))
            c = Shape(**fields)
        key = (c.section, c.desc)
        if key not in seen:
            seen.add(key)
            chosen.append(c)
    if not chosen:
        raise ValueError("no row matches --sections/--only")
    return chosen


# ---- rows and what is derived from them (pure) -----------------------------------------------------------------

def row(s: Shape, provider: str, status: str, reason: str = "", **values) -> dict:
    if status not in ("ok", "n/a", "skipped", "error"):
        raise ValueError(f"unknown status {status!r}")
    return {"section": s.section, "case": s.name, "shape": s.desc, "provider": provider, "status": status,
            "reason": reason, **values}


def metrics(s: Shape, provider: str, ms: float, ceil: dict, info: dict | None = None) -> dict:
    """TFLOP/s at ``ms``; for attn_lt rows the floor (ms, TFLOP/s, % reached; ``floor_plan_pct`` with the plan's
    computed scores); for decode rows the cache read rate and its share of the copy rate."""
    info = info or {}
    m = {"tflops": round(flops(s) / ms / 1e9, 2)}
    if provider.startswith("lt"):
        f = floor_ms(s, ceil["gemm_tflops"], ceil["copy_tbs"])
        m.update(floor_ms=round(f, 4), floor_tflops=round(flops(s) / f / 1e9, 1), floor_pct=round(100 * f / ms, 1))
        if info.get("computed_scores"):
            fp = floor_ms(s, ceil["gemm_tflops"], ceil["copy_tbs"], info["computed_scores"])
            m["floor_plan_pct"] = round(100 * fp / ms, 1)
    if s.section == "mla_decode":
        tbs = cache_bytes(s) / ms / 1e9
        roof = decode_roofline_ms(s, ceil["gemm_tflops"], ceil["copy_tbs"])
        m.update(cache_tbs=round(tbs, 3), cache_pct_copy=round(100 * tbs / ceil["copy_tbs"], 1),
                 gemm_pct=round(100 * m["tflops"] / ceil["gemm_tflops"], 1), roofline_pct=round(100 * roof / ms, 1))
    return m


def _ok(rows, case, provider):
    return next((r for r in rows if r["case"] == case and r["provider"] == provider and r["status"] == "ok"), None)


def best_sdpa(rows: list[dict], case: str) -> dict | None:
    ok = [r for r in rows if r["case"] == case and r["status"] == "ok" and r["provider"] in SDPA_PROVIDERS]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def derive(rows: list[dict]) -> list[dict]:
    """Ratios between the rows of one case, set in place: overlap ``gain`` (1 lane's time over 2 lanes'); wide and
    MLA ``vs_best_sdpa`` (the fastest SDPA backend's time over lt's) and ``best_sdpa``; MLA prefill
    ``vs_efficient``; mass ``overhead_pct`` (lt with the mass over lt without, minus 1) and eager's ``vs_lt_mass``."""
    for r in rows:
        if r["status"] != "ok":
            continue
        c = r["case"]
        if r["section"] == "overlap" and r["provider"] == "lt-lanes2":
            one = _ok(rows, c, "lt-lanes1")
            if one:
                r["gain"] = round(one["ms"] / r["ms"], 3)
        elif r["section"] in ("wide", "mla_prefill", "mla_decode") and r["provider"] in ("lt", "wmma", "auto"):
            b = best_sdpa(rows, c)
            if b:
                r["vs_best_sdpa"], r["best_sdpa"] = round(b["ms"] / r["ms"], 3), b["provider"]
            for sd in ("efficient", "cudnn"):
                other = _ok(rows, c, sd)
                if r["section"] == "mla_prefill" and other:
                    r[f"vs_{sd}"] = round(other["ms"] / r["ms"], 3)
        elif r["section"] == "mass" and r["provider"] == "lt+mass":
            plain = _ok(rows, c, "lt")
            if plain:
                r["overhead_pct"] = round(100 * (r["ms"] / plain["ms"] - 1), 1)
        elif r["section"] == "mass" and r["provider"] == "eager":
            lm = _ok(rows, c, "lt+mass")
            if lm:
                r["vs_lt_mass"] = round(r["ms"] / lm["ms"], 3)
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets that this run measured: {"target", "value", "unit", "goal", "met", "note"}."""
    out = []

    def add(r, what, value, unit, op, goal, note=""):
        met = value is None or (value >= goal if op == ">=" else value <= goal)
        out.append({"target": f"{r['case']} ({r['shape']}): {what}", "value": value, "unit": unit,
                    "goal": f"{op} {goal:g}{unit}", "met": met, "note": note})

    for r in rows:
        if r["status"] != "ok":
            continue
        sec, p, c = r["section"], r["provider"], r["case"]
        if sec == "overlap" and p == "lt-lanes2" and c in ("overlap-d128", "overlap-d64"):
            add(r, "lt, % of the floor", r["floor_pct"], " %", ">=", OVERLAP_FLOOR_PCT)
        elif sec == "wide" and p == "lt" and c in ("wide-d512", "wide-d1024"):
            x = r.get("vs_best_sdpa")
            add(r, "lt over the best SDPA backend", x, "x", ">=", WIDE_RATIO,
                "" if x is not None else "no SDPA backend ran the case")
        elif sec == "mla_prefill" and p in ("lt", "auto") and r.get("vs_efficient") is not None:
            add(r, f"{'attention() (auto: ' + r.get('backend', '?') + ')' if p == 'auto' else 'lt'} over SDPA "
                "efficient", r["vs_efficient"], "x", ">=", MLA_PREFILL_RATIO)
        elif sec == "mla_decode" and p in ("lt", "auto") and c.startswith("mla-decode-sk"):  # the Hq 128
            who = f"attention() (auto: {r.get('backend', '?')})" if p == "auto" else "lt"
            add(r, f"{who}: latent cache read, % of the copy rate", r["cache_pct_copy"], " %", ">=",
                DECODE_CACHE_PCT)
        elif sec == "mass" and p == "lt+mass" and r.get("overhead_pct") is not None:
            goal = MASS_DECODE_OVERHEAD_PCT if "decode" in c else MASS_OVERHEAD_PCT
            add(r, "overhead of the mass", r["overhead_pct"], " %", "<=", goal)
    return out


# ---- writers (pure) --------------------------------------------------------------------------------------------

def _f(x, fmt="{:.1f}") -> str:
    return "" if x is None else fmt.format(x)


def _cell(r: dict | None, key: str = "tflops", fmt: str = "{:.1f}") -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return {"n/a": "n/a", "skipped": "skip", "error": "ERR"}[r["status"]]
    return _f(r.get(key), fmt)


def _kernels(r: dict | None) -> str:
    """'gemm G + softmax S in span T ms' from a row's profile."""
    p = (r or {}).get("profile") or {}
    if not p or "span_ms" not in p:
        return ""
    fam = p.get("kernels_ms", {})
    return f"{fam.get('gemm', 0):.1f}+{fam.get('softmax', 0):.1f} in {p['span_ms']:.1f}"


def _cases(rows, section):
    seen = {}
    for r in rows:
        if r["section"] == section:
            seen.setdefault(r["case"], r["shape"])
    return list(seen.items())


def table(rows: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """One (title, header, lines) per section that has rows."""
    out = []
    by = {(r["case"], r["provider"]): r for r in rows}
    cs = _cases(rows, "overlap")
    if cs:
        header = ["case", "shape", "chunks", "1 lane ms", "TFLOP/s", "% floor", "2 lanes ms", "TFLOP/s", "% floor",
                  "gain", "floor TFLOP/s", "gemm+softmax in span ms (1 lane)", "(2 lanes)"]
        lines = []
        for c, shape in cs:
            a, b = by.get((c, "lt-lanes1")), by.get((c, "lt-lanes2"))
            chunks = "/".join(f"{x['chunks']}x{x['lanes']}" for x in (a, b) if x and x.get("chunks") is not None)
            fl = next((x.get("floor_tflops") for x in (b, a) if x and x.get("floor_tflops")), None)
            lines.append([c, shape, chunks, _cell(a, "ms", "{:.2f}"), _cell(a), _cell(a, "floor_pct"),
                          _cell(b, "ms", "{:.2f}"), _cell(b), _cell(b, "floor_pct"),
                          _f((b or {}).get("gain"), "{:.2f}x"), _f(fl), _kernels(a), _kernels(b)])
        out.append(("overlap: attn_lt lt, lanes=1 vs 2 (chunks x lanes; % of the floor from this run's "
                    "GEMM and copy rates)", header, lines))
    for section, title in (("wide", "wide heads: TFLOP/s"), ("mla_prefill", "MLA prefill: TFLOP/s")):
        cs = _cases(rows, section)
        if not cs:
            continue
        fused = ("wmma", "auto") if section == "mla_prefill" else ()
        header = ["case", "shape", "lt", "% floor"] + list(fused) + list(SDPA_PROVIDERS) + ["lt/best SDPA"]
        header += ["auto/best SDPA"] if fused else []
        lines = []
        for c, shape in cs:
            lt, auto = by.get((c, "lt")), by.get((c, "auto"))
            x = (lt or {}).get("vs_best_sdpa")
            line = [c, shape, _cell(lt), _cell(lt, "floor_pct")] + [_cell(by.get((c, p))) for p in fused]
            line += [_cell(by.get((c, p))) for p in SDPA_PROVIDERS] + [f"{x:.2f}x ({lt['best_sdpa']})" if x else ""]
            if fused:
                xa = (auto or {}).get("vs_best_sdpa")
                line.append(f"{xa:.2f}x ({auto['best_sdpa']}; ran {auto.get('backend', '?')})" if xa else "")
            lines.append(line)
        out.append((title, header, lines))
    cs = _cases(rows, "mla_decode")
    if cs:
        header = ["case", "shape", "lt ms", "% copy", "% lt floor", "wmma ms", "auto ms", "auto TB/s",
                  "auto % copy", "auto % GEMM", "auto % roofline"] + list(SDPA_PROVIDERS) + ["default"]
        lines = []
        for c, shape in cs:
            lt, wm, auto = by.get((c, "lt")), by.get((c, "wmma")), by.get((c, "auto"))
            lines.append([c, shape, _cell(lt, "ms", "{:.3f}"), _cell(lt, "cache_pct_copy"), _cell(lt, "floor_pct"),
                          _cell(wm, "ms", "{:.3f}"), _cell(auto, "ms", "{:.3f}"), _cell(auto, "cache_tbs", "{:.2f}"),
                          _cell(auto, "cache_pct_copy"), _cell(auto, "gemm_pct"), _cell(auto, "roofline_pct")]
                         + [_cell(by.get((c, p)), "ms", "{:.3f}") for p in SDPA_PROVIDERS + ("default",)])
        out.append(("MLA decode: ms, latent cache read (B Sk 576 2 B / time) as % of the copy rate, TFLOP/s as % of "
                    "the GEMM rate, and the roofline (the longer of the two at those rates) as % of the time; SDPA ms",
                    header, lines))
    cs = _cases(rows, "mass")
    if cs:
        header = ["case", "shape", "lt ms", "+mass ms", "overhead", "eager ms", "eager chunks", "peak MiB lt",
                  "+mass", "eager", "mass err vs eager"]
        lines = []
        for c, shape in cs:
            lt, lm, ea = by.get((c, "lt")), by.get((c, "lt+mass")), by.get((c, "eager"))
            lines.append([c, shape, _cell(lt, "ms", "{:.2f}"), _cell(lm, "ms", "{:.2f}"),
                          _f((lm or {}).get("overhead_pct"), "{:+.1f} %"), _cell(ea, "ms", "{:.2f}"),
                          _f((ea or {}).get("chunks"), "{}"), _cell(lt, "peak_mib", "{:.0f}"),
                          _cell(lm, "peak_mib", "{:.0f}"), _cell(ea, "peak_mib", "{:.0f}"),
                          _f((lm or {}).get("mass_vs_eager"), "{:.1e}")])
        out.append(("attention mass per key: lt without / with return_key_mass, eager PyTorch", header, lines))
    return out


def not_run(rows: list[dict]) -> list[str]:
    seen: dict = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["provider"], r["status"], r["reason"]), []).append(r["case"])
    return [f"{p} {st}: {why} [{', '.join(cs)}]" for (p, st, why), cs in seen.items()]


def describe(meta: dict) -> str:
    v = meta.get("versions", {})
    ceil = meta.get("ceilings", {})
    parts = [f"{meta.get('date', '?')}, {meta.get('gpu', '?')} (driver {meta.get('driver', '?')})"]
    if v:
        parts.append(", ".join(f"{k} {x}" for k, x in v.items()))
    parts.append(f"measured in this run: bf16 GEMM 8192^3 {ceil.get('gemm_tflops', '?')} TFLOP/s, "
                 f"device-to-device copy {ceil.get('copy_tbs', '?')} TB/s (read + write)")
    parts.append(f"command: `{meta.get('command', '?')}`")
    if meta.get("elapsed_s") is not None:
        parts.append(f"run time {meta['elapsed_s']:.0f} s")
    return "; ".join(parts) + "."


def _target_lines(rows) -> list[str]:
    return [f"{'met' if t['met'] else 'MISSED'}: {t['target']} = "
            f"{'-' if t['value'] is None else t['value']}{t['unit']} (goal {t['goal']})"
            + (f"; {t['note']}" if t["note"] else "") for t in targets(rows)]


def render_text(meta: dict, rows: list[dict]) -> str:
    buf = io.StringIO()
    buf.write(describe(meta) + "\n")
    for title, header, lines in table(rows):
        widths = [max(len(x) for x in col) for col in zip(header, *lines)]
        buf.write(f"\n{title}\n")
        for ln in [header] + lines:
            buf.write("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(ln, widths)))
                      .rstrip() + "\n")
    t = _target_lines(rows)
    if t:
        buf.write("\ntargets:\n" + "".join(f"  {x}\n" for x in t))
    buf.write(clock_section(rows, markdown=False))
    why = not_run(rows)
    if why:
        buf.write("\nnot run:\n" + "".join(f"  {x}\n" for x in why))
    return buf.getvalue()


def render_markdown(meta: dict, rows: list[dict]) -> str:
    buf = io.StringIO()
    buf.write(describe(meta) + "\n")
    markdown_tables(buf, table(rows))
    t = _target_lines(rows)
    if t:
        buf.write("\nTargets:\n\n" + "".join(f"- {x}\n" for x in t))
    buf.write(clock_section(rows, markdown=True))
    why = not_run(rows)
    if why:
        buf.write("\nNot run (provider, status: reason [cases]):\n\n" + "".join(f"- {x}\n" for x in why))
    return buf.getvalue()


def write_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    """DIR/lt.json ({"schema", "version", "meta", "rows", "targets"}, a row a line) and DIR/summary.md."""
    derive(rows)
    with open(os.path.join(out_dir, "lt.json"), "w") as f:
        f.write(json.dumps({"schema": SCHEMA, "version": 1})[:-1] + ',\n"meta": ' + json.dumps(meta)
                + ',\n"rows": [\n' + ",\n".join(json.dumps(r) for r in rows) + '\n],\n"targets": '
                + json.dumps(targets(rows)) + "}\n")
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(render_markdown(meta, rows))


def read_results(path) -> tuple[dict, list[dict]]:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a results file of tools/bench_lt.py")
    return doc.get("meta", {}), doc["rows"]


# ---- profiles (pure part) ---------------------------------------------------------------------------------------

_GEMM_HINTS = ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "ampere", "hopper", "cublas", "scores_sm90")


def kernel_family(name: str) -> str:
    n = name.lower()
    if "softmax" in n:
        return "softmax"
    if "merge" in n:  # the key tiles' LSE merge (and the fused kernel's split merge)
        return "merge"
    if n.startswith(("memset", "memcpy")):
        return "memory"
    if any(h in n for h in _GEMM_HINTS):
        return "gemm"
    return "other"


def summarize_kernels(events, chunks: int | None = None) -> dict:
    """Where one call's GPU time goes, from its kernels ``(name, stream, start_us, end_us)``: ms per family
    (gemm, softmax, memory, other), Q@K^T and P@V apart when every stream's GEMM kernels pair with its softmaxes
    (qk before, pv after), the span (first start to last end), the busy time (sum of kernels), the overlap
    (busy - span: time two kernels ran at once), streams, and per chunk when ``chunks`` is given."""
    events = sorted(events, key=lambda e: e[2])
    if not events:
        return {}
    fam: dict = {}
    per_stream: dict = {}
    for name, stream, t0, t1 in events:
        f = kernel_family(name)
        fam[f] = fam.get(f, 0.0) + (t1 - t0) / 1000
        per_stream.setdefault(stream, []).append((f, t1 - t0))
    span = (max(e[3] for e in events) - events[0][2]) / 1000
    busy = sum(fam.values())
    out = {"kernels_ms": {k: round(v, 3) for k, v in sorted(fam.items())}, "span_ms": round(span, 3),
           "busy_ms": round(busy, 3), "overlap_ms": round(busy - span, 3), "streams": len(per_stream),
           "kernels": len(events)}
    qk = pv = 0.0
    paired = True
    for ks in per_stream.values():
        gemms = [d for f, d in ks if f == "gemm"]
        n_soft = sum(1 for f, _ in ks if f == "softmax")
        if len(gemms) != 2 * n_soft:
            paired = False
            break
        qk += sum(gemms[0::2]) / 1000
        pv += sum(gemms[1::2]) / 1000
    if paired:
        out["qk_ms"], out["pv_ms"] = round(qk, 3), round(pv, 3)
    if chunks:
        out["per_chunk_ms"] = {k: round(v / chunks, 4) for k, v in
                               (("gemm", fam.get("gemm", 0.0)), ("softmax", fam.get("softmax", 0.0)))}
        if paired:
            out["per_chunk_ms"].update(qk=round(qk / chunks, 4), pv=round(pv / chunks, 4))
    return out


# ---- references (torch; CPU or GPU) ----------------------------------------------------------------------------

def ref_rows(q, k, v, rows, causal=False, mask=None, scale=None, batches=None):
    """FP32 attention output on query ``rows`` of ``batches`` (all when None): (len(batches), Hq, len(rows), Dv).
    The query heads of a kv head are computed together, so that K and V are converted once per kv head."""
    import torch

    from attn_lt.testing import causal_mask

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    batches = list(range(B)) if batches is None else list(batches)
    r = len(rows)
    out = torch.empty(len(batches), Hq, r, v.shape[-1], dtype=torch.float32, device=q.device)
    cm = causal_mask(Sq, Sk, q.device)[rows] if causal else None
    m = None if mask is None else mask.expand(B, Hq, Sq, Sk)
    for i, b in enumerate(batches):
        for h in range(Hkv):
            heads = slice(h * g, (h + 1) * g)
            s = (q[b, heads][:, rows].float().reshape(g * r, D) @ k[b, h].float().T).view(g, r, Sk) * scale
            if m is not None:
                mb = m[b, heads][:, rows]
                s = s.masked_fill(~mb, -math.inf) if mb.dtype == torch.bool else s + mb.float()
            if cm is not None:
                s = s.masked_fill(~cm, -math.inf)
            lse = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
            out[i, heads] = (p.reshape(g * r, Sk) @ v[b, h].float()).view(g, r, -1)
    return out


def ref_mass(q, k, pairs, window=None, scale=None, block=4096):
    """FP32 attention mass per key, (len(pairs), Sk), of the (batch, query head) ``pairs``: the sum over the query
    rows (the last ``window``) of softmax(scale q k^T), computed in row blocks."""
    import torch

    B, Hq, Sq, D = q.shape
    g = Hq // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    first = 0 if window is None else max(0, Sq - window)
    out = torch.zeros(len(pairs), k.shape[2], dtype=torch.float32, device=q.device)
    for i, (b, h) in enumerate(pairs):
        kf = k[b, h // g].float()
        for r0 in range(first, Sq, block):
            s = q[b, h, r0:min(Sq, r0 + block)].float() @ kf.T * scale
            out[i] += torch.softmax(s, dim=-1).sum(0)
    return out


def eager_mass(q, k, window=None, kv_per_chunk=None, scale=None):
    """What users of score-based KV-cache compression run today: ``softmax(q @ k^T * scale)`` in FP32, then the
    sum over the query rows (the last ``window``), (B, Hq, Sk) FP32; the query heads of a kv head folded into the
    rows (no K copy), ``kv_per_chunk`` kv heads at a time so that the scores fit."""
    import torch

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qs = q if window is None else q[:, :, max(0, Sq - window):]
    r = qs.shape[2]
    n = Hkv if kv_per_chunk is None else kv_per_chunk
    out = torch.empty(B, Hq, Sk, dtype=torch.float32, device=q.device)
    for h0 in range(0, Hkv, n):
        h1 = min(Hkv, h0 + n)
        qg = qs[:, h0 * g:h1 * g].reshape(B, h1 - h0, g * r, D)
        p = torch.softmax(qg @ k[:, h0:h1].transpose(-1, -2) * scale, dim=-1, dtype=torch.float32)
        out[:, h0 * g:h1 * g] = p.view(B, h1 - h0, g, r, Sk).sum(-2).view(B, (h1 - h0) * g, Sk)
        del p
    return out


# ---- measuring (GPU) --------------------------------------------------------------------------------------------

class Unavailable(Exception):
    """The provider cannot run the case (n/a)."""


class Skipped(Exception):
    """A guard kept the provider from running (skipped)."""


@dataclass
class Spec:
    """One provider of one row: ``make()`` -> (call, info) (raises Unavailable / Skipped); ``check(result)`` -> the
    relative error of a call's result; ``need()`` -> extra bytes it plans to hold (guarded against free memory)."""

    provider: str
    family: str  # "lt", "sdpa", "eager"
    make: object
    check: object
    need: object = None
    need_what: str = ""


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def first_call(s: Shape, sp: Spec):
    """A provider's first calls: the memory guard, ``make`` (lt: plan and tune), a call whose result is checked, a
    second call whose peak memory is taken. (fn, rel_err, peak MiB, info) when it ran right, else its final row."""
    import torch

    try:
        if sp.need is not None:
            need, free = sp.need(), free_bytes()
            if need > MEMORY_FRACTION * free:
                return row(s, sp.provider, "skipped", f"needs about {_gib(need)} at once ({sp.need_what}); "
                                                      f"{_gib(free)} free")
        fn, info = sp.make()
    except Unavailable as e:
        return row(s, sp.provider, "n/a", first_line(e, 300))
    except Skipped as e:
        return row(s, sp.provider, "skipped", first_line(e, 300))
    except torch.cuda.OutOfMemoryError as e:
        return row(s, sp.provider, "skipped", f"out of memory: {first_line(e, 120)}")
    except Exception as e:
        return row(s, sp.provider, "error", f"{type(e).__name__}: {first_line(e)}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                res = fn()
                torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:
                if sp.family != "sdpa":
                    raise
                return row(s, sp.provider, "n/a", sdpa_reasons(caught, e))
        err = sp.check(res)
        del res
        _, peak = peak_mib(fn)
    except torch.cuda.OutOfMemoryError as e:
        return row(s, sp.provider, "skipped", f"out of memory: {first_line(e, 120)}")
    except Exception as e:
        return row(s, sp.provider, "error", f"{type(e).__name__}: {first_line(e)}")
    finally:
        torch.cuda.empty_cache()
    if not err <= CHECK_TOL:
        return row(s, sp.provider, "error", f"wrong result: relative error {err:.3g} (bound {CHECK_TOL})",
                   rel_err=err if math.isfinite(err) else None)
    return fn, err, peak, info


def run_row(s: Shape, specs: list[Spec], timer: Timer, ceil: dict, log,
            monitor: GpuMonitor | None = None) -> tuple[list[dict], dict]:
    """Every provider of a row: first calls, then interleaved timed rounds. Returns (rows, {provider: fn} of those
    that ran). With a ``monitor``, each row also says what the GPU's clock did while that provider was timed."""
    rows, ready = {}, {}
    for sp in specs:
        log(f"{s.name}: {sp.provider}")
        got = first_call(s, sp)
        if isinstance(got, dict):
            rows[sp.provider] = got
        else:
            ready[sp.provider] = got
    timed, failed = timed_rounds({p: got[0] for p, got in ready.items()}, timer, monitor, FAST_ROUNDS)
    for p, (status, reason) in failed.items():
        rows[p] = row(s, p, status, reason)
        del ready[p]
    for p, t in timed.items():
        fn, err, peak, info = ready[p]
        rows[p] = row(s, p, "ok", rel_err=float(f"{err:.3g}"), peak_mib=round(peak, 1), **t,
                      **metrics(s, p, t["ms"], ceil, info), **{k: v for k, v in info.items() if k != "computed_scores"})
    return [rows[sp.provider] for sp in specs], {p: v[0] for p, v in ready.items()}


def profile_call(fn, chunks: int | None) -> dict:
    """Per-kernel GPU time of one call (torch.profiler; CUPTI sees cuBLASLt's kernels and ours)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = []
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        stream = getattr(e, "device_resource_id", None)
        ev.append((e.name, e.thread if stream is None else stream, e.time_range.start, e.time_range.end))
    return summarize_kernels(ev, chunks)


@contextlib.contextmanager
def lanes_env(lanes: int | None):
    """The long path's ``lanes`` option set (None: the default) while the block runs: plans made in it use it."""
    with config.override(**({} if lanes is None else {"lanes": lanes})):
        yield


def plan_info(p) -> dict:
    """Chunks (computed ones), lanes, the scores they compute and the plan's summary, from ``explain()``."""
    e = p.explain()
    pl = e.plan
    return {"chunks": pl.computed_chunks, "lanes": pl.lanes, "key_tile": pl.key_tile,
            "computed_scores": float(sum(n * c.ne * pl.rows(c) * c.keys for c, n in pl.shapes().values())),
            "plan": pl.summary()}


# ---- the sections' providers (GPU) ------------------------------------------------------------------------------

def make_inputs(s: Shape):
    """(q, k, v, mask) with fresh random data seeded by the row's name; v a view of k when ``v_view``."""
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[s.dtype]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(s.name.encode()))

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=gen)

    q, k = rnd(s.B, s.Hq, s.Sq, s.D), rnd(s.B, s.Hkv, s.Sk, s.D)
    v = k[..., :s.Dv] if s.v_view else rnd(s.B, s.Hkv, s.Sk, s.Dv)
    return q, k, v, (rnd(1, 1, s.Sq, s.Sk) if s.mask else None)


def sample_rows(s: Shape, n: int = 16):
    import torch

    return torch.unique(torch.linspace(0, s.Sq - 1, min(s.Sq, n), device="cuda").round().long())


def sample_batches(s: Shape) -> list[int]:
    return sorted({0, s.B // 2, s.B - 1})


def out_checker(s: Shape, q, k, v, mask):
    """check(result) for outputs: the relative error on sampled rows and batches against the FP32 reference."""
    from attn_lt.testing import rel_error

    rows, batches = sample_rows(s), sample_batches(s)
    ref = ref_rows(q, k, v, rows, s.causal, mask, batches=batches)

    def check(out):
        out = out[0] if isinstance(out, tuple) else out
        return rel_error(out[batches][:, :, rows], ref)
    return check


def lt_spec(provider, s, q, k, v, mask, check, workspace, lanes=None, key_mass=False, window=None,
            backend="lt") -> Spec:
    """attn_lt through a plan of ``backend`` ("lt", "wmma" or "auto"), tuned before it is timed."""
    def make():
        import attn_lt

        with lanes_env(lanes) if lanes is not None else contextlib.nullcontext():
            p = attn_lt.plan(q, k, v, attn_mask=mask, causal=s.causal, backend=backend, workspace_bytes=workspace,
                             return_key_mass=key_mass, key_mass_window=window)
        p.tune(q, k, v, mask)
        if p.backend != "lt":
            return (lambda: p.run(q, k, v, mask)), {"backend": p.backend}
        info = {**plan_info(p), "backend": p.backend}
        if lanes is not None:
            info["lanes_asked"] = lanes
        return (lambda: p.run(q, k, v, mask)), info
    return Spec(provider, "lt", make, check)


def sdpa_spec(provider, s, q, k, v, mask, check, need=None, need_what="") -> Spec:
    def make():
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
        kw = {"enable_gqa": True} if s.Hq != s.Hkv else {}
        if s.causal and s.Sq != s.Sk:
            raise Unavailable("SDPA's is_causal is top-left aligned when Sq != Sk")

        def call():
            ctx = sdpa_kernel(backends[provider]) if provider != "default" else contextlib.nullcontext()
            with ctx:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s.causal, **kw)
        return call, {}
    return Spec(provider, "sdpa", make, check, need, need_what)


def math_need(s: Shape):
    return (lambda: math_bytes(s)), "SDPA math: q, k, v in FP32 with K and V repeated over the query heads, " \
                                    "FP32 scores and softmax"


def specs_for(s: Shape, tensors, workspace, keep: dict) -> list[Spec]:
    q, k, v, mask = tensors
    check = out_checker(s, q, k, v, mask)
    if s.section == "overlap":
        return [lt_spec(f"lt-lanes{n}", s, q, k, v, mask, check, workspace, lanes=n) for n in (1, 2)]
    if s.section in ("wide", "mla_prefill"):
        order = ("efficient", "cudnn", "flash", "math") if s.section == "mla_prefill" else SDPA_PROVIDERS
        sp = [lt_spec("lt", s, q, k, v, mask, check, workspace)]
        if s.section == "mla_prefill":
            sp += [lt_spec(b, s, q, k, v, mask, check, workspace, backend=b) for b in ("wmma", "auto")]
        for p in order:
            need, what = math_need(s) if p == "math" else (None, "")
            sp.append(sdpa_spec(p, s, q, k, v, mask, check, need, what))
        return sp
    if s.section == "mla_decode":
        sp = [lt_spec(b, s, q, k, v, mask, check, workspace, backend=b) for b in ("lt", "wmma", "auto")]
        for p in SDPA_PROVIDERS:
            need, what = math_need(s) if p == "math" else (None, "")
            sp.append(sdpa_spec(p, s, q, k, v, mask, check, need, what))
        # SDPA's default falls back to math when no fused backend takes the case: guard it with math's memory then
        default = sdpa_spec("default", s, q, k, v, mask, check)
        default.need = lambda: 0 if keep.get("fused_ran") else math_bytes(s)
        default.need_what = "no fused backend ran this case, so the default would take math: " + math_need(s)[1]
        sp.append(default)
        return sp
    if s.section == "mass":
        return mass_specs(s, q, k, v, check, workspace, keep)
    raise ValueError(s.section)


def mass_specs(s: Shape, q, k, v, check, workspace, keep: dict) -> list[Spec]:
    """lt, lt with the mass (checked: output on sampled rows, mass against FP32 on sampled heads), eager PyTorch
    (checked against the same FP32 mass); lt's mass is also compared with eager's in full (``mass_vs_eager``)."""
    from attn_lt.testing import rel_error

    pairs = [(b, h) for b in sample_batches(s) for h in sorted({0, s.Hq - 1})]
    ref = ref_mass(q, k, pairs, s.window)
    idx_b = [b for b, _ in pairs]
    idx_h = [h for _, h in pairs]

    def check_lt_mass(res):
        out, mass = res
        keep["lt_mass"] = mass.clone()
        return max(check(out), rel_error(mass[idx_b, idx_h], ref))

    def check_eager(mass):
        keep["eager"] = mass.clone()
        return rel_error(mass[idx_b, idx_h], ref)

    def make_eager():
        n = eager_kv_per_chunk(s, free_bytes())
        if n is None:
            raise Skipped(f"needs about {_gib(eager_bytes_per_kv_head(s))} for one kv head's scores "
                          f"({EAGER_SCORE_BYTES} B a score); {_gib(free_bytes())} free")
        return (lambda: eager_mass(q, k, s.window, n)), {"chunks": -(-s.Hkv // n)}

    return [lt_spec("lt", s, q, k, v, None, check, workspace),
            lt_spec("lt+mass", s, q, k, v, None, check_lt_mass, workspace, key_mass=True, window=s.window),
            Spec("eager", "eager", make_eager, check_eager)]


# ---- the run ----------------------------------------------------------------------------------------------------

def metadata(argv) -> dict:
    """The suite's metadata (``bench.metadata``: the GPU, driver, the GPU's state, versions, the sources' hash),
    with this tool's command and the lanes' setting."""
    meta = bench.metadata(argv)
    meta.update(lanes_env=str(config.current().lanes),
                command="python tools/bench_lt.py " + " ".join(shlex.quote(a) for a in argv))
    return meta


def run(a, argv) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_lt: no CUDA GPU visible, nothing to measure; `python tools/bench_lt.py --list` shows the rows",
              file=sys.stderr)
        return 2
    sys.path.insert(0, REPO)
    rows_to_run = chosen(a)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.monotonic()
    meta = metadata(argv)
    warm_up(a.warm_up_s)
    meta["ceilings"] = ceil = ceilings()
    meta.update(rep_ms=a.rep_ms, rounds=a.rounds, warm_up_s=a.warm_up_s, settle_ms=a.settle_ms, check_tol=CHECK_TOL,
                quick=a.quick, workspace_mb=a.workspace_mb, max_seq=a.max_seq)
    timer = Timer(a.rep_ms, a.rounds, settle_ms=a.settle_ms)
    monitor = GpuMonitor(enabled=not a.no_clock)
    workspace = None if a.workspace_mb is None else a.workspace_mb << 20
    rows: list[dict] = []
    deferred: list = []  # (overlap row, its call) to profile once everything else is measured

    def log(msg):
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def save():
        meta["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_results(a.out, meta, rows)

    for s in rows_to_run:
        if a.time_limit_s and time.monotonic() - t0 > a.time_limit_s:
            rows.append(row(s, "*", "skipped", f"the run's time limit ({a.time_limit_s:g} s) was reached"))
            continue
        tensors = specs = fns = got = None
        keep: dict = {}
        try:
            tensors = make_inputs(s)
            specs = specs_for(s, tensors, workspace, keep)
            if s.section == "mla_decode":  # the default's guard needs to know whether a fused backend ran
                specs = _track_fused(specs, keep)
            got, fns = run_row(s, specs, timer, ceil, log, monitor)
            if s.section == "mass" and "lt_mass" in keep and "eager" in keep:
                from attn_lt.testing import rel_error

                for r in got:
                    if r["provider"] == "lt+mass" and r["status"] == "ok":
                        r["mass_vs_eager"] = float(f"{rel_error(keep['lt_mass'], keep['eager']):.3g}")
            if s.section == "overlap" and not a.no_profile:  # profiled at the end: see below
                deferred += [(r, fns[r["provider"]]) for r in got if r["status"] == "ok" and r["provider"] in fns]
            rows += got
        except Exception as e:  # a row that fails as a whole is recorded, and the run goes on
            import traceback

            log(traceback.format_exc(limit=3))
            rows.append(row(s, "*", "error", f"{type(e).__name__}: {first_line(e)}"))
        finally:  # the row's tensors (also held by its providers' closures) go before the next row's, but for
            del tensors, specs, fns, got  # the overlap calls kept for their profiles (about 1.5 GiB in all)
            keep.clear()
            torch.cuda.empty_cache()
        save()
    # The profiles come last: a profiler session may leave CUPTI costs on every later launch in the process, which
    # would tax the short (decode) calls timed above.
    for r, fn in deferred:
        log(f"{r['case']}: profile of {r['provider']}")
        try:
            r["profile"] = profile_call(fn, r.get("chunks"))
        except Exception as e:
            r["profile"] = {"error": f"{type(e).__name__}: {first_line(e)}"}
    deferred.clear()
    monitor.close()
    meta["clock_monitor"] = monitor.status()
    meta["gpu_state_at_end"] = gpu_state()
    save()
    print(f"\nfiles: lt.json, summary.md in {a.out}")
    print(render_text(meta, rows), end="")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def _track_fused(specs: list[Spec], keep: dict) -> list[Spec]:
    """Wrap the fused SDPA backends' calls so that ``keep['fused_ran']`` says whether one of them ran."""
    for sp in specs:
        if sp.family == "sdpa" and sp.provider in ("cudnn", "flash", "efficient"):
            def checked(res, _check=sp.check):
                keep["fused_ran"] = True
                return _check(res)
            sp.check = checked
    return specs


def chosen(a) -> list[Shape]:
    only = [w for w in a.only.split(",") if w]
    sections = [x for x in a.sections.split(",") if x]
    return select(cases(a.quick), sections, only, a.max_seq)


def cmd_list(a) -> int:
    rows_ = chosen(a)
    wn, ws = max(len(s.name) for s in rows_), max(len(s.desc) for s in rows_)
    print(f"{'case':<{wn}}  {'shape':<{ws}}  {'GFLOP':>8}  {'lt GB':>7}  floor ms at 737 TFLOP/s and 3.00 TB/s")
    for s in rows_:
        print(f"{s.name:<{wn}}  {s.desc:<{ws}}  {flops(s) / 1e9:>8.1f}  {lt_bytes(s) / 1e9:>7.2f}  "
              f"{floor_ms(s, 737, 3.0):>8.3f}")
    print(f"{len(rows_)} rows; sources {source_hash()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/bench_lt.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the target rows only, fewer rounds (about 90 s)")
    ap.add_argument("--out", default="bench-results/lt", help="output directory (default bench-results/lt)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    ap.add_argument("--only", default="", help="rows whose name is or contains one of these (comma-separated)")
    ap.add_argument("--max-seq", type=int, default=0, help="cap every Sq and Sk (0: none; for smoke tests)")
    ap.add_argument("--workspace-mb", type=int, default=None, help="lt's workspace budget (default: the library's)")
    ap.add_argument("--rep-ms", type=float, default=None, help="timing budget of a provider on a row, ms "
                    "(default 200, 100 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 5, 3 with --quick; "
                    f"rows whose calls all take under {FAST_CALL_MS:g} ms get at least {FAST_ROUNDS}, rows whose "
                    f"round takes over {SLOW_ROUND_MS / 1e3:g} s at most 3; each row records its own)")
    ap.add_argument("--warm-up-s", type=float, default=None, help="seconds of GEMMs first (default 3, 1 with --quick)")
    ap.add_argument("--settle-ms", type=float, default=SETTLE_MS, help="untimed calls of a provider before each of "
                    f"its rounds, ms, so that it is timed at its own sustained clock (default {SETTLE_MS:g}; 0: none)")
    ap.add_argument("--no-profile", action="store_true", help="leave out the per-kernel profile of the overlap rows")
    ap.add_argument("--no-clock", action="store_true",
                    help="leave out the SM clock's samples (nvidia-smi in the background) beside the timings")
    ap.add_argument("--time-limit-s", type=float, default=0, help="rows not started after this long are recorded "
                    "as skipped (0: no limit)")
    ap.add_argument("--list", action="store_true", help="print the rows with FLOPs and bytes and exit (no GPU)")
    return ap


def parse_args(argv) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    if a.rep_ms is None:
        a.rep_ms = 100.0 if a.quick else 200.0
    if a.rounds is None:
        a.rounds = 3 if a.quick else 5
    if a.warm_up_s is None:
        a.warm_up_s = 1.0 if a.quick else 3.0
    if a.rounds < 1 or a.rep_ms <= 0 or min(a.warm_up_s, a.time_limit_s, a.settle_ms) < 0:
        raise ValueError(f"--rounds must be >= 1, --rep-ms > 0, --warm-up-s, --time-limit-s and --settle-ms >= 0; "
                         f"got {a.rounds}, {a.rep_ms}, {a.warm_up_s}, {a.time_limit_s}, {a.settle_ms}")
    if a.workspace_mb is not None and a.workspace_mb < 1:
        raise ValueError(f"--workspace-mb must be >= 1, got {a.workspace_mb}")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
        chosen(a)  # bad --sections / --only / --max-seq: exit 2 before anything is measured
        if a.list:
            return cmd_list(a)
        return run(a, argv)
    except (ValueError, OSError) as e:
        print(f"bench_lt: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
