"""The long path's Q@K^T on Hopper by native/scores_sm90.cu instead of cuBLASLt, under the settings' ``qk="native"``
option (``attn_lt.config.override``).

The scores GEMM (k = D, FP32 output) is bound by its 4-byte stores. The native kernel overlaps one tile's TMA stores
with the next tile's loads and MMAs on a persistent grid whose CTAs each keep one K block. Measured
(``tools/experiments/bench_scores.py``, bf16, 2048 rows x 16384 keys x 3 heads): at D128 it writes 3.40 TB/s on the H200
against cuBLASLt's 3.22 (2.62 against 2.49 on the H100), at D64 the same as cuBLASLt, and the long path with one
lane gains up to 1.5 points of its floor; with the default two lanes the long path loses 1-3 points, since the
kernel's grid holds every SM while the other lane's softmax waits for them. So cuBLASLt stays the default
(docs/performance-log.md has the figures).

:func:`qk_gemm` gives a chunk its Q@K^T: a :class:`NativeScores` where :func:`runs_native`, else cuBLASLt's
:class:`~attn_lt.lt.cublaslt.Gemm`.
"""

from __future__ import annotations

import ctypes
import logging

from .. import config, native
from ..fused import device_facts
from . import cublaslt
from .cublaslt import GemmKey

log = logging.getLogger("attn_lt")

#: Head dims the kernel is built for.
HEAD_DIMS = (64, 128)

#: Where the algorithm of a native Q@K^T comes from, as ``explain`` shows it.
SOURCE = "native (scores_sm90: Hopper Q@K^T, the qk='native' option)"

#: Mirrors of attn_lt_scores_sm90's checks (native/scores_sm90.cu): lengths, tiles, strides (bytes, as TMA takes).
MAX_LENGTH = 1 << 31
MAX_TILES = (1 << 31) - (1 << 20)
MAX_STRIDE_BYTES = 1 << 40
TILE = 128
#: The share of the SMs a grid that keeps K must cover for the kernel to be run (measured: a grid of half the SMs
#: writes at half the rate; with more key blocks than SMs no CTA keeps K and the kernel is 8-25 % slower).
MIN_SM_SHARE = 0.9


def native_reasons(key: GemmKey, sms: int) -> list[str]:
    """Why the native kernel does not take the Q@K^T ``key`` on a Hopper GPU of ``sms`` SMs (empty: it does): what
    it cannot run (the launcher's checks), and where it is measured slower than cuBLASLt."""
    why = []
    if key.role != "qk" or key.out_dtype != "fp32" or not key.trans_a or key.trans_b:
        why.append("not the long path's Q@K^T with FP32 scores")
    if key.dtype not in ("fp16", "bf16"):
        why.append(f"dtype {key.dtype}")
    if key.k not in HEAD_DIMS:
        why.append(f"head dim {key.k} not in {HEAD_DIMS}")
    if min(key.align_a, key.align_b, key.align_c) < 16:
        why.append("an operand not 16-byte aligned")

    def stride_ok(size: int, stride: int, esize: int) -> bool:  # elements of esize bytes
        return size == 1 or (0 < stride * esize < MAX_STRIDE_BYTES and stride * esize % 16 == 0)

    if not (stride_ok(key.m, key.lda, 2) and stride_ok(key.n, key.ldb, 2) and stride_ok(key.batch, key.stride_a, 2)
            and stride_ok(key.batch, key.stride_b, 2) and stride_ok(key.n, key.ldc, 4)
            and stride_ok(key.batch, key.stride_c, 4)):
        why.append("a stride that is not a positive multiple of 16 bytes below 2^40 bytes")
    if key.ldc < -(-key.m // 4) * 4:
        why.append("score rows shorter than their last 16-byte chunk, which the kernel writes whole")
    key_blocks = -(-key.m // TILE)
    if max(key.m, key.n, key.batch) >= MAX_LENGTH or key_blocks * -(-key.n // TILE) > MAX_TILES // key.batch:
        why.append("more rows, keys or tiles than the kernel indexes")
    if key_blocks > sms:
        why.append(f"{key_blocks} key blocks of {TILE}, more than the {sms} SMs: no CTA keeps K (slower than "
                   "cuBLASLt)")
    elif key_blocks * (sms // key_blocks) < MIN_SM_SHARE * sms:
        why.append(f"{key_blocks} key blocks of {TILE}: a grid that keeps K uses {key_blocks * (sms // key_blocks)} "
                   f"of {sms} SMs (slower than cuBLASLt)")
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


def runs_native(device: int, key: GemmKey) -> bool:
    """Whether :func:`qk_gemm` gives ``key`` the native kernel on ``device``: the ``qk="native"`` option, a Hopper GPU,
    and nothing in :func:`native_reasons`."""
    if config.current().qk != "native" or key.role != "qk":
        return False
    facts = device_facts(device)  # the library's sm_90a build holds this kernel beside the fused one
    if facts is None or not facts.hopper:
        return False
    why = native_reasons(key, facts.sms)
    if why:
        log.debug("qk=native: cuBLASLt runs %s: %s", key, "; ".join(why))
    return not why


def qk_gemm(device: int, key: GemmKey):
    """The Q@K^T of ``key`` on ``device``: a new :class:`NativeScores` where :func:`runs_native` (each holds the
    arguments of its own launches: one per chunk of a program, which runs one call at a time), else cuBLASLt's
    :class:`~attn_lt.lt.cublaslt.Gemm` (shared; its ``run`` keeps no per-call state)."""
    if runs_native(device, key):
        return NativeScores(device, key)
    return cublaslt.gemm(device, key)
