"""Context parallelism: one long sequence attended on several GPUs over ``torch.distributed`` (NCCL).

The sequence dimension of q, k and v is sharded across the ranks of a process group; each rank computes the
attention of its query rows against every key (or every key in its causal past), its local work going through
``attn_lt.attention(..., return_lse=True)``, and the partial results of different key blocks are merged by their
log-sum-exp in FP32 (:mod:`attn_lt.merge`). The result on each rank is that rank's shard of the single-GPU
attention of the whole sequence.

Layouts (the global sequence cut into equal chunks):

* ``"zigzag"``: 2N chunks, rank r holds chunks r and 2N-1-r (in that order). Under a causal mask every rank then
  has the same work (each holds an early and a late chunk), the load balance that ring attention needs.
* ``"contiguous"``: N chunks, rank r holds chunk r. Simple, but causal work grows with the rank.

Communication (``comm``):

* ``"ring"``: N-1 steps; at each step every rank sends the K/V block it holds to rank r+1 and receives the next one
  from rank r-1 (``batch_isend_irecv``, double-buffered) while it computes on the current one. Memory: three K/V
  blocks of the local length whatever N is. Communication is hidden whenever a step's compute outlasts a block's
  transfer (for H = 32, D = 128 on NVLink: local lengths above a few thousand tokens).
* ``"allgather"``: one all-gather of K and V (the whole sequence lands on every rank, put into sequence order),
  then one local call per run of consecutive query chunks, against the key prefix it may see: no merge, the
  fewest and largest calls, but the transfer is exposed and every rank holds the whole K/V.
* ``"auto"``: :func:`choose_comm` — ``allgather`` while the whole sequence's K+V is at most
  :data:`ALLGATHER_MAX_KV_BYTES` (1 GiB), else ``ring``; ``ring`` on one rank (no communication at all).

Causal masking is bottom-right over the global sequence, which must then have as many queries as keys
(``Sq == Sk``, else ``ValueError``). A key block entirely in a query block's past runs without a causal mask, the
diagonal block with one, and blocks in the future are skipped (never computed): :func:`block_schedule`.

This module is imported only by its users (``import attn_lt`` does not import it).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import attn_lt

from .merge import merge_into

log = logging.getLogger("attn_lt")

__all__ = ["context_parallel_attention", "shard", "unshard", "rank_chunks", "block_schedule", "Block",
           "choose_comm", "CommTrace", "LAYOUTS", "COMMS", "ALLGATHER_MAX_KV_BYTES"]

LAYOUTS = ("zigzag", "contiguous")
COMMS = ("auto", "ring", "allgather")

#: ``comm="auto"`` gathers K/V while the whole sequence's K+V is at most this many bytes, else runs the ring.
#: Why: both do the same FLOPs. The all-gather runs one collective and the fewest, largest local calls (no merge,
#: no per-step synchronisation) but exposes its transfer and holds the whole K/V on every rank; the ring hides its
#: transfers behind compute but pays N steps of calls, merges and waits. For short sequences (little compute per
#: rank) the fixed per-step costs dominate and the exposed transfer is small (1 GiB moves in about 3 ms over
#: NVLink); for long ones the ring's memory bound (three local K/V blocks whatever N is) and its hidden transfer
#: win, and the gathered K/V (16 GiB at 1M tokens, H = 32, D = 128) becomes a memory problem. The crossover is to
#: be measured (``tools/bench_cp.py`` reports both) and this constant tuned.
ALLGATHER_MAX_KV_BYTES = 1 << 30


# ---- sharding ----------------------------------------------------------------------------------------------------

def _check_layout(layout: str) -> int:
    """Chunks per rank of ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def _check_world(rank: int, world: int) -> None:
    for name, x in (("rank", rank), ("world", world)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world and world >= 1, got rank={rank}, world={world}")


def rank_chunks(rank: int, world: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` of ``world`` holds, in its local order: ``(rank, 2*world-1-rank)``
    for ``"zigzag"`` (the sequence cut in 2·world chunks), ``(rank,)`` for ``"contiguous"`` (world chunks)."""
    _check_world(rank, world)
    return (rank, 2 * world - 1 - rank) if _check_layout(layout) == 2 else (rank,)


def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of a full tensor along its sequence dimension ``dim``.

    Args:
        x: e.g. q, k or v (B, H, S, D), an LSE (B, H, S), or a mask's rows (B|1, H|1, S, Sk) (``dim=2``).
        rank, world: this rank and the number of ranks.
        layout: "zigzag" (rank r gets chunks r and 2·world-1-r of 2·world) or "contiguous" (chunk r of world).
        dim: the sequence dimension (negative counts from the end).

    Returns:
        A new contiguous tensor, ``x.shape`` with ``S / world`` along ``dim``.

    Raises:
        ValueError: ``S`` not divisible by the number of chunks (2·world for zigzag, world for contiguous).
    """
    cpr = _check_layout(layout)
    _check_world(rank, world)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    n = x.shape[dim]
    if n % (world * cpr):
        raise ValueError(f"x {_shape(x)}: its sequence length {n} (dim {dim}) must be divisible by "
                         f"{world * cpr} ({cpr} {layout} chunk(s) for each of {world} ranks)")
    c = n // (world * cpr)
    return torch.cat([x.narrow(dim, g * c, c) for g in rank_chunks(rank, world, layout)], dim)


def unshard(parts, layout: str = "zigzag", dim: int = 2, group=None) -> torch.Tensor:
    """The full tensor from the shards of all ranks (the inverse of :func:`shard`).

    Args:
        parts: a list of every rank's shard in rank order, each (..., S/world, ...) along ``dim``; or this rank's
            shard alone (a tensor), which is then all-gathered over ``group`` (every rank must call).
        layout: the layout the shards were made with.
        dim: the sequence dimension.
        group: the process group of the gather (default: the default group); only used for a single tensor.

    Returns:
        The full tensor, the shards' shape with ``S`` along ``dim``.
    """
    cpr = _check_layout(layout)
    if isinstance(parts, torch.Tensor):
        _require_dist(group)
        x = parts.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
    parts = list(parts)
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty list of tensors (one shard per rank) or one tensor")
    if any(tuple(p.shape) != tuple(parts[0].shape) for p in parts):
        raise ValueError(f"shards must share one shape; got {[_shape(p) for p in parts]}")
    world, n = len(parts), parts[0].shape[dim]
    if n % cpr:
        raise ValueError(f"a {layout} shard holds {cpr} equal chunks; shard length {n} (dim {dim}) is odd")
    c = n // cpr
    chunks = [None] * (world * cpr)
    for r, p in enumerate(parts):
        for j, g in enumerate(rank_chunks(r, world, layout)):
            chunks[g] = p.narrow(dim, j * c, c)
    return torch.cat(chunks, dim)


# ---- the block schedule ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One local attention call: query chunks ``[q0, q1)`` of the rank's shard against key chunks ``[k0, k1)`` of
    the K/V shard at hand (local chunk indices), with the causal mask (a diagonal block) or without."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool

    def __str__(self) -> str:
        return f"q[{self.q0}:{self.q1}] x k[{self.k0}:{self.k1}]{' causal' if self.causal else ''}"


def _runs(idx: list[int], chunks, split_cols: bool) -> list[tuple[int, int]]:
    """Split sorted local indices into runs ``[a, b)`` that are consecutive locally (and, with ``split_cols``,
    whose global chunks are consecutive too, so that a mask's columns are one slice)."""
    runs: list[tuple[int, int]] = []
    for j in idx:
        if runs and runs[-1][1] == j and (not split_cols or chunks[j] == chunks[j - 1] + 1):
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


def block_schedule(q_chunks, k_chunks, causal: bool, split_cols: bool = False) -> tuple[Block, ...]:
    """The local calls that attend query chunks ``q_chunks`` to key chunks ``k_chunks`` (global chunk indices in
    local order, chunks of equal length, as :func:`rank_chunks` gives).

    Without ``causal``: all queries against all keys (one block; with ``split_cols``, one per run of globally
    consecutive key chunks). With ``causal`` (bottom-right over the global sequence, equal query and key chunk
    lengths): a key chunk before a query chunk is attended without a mask, the same chunk with the causal mask,
    a later one not at all. When the query and key chunks are the same ascending list (a rank's own K/V), one
    causal call over the concatenation is exact and is used. ``split_cols`` (a user mask is sliced by columns)
    keeps every block's key chunks globally consecutive.
    """
    q_chunks, k_chunks = tuple(q_chunks), tuple(k_chunks)
    nq, nk = len(q_chunks), len(k_chunks)
    if not causal:
        return tuple(Block(0, nq, a, b, False) for a, b in _runs(list(range(nk)), k_chunks, split_cols))
    ascending = all(a < b for a, b in zip(k_chunks, k_chunks[1:]))
    if q_chunks == k_chunks and ascending and (not split_cols or len(_runs(list(range(nk)), k_chunks, True)) == 1):
        return (Block(0, nq, 0, nk, True),)
    blocks = [Block(i, i + 1, j, j + 1, True) for i, g in enumerate(q_chunks) for j, h in enumerate(k_chunks)
              if h == g]
    past = [[j for j, h in enumerate(k_chunks) if h < g] for g in q_chunks]
    i = 0
    while i < nq:
        j = i
        while j + 1 < nq and past[j + 1] == past[i]:
            j += 1
        blocks += [Block(i, j + 1, a, b, False) for a, b in _runs(past[i], k_chunks, split_cols)]
        i = j + 1
    return tuple(blocks)


def choose_comm(world: int, kv_bytes: int) -> str:
    """The communication ``comm="auto"`` takes: ``"ring"`` on one rank (nothing to send; one call), else
    ``"allgather"`` while the whole sequence's K+V (``kv_bytes``) is at most :data:`ALLGATHER_MAX_KV_BYTES`, else
    ``"ring"`` (see that constant for why)."""
    if world == 1:
        return "ring"
    return "allgather" if kv_bytes <= ALLGATHER_MAX_KV_BYTES else "ring"


# ---- timing ------------------------------------------------------------------------------------------------------

class CommTrace:
    """Phase timings of context-parallel calls, for benchmarks: pass ``trace=CommTrace()`` and read
    :meth:`summary` after the calls. Phases: ``"compute"`` (local attention calls and merges), ``"wait"`` (the
    compute stream stalled on communication: the transfer time not hidden, plus any wait for a slower rank), ``"reorder"`` (all-gather: K/V put into
    sequence order), ``"check"`` (the ranks' agreement exchange). GPU time by CUDA events on the current stream for
    CUDA tensors; wall-clock time on CPU."""

    def __init__(self) -> None:
        self._spans: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def span(self, kind: str, device: torch.device):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(torch.cuda.current_stream(device))
            yield
            e.record(torch.cuda.current_stream(device))
        else:
            s = time.perf_counter()
            yield
            e = time.perf_counter()
        self._spans.append((kind, s, e))

    def summary(self) -> dict[str, float]:
        """Milliseconds per phase summed over the recorded spans (waits for the events), and ``"steps"``."""
        res: dict[str, float] = {}
        for kind, s, e in self._spans:
            if isinstance(s, torch.cuda.Event):
                e.synchronize()
                ms = s.elapsed_time(e)
            else:
                ms = (e - s) * 1e3
            res[kind] = res.get(kind, 0.0) + ms
        res["steps"] = float(sum(1 for k, _, _ in self._spans if k == "compute"))
        return res

    def clear(self) -> None:
        self._spans.clear()


@contextlib.contextmanager
def _span(trace: CommTrace | None, kind: str, device: torch.device):
    if trace is None:
        yield
    else:
        with trace.span(kind, device):
            yield


# ---- validation --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Setup:
    """One call, validated: local lengths, chunk lengths, the mask's local rows and the communication."""

    rank: int
    world: int
    layout: str
    comm: str
    causal: bool
    scale: float
    Sq: int  # local
    Sk: int  # local
    cq: int  # query chunk length
    ck: int  # key chunk length
    mask: torch.Tensor | None  # 4-D, rows: this rank's (local order) or 1; columns: global order or 1

    @property
    def mask_cols(self) -> bool:
        return self.mask is not None and self.mask.shape[3] > 1


def _require_dist(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group() "
                           "first (one process per GPU, e.g. under torchrun)")


def _local_mask(mask, q, k, st_rank: int, world: int, layout: str) -> torch.Tensor:
    """The mask's rows for this rank, 4-D: rows this rank's (local order) or 1, columns global or 1."""
    B, Hq, Sq, _ = q.shape
    Sk_global = k.shape[2] * world
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() > 4 or mask.dim() < 2:
        raise ValueError(f"attn_mask {_shape(mask)} must have 2 to 4 dimensions, broadcastable to (B, Hq, rows, "
                         f"Sk) = ({B}, {Hq}, {Sq} or {Sq * world}, {Sk_global})")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    rows, cols = m.shape[2], m.shape[3]
    ok = m.shape[0] in (1, B) and m.shape[1] in (1, Hq) and cols in (1, Sk_global) and rows in (1, Sq, Sq * world)
    if not ok:
        raise ValueError(f"attn_mask {_shape(mask)} must broadcast to (B, Hq, rows, Sk) with B={B}, Hq={Hq}, "
                         f"rows this rank's {Sq} query rows (in its {layout} order) or all {Sq * world}, and the "
                         f"global key length Sk={Sk_global} (or 1)")
    if rows == Sq * world and world > 1:
        m = shard(m, st_rank, world, layout, dim=2)
    return m


def _validate(q, k, v, attn_mask, causal, scale, layout, comm, return_lse, rank, world) -> _Setup:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be this rank's 4-D shards: q (B, Hq, Sq/N, D), k (B, Hkv, Sk/N, D), v "
                         f"(B, Hkv, Sk/N, Dv); got {shapes}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device} for {shapes}")
    B, Hq, Sq, D = q.shape
    _, Hkv, Sk, _ = k.shape
    if k.shape[0] != B or v.shape[0] != B or tuple(v.shape[:3]) != tuple(k.shape[:3]) or k.shape[3] != D:
        raise ValueError("shapes must be q (B, Hq, Sq/N, D), k (B, Hkv, Sk/N, D), v (B, Hkv, Sk/N, Dv); got "
                         + shapes)
    if min(B, Hq, Sq, D, Hkv, Sk) < 1 or Hq % Hkv:
        raise ValueError(f"every dimension must be at least 1 and Hq a multiple of Hkv; got {shapes}")
    if not isinstance(causal, bool) or not isinstance(return_lse, bool):
        raise TypeError(f"causal and return_lse must be bools, got {type(causal).__name__} and "
                        f"{type(return_lse).__name__}")
    cpr = _check_layout(layout)
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")
    if Sq % cpr or Sk % cpr:
        raise ValueError(f"layout 'zigzag' needs even local lengths (the global sequence cut in 2N = {2 * world} "
                         f"equal chunks); got {shapes}")
    if causal and Sq != Sk:
        raise ValueError(f"causal context parallelism needs as many queries as keys (global Sq == Sk, each rank "
                         f"the same local length); got {shapes} on {world} ranks")
    if scale is None:
        scale = D**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    mask = None if attn_mask is None else _local_mask(attn_mask, q, k, rank, world, layout)
    if comm == "auto":
        kv_bytes = world * Sk * B * Hkv * (D + v.shape[3]) * k.element_size()
        comm = choose_comm(world, kv_bytes)
    return _Setup(rank, world, layout, comm, causal, float(scale), Sq, Sk, Sq // cpr, Sk // cpr, mask)


def _mask_slice(st: _Setup, rows: tuple[int, int], col0: int, ncols: int):
    """The mask for local query rows ``[rows)`` and global key columns ``[col0, col0 + ncols)`` (a view)."""
    m = st.mask
    if m is None:
        return None
    if m.shape[2] > 1:
        m = m[:, :, rows[0]:rows[1]]
    if m.shape[3] > 1:
        m = m[:, :, :, col0:col0 + ncols]
    return m


_FIELDS = ("error", "world", "B", "Hq", "Hkv", "Sq", "Sk", "D", "Dv", "dtype", "causal", "layout", "comm",
           "mask_dtype", "mask_B", "mask_H", "mask_rows", "mask_cols", "scale_bits")


_META_DTYPES = ("float16", "bfloat16", "float32", "float64", "bool")


def _field_value(name: str, value: int):
    """A field of :func:`_meta` as a person reads it: dtypes, layouts and communication schemes by name, causal
    as a bool, the scale as the float it encodes."""
    if name in ("dtype", "mask_dtype"):
        if name == "mask_dtype" and value == -1:
            return "no mask"
        return f"torch.{_META_DTYPES[value]}" if 0 <= value < len(_META_DTYPES) else "another dtype"
    if name == "layout":
        return LAYOUTS[value] if 0 <= value < len(LAYOUTS) else value
    if name == "comm":
        return COMMS[value] if 0 <= value < len(COMMS) else value
    if name == "causal":
        return bool(value)
    if name == "scale_bits":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


def _meta(q, k, v, st: _Setup | None) -> list[int]:
    if st is None:
        return [1] + [-1] * (len(_FIELDS) - 1)
    m = st.mask
    dt = tuple(getattr(torch, n) for n in _META_DTYPES)
    code = (lambda d: dt.index(d) if d in dt else len(dt))
    mask = [-1, 0, 0, 0, 0] if m is None else [code(m.dtype), *m.shape]
    return [0, st.world, *q.shape[:2], k.shape[1], st.Sq, st.Sk, q.shape[3], v.shape[3], code(q.dtype),
            int(st.causal), LAYOUTS.index(st.layout), COMMS.index(st.comm), *mask,
            struct.unpack("<q", struct.pack("<d", st.scale))[0]]


def _agree(group, device, meta: list[int], err: BaseException | None) -> None:
    """Exchange every rank's validation result and call description; raise on every rank (the same decision)
    if one rank rejected its inputs or the ranks disagree, so that no rank is left waiting in a collective."""
    t = torch.tensor(meta, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    got = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(got, t, group=group)
    rows = [g.tolist() for g in got]
    bad = [r for r, row in enumerate(rows) if row[0]]
    if err is not None:
        raise err
    if bad:
        raise ValueError(f"context_parallel_attention: rank(s) {bad} rejected their inputs (see the error raised "
                         "there); no rank started communicating")
    for i, name in enumerate(_FIELDS):
        if len({row[i] for row in rows}) > 1:
            shown = "scale" if name == "scale_bits" else name
            values = ", ".join(f"rank {r}: {_field_value(name, row[i])}" for r, row in enumerate(rows))
            raise ValueError(f"context_parallel_attention: the ranks disagree on {shown} ({values}); every rank "
                             "must pass shards of one call (same shapes, dtype, options)")


# ---- the call ----------------------------------------------------------------------------------------------------

def context_parallel_attention(q, k, v, *, group=None, causal: bool = False, attn_mask=None,
                               scale: float | None = None, layout: str = "zigzag", comm: str = "auto",
                               return_lse: bool = False, backend: str = "auto", local_attention=None,
                               check_ranks: bool = True, trace: CommTrace | None = None, **attention_opts):
    """Attention of a sequence sharded across the ranks of ``group``: this rank's rows of the single-GPU result.

    Every rank of the group calls it with its shards (collective; same shapes and options on every rank).

    Args:
        q: (B, Hq, Sq/N, D) this rank's query rows, as ``shard(q_full, rank, N, layout)`` gives (N ranks).
        k, v: (B, Hkv, Sk/N, D) and (B, Hkv, Sk/N, Dv) this rank's keys and values, sharded the same way;
            ``Hq % Hkv == 0`` (grouped-query attention: K/V are never copied per query head).
        group: the ``torch.distributed`` process group (default: the default group; must be initialized).
        causal: bottom-right causal over the global sequence; needs global Sq == Sk (``ValueError`` otherwise).
        attn_mask: bool (True = may attend) or float (added to the scaled scores), broadcastable to
            (B, Hq, rows, Sk) with Sk the global key length (columns in global order, or 1) and rows either this
            rank's Sq/N query rows in its layout order (``shard(mask, rank, N, layout)``: no copy, and 1/N of the
            memory) or all Sq rows (this rank's are sliced out, a copy for "zigzag"), or 1.
        scale: default ``D ** -0.5``.
        layout: "zigzag" (default: causal load balance; needs S divisible by 2N) or "contiguous" (S by N).
        comm: "auto" (:func:`choose_comm`), "ring" or "allgather" (module docstring).
        return_lse: also return the FP32 log-sum-exp (B, Hq, Sq/N) of this rank's rows.
        backend: the local path ("auto", "lt", "wmma"), passed to ``attn_lt.attention``.
        local_attention: the local attention function, default ``attn_lt.attention``; any function with its
            signature that returns ``(out, lse)`` under ``return_lse=True`` (e.g.
            ``attn_lt.testing.attention_reference`` for CPU tensors and the gloo backend).
        check_ranks: exchange a small description of the call first (one all-gather of 19 integers and a host
            synchronisation) so that inconsistent shards or options, or a rank whose inputs are rejected, raise on
            every rank instead of leaving ranks waiting; turn off in a loop whose shapes are known to agree.
        trace: a :class:`CommTrace` collecting the phases' times (benchmarks).
        **attention_opts: passed to the local attention (e.g. ``workspace_bytes``, ``threshold``,
            ``algo_policy``).

    Returns:
        out (B, Hq, Sq/N, Dv) in q's dtype, this rank's rows in its layout order (``unshard`` puts the ranks'
        outputs together); with ``return_lse``, ``(out, lse)``, lse float32 (B, Hq, Sq/N). A row whose keys are
        all masked gives 0 and -inf.

    Raises:
        TypeError, ValueError: bad input, naming the shapes, before any communication; with ``check_ranks``,
            raised on every rank when any rank's inputs are bad or the ranks disagree.
        RuntimeError: torch.distributed is not initialized.
    """
    _require_dist(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group passed as group=")
    local = attn_lt.attention if local_attention is None else local_attention
    st, err = None, None
    try:
        if not callable(local):
            raise TypeError(f"local_attention must be callable, got {type(local).__name__}")
        if "out" in attention_opts:
            raise ValueError("out= is not supported: each local call writes a block of rows; the result is new")
        st = _validate(q, k, v, attn_mask, causal, scale, layout, comm, return_lse, rank, world)
        if st.comm == "ring":  # the blocks sent around the ring (and the shapes the preflight sees)
            k, v = k.contiguous(), v.contiguous()
        if local is attn_lt.attention:
            _preflight(st, q, k, v, backend, attention_opts)
    except (TypeError, ValueError, NotImplementedError) as e:
        if not (check_ranks and world > 1 and isinstance(q, torch.Tensor)):
            raise
        err = e
    if check_ranks and world > 1:
        with _span(trace, "check", q.device):
            _agree(group, q.device, _meta(q, k, v, st), err)
    log.debug("context_parallel_attention rank %d/%d: q %s k %s %s %s causal=%s mask=%s", rank, world,
              tuple(q.shape), tuple(k.shape), st.layout, st.comm, causal,
              None if st.mask is None else tuple(st.mask.shape))
    opts = dict(attention_opts, backend=backend)
    run = _allgather if st.comm == "allgather" else _ring
    out, lse = run(st, q, k, v, group, local, opts, trace)
    return (out, lse) if return_lse else out


def _preflight(st: _Setup, q, k, v, backend, opts) -> None:
    """Ask ``attn_lt.explain`` about every local call before communicating: a case the local path refuses
    raises here, on every rank alike, rather than in the middle of the ring. No GPU work."""
    devices = {q.device} | ({st.mask.device} if st.mask is not None else set())
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"attn_lt.attention runs on CUDA tensors; got q {_shape(q)} on {q.device}"
                         + (f", attn_mask on {st.mask.device}" if st.mask is not None else "")
                         + " (pass local_attention= to run another local attention, e.g. on CPU)")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError("context_parallel_attention is forward only: call it under torch.no_grad() or "
                                  "torch.inference_mode(), or on tensors that do not require grad")
    ex = {key: opts[key] for key in ("workspace_bytes", "threshold") if key in opts}
    seen = set()
    for q_, k_, v_, m, causal in _calls(st, q, k, v):
        key = (tuple(q_.shape), tuple(k_.shape), None if m is None else tuple(m.shape), causal)
        if key not in seen:
            seen.add(key)
            attn_lt.explain(q_, k_, v_, attn_mask=m, causal=causal, scale=st.scale, backend=backend, **ex)


def _calls(st: _Setup, q, k, v):
    """(q, k, v, mask, causal) of every local call the run will make, with this rank's K/V standing for the
    blocks it will receive (same shapes) or meta tensors for gathered K/V."""
    if st.comm == "allgather":
        full = (q.shape[0], k.shape[1], k.shape[2] * st.world)
        kf = torch.empty(*full, k.shape[3], device="meta", dtype=k.dtype)
        vf = torch.empty(*full, v.shape[3], device="meta", dtype=v.dtype)
        for rows, kend, causal in _allgather_calls(st):
            yield (q[:, :, rows[0]:rows[1]], kf[:, :, :kend], vf[:, :, :kend],
                   _mask_slice(st, rows, 0, kend), causal)
        return
    qc = rank_chunks(st.rank, st.world, st.layout)
    for t in range(st.world):
        kc = rank_chunks((st.rank - t) % st.world, st.world, st.layout)
        for b in block_schedule(qc, kc, st.causal, split_cols=st.mask_cols):
            yield _block_args(st, b, kc, q, k, v)


def _block_args(st: _Setup, b: Block, kc, q, k, v):
    rows = (b.q0 * st.cq, b.q1 * st.cq)
    ks = slice(b.k0 * st.ck, b.k1 * st.ck)
    m = _mask_slice(st, rows, kc[b.k0] * st.ck, (b.k1 - b.k0) * st.ck)
    return q[:, :, rows[0]:rows[1]], k[:, :, ks], v[:, :, ks], m, b.causal


def _peer(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


class _Acc:
    """FP32 accumulation of partial results over row ranges of this rank's queries."""

    def __init__(self, q, dv: int, nparts: int):
        self.q, self.dv, self.left = q, dv, nparts
        self.out = self.lse = None

    def add(self, rows: tuple[int, int], o, l) -> None:
        B, Hq, Sq, _ = self.q.shape
        full = rows == (0, Sq)
        self.left -= 1
        if self.out is None and full:
            # the first partial over every row starts the accumulator; the only partial is returned as it is
            self.out, self.lse = (o, l) if self.left == 0 else (o.to(torch.float32, copy=True), l.clone())
            return
        if self.out is None:
            self.out = torch.zeros(B, Hq, Sq, self.dv, dtype=torch.float32, device=self.q.device)
            self.lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=self.q.device)
        merge_into(self.out[:, :, rows[0]:rows[1]], self.lse[:, :, rows[0]:rows[1]], o, l)

    def result(self):
        assert self.left == 0 and self.out is not None
        return self.out.to(self.q.dtype), self.lse


def _ring(st: _Setup, q, k, v, group, local, opts, trace):
    dev, world = q.device, st.world
    qc = rank_chunks(st.rank, world, st.layout)
    steps = []
    for t in range(world):
        kc = rank_chunks((st.rank - t) % world, world, st.layout)
        steps.append((kc, block_schedule(qc, kc, st.causal, split_cols=st.mask_cols)))
    acc = _Acc(q, v.shape[3], sum(len(b) for _, b in steps))
    cur = (k, v)
    bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
    to, frm = _peer(group, (st.rank + 1) % world), _peer(group, (st.rank - 1) % world)
    for t, (kc, blocks) in enumerate(steps):
        works = []
        if t < world - 1:
            if len(bufs) < min(2, world - 1):
                bufs.append((torch.empty_like(cur[0]), torch.empty_like(cur[1])))
            nxt = bufs[t % 2]
            ops = [dist.P2POp(dist.isend, cur[0], to, group), dist.P2POp(dist.isend, cur[1], to, group),
                   dist.P2POp(dist.irecv, nxt[0], frm, group), dist.P2POp(dist.irecv, nxt[1], frm, group)]
            works = dist.batch_isend_irecv(ops)
        with _span(trace, "compute", dev):
            for b in blocks:
                q_, k_, v_, m, causal = _block_args(st, b, kc, q, *cur)
                o, l = local(q_, k_, v_, attn_mask=m, causal=causal, scale=st.scale, return_lse=True, **opts)
                acc.add((b.q0 * st.cq, b.q1 * st.cq), o, l)
        if works:
            with _span(trace, "wait", dev):
                for w in works:
                    w.wait()
            cur = nxt
    return acc.result()


def _allgather_calls(st: _Setup):
    """(local query rows, key prefix length, causal) of each call of the all-gather path: one per run of query
    chunks that are consecutive in the global sequence, against the keys it may see (all without causal)."""
    if not st.causal:
        return [((0, st.Sq), st.Sk * st.world, False)]
    qc = rank_chunks(st.rank, st.world, st.layout)
    calls = []
    for a, b in _runs(list(range(len(qc))), qc, True):
        calls.append(((a * st.cq, b * st.cq), qc[b - 1] * st.ck + st.ck, True))
    return calls


def _gather(x, st: _Setup, group):
    """Start the all-gather of this rank's shard: (handle, buffer (world, *x.shape))."""
    x = x.contiguous()
    buf = torch.empty((st.world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name, else the old
    return fn(buf, x, group=group, async_op=True), buf.view((st.world,) + tuple(x.shape))


def _reorder(buf, st: _Setup):
    """The gathered shards (world, B, H, S/N, D) as one (B, H, S, D) tensor in global sequence order."""
    _, B, H, S, D = buf.shape
    c = S // _check_layout(st.layout)
    full = torch.empty(B, H, S * st.world, D, dtype=buf.dtype, device=buf.device)
    for r in range(st.world):
        for j, g in enumerate(rank_chunks(r, st.world, st.layout)):
            full[:, :, g * c:(g + 1) * c].copy_(buf[r, :, :, j * c:(j + 1) * c])
    return full


def _allgather(st: _Setup, q, k, v, group, local, opts, trace):
    dev = q.device
    hk, bk = _gather(k, st, group)
    hv, bv = _gather(v, st, group)
    with _span(trace, "wait", dev):
        hk.wait()
    with _span(trace, "reorder", dev):
        kf = _reorder(bk, st)
    del bk
    with _span(trace, "wait", dev):
        hv.wait()
    with _span(trace, "reorder", dev):
        vf = _reorder(bv, st)
    del bv
    outs, lses = [], []
    with _span(trace, "compute", dev):
        for rows, kend, causal in _allgather_calls(st):
            o, l = local(q[:, :, rows[0]:rows[1]], kf[:, :, :kend], vf[:, :, :kend],
                         attn_mask=_mask_slice(st, rows, 0, kend), causal=causal, scale=st.scale,
                         return_lse=True, **opts)
            outs.append(o)
            lses.append(l)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)
