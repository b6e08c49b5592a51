"""The production call: validate -> select -> plan -> execute, torch or cupy in and out."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from . import config
from .plan import Plan, make_plan
from .select import Decision, select
from .validate import Case, check_tensors

log = logging.getLogger("attn_lt")

_NO_BACKWARD = ("attn_lt.attention has no backward pass (forward and inference only): call it under "
                "torch.no_grad() / torch.inference_mode(), or on tensors that do not require grad")


def _is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


@contextlib.contextmanager
def _cupy_stream():
    """Run torch work on cupy's current stream, so cupy callers keep their stream semantics."""
    import cupy

    ptr = cupy.cuda.get_current_stream().ptr
    dev = torch.device("cuda", cupy.cuda.Device().id)
    stream = torch.cuda.ExternalStream(ptr, device=dev) if ptr else torch.cuda.default_stream(dev)
    with torch.cuda.stream(stream):
        yield


def attention(q, k, v, *, attn_mask=None, causal: bool = False, scale: float | None = None,
              backend: str = "auto", return_lse: bool = False, out=None, workspace_bytes: int | None = None,
              threshold: int | None = None, algo_policy: str | None = None):
    """Scaled dot-product attention, ``softmax(scale * q @ k^T + mask) @ v``.

    Args:
        q: (B, Hq, Sq, D) fp16 or bf16, on a CUDA device (torch.Tensor or cupy.ndarray). Views whose last
            dimension has stride 1, e.g. a (B, S, H, D) tensor transposed to (B, H, S, D), are read in place.
        k, v: (B, Hkv, Sk, D), same dtype and device; ``Hq % Hkv == 0`` (grouped-query attention when Hkv < Hq).
        attn_mask: optional, broadcastable to (B, Hq, Sq, Sk): bool (True = may attend, as in SDPA) or float
            (added to the scaled scores; fp32 or q's dtype).
        causal: query i sees keys j <= i + (Sk - Sq) (bottom-right aligned, the KV-cache convention; equal to
            SDPA's ``is_causal`` when Sq == Sk). Combines with ``attn_mask``.
        scale: default ``D ** -0.5``.
        backend: "auto" (the hybrid selector), "lt" (cuBLASLt long path) or "wmma" (fused short path); a forced
            backend that cannot run the case raises ValueError naming every reason.
        return_lse: also return the FP32 log-sum-exp of each row's scaled, masked scores.
        out: optional preallocated output, contiguous (B, Hq, Sq, D) of q's dtype and device, written in full.
        workspace_bytes: budget of the long path's workspace (default ``ATTN_LT_WORKSPACE_MB``, 1 GiB).
        threshold: key length from which "auto" takes the long path (default ``ATTN_LT_THRESHOLD``, 4096).
        algo_policy: cuBLASLt algorithm choice: "tune" (tune a GEMM shape on first use unless cached; default),
            "cache" (cached algorithms, never tune) or "heuristic" (default ``ATTN_LT_ALGO_POLICY``).

    Returns:
        out: (B, Hq, Sq, D) in the input dtype, contiguous; with ``return_lse``, ``(out, lse)`` with lse FP32
        (B, Hq, Sq). A row whose keys are all masked gives zeros in out and -inf in lse, never NaN.

    Raises:
        TypeError, ValueError: bad input (types, dtypes, shapes, head counts, mask, devices), before GPU work.
        NotImplementedError: inputs that require grad with grad mode on (attn_lt is forward only).
    """
    if isinstance(q, torch.Tensor) and torch.compiler.is_compiling():
        if out is not None:
            raise ValueError("out= is not supported inside torch.compile")
        res = torch.ops.attn_lt.attention(q, k, v, attn_mask, causal, scale, backend, workspace_bytes, threshold,
                                          algo_policy)
        return res if return_lse else res[0]
    if _is_cupy(q):
        import cupy

        to_t = (lambda x: None if x is None else torch.from_dlpack(x))
        with _cupy_stream():
            res = attention(to_t(q), to_t(k), to_t(v), attn_mask=to_t(attn_mask), causal=causal, scale=scale,
                            backend=backend, return_lse=return_lse, out=to_t(out),
                            workspace_bytes=workspace_bytes, threshold=threshold, algo_policy=algo_policy)
        return tuple(cupy.from_dlpack(r) for r in res) if return_lse else cupy.from_dlpack(res)
    case = check_tensors(q, k, v, attn_mask, causal, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(_NO_BACKWARD)
    shape = (case.B, case.Hq, case.Sq, case.D)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif not (isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.dtype == q.dtype
              and out.device == q.device and out.is_contiguous()):
        desc = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"out must be a contiguous {shape} {q.dtype} tensor on {q.device}, got {desc}")
    decision = select(case, backend, threshold)
    # budget errors surface here, before any GPU work
    plan = make_plan(case, workspace_bytes) if decision.backend == "lt" else None
    policy = config.algo_policy(algo_policy)
    log.debug("attention %s -> %s", case, decision.backend)
    lse = torch.empty((case.B, case.Hq, case.Sq), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        if decision.backend == "wmma":
            _run_wmma(case, q, k, v, out, lse)
        else:
            from .lt import path

            mask = None if attn_mask is None else attn_mask.expand(case.B, case.Hq, case.Sq, case.Sk)
            path.run(case, plan, q, k, v, mask, out, lse, policy)
    return (out, lse) if return_lse else out


def _run_wmma(case: Case, q, k, v, out, lse) -> None:
    from . import native

    a = native.FlashArgs()
    a.q, a.k, a.v, a.o, a.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
    a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D = case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D
    a.q_sb, a.q_sh, a.q_ss = case.q_strides[:3]
    a.k_sb, a.k_sh, a.k_ss = case.k_strides[:3]
    a.v_sb, a.v_sh, a.v_ss = case.v_strides[:3]
    a.o_sb, a.o_sh, a.o_ss = out.stride()[:3]
    a.scale, a.causal, a.dtype = case.scale, int(case.causal), native.DTYPE_CODES[case.dtype]
    native.flash(a, torch.cuda.current_stream(q.device).cuda_stream)


@dataclass(frozen=True)
class Explanation:
    """What a call would do: the case, the selector's decision and reasons, and the long path's plan."""

    case: Case
    decision: Decision
    plan: Plan | None

    def __str__(self) -> str:
        lines = [f"case: {self.case}", str(self.decision)]
        if self.plan is not None:
            lines.append(f"plan: {self.plan.summary(self.case)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"case": str(self.case), "backend": self.decision.backend, "reasons": list(self.decision.reasons),
                "rejected": {n: list(r) for n, r in self.decision.rejected},
                "plan": None if self.plan is None else self.plan.to_dict()}


def explain_case(case: Case, backend: str = "auto", workspace_bytes: int | None = None,
                 threshold: int | None = None) -> Explanation:
    decision = select(case, backend, threshold)
    plan = make_plan(case, workspace_bytes) if decision.backend == "lt" else None
    return Explanation(case, decision, plan)


def explain(q, k, v, *, attn_mask=None, causal: bool = False, scale: float | None = None, backend: str = "auto",
            workspace_bytes: int | None = None, threshold: int | None = None) -> Explanation:
    """What ``attention`` would do with these arguments (tensors on any device, "meta" included); no GPU work."""
    case = check_tensors(q, k, v, attn_mask, causal, scale, require_cuda=False)
    return explain_case(case, backend, workspace_bytes, threshold)


# torch.compile: attention() dispatches to this custom op while compiling; the fake implementation gives shapes
# (and the same validation errors) without GPU work.
@torch.library.custom_op("attn_lt::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool,
                  scale: float | None, backend: str, workspace_bytes: int | None, threshold: int | None,
                  algo_policy: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    return attention(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend, return_lse=True,
                     workspace_bytes=workspace_bytes, threshold=threshold, algo_policy=algo_policy)


def _no_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(_NO_BACKWARD)


_attention_op.register_autograd(_no_backward)


@_attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, causal, scale, backend, workspace_bytes, threshold, algo_policy):
    case = check_tensors(q, k, v, attn_mask, causal, scale, require_cuda=False)
    return (q.new_empty(case.B, case.Hq, case.Sq, case.D),
            q.new_empty(case.B, case.Hq, case.Sq, dtype=torch.float32))
