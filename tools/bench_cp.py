#!/usr/bin/env python3
"""Context-parallel attention benchmark (attn_lt.distributed): one long causal sequence on N GPUs over NCCL,
against one GPU measured in the same run.

    torchrun --nproc-per-node N tools/bench_cp.py [--out DIR] [--quick] [--seqlens 262144,1048576]
        [--modes zigzag-ring,zigzag-allgather,contiguous-ring] [--long-modes zigzag-ring] [--backends auto]
        [-b 1] [-H 32] [--kv-heads 32] [-d 128] [--no-causal] [--reps 3] [--case-budget-s 45]
        [--single-max-s 262144] [--check-rows 48] [--warmup-tune-ms 5000] [--time-limit-s 280] [--seed N]
    python tools/bench_cp.py ...                 the same on one process (world 1)
    python tools/bench_cp.py --plan ...          the cases, FLOPs and memory per GPU (no GPU needed)
    torchrun --nproc-per-node 2 tools/bench_cp.py --cpu-smoke --out DIR   the whole program on CPU (gloo, tiny
                                                 shapes, the plain-PyTorch local attention): a test of the script

Protocol, per sequence length S (ascending) and local backend (``attn_lt.attention``'s ``backend``):
1. One GPU: every rank runs ``attn_lt.attention`` on the whole sequence (the same inputs) when S <=
   ``--single-max-s`` and it fits in memory; a warm-up call (GEMM tuning happens there), then timed calls. Its rate
   is the baseline of the scaling efficiency; for a longer S the baseline is the rate of the longest S measured
   on one GPU in this run (the table says which).
2. Each mode (layout-comm, e.g. zigzag-ring): a warm-up call (peak memory measured there, per GPU; attn_lt
   tunes its GEMMs there, up to --warmup-tune-ms per local call), then timed calls (no tuning), each between a
   barrier and a CUDA-event pair on every rank; the time of a call is the slowest rank's median. Modes listed in
   ``--long-modes`` alone run for S > ``--single-max-s``.
3. Communication: the call's phases come from ``attn_lt.distributed.CommTrace`` — ``compute`` (local calls and
   merges), ``wait`` (the compute stream stalled on communication: *exposed*; it also holds any wait for a slower
   rank, i.e. load imbalance, large for contiguous causal), ``reorder`` (all-gather only); the same transfers are
   also timed alone, so *hidden* = alone - wait (slowest rank's figures).
4. Correctness: every output is compared on sampled query rows with an FP32 reference computed from the same
   inputs (each rank's FP32 partial over its own K/V, merged); the one-GPU output on the same rows too. A mode
   passes when its error is at most twice the one-GPU error + 1e-3 (or 0.02 without a one-GPU run).

Numbers: time (ms), TFLOP/s of the whole call (4·B·Hq·S²·D, halved when causal) and per GPU, efficiency = rate on
N GPUs / (N × one-GPU rate), exposed and hidden communication, peak memory per GPU (torch's allocator; NCCL's own
buffers are not counted). Results: DIR/results.json (rewritten after every case), the table printed last.
NCCL's environment is left as it is (recorded in the JSON). Exit codes: 0 ok; 1 a check failed; 2 no GPU / bad
arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import attn_lt  # noqa: E402
from attn_lt import distributed as cp  # noqa: E402
from attn_lt.merge import merge  # noqa: E402
from attn_lt.testing import attention_reference, rel_error  # noqa: E402

#: Sanity bound of the sampled-row error where no one-GPU result exists (bf16 attention is ~4e-3).
CHECK_TOL = 2e-2
#: Tokens per independently seeded block of the generated inputs (any rank can regenerate any token range).
GEN_BLOCK = 4096
MODES = ("zigzag-ring", "zigzag-allgather", "contiguous-ring", "contiguous-allgather", "zigzag-auto",
         "contiguous-auto")
NAMES = {"q": 1, "k": 2, "v": 3}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = (lambda s: [int(float(x)) for x in s.split(",") if x])
    words = (lambda s: [x for x in s.split(",") if x])
    p.add_argument("--out", default="bench-cp-results", help="directory of results.json")
    p.add_argument("--quick", action="store_true", help="S = 65536, two timed calls: about a minute")
    p.add_argument("--seqlens", type=ints, default=None, help="global sequence lengths (default 262144,1048576)")
    p.add_argument("--modes", type=words, default=["zigzag-ring", "zigzag-allgather", "contiguous-ring"])
    p.add_argument("--long-modes", type=words, default=["zigzag-ring"],
                   help="the modes run for S > --single-max-s (default zigzag-ring)")
    p.add_argument("--backends", type=words, default=["auto"], help="local backends: auto, lt, wmma")
    p.add_argument("-b", "--batch", type=int, default=1)
    p.add_argument("-H", "--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("-d", "--head-dim", type=int, default=128)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--reps", type=int, default=3, help="timed calls per case (at most)")
    p.add_argument("--case-budget-s", type=float, default=45.0,
                   help="fewer timed calls where warm-up + reps would take longer (at least one)")
    p.add_argument("--single-max-s", type=int, default=262144,
                   help="longest S run on one GPU (time budget: 1M causal on one H200 takes 30-80 s a call)")
    p.add_argument("--check-rows", type=int, default=48)
    p.add_argument("--warmup-tune-ms", type=float, default=5000,
                   help="attn_lt's tuning budget of each local call in the warm-up (timed calls tune nothing; "
                   "GEMM classes not reached keep cuBLASLt's heuristic, alike for one GPU and N; keeps the run short)")
    p.add_argument("--time-limit-s", type=float, default=280.0, help="start no case after this (default 280)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--plan", action="store_true", help="print the cases and memory per GPU; no GPU work")
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="ranks assumed by --plan (default: WORLD_SIZE or 1)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run on CPU with gloo, tiny shapes and the plain-PyTorch local attention")
    a = p.parse_args(argv)
    if a.seqlens is None:
        a.seqlens = [65536] if a.quick else ([96, 192] if a.cpu_smoke else [262144, 1048576])
    if a.quick:
        a.reps = min(a.reps, 2)
        a.check_rows = min(a.check_rows, 32)
    if a.cpu_smoke:
        a.heads, a.kv_heads, a.head_dim = min(a.heads, 4), min(a.kv_heads or 2, 2), min(a.head_dim, 16)
        a.single_max_s = min(a.single_max_s, 96)
    a.kv_heads = a.kv_heads or a.heads
    a.seqlens = sorted(set(a.seqlens))
    for m in a.modes + a.long_modes:
        if m not in MODES:
            p.error(f"mode {m!r} is not one of {MODES}")
    for b in a.backends:
        if b not in ("auto", "lt", "wmma"):
            p.error(f"backend {b!r} is not one of auto, lt, wmma")
    if a.heads % a.kv_heads or min(a.batch, a.heads, a.head_dim, a.reps) < 1:
        p.error("need positive sizes and --heads a multiple of --kv-heads")
    return a


# ---- processes, timing, memory -----------------------------------------------------------------------------------

def setup(a):
    """Initialise the process group (torchrun's environment, or one process); (rank, world, device)."""
    if "RANK" not in os.environ:  # started without a launcher: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(minutes=30)
    if a.cpu_smoke:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timeout)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return dist.get_rank(), dist.get_world_size(), device


