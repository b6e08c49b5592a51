"""The long path's planner: which score blocks to compute, in which chunks, at which addresses. Pure Python.

Vocabulary. A *batch entry* E = b * Hkv + hkv is one kv head of one sequence; one strided-batched GEMM covers
``ne`` consecutive entries. Its *rows* are query rows: either ``Sq`` rows of one query head of the group
(``gi``), or, when the layout allows and the whole group fits, all ``g * Sq`` rows of the group folded together
(grouped-query attention then reads K and V once per kv head). Its *keys* are ``[0, kend)``: with ``causal`` the
key blocks that every row of the chunk masks out are never computed.

Memory: a plan uses one workspace of ``workspace_bytes`` = per lane, cuBLASLt workspace + the largest chunk's FP32
score block; P is written in place over the scores. That is bounded by the budget whatever the sequence length.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from . import config
from .validate import Case

#: Query rows per chunk (before the budget cuts them): causal uses smaller blocks so that the computed but
#: masked triangle of each block stays a small fraction of the work.
ROW_BLOCK = 2048
CAUSAL_ROW_BLOCK = 1024
#: A folded group with causal masking computes every key of every row; fold only when that waste is small.
FOLD_CAUSAL_MAX_ROWS = 128
#: Key counts of causal chunks are rounded up to this block (fewer distinct GEMM shapes; the mask does the rest).
KEY_BLOCK = 256
#: Score rows are padded to this many floats (128 bytes) for aligned, vectorised access.
LD_ALIGN = 32


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def score_ld(n: int) -> int:
    """Row stride (floats) of a score block with ``n`` keys."""
    return _round_up(n, LD_ALIGN)


@dataclass(frozen=True)
class Chunk:
    """One step of the long path: QK^T, softmax, PV over ``ne`` batch entries, query rows [s0, s1), keys
    [0, kend). ``gi`` is the query head inside the kv group, or None when the group is folded into the rows."""

    e0: int
    ne: int
    gi: int | None
    s0: int
    s1: int
    kend: int

    def __str__(self) -> str:
        g = "all" if self.gi is None else self.gi
        return f"entries {self.e0}..{self.e0 + self.ne - 1} group {g} rows {self.s0}:{self.s1} keys 0:{self.kend}"


@dataclass(frozen=True)
class Plan:
    """How one :class:`Case` runs on the long path (see the module docstring)."""

    budget: int
    gemm_workspace: int
    score_bytes: int
    fold_group: bool
    combine_batch: bool
    chunks: tuple[Chunk, ...]
    lanes: int = 1  # 2: chunk i runs on lane i % 2, each lane with its own region and stream

    @property
    def lane_bytes(self) -> int:
        """Bytes of one lane's region: its cuBLASLt workspace, then its score region."""
        return self.gemm_workspace + self.score_bytes

    @property
    def workspace_bytes(self) -> int:
        return self.lanes * self.lane_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunks"] = [asdict(c) for c in self.chunks]
        return d

    def rows(self, case: Case, c: Chunk) -> int:
        """GEMM rows (M) of chunk ``c``."""
        return case.group * case.Sq if c.gi is None else c.s1 - c.s0

    def summary(self, case: Case) -> str:
        full = case.B * case.Hq * case.Sq * case.Sk
        done = sum(c.ne * self.rows(case, c) * c.kend for c in self.chunks)
        biggest = max(self.chunks, key=lambda c: c.ne * self.rows(case, c) * c.kend)
        n = len(self.chunks)
        return (f"{n} chunk{'' if n == 1 else 's'} (largest: {biggest.ne} entries x {self.rows(case, biggest)} rows x "
                f"{biggest.kend} keys), GQA group {'folded into rows' if self.fold_group else 'one head a GEMM'}, "
                f"batch {'(B, Hkv) in one stride' if self.combine_batch else 'one sequence a GEMM'}; "
                f"{done / full:.1%} of the {case.Sq}x{case.Sk} score matrices computed; "
                f"{'two lanes (softmax beside the next GEMMs)' if self.lanes == 2 else 'one lane'}; workspace "
                f"{self.workspace_bytes / 2**20:.1f} MiB of a {self.budget / 2**20:.0f} MiB budget")


