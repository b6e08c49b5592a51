"""The long path ``lt``: its declaration and its executor.

Per chunk of a :class:`~attn_lt.chunks.ChunkPlan`: Q@K^T into the FP32 score region (cuBLASLt, or the Hopper
kernel of ``lt/scores.py`` under the ``qk="native"`` option), the native softmax (P in place over the scores,
LSE), P@V into the output (cuBLASLt), all on the caller's current stream; a key tile's P@V goes to an FP32 partial
output instead, which the native merge joins by LSE (the last tile writes the output). A :class:`Program` prepares one plan once —
every chunk's operand offsets, both GEMMs with their descriptors and algorithms, the softmax arguments — so that a
call only adds base addresses and launches.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from .. import config, native
from ..backends import Backend
from ..chunks import Chunk, ChunkLayout, ChunkPlan, chunk_layout, tile_regions
from ..validate import Case, address_alignment
from . import algos, cublaslt, scores
from .cublaslt import GemmKey

#: The long path runs any head dim cuBLASLt accepts (v's may differ from q's and k's); the softmax does not
#: depend on it.
LT = Backend("lt", ("fp16", "bf16"), None, 4096, supports_value_dim=True, supports_key_mass=True)

_ESIZE = 2  # bytes per fp16/bf16 element


def gemm_keys(case: Case, lay: ChunkLayout, ptrs: tuple[int, int, int, int, int]) -> tuple[GemmKey, GemmKey]:
    """The (qk, pv) GEMM keys of one chunk; ``ptrs`` are the device addresses of q, k, v, P@V's output (the
    output, or a key tile's FP32 partial) and the scores."""
    q, k, v, o, s = ptrs
    qk = GemmKey("qk", case.dtype, m=lay.k.rows, n=lay.q.rows, k=case.D, batch=lay.s.batch,
                 trans_a=True, trans_b=False, lda=lay.k.row_stride, ldb=lay.q.row_stride, ldc=lay.s.row_stride,
                 stride_a=lay.k.batch_stride, stride_b=lay.q.batch_stride, stride_c=lay.s.batch_stride,
                 align_a=address_alignment(k), align_b=address_alignment(q), align_c=address_alignment(s))
    o_view = lay.o if lay.part is None else lay.part
    pv = GemmKey("pv", case.dtype, m=case.Dv, n=lay.q.rows, k=lay.k.rows, batch=lay.s.batch,
                 trans_a=False, trans_b=False, lda=lay.v.row_stride, ldb=2 * lay.s.row_stride,
                 ldc=o_view.row_stride, stride_a=lay.v.batch_stride, stride_b=2 * lay.s.batch_stride,
                 stride_c=o_view.batch_stride, align_a=address_alignment(v), align_b=address_alignment(s),
                 align_c=address_alignment(o), out="" if lay.part is None else "fp32")
    return qk, pv


def chunk_gemms(case: Case, plan: ChunkPlan, c: Chunk, bases: tuple[int, int, int, int, int]):
    """(layout, operand addresses of q, k, v, o and the scores, (qk, pv) keys) of chunk ``c``, given the base
    addresses of q, k, v, out and the score region (a key tile's partial output lies in the lane's tile
    accumulators, which start 256-byte aligned after the scores)."""
    lay = chunk_layout(case, plan, c)
    qb, kb, vb, ob, sb = bases
    ptrs = (qb + lay.q.offset * _ESIZE, kb + lay.k.offset * _ESIZE, vb + lay.v.offset * _ESIZE,
            ob + lay.o.offset * _ESIZE, sb)
    pv_out = ptrs[3] if lay.part is None else sb + plan.score_bytes + lay.part.offset * 4
    return lay, ptrs, gemm_keys(case, lay, ptrs[:3] + (pv_out, sb))


def model_bases(case: Case, out_align: int = 256) -> tuple[int, int, int, int, int]:
    """Stand-in base addresses with exactly the alignment a plan is made for (the inputs' ``case.ptr_align``,
    the output's ``out_align``, the 256-byte aligned score region): every chunk's GEMM keys (alignments included)
    depend on the bases only through these alignments."""
    far = 1 << 40

    def at(align: int) -> int:
        return far + align  # the lowest set bit is ``align`` (far is a larger power of two)

    return at(case.ptr_align), at(case.ptr_align), at(case.ptr_align), at(out_align), at(256)


