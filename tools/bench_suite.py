"""The benchmark suite's pure parts: the case generator, the FLOP and byte formulas with each path's roofline, the
providers' declarations, ratios, the writers (terminal table, Markdown, CSV, JSON, PNG plots) and the comparison
of two runs. Standard library only (matplotlib for the plots, imported when plotting), so that all of it is tested
in CI on synthetic rows (tests/test_bench_suite.py). The GPU runner is tools/bench.py; the protocol is described in
the README's "Benchmarks" section.

A result row is a flat dict: the case's fields, ``provider``, ``status`` ("ok", "n/a" when the provider cannot run
the case, "skipped" when the runner's memory or time guard kept it from running, "error" when it ran and failed or
gave a wrong result), ``reason``, and for "ok" rows: ``ms`` (median), ``tflops``, ``tbs`` (the path's bytes over
the time), ``io_tbs`` (the bytes of Q, K, V, O and the mask over the time: comparable across paths),
``roofline_pct`` (the path's roofline time over the time), ``peak_mib``, ``rel_err`` (against an FP32 reference on
sampled rows), ``reps``, ``spread_pct`` (the range of the timed rounds' medians over the median), ``host_us``
(host time to issue a call, for calls of at most 2 ms), ``route`` (the path attn_lt took), ``vs_auto`` (this
provider's time over attn_lt auto's: how many times faster auto is) and, with
``--lt-details``, ``details`` (lt's per-kernel time and GEMM algorithms; JSON only).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields

GROUPS = ("fa3", "long", "decode")
DTYPE_BYTES = {"bf16": 2, "fp16": 2}

#: HBM bytes a score costs the unfused path at least: FP32 write 4, softmax read 4, P write 2, P read 2.
SCORE_BYTES = 12


@dataclass(frozen=True)
class Case:
    """One attention shape. ``mask``: a dense additive mask of shape (B, 1, Sq, Sk) in the input dtype."""

    group: str
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    causal: bool = False
    mask: bool = False
    dtype: str = "bf16"

    def __post_init__(self):
        if self.group not in GROUPS or self.dtype not in DTYPE_BYTES:
            raise ValueError(f"group must be one of {GROUPS} and dtype one of {tuple(DTYPE_BYTES)}: {self}")
        if min(self.B, self.Hq, self.Hkv, self.Sq, self.Sk, self.D) < 1 or self.Hq % self.Hkv:
            raise ValueError(f"sizes must be positive and Hq a multiple of Hkv: {self}")

    @property
    def name(self) -> str:
        if self.group == "decode":
            base = f"decode-sq{self.Sq}-sk{_k(self.Sk)}-{'gqa' if self.Hkv < self.Hq else 'mha'}"
        elif self.group == "long":
            base = f"long-s{_k(self.Sk)}"
        else:
            base = f"{self.group}-d{self.D}-s{_k(self.Sk)}"
        return base + ("-causal" if self.causal else "") + ("-mask" if self.mask else "")

    @property
    def shape(self) -> str:
        kv = f"/{self.Hkv}" if self.Hkv != self.Hq else ""
        s = f"S{self.Sk}" if self.Sq == self.Sk else f"Sq{self.Sq} Sk{self.Sk}"
        return f"B{self.B} H{self.Hq}{kv} {s} D{self.D}"

    @property
    def panel(self) -> str:
        """The plot panel this case belongs to (every case of a panel differs only in Sk)."""
        if self.group == "decode":
            head = f"decode Sq={self.Sq} {'GQA Hkv=' + str(self.Hkv) if self.Hkv < self.Hq else 'MHA'}"
        elif self.group == "long":
            head = f"long B={self.B} H={self.Hq} D={self.D}"
        else:
            head = f"FA3 protocol D={self.D}"
        return head + (", causal" if self.causal else "") + (", mask" if self.mask else "")


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


# ---- the sweep -------------------------------------------------------------------------------------------------

FA3_TOKENS, FA3_HIDDEN = 16384, 2048
FA3_S = (512, 1024, 2048, 4096, 8192, 16384)
FA3_D = (64, 128, 256)  # head dims of the FA3 group (256: the Hopper fused kernel's; SDPA flash and cuDNN run it)
LONG_S = (32768, 65536, 131072)
DECODE_SK = (8192, 16384, 32768, 65536, 131072)
DECODE_B, DECODE_HQ, DECODE_GQA_HKV, DECODE_SQ = 8, 32, 8, (1, 16)


def fa3_case(D: int, S: int, causal: bool = False, mask: bool = False) -> Case:
    """The FlashAttention-3 paper's protocol: B*S = 16k tokens, H*D = 2048."""
    return Case("fa3", FA3_TOKENS // S, FA3_HIDDEN // D, FA3_HIDDEN // D, S, S, D, causal, mask)


def long_case(S: int, causal: bool = False, mask: bool = False) -> Case:
    return Case("long", 1, 32, 32, S, S, 128, causal, mask)


def decode_case(Sq: int, Sk: int, gqa: bool, mask: bool = False) -> Case:
    """Sq new queries against a KV cache of Sk keys (not causal: every query sees the whole cache)."""
    return Case("decode", DECODE_B, DECODE_HQ, DECODE_GQA_HKV if gqa else DECODE_HQ, Sq, Sk, 128, False, mask)


def sweep(quick: bool = False, groups=GROUPS, with_masks: bool = True) -> list[Case]:
    """The cases of a run, in order. The masked variants are the non-causal cases with a dense additive mask
    (SDPA takes a mask or ``is_causal``, not both). ``quick``: a subset that runs in about a minute."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    if quick:
        cases = [fa3_case(128, 1024), fa3_case(128, 4096), fa3_case(128, 4096, causal=True), fa3_case(64, 16384),
                 long_case(32768, causal=True), decode_case(1, 32768, gqa=False), decode_case(16, 32768, gqa=True),
                 fa3_case(128, 4096, mask=True), decode_case(1, 32768, gqa=True, mask=True)]
    else:
        plain = [fa3_case(D, S, c) for D in FA3_D for c in (False, True) for S in FA3_S]
        plain += [long_case(S, c) for c in (False, True) for S in LONG_S]
        plain += [decode_case(sq, sk, gqa) for sq in DECODE_SQ for gqa in (False, True) for sk in DECODE_SK]
        masked = [Case(**{**asdict(c), "mask": True}) for c in plain if not c.causal]
        cases = plain + masked
    return [c for c in cases if c.group in groups and (with_masks or not c.mask)]


# ---- formulas --------------------------------------------------------------------------------------------------

def scores(c: Case) -> float:
    """Score elements the computation needs: B Hq Sq Sk, halved when causal (the FlashAttention convention)."""
    return float(c.B * c.Hq * c.Sq * c.Sk) * (0.5 if c.causal else 1.0)


def flops(c: Case) -> float:
    """Forward FLOPs: 2 D for Q K^T and 2 D for P V per score, 4 B Hq Sq Sk D (halved when causal)."""
    return 4.0 * c.D * scores(c)


def io_bytes(c: Case) -> int:
    """Bytes every path must move at least: Q, K, V and O once, and the mask once."""
    e = DTYPE_BYTES[c.dtype]
    return e * (2 * c.B * c.Hq * c.Sq * c.D + 2 * c.B * c.Hkv * c.Sk * c.D + (c.B * c.Sq * c.Sk if c.mask else 0))


def path_bytes(c: Case, path: str) -> float:
    """The HBM floor of a path: "fused" moves the inputs and output once; "unfused" adds 12 bytes a score."""
    if path not in ("fused", "unfused"):
        raise ValueError(f"path must be 'fused' or 'unfused', got {path!r}")
    return io_bytes(c) + (SCORE_BYTES * scores(c) if path == "unfused" else 0.0)


def roofline_ms(c: Case, path: str, peak_tflops: float, peak_tbs: float) -> float:
    """The path's roofline: its FLOPs at the GEMM ceiling or its bytes at the copy bandwidth, whichever is longer."""
    return max(flops(c) / (peak_tflops * 1e9), path_bytes(c, path) / (peak_tbs * 1e9))


def metrics(c: Case, path: str, ms: float, ceilings: dict) -> dict:
    """At ``ms``: TFLOP/s; achieved bandwidth of the path's bytes (``tbs``, TB/s) and percent of the path's
    roofline; effective bandwidth (``io_tbs``: Q, K, V, O and mask bytes over the time, comparable across paths)."""
    return {"tflops": round(flops(c) / ms / 1e9, 2), "tbs": round(path_bytes(c, path) / ms / 1e9, 3),
            "io_tbs": round(io_bytes(c) / ms / 1e9, 3),
            "roofline_pct": round(100 * roofline_ms(c, path, ceilings["gemm_tflops"], ceilings["hbm_tbs"]) / ms, 1)}


# ---- providers -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Provider:
    name: str
    family: str  # "attn_lt", "sdpa" or "torch"
    path: str  # "fused", "unfused", or "route" (the path attn_lt's selector takes)
    label: str
    color: str
    marker: str


PROVIDERS = {p.name: p for p in (
    Provider("auto", "attn_lt", "route", "attn_lt auto", "#000000", "o"),
    Provider("lt", "attn_lt", "unfused", "attn_lt lt", "#d62728", "s"),
    Provider("wmma", "attn_lt", "fused", "attn_lt wmma", "#ff7f0e", "^"),
    Provider("cudnn", "sdpa", "fused", "SDPA cuDNN", "#1f77b4", "D"),
    Provider("flash", "sdpa", "fused", "SDPA flash", "#2ca02c", "v"),
    Provider("efficient", "sdpa", "fused", "SDPA efficient", "#9467bd", "P"),
    Provider("math", "sdpa", "unfused", "SDPA math", "#8c564b", "x"),
    Provider("default", "sdpa", "fused", "SDPA default", "#17becf", "*"),
    Provider("unfused", "torch", "unfused", "PyTorch unfused", "#7f7f7f", "h"),
)}
ATTN_LT = tuple(n for n, p in PROVIDERS.items() if p.family == "attn_lt")


def provider_path(provider: str, route: str | None = None) -> str:
    """The path whose roofline a provider is measured against; ``route`` is the backend auto took."""
    p = PROVIDERS[provider].path
    if p == "route":
        if route not in ("lt", "wmma"):
            raise ValueError(f"auto's route must be 'lt' or 'wmma', got {route!r}")
        return PROVIDERS[route].path
    return p


def unfused_peak_bytes(c: Case) -> float:
    """What the unfused chains (PyTorch's, SDPA math) hold at once: FP32 scores, their softmax, and P."""
    return float(c.B * c.Hq * c.Sq * c.Sk) * (4 + 4 + DTYPE_BYTES[c.dtype]) + io_bytes(c)


# ---- rows, ratios ----------------------------------------------------------------------------------------------

CASE_FIELDS = tuple(f.name for f in fields(Case))
#: What the GPU's clock did while a provider was timed (``bench.GpuMonitor``'s summary, prefixed ``gpu_``).
GPU_FIELDS = ("gpu_sm_mhz", "gpu_sm_mhz_min", "gpu_sm_mhz_rated", "gpu_power_w_max", "gpu_samples", "gpu_clock_held")
ROW_FIELDS = ("case",) + CASE_FIELDS + (
    "provider", "status", "reason", "route", "ms", "tflops", "tbs", "io_tbs", "roofline_pct", "peak_mib", "rel_err",
    "reps", "rounds", "spread_pct", "host_us", "vs_auto") + GPU_FIELDS + ("details",)
CSV_FIELDS = ROW_FIELDS[:-1]  # details are nested: JSON only


def row(c: Case, provider: str, status: str, reason: str = "", **values) -> dict:
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}")
    if status not in ("ok", "n/a", "skipped", "error"):
        raise ValueError(f"unknown status {status!r}")
    r = {"case": c.name, **asdict(c), "provider": provider, "status": status, "reason": reason}
    unknown = set(values) - set(ROW_FIELDS)
    if unknown:
        raise ValueError(f"unknown row fields {sorted(unknown)}")
    r.update(values)
    return r


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set ``vs_auto`` on every "ok" row: its time over attn_lt auto's time for the same case (>1: auto faster),
    the "auto/P" entry of :func:`ratios`."""
    rs = ratios(rows)
    for r in rows:
        if r["status"] == "ok":
            x = 1.0 if r["provider"] == "auto" else rs.get(r["case"], {}).get(f"auto/{r['provider']}")
            if x is not None:
                r["vs_auto"] = x
    return rows


def ratios(rows: list[dict]) -> dict:
    """{case: {"A/P": time of P over time of A}} for every attn_lt provider A and every other provider P that ran."""
    by_case: dict = {}
    for r in rows:
        if r["status"] == "ok":
            by_case.setdefault(r["case"], {})[r["provider"]] = r["ms"]
    out = {}
    for case, t in by_case.items():
        out[case] = {f"{a}/{p}": round(t[p] / t[a], 4) for a in ATTN_LT if a in t for p in t if p != a}
    return out


def cases_of(rows: list[dict]) -> list[Case]:
    """The distinct cases of ``rows``, in order."""
    seen: dict = {}
    for r in rows:
        seen.setdefault(r["case"], Case(**{f: r[f] for f in CASE_FIELDS}))
    return list(seen.values())


# ---- writers ---------------------------------------------------------------------------------------------------

def write_json(path, meta: dict, rows: list[dict]) -> None:
    """{"schema": 1, "meta": ..., "rows": [...], "ratios": {case: {"A/P": x}}}, a row or a case's ratios a line."""
    with open(path, "w") as f:
        f.write('{"schema": 1,\n"meta": ' + json.dumps(meta) + ',\n"rows": [\n')
        f.write(",\n".join(json.dumps(r) for r in rows))
        f.write('\n],\n"ratios": {\n')
        f.write(",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in ratios(rows).items()))
        f.write("\n}}\n")


def read_json(path) -> tuple[dict, list[dict]]:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a results file of this suite (schema 1)")
    return doc.get("meta", {}), doc["rows"]


def write_csv(path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k, "")) for k in CSV_FIELDS})


