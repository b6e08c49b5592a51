"""Execute a :class:`~attn_lt.plan.Plan` on the GPU: per chunk, Q@K^T into the FP32 score region, the native
softmax (P in place, LSE), and P@V into the output, all on the caller's current stream."""

from __future__ import annotations

import time

import torch

from .. import config, native
from ..plan import Chunk, ChunkLayout, Plan, chunk_layout
from ..validate import Case, address_alignment as alignment
from . import algos, cublaslt
from .cublaslt import GemmKey

_ESIZE = 2  # bytes per fp16/bf16 element


def gemm_keys(case: Case, lay: ChunkLayout, ptrs: tuple[int, int, int, int, int]) -> tuple[GemmKey, GemmKey]:
    """The (qk, pv) GEMM keys of one chunk; ``ptrs`` are the device addresses of q, k, v, o and the scores."""
    q, k, v, o, s = ptrs
    qk = GemmKey("qk", case.dtype, m=lay.k.rows, n=lay.q.rows, k=case.D, batch=lay.s.batch,
                 trans_a=True, trans_b=False, lda=lay.k.row_stride, ldb=lay.q.row_stride, ldc=lay.s.row_stride,
                 stride_a=lay.k.batch_stride, stride_b=lay.q.batch_stride, stride_c=lay.s.batch_stride,
                 align_a=alignment(k), align_b=alignment(q), align_c=alignment(s))
    pv = GemmKey("pv", case.dtype, m=case.D, n=lay.q.rows, k=lay.k.rows, batch=lay.s.batch,
                 trans_a=False, trans_b=False, lda=lay.v.row_stride, ldb=2 * lay.s.row_stride,
                 ldc=lay.o.row_stride, stride_a=lay.v.batch_stride, stride_b=2 * lay.s.batch_stride,
                 stride_c=lay.o.batch_stride, align_a=alignment(v), align_b=alignment(s), align_c=alignment(o))
    return qk, pv


def chunk_gemms(case: Case, plan: Plan, c: Chunk, bases: tuple[int, int, int, int, int]):
    """(layout, operand addresses of q, k, v, o and the scores, (qk, pv) keys) of chunk ``c``, given the base
    addresses of q, k, v, out and the score region."""
    lay = chunk_layout(case, plan, c)
    qb, kb, vb, ob, sb = bases
    ptrs = (qb + lay.q.offset * _ESIZE, kb + lay.k.offset * _ESIZE, vb + lay.v.offset * _ESIZE,
            ob + lay.o.offset * _ESIZE, sb)
    return lay, ptrs, gemm_keys(case, lay, ptrs)


def _zero_masked_chunk(case: Case, c: Chunk, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Rows whose every key is masked (causal with Sq > Sk): output 0, LSE -inf."""
    g = case.group
    for e in range(c.e0, c.e0 + c.ne):
        b, h = divmod(e, case.Hkv)
        heads = slice(h * g, (h + 1) * g) if c.gi is None else slice(h * g + c.gi, h * g + c.gi + 1)
        out[b, heads, c.s0:c.s1].zero_()
        lse[b, heads, c.s0:c.s1] = float("-inf")


def run(case: Case, plan: Plan, q, k, v, mask, out: torch.Tensor, lse: torch.Tensor,
        policy: str = "heuristic") -> None:
    """Run ``plan`` for tensors q, k, v (and the user mask, already expanded to (B, Hq, Sq, Sk) or None),
    writing ``out`` (contiguous (B, Hq, Sq, D)) and ``lse`` (contiguous FP32 (B, Hq, Sq)); ``policy`` is the
    algorithm policy (see lt/algos.py). A GEMM met for the first time is resolved (cache, tuning) on its own
    operands before it runs."""
    device = q.device.index
    stream = torch.cuda.current_stream(q.device).cuda_stream
    deadline = time.perf_counter() + config.tune_call_ms() / 1e3
    ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=q.device)
    gemm_ws, scores = ws.data_ptr(), ws.data_ptr() + plan.gemm_workspace
    bases = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), scores)
    args = native.SoftmaxArgs()
    args.scores = args.probs = scores
    args.lse = lse.data_ptr()
    args.Sq, args.Sk, args.g, args.Hkv, args.Hq = case.Sq, case.Sk, case.group, case.Hkv, case.Hq
    args.causal = int(case.causal)
    args.out_dtype = native.DTYPE_CODES[case.dtype]
    args.variant = native.SOFTMAX_VARIANTS[config.softmax_variant()]
    if mask is not None:
        args.mask = mask.data_ptr()
        args.mask_dtype = native.DTYPE_CODES[case.mask.dtype]
        args.m_sb, args.m_sh, args.m_sq, args.m_sk = case.mask.strides
    for c in plan.chunks:
        if c.kend == 0:
            _zero_masked_chunk(case, c, out, lse)
            continue
        lay, ptrs, (qk_key, pv_key) = chunk_gemms(case, plan, c, bases)
        qk = cublaslt.gemm(device, qk_key, plan.gemm_workspace, policy)
        qk_ops = (ptrs[1], ptrs[0], scores, case.scale, gemm_ws, plan.gemm_workspace, stream)
        if not qk.resolved:
            algos.resolve(qk, policy, plan.gemm_workspace, qk_ops, deadline)
        qk.run(*qk_ops)
        args.rows, args.cols, args.batch = lay.s.rows, lay.s.cols, lay.s.batch
        args.ld_s, args.bs_s = lay.s.row_stride, lay.s.batch_stride
        args.ld_p, args.bs_p = 2 * lay.s.row_stride, 2 * lay.s.batch_stride
        args.row0, args.gi0, args.e0 = lay.row0, lay.gi0, c.e0
        native.softmax(args, stream)
        pv = cublaslt.gemm(device, pv_key, plan.gemm_workspace, policy)
        pv_ops = (ptrs[2], scores, ptrs[3], 1.0, gemm_ws, plan.gemm_workspace, stream)
        if not pv.resolved:  # tuned on the real P, which the next line overwrites with the same result
            algos.resolve(pv, policy, plan.gemm_workspace, pv_ops, deadline)
        pv.run(*pv_ops)