def _entry_stride(strides, Hkv: int, unit: int) -> int:
    """Element stride from batch entry E to E+1 for a (B, H, S, D) tensor whose kv head spans ``unit`` heads."""
    return strides[1] * unit if Hkv > 1 else strides[0]


def _combinable(strides, B: int, Hkv: int, unit: int) -> bool:
    return B == 1 or Hkv == 1 or strides[0] == Hkv * unit * strides[1]


def _foldable(case: Case) -> bool:
    qs = case.q_strides
    return case.group > 1 and (case.Sq == 1 or qs[1] == case.Sq * qs[2])


#: A plan with at least this many computed chunks runs on two lanes (see :func:`make_plan`).
LANE_MIN_CHUNKS = 4


def make_plan(case: Case, budget: int | None = None, lanes: int | None = None) -> Plan:
    """Chunk ``case`` so that its FP32 score blocks plus the cuBLASLt workspace fit ``budget`` bytes (default
    ``ATTN_LT_WORKSPACE_MB``).

    Lanes: a case of several chunks runs them on two lanes (``ATTN_LT_LANES``, default 2), each with its own
    score region and cuBLASLt workspace in half the budget, on two CUDA streams, so that one chunk's
    memory-bound softmax runs beside the next chunk's GEMMs instead of after them."""
    return _make_plan(case, config.workspace_bytes(budget), config.lanes() if lanes is None else lanes)


