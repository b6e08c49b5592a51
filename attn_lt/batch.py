"""Serving batches: packed (varlen) sequences and a paged KV cache, with lengths as device data.

FlashAttention's conventions, so that engines written for it plug in::

    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=..., max_seqlen_k=...)
    out = paged_attention(q, k_cache, v_cache, block_table, seqlens_k)

The kernels read the lengths and block tables from device memory: one launch, planned for a capacity (the number
of requests and ``max_seqlen_q`` / ``max_seqlen_k``), serves any lengths within it, so a CUDA graph captured once
replays correctly while requests grow, join and leave. A request of at most 16 rows a kv head (decode, speculative
decoding; on an FP8 cache up to 64, a 16-row block for each 16) runs on decode blocks whose keys are cut into parts
of a fixed size (:func:`plan_batch`), merged by LSE; longer requests (prefill chunks) on row blocks. MLA decode
(q/k head dim 576, v the first 512 columns of a paged latent cache) runs on the Hopper MLA kernel, its keys in parts
likewise. Device metadata is never trusted: kernels
stay inside the tensors, record what was wrong in a device flag, and ``check=True`` (or :func:`check_batch_errors`)
raises with it. Inside ``torch.compile`` the two calls are custom ops (``attn_lt::varlen_attention``,
``attn_lt::paged_attention``) and take every argument but ``out``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass

import torch

from . import native
from .device import stream_queries
from .fused import (ASSUMED_DEVICE, MAX_DECODE_ROWS, MLA_DECODE, MLA_ROWS, DeviceFacts, device_facts,
                    fp8_converted, fp8_kv_why)
from .validate import (FP8_KV_DTYPE, call_results, check_causal, check_kv_descale, check_options, check_scale,
                       check_variants, descale_tensor, op_results, op_variants)

log = logging.getLogger("attn_lt")

#: Head dims the batch kernels run (q·k = v), and MLA decode's (q·k 576, v 512: a paged latent cache, v = k's first
#: 512 columns, one query row a request, Hopper).
BATCH_HEAD_DIMS = (64, 128, 256)
LATENT_DIMS = MLA_DECODE
#: MLA decode: the smallest block size (a key tile of 64 rows lies in one block), and the parts of the keys, sized so
#: that a batch at capacity gives about this many CTAs an SM (one CTA an SM: 226 KB of shared memory), of at least
#: MLA_SPLIT_MIN_KEYS keys (a part reads its 64 query heads' 72 KB Q once and writes 128 KB of FP32 partials a
#: 64 heads).
MLA_MIN_BLOCK_SIZE, MLA_SPLIT_WAVES, MLA_SPLIT_MIN_KEYS = 64, 2, 1024
#: Rows a kv head (query rows × Hq / Hkv) up to which a request runs on decode blocks (native/batch.cuh's
#: kBatchSmallRows).
SMALL_ROWS = 16
#: Keys a tile of native/flash.cu; a part of a split request has at least SPLIT_MIN_KEYS of them.
KEY_TILE, SPLIT_MIN_KEYS = 64, 256
#: The decode blocks' parts are sized so that a batch at capacity gives about SPLIT_WAVES CTAs a CTA slot
#: (DECODE_CTAS_PER_SM an SM): enough short CTAs that requests of different lengths even out over the SMs. A batch of
#: at most half as many (request, kv head) pairs as slots has parts of at least PART_KEYS keys where that still fills
#: every slot once: there the waves rule gives parts of a few tiles, whose fixed costs (the first tiles' latency, the
#: partial rows and their merge) outweigh their keys (docs/performance.md, "Small batches").
SPLIT_WAVES, PART_KEYS = 8, 2048
#: CTA slots an SM that the decode blocks' parts are planned for (two 16-bit decode blocks fit an SM).
DECODE_CTAS_PER_SM = 2
#: The largest head dim whose requests past 16 rows a kv head run on one group block of the decode grid (a 16-bit
#: cache; native/flash.cu's kGroupBlocks): D 256, and an FP8 cache, run a 16-row decode block for each 16.
GROUP_BLOCK_MAX_D = 128
MAX_PARTS = 1024
#: Most bytes the decode blocks' FP32 partials may take.
MAX_PARTIAL_BYTES = 256 << 20
#: Block sizes a paged cache may have: powers of two in this range.
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class BatchPlan:
    """How a serving batch runs, fixed by its capacity: the decode blocks' part size (``split_keys``, 0: whole),
    the rows a kv head they take, the row blocks' kernel (None when no request can have more), and the workspace
    the partials take."""

    kind: str  # "varlen" | "paged"
    requests: int
    Hq: int
    Hkv: int
    D: int
    Dv: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int  # 0 for varlen
    split_keys: int
    parts: int
    row_kernel: str | None  # "sm90" | "flash" | None
    decode_blocks: bool
    facts: DeviceFacts
    assumed_device: bool
    decode_rows: int = SMALL_ROWS  # rows a kv head on decode blocks (_decode_rows)
    split_rule: str = ""  # what set split_keys (explain's words)

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv

    @property
    def latent(self) -> bool:
        """MLA decode on a paged latent cache."""
        return (self.D, self.Dv) == LATENT_DIMS

    @property
    def partial_rows(self) -> int:
        """Rows of FP32 partials a part (see :func:`_partial_rows`)."""
        return _partial_rows(self.latent, self.requests, self.Hq, self.Hkv, self.decode_rows)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the partials (outputs, then their LSEs) when the keys are split, else 0."""
        return self.parts * self.partial_rows * (self.Dv + 1) * 4 if self.parts > 1 else 0

    def to_dict(self) -> dict:
        return {"kind": self.kind, "requests": self.requests, "heads_q": self.Hq, "heads_kv": self.Hkv,
                "head_dim": self.D, "head_dim_v": self.Dv, "max_seqlen_q": self.max_seqlen_q, "max_seqlen_k": self.max_seqlen_k,
                "block_size": self.block_size, "decode_blocks": self.decode_blocks, "split_keys": self.split_keys,
                "parts": self.parts, "split_rule": self.split_rule, "row_kernel": self.row_kernel,
                "decode_rows": self.decode_rows,
                "workspace_bytes": self.workspace_bytes,
                "sms": self.facts.sms, "assumed_device": self.assumed_device}

    def __str__(self) -> str:
        g = self.group
        cache = f"paged cache, blocks of {self.block_size} keys" if self.kind == "paged" else "packed keys"
        dims = f"D {self.D}" if self.Dv == self.D else f"D {self.D} / Dv {self.Dv} (v in k: an MLA latent cache)"
        lines = [f"{self.kind} batch: up to {self.requests} requests of up to {self.max_seqlen_q} query rows and "
                 f"{self.max_seqlen_k} keys, Hq {self.Hq} / Hkv {self.Hkv}, {dims}, {cache}; lengths and "
                 "block tables read on the device (one launch serves every step within this capacity)"]
        slots = DECODE_CTAS_PER_SM * self.facts.sms
        if self.latent:
            blocks = -(-g // MLA_ROWS)
            ctas = self.requests * self.Hkv * blocks * self.parts
            split = (f"keys in parts of {self.split_keys} ({self.parts} at capacity, {ctas} CTAs for "
                     f"{self.facts.sms} SMs when every request is full; a request uses ceil(keys / {self.split_keys}) "
                     f"of them, one part writes its output directly), partials merged by LSE "
                     f"({self.workspace_bytes / 2**20:.1f} MiB)" if self.parts > 1
                     else "keys whole (enough CTAs without a split)")
            lines.append(f"MLA decode blocks of native/flash_sm90.cu (wgmma, TMA; {MLA_ROWS} query heads a CTA, "
                         f"{blocks} a kv head; each 64-key tile of the latent cache read once as K and V), {split}")
        elif self.decode_blocks:
            ctas = self.requests * self.Hkv * self.parts
            split = (f"keys in parts of {self.split_keys} ({self.split_rule}: {self.parts} at capacity, {ctas} CTAs "
                     f"for {slots} slots when every request is full; a request uses ceil(keys / {self.split_keys}) of "
                     f"them, one part writes its output directly), partials merged by LSE "
                     f"({self.workspace_bytes / 2**20:.1f} MiB)" if self.parts > 1
                     else "keys whole (enough CTAs without a split)")
            n = self.decode_rows
            blocks = "16-row decode blocks of native/flash.cu (mma.sync, the four warps splitting each key tile)"
            sixteen = f"{n // 16} blocks of 16 rows a kv head, reading the same key tiles"
            if n > SMALL_ROWS and self.D <= GROUP_BLOCK_MAX_D:
                blocks = (f"up to 16 rows on {blocks}, more on one group block a kv head that reads each key tile "
                          "once (up to 32 rows: two warps on each 16, splitting the tile; up to 64: a warp an m16 "
                          f"tile) (an FP8 cache: {sixteen})")
            elif n > SMALL_ROWS:
                blocks = f"{blocks}, {sixteen}"
            lines.append(f"requests of at most {n} rows a kv head (query rows x {g}): {blocks}, {split}")
        else:
            lines.append(f"no decode blocks: {g} query heads a kv head exceed {MAX_DECODE_ROWS} rows")
        if self.row_kernel is None:
            lines.append(f"no row blocks: no request can have more than {self.decode_rows} rows a kv head")
        else:
            name = ("native/flash_sm90.cu (wgmma, TMA)" if self.row_kernel == "sm90"
                    else "native/flash.cu (mma.sync)")
            why = "" if self.row_kernel == "sm90" else " (no Hopper kernel here)"
            lines.append(f"longer requests (prefill chunks): row blocks of {name}{why}, keys whole")
        if self.assumed_device:
            lines.append(f"(no GPU here: planned for a {self.facts.sms}-SM Hopper GPU)")
        return "\n".join(lines)


def plan_batch(requests: int, Hq: int, Hkv: int, D: int, *, max_seqlen_q: int, max_seqlen_k: int,
               block_size: int = 0, Dv: int | None = None, facts: DeviceFacts | None = None) -> BatchPlan:
    """The launch plan of a batch of this capacity (no GPU work; without a GPU, for :data:`ASSUMED_DEVICE`).
    ``block_size`` > 0: a paged cache. ``Dv``: v's head dim (default D; 512 with D 576: MLA decode). The same for a
    16-bit and an FP8 cache (whose decode blocks take every request, or which is converted first)."""
    assumed = False
    if facts is None:
        facts = device_facts()
        if facts is None:
            facts, assumed = ASSUMED_DEVICE, True
    return _plan(requests, Hq, Hkv, D, D if Dv is None else Dv, max_seqlen_q, max_seqlen_k, block_size, facts,
                 assumed)


def _partial_rows(latent: bool, requests: int, Hq: int, Hkv: int, rows: int = SMALL_ROWS) -> int:
    """Rows of FP32 partials a part: (request, kv head, decode-block row; ``rows`` of them, :func:`_decode_rows`), or
    (request, query head) for MLA."""
    return requests * (Hq if latent else Hkv * rows)


def _split(max_k: int, size: int, part_bytes: int, max_parts: int) -> tuple[int, int]:
    """(split_keys, parts) for parts of ``size`` keys, the size doubled until at most ``max_parts`` parts whose
    partials fit MAX_PARTIAL_BYTES; (0, 1) when one part holds every key."""
    while -(-max_k // size) > 1 and (-(-max_k // size) > max_parts
                                     or -(-max_k // size) * part_bytes > MAX_PARTIAL_BYTES):
        size *= 2
    parts = -(-max_k // size)
    return (size, parts) if parts > 1 else (0, 1)


def _mla_plan(requests, Hq, Hkv, Dv, max_k, block_size, facts, assumed) -> BatchPlan:
    row_blocks = -(-(Hq // Hkv) // MLA_ROWS)
    size = max(MLA_SPLIT_MIN_KEYS, -(-max_k * requests * Hkv * row_blocks // (MLA_SPLIT_WAVES * facts.sms)))
    size = -(-max_k // -(-max_k // size))  # that many parts, of even sizes
    size = -(-size // KEY_TILE) * KEY_TILE
    split_keys, parts = _split(max_k, size, _partial_rows(True, requests, Hq, Hkv) * (Dv + 1) * 4,
                               65535 // row_blocks)
    return BatchPlan("paged", requests, Hq, Hkv, LATENT_DIMS[0], Dv, 1, max_k, block_size, split_keys, parts, None,
                     True, facts, assumed)


@functools.lru_cache(maxsize=1024)
def _plan(requests, Hq, Hkv, D, Dv, max_q, max_k, block_size, facts, assumed) -> BatchPlan:
    _check_capacity(requests, Hq, Hkv, D, max_q, max_k, block_size, Dv)
    if (D, Dv) == LATENT_DIMS:
        return _mla_plan(requests, Hq, Hkv, Dv, max_k, block_size, facts, assumed)
    g = Hq // Hkv
    rows_kv = _decode_rows(g, max_q)
    decode = g <= rows_kv
    row_kernel = None
    if g * max_q > rows_kv:
        row_kernel = "sm90" if facts.hopper else "flash"
    split_keys, parts = 0, 1
    if decode:
        # parts of a fixed size, so that every request's CTAs take about the same time whatever its length (a CTA
        # a request, kv head and part; an FP8 cache's many-row requests run one for each 16 rows)
        slots, pairs = DECODE_CTAS_PER_SM * facts.sms, requests * Hkv
        size = -(-max_k * pairs // (SPLIT_WAVES * slots))
        rule = f"about {SPLIT_WAVES} CTAs a slot"
        fill = slots // pairs  # parts whose CTAs fill the slots once at capacity
        long_parts = min(PART_KEYS, -(-max_k // fill)) if fill >= 2 else 0
        if long_parts > size:
            size = long_parts
            rule = (f"{pairs} (request, kv head) pairs for {slots} slots: parts of {PART_KEYS} keys, shorter where "
                    "one wave of those would leave slots empty")
        size = max(SPLIT_MIN_KEYS, -(-size // KEY_TILE) * KEY_TILE)
        split_keys, parts = _split(max_k, size, _partial_rows(False, requests, Hq, Hkv, rows_kv) * (D + 1) * 4,
                                   MAX_PARTS)
    return BatchPlan("paged" if block_size else "varlen", requests, Hq, Hkv, D, D, max_q, max_k, block_size,
                     split_keys, parts, row_kernel, decode, facts, assumed, rows_kv, rule if parts > 1 else "")


def clear_plan_cache() -> None:
    """Forget the plans made so far, so that the next ones follow this module's planner constants as they are now
    (benchmarks that vary SPLIT_WAVES, PART_KEYS, SPLIT_MIN_KEYS or MLA_SPLIT_WAVES)."""
    _plan.cache_clear()


def explain_batch(requests: int, heads_q: int, heads_kv: int, head_dim: int, *, max_seqlen_q: int,
                  max_seqlen_k: int, block_size: int = 0, head_dim_v: int | None = None,
                  return_key_mass: bool = False, kv_dtype: torch.dtype | None = None) -> str:
    """How a varlen (``block_size`` 0) or paged batch of this capacity runs on the current GPU (or, without one, an
    H100): the kernels, the split of the keys and why; with ``kv_dtype`` torch.float8_e4m3fn, how an FP8 cache is
    read; with ``return_key_mass``, how the mass per key is made. ``head_dim_v`` 512 with ``head_dim`` 576: MLA
    decode on a paged latent cache. No GPU work."""
    if kv_dtype is not None and kv_dtype != FP8_KV_DTYPE and kv_dtype not in _DTYPES:
        raise TypeError(f"kv_dtype must be torch.float16, torch.bfloat16 or {FP8_KV_DTYPE}, got {kv_dtype}")
    plan = plan_batch(requests, heads_q, heads_kv, head_dim, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      block_size=block_size, Dv=head_dim_v)
    return (str(plan) + ("\n" + fp8_line(plan, return_key_mass) if kv_dtype == FP8_KV_DTYPE else "")
            + ("\n" + mass_line(plan) if return_key_mass else ""))


def fp8_line(plan: BatchPlan, want_mass: bool = False) -> str:
    """How a batch of ``plan``'s capacity reads an FP8 cache (:func:`explain_batch`'s line for it)."""
    if _fp8_converted(plan.max_seqlen_q, plan.Hq, plan.Hkv, plan.D, plan.Dv, want_mass):
        return (f"K/V: an FP8 KV cache with prefill rows (more than {MAX_DECODE_ROWS} query rows a kv head at "
                "capacity) or the mass of many-row requests: converted to q's dtype first (each element times its "
                "descale factor, in FP32, rounded once, one kernel reading the FP8 bytes once), then the 16-bit "
                "kernels run; "
                + ("the blocks each request's keys use, in a new buffer of 1 + B x max_blocks blocks each call "
                   f"(x {plan.block_size} x Hkv x (D + Dv) x 2 bytes)" if plan.kind == "paged" else
                   "all of k and v (a new buffer of total_k x Hkv x (D + Dv) x 2 bytes each call)")
                + f". Calls of up to {MAX_DECODE_ROWS} rows a kv head read the FP8 bytes: "
                + fp8_kv_why(plan.D, plan.Dv))
    return "K/V: " + fp8_kv_why(plan.D, plan.Dv)


def mass_line(plan: BatchPlan) -> str:
    """How ``return_key_mass`` runs for a batch of ``plan``'s capacity (what varlen_attention / paged_attention do;
    :func:`explain_batch`'s last line when it is asked for)."""
    if plan.latent:
        return "mass per key: not available for MLA decode"
    layout = (f"FP32 (B, Hq, max_seqlen_k), {plan.requests * plan.Hq * plan.max_seqlen_k * 4 / 2**20:.1f} MiB"
              if plan.kind == "paged" else "FP32 (Hq, total_k), at each key's packed column")
    ways = []
    if plan.decode_blocks:
        ways.append("one-row requests from the scores their decode blocks store (4 bytes a head and key written, "
                    "then read and written once more: no second read of K)")
    if plan.max_seqlen_q > 1 or not plan.decode_blocks:
        ways.append("the other requests by a pass over their keys that recomputes the summed rows' scores from the "
                    "call's LSE (native/flash.cu attn_lt_batch_key_mass; key_mass_window: each request's last rows)")
    return f"mass per key ({layout}): " + "; ".join(ways)


# ---- validation (no GPU work) -----------------------------------------------------------------------------------

def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int (a capacity on the host, not a tensor), got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return x


def _check_capacity(requests, Hq, Hkv, D, max_q, max_k, block_size, Dv=None) -> None:
    for name, x in (("requests", requests), ("heads_q", Hq), ("heads_kv", Hkv), ("max_seqlen_q", max_q),
                    ("max_seqlen_k", max_k)):
        _positive_int(name, x)
    if Hq % Hkv:
        raise ValueError(f"heads_q {Hq} is not a multiple of heads_kv {Hkv}")
    Dv = D if Dv is None else Dv
    if (D, Dv) == LATENT_DIMS:
        if not block_size or block_size < MLA_MIN_BLOCK_SIZE or max_q != 1:
            raise ValueError(f"MLA decode (head dims {D}/{Dv}) runs on a paged latent cache with blocks of at least "
                             f"{MLA_MIN_BLOCK_SIZE} keys and one query row a request; got block_size {block_size}, "
                             f"max_seqlen_q {max_q}")
    elif D not in BATCH_HEAD_DIMS or Dv != D:
        raise ValueError(f"head dim {D} (v {Dv}) is not one the batch kernels run: D = Dv in {BATCH_HEAD_DIMS}, or "
                         f"{LATENT_DIMS[0]} with v {LATENT_DIMS[1]} (MLA decode on a paged latent cache)")
    if max_q >= 2**30 or max_k >= 2**30 or max_q * (Hq // Hkv) >= 2**30:
        raise ValueError(f"max_seqlen_q {max_q} (x {Hq // Hkv} query heads a kv head) and max_seqlen_k {max_k} "
                         "must be below 2**30")
    if requests * Hkv > 65535 or Hq > 65535:
        raise ValueError(f"{requests} requests x {Hkv} kv heads, and {Hq} query heads, must be at most 65535 (the "
                         "grid's range)")
    if block_size and (block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE):
        raise ValueError(f"block_size {block_size} must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}")


def _check_latent(k, v, names: tuple[str, str]) -> None:
    """MLA decode reads one latent cache as K and V: v must be k's first columns (its address and strides)."""
    try:
        same = v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
    except RuntimeError:  # fake tensors while torch.compile traces have no address: checked when the op runs
        return
    if not same:
        raise ValueError(f"MLA decode (head dims {LATENT_DIMS[0]}/{LATENT_DIMS[1]}) reads one latent cache as K and V: "
                         f"{names[1]} must be {names[0]}[..., :{LATENT_DIMS[1]}] (the same memory); got {names[0]} "
                         f"{_shape(k)}, {names[1]} {_shape(v)} at different addresses or strides")


def _check_latent_device(facts: DeviceFacts, device) -> None:
    if not facts.hopper:
        raise ValueError(f"MLA decode (head dims {LATENT_DIMS[0]}/{LATENT_DIMS[1]}) on a paged cache runs on the Hopper "
                         f"kernel only; {device} is not a Hopper GPU with it (attn_lt.attention() runs MLA on a dense "
                         "cache)")


def _check_data(q, k, v, names: tuple[str, str, str], kv_dims: int) -> tuple[str, int, int, int, int]:
    """Types, dtypes and dims of q, k, v (k and v in q's dtype, or both FP8: :func:`_kv_fp8`); returns (q's dtype,
    Hq, Hkv, D, Dv)."""
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"{names[0]} has dtype {q.dtype}; the batch kernels take torch.float16 and torch.bfloat16")
    if k.dtype != v.dtype or k.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise TypeError(f"{names[1]} and {names[2]} must have {names[0]}'s dtype, or both {FP8_KV_DTYPE} (an FP8 KV "
                        f"cache); got {q.dtype}, {k.dtype}, {v.dtype}")
    shapes = f"{names[0]} {_shape(q)}, {names[1]} {_shape(k)}, {names[2]} {_shape(v)}"
    if q.dim() != 3 or k.dim() != kv_dims or v.dim() != kv_dims:
        layout = "(total_k, Hkv, D)" if kv_dims == 3 else "(num_blocks, block_size, Hkv, D)"
        raise ValueError(f"{names[0]} must be 3-D (rows, Hq, D) and {names[1]}, {names[2]} {kv_dims}-D {layout}; "
                         f"got {shapes}")
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[-2]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{names[1]} and {names[2]} must agree in every dim but the last; got {shapes}")
    Dv = v.shape[-1]
    if (D, Dv) == LATENT_DIMS and k.shape[-1] == D and kv_dims == 4:
        _check_latent(k, v, names[1:])
    elif k.shape[-1] != D or Dv != D:
        raise ValueError(f"head dims must agree (q·k = v = D; the batch kernels take D in {BATCH_HEAD_DIMS}, and "
                         f"{LATENT_DIMS[0]}/{LATENT_DIMS[1]} for MLA decode on a paged latent cache); got {shapes}")
    elif D not in BATCH_HEAD_DIMS:
        raise ValueError(f"head dim {D} not in {BATCH_HEAD_DIMS} (the batch kernels' head dims); got {shapes}")
    if Hkv < 1 or Hq < 1 or Hq % Hkv:
        raise ValueError(f"Hq ({Hq}) must be a positive multiple of Hkv ({Hkv}); got {shapes}")
    if q.shape[0] >= 2**31 or k.shape[0] >= 2**31:
        raise ValueError(f"{names[0]} and {names[1]} must have fewer than 2**31 rows (blocks); got {shapes}")
    return _DTYPES[q.dtype], Hq, Hkv, D, Dv


def _kv_fp8(k) -> bool:
    """Whether k (and v, checked alike) is an FP8 KV cache."""
    return k.dtype == FP8_KV_DTYPE


def _fp8_converted(max_q: int, Hq: int, Hkv: int, D: int, Dv: int, want_mass: bool = False) -> bool:
    """Whether a batch of this capacity converts its FP8 KV cache first (:func:`attn_lt.fused.fp8_converted`; the
    buffers: :func:`_fp8_buffers`): prefill rows, or the mass of requests that the stored scores do not give (more
    than one row, or a group past one 16-row decode block)."""
    g = Hq // Hkv
    return fp8_converted(max_q * g, D, Dv, want_mass and (max_q != 1 or g > SMALL_ROWS))


def _decode_rows(g: int, max_q: int) -> int:
    """Rows a kv head a batch's decode blocks take, and the rows a (request, kv head) of their partials
    (native/attn_lt.h's attn_lt_batch_args::decode_rows), for groups of ``g`` query heads and up to ``max_q`` query
    rows a request: the rows a kv head at capacity (speculative decoding) where they are at most
    :data:`attn_lt.fused.MAX_DECODE_ROWS`, every request on decode blocks; else (prefill rows, which run on row
    blocks) one row's ``g``; rounded up to 16 (16 when more than MAX_DECODE_ROWS: no decode blocks). Only the rows a
    request has run, so more decode rows than it needs cost the grid's empty blocks and the parts' size, not work."""
    rows = g * max_q if g * max_q <= MAX_DECODE_ROWS else g
    return -(-max(rows, SMALL_ROWS) // 16) * 16 if rows <= MAX_DECODE_ROWS else SMALL_ROWS


def _fp8_buffers(k, dtype, block_table=None) -> tuple:
    """The buffers an FP8 KV cache is converted into for the 16-bit kernels (native/attn_lt.h's
    attn_lt_batch_convert_kv, launched by :func:`_run`): k and v in ``dtype``, packed as k, or, for a paged cache,
    1 + B x max_blocks blocks (block 0 zeros) with the table of their places. Returns (k, v, table or None)."""
    shape = tuple(k.shape) if block_table is None else (1 + block_table.numel(),) + tuple(k.shape[1:])
    table = None if block_table is None else torch.empty(block_table.shape, dtype=torch.int32, device=k.device)
    return torch.empty(shape, dtype=dtype, device=k.device), torch.empty(shape, dtype=dtype, device=k.device), table


def _check_index(name: str, t, shape_hint: str, dims: int, length: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32, on the device), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if t.dim() != dims or (length is not None and t.shape[0] != length):
        raise ValueError(f"{name} must be {shape_hint}; got {_shape(t)}")


def _check_devices(named: dict) -> torch.device:
    dev = next(iter(named.values())).device
    if dev.type != "cuda":
        raise ValueError(f"the batch calls run on a CUDA device; {next(iter(named))} is on {dev}")
    for name, t in named.items():
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, not on {dev} with the others")
    return dev


def _rows_ok(t, dims_major: int) -> bool:
    """The layout the kernels read: last dim contiguous, the other strides whole 16-byte chunks (8 elements of fp16,
    16 of FP8), 16-byte aligned."""
    return (t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:dims_major])
            and t.data_ptr() % 16 == 0)


def _readable(name: str, t, copy: bool):
    dims = t.dim() - 1
    if _rows_ok(t, dims):
        return t
    if not copy:
        raise ValueError(f"{name} {_shape(t)} with strides {t.stride()} is not a layout the kernels read (last dim "
                         "contiguous, other strides whole 16-byte chunks, 16-byte aligned); a cache is never copied")
    log.debug("%s %s with strides %s copied to a contiguous tensor", name, _shape(t), t.stride())
    return t.clone(memory_format=torch.contiguous_format)  # (a fresh, aligned copy even of a contiguous view)


def _check_out_type(out, dtype) -> None:
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != dtype):
        raise TypeError(f"out must be a torch.Tensor of {dtype}, got {getattr(out, 'dtype', type(out).__name__)}")


def _check_out(out, shape: tuple, dtype, device):
    if out is None:
        return None
    _check_out_type(out, dtype)
    if tuple(out.shape) != shape or out.device != device:
        raise ValueError(f"out must be {shape} on {device}; got {_shape(out)} on {out.device}")
    if not (out.stride(-1) == 1 and out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0 and out.data_ptr() % 16 == 0):
        raise ValueError(f"out {_shape(out)} with strides {out.stride()} is not a layout the kernels write")
    return out


# ---- the device error flag --------------------------------------------------------------------------------------

_error_flags: dict[int, torch.Tensor] = {}
_error_flags_lock = threading.Lock()


def _error_flag(device: torch.device, capturing: bool) -> torch.Tensor:
    """The GPU's error flag (one int32 every batch call on it ORs its failures into, whatever its stream)."""
    flag = _error_flags.get(device.index)
    if flag is None:
        if capturing:
            raise RuntimeError("the batch calls keep an error flag on each GPU, made on the first call outside CUDA "
                               "graph capture: make one eager call (as engines do to warm up) before capturing")
        with _error_flags_lock:
            flag = _error_flags.get(device.index)
            if flag is None:
                flag = _error_flags[device.index] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def describe_errors(bits: int) -> list[str]:
    """What each bit of a batch error flag means (native/attn_lt.h's attn_lt_batch_error)."""
    return [text for bit, text in native.BATCH_ERRORS.items() if bits & bit]


def check_batch_errors(device=None) -> None:
    """Raise ``ValueError`` if a batch call on ``device`` (default: the current one) met bad metadata since the last
    check, and clear the record: one synchronisation of the current stream (calls and graph replays on other
    streams are seen once that stream has waited for them). The kernels never read outside their tensors whatever
    the metadata says: a request with bad lengths gets no keys (zeros, LSE -inf) or writes nothing, and keys in a
    block whose id is out of range are not attended."""
    dev = None if device is None else torch.device(device)
    index = torch.cuda.current_device() if dev is None or dev.index is None else dev.index
    flag = _error_flags.get(index)
    if flag is None:
        return
    with torch.cuda.device(index):
        seen = flag.clone()  # read and cleared in stream order: a failure after the read stays for the next check
        flag.zero_()
        bits = int(seen.item())
    if bits:
        raise ValueError("bad serving-batch metadata: " + "; ".join(describe_errors(bits)))


# ---- the calls --------------------------------------------------------------------------------------------------

def _plan_args(plan: BatchPlan, dtype: str, scale: float, causal: bool, flag, workspace) -> "native.BatchArgs":
    """The launch arguments the plan fixes: capacity, shape, options, error flag and workspace (the partials: outputs,
    then their LSEs, native/attn_lt.h checks the layout); the tensors and metadata are set by :func:`_set_tensors`
    and :func:`_set_metadata`."""
    a = native.BatchArgs()
    f = a.f
    f.B, f.Hq, f.Hkv, f.Sq, f.Sk, f.D, f.Dv = (plan.requests, plan.Hq, plan.Hkv, plan.max_seqlen_q, plan.max_seqlen_k,
                                               plan.D, plan.Dv)
    f.scale, f.causal, f.dtype = scale, int(causal), native.DTYPE_CODES[dtype]
    f.variant = native.BATCH_VARIANTS[plan.row_kernel or "flash"]
    if workspace is not None:
        f.o_part = workspace.data_ptr()
        f.lse_part = f.o_part + plan.parts * plan.partial_rows * plan.Dv * 4
        a.workspace_bytes = plan.workspace_bytes
    a.error = flag.data_ptr()
    a.split_keys, a.decode_rows = plan.split_keys, plan.decode_rows
    return a


def _set_tensors(a, q, k, v, out, lse, paged: bool) -> None:
    """q (rows, Hq, D), out (rows, Hq, Dv), lse (Hq, rows) or None; k, v packed (total_k, Hkv, D) or caches
    (num_blocks, block_size, Hkv, D)."""
    f = a.f
    f.q, f.o = q.data_ptr(), out.data_ptr()
    f.lse = lse.data_ptr() if lse is not None else None
    f.q_ss, f.q_sh = q.stride(0), q.stride(1)
    f.o_ss, f.o_sh = out.stride(0), out.stride(1)
    a.total_q = q.shape[0]
    _set_cache(a, k, v, paged)


def _set_cache(a, k, v, paged: bool) -> None:
    """k, v packed (total_k, Hkv, D) or caches (num_blocks, block_size, Hkv, D): their addresses, strides and
    extent."""
    f = a.f
    f.k, f.v = k.data_ptr(), v.data_ptr()
    if paged:
        f.k_sb, f.k_ss, f.k_sh = k.stride(0), k.stride(1), k.stride(2)
        f.v_sb, f.v_ss, f.v_sh = v.stride(0), v.stride(1), v.stride(2)
        a.num_blocks, a.block_size, a.total_k = k.shape[0], k.shape[1], 0
    else:
        f.k_sb, f.k_ss, f.k_sh = 0, k.stride(0), k.stride(1)
        f.v_sb, f.v_ss, f.v_sh = 0, v.stride(0), v.stride(1)
        a.total_k = k.shape[0]


def _variant(window, softcap, sinks, causal: bool, q, latent: bool) -> tuple:
    """The attention variants of a batch call on q (rows, Hq, D), checked: (window, softcap, sinks) as
    :func:`_set_variant` takes them (ValueError for MLA decode, which runs none)."""
    window, softcap = check_variants(window, softcap, sinks, causal, q)
    if latent and (window is not None or softcap or sinks is not None):
        raise ValueError("MLA decode (head dims 576/512) runs no window, softcap or sinks")
    return window, softcap, sinks


def _set_variant(a, window, softcap: float, sinks) -> None:
    """The launch arguments' window edges, softcap and sinks' address (see :func:`_variant`)."""
    f = a.f
    f.window_left, f.window_right = (-1, -1) if window is None else window
    f.softcap = softcap
    f.sinks = None if sinks is None else sinks.data_ptr()


def _set_kv(a, kv) -> None:
    """The launch arguments' K/V format: ``kv`` None (q's dtype), or an FP8 cache's descale factors as
    :func:`attn_lt.validate.check_kv_descale` returns them."""
    f = a.f
    if kv is None:
        f.kv_dtype, f.k_descale, f.v_descale, f.descale_sh = 0, None, None, 0
        return
    kd, vd, f.descale_sh = kv
    f.kv_dtype = native.DTYPE_CODES["e4m3"]
    f.k_descale = None if kd is None else kd.data_ptr()
    f.v_descale = None if vd is None else vd.data_ptr()


def _set_metadata(a, cu_q, cu_k, seqlens_k, block_table) -> None:
    a.cu_q = cu_q.data_ptr() if cu_q is not None else None
    a.cu_k = cu_k.data_ptr() if cu_k is not None else None
    a.seqlens_k = seqlens_k.data_ptr() if seqlens_k is not None else None
    a.block_table = block_table.data_ptr() if block_table is not None else None
    if block_table is not None:
        a.bt_stride, a.max_blocks = block_table.stride(0), block_table.shape[1]


def _launch(plan: BatchPlan, q, k, v, out, lse, cu_q, cu_k, seqlens_k, block_table, dtype: str, scale: float,
            causal: bool, device: torch.device, check: bool, variant: tuple = (None, 0.0, None), mass=None,
            mass_window: int | None = None, kv=None, converted=None):
    current_device, raw_stream, is_capturing = stream_queries()
    with torch.cuda.device(device) if current_device() != device.index else contextlib.nullcontext():
        capturing = is_capturing()
        if check and capturing:
            raise ValueError("check=True synchronises to read the error flag, which CUDA graph capture forbids: "
                             "check after replays with attn_lt.check_batch_errors()")
        flag = _error_flag(device, capturing)
        workspace = (torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device) if plan.workspace_bytes
                     else None)
        a = _plan_args(plan, dtype, scale, causal, flag, workspace)
        _set_tensors(a, q, k, v, out, lse, block_table is not None)
        _set_metadata(a, cu_q, cu_k, seqlens_k, block_table)
        _set_variant(a, *variant)
        _set_kv(a, kv)
        _run(a, plan, raw_stream(device.index), block_table is not None, mass, mass_window, converted)
        if check:
            check_batch_errors(device)


def _run(a, plan: BatchPlan, stream: int, paged: bool, mass=None, mass_window: int | None = None,
         converted=None) -> None:
    """Launch a batch's arguments ``a`` on ``stream``; with ``mass`` (FP32, as :func:`_mass_tensor` makes it), the
    mass per key after the call: one-row requests' from the scores their decode blocks store there, the others' by a
    pass over their keys (each request's last ``mass_window`` rows; None: all). ``converted``: the buffers
    (:func:`_fp8_buffers`) that ``a``'s FP8 cache is converted into first, on the same stream; the 16-bit kernels
    then read them (through a copy of ``a``: a BatchStep's arguments keep the cache for its next call)."""
    if converted is not None:
        k16, v16, table16 = converted
        native.batch_convert_kv(native.ConvertArgs(b=a, k_out=k16.data_ptr(), v_out=v16.data_ptr(),
                                                   table_out=None if table16 is None else table16.data_ptr()),
                                stream)
        a = native.BatchArgs.from_buffer_copy(a)
        _set_cache(a, k16, v16, paged)
        if paged:  # (the table of the places: the same shape, contiguous)
            a.block_table, a.bt_stride = table16.data_ptr(), table16.stride(0)
        _set_kv(a, None)
    if mass is None:
        native.batch(a, stream)
        return
    # one-row requests' scores from the decode blocks, laid out as the mass
    a.f.scores, a.f.s_sh = mass.data_ptr(), mass.stride(-2)
    a.f.s_sb = mass.stride(0) if paged else 0
    try:
        native.batch(a, stream)
        m = native.BatchMassArgs()
        m.b, m.mass, m.from_scores = a, mass.data_ptr(), 1
        m.window = plan.max_seqlen_q if mass_window is None else min(mass_window, plan.max_seqlen_q)
        native.batch_key_mass(m, stream)
    finally:
        a.f.scores = None  # this call's only (a BatchStep's arguments serve its later calls)


def _mass_tensor(plan: BatchPlan, total_k: int, device, every_row_written: bool):
    """The mass per key's FP32 tensor: (Hq, total_k) for packed keys (columns no request owns stay 0), else
    (requests, Hq, max_seqlen_k); zeroed unless every row is written (a paged batch of one query row a request)."""
    shape = (plan.Hq, total_k) if plan.kind == "varlen" else (plan.requests, plan.Hq, plan.max_seqlen_k)
    alloc = torch.empty if every_row_written and plan.kind == "paged" else torch.zeros
    return alloc(shape, dtype=torch.float32, device=device)


def _no_keys(out, lse, sinks) -> None:
    """A batch with no keys at all: zero rows, LSE -inf (or the rows' sinks)."""
    out.zero_()
    if lse is not None:
        if sinks is None:
            lse.fill_(-float("inf"))
        else:
            lse.copy_(sinks[:, None].expand_as(lse))


def _outputs(q, Hq: int, D: int, out, return_lse: bool) -> tuple:
    """out (rows, Hq, D) (D: v's head dim; the caller's, or new) and, when asked for, lse FP32 (Hq, rows)."""
    if out is None:
        out = torch.empty((q.shape[0], Hq, D), dtype=q.dtype, device=q.device)
    return out, torch.empty((Hq, q.shape[0]), dtype=torch.float32, device=q.device) if return_lse else None


def _mass_options(return_key_mass, key_mass_window, latent: bool) -> bool:
    """Whether the call returns the mass per key; its options checked (ValueError for MLA decode)."""
    check_options(return_key_mass=return_key_mass, key_mass_window=key_mass_window)
    if return_key_mass and latent:
        raise ValueError("return_key_mass is not available for MLA decode (head dims 576/512)")
    return bool(return_key_mass)


def _traced(op, args: tuple, q, out, causal, scale, return_lse, check, window, softcap, sinks, return_key_mass,
            key_mass_window, k_descale, v_descale):
    """A batch call while torch.compile traces it: its custom op (:func:`_varlen_op`, :func:`_paged_op`), the
    variants and descale factors as the op takes them, the results as the call returns them."""
    if out is not None:
        raise ValueError("out= is not supported inside torch.compile (the batch calls return a new output there)")
    causal, window, softcap = op_variants(causal, window, softcap)
    got = op(*args, causal, scale, bool(return_lse), bool(check), window, softcap, sinks, bool(return_key_mass),
             key_mass_window, descale_tensor("k_descale", k_descale, q.device),
             descale_tensor("v_descale", v_descale, q.device))
    return call_results(got[0], got[1], bool(return_lse), got[2] if return_key_mass else None)


def _fake_results(q, Dv: int, return_lse: bool, mass_shape) -> tuple:
    """The shapes of a batch call's custom op results (:func:`attn_lt.validate.op_results`); ``mass_shape`` None
    when not asked for."""
    rows, Hq = q.shape[0], q.shape[1]
    return (q.new_empty((rows, Hq, Dv)), q.new_empty((Hq, rows) if return_lse else 0, dtype=torch.float32),
            q.new_empty(0 if mass_shape is None else mass_shape, dtype=torch.float32))


def _concrete(*ints) -> bool:
    """Whether these ints are known while tracing (not symbolic: a capacity torch.compile made dynamic)."""
    return all(x is None or isinstance(x, int) for x in ints)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
                     causal: bool = False, scale: float | None = None, return_lse: bool = False, out=None,
                     check: bool = False, window=None, softcap: float | None = None, sinks=None,
                     return_key_mass: bool = False, key_mass_window: int | None = None, k_descale=None,
                     v_descale=None):
    """Attention over packed sequences (FlashAttention's ``flash_attn_varlen_func`` conventions).

    q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, D); fp16 or bf16, D 64, 128 or 256, Hq a
    multiple of Hkv (GQA read in place). k and v may be an FP8 KV cache (torch.float8_e4m3fn, both) with
    ``k_descale`` / ``v_descale`` (None, a number, or FP32 one value or (Hkv,) on the device: k's values are its
    elements times k_descale): the decode blocks read its bytes for up to 64 query rows a kv head (max_seqlen_q x
    Hq / Hkv); with more (prefill chunks) k and v are converted to q's dtype first (each call: a new buffer of
    total_k x Hkv x 2D x 2 bytes), see :func:`explain_batch`.
    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 (B + 1,) on q's device, request b owning rows [cu[b], cu[b + 1]).
    ``max_seqlen_q`` / ``max_seqlen_k``: host ints, the capacity the launch is planned for (any lengths up to them
    run without re-planning; a CUDA graph captured with them replays for any such lengths). ``causal``:
    bottom-right within each request. ``out``: (total_q, Hq, D) to write into.
    ``window``, ``softcap``, ``sinks``: the attention variants, as :func:`attn_lt.attention` takes them (the window
    within each request).

    ``return_key_mass``: also return the attention mass per key, FP32 (Hq, total_k): for each request and query
    head, the sum over its query rows (its last ``key_mass_window`` rows, when given) of the probabilities P of
    each of its keys, at that key's packed column (what KV-cache eviction during serving needs; a one-row request's
    from the scores its decode blocks store, the others' by a pass over their keys from the call's LSE; see
    :func:`explain_batch`).

    Returns out (total_q, Hq, D) in q's dtype; with ``return_lse``, ``(out, lse)``, lse FP32 (Hq, total_q); with
    ``return_key_mass`` the mass comes last. A request with no keys gives zeros and LSE -inf; rows no request owns
    are left as they were (with no keys at all, total_k = 0, every row is zeros and the offsets are not read).
    ``check=True`` synchronises after the call and raises ``ValueError`` if this or an earlier unchecked call on the
    GPU met bad lengths (:func:`check_batch_errors`).
    """
    if torch.compiler.is_compiling() and isinstance(q, torch.Tensor):
        return _traced(torch.ops.attn_lt.varlen_attention, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k), q, out, causal, scale, return_lse, check, window, softcap, sinks,
                       return_key_mass, key_mass_window, k_descale, v_descale)
    c = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, out, window,
                      softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale)
    q, k, v = _readable("q", q, True), _readable("k", k, True), _readable("v", v, True)
    out, lse = _outputs(q, c.Hq, c.D, c.out, return_lse or c.want_mass)
    plan = plan_batch(c.B, c.Hq, c.Hkv, c.D, max_seqlen_q=c.max_q, max_seqlen_k=c.max_k,
                      facts=device_facts(c.device.index))
    mass = _mass_tensor(plan, k.shape[0], c.device, False) if c.want_mass else None
    if k.shape[0] == 0:  # no keys at all: every request's rows are zeros (only the lengths are not checked)
        _no_keys(out, lse, c.variant[2])
        return call_results(out, lse, return_lse, mass)
    _launch(plan, q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), None, None, c.dtype,
            c.scale, c.causal, c.device, check, c.variant, mass, key_mass_window, c.kv,
            _fp8_buffers(k, q.dtype) if c.convert else None)
    return call_results(out, lse, return_lse, mass)


@dataclass(frozen=True)
class _Checked:
    """A batch call's arguments with every rule checked that needs no GPU work (:func:`_check_varlen`,
    :func:`_check_paged`): what the launch takes."""
    dtype: str
    Hq: int
    Hkv: int
    D: int
    Dv: int
    B: int
    max_q: int
    max_k: int
    causal: bool
    scale: float
    want_mass: bool
    device: torch.device
    out: torch.Tensor | None
    variant: tuple
    kv: tuple | None
    convert: bool  # an FP8 cache converted to q's dtype first (_fp8_converted)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, out, window,
                  softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale) -> _Checked:
    """:func:`varlen_attention`'s arguments checked (TypeError / ValueError naming the shapes)."""
    dtype, Hq, Hkv, D, _ = _check_data(q, k, v, ("q", "k", "v"), 3)
    causal = check_causal(causal)
    scale = D ** -0.5 if scale is None else check_scale(scale)
    want_mass = _mass_options(return_key_mass, key_mass_window, False)
    max_q, max_k = _positive_int("max_seqlen_q", max_seqlen_q), _positive_int("max_seqlen_k", max_seqlen_k)
    convert = _kv_fp8(k) and _fp8_converted(max_q, Hq, Hkv, D, D, want_mass)
    _check_index("cu_seqlens_q", cu_seqlens_q, "(B + 1,) with B >= 1", 1)
    B = cu_seqlens_q.shape[0] - 1
    if B < 1:
        raise ValueError(f"cu_seqlens_q must hold B + 1 >= 2 offsets; got {_shape(cu_seqlens_q)}")
    _check_index("cu_seqlens_k", cu_seqlens_k, f"({B + 1},) like cu_seqlens_q", 1, B + 1)
    _check_capacity(B, Hq, Hkv, D, max_q, max_k, 0)
    if q.shape[0] < 1:
        raise ValueError(f"q {_shape(q)} has no rows")
    _check_out_type(out, q.dtype)
    device = _check_devices({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                             "out": out})
    out = _check_out(out, (q.shape[0], Hq, D), q.dtype, device)
    variant = _variant(window, softcap, sinks, causal, q, False)
    kv = check_kv_descale(k_descale, v_descale, _kv_fp8(k), Hkv, device)
    return _Checked(dtype, Hq, Hkv, D, D, B, max_q, max_k, causal, scale, want_mass, device, out, variant, kv,
                    convert)


def paged_attention(q, k_cache, v_cache, block_table, seqlens_k, *, cu_seqlens_q=None, max_seqlen_q: int | None = None,
                    max_seqlen_k: int | None = None, causal: bool = True, scale: float | None = None,
                    return_lse: bool = False, out=None, check: bool = False, window=None,
                    softcap: float | None = None, sinks=None, return_key_mass: bool = False,
                    key_mass_window: int | None = None, k_descale=None, v_descale=None):
    """Attention against a paged KV cache (FlashAttention's ``flash_attn_with_kvcache`` / vLLM's layout).

    k_cache, v_cache: (num_blocks, block_size, Hkv, D), block_size a power of two from 8 (vLLM's 16 ... 256 and
    beyond); ``block_table``: int32 (B, max_blocks), request b's key j in block ``block_table[b, j // block_size]``;
    ``seqlens_k``: int32 (B,) keys a request. q: (B, Hq, D), one query row a request (decode), or packed
    (total_q, Hq, D) with ``cu_seqlens_q`` int32 (B + 1,) and ``max_seqlen_q`` (chunked prefill, speculative
    decoding, prefill chunks and decode rows mixed in one call). ``max_seqlen_k``: the key capacity the launch is
    planned for (default: max_blocks × block_size). ``causal``: bottom-right within each request (a request's
    query rows are its last keys' positions). ``window``, ``softcap``, ``sinks``: the attention variants, as
    :func:`attn_lt.attention` takes them (not with MLA decode).

    FP8 KV cache: k_cache and v_cache torch.float8_e4m3fn (e4m3, q and out stay fp16/bf16) with ``k_descale`` /
    ``v_descale`` (None, a number, or FP32 one value or (Hkv,) on the device: a key's values are its elements times
    k_descale), as vLLM and FlashInfer store it: the decode blocks read its bytes, half those of a bf16 cache, for
    up to 64 query rows a kv head (max_seqlen_q x Hq / Hkv); with more (prefill chunks, mixed batches) the blocks
    each request's keys use are converted to q's dtype first (each call: a new buffer of 1 + B x max_blocks blocks
    in 16 bits; engines that split decode and prefill calls keep decode on the FP8 bytes). MLA decode reads its latent
    cache in FP8 too (below, Hopper: pass the latent's factor as both).

    MLA decode (DeepSeek's latent cache, Hopper): k_cache (num_blocks, block_size, Hkv, 576), v_cache =
    ``k_cache[..., :512]`` (the same memory, read once), block_size >= 64 (FlashMLA's 64), q (B, Hq, 576) one row a
    request; out (B, Hq, 512). ``scale`` defaults to 576 ** -0.5; DeepSeek's models pass their own.

    ``return_key_mass``: also return the attention mass per key, FP32 (B, Hq, max_seqlen_k): request b's key j at
    ``[b, h, j]``, the sum over its query rows (its last ``key_mass_window`` rows, when given) of the probabilities
    P; zeros past its length and for keys of a block id outside the cache (not with MLA decode).

    Returns out (rows, Hq, Dv); with ``return_lse``, ``(out, lse)``, lse FP32 (Hq, rows); with ``return_key_mass``
    the mass comes last. A request with no keys gives zeros and LSE -inf; a block id outside the cache is never read
    past the cache (MLA decode reads block 0 in its place), its keys are not attended, and it is recorded
    (``check=True``, or :func:`check_batch_errors`). Prefill rows on Hopper read a request's last block whole (the
    slots past its length are masked, not skipped): keep unused cache slots finite, e.g. allocate the cache with
    ``torch.zeros`` (MLA decode and the decode rows need not: they never let those slots reach the output).
    """
    if torch.compiler.is_compiling() and isinstance(q, torch.Tensor):
        return _traced(torch.ops.attn_lt.paged_attention, (q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q,
                       max_seqlen_q, max_seqlen_k), q, out, causal, scale, return_lse, check, window, softcap, sinks,
                       return_key_mass, key_mass_window, k_descale, v_descale)
    c = _check_paged(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                     scale, out, window, softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale)
    q = _readable("q", q, True)
    k_cache, v_cache = _readable("k_cache", k_cache, False), _readable("v_cache", v_cache, False)
    if block_table.stride(1) != 1 or block_table.stride(0) < block_table.shape[1]:  # (an expanded table: stride 0)
        block_table = block_table.contiguous()
    out, lse = _outputs(q, c.Hq, c.Dv, c.out, return_lse or c.want_mass)
    plan = plan_batch(c.B, c.Hq, c.Hkv, c.D, max_seqlen_q=c.max_q, max_seqlen_k=c.max_k, block_size=k_cache.shape[1],
                      Dv=c.Dv, facts=device_facts(c.device.index))
    # every row of the mass is written, but that of a request without query rows (possible with cu_seqlens_q)
    mass = _mass_tensor(plan, 0, c.device, cu_seqlens_q is None) if c.want_mass else None
    _launch(plan, q, k_cache, v_cache, out, lse, None if cu_seqlens_q is None else cu_seqlens_q.contiguous(), None,
            seqlens_k.contiguous(), block_table, c.dtype, c.scale, c.causal, c.device, check, c.variant, mass,
            key_mass_window, c.kv, _fp8_buffers(k_cache, q.dtype, block_table) if c.convert else None)
    return call_results(out, lse, return_lse, mass)


def _check_paged(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, scale,
                 out, window, softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale) -> _Checked:
    """:func:`paged_attention`'s arguments checked (TypeError / ValueError naming the shapes), but the caches'
    layout (read from their addresses when the call runs)."""
    dtype, Hq, Hkv, D, Dv = _check_data(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), 4)
    causal = check_causal(causal)
    scale = D ** -0.5 if scale is None else check_scale(scale)
    want_mass = _mass_options(return_key_mass, key_mass_window, Dv != D)
    _check_index("block_table", block_table, "(B, max_blocks_per_seq)", 2)
    B, max_blocks = block_table.shape
    block_size = k_cache.shape[1]
    if B < 1 or max_blocks < 1:
        raise ValueError(f"block_table must be (B, max_blocks) with both >= 1; got {_shape(block_table)}")
    _check_index("seqlens_k", seqlens_k, f"({B},), one length a row of block_table {_shape(block_table)}", 1, B)
    if cu_seqlens_q is None:
        if max_seqlen_q not in (None, 1):
            raise ValueError(f"max_seqlen_q={max_seqlen_q} needs cu_seqlens_q (without it q holds one row a request)")
        if q.shape[0] != B:
            raise ValueError(f"q {_shape(q)} must hold one row a request ({B} rows of block_table "
                             f"{_shape(block_table)}) without cu_seqlens_q")
        max_q = 1
    else:
        _check_index("cu_seqlens_q", cu_seqlens_q, f"({B + 1},), one offset more than block_table's {B} rows", 1,
                     B + 1)
        if max_seqlen_q is None:
            raise ValueError("max_seqlen_q (a host int, the query rows' capacity) is needed with cu_seqlens_q")
        max_q = _positive_int("max_seqlen_q", max_seqlen_q)
    max_k = max_blocks * block_size if max_seqlen_k is None else _positive_int("max_seqlen_k", max_seqlen_k)
    _check_capacity(B, Hq, Hkv, D, max_q, max_k, block_size, Dv)
    convert = _kv_fp8(k_cache) and _fp8_converted(max_q, Hq, Hkv, D, Dv, want_mass)
    if q.shape[0] < 1 or k_cache.shape[0] < 1:
        raise ValueError(f"q {_shape(q)} and k_cache {_shape(k_cache)} must not be empty")
    _check_out_type(out, q.dtype)
    device = _check_devices({"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table,
                             "seqlens_k": seqlens_k, "cu_seqlens_q": cu_seqlens_q, "out": out})
    out = _check_out(out, (q.shape[0], Hq, Dv), q.dtype, device)
    if Dv != D:
        _check_latent_device(device_facts(device.index), device)
    variant = _variant(window, softcap, sinks, causal, q, Dv != D)
    kv = check_kv_descale(k_descale, v_descale, _kv_fp8(k_cache), Hkv, device)
    return _Checked(dtype, Hq, Hkv, D, Dv, B, max_q, max_k, causal, scale, want_mass, device, out, variant, kv,
                    convert)


# torch.compile: the batch calls dispatch to these custom ops while compiling (no out=); the fake implementations
# give the shapes, and the errors of every argument rule that needs no address, without GPU work.
@torch.library.custom_op("attn_lt::varlen_attention", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float | None,
               return_lse: bool, check: bool, window: list[int] | None, softcap: float, sinks: torch.Tensor | None,
               return_key_mass: bool, key_mass_window: int | None, k_descale: torch.Tensor | None,
               v_descale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                           causal=causal, scale=scale, return_lse=return_lse, check=check, window=window,
                           softcap=softcap, sinks=sinks, return_key_mass=return_key_mass,
                           key_mass_window=key_mass_window, k_descale=k_descale, v_descale=v_descale)
    return op_results(got, return_lse, return_key_mass, q)


@_varlen_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, check,
                 window, softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale):
    if _concrete(max_seqlen_q, max_seqlen_k):  # (symbolic capacities are checked when the op runs)
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, None, window,
                      softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale)
    return _fake_results(q, v.shape[-1], return_lse, (q.shape[1], k.shape[0]) if return_key_mass else None)


@torch.library.custom_op("attn_lt::paged_attention", mutates_args=())
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int | None,
              max_seqlen_k: int | None, causal: bool, scale: float | None, return_lse: bool, check: bool,
              window: list[int] | None, softcap: float, sinks: torch.Tensor | None, return_key_mass: bool,
              key_mass_window: int | None, k_descale: torch.Tensor | None,
              v_descale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = paged_attention(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q=cu_seqlens_q,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
                          return_lse=return_lse, check=check, window=window, softcap=softcap, sinks=sinks,
                          return_key_mass=return_key_mass, key_mass_window=key_mass_window, k_descale=k_descale,
                          v_descale=v_descale)
    return op_results(got, return_lse, return_key_mass, q)


@_paged_op.register_fake
def _paged_fake(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal, scale,
                return_lse, check, window, softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale):
    if _concrete(max_seqlen_q, max_seqlen_k):
        _check_paged(q, k_cache, v_cache, block_table, seqlens_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                     scale, None, window, softcap, sinks, return_key_mass, key_mass_window, k_descale, v_descale)
    max_k = block_table.shape[1] * k_cache.shape[1] if max_seqlen_k is None else max_seqlen_k
    return _fake_results(q, v_cache.shape[-1], return_lse,
                         (block_table.shape[0], q.shape[1], max_k) if return_key_mass else None)


class BatchStep:
    """A serving step planned once and run once per layer (the shape of FlashInfer's ``plan()``/``run()`` wrappers).

    Made for a capacity — ``max_requests`` requests of up to ``max_seqlen_q`` query rows and ``max_seqlen_k`` keys,
    heads, head dims, dtype, a paged cache's ``block_size`` (0: packed varlen keys) — it owns the device buffers of
    the step's metadata and its workspace, allocated here once::

        step = attn_lt.BatchStep(64, 32, 8, 128, max_seqlen_k=32768, block_size=16)
        step.plan(cu_seqlens_q, seqlens_k, block_table)     # once per engine step: copies, no sync, no allocation
        for layer in layers:
            out = step.run(q, k_cache[layer], v_cache[layer])  # launch only

    :meth:`plan` copies the metadata into the step's buffers in stream order (requests past the given ones get no
    rows and no keys), so a CUDA graph captured over :meth:`run` once replays correctly after every later
    :meth:`plan` with new lengths, new requests and new block tables. MLA decode: ``head_dim`` 576 with
    ``head_dim_v`` 512 and v_cache = ``k_cache[..., :512]`` (Hopper). ``kv_dtype`` torch.float8_e4m3fn: an FP8 KV
    cache (read as :func:`paged_attention` reads it: decode rows on its bytes, prefill rows from a copy converted
    first; an MLA latent cache; :meth:`run` takes its descale factors).
    Metadata is checked on the device as in :func:`paged_attention` (:func:`check_batch_errors` reports it).
    """

    def __init__(self, max_requests: int, heads_q: int, heads_kv: int, head_dim: int, *, max_seqlen_k: int,
                 max_seqlen_q: int = 1, block_size: int = 0, head_dim_v: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, device=None, causal: bool = True, scale: float | None = None,
                 kv_dtype: torch.dtype | None = None):
        Dv = head_dim if head_dim_v is None else head_dim_v
        _check_capacity(max_requests, heads_q, heads_kv, head_dim, max_seqlen_q, max_seqlen_k, block_size, Dv)
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in (dtype, FP8_KV_DTYPE):
            raise TypeError(f"kv_dtype must be dtype ({dtype}) or {FP8_KV_DTYPE} (an FP8 KV cache), got {kv_dtype}")
        self.fp8 = kv_dtype == FP8_KV_DTYPE
        # whether a run converts the FP8 cache first (_fp8_converted), without and with the mass
        self._converts = tuple(self.fp8 and _fp8_converted(max_seqlen_q, heads_q, heads_kv, head_dim, Dv, mass)
                               for mass in (False, True))
        device = torch.device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"a BatchStep runs on a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        facts = device_facts(device.index)
        if Dv != head_dim:
            _check_latent_device(facts, device)
        self.device, self.dtype, self.kv_dtype, self.block_size = device, dtype, kv_dtype, block_size
        self.causal = check_causal(causal)
        self.scale = head_dim ** -0.5 if scale is None else check_scale(scale)
        self._plan = plan_batch(max_requests, heads_q, heads_kv, head_dim, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, block_size=block_size, Dv=Dv, facts=facts)
        B, i32 = max_requests, dict(dtype=torch.int32, device=device)
        self.max_blocks = -(-max_seqlen_k // block_size) if block_size else 0
        current_device, self._raw_stream, is_capturing = stream_queries()
        with torch.cuda.device(device):
            flag = _error_flag(device, is_capturing())
            self._ramp = torch.arange(B + 1, **i32)
            self._cu_q = torch.zeros(B + 1, **i32)
            self._cu_k = None if block_size else torch.zeros(B + 1, **i32)
            self._seqlens = torch.zeros(B, **i32) if block_size else None
            self._table = torch.zeros(B, self.max_blocks, **i32) if block_size else None
            self._workspace = (torch.empty(self._plan.workspace_bytes, dtype=torch.uint8, device=device)
                               if self._plan.workspace_bytes else None)
        self._args = _plan_args(self._plan, _DTYPES[dtype], self.scale, self.causal, flag, self._workspace)
        _set_metadata(self._args, self._cu_q, self._cu_k, self._seqlens, self._table)
        self._current_device = current_device
        self._requests = 0  # planned requests (0: not planned)
        self._layout = None  # the last layout run() checked in full

    @property
    def capacity(self) -> BatchPlan:
        """The launch plan of the capacity (what :meth:`explain` describes)."""
        return self._plan

    def explain(self) -> str:
        """How the step's calls run: the kernels, the split of the keys and why (no GPU work)."""
        return str(self._plan) + ("\n" + fp8_line(self._plan) if self.fp8 else "")

    def _index(self, name: str, t, shape: tuple) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}; got {_shape(t)}")
        if t.device != self.device and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; the step runs on {self.device} (host tensors are copied)")

    def plan(self, cu_seqlens_q=None, seqlens_k=None, block_table=None, *, cu_seqlens_k=None) -> None:
        """Set the step's requests: ``cu_seqlens_q`` int32 (B + 1,) (None: one query row a request), and the keys —
        paged: ``seqlens_k`` int32 (B,) and ``block_table`` int32 (B, up to ``max_blocks``) (entries past the given
        columns read as bad blocks); varlen: ``cu_seqlens_k`` int32 (B + 1,). B <= ``max_requests``; tensors on the
        step's device. Stream-ordered copies into the step's buffers: no sync, no allocation, capturable. Host
        tensors are copied too, asynchronously from pinned memory: keep them unchanged until the stream has run the
        copy, and do not plan from host tensors under capture (the graph would keep their address)."""
        paged = self.block_size > 0
        if paged and (seqlens_k is None or block_table is None or cu_seqlens_k is not None):
            raise ValueError("a paged step is planned with seqlens_k and block_table (not cu_seqlens_k)")
        if not paged and (cu_seqlens_k is None or seqlens_k is not None or block_table is not None):
            raise ValueError("a varlen step (block_size 0) is planned with cu_seqlens_k (not seqlens_k/block_table)")
        lengths = seqlens_k if paged else cu_seqlens_k
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1:
            raise ValueError(f"{'seqlens_k' if paged else 'cu_seqlens_k'} must be a 1-D int32 tensor")
        B = lengths.shape[0] - (0 if paged else 1)
        cap = self._plan.requests
        if not 1 <= B <= cap:
            raise ValueError(f"{B} requests; the step holds 1 to {cap}")
        if paged:
            self._index("seqlens_k", seqlens_k, (B,))
            if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
                raise ValueError(f"block_table must be (B, max_blocks) int32; got {type(block_table).__name__}")
            cols = block_table.shape[1]
            self._index("block_table", block_table, (B, cols))
            if not 1 <= cols <= self.max_blocks:
                raise ValueError(f"block_table {_shape(block_table)} must have 1 to {self.max_blocks} columns (the "
                                 "step's max_seqlen_k / block_size)")
        else:
            self._index("cu_seqlens_k", cu_seqlens_k, (B + 1,))
        if cu_seqlens_q is not None:
            self._index("cu_seqlens_q", cu_seqlens_q, (B + 1,))
        # (each op runs on its tensors' device, in that device's current stream)
        if cu_seqlens_q is None:  # request b's row b; requests past B: no rows
            torch.clamp(self._ramp, max=B, out=self._cu_q)
        else:
            self._cu_q[:B + 1].copy_(cu_seqlens_q, non_blocking=True)
            if B < cap:
                self._cu_q[B + 1:].copy_(self._cu_q[B:B + 1].expand(cap - B))
        if paged:
            self._seqlens[:B].copy_(seqlens_k, non_blocking=True)
            self._table[:B, :cols].copy_(block_table, non_blocking=True)
            if cols < self.max_blocks:
                self._table[:B, cols:].fill_(-1)
            if B < cap:
                self._seqlens[B:].zero_()
        else:
            self._cu_k[:B + 1].copy_(cu_seqlens_k, non_blocking=True)
            if B < cap:
                self._cu_k[B + 1:].copy_(self._cu_k[B:B + 1].expand(cap - B))
        self._requests = B

    def run(self, q, k_cache, v_cache, *, out=None, scale: float | None = None, return_lse: bool = False,
            window=None, softcap: float | None = None, sinks=None, k_descale=None, v_descale=None,
            return_key_mass: bool = False, key_mass_window: int | None = None):
        """Attention of the planned requests: q (total_q, Hq, D) packed as planned; k_cache, v_cache
        (num_blocks, block_size, Hkv, D / Dv) (varlen: k, v (total_k, Hkv, D)) in the step's ``kv_dtype``; ``out``
        (total_q, Hq, Dv) to write into; ``scale`` (default: the step's); ``window``, ``softcap``, ``sinks``: this
        layer's attention variants (as :func:`attn_lt.attention` takes them); ``k_descale`` / ``v_descale``: an FP8
        cache's factors (as :func:`paged_attention` takes them; tensors keep a captured graph valid when they
        change); ``return_key_mass`` / ``key_mass_window``: also the mass per key, as :func:`paged_attention` and
        :func:`varlen_attention` return it (paged: (max_requests, Hq, max_seqlen_k), zeros for requests past the
        planned ones). Launch only (no sync, no allocation but out, lse and the mass when not given, and an FP8
        cache's converted copy where prefill rows need one, :func:`explain_batch`). Returns out,
        or ``(out, lse)`` with lse FP32 (Hq, total_q); the mass comes last."""
        if not self._requests:
            raise ValueError("BatchStep.run() before plan(): plan the step's requests first")
        paged = self.block_size > 0
        # the tensors' layouts, checked in full once per layout (a layer loop repeats one)
        layout = (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
                  q.dtype, k_cache.dtype, v_cache.dtype, q.device, k_cache.device, v_cache.device,
                  v_cache.data_ptr() == k_cache.data_ptr(), (q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr()) % 16)
        if layout != self._layout:
            checked = self._check_run(q, k_cache, v_cache, paged)
            same = checked[0] is q and checked[1] is k_cache and checked[2] is v_cache
            self._layout = layout if same else None  # (a copied q is checked and copied again next time)
            q, k_cache, v_cache = checked
        p = self._plan
        want_mass = _mass_options(return_key_mass, key_mass_window, p.latent)
        if out is not None:
            _check_out_type(out, q.dtype)
            out = _check_out(out, (q.shape[0], p.Hq, p.Dv), q.dtype, self.device)
        out, lse = _outputs(q, p.Hq, p.Dv, out, return_lse or want_mass)
        mass = _mass_tensor(p, 0 if paged else k_cache.shape[0], self.device, False) if want_mass else None
        variant = (None, 0.0, None)
        if window is not None or softcap is not None or sinks is not None:
            variant = _variant(window, softcap, sinks, self.causal, q, p.latent)
        kv = check_kv_descale(k_descale, v_descale, self.fp8, p.Hkv, self.device)
        if not paged and k_cache.shape[0] == 0:
            _no_keys(out, lse, variant[2])
            return call_results(out, lse, return_lse, mass)
        converted = None
        if self._converts[want_mass]:
            converted = _fp8_buffers(k_cache, q.dtype, self._table if paged else None)
        a = self._args
        a.f.scale = self.scale if scale is None else check_scale(scale)
        _set_tensors(a, q, k_cache, v_cache, out, lse, paged)
        _set_variant(a, *variant)
        _set_kv(a, kv)
        if self._current_device() == self.device.index:
            _run(a, p, self._raw_stream(self.device.index), paged, mass, key_mass_window, converted)
        else:
            with torch.cuda.device(self.device):
                _run(a, p, self._raw_stream(self.device.index), paged, mass, key_mass_window, converted)
        return call_results(out, lse, return_lse, mass)

    def _check_run(self, q, k_cache, v_cache, paged: bool) -> tuple:
        """run()'s checks of q and the caches: TypeError / ValueError, or the tensors as the kernels read them (q
        copied when its layout is not one they read)."""
        p = self._plan
        for name, t, dtype in (("q", q, self.dtype), ("k_cache", k_cache, self.kv_dtype),
                               ("v_cache", v_cache, self.kv_dtype)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}; the step runs on {self.device}")
        kv = (self.block_size, p.Hkv) if paged else (p.Hkv,)
        if (q.dim() != 3 or tuple(q.shape[1:]) != (p.Hq, p.D) or q.shape[0] < 1
                or tuple(k_cache.shape[1:]) != kv + (p.D,) or tuple(v_cache.shape[1:]) != kv + (p.Dv,)
                or v_cache.shape[0] != k_cache.shape[0] or k_cache.shape[0] < (1 if paged else 0)):
            dims = f"{p.D}" if p.D == p.Dv else f"{p.D} / {p.Dv}"
            raise ValueError(f"the step takes q (rows, {p.Hq}, {p.D}) and "
                             f"{'caches (num_blocks, ' if paged else 'k, v (total_k, '}{', '.join(map(str, kv))}, "
                             f"{dims}); got q {_shape(q)}, k {_shape(k_cache)}, v {_shape(v_cache)}")
        if p.latent:
            _check_latent(k_cache, v_cache, ("k_cache", "v_cache"))
        q = _readable("q", q, True)
        return q, _readable("k", k_cache, not paged), _readable("v", v_cache, not paged)
