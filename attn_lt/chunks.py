"""The long path's planner: which score blocks to compute, in which chunks, at which addresses. Pure Python.

Vocabulary. A *batch entry* E = b * Hkv + hkv is one kv head of one sequence; one strided-batched GEMM covers
``ne`` consecutive entries. Its *rows* are query rows: either ``Sq`` rows of one query head of the group
(``gi``), or, when the layout allows and the whole group fits, all ``g * Sq`` rows of the group folded together
(grouped-query attention then reads K and V once per kv head). Its *keys* are ``[0, kend)``: with ``causal`` the
key blocks that every row of the chunk masks out are never computed.

A plan is a regular grid, not a list: *row blocks* (query rows [s0, s1) of one group member, or the folded
group), each cut into *entry groups* of ``ne`` entries, and — once rows get long — each cut into *key tiles*.

Key tiles. A chunk's FP32 scores must fit the budget, so as ``Sk`` grows a whole-row chunk keeps fewer query
rows; below :data:`TILE_MIN_ROWS` its GEMMs become slivers that re-read K and V for every few rows (at 1M keys and
a 1 GiB budget, 64 rows: 8 bytes of K/V traffic a score on top of the path's 12). Such plans tile the keys
instead: row blocks keep their size, each covers its keys ``key_tile`` at a time, every tile writes an FP32
partial output and its LSE, and a small native kernel joins them by LSE (the arithmetic of :mod:`attn_lt.merge`),
the last tile writing the output. The chunk sizes and the set of GEMM shapes then stay the same at any length; only
the number of chunks grows, and nothing here lists them unless asked (``explain`` at 10M keys reads the grid).
Calls of at least :data:`TILE_MIN_ROWS` query rows whose rows are longer than the softmax runs at its full rate
(:func:`tile_keys`) are tiled too, whatever the budget: without a mask, what one softmax CTA holds (on sm_90 longer
rows stream over clusters of CTAs at about 60 % of its one-CTA rate); with a dense mask sharing the CTA's ring,
what two CTAs an SM hold (longer masked rows leave one CTA an SM). No key tile is longer than that (unless the tile
unit is: fewer than 64 query rows), and without causal masking a row block's tiles are balanced (no short last
tile).

Memory: a plan uses one workspace of ``workspace_bytes`` = per lane, cuBLASLt workspace + the largest chunk's FP32
score block (+ the key tiles' accumulators); P is written in place over the scores. That is bounded by the budget
whatever the sequence length.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

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
#: Plans whose whole-row chunks would hold fewer query rows than this tile the keys, and calls of fewer query rows
#: keep whole rows however long (see the module docstring and :func:`long_rows`).
TILE_MIN_ROWS = 512
#: Query rows of a key-tiled row block (causal too: beside keys this long its masked corner is a sliver), and a bound
#: on the key tile. Measured on the H100 (B1 H4 S512k causal, tools/probe_tiles.py): 1024 rows x 121856 keys
#: 94 TFLOP/s, 2048 x 59392 98, 2048 x 32768 (at most; 4 entries a GEMM) 101, 4096 x 28672 99. Since the softmax
#: holds at most 28160 keys a CTA, :func:`tile_keys` is the tighter bound (KEY_TILE_MAX binds only in probes that
#: raise it).
TILE_ROWS = 2048
KEY_TILE_MAX = 32768
#: Shared memory of the softmax's ring a CTA (native/softmax.cu's kPipeSmem; a test holds the two equal): two slots
#: of a row, each its FP32 scores plus, with a dense mask contiguous over keys, its mask bytes. The planner keeps
#: Hopper's figure; a GPU whose opt-in a block is smaller (A100: 163 KB) runs the longer rows on other kernels.
PIPE_RING_BYTES = 220 * 1024
#: The longest FP32 score row (keys) the softmax holds in one CTA without a mask (see :func:`one_cta_keys`). Longer
#: rows run over clusters of CTAs, at 2.2-2.3 TB/s against 3.8-4.0 on the H200, so prefill-sized calls tile such
#: keys at most this long: H200, B1 H16 S64k D128 0.83x the time of whole rows, B1 H4 S64k D512 0.86x, B1 H32 S128k
#: causal 0.82x (tools/experiments/probe_long_rows.py). Masked rows: :func:`tile_keys`.
ONE_CTA_KEYS = PIPE_RING_BYTES // (2 * 4)
#: The ring a softmax CTA may take with two CTAs an SM on Hopper (228 KB of shared memory an SM, less each CTA's
#: 1 KB reserve and static shared memory): the bound of a masked row's tile (:func:`tile_keys`).
TWO_CTA_RING_BYTES = 112 * 1024


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def score_ld(n: int) -> int:
    """Row stride (floats) of a score block with ``n`` keys."""
    return _round_up(n, LD_ALIGN)


@dataclass(frozen=True)
class Chunk:
    """One step of the long path: QK^T, softmax, PV over ``ne`` batch entries, query rows [s0, s1), keys
    [k0, kend). ``gi`` is the query head inside the kv group, or None when the group is folded into the rows.
    ``tile`` is "" when the chunk covers its rows' whole key range, else "first", "mid" or "last" of its row
    block's key tiles (partial results merged by LSE; "last" writes the output)."""

    e0: int
    ne: int
    gi: int | None
    s0: int
    s1: int
    kend: int
    k0: int = 0
    tile: str = ""

    @property
    def keys(self) -> int:
        return self.kend - self.k0

    def __str__(self) -> str:
        g = "all" if self.gi is None else self.gi
        t = f" ({self.tile} key tile)" if self.tile else ""
        return (f"entries {self.e0}..{self.e0 + self.ne - 1} group {g} rows {self.s0}:{self.s1} "
                f"keys {self.k0}:{self.kend}{t}")