@functools.lru_cache(maxsize=256)
def _make_plan(case: Case, budget: int, lanes: int) -> Plan:
    gemm_ws = min(config.GEMM_WORKSPACE_MAX, (budget // 8) // 256 * 256)
    one_row = score_ld(case.Sk) * 4
    if budget - gemm_ws < one_row:
        raise ValueError(f"workspace budget of {budget} bytes is too small for {case}: one row of FP32 scores "
                         f"needs {one_row} bytes plus the cuBLASLt workspace; raise ATTN_LT_WORKSPACE_MB or "
                         "workspace_bytes")
    fold, combine, chunks, used = _chunking(case, budget - gemm_ws)
    lane_scores = (budget - 2 * gemm_ws) // 2 // 256 * 256
    if lanes > 1 and sum(1 for c in chunks if c.kend) >= LANE_MIN_CHUNKS and lane_scores >= one_row:
        fold, combine, chunks, used = _chunking(case, lane_scores)
        return Plan(budget, gemm_ws, _round_up(used, 256), fold, combine, chunks, 2)
    return Plan(budget, gemm_ws, used, fold, combine, chunks, 1)


def _chunking(case: Case, scores: int) -> tuple[bool, bool, tuple[Chunk, ...], int]:
    """(fold the group, one stride over (B, Hkv), the chunks, the largest chunk's score bytes) when each chunk's
    FP32 scores may take ``scores`` bytes."""
    one_row = score_ld(case.Sk) * 4
    g = case.group
    combine = all(_combinable(s, case.B, case.Hkv, u)
                  for s, u in ((case.q_strides, g), (case.k_strides, 1), (case.v_strides, 1)))
    entries = case.B * case.Hkv
    span = entries if combine else case.Hkv  # entries one GEMM may cover

    def kend_of(s1: int) -> int:
        if not case.causal:
            return case.Sk
        k = s1 + case.Sk - case.Sq
        return 0 if k <= 0 else min(case.Sk, _round_up(k, KEY_BLOCK))

    fold = (_foldable(case) and g * case.Sq * one_row <= scores
            and (not case.causal or g * case.Sq <= FOLD_CAUSAL_MAX_ROWS))
    chunks: list[Chunk] = []

    def add_entries(rows: int, kend: int, gi: int | None, s0: int, s1: int) -> None:
        per_entry = max(1, rows * score_ld(kend) * 4) if kend else 1
        ne_max = max(1, min(span, scores // per_entry))
        ne_max = -(-span // -(-span // ne_max))  # the same number of GEMMs, evenly filled
        for base in range(0, entries, span):
            for e0 in range(base, base + span, ne_max):
                chunks.append(Chunk(e0, min(ne_max, base + span - e0), gi, s0, s1, kend))

    if fold:
        add_entries(g * case.Sq, kend_of(case.Sq), None, 0, case.Sq)
    else:
        m = min(case.Sq, CAUSAL_ROW_BLOCK if case.causal else ROW_BLOCK)
        m = min(m, scores // one_row)
        if m >= 64:
            m -= m % 64
        for s0 in range(0, case.Sq, m):
            s1 = min(case.Sq, s0 + m)
            for gi in range(g):
                add_entries(s1 - s0, kend_of(s1), gi, s0, s1)

    rows = g * case.Sq if fold else None
    used = max((c.ne * (rows or c.s1 - c.s0) * score_ld(c.kend) * 4 for c in chunks if c.kend), default=0)
    assert used <= scores, (used, scores)
    return fold, combine, tuple(chunks), used


@dataclass(frozen=True)
class MatrixView:
    """A strided batch of row-major matrices inside one tensor: element offset from the tensor's start, rows,
    cols, row stride, batch count and batch stride, all in elements."""

    offset: int
    rows: int
    cols: int
    row_stride: int
    batch: int
    batch_stride: int


@dataclass(frozen=True)
class ChunkLayout:
    """Where one chunk's operands live: q (M x D), k (N x D), v (N x Dv), o (M x Dv), s the (M x N) FP32 scores in
    the score region (P, in the input dtype, uses twice the row and batch strides at the same addresses)."""

    q: MatrixView
    k: MatrixView
    v: MatrixView
    o: MatrixView
    s: MatrixView
    row0: int  # first row's index in the flattened (group, Sq) rows, for the softmax kernel
    gi0: int


def out_strides(case: Case) -> tuple[int, int, int, int]:
    """Strides of the output, which is contiguous (B, Hq, Sq, Dv)."""
    return (case.Hq * case.Sq * case.Dv, case.Sq * case.Dv, case.Dv, 1)


def chunk_layout(case: Case, plan: Plan, c: Chunk) -> ChunkLayout:
    """Offsets and strides of every operand of chunk ``c`` (requires c.kend > 0)."""
    g, D, Dv, Hkv = case.group, case.D, case.Dv, case.Hkv
    b, h = divmod(c.e0, Hkv)

    def view(strides, unit: int, rows: int, cols: int, row_stride: int, extra: int) -> MatrixView:
        offset = b * strides[0] + h * unit * strides[1] + extra
        return MatrixView(offset, rows, cols, max(row_stride, cols) if rows == 1 else row_stride, c.ne,
                          _entry_stride(strides, Hkv, unit))

    os_ = out_strides(case)
    if c.gi is None:  # the group folded into rows: (gi, s) flattened, gi outer
        M = g * case.Sq
        q = view(case.q_strides, g, M, D, case.q_strides[2] if case.Sq > 1 else case.q_strides[1], 0)
        o = view(os_, g, M, Dv, Dv, 0)
        row0, gi0 = 0, 0
    else:
        M = c.s1 - c.s0
        q = view(case.q_strides, g, M, D, case.q_strides[2], c.gi * case.q_strides[1] + c.s0 * case.q_strides[2])
        o = view(os_, g, M, Dv, Dv, c.gi * os_[1] + c.s0 * Dv)
        row0, gi0 = c.s0, c.gi
    k = view(case.k_strides, 1, c.kend, D, case.k_strides[2], 0)
    v = view(case.v_strides, 1, c.kend, Dv, case.v_strides[2], 0)
    ld = score_ld(c.kend)
    s = MatrixView(0, M, c.kend, ld, c.ne, M * ld)
    return ChunkLayout(q, k, v, o, s, row0, gi0)