def _unit(group: str) -> str:
    return "effective TB/s (Q, K, V, O, mask bytes)" if group == "decode" else "TFLOP/s"


def _cell(r: dict | None, group: str) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return {"n/a": "n/a", "skipped": "skip", "error": "ERR"}[r["status"]]
    return f"{r['io_tbs']:.2f}" if group == "decode" else f"{r['tflops']:.1f}"


def _best(rs: list[dict], family: str) -> dict | None:
    ok = [r for r in rs if r["status"] == "ok" and PROVIDERS[r["provider"]].family == family]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def table(rows: list[dict]) -> list[tuple[str, list[str], list[list[str]]]]:
    """One (title, header, lines) per group: each case's rate per provider (TFLOP/s; decode: effective TB/s, the
    bytes of Q, K, V, O and mask over the time), auto's route and its ratios to the fastest SDPA backend and to
    the PyTorch unfused chain."""
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    out = []
    for group in GROUPS:
        cs = [c for c in cases_of(rows) if c.group == group]
        if not cs:
            continue
        header = ["case", "shape"] + provs + ["auto via", "auto/best SDPA", "auto/unfused"]
        lines = []
        for c in cs:
            rs = [r for r in rows if r["case"] == c.name]
            by = {r["provider"]: r for r in rs}
            auto = by.get("auto")
            best, unf = _best(rs, "sdpa"), by.get("unfused")
            ok = auto is not None and auto["status"] == "ok"
            ratio = (lambda peer: f"{peer['ms'] / auto['ms']:.2f}x" if ok and peer and peer["status"] == "ok"
                     else "")
            via = auto.get("route", "") if ok else ""
            lines.append([c.name, c.shape] + [_cell(by.get(p), group) for p in provs]
                         + [via, ratio(best) + (f" ({best['provider']})" if ok and best else ""), ratio(unf)])
        out.append((f"{group}: {_unit(group)}, median", header, lines))
    return out


