"""A thin layer over ``nvmath.bindings.cublasLt``: one handle per device, descriptors built once per GEMM shape
(:class:`GemmKey`) and reused, execution on the caller's stream, statuses turned into :class:`CublasLtError`
naming the status and the GEMM.

Conventions: cuBLASLt is column-major. A row-major (rows x cols) matrix with row stride ``ld`` is a
column-major (cols x rows) matrix with leading dimension ``ld``, so the long path's GEMMs are

* ``qk``: scores^T (N x M) = K (D x N)^T @ Q^T (D x M)       -> m=N, n=M, k=D, A transposed, FP32 output
* ``pv``: O^T (Dv x M)     = V^T (Dv x N) @ P^T (N x M)      -> m=Dv, n=M, k=N, output in ``out_dtype``
  (the input dtype, or FP32 for the partial outputs of key slices)
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger("attn_lt")

#: cudaDataType codes.
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUDA_TYPES = {"fp32": CUDA_R_32F, "fp16": CUDA_R_16F, "bf16": CUDA_R_16BF}
_OP_N, _OP_T = 0, 1


class CublasLtError(RuntimeError):
    """A cuBLASLt call failed; the message names the status and the GEMM."""


def lib():
    """The ``nvmath.bindings.cublasLt`` module (imported lazily: ``import attn_lt`` works without nvmath)."""
    from nvmath.bindings import cublasLt

    return cublasLt


def compute_32f() -> int:
    from nvmath.bindings import cublas

    return int(cublas.ComputeType.COMPUTE_32F)


@dataclass(frozen=True)
class GemmKey:
    """Everything that identifies one strided-batched GEMM for descriptors, algorithm choice and caching."""

    role: str  # "qk" (FP32 out) or "pv"
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
    out: str = ""  # output dtype: "" = the role's default (qk: fp32, pv: the input dtype)

    @property
    def out_dtype(self) -> str:
        return self.out or ("fp32" if self.role == "qk" else self.dtype)

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.out:
            del d["out"]  # keys of GEMMs with the default output keep the format of earlier versions
        return d

    @classmethod
    def from_dict(cls, d: dict) -> GemmKey:
        return cls(**d)

    def __str__(self) -> str:
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        return (f"{self.role} {self.dtype}->{self.out_dtype} {t} m{self.m} n{self.n} k{self.k} batch{self.batch} "
                f"ld({self.lda},{self.ldb},{self.ldc})")


_attr_buffers: dict = {}


def set_attr(setter, obj, attr, dtype_of, value) -> None:
    """Set one cuBLASLt descriptor attribute (``setter``) of ``obj`` to ``value`` (the value is copied by
    cuBLASLt, so one small host buffer per attribute serves every call)."""
    key = (dtype_of, attr)
    got = _attr_buffers.get(key)
    if got is None:
        buf = np.zeros(1, dtype=dtype_of(attr))
        got = _attr_buffers[key] = (buf, buf.ctypes.data, buf.nbytes, int(attr))
    buf, ptr, nbytes, code = got
    buf[0] = value
    setter(obj, code, ptr, nbytes)


_handles: dict[int, int] = {}
_handles_lock = threading.Lock()


def handle(device: int) -> int:
    """The cuBLASLt handle of ``device`` (created once per process)."""
    with _handles_lock:
        h = _handles.get(device)
        if h is None:
            import torch

            with torch.cuda.device(device):
                h = _handles[device] = call("cublasLtCreate", lib().create)
        return h


def call(what: str, fn, *args):
    """``fn(*args)``, a cuBLASLt status other than success raised as :class:`CublasLtError` naming ``what``."""
    L = lib()
    try:
        return fn(*args)
    except L.cuBLASLtError as e:
        raise CublasLtError(f"{what} failed: {e}") from e


class Gemm:
    """Descriptors of one :class:`GemmKey` on one device and its algorithm; ``run`` executes it.

    The algorithm is set by ``lt/algos.py`` (``use``): the heuristic's, a cached one, or a tuned one;
    ``algo_source`` says which and ``resolved`` whether the algorithm policy has been applied."""

    def __init__(self, device: int, key: GemmKey):
        L = lib()
        self.key, self.device, self.handle = key, device, handle(device)
        self.desc = call("cublasLtMatmulDescCreate", L.matmul_desc_create, compute_32f(), CUDA_R_32F)
        self._destroy = [(L.matmul_desc_destroy, self.desc)]
        dset, ddt = L.matmul_desc_set_attribute, L.get_matmul_desc_attribute_dtype
        set_attr(dset, self.desc, L.MatmulDescAttribute.TRANSA, ddt, _OP_T if key.trans_a else _OP_N)
        set_attr(dset, self.desc, L.MatmulDescAttribute.TRANSB, ddt, _OP_T if key.trans_b else _OP_N)
        a_rows, a_cols = (key.k, key.m) if key.trans_a else (key.m, key.k)
        b_rows, b_cols = (key.n, key.k) if key.trans_b else (key.k, key.n)
        self.a = self._layout(key.dtype, a_rows, a_cols, key.lda, key.stride_a)
        self.b = self._layout(key.dtype, b_rows, b_cols, key.ldb, key.stride_b)
        self.c = self._layout(key.out_dtype, key.m, key.n, key.ldc, key.stride_c)
        weakref.finalize(self, _destroy_all, self._destroy)
        self.algo = np.zeros(1, dtype=L.matmul_algo_dtype)
        self.algo_ptr = self.algo.ctypes.data
        self.workspace_size = 0
        self.algo_source = "none"
        self.resolved = False
        self._beta = np.zeros(1, dtype=np.float32)
        self.beta_ptr = self._beta.ctypes.data
        self._matmul = L.matmul
        self._heuristic: tuple | None = None

    def _layout(self, dtype: str, rows: int, cols: int, ld: int, stride: int) -> int:
        L = lib()
        lay = call("cublasLtMatrixLayoutCreate", L.matrix_layout_create, CUDA_TYPES[dtype], rows, cols, ld)
        self._destroy.append((L.matrix_layout_destroy, lay))
        lset, ldt = L.matrix_layout_set_attribute, L.get_matrix_layout_attribute_dtype
        set_attr(lset, lay, L.MatrixLayoutAttribute.BATCH_COUNT, ldt, self.key.batch)
        set_attr(lset, lay, L.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, ldt, stride)
        return lay

    def heuristic(self, workspace_limit: int, count: int = 1) -> np.ndarray:
        """cuBLASLt's heuristic results (up to ``count``, best first) within ``workspace_limit`` bytes."""
        L = lib()
        pref = call("cublasLtMatmulPreferenceCreate", L.matmul_preference_create)
        try:
            pset, pdt = L.matmul_preference_set_attribute, L.get_matmul_preference_attribute_dtype
            P = L.MatmulPreferenceAttribute
            set_attr(pset, pref, P.MAX_WORKSPACE_BYTES, pdt, workspace_limit)
            set_attr(pset, pref, P.MIN_ALIGNMENT_A_BYTES, pdt, self.key.align_a)
            set_attr(pset, pref, P.MIN_ALIGNMENT_B_BYTES, pdt, self.key.align_b)
            set_attr(pset, pref, P.MIN_ALIGNMENT_C_BYTES, pdt, self.key.align_c)
            set_attr(pset, pref, P.MIN_ALIGNMENT_D_BYTES, pdt, self.key.align_c)
            results = np.zeros(count, dtype=L.matmul_heuristic_result_dtype)
            returned = np.zeros(1, dtype=np.int32)
            call(f"cublasLtMatmulAlgoGetHeuristic ({self.key})", L.matmul_algo_get_heuristic, self.handle,
                 self.desc, self.a, self.b, self.c, self.c, pref, count, results.ctypes.data, returned.ctypes.data)
        finally:
            L.matmul_preference_destroy(pref)
        return results[: int(returned[0])]

    def heuristic_top(self, workspace_limit: int) -> tuple[np.ndarray, int]:
        """(algorithm, workspace bytes) of the heuristic's best choice, asked once per GEMM."""
        if self._heuristic is None or self._heuristic[2] != workspace_limit:
            results = self.heuristic(workspace_limit, count=1)
            if len(results) == 0:
                raise CublasLtError(f"cuBLASLt found no algorithm for {self.key} within {workspace_limit} bytes "
                                    "of workspace")
            algo = np.zeros(1, dtype=lib().matmul_algo_dtype)
            algo[0] = results[0]["algo"]
            self._heuristic = (algo, int(results[0]["workspace_size"]), workspace_limit)
        return self._heuristic[0], self._heuristic[1]

    def use(self, algo: np.ndarray, workspace_size: int, source: str, resolved: bool) -> None:
        """Run with ``algo`` from now on (its bytes are copied; the address ``run`` passes stays the same)."""
        self.algo[:] = algo
        self.workspace_size, self.algo_source, self.resolved = workspace_size, source, resolved

    def run(self, a: int, b: int, c: int, alpha_ptr: int, workspace: int, workspace_size: int, stream: int,
            algo: np.ndarray | None = None) -> None:
        """D = C = alpha * op(A) @ op(B) on ``stream``: device addresses of A, B, C, a host address of the FP32
        alpha, the workspace; the chosen algorithm or ``algo``."""
        try:
            self._matmul(self.handle, self.desc, alpha_ptr, a, self.a, b, self.b, self.beta_ptr, c, self.c, c,
                         self.c, self.algo_ptr if algo is None else algo.ctypes.data, workspace, workspace_size,
                         stream)
        except lib().cuBLASLtError as e:
            raise CublasLtError(f"cublasLtMatmul ({self.key}) failed: {e}") from e


def _destroy_all(items) -> None:
    for fn, obj in reversed(items):
        try:
            fn(obj)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


@functools.lru_cache(maxsize=1024)
def gemm(device: int, key: GemmKey) -> Gemm:
    """The :class:`Gemm` for ``key`` on ``device``, built once and reused (plan once, execute many)."""
    g = Gemm(device, key)
    log.debug("new GEMM %s", key)
    return g
