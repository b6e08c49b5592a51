"""The long path's Q@K^T on Hopper by native/scores_sm90.cu instead of cuBLASLt, when ``ATTN_LT_QK=native``.

The scores GEMM (k = D, FP32 output) is bound by its 4-byte stores. The native kernel overlaps one tile's TMA stores
with the next tile's loads and MMAs on a persistent grid. Measured (``tools/bench_scores.py``, bf16, 2048 rows x
16384 keys x 3 heads, D 128): alone it writes 3.30-3.38 TB/s on the H200 against cuBLASLt's 3.18 (2.62 against
2.49 on the H100), and the long path with one lane gains about 1 %; with the default two lanes the long path is
1-3 % slower, since its grid takes every SM while the other lane's softmax waits for them. So cuBLASLt stays the
default; ``tools/NOTES.md`` (nineteenth pass) has the figures.

:func:`qk_gemm` gives a chunk its Q@K^T: :class:`NativeScores` where :func:`runs_native`, else cuBLASLt's
:class:`~attn_lt.lt.cublaslt.Gemm`.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from .. import config, native
from . import cublaslt
from .cublaslt import GemmKey

log = logging.getLogger("attn_lt")

#: Head dims the kernel is built for.
HEAD_DIMS = (64, 128)

#: Where the algorithm of a native Q@K^T comes from, as ``explain`` shows it.
SOURCE = "native (scores_sm90: Hopper Q@K^T, ATTN_LT_QK=native)"


def native_reasons(key: GemmKey) -> list[str]:
    """Why the native kernel cannot take the Q@K^T ``key`` on a Hopper GPU (empty: it can)."""
    why = []
    if key.role != "qk" or key.out_dtype != "fp32" or not key.trans_a or key.trans_b:
        why.append("not the long path's Q@K^T with FP32 scores")
    if key.k not in HEAD_DIMS:
        why.append(f"head dim {key.k} not in {HEAD_DIMS}")
    if min(key.align_a, key.align_b, key.align_c) < 16:
        why.append("an operand not 16-byte aligned")

    def stride_ok(size: int, stride: int, per16: int) -> bool:
        return size == 1 or (stride > 0 and stride % per16 == 0)

    if not (stride_ok(key.m, key.lda, 8) and stride_ok(key.n, key.ldb, 8) and stride_ok(key.batch, key.stride_a, 8)
            and stride_ok(key.batch, key.stride_b, 8) and stride_ok(key.n, key.ldc, 4)
            and stride_ok(key.batch, key.stride_c, 4)):
        why.append("a stride that is not a multiple of 16 bytes")
    return why


class NativeScores:
    """A chunk's Q@K^T by native/scores_sm90.cu, with :class:`~attn_lt.lt.cublaslt.Gemm`'s ``run`` contract
    (A = K, B = Q, C = the scores, alpha at a host address); nothing to resolve."""

    resolved = True
    algo_source = SOURCE
    workspace_size = 0

    def __init__(self, device: int, key: GemmKey):
        self.key, self.device = key, device
        a = self.args = native.ScoresArgs()
        a.rows, a.cols, a.batch, a.D = key.n, key.m, key.batch, key.k
        a.q_ld, a.q_bs, a.k_ld, a.k_bs = key.ldb, key.stride_b, key.lda, key.stride_a
        a.s_ld, a.s_bs = key.ldc, key.stride_c
        a.dtype = native.DTYPE_CODES[key.dtype]

    def run(self, a: int, b: int, c: int, alpha_ptr: int, workspace: int, workspace_size: int, stream: int,
            algo=None) -> None:
        """scores (c) = alpha * Q (b) @ K (a)^T on ``stream``; the workspace is not used."""
        args = self.args
        args.k, args.q, args.s = a, b, c
        args.alpha = ctypes.c_float.from_address(alpha_ptr).value
        native.scores_sm90(args, stream)


@functools.lru_cache(maxsize=16)
def _hopper(device: int) -> bool:
    """Whether the native Q@K^T runs on ``device`` (sm_90, the library built for sm_90a)."""
    try:
        import torch

        with torch.cuda.device(device):
            return native.scores_sm90_supported(HEAD_DIMS[0])
    except (native.NativeLibraryError, RuntimeError, OSError):
        return False


def runs_native(device: int, key: GemmKey) -> bool:
    """Whether :func:`qk_gemm` gives ``key`` the native kernel on ``device``: ``ATTN_LT_QK=native``, a Hopper GPU,
    and nothing in :func:`native_reasons`."""
    if config.qk_kernel() != "native" or key.role != "qk" or not _hopper(device):
        return False
    why = native_reasons(key)
    if why:
        log.debug("ATTN_LT_QK=native: cuBLASLt runs %s: %s", key, "; ".join(why))
    return not why


def qk_gemm(device: int, key: GemmKey):
    """The Q@K^T of ``key`` on ``device``: :class:`NativeScores` where :func:`runs_native`, else cuBLASLt's."""
    if runs_native(device, key):
        return _native(device, key)
    return cublaslt.gemm(device, key)


@functools.lru_cache(maxsize=1024)
def _native(device: int, key: GemmKey) -> NativeScores:
    return NativeScores(device, key)