def gist(reason: str) -> str:
    """A reason without what names one case (attn_lt's case description, SDPA's tensor sizes, memory amounts), so
    that one cause is one line of the report; results files keep the whole reason."""
    reason = re.sub(r"^backend='\w+' cannot run .*?: ", "", reason)
    reason = re.sub(r"\s*Query\.sizes\(\).*", "", reason)
    return re.sub(r"needs about \d+ GiB at once for its score matrices; \d+ GiB free",
                  "its score matrices (FP32 scores, their softmax and P at once) need more than the free memory",
                  reason)


def reasons(rows: list[dict]) -> list[str]:
    """Why providers did not run, one line per (provider, status, reason) with the cases it applies to."""
    seen: dict = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault((r["provider"], r["status"], gist(r["reason"])), []).append(r["case"])
    lines = []
    for (p, status, why), cs in seen.items():
        shown = ", ".join(cs[:3]) + (f" and {len(cs) - 3} more" if len(cs) > 3 else "")
        lines.append(f"{p} {status}: {why} [{shown}]")
    return lines


def clock_lines(rows: list[dict]) -> list[str]:
    """The timed providers whose GPU held its SM clock down (power cap, thermal) while they ran, with the clock seen
    (``bench.GpuMonitor``'s samples, the rows' ``gpu_*`` fields): their times are those of a GPU at that clock."""
    out = []
    for r in rows:
        if r.get("status") == "ok" and r.get("gpu_clock_held"):
            watts = r.get("gpu_power_w_max")
            power = f", up to {watts:.0f} W" if watts is not None else ""
            out.append(f"{r['case']} {r['provider']}: SM clock {r['gpu_sm_mhz']:.0f} MHz median of "
                       f"{r['gpu_sm_mhz_rated']:.0f}, {r['gpu_sm_mhz_min']:.0f} lowest{power} ({r['gpu_clock_held']} "
                       f"of {r['gpu_samples']} samples)")
    return out


