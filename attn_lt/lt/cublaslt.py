"""A thin layer over ``nvmath.bindings.cublasLt``: one handle per device, descriptors built once per GEMM
shape (:class:`GemmKey`) and reused, execution on the caller's stream, statuses turned into
:class:`CublasLtError` naming the status and the GEMM.

Conventions: cuBLASLt is column-major. A row-major (rows x cols) matrix with row stride ``ld`` is a
column-major (cols x rows) matrix with leading dimension ``ld``, so the long path's GEMMs are

* ``qk``: scores^T (N x M) = K (D x N)^T @ Q^T (D x M)       -> m=N, n=M, k=D, A transposed, FP32 output
* ``pv``: O^T (D x M)      = V^T (D x N) @ P^T (N x M)       -> m=D, n=M, k=N, input-dtype output
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger("attn_lt")

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_DTYPE = {"fp32": _CUDA_R_32F, "fp16": _CUDA_R_16F, "bf16": _CUDA_R_16BF}
_OP_N, _OP_T = 0, 1


class CublasLtError(RuntimeError):
    """A cuBLASLt call failed; the message names the status and the GEMM."""


def _lt():
    from nvmath.bindings import cublasLt  # imported lazily: `import attn_lt` works without nvmath

    return cublasLt


@dataclass(frozen=True)
class GemmKey:
    """Everything that identifies one strided-batched GEMM for descriptors, algorithm choice and caching."""

    role: str  # "qk" (FP32 out) or "pv" (input-dtype out)
    dtype: str  # input dtype, "fp16" | "bf16"
    m: int
    n: int
    k: int
    batch: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    align_a: int
    align_b: int
    align_c: int

    @property
    def out_dtype(self) -> str:
        return "fp32" if self.role == "qk" else self.dtype

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemmKey:
        return cls(**d)

    def __str__(self) -> str:
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        return (f"{self.role} {self.dtype}->{self.out_dtype} {t} m{self.m} n{self.n} k{self.k} batch{self.batch} "
                f"ld({self.lda},{self.ldb},{self.ldc})")


def _set(setter, obj, attr, dtype_of, value) -> None:
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, int(attr), buf.ctypes.data, buf.nbytes)


_handles: dict[int, int] = {}
_handles_lock = threading.Lock()


def handle(device: int) -> int:
    """The cuBLASLt handle of ``device`` (created once per process)."""
    with _handles_lock:
        h = _handles.get(device)
        if h is None:
            import torch

            with torch.cuda.device(device):
                h = _handles[device] = _call("cublasLtCreate", _lt().create)
        return h


def _call(what: str, fn, *args):
    L = _lt()
    try:
        return fn(*args)
    except L.cuBLASLtError as e:
        raise CublasLtError(f"{what} failed: {e}") from e


class Gemm:
    """Descriptors of one :class:`GemmKey` on one device, with the chosen algorithm; ``run`` executes it."""

    def __init__(self, device: int, key: GemmKey, workspace_limit: int):
        L = _lt()
        from nvmath.bindings import cublas

        self.key, self.device, self.handle = key, device, handle(device)
        self.desc = _call("cublasLtMatmulDescCreate", L.matmul_desc_create, int(cublas.ComputeType.COMPUTE_32F),
                          _CUDA_R_32F)
        self._destroy = [(L.matmul_desc_destroy, self.desc)]
        dset, ddt = L.matmul_desc_set_attribute, L.get_matmul_desc_attribute_dtype
        _set(dset, self.desc, L.MatmulDescAttribute.TRANSA, ddt, _OP_T if key.trans_a else _OP_N)
        _set(dset, self.desc, L.MatmulDescAttribute.TRANSB, ddt, _OP_T if key.trans_b else _OP_N)
        a_rows, a_cols = (key.k, key.m) if key.trans_a else (key.m, key.k)
        b_rows, b_cols = (key.n, key.k) if key.trans_b else (key.k, key.n)
        self.a = self._layout(key.dtype, a_rows, a_cols, key.lda, key.stride_a)
        self.b = self._layout(key.dtype, b_rows, b_cols, key.ldb, key.stride_b)
        self.c = self._layout(key.out_dtype, key.m, key.n, key.ldc, key.stride_c)
        weakref.finalize(self, _destroy_all, self._destroy)
        self.algo = np.zeros(1, dtype=L.matmul_algo_dtype)
        self.workspace_size = 0
        self.algo_source = "none"
        self.resolved = False  # set by algos.resolve once the policy (cache, tuning) has been applied
        from . import algos

        algos.heuristic_choice(self, workspace_limit)
        self._beta = np.zeros(1, dtype=np.float32)

    def _layout(self, dtype: str, rows: int, cols: int, ld: int, stride: int) -> int:
        L = _lt()
        lay = _call("cublasLtMatrixLayoutCreate", L.matrix_layout_create, _DTYPE[dtype], rows, cols, ld)
        self._destroy.append((L.matrix_layout_destroy, lay))
        lset, ldt = L.matrix_layout_set_attribute, L.get_matrix_layout_attribute_dtype
        _set(lset, lay, L.MatrixLayoutAttribute.BATCH_COUNT, ldt, self.key.batch)
        _set(lset, lay, L.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, ldt, stride)
        return lay

    def heuristic(self, workspace_limit: int, count: int = 1) -> np.ndarray:
        """cuBLASLt's heuristic results (up to ``count``, best first) within ``workspace_limit`` bytes."""
        L = _lt()
        pref = _call("cublasLtMatmulPreferenceCreate", L.matmul_preference_create)
        try:
            pset, pdt = L.matmul_preference_set_attribute, L.get_matmul_preference_attribute_dtype
            P = L.MatmulPreferenceAttribute
            _set(pset, pref, P.MAX_WORKSPACE_BYTES, pdt, workspace_limit)
            _set(pset, pref, P.MIN_ALIGNMENT_A_BYTES, pdt, self.key.align_a)
            _set(pset, pref, P.MIN_ALIGNMENT_B_BYTES, pdt, self.key.align_b)
            _set(pset, pref, P.MIN_ALIGNMENT_C_BYTES, pdt, self.key.align_c)
            _set(pset, pref, P.MIN_ALIGNMENT_D_BYTES, pdt, self.key.align_c)
            results = np.zeros(count, dtype=L.matmul_heuristic_result_dtype)
            returned = np.zeros(1, dtype=np.int32)
            _call(f"cublasLtMatmulAlgoGetHeuristic ({self.key})", L.matmul_algo_get_heuristic, self.handle,
                  self.desc, self.a, self.b, self.c, self.c, pref, count, results.ctypes.data, returned.ctypes.data)
        finally:
            L.matmul_preference_destroy(pref)
        return results[: int(returned[0])]

    def run(self, a: int, b: int, c: int, alpha: float, workspace: int, workspace_size: int, stream: int,
            algo: np.ndarray | None = None) -> None:
        """D = C = alpha * op(A) @ op(B) on ``stream`` (pointers are device addresses), with the chosen
        algorithm or ``algo``."""
        al = np.array([alpha], dtype=np.float32)
        _call(f"cublasLtMatmul ({self.key})", _lt().matmul, self.handle, self.desc, al.ctypes.data, a, self.a, b,
              self.b, self._beta.ctypes.data, c, self.c, c, self.c, (self.algo if algo is None else algo).ctypes.data,
              workspace, workspace_size, stream)


def _destroy_all(items) -> None:
    for fn, obj in reversed(items):
        try:
            fn(obj)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


@functools.lru_cache(maxsize=1024)
def gemm(device: int, key: GemmKey, workspace_limit: int, policy: str = "heuristic") -> Gemm:
    """The :class:`Gemm` for ``key`` on ``device`` under an algorithm ``policy``, built once and reused (plan
    once, execute many); its algorithm is the heuristic's until ``algos.resolve`` applies the policy."""
    g = Gemm(device, key, workspace_limit)
    log.debug("new GEMM %s: algorithm from %s, workspace %d B", key, g.algo_source, g.workspace_size)
    return g