@dataclass(frozen=True)
class RowBlock:
    """Query rows [s0, s1) of group member ``gi`` (None: the group folded), keys [0, kend), in GEMMs of up to
    ``ne`` entries each."""

    gi: int | None
    s0: int
    s1: int
    kend: int
    ne: int


@dataclass(frozen=True)
class ChunkPlan:
    """How one :class:`Case` runs on the long path (see the module docstring)."""

    case: Case = field(repr=False)
    budget: int
    gemm_workspace: int
    score_bytes: int  # the largest chunk's FP32 scores (one lane)
    fold_group: bool
    combine_batch: bool
    row_block: int  # query rows a row block (the group folded: all g * Sq rows)
    key_tile: int = 0  # keys a tile; 0: every chunk covers its rows' whole key range
    tile_bytes: int = 0  # one lane's FP32 accumulators of key tiles (after its scores)
    lanes: int = 1  # 2: chunk groups alternate between two lanes, each with its own region and stream
    score_budget: int = 0  # bytes the scores of one chunk may take (sets the entries a GEMM)

    @property
    def lane_bytes(self) -> int:
        """Bytes of one lane's region: its cuBLASLt workspace, its score region, its tile accumulators."""
        return self.gemm_workspace + self.score_bytes + self.tile_bytes

    @property
    def workspace_bytes(self) -> int:
        return self.lanes * self.lane_bytes

    # -- the grid ----------------------------------------------------------------------------------------------
    def row_blocks(self) -> Iterator[RowBlock]:
        case, g = self.case, self.case.group
        if self.fold_group:
            kend = _kend_of(case, case.Sq)
            yield RowBlock(None, 0, case.Sq, kend, self._entries_a_gemm(g * case.Sq, kend))
            return
        m = self.row_block
        for s0 in range(0, case.Sq, m):
            s1 = min(case.Sq, s0 + m)
            kend = _kend_of(case, s1)
            ne = self._entries_a_gemm(s1 - s0, kend)
            for gi in range(g):
                yield RowBlock(gi, s0, s1, kend, ne)

    def _entries_a_gemm(self, rows: int, kend: int) -> int:
        span = self._span
        if not kend:
            return span
        if self.key_tile and kend > self.key_tile:
            ne_max = self._tiled_entries
        else:  # whole key rows: the scores share the budget with the tiles' accumulators, if any
            room = self.score_budget - (self._acc_reserve if self.key_tile else 0)
            ne_max = max(1, min(span, room // (rows * score_ld(kend) * 4)))
        return -(-span // -(-span // ne_max))  # the same number of GEMMs, evenly filled

    @functools.cached_property
    def _tiled_entries(self) -> int:
        """Entries a key-tiled GEMM may cover: its scores and accumulators (+ their padding) within the budget."""
        per_entry = self.row_block * score_ld(self.key_tile) * 4 + _tile_acc_bytes(self.row_block, self.case.Dv)
        return max(1, min(self._span, (self.score_budget - _ACC_PAD) // per_entry))

    @property
    def _acc_reserve(self) -> int:
        return self._tiled_entries * _tile_acc_bytes(self.row_block, self.case.Dv) + _ACC_PAD

    @property
    def _span(self) -> int:
        """Entries one GEMM may cover: all (B, Hkv) when one stride reaches them, else one sequence's Hkv."""
        return self.case.B * self.case.Hkv if self.combine_batch else self.case.Hkv

    def tile_count(self, kend: int) -> int:
        """How many key tiles a row block with keys [0, kend) is computed in (1: its whole key range)."""
        t = self.key_tile
        return -(-kend // t) if t and kend > t else 1

    def tiles(self, kend: int) -> list[tuple[int, int]]:
        """The key ranges [k0, k1) a row block with keys [0, kend) is computed in."""
        t = self.key_tile
        n = self.tile_count(kend)
        return [(0, kend)] if n == 1 else [(i * t, min(kend, (i + 1) * t)) for i in range(n)]

    def entry_groups(self, ne: int) -> Iterator[tuple[int, int]]:
        """(e0, ne) of each GEMM's entries, for GEMMs of up to ``ne`` entries."""
        entries, span = self.case.B * self.case.Hkv, self._span
        for base in range(0, entries, span):
            for e0 in range(base, base + span, ne):
                yield e0, min(ne, base + span - e0)

    def chunks_of(self, rb: RowBlock) -> Iterator[Chunk]:
        """Row block ``rb``'s chunks in order (a group's key tiles one after the other)."""
        tiles = self.tiles(rb.kend)
        for e0, ne in self.entry_groups(rb.ne):
            if len(tiles) == 1:
                yield Chunk(e0, ne, rb.gi, rb.s0, rb.s1, rb.kend)
                continue
            last = len(tiles) - 1
            for i, (k0, k1) in enumerate(tiles):
                yield Chunk(e0, ne, rb.gi, rb.s0, rb.s1, k1, k0, "first" if i == 0 else "last" if i == last else "mid")

    def iter_chunks(self) -> Iterator[Chunk]:
        """Every chunk in order (generated: a plan of 10M keys has millions)."""
        for rb in self.row_blocks():
            yield from self.chunks_of(rb)

    @functools.cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk, listed (use :meth:`iter_chunks` or :meth:`shapes` where a plan may be very large)."""
        return tuple(self.iter_chunks())

    def rows(self, c: Chunk) -> int:
        """GEMM rows (M) of chunk ``c``."""
        return self.case.group * self.case.Sq if c.gi is None else c.s1 - c.s0

    def shapes(self) -> dict[tuple, tuple[Chunk, int]]:
        """Per chunk shape (rows, entries, keys, tile role): its first chunk and how many chunks have it, counted
        from the row blocks without listing the chunks."""
        return self._shapes

    @functools.cached_property
    def _shapes(self) -> dict[tuple, tuple[Chunk, int]]:
        """Counted in closed form over the row blocks: runs of identical blocks (the full blocks of a plan without
        causal masking, the all-masked blocks of causal Sq > Sk, causal blocks of whole rows that end at the same
        key) are multiplied, and the key-tiled causal blocks, whose tile lengths repeat every key_tile / row_block
        blocks, are counted by period (their middle tiles by an arithmetic series): the blocks visited are at most
        a few per shape returned, whatever the length."""
        out: dict[tuple, list] = {}
        groups_of: dict[int, dict[int, tuple[int, int]]] = {}  # ne -> {GEMM size: (its first e0, how many)}

        def groups(ne: int) -> dict[int, tuple[int, int]]:
            got = groups_of.get(ne)
            if got is None:
                got = groups_of[ne] = {}
                for e0, size in self.entry_groups(ne):
                    first, n = got.get(size, (e0, 0))
                    got[size] = (first, n + 1)
            return got

        def add(rb: RowBlock, times: int = 1) -> None:
            t, n = self.key_tile, self.tile_count(rb.kend)
            if n == 1:
                roles = (("", 0, rb.kend, 1),)
            else:
                roles = (("first", 0, t, 1), ("mid", t, 2 * t, n - 2), ("last", (n - 1) * t, rb.kend, 1))
            for role, k0, k1, n_tiles in roles:
                if not n_tiles:
                    continue
                for ne, (e0, n_groups) in groups(rb.ne).items():
                    key = (rb.s1 - rb.s0 if rb.gi is not None else None, ne, k1 - k0, role)
                    got = out.get(key)
                    if got is None:
                        out[key] = [Chunk(e0, ne, rb.gi, rb.s0, rb.s1, k1, k0, role), n_tiles * n_groups * times]
                    else:
                        got[1] += n_tiles * n_groups * times

        def more(rows: int, ne: int, role: str, keys: int, count: int) -> None:
            for size, (_, n_groups) in groups(ne).items():
                out[(rows, size, keys, role)][1] += count * n_groups

        case, g = self.case, self.case.group
        if self.fold_group:
            for rb in self.row_blocks():
                add(rb)
            return {k: (c, n) for k, (c, n) in out.items()}
        m, Sq, t = self.row_block, case.Sq, self.key_tile
        nb, nb_full = -(-Sq // m), Sq // m

        def block(j: int, gi: int = 0) -> RowBlock:
            s0 = j * m
            s1 = min(Sq, s0 + m)
            kend = _kend_of(case, s1)
            return RowBlock(gi, s0, s1, kend, self._entries_a_gemm(s1 - s0, kend))

        def add_block(j: int, times: int = 1) -> None:
            for gi in range(g):  # the group's heads: the same shapes, the first head's chunk as the example
                add(block(j, gi), times)

        period = t // m if t and t % m == 0 else 0  # key tiles are multiples of the row block (_key_tiling)

        def periodic(j: int) -> bool:  # a full, key-tiled block whose keys are not cut at Sk
            s1 = (j + 1) * m
            return (period > 0 and j < nb_full and _kend_of(case, s1) > t
                    and _round_up(s1 + case.Sk - Sq, KEY_BLOCK) < case.Sk)

        j = 0
        if not case.causal:  # every full block alike
            if nb_full:
                add_block(0)
                if nb_full > 1:
                    add_block(1, nb_full - 1)
            if nb > nb_full:
                add_block(nb - 1)
            return {k: (c, n) for k, (c, n) in out.items()}
        masked = min(nb_full, max(0, (Sq - case.Sk) // m))  # blocks whose every row is masked (kend 0)
        if masked:
            add_block(0)
            if masked > 1:
                add_block(1, masked - 1)
            j = masked
        while j < nb:
            if not periodic(j):
                # the run of full blocks that end at j's key (whole rows: one shape), counted once: block i ends at
                # kend = round_up((i + 1) m + Sk - Sq, KEY_BLOCK), the same for every (i + 1) m <= kend - (Sk - Sq)
                end = j + 1
                if j < nb_full:
                    kend = _kend_of(case, (j + 1) * m)
                    last = nb_full if kend >= case.Sk else (kend - (case.Sk - Sq)) // m
                    end = max(end, min(nb_full, last))
                add_block(j, end - j)
                j = end
                continue
            lo, hi = j, nb_full  # the run of periodic blocks: [j, end), found by bisection (kend grows with j)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if periodic(mid) else (lo, mid)
            end = lo + 1
            head = min(end, j + 2 * period)  # two periods one by one: every shape of the run seen in order
            for jj in range(j, head):
                add_block(jj)
            for r in range(period):  # the rest by residue: the same last tile, one more middle tile a period
                j0 = head + r
                if j0 >= end:
                    break
                k = (end - 1 - j0) // period + 1
                rb = block(j0)
                n0 = self.tile_count(rb.kend)
                rows = rb.s1 - rb.s0
                more(rows, rb.ne, "first", t, k * g)
                more(rows, rb.ne, "mid", t, (k * (n0 - 2) + k * (k - 1) // 2) * g)
                more(rows, rb.ne, "last", rb.kend - (n0 - 1) * t, k * g)
            j = end
        return {k: (c, n) for k, (c, n) in out.items()}

    @property
    def n_chunks(self) -> int:
        """Chunks of the plan, counted from :meth:`shapes`."""
        return sum(n for _, n in self.shapes().values())

    @property
    def computed_chunks(self) -> int:
        """Chunks that compute scores (not the all-masked rows of causal Sq > Sk)."""
        return sum(n for c, n in self.shapes().values() if c.kend)

    def summary(self) -> str:
        case = self.case
        full = case.B * case.Hq * case.Sq * case.Sk
        shapes = self.shapes()
        n = self.n_chunks
        done = sum(cnt * c.ne * self.rows(c) * c.keys for c, cnt in shapes.values())
        biggest = max((c for c, _ in shapes.values()), key=lambda c: c.ne * self.rows(c) * c.keys)
        why = "; ".join(w for w, yes in (
            (f"rows longer than the softmax runs at its full rate ({tile_keys(case)} keys)", long_rows(case)),
            (f"whole rows would leave a chunk fewer than {TILE_MIN_ROWS} rows",
             _whole_rows(case, self.score_budget) < min(case.Sq, TILE_MIN_ROWS))) if yes)
        tiles = (f"keys in tiles of {self.key_tile} merged by LSE ({why})" if self.key_tile
                 else "each chunk over its rows' whole key range")
        return (f"{n} chunk{'' if n == 1 else 's'} (largest: {biggest.ne} entries x {self.rows(biggest)} rows x "
                f"{biggest.keys} keys), GQA group {'folded into rows' if self.fold_group else 'one head a GEMM'}, "
                f"batch {'(B, Hkv) in one stride' if self.combine_batch else 'one sequence a GEMM'}, {tiles}; "
                f"{done / full:.1%} of the {case.Sq}x{case.Sk} score matrices computed; "
                f"{'two lanes (softmax beside the next GEMMs)' if self.lanes == 2 else 'one lane'}; workspace "
                f"{self.workspace_bytes / 2**20:.1f} MiB of a {self.budget / 2**20:.0f} MiB budget")

    def to_dict(self, chunks: bool = False) -> dict:
        """The plan's parameters, its chunk count, and (``chunks``) every chunk."""
        d = {k: v for k, v in asdict(self).items() if k != "case"}
        d["chunks"] = [asdict(c) for c in self.iter_chunks()] if chunks else self.n_chunks
        return d


_ACC_PAD = 1280  # the accumulators' start and each of their four regions 256-byte aligned


def _tile_acc_bytes(rows: int, Dv: int) -> int:
    """FP32 accumulators one entry of a key-tiled chunk needs: output and LSE, running and partial."""
    return 2 * rows * (Dv + 1) * 4


def tile_regions(plan: ChunkPlan, c: Chunk) -> tuple[tuple[int, int, int, int], int]:
    """Byte offsets, from the start of a lane's tile accumulators, of key-tiled chunk ``c``'s running output,
    running LSE, partial output and partial LSE (FP32 [ne][rows][Dv] or [ne][rows], 256-byte aligned), and the
    bytes they take."""
    n = c.ne * plan.rows(c)
    o = _round_up(n * plan.case.Dv * 4, 256)
    lse = _round_up(n * 4, 256)
    return (0, o, o + lse, 2 * o + lse), 2 * (o + lse)


def _kend_of(case: Case, s1: int) -> int:
    """Keys a row block ending at query row ``s1`` computes: all of them, or with causal masking up to its last
    row's last visible key, rounded up to :data:`KEY_BLOCK` (0: every key of every row is masked)."""
    if not case.causal:
        return case.Sk
    k = s1 + case.Sk - case.Sq
    return 0 if k <= 0 else min(case.Sk, _round_up(k, KEY_BLOCK))


def _entry_stride(strides, Hkv: int, unit: int) -> int:
    """Element stride from batch entry E to E+1 for a (B, H, S, D) tensor whose kv head spans ``unit`` heads."""
    return strides[1] * unit if Hkv > 1 else strides[0]


def _combinable(strides, B: int, Hkv: int, unit: int) -> bool:
    return B == 1 or Hkv == 1 or strides[0] == Hkv * unit * strides[1]


def _foldable(case: Case) -> bool:
    qs = case.q_strides
    return case.group > 1 and (case.Sq == 1 or qs[1] == case.Sq * qs[2])


#: A plan with at least this many computed chunks runs on two lanes (see :func:`plan_chunks`).
LANE_MIN_CHUNKS = 4


def plan_chunks(case: Case, budget: int | None = None, lanes: int | None = None,
                key_tiles: bool | None = None) -> ChunkPlan:
    """Chunk ``case`` so that its FP32 score blocks plus the cuBLASLt workspace fit ``budget`` bytes (default
    ``ATTN_LT_WORKSPACE_MB``). ``key_tiles``: allow key tiles (default: the settings' ``key_tiles`` option; see
    the module docstring; a call that returns the attention mass per key needs each chunk's P normalised over all
    its keys, so it passes False).

    Lanes: a case of several chunks runs them on two lanes (the settings' ``lanes`` option, default 2), each with
    its own score region and cuBLASLt workspace in half the budget, on two CUDA streams, so that one chunk's
    memory-bound softmax runs beside the next chunk's GEMMs instead of after them."""
    return _plan_chunks(case, config.workspace_bytes(budget), config.current().lanes if lanes is None else lanes,
                      config.current().key_tiles if key_tiles is None else key_tiles)


@functools.lru_cache(maxsize=256)
def _plan_chunks(case: Case, budget: int, lanes: int, key_tiles: bool) -> ChunkPlan:
    gemm_ws = min(config.GEMM_WORKSPACE_MAX, (budget // 8) // 256 * 256)
    plan = _grid(case, budget, gemm_ws, budget - gemm_ws, 1, key_tiles)
    lane_scores = (budget - 2 * gemm_ws) // 2 // 256 * 256
    if lanes > 1 and plan.computed_chunks >= LANE_MIN_CHUNKS:
        try:
            return _grid(case, budget, gemm_ws, lane_scores, 2, key_tiles)
        except ValueError:
            pass  # half the budget is too small: one lane
    return plan


_MASK_BYTES = {"bool": 1, "fp16": 2, "bf16": 2, "fp32": 4}  # a mask element (native/softmax.cu's mask_esize)


def _row_block(case: Case) -> int:
    """Query rows of a whole-row chunk before the budget cuts them."""
    return min(case.Sq, CAUSAL_ROW_BLOCK if case.causal else ROW_BLOCK)


def _ring_mask_bytes(case: Case) -> int:
    """Bytes a key of the mask takes in the softmax's ring: a dense mask contiguous over keys streams through it."""
    m = case.mask
    return _MASK_BYTES[m.dtype] if m is not None and m.strides[3] == 1 else 0


def _ring_keys(ring_bytes: int, case: Case) -> int:
    """The longest score row (keys, a multiple of :data:`KEY_BLOCK`) whose two ring slots, FP32 scores and the
    mask's bytes in the ring, take at most ``ring_bytes``."""
    return ring_bytes // (2 * (4 + _ring_mask_bytes(case))) // KEY_BLOCK * KEY_BLOCK


def one_cta_keys(case: Case) -> int:
    """The longest score row (keys, a multiple of :data:`KEY_BLOCK`) of ``case`` that one softmax CTA holds: two
    ring slots of FP32 scores, plus the mask's bytes when a dense mask is contiguous over keys (the kernel then
    streams it through the ring: bool 22528 keys, 16-bit 18688, fp32 14080; unmasked :data:`ONE_CTA_KEYS`)."""
    return _ring_keys(PIPE_RING_BYTES, case)


def tile_keys(case: Case) -> int:
    """The longest key tile of ``case``, and the row length past which calls of at least :data:`TILE_MIN_ROWS`
    query rows tile their keys: :func:`one_cta_keys` without a mask in the ring; with one, the longest row whose
    two ring slots leave room for two softmax CTAs an SM (:data:`TWO_CTA_RING_BYTES`: bool 11264 keys, 16-bit
    9472, fp32 7168). Longer masked rows run one CTA an SM; tiled, B1 H16 D128: H200
    S16k 0.941x the time of whole rows with a bf16 mask, 0.944x with a bool one, S12k 0.968x / 0.972x, S32k bool
    0.950x against tiles of 16384; H100 S16k bf16 0.984x, S32k 0.987x against tiles of 16384."""
    return _ring_keys(TWO_CTA_RING_BYTES if _ring_mask_bytes(case) else PIPE_RING_BYTES, case)


def long_rows(case: Case) -> bool:
    """Whether ``case`` is a call of at least :data:`TILE_MIN_ROWS` query rows whose score rows are longer than the
    softmax runs at its full rate (:func:`tile_keys`): such calls tile their keys at any budget."""
    return case.Sq >= TILE_MIN_ROWS and case.Sk > tile_keys(case)


def _whole_rows(case: Case, scores: int) -> int:
    """Query rows of a chunk over whole key rows within ``scores`` bytes (a multiple of 64 from 64 on)."""
    whole = min(_row_block(case), scores // (score_ld(case.Sk) * 4))
    return whole - whole % 64 if whole >= 64 else whole


def _grid(case: Case, budget: int, gemm_ws: int, scores: int, lanes: int, key_tiles: bool) -> ChunkPlan:
    """The plan whose chunks' FP32 scores (and key tiles' accumulators) take at most ``scores`` bytes a lane."""
    one_row = score_ld(case.Sk) * 4
    g = case.group
    combine = all(_combinable(s, case.B, case.Hkv, u)
                  for s, u in ((case.q_strides, g), (case.k_strides, 1), (case.v_strides, 1)))
    tile_rows = key_tiles and long_rows(case)
    fold = (_foldable(case) and not tile_rows and g * case.Sq * one_row <= scores
            and (not case.causal or g * case.Sq <= FOLD_CAUSAL_MAX_ROWS))
    m, tile = g * case.Sq, 0
    if not fold:
        m = _row_block(case)
        whole = _whole_rows(case, scores)
        tiled = tile_rows or (key_tiles and whole < min(m, TILE_MIN_ROWS))
        rows, tile = _key_tiling(case, scores, min(case.Sq, TILE_ROWS)) if tiled else (0, 0)
        if rows > whole or (tile_rows and rows):
            m = rows
        else:
            m, tile = whole, 0
        if m < 1:
            need = (f"not even a key tile of {min(case.Sq, 64)} rows x {KEY_BLOCK} keys fits with its accumulators"
                    if key_tiles else f"one row of FP32 scores needs {one_row} bytes")
            raise ValueError(f"workspace budget of {budget} bytes is too small for {case}: {need}, plus the cuBLASLt "
                             "workspace; raise ATTN_LT_WORKSPACE_MB or workspace_bytes")
    plan = ChunkPlan(case, budget, gemm_ws, 0, fold, combine, m, tile, 0, lanes, scores)
    used = acc = 0
    for c, _ in plan.shapes().values():
        if c.kend:
            used = max(used, c.ne * plan.rows(c) * score_ld(c.keys) * 4)
        if c.tile:
            acc = max(acc, tile_regions(plan, c)[1])
    used = _round_up(used, 256) if lanes > 1 or acc else used  # the next lane, or the accumulators, 256-aligned
    assert used + acc <= scores, (used, acc, scores)
    return ChunkPlan(case, budget, gemm_ws, used, fold, combine, m, tile, acc, lanes, scores)


def _key_tiling(case: Case, scores: int, m: int) -> tuple[int, int]:
    """(rows a row block, keys a tile) for key-tiled chunks within ``scores`` bytes: the most rows up to ``m``
    (a multiple of 64), then the longest tile within the budget, :data:`KEY_TILE_MAX` and :func:`tile_keys`
    that is a multiple of the unit, lcm(rows, :data:`KEY_BLOCK`) (so that causal row blocks meet a bounded set of
    tile lengths; the unit alone when it is longer); without causal masking, every row block covers all ``Sk``
    keys, so the tiles are then balanced: the same count, each ceil(Sk / count) rounded up to the unit; (0, 0)
    when no tile of 64 rows (``m`` if fewer) fits."""
    longest = min(KEY_TILE_MAX, tile_keys(case))
    rows = m - m % 64 if m >= 64 else m
    while rows >= min(m, 64):
        unit = math.lcm(rows, KEY_BLOCK)
        room = scores - _tile_acc_bytes(rows, case.Dv) - _ACC_PAD
        tile = room // (rows * 4) // unit * unit if room > 0 else 0
        while tile and rows * score_ld(tile) * 4 > room:
            tile -= unit
        if tile >= unit:
            tile = min(tile, max(unit, longest // unit * unit), _round_up(case.Sk, unit))
            if not case.causal:  # Sk in ceil(Sk / tile) equal tiles
                tile = _round_up(-(-case.Sk // -(-case.Sk // tile)), unit)
            return rows, tile
        rows = rows - 64 if rows > 64 else rows // 2
    return 0, 0


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
    the score region (P, in the input dtype, uses twice the row and batch strides at the same addresses). ``col0``
    is the first key's index (key tiles); ``part`` is where a key-tiled chunk's P@V goes instead of ``o``: an FP32
    view from the start of the lane's tile accumulators (the running output for a first tile, else the partial
    one; :func:`tile_regions`)."""

    q: MatrixView
    k: MatrixView
    v: MatrixView
    o: MatrixView
    s: MatrixView
    row0: int  # first row's index in the flattened (group, Sq) rows, for the softmax kernel
    gi0: int
    col0: int = 0
    part: MatrixView | None = None


def out_strides(case: Case, layout: str = "bhsd") -> tuple[int, int, int, int]:
    """Strides over (B, Hq, Sq, Dv) of the output, contiguous in ``layout`` ("bhsd": (B, Hq, Sq, Dv); "bshd":
    (B, Sq, Hq, Dv))."""
    if layout == "bshd":
        return (case.Sq * case.Hq * case.Dv, case.Dv, case.Hq * case.Dv, 1)
    return (case.Hq * case.Sq * case.Dv, case.Sq * case.Dv, case.Dv, 1)


def chunk_layout(case: Case, plan: ChunkPlan, c: Chunk) -> ChunkLayout:
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
    N = c.keys
    k = view(case.k_strides, 1, N, D, case.k_strides[2], c.k0 * case.k_strides[2])
    v = view(case.v_strides, 1, N, Dv, case.v_strides[2], c.k0 * case.v_strides[2])
    ld = score_ld(N)
    s = MatrixView(0, M, N, ld, c.ne, M * ld)
    part = None
    if c.tile:
        offsets, _ = tile_regions(plan, c)
        part = MatrixView((offsets[0] if c.tile == "first" else offsets[2]) // 4, M, Dv, Dv, c.ne, M * Dv)
    return ChunkLayout(q, k, v, o, s, row0, gi0, c.k0, part)