def clock_section(rows: list[dict], markdown: bool) -> str:
    """The tables' closing list of :func:`clock_lines` (empty when no provider ran on a clock held down)."""
    held = clock_lines(rows)
    if not held:
        return ""
    if markdown:
        return "\nClock held down while timed:\n\n" + "".join(f"- {x}\n" for x in held)
    return "\nclock held down while timed:\n" + "".join(f"  {x}\n" for x in held)


def render_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    for title, header, lines in table(rows):
        widths = [max(len(x) for x in col) for col in zip(header, *lines)]
        buf.write(f"\n{title}\n")
        for ln in [header] + lines:
            buf.write("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(ln, widths)))
                      + "\n")
    buf.write(clock_section(rows, markdown=False))
    why = reasons(rows)
    if why:
        buf.write("\nnot run:\n" + "".join(f"  {x}\n" for x in why))
    return buf.getvalue()


def describe(meta: dict) -> str:
    """One paragraph of where and how a run was made."""
    v = meta.get("versions", {})
    ceil = meta.get("ceilings", {})
    parts = [f"{meta.get('date', '?')}, {meta.get('gpu', '?')} (driver {meta.get('driver', '?')})"]
    if v:
        parts.append(", ".join(f"{k} {x}" for k, x in v.items()))
    parts += [f"ceilings measured in the run: bf16 GEMM {ceil.get('gemm_tflops', '?')} TFLOP/s, "
             f"HBM {ceil.get('hbm_tbs', '?')} TB/s",
             f"command: `{meta.get('command', '?')}`"]
    if meta.get("elapsed_s") is not None:
        parts.append(f"sweep time {meta['elapsed_s']:.0f} s")
    return "; ".join(parts) + "."