def plan_gemm_keys(case: Case, plan: ChunkPlan, out_align: int = 256) -> list[tuple[GemmKey, GemmKey]]:
    """The (qk, pv) keys of one computed chunk of each shape of ``plan`` (:meth:`ChunkPlan.shapes`), in plan
    order."""
    bases = model_bases(case, out_align)
    return [chunk_gemms(case, plan, c, bases)[2] for c, _ in plan.shapes().values() if c.kend]


#: Plans of at most this many computed chunks are prepared whole (every chunk's GEMMs and arguments built once);
#: larger ones (long keys: hundreds of thousands of chunks) build each chunk's step as it runs, some 30 µs of host
#: time against the hundreds of µs of GPU work of a chunk that size.
PREPARED_MAX_CHUNKS = 4096


class _Step:
    """One computed chunk: byte offsets of its operands from the bases, its GEMMs and softmax arguments; for a key
    tile, byte offsets from the lane's tile accumulators of its LSE and P@V output and of the four accumulators
    (:func:`~attn_lt.chunks.tile_regions`), and its merge's arguments (None for a first tile)."""

    __slots__ = ("chunk", "q", "k", "v", "o", "qk", "pv", "args", "lane", "tile_lse", "tile_out", "regions", "merge",
                 "adds_mass")

    def __init__(self, chunk, offsets, qk, pv, args, lane, regions=None, merge=None):
        self.chunk = chunk
        self.q, self.k, self.v, self.o = offsets
        self.qk, self.pv, self.args, self.lane = qk, pv, args, lane
        self.regions, self.merge = regions, merge
        self.adds_mass: bool | None = None  # whether the softmax can add its P into the mass (asked once)
        self.tile_lse = self.tile_out = None
        if regions is not None:  # a first tile starts the running result, the others write the partial one
            self.tile_out, self.tile_lse = regions[0:2] if chunk.tile == "first" else regions[2:4]