def tune_budget(ms: float):
    """attn_lt's per-call tuning budget for the calls inside: the warm-up tunes every GEMM class of the case (as
    tools/bench.py does), timed calls tune nothing."""
    return attn_lt.config.tuning_budget(int(ms))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Milliseconds between start() and stop(): CUDA events on the current stream, wall clock on CPU."""

    def __init__(self, device):
        self.device = device

    def start(self):
        if self.device.type == "cuda":
            self.s, self.e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.s.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            self.e.record()
            self.e.synchronize()
            return self.s.elapsed_time(self.e)
        return (time.perf_counter() - self.t) * 1e3


def mem_reset(device) -> int:
    sync(device)
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def mem_peak(device) -> int:
    sync(device)
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def agree_max(x: float, device) -> float:
    """The largest ``x`` over the ranks (every rank gets the same value: decisions stay in lockstep)."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- inputs ------------------------------------------------------------------------------------------------------

def gen_tokens(a, name: str, t0: int, t1: int, device, dtype, heads: int) -> torch.Tensor:
    """Tokens [t0, t1) of input ``name`` (B, heads, t1 - t0, D): blocks of GEN_BLOCK tokens, each from its own
    seed, so every rank makes the same values for the same tokens."""
    parts = []
    for blk in range(t0 // GEN_BLOCK, (t1 - 1) // GEN_BLOCK + 1):
        g = torch.Generator(device=device)
        g.manual_seed((a.seed * 1_000_003 + NAMES[name] * 7_919 + blk) % (2**63 - 1))
        x = torch.randn(a.batch, heads, GEN_BLOCK, a.head_dim, device=device, dtype=dtype, generator=g)
        lo, hi = max(t0, blk * GEN_BLOCK) - blk * GEN_BLOCK, min(t1, (blk + 1) * GEN_BLOCK) - blk * GEN_BLOCK
        parts.append(x[:, :, lo:hi])
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].contiguous()