def markdown_tables(buf, tables) -> None:
    """Write (title, header, lines) tables to ``buf`` as Markdown."""
    for title, header, lines in tables:
        buf.write(f"\n**{title}**\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
        for ln in lines:
            buf.write("| " + " | ".join(ln) + " |\n")


def render_markdown(meta: dict, rows: list[dict]) -> str:
    buf = io.StringIO()
    buf.write(describe(meta) + "\n")
    markdown_tables(buf, table(rows))
    buf.write(clock_section(rows, markdown=True))
    why = reasons(rows)
    if why:
        buf.write("\nNot run (provider, status: reason [cases]):\n\n" + "".join(f"- {x}\n" for x in why))
    return buf.getvalue()


README_BEGIN, README_END = "<!-- bench:begin -->", "<!-- bench:end -->"


def splice(text: str, block: str) -> str:
    """``text`` with what lies between the README markers replaced by ``block``."""
    i, j = text.find(README_BEGIN), text.find(README_END)
    if i < 0 or j < i:
        raise ValueError(f"no {README_BEGIN} ... {README_END} block to replace")
    return text[:i + len(README_BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[j:]


def plot(rows: list[dict], out_dir, dpi: int = 72) -> list[str]:
    """PNG plots: ``rate.png`` (TFLOP/s vs S per panel: FA3 protocol per D, long context; decode: effective TB/s
    vs Sk), one
    line per provider, and ``memory.png`` (peak MiB vs S for the long-context and FA3 D=128 panels)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    ran = {r["case"] for r in ok}
    order = sorted((c for c in cases_of(rows) if c.name in ran),
                   key=lambda c: (GROUPS.index(c.group), c.D, c.Sq, -c.Hkv, c.mask, c.causal, c.Sk))
    panels: dict = {}
    for c in order:
        panels.setdefault(c.panel, []).append(c)
    written = []

    def draw(names, fname, y_of, ylabel_of, log_y=False):
        if not names:
            return
        ncol = min(3, len(names))
        nrow = math.ceil(len(names) / ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.3 * nrow), squeeze=False)
        for ax, name in zip(axes.flat, names):
            case_names = {c.name: c for c in panels[name]}
            for p, prov in PROVIDERS.items():
                pts = sorted((case_names[r["case"]].Sk, y_of(r)) for r in ok
                             if r["provider"] == p and r["case"] in case_names)
                if pts:
                    ax.plot(*zip(*pts), marker=prov.marker, color=prov.color, label=prov.label, lw=1.2, ms=4)
            ax.set_xscale("log", base=2)
            xs = sorted({c.Sk for c in panels[name]})
            ax.set_xticks(xs, [_k(x) for x in xs])
            ax.minorticks_off()
            if log_y:
                ax.set_yscale("log")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("Sk" if panels[name][0].group == "decode" else "S", fontsize=8)
            ax.set_ylabel(ylabel_of(panels[name][0]), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        handles = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(9, len(handles)), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.06 if nrow > 1 else 0.1, 1, 1))
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)

    names = list(panels)
    draw(names, "rate.png", lambda r: r["io_tbs"] if r["group"] == "decode" else r["tflops"],
         lambda c: "effective TB/s" if c.group == "decode" else "TFLOP/s")
    mem = [n for n in names if panels[n][0].group == "long" or (panels[n][0].group == "fa3" and panels[n][0].D == 128)]
    draw(mem, "memory.png", lambda r: max(r["peak_mib"], 1), lambda c: "peak extra MiB", log_y=True)
    return written


# ---- comparing two runs ----------------------------------------------------------------------------------------

def compare(rows_a: list[dict], rows_b: list[dict]) -> dict:
    """How far two runs' ratios are apart: |r_a / r_b - 1| over every ratio both runs have."""
    ra, rb = ratios(rows_a), ratios(rows_b)
    diffs = []
    for case in ra.keys() & rb.keys():
        for pair in ra[case].keys() & rb[case].keys():
            diffs.append((abs(ra[case][pair] / rb[case][pair] - 1), case, pair, ra[case][pair], rb[case][pair]))
    diffs.sort(reverse=True)
    if not diffs:
        return {"n": 0, "median_pct": None, "max_pct": None, "worst": []}
    return {"n": len(diffs), "median_pct": round(100 * statistics.median(d[0] for d in diffs), 2),
            "max_pct": round(100 * diffs[0][0], 2),
            "within_3pct": sum(d[0] <= 0.03 for d in diffs), "within_5pct": sum(d[0] <= 0.05 for d in diffs),
            "worst": [{"case": c, "ratio": p, "a": a, "b": b, "diff_pct": round(100 * d, 2)}
                      for d, c, p, a, b in diffs[:8]]}


# ---- progress --------------------------------------------------------------------------------------------------

class Progress:
    """A progress bar with the elapsed time and an estimate of what is left, on stderr."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()

    def line(self, label: str) -> str:
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        n = self.width * self.done // max(self.total, 1)
        left = "?" if math.isnan(eta) else f"{eta:.0f}s"
        return f"[{'#' * n}{'.' * (self.width - n)}] {self.done}/{self.total} {el:.0f}s, ~{left} left  {label[:50]}"

    def _show(self, label: str) -> None:
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write("\r" + self.line(label).ljust(110) if tty else self.line(label) + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        self._show(label)
        self.done += 1

    def close(self) -> None:
        self.done = self.total
        self._show("done")
        if getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