class Program:
    """The long path's run of one plan on one device, prepared once (descriptors, algorithms, arguments).

    ``run`` takes base addresses and launches; a GEMM whose algorithm is not yet resolved under the policy is
    resolved (cache, or tuned on the call's own operands within ``ATTN_LT_TUNE_CALL_MS``) the first time it runs.
    One program serves one call at a time (a lock guards its argument structs)."""

    def __init__(self, case: Case, plan: ChunkPlan, device: int, policy: str, out_align: int = 256):
        self.case, self.plan, self.device, self.policy = case, plan, device, policy
        self._lock = threading.Lock()
        self._alpha = np.array([case.scale], dtype=np.float32)
        self._one = np.array([1.0], dtype=np.float32)
        self._alpha_ptr, self._one_ptr = self._alpha.ctypes.data, self._one.ctypes.data
        self._model = model_bases(case, out_align)
        self.empty_chunks = tuple(c for rb in plan.row_blocks() if not rb.kend for c in plan.chunks_of(rb))
        #: every computed chunk's step, or None when the plan is too large to list (steps made as they run)
        self.steps: list[_Step] | None = (list(self._steps()) if plan.computed_chunks <= PREPARED_MAX_CHUNKS
                                          else None)
        self._lean = self.steps is not None and not plan.key_tile
        #: each (entry, query head) has one chunk, over every key and every query row: the attention mass per key
        #: is written once (no zeroing, no accumulation; what decode needs), not summed chunk by chunk
        self.mass_written_once = self.steps is not None and not self.empty_chunks and not plan.key_tile and all(
            s.chunk.kend == case.Sk and s.chunk.s0 == 0 and s.chunk.s1 == case.Sq for s in self.steps)
        self.pending = self.steps is None or any(not (s.qk.resolved and s.pv.resolved) for s in self.steps)

    def _steps(self):
        """Every computed chunk's step, in plan order; a row block's key tiles stay on one lane."""
        group = -1
        for c in self.plan.iter_chunks():
            if c.tile in ("", "first"):
                group += 1
            if c.kend:
                yield self._step(c, group % self.plan.lanes)

    def _step(self, c: Chunk, lane: int) -> _Step:
        lay, ptrs, (qk_key, pv_key) = chunk_gemms(self.case, self.plan, c, self._model)
        offsets = tuple(p - b for p, b in zip(ptrs[:4], self._model[:4]))
        qk, pv = scores.qk_gemm(self.device, qk_key), cublaslt.gemm(self.device, pv_key)
        args = self._softmax_args(lay, c)
        if not c.tile:
            return _Step(c, offsets, qk, pv, args, lane)
        regions, _ = tile_regions(self.plan, c)
        args.lse_local = 1
        merge = None
        if c.tile != "first":
            case = self.case
            merge = native.TileMergeArgs()
            merge.rows, merge.batch, merge.Dv = lay.s.rows, lay.s.batch, case.Dv
            merge.o_ld, merge.o_bs = lay.o.row_stride, lay.o.batch_stride
            merge.row0, merge.gi0, merge.e0 = lay.row0, lay.gi0, c.e0
            merge.Sq, merge.g, merge.Hkv, merge.Hq = case.Sq, case.group, case.Hkv, case.Hq
            merge.out_dtype = native.DTYPE_CODES[case.dtype]
            merge.last = int(c.tile == "last")
        return _Step(c, offsets, qk, pv, args, lane, regions, merge)

    def _softmax_args(self, lay: ChunkLayout, c: Chunk) -> native.SoftmaxArgs:
        case = self.case
        a = native.SoftmaxArgs()
        a.Sq, a.Sk, a.g, a.Hkv, a.Hq = case.Sq, case.Sk, case.group, case.Hkv, case.Hq
        a.causal = int(case.causal)
        a.out_dtype = native.DTYPE_CODES[case.dtype]
        a.variant = native.SOFTMAX_VARIANTS[config.current().softmax]
        if case.mask is not None:
            a.mask_dtype = native.DTYPE_CODES[case.mask.dtype]
            a.m_sb, a.m_sh, a.m_sq, a.m_sk = case.mask.strides
        a.rows, a.cols, a.batch = lay.s.rows, lay.s.cols, lay.s.batch
        a.ld_s, a.bs_s = lay.s.row_stride, lay.s.batch_stride
        a.ld_p, a.bs_p = 2 * lay.s.row_stride, 2 * lay.s.batch_stride
        a.row0, a.gi0, a.e0, a.k0 = lay.row0, lay.gi0, c.e0, lay.col0
        return a

    def key_mass_buffer(self, device: torch.device, window: int | None = None) -> torch.Tensor:
        """The FP32 (B, Hq, Sk) tensor ``run`` takes as ``key_mass`` (with the same ``window``): uninitialised
        when the softmax writes every element once (:meth:`_mass_direct`), else zeroed (sums are added into it)."""
        case = self.case
        make = torch.empty if self._mass_direct(window) else torch.zeros
        return make((case.B, case.Hq, case.Sk), dtype=torch.float32, device=device)

    def _mass_direct(self, window: int | None) -> bool:
        """One row a head in the window and one chunk a head: the softmax writes the mass as it writes P."""
        return self.mass_written_once and min(self.case.Sq, window or self.case.Sq) == 1

    def gemms(self) -> list[tuple[Chunk, object, object]]:
        """(chunk, qk Gemm, pv Gemm) of every computed chunk (of one chunk a shape when the plan is too large to
        list)."""
        steps = self.steps
        if steps is None:
            steps = [self._step(c, 0) for c, _ in self.plan.shapes().values() if c.kend]
        return [(s.chunk, s.qk, s.pv) for s in steps]

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, out: torch.Tensor,
            lse: torch.Tensor, workspace: torch.Tensor, stream: int, may_tune: bool = True,
            tune_budget_ms: float | None = None, key_mass: torch.Tensor | None = None,
            key_mass_window: int | None = None) -> None:
        """Run every chunk on ``stream`` (and, with two lanes, a second stream forked from and joined back to it).
        ``workspace``: a CUDA uint8 tensor of at least ``plan.workspace_bytes`` bytes (per lane, cuBLASLt's share
        then the score region, then the key tiles' accumulators). ``tune_budget_ms``: tuning time this call may
        spend (default ``ATTN_LT_TUNE_CALL_MS``). ``key_mass``: an FP32 (B, Hq, Sk) tensor from
        :meth:`key_mass_buffer` that receives the sum of P over the query rows (the last ``key_mass_window`` rows
        of each head when given; plans without key tiles only): written by the softmax in decode, added by the
        softmax (FP32, per CTA, then atomics) where its PIPE kernel runs the chunk, else summed from P by torch."""
        plan = self.plan
        ws0 = workspace.data_ptr()
        bases = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        lse_ptr, mask_ptr = lse.data_ptr(), (0 if mask is None else mask.data_ptr())
        if key_mass is not None and plan.key_tile:
            raise ValueError("the attention mass per key needs a plan without key tiles (plan_chunks(key_tiles=False))")
        with self._lock:
            for c in self.empty_chunks:
                _zero_masked_chunk(self.case, c, out, lse)
            lanes = _Lanes(self.device, stream) if plan.lanes == 2 else None
            streams = (stream,) if lanes is None else (stream, lanes.side_ptr)
            if lanes is not None:
                lanes.fork()
            # a mass the softmax writes itself as it writes P (decode) takes the lean loop; any other, the general
            direct = key_mass is not None and self._mass_direct(key_mass_window)
            mass_ptr = key_mass.data_ptr() if direct else 0
            summed = None if direct else key_mass
            if self.pending or summed is not None or not self._lean:
                deadline = 0.0
                if self.pending:
                    budget = config.tune_call_ms() if tune_budget_ms is None else tune_budget_ms
                    deadline = time.perf_counter() + budget / 1e3
                self._run_general(bases, lse_ptr, mask_ptr, mass_ptr, workspace, streams, may_tune, deadline,
                                  summed, key_mass_window, lanes)
            else:
                self._run_lean(bases, lse_ptr, mask_ptr, mass_ptr, ws0, streams)
            if lanes is not None:
                lanes.join()

    def _run_lean(self, bases, lse_ptr, mask_ptr, mass_ptr, ws0, streams) -> None:
        """The loop of a prepared plan without key tiles whose GEMMs are resolved: addresses and launches only.
        ``mass_ptr``: the mass the softmax writes as it writes P (0: none)."""
        qb, kb, vb, ob = bases
        softmax, alpha, one = native.softmax, self._alpha_ptr, self._one_ptr
        gws, lane_bytes = self.plan.gemm_workspace, self.plan.lane_bytes
        try:
            for s in self.steps:
                st = streams[s.lane]
                w = ws0 + s.lane * lane_bytes
                scores = w + gws
                s.qk.run(kb + s.k, qb + s.q, scores, alpha, w, gws, st)
                a = s.args
                a.scores = a.probs = scores
                a.lse, a.mask, a.mass = lse_ptr, mask_ptr, mass_ptr
                softmax(a, st)
                s.pv.run(vb + s.v, scores, ob + s.o, one, w, gws, st)
        finally:
            if mass_ptr:  # the arguments are copied at launch; no later run may see a stale mass
                for s in self.steps:
                    s.args.mass = 0

    def _run_general(self, bases, lse_ptr, mask_ptr, mass_ptr, workspace, streams, may_tune, deadline, key_mass,
                     window, lanes) -> None:
        """The loop with algorithm resolution (first runs), key tiles and the attention mass per key that is not
        written by the softmax alone. ``mass_ptr``: the mass the softmax writes as it writes P (0: none);
        ``key_mass``: a mass summed over several rows or chunks (None: none)."""
        qb, kb, vb, ob = bases
        gws = self.plan.gemm_workspace
        ws0 = workspace.data_ptr()
        tile_base = gws + self.plan.score_bytes
        case = self.case
        masses = [] if key_mass is None else [key_mass]
        if masses and lanes is not None:  # lanes write disjoint slices once, or add into their own sums
            if self.mass_written_once:
                masses.append(key_mass)
            else:
                with torch.cuda.stream(lanes.side):  # zeroed in the side lane's order (after the fork)
                    masses.append(torch.zeros_like(key_mass))
        first = 0 if window is None else max(0, case.Sq - window)  # first query position in the window
        for s in self.steps if self.steps is not None else self._steps():
            st = streams[s.lane]
            w = ws0 + s.lane * self.plan.lane_bytes
            scores, tiles = w + gws, w + tile_base
            qk_ops = (kb + s.k, qb + s.q, scores, self._alpha_ptr, w, gws, st)
            if not s.qk.resolved:
                algos.resolve(s.qk, self.policy, gws, qk_ops, deadline, may_tune)
            s.qk.run(*qk_ops)
            a = s.args
            a.scores = a.probs = scores
            a.lse = lse_ptr if s.tile_lse is None else tiles + s.tile_lse
            a.mask, a.mass = mask_ptr, mass_ptr
            added = False
            if masses:  # the softmax adds the chunk's P into the lane's mass where its PIPE kernel runs the chunk
                if s.adds_mass is None:
                    s.adds_mass = native.softmax_adds_mass(a)
                added = s.adds_mass
                if added:
                    a.mass, a.mass_add, a.mass_q0 = masses[s.lane].data_ptr(), 1, first
            try:
                native.softmax(a, st)
            finally:
                a.mass = a.mass_add = 0  # the arguments are copied at launch; no later run may see a stale mass
            if masses and not added:
                region = workspace[w - ws0 + gws:]
                if s.lane == 0:
                    self._add_key_mass(s, region, masses[0], first)
                else:
                    with torch.cuda.stream(lanes.side):
                        self._add_key_mass(s, region, masses[1], first)
            pv_ops = (vb + s.v, scores, ob + s.o if s.tile_out is None else tiles + s.tile_out, self._one_ptr, w,
                      gws, st)
            if not s.pv.resolved:  # tuned on the real P; the run below writes the same result again
                algos.resolve(s.pv, self.policy, gws, pv_ops, deadline, may_tune)
            s.pv.run(*pv_ops)
            m = s.merge
            if m is not None:
                m.acc_o, m.acc_lse, m.part_o, m.part_lse = (tiles + r for r in s.regions)
                m.o, m.lse = (ob + s.o, lse_ptr) if m.last else (0, 0)
                native.tile_merge(m, st)
        if len(masses) == 2:
            lanes.join()
            if masses[1] is not masses[0]:
                masses[0] += masses[1]
                masses[1].record_stream(torch.cuda.current_stream())  # made on the side lane, last read here
        self.pending = self.steps is None or any(not (s.qk.resolved and s.pv.resolved) for s in self.steps)

    def _add_key_mass(self, s: _Step, region: torch.Tensor, key_mass: torch.Tensor, first: int) -> None:
        """key_mass[b, h, :kend] += the sum of this chunk's P rows of query head h from query position ``first``
        on (``=`` when the plan writes the mass once); ``region`` is the chunk's score region (uint8), where P lies
        in the input dtype."""
        case, c, a = self.case, s.chunk, s.args
        dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
        p_all = region.view(dt)
        base = p_all.storage_offset()
        mass3 = key_mass.view(case.B * case.Hkv, case.group, case.Sk)
        if c.gi is None:  # rows are (gi, s) of the whole group
            p = p_all.as_strided((c.ne, case.group, case.Sq - first, c.kend),
                                 (a.bs_p, case.Sq * a.ld_p, a.ld_p, 1), base + first * a.ld_p)
            _sum_into(p, 2, mass3[c.e0:c.e0 + c.ne, :, :c.kend], self.mass_written_once)
            return
        lo = max(c.s0, first)
        if lo >= c.s1:
            return
        p = p_all.as_strided((c.ne, c.s1 - lo, c.kend), (a.bs_p, a.ld_p, 1), base + (lo - c.s0) * a.ld_p)
        _sum_into(p, 1, mass3[c.e0:c.e0 + c.ne, c.gi, :c.kend], self.mass_written_once)


