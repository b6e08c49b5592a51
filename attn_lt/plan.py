"""The long path's planner: which score blocks to compute, in which chunks, at which addresses. Pure Python.

Vocabulary. A *batch entry* E = b * Hkv + hkv is one kv head of one sequence; one strided-batched GEMM covers
``ne`` consecutive entries. Its *rows* are query rows: either ``Sq`` rows of one query head of the group
(``gi``), or, when the layout allows and the whole group fits, all ``g * Sq`` rows of the group folded together
(grouped-query attention then reads K and V once per kv head). Its *keys* are ``[0, kend)``: with ``causal`` the
key blocks that every row of the chunk masks out are never computed.

Memory: a plan uses one workspace of ``workspace_bytes`` = cuBLASLt workspace + the largest chunk's FP32 score
block; P is written in place over the scores. That is bounded by the budget whatever the sequence length.
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

    @property
    def workspace_bytes(self) -> int:
        return self.gemm_workspace + self.score_bytes

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
        return (f"{len(self.chunks)} chunks (largest: {biggest.ne} entries x {self.rows(case, biggest)} rows x "
                f"{biggest.kend} keys), GQA group {'folded into rows' if self.fold_group else 'one head a GEMM'}, "
                f"batch {'(B, Hkv) in one stride' if self.combine_batch else 'one sequence a GEMM'}; "
                f"{done / full:.1%} of the {case.Sq}x{case.Sk} score matrices computed; workspace "
                f"{self.workspace_bytes / 2**20:.1f} MiB of a {self.budget / 2**20:.0f} MiB budget")


def _entry_stride(strides, Hkv: int, unit: int) -> int:
    """Element stride from batch entry E to E+1 for a (B, H, S, D) tensor whose kv head spans ``unit`` heads."""
    return strides[1] * unit if Hkv > 1 else strides[0]


def _combinable(strides, B: int, Hkv: int, unit: int) -> bool:
    return B == 1 or Hkv == 1 or strides[0] == Hkv * unit * strides[1]


def _foldable(case: Case) -> bool:
    qs = case.q_strides
    return case.group > 1 and (case.Sq == 1 or qs[1] == case.Sq * qs[2])


@functools.lru_cache(maxsize=256)
def make_plan(case: Case, budget: int | None = None) -> Plan:
    """Chunk ``case`` so that its FP32 score blocks plus the cuBLASLt workspace fit ``budget`` bytes."""
    budget = config.workspace_bytes(budget)
    gemm_ws = min(config.GEMM_WORKSPACE_MAX, (budget // 8) // 256 * 256)
    scores = budget - gemm_ws
    one_row = score_ld(case.Sk) * 4
    if scores < one_row:
        raise ValueError(f"workspace budget of {budget} bytes is too small for {case}: one row of FP32 scores "
                         f"needs {one_row} bytes plus the cuBLASLt workspace; raise ATTN_LT_WORKSPACE_MB or "
                         "workspace_bytes")
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
    return Plan(budget, gemm_ws, used, fold, combine, tuple(chunks))


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
    """Where one chunk's operands live: q and o are (M x D), k and v (N x D), s the (M x N) FP32 scores in
    the score region (P, in the input dtype, uses twice the row and batch strides at the same addresses)."""

    q: MatrixView
    k: MatrixView
    v: MatrixView
    o: MatrixView
    s: MatrixView
    row0: int  # first row's index in the flattened (group, Sq) rows, for the softmax kernel
    gi0: int


def out_strides(case: Case) -> tuple[int, int, int, int]:
    """Strides of the output, which the long path allocates contiguous (B, Hq, Sq, D)."""
    return (case.Hq * case.Sq * case.D, case.Sq * case.D, case.D, 1)


def chunk_layout(case: Case, plan: Plan, c: Chunk) -> ChunkLayout:
    """Offsets and strides of every operand of chunk ``c`` (requires c.kend > 0)."""
    g, D, Hkv = case.group, case.D, case.Hkv
    b, h = divmod(c.e0, Hkv)

    def view(strides, unit: int, rows: int, cols: int, row_stride: int, extra: int) -> MatrixView:
        offset = b * strides[0] + h * unit * strides[1] + extra
        return MatrixView(offset, rows, cols, max(row_stride, cols) if rows == 1 else row_stride, c.ne,
                          _entry_stride(strides, Hkv, unit))

    os_ = out_strides(case)
    if c.gi is None:  # the group folded into rows: (gi, s) flattened, gi outer
        M = g * case.Sq
        q = view(case.q_strides, g, M, D, case.q_strides[2] if case.Sq > 1 else case.q_strides[1], 0)
        o = view(os_, g, M, D, D, 0)
        row0, gi0 = 0, 0
    else:
        M = c.s1 - c.s0
        q = view(case.q_strides, g, M, D, case.q_strides[2], c.gi * case.q_strides[1] + c.s0 * case.q_strides[2])
        o = view(os_, g, M, D, D, c.gi * os_[1] + c.s0 * D)
        row0, gi0 = c.s0, c.gi
    k = view(case.k_strides, 1, c.kend, D, case.k_strides[2], 0)
    v = view(case.v_strides, 1, c.kend, D, case.v_strides[2], 0)
    ld = score_ld(c.kend)
    s = MatrixView(0, M, c.kend, ld, c.ne, M * ld)
    return ChunkLayout(q, k, v, o, s, row0, gi0)