def heads_of(a, name):
    return a.heads if name == "q" else a.kv_heads


def make_full(a, S, device, dtype):
    return tuple(gen_tokens(a, n, 0, S, device, dtype, heads_of(a, n)) for n in ("q", "k", "v"))


def make_shards(a, S, rank, world, layout, device, dtype, names=("q", "k", "v")):
    chunks = cp.rank_chunks(rank, world, layout)
    c = S // (world * len(chunks))
    return tuple(torch.cat([gen_tokens(a, n, g * c, (g + 1) * c, device, dtype, heads_of(a, n)) for g in chunks], 2)
                 for n in names)


def gen_rows(a, name, rows: list[int], device, dtype) -> torch.Tensor:
    """Tokens ``rows`` (sorted global indices) of input ``name``, (B, heads, len(rows), D); each block made once."""
    out, blocks = [], {}
    for r in rows:
        blocks.setdefault(r // GEN_BLOCK, []).append(r % GEN_BLOCK)
    for blk, offs in sorted(blocks.items()):
        x = gen_tokens(a, name, blk * GEN_BLOCK, (blk + 1) * GEN_BLOCK, device, dtype, heads_of(a, name))
        out.append(x[:, :, offs])
    return torch.cat(out, dim=2)


def sample_rows(a, S, world) -> list[int]:
    """Query rows checked: the first and last, both sides of every zigzag chunk boundary, and --check-rows
    random ones (sorted, distinct)."""
    c = S // (2 * world)
    fixed = {0, S - 1} | {x for g in range(1, 2 * world) for x in (g * c - 1, g * c)}
    g = torch.Generator().manual_seed(a.seed)
    return sorted(fixed | set(torch.randint(0, S, (a.check_rows,), generator=g).tolist()))


def flops(a, S) -> float:
    f = 4.0 * a.batch * a.heads * S * S * a.head_dim
    return f / 2 if not a.no_causal else f


# ---- the FP32 reference on sampled rows --------------------------------------------------------------------------

def reference_rows(a, S, rows, device, dtype, rank, world):
    """(out, lse) FP32 of the sampled rows: every rank attends the rows (FP32) to its own contiguous K/V shard
    with the global causal mask, and the partials are merged (attn_lt.merge) on every rank."""
    q_rows = gen_rows(a, "q", rows, device, dtype)
    k, v = make_shards(a, S, rank, world, "contiguous", device, dtype, names=("k", "v"))
    c = S // world
    key_pos = torch.arange(rank * c, (rank + 1) * c, device=device)
    row_pos = torch.tensor(rows, device=device)
    g = a.heads // a.kv_heads
    scale = a.head_dim**-0.5
    out = torch.empty(a.batch, a.heads, len(rows), a.head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(a.batch, a.heads, len(rows), dtype=torch.float32, device=device)
    for h in range(a.heads):
        s = (q_rows[:, h].float() @ k[:, h // g].float().transpose(-1, -2)) * scale
        if not a.no_causal:
            s.masked_fill_(key_pos[None, None, :] > row_pos[None, :, None], -math.inf)
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l.masked_fill(torch.isinf(l), 0)[..., None])
        out[:, h], lse[:, h] = p @ v[:, h // g].float(), l
    del k, v
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out)
    dist.all_gather(lses, lse)
    return merge(outs, lses)


def rows_of_shards(out_local, S, rows, rank, world, layout, device):
    """The sampled rows of a sharded output, assembled on every rank: (B, H, len(rows), D) FP32."""
    pos = cp.shard(torch.arange(S, device=device), rank, world, layout, dim=0)
    want = torch.tensor(rows, device=device)
    mine = torch.isin(pos, want)
    res = torch.zeros(out_local.shape[0], out_local.shape[1], len(rows), out_local.shape[3], dtype=torch.float32,
                      device=device)
    res[:, :, torch.searchsorted(want, pos[mine])] = out_local[:, :, mine].float()
    dist.all_reduce(res)
    return res


# ---- communication alone -----------------------------------------------------------------------------------------

def comm_alone_ms(a, k, v, comm, device, reps=3) -> float:
    """The transfers of one call without compute: N-1 ring steps of this rank's K/V, or the two all-gathers."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return 0.0
    timer, times = Timer(device), []
    for _ in range(reps):
        dist.barrier()
        timer.start()
        if comm == "ring":
            cur, nxt = (k, v), (torch.empty_like(k), torch.empty_like(v))
            spare = (torch.empty_like(k), torch.empty_like(v))
            for _t in range(world - 1):
                ops = [dist.P2POp(dist.isend, cur[0], (rank + 1) % world), dist.P2POp(dist.isend, cur[1],
                                                                                       (rank + 1) % world),
                       dist.P2POp(dist.irecv, nxt[0], (rank - 1) % world), dist.P2POp(dist.irecv, nxt[1],
                                                                                      (rank - 1) % world)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                cur, nxt, spare = nxt, spare, cur
        else:
            for x in (k, v):
                buf = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=device)
                fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                fn(buf, x)
        times.append(timer.stop())
    return statistics.median(times)


# ---- cases -------------------------------------------------------------------------------------------------------

def local_fn(a):
    return attention_reference if a.cpu_smoke else None  # None: attn_lt.attention


def single_fits(a, S, device) -> tuple[bool, str]:
    if S > a.single_max_s:
        return False, f"S > --single-max-s {a.single_max_s}"
    need = S * a.batch * a.head_dim * 2 * (2 * a.heads + 2 * a.kv_heads) + (2 << 30)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > 0.9 * free:
            return False, f"needs {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    return True, ""


def run_single(a, S, backend, rows, ref, device, dtype, reps_for) -> dict:
    q, k, v = make_full(a, S, device, dtype)
    fn = local_fn(a)
    call = (lambda: fn(q, k, v, causal=not a.no_causal)) if fn else \
        (lambda: attn_lt.attention(q, k, v, causal=not a.no_causal, backend=backend))
    base = mem_reset(device)
    timer = Timer(device)
    timer.start()
    with tune_budget(a.warmup_tune_ms):
        out = call()
    warm = timer.stop()
    peak = mem_peak(device) - base
    err = rel_error(out[:, :, rows].float(), ref[0])
    del out
    reps = reps_for(warm)
    times = []
    for _ in range(reps):
        timer.start()
        with tune_budget(0):
            call()
        times.append(timer.stop())
    ms = statistics.median(times)
    per_rank = gather(ms)
    return {"mode": "1-GPU", "ranks": 1, "ms": per_rank[0], "ms_per_rank": per_rank, "reps": reps,
            "tflops": flops(a, S) / (per_rank[0] * 1e-3) / 1e12, "peak_gib": gather(peak / 2**30),
            "rel_err": err}


def run_mode(a, S, backend, mode, rows, ref, device, dtype, rank, world, reps_for) -> dict:
    layout, comm = mode.split("-")
    q, k, v = make_shards(a, S, rank, world, layout, device, dtype)
    opts = dict(causal=not a.no_causal, layout=layout, comm=comm, backend=backend)
    if local_fn(a):
        opts["local_attention"] = local_fn(a)
    base = mem_reset(device)
    timer = Timer(device)
    dist.barrier()
    timer.start()
    with tune_budget(a.warmup_tune_ms):
        out = cp.context_parallel_attention(q, k, v, **opts)
    warm = agree_max(timer.stop(), device)
    peak_abs = mem_peak(device) / 2**30
    peak = peak_abs - base / 2**30  # above the inputs and whatever was allocated before the call
    got = rows_of_shards(out, S, rows, rank, world, layout, device)
    err = rel_error(got, ref[0])
    del out
    reps = reps_for(warm)
    times, phases = [], []
    for _ in range(reps):
        trace = cp.CommTrace()
        dist.barrier()
        timer.start()
        with tune_budget(0):
            cp.context_parallel_attention(q, k, v, trace=trace, **opts)
        times.append(timer.stop())
        phases.append(trace.summary())
    ms = statistics.median(times)
    ph = {key: statistics.median(p.get(key, 0.0) for p in phases) for key in ("compute", "wait", "reorder", "check")}
    used = comm if comm != "auto" else cp.choose_comm(world, world * k.shape[2] * k.shape[0] * k.shape[1]
                                                      * k.shape[3] * 2 * k.element_size())
    alone = comm_alone_ms(a, k, v, used, device)
    per_rank = gather({"ms": ms, "peak_gib": peak_abs, "extra_gib": peak, **ph, "alone": alone})
    slow = max(r["ms"] for r in per_rank)
    exposed = max(r["wait"] + r["reorder"] for r in per_rank)
    hidden = max(0.0, max(r["alone"] for r in per_rank) - max(r["wait"] for r in per_rank))
    return {"mode": mode, "comm": used, "ranks": world, "ms": slow, "ms_per_rank": [r["ms"] for r in per_rank],
            "reps": reps, "tflops": flops(a, S) / (slow * 1e-3) / 1e12,
            "compute_ms_per_rank": [r["compute"] for r in per_rank], "exposed_comm_ms": exposed,
            "wait_ms_per_rank": [r["wait"] for r in per_rank], "reorder_ms_per_rank": [r["reorder"] for r in per_rank],
            "check_ms": max(r["check"] for r in per_rank), "comm_alone_ms": max(r["alone"] for r in per_rank),
            "hidden_comm_ms": hidden, "peak_gib": [r["peak_gib"] for r in per_rank],
            "extra_gib": [r["extra_gib"] for r in per_rank], "rel_err": err}


# ---- report ------------------------------------------------------------------------------------------------------

def metadata(a, argv, world, device) -> dict:
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "world": world,
            "shape": {"B": a.batch, "Hq": a.heads, "Hkv": a.kv_heads, "D": a.head_dim, "dtype": "bf16",
                      "causal": not a.no_causal},
            "seed": a.seed, "torch": torch.__version__,
            "command": "tools/bench_cp.py " + " ".join(shlex.quote(x) for x in argv),
            "nccl_env": {k: v for k, v in sorted(os.environ.items())
                         if k.startswith(("NCCL_", "TORCH_NCCL", "TORCH_SYMM", "NVSHMEM"))},
            "allgather_max_kv_bytes": cp.ALLGATHER_MAX_KV_BYTES}
    if device.type == "cuda":
        try:
            from attn_lt.cli import environment

            meta["environment"] = environment()
        except Exception as e:  # the record is best effort; the run goes on
            meta["environment"] = f"unavailable: {type(e).__name__}: {e}"
        meta["gpu"] = torch.cuda.get_device_name(device)
        v = torch.cuda.nccl.version()
        meta["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return meta


def table(rows) -> str:
    head = ("S", "backend", "mode", "GPUs", "ms", "TFLOP/s", "/GPU", "eff", "baseline", "exposed ms",
            "hidden ms", "peak GiB", "rel err", "check")
    lines = [head]
    for r in rows:
        if r.get("status") != "ok":
            lines.append((str(r["S"]), r["backend"], r["mode"], "", r.get("status", ""), r.get("reason", "")[:60],
                          *[""] * 8))
            continue
        eff = f"{100 * r['efficiency']:.1f}%" if r.get("efficiency") is not None else "-"
        peak = max(r["peak_gib"]) if isinstance(r["peak_gib"], list) else r["peak_gib"]
        lines.append((str(r["S"]), r["backend"], r["mode"], str(r["ranks"]), f"{r['ms']:.1f}",
                      f"{r['tflops']:.1f}", f"{r['tflops'] / r['ranks']:.1f}", eff,
                      str(r.get("baseline_s", "-")), f"{r['exposed_comm_ms']:.1f}" if "exposed_comm_ms" in r else "-",
                      f"{r['hidden_comm_ms']:.1f}" if "hidden_comm_ms" in r else "-", f"{peak:.1f}",
                      f"{r['rel_err']:.2e}", r.get("check", "")))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines)


def plan(a, world: int) -> str:
    lines = [f"world {world}, B{a.batch} Hq{a.heads} Hkv{a.kv_heads} D{a.head_dim} bf16 "
             f"{'non-causal' if a.no_causal else 'causal'}"]
    for S in a.seqlens:
        kv = S * a.batch * a.kv_heads * a.head_dim * 2 * 2
        qo = S * a.batch * a.heads * a.head_dim * 2 * 2
        modes = a.modes if S <= a.single_max_s else a.long_modes
        lines.append(f"S={S}: {flops(a, S) / 1e15:.2f} PFLOP; one GPU {'yes' if S <= a.single_max_s else 'no'} "
                     f"({(qo + kv) / 2**30:.1f} GiB of q, k, v, out); per GPU: ring "
                     f"{(qo + (1 + min(2, world - 1)) * kv) / world / 2**30:.1f}"
                     f" GiB + FP32 acc {qo / world / 2**30:.1f}, all-gather {(qo / world + 2.5 * kv) / 2**30:.1f} "
                     f"GiB; modes {','.join(modes)}; backends {','.join(a.backends)}; choose_comm -> "
                     f"{cp.choose_comm(world, kv)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.plan:
        print(plan(a, a.world))
        return 0
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("bench_cp: no CUDA GPU visible (use --plan, or --cpu-smoke to exercise the script on CPU)",
              file=sys.stderr)
        return 2
    rank, world, device = setup(a)
    dtype = torch.bfloat16
    if a.seed is None:
        a.seed = int(agree_max(int(time.time() * 1000) % (2**31), device))
    t_start = time.monotonic()
    meta = metadata(a, argv, world, device) if rank == 0 else None
    rows_out: list[dict] = []
    failed = False

    def save():
        if rank == 0:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "results.json"), "w") as f:
                json.dump({"metadata": meta, "rows": rows_out}, f, indent=1)

    def reps_for(warm_ms: float) -> int:
        warm_ms = agree_max(warm_ms, device)
        return max(1, min(a.reps, int(a.case_budget_s * 1e3 / max(warm_ms, 1e-3)) - 1))

    baseline: dict[str, tuple[int, float]] = {}  # backend -> (S, one-GPU TFLOP/s) of the longest S measured
    for S in a.seqlens:
        if S % (2 * world):
            rows_out.append({"S": S, "backend": "-", "mode": "-", "status": "skipped",
                             "reason": f"S not divisible by 2 x {world} ranks"})
            continue
        rows = sample_rows(a, S, world)
        ref = reference_rows(a, S, rows, device, dtype, rank, world)
        for backend in a.backends:
            fits, why = single_fits(a, S, device)
            fits = agree_max(0.0 if fits else 1.0, device) == 0.0
            modes = a.modes if S <= a.single_max_s else a.long_modes
            cases = (["1-GPU"] if fits else []) + modes
            single_err = None
            for mode in cases:
                over = agree_max(time.monotonic() - t_start, device) > a.time_limit_s
                row = {"S": S, "backend": backend, "mode": mode}
                if over:
                    rows_out.append({**row, "status": "skipped", "reason": f"--time-limit-s {a.time_limit_s}"})
                    continue
                # no OOM recovery: a rank that fails inside a collective would leave the others waiting, so a
                # failure ends the run (torchrun stops every rank); results.json keeps the finished cases
                if mode == "1-GPU":
                    r = run_single(a, S, backend, rows, ref, device, dtype, reps_for)
                    single_err = r["rel_err"]
                    baseline[backend] = (S, r["tflops"])
                    r.update(efficiency=1.0, baseline_s=S, bound=CHECK_TOL)
                else:
                    r = run_mode(a, S, backend, mode, rows, ref, device, dtype, rank, world, reps_for)
                    if backend in baseline:
                        bs, rate = baseline[backend]
                        r.update(efficiency=r["tflops"] / (world * rate), baseline_s=bs)
                    r["bound"] = 2 * single_err + 1e-3 if single_err is not None else CHECK_TOL
                ok = math.isfinite(r["rel_err"]) and r["rel_err"] <= r["bound"]
                r["check"] = "ok" if ok else f"FAIL (> {r['bound']:.1e})"
                failed |= not ok
                rows_out.append({**row, "status": "ok", **r})
                if rank == 0:
                    last = rows_out[-1]
                    print(f"[{time.monotonic() - t_start:6.1f}s] S={S} {backend} {mode}: "
                          + (f"{last['ms']:.1f} ms, {last['tflops']:.1f} TFLOP/s, err {last['rel_err']:.2e}"
                             if last["status"] == "ok" else f"{last['status']} ({last.get('reason', '')})"),
                          flush=True)
                save()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        meta["wall_s"] = round(time.monotonic() - t_start, 1)
        if baseline:
            meta["baseline_note"] = ("efficiency = rate on N GPUs / (N x one-GPU rate); for S above the longest "
                                     "one-GPU run, that run's rate is the baseline (column 'baseline')")
        save()
        print(f"\ncontext parallelism: {meta['world']} ranks, B{a.batch} Hq{a.heads} Hkv{a.kv_heads} D{a.head_dim}"
              f" bf16 {'causal' if not a.no_causal else 'non-causal'}; results in {a.out}/results.json")
        print(table(rows_out))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