def _sum_into(p: torch.Tensor, dim: int, dest: torch.Tensor, write: bool) -> None:
    """dest (a view of the mass) = or += the FP32 sum of P over ``dim``; a single query row is converted, not
    summed."""
    if p.shape[dim] == 1:
        p = p.squeeze(dim)
        if write:
            dest.copy_(p)
        else:
            dest += p
    elif write:
        assert dest.shape == p.shape[:dim] + p.shape[dim + 1:]  # out= would resize (and leave the mass) otherwise
        torch.sum(p, dim=dim, dtype=torch.float32, out=dest)
    else:
        dest += p.sum(dim=dim, dtype=torch.float32)


class _Lanes:
    """The second lane's stream for calls on one caller stream, with the events that fork it from the caller's
    stream and join it back (kept per (device, caller stream): one set of objects for all calls)."""

    _known: dict[tuple[int, int], tuple] = {}

    def __init__(self, device: int, stream: int):
        got = self._known.get((device, stream))
        if got is None:
            caller = torch.cuda.ExternalStream(stream, device=torch.device("cuda", device)) if stream else \
                torch.cuda.default_stream(device)
            side = torch.cuda.Stream(device=device)
            got = self._known[(device, stream)] = (caller, side, torch.cuda.Event(), torch.cuda.Event())
        self.caller, self.side, self._fork, self._join = got
        self.side_ptr = self.side.cuda_stream
        self._joined = False

    def fork(self) -> None:
        self._fork.record(self.caller)
        self.side.wait_event(self._fork)

    def join(self) -> None:
        if not self._joined:
            self._join.record(self.side)
            self.caller.wait_event(self._join)
            self._joined = True


def _zero_masked_chunk(case: Case, c: Chunk, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Rows whose every key is masked (causal with Sq > Sk): output 0, LSE -inf."""
    g = case.group
    for e in range(c.e0, c.e0 + c.ne):
        b, h = divmod(e, case.Hkv)
        heads = slice(h * g, (h + 1) * g) if c.gi is None else slice(h * g + c.gi, h * g + c.gi + 1)
        out[b, heads, c.s0:c.s1].zero_()
        lse[b, heads, c.s0:c.s1] = float("-inf")
