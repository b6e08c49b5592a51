"""The public calls: ``plan`` (validate, select, plan once), ``AttentionPlan.run`` (launch), ``attention`` (a thin
wrapper over a bounded cache of plans) and ``explain``; torch or cupy in and out.

Data flows one way: validate → select → plan (chunks, GEMM descriptors, algorithms) → execute.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
from dataclasses import dataclass, replace

import torch

from . import config, fastpath
from .chunks import ChunkPlan, plan_chunks, out_strides
from .select import Decision, route_of, select
from .validate import (FP8_KV_DTYPE, Case, address_alignment, call_results, check_descale, check_kv_descale,
                       check_options, check_out, check_sinks, check_tensors, descale_tensor, mask_alignment,
                       op_results, op_variants, out_shape)
from .device import stream_queries
from .fused import (MLA_DECODE, WMMA, FusedLaunch, Program as FusedProgram, convert_fp8_kv, device_facts,
                    fp8_converted, fp8_decode_launch, fp8_kv_why, fp8_prefill_launch, fp8_prefill_refusal, fp8_refusal,
                    fused_launch, hopper_kernel, stores_scores)

log = logging.getLogger("attn_lt")

_NO_BACKWARD = ("attn_lt.attention has no backward pass (forward and inference only): call it under "
                "torch.no_grad() / torch.inference_mode(), or on tensors that do not require grad")

#: Plans kept by ``attention()`` (least recently used first out).
PLAN_CACHE_SIZE = 256


_current_device, _raw_stream, _capturing = stream_queries()

fastpath.setup(_current_device, _raw_stream, _capturing)

_scratch: dict[tuple[int, int], torch.Tensor] = {}
_scratch_lock = threading.Lock()


def scratch_buffer(device: torch.device, stream: int, nbytes: int, capturing: bool = False) -> torch.Tensor:
    """The scratch buffer (workspace, LSE nobody asked for) that every call on one CUDA stream shares: calls on a
    stream run in order, so one buffer serves them all; it grows to the largest call's need (at most the workspace
    budget plus an LSE) and is kept, as cuBLAS keeps its workspace. While capturing a CUDA graph a fresh buffer
    comes from the graph's pool. :func:`release_scratch` frees them."""
    if capturing:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    key = (device.index, stream)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < nbytes:
        with _scratch_lock:
            fastpath.clear()  # its launches write the old buffer
            buf = _scratch.pop(key, None)
            del buf  # the old buffer goes back to the caching allocator before the larger one is taken
            buf = _scratch[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


def release_scratch() -> None:
    """Free the per-stream scratch buffers (the next call takes a new one)."""
    with _scratch_lock:
        fastpath.clear()
        _scratch.clear()


def _device_of(index: int) -> torch.device:
    """The torch.device of a signature's device index (``Tensor.get_device()``: -1 for CPU)."""
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


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


#: Positions in a signature's family (its first element; see :func:`call_signature`).
_DTYPE, _DEVICE, _MASK = 8, 11, 14


def call_signature(q, k, v, attn_mask, out_align: int) -> tuple:
    """What a plan fixes about its tensors, as ``(rest, Sk, v's Sk, k strides, v strides)``: ``rest`` holds the
    other shapes and strides, the dtypes, the device indices (-1: CPU), the mask's layout, the address alignment,
    and whether v starts at k's address (an MLA latent cache: ``Case.v_in_k``). Built from tensor attributes read
    once, with ints where torch.device objects would cost more to make, hash and compare."""
    kp, vp = k.data_ptr(), v.data_ptr()
    bits = q.data_ptr() | kp | vp
    kb, kh, Sk, kd = k.shape
    vb, vh, vSk, vd = v.shape
    m = None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.dtype,
                                        attn_mask.get_device(), mask_alignment(attn_mask))
    family = (q.shape, q.stride(), kb, kh, kd, vb, vh, vd, q.dtype, k.dtype, v.dtype, q.get_device(),
              k.get_device(), v.get_device(), m, min(256, bits & -bits) if bits else 256, out_align, vp == kp)
    return family, Sk, vSk, k.stride(), v.stride()


@dataclass(frozen=True)
class Explanation:
    """What a call does: the case, the selector's decision and reasons, the long path's chunk plan, and (when
    known) each GEMM's algorithm and where it came from."""

    case: Case
    decision: Decision
    plan: ChunkPlan | None
    gemms: tuple[dict, ...] = ()
    fused: FusedLaunch | None = None

    def __str__(self) -> str:
        lines = [f"case: {self.case}", str(self.decision)]
        if self.plan is not None:
            lines.append(f"plan: {self.plan.summary()}")
        if self.fused is not None:
            lines.append(f"kernel: {self.fused}")
        for g in self.gemms:
            n = g["gemms"]
            lines.append(f"  class {g['class']}: {n} GEMM shape{'' if n == 1 else 's'} (e.g. {g['example']})\n"
                         f"       algorithm: {g['algorithm']}")
        return "\n".join(lines)

    def to_dict(self, chunks: bool = False) -> dict:
        """As a dict; the plan's chunks counted, or (``chunks``) listed."""
        return {"case": str(self.case), "backend": self.decision.backend, "reasons": list(self.decision.reasons),
                "rejected": {n: list(r) for n, r in self.decision.rejected},
                "plan": None if self.plan is None else self.plan.to_dict(chunks), "gemms": list(self.gemms),
                "kernel": None if self.fused is None else self.fused.to_dict()}


class AttentionPlan:
    """One attention case planned once: the validated case, the route and its reasons, the long path's chunk plan,
    every GEMM's descriptors and algorithm, the kernels' arguments and the workspace size.

    ``run`` checks only what may change between calls (shapes, strides, dtypes, devices, alignment — the plan's
    signature) and launches: no planning, no tuning once tuned, no allocation beyond the output, the LSE and the
    workspace (which the caller may pass). Make one with :func:`plan`."""

    def __init__(self, case: Case, decision: Decision, chunks: ChunkPlan | None, signature: tuple | None,
                 policy: str, out_align: int = 256, key_mass: bool = False, key_mass_window: int | None = None,
                 fused: FusedLaunch | None = None, out_layout: str = "bhsd"):
        self.case, self.chunks, self.policy, self.fused = case, chunks, policy, fused
        self._decision = decision
        self.backend = decision.backend  # "lt" or "wmma"
        self.signature, self.out_align = signature, out_align
        #: the device the plan runs on (None for a plan made from shapes)
        self.device = None if signature is None else _device_of(signature[0][_DEVICE])
        self.key_mass, self.key_mass_window = key_mass, key_mass_window
        self.out_layout = out_layout  # "bhsd" or "bshd" (validate.OUT_LAYOUTS)
        self._out_shape = out_shape(case, out_layout)
        self._used = 0  # when attention() last used it (its plan cache's eviction order)
        self._keys = None  # the key lengths the compiled fast path may run on this plan (see _fast_keys), once asked
        self._program = None
        self._scratch_views = None
        self._fast = None  # run()'s handle in the compiled fast path (attn_lt.fastpath.bind), once bound
        self._lock = threading.Lock()

    @property
    def decision(self) -> Decision:
        """The selector's decision and its reasons."""
        return self._decision

    @property
    def program(self):
        """The prepared launcher (``lt.path.Program`` or ``fused.Program``), or None before the first run."""
        return self._program

    @property
    def workspace_bytes(self) -> int:
        """Bytes of workspace ``run`` needs (the long path's chunks, or the fused path's split partials)."""
        if self.chunks is not None:
            return self.chunks.workspace_bytes
        return 0 if self.fused is None else self.fused.workspace_bytes

    def _prepared(self, device: int):
        p = self._program
        if p is None:
            with self._lock:
                p = self._program
                if p is None:
                    if self.backend == "wmma":
                        p = FusedProgram(self.case, out_strides(self.case, self.out_layout), self.fused)
                    else:
                        from .lt.path import Program as LtProgram

                        p = LtProgram(self.case, self.chunks, device, self.policy, self.out_align)
                    self._program = p
        return p

    def _fast_keys(self, backend: str, threshold) -> tuple[int, float]:
        """The key lengths (lo, hi) of this plan's calls that the compiled fast path may run on it with other key
        lengths and K/V strides: the fused kernels read both from each call (the split count is cut to the keys by
        the launcher), so the bound is the selector's: those its route (``backend`` "auto") sends to wmma on this
        case's side of Sq >= Sk; every length for a forced backend or a case the long path cannot run. Worked out
        once."""
        if self._keys is None:
            lo, hi = 1, math.inf
            if backend == "auto" and "lt" not in dict(self._decision.rejected):  # (else no route: lt cannot run it)
                lo, top = route_of(self.case, threshold).wmma_keys(self.case.Sq)
                hi = math.inf if top is None else top
            self._keys = (lo, hi)
        return self._keys

    def run(self, q, k, v, attn_mask=None, *, out=None, return_lse: bool = False, workspace=None, sinks=None):
        """Attention of q, k, v (and ``attn_mask``) as planned; tensors must match the plan's shapes, strides,
        dtypes and device (the data may differ). Returns ``out`` (B, Hq, Sq, Dv), or (B, Sq, Hq, Dv) for a plan
        made with ``out_layout="bshd"``; with ``return_lse``
        ``(out, lse)``; a plan made with ``return_key_mass`` adds the mass last: ``(out, mass)`` or
        ``(out, lse, mass)``.

        ``out``: optional contiguous output of q's dtype. ``workspace``: optional uint8 CUDA tensor of at least
        :attr:`workspace_bytes` bytes (else one is taken from PyTorch's caching allocator). ``sinks``: FP32 (Hq,),
        given exactly when the plan was made with sinks."""
        if (sinks is not None) != self.case.sinks:
            raise ValueError(f"this plan was made {'with' if self.case.sinks else 'without'} sinks; pass them "
                             f"{'to every run' if self.case.sinks else 'to plan() first'}")
        # the fast path takes plain calls: no mask, output, LSE, workspace or sinks of the caller's
        plain = (fastpath.run is not None and attn_mask is None and out is None and not return_lse and workspace is None
                 and sinks is None)
        if plain and self._fast is not None:  # the layout bound last time, launched in C++; else None
            res = fastpath.run(self._fast, q, k, v)
            if res is not None:
                return res
        if self.signature is None:
            raise RuntimeError("this plan was made from shapes without tensors (explain only); make one from "
                               "CUDA tensors with attn_lt.plan(q, k, v, ...) to run it")
        out_align = 256 if out is None else address_alignment(out.data_ptr())
        sig = call_signature(q, k, v, attn_mask, min(out_align, self.out_align))
        if sig != self.signature:
            mask = "" if attn_mask is None else f", mask {tuple(attn_mask.shape)}"
            raise ValueError(f"plan made for {self.case} cannot run these tensors: q {tuple(q.shape)} "
                             f"{tuple(q.stride())}, k {tuple(k.shape)} {tuple(k.stride())}, v {tuple(v.shape)} "
                             f"{tuple(v.stride())}{mask} (shapes, strides, dtypes, device and alignment must match "
                             "the plan's)")
        if sinks is not None:
            check_sinks(sinks, self.case.Hq, self.device)
        res = self._execute(q, k, v, attn_mask, out, return_lse, workspace, sig, sinks=sinks)
        if plain:
            launch = self._fast_launch()
            if launch is not None:  # later runs of these tensors' layout take the compiled fast path
                self._fast = fastpath.bind(q, k, v, *launch)
        return res

    def _fast_launch(self) -> tuple | None:
        """The launch the compiled fast path repeats for this plan (attn_lt.fastpath: the scratch's generation,
        output shape, arguments, launcher, LSE partials' offset, stream, scratch addresses) after a run on the
        current stream; None where it cannot: not a fused plan without a mask or attention mass, another device
        current, a graph capture."""
        device = self.device.index
        if (self.backend != "wmma" or self.case.mask is not None or self.key_mass or device != _current_device()
                or _capturing()):
            return None
        stream = _raw_stream(device)
        gen = fastpath.generation()  # before the addresses: a clear in between (the scratch grew) voids them
        ws_ptr, lse_ptr = self._scratch(self.device, stream, False)[2:]
        return (gen, self._out_shape, *self._program.fast_launch(), stream, ws_ptr, lse_ptr)

    def _remember_fast(self, q, k, v, sinks, options: tuple, settings: config.Settings, backend: str,
                       threshold) -> None:
        """After attention() ran this plan on q, k, v (no mask, no ``out``, no LSE) with ``options`` (see
        :func:`attn_lt.fastpath.remember`) under ``settings``: let the compiled fast path run the later calls of
        these tensors' family (native/fastpath.cpp: all but the key length and the K/V strides) and options on it,
        over the key lengths of :meth:`_fast_keys`."""
        launch = self._fast_launch()
        if launch is not None:
            fastpath.remember(q, k, v, sinks, options, (settings,), self._fast_keys(backend, threshold), *launch)

    def _scratch(self, device: torch.device, stream: int, capturing: bool) -> tuple:
        """(workspace, LSE scratch, their addresses): views of the stream's shared scratch buffer (see
        :func:`scratch_buffer`), kept while the buffer stays the same."""
        case = self.case
        ws_bytes = -(-self.workspace_bytes // 256) * 256
        lse_bytes = 4 * case.B * case.Hq * case.Sq
        buf = scratch_buffer(device, stream, ws_bytes + lse_bytes, capturing)
        s = self._scratch_views
        if s is not None and s[0] is buf:
            return s[1]
        ws = buf[:ws_bytes]
        lse = buf[ws_bytes:ws_bytes + lse_bytes].view(torch.float32).view(case.B, case.Hq, case.Sq)
        views = (ws, lse, ws.data_ptr(), lse.data_ptr())
        if not capturing:
            self._scratch_views = (buf, views)
        return views

    def _execute(self, q, k, v, attn_mask, out, return_lse, workspace, sig, tune_budget_ms=None, sinks=None):
        """Launch (the caller checked the tensors against the plan: ``sig`` is their signature, and the sinks)."""
        if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
            raise NotImplementedError(_NO_BACKWARD)
        case = self.case
        dev = self.device
        device = dev.index
        if out is None:
            out = torch.empty(self._out_shape, dtype=q.dtype, device=dev)
        else:
            check_out(out, case, q, self.out_layout)
        stream = _raw_stream(device)
        capturing = _capturing()
        ws, lse, ws_ptr, lse_ptr = self._scratch(dev, stream, capturing)
        if return_lse:
            lse = torch.empty((case.B, case.Hq, case.Sq), dtype=torch.float32, device=dev)
            lse_ptr = lse.data_ptr()
        if workspace is not None:
            need = self.workspace_bytes
            if not (isinstance(workspace, torch.Tensor) and workspace.device == dev
                    and workspace.dtype == torch.uint8 and workspace.numel() >= need
                    and workspace.is_contiguous() and workspace.data_ptr() % 256 == 0):
                raise ValueError(f"workspace must be a contiguous, 256-byte aligned uint8 tensor of at least "
                                 f"{need} bytes on {dev}")
            ws, ws_ptr = workspace, workspace.data_ptr()
        program = self._program or self._prepared(device)
        switch = _current_device() != device
        if self.backend == "wmma":
            mask_ptr = 0 if attn_mask is None else attn_mask.data_ptr()
            mass = torch.empty((case.B, case.Hq, case.Sk), dtype=torch.float32, device=dev) if self.key_mass else None
            # a decode step's mass from the scores the call stores, not from K read again
            from_scores = mass is not None and stores_scores(case, program.kernel)
            args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse_ptr, stream, mask_ptr, ws_ptr,
                    sig[1], sig[3], sig[4], 0 if sinks is None else sinks.data_ptr(),
                    mass.data_ptr() if from_scores else 0)
            if switch:
                with torch.cuda.device(device):
                    program.run(*args)
            else:
                program.run(*args)
            if mass is None:
                return (out, lse) if return_lse else out
            first = 0 if self.key_mass_window is None else max(case.Sq - self.key_mass_window, 0)
            with torch.cuda.device(device) if switch else contextlib.nullcontext():
                program.run_mass(q.data_ptr(), k.data_ptr(), lse_ptr, mass.data_ptr(), first, stream, mask_ptr,
                                 from_scores)
        else:
            mass = program.key_mass_buffer(dev, self.key_mass_window) if self.key_mass else None
            target = None
            if self.out_layout == "bshd":  # the long path writes (B, Hq, Sq, Dv): the same memory when Sq is 1
                target = out
                shape = (case.B, case.Hq, case.Sq, case.Dv)
                out = out.view(shape) if case.Sq == 1 else torch.empty(shape, dtype=out.dtype, device=dev)
            with torch.cuda.device(device) if switch else contextlib.nullcontext():
                program.run(q, k, v, attn_mask, out, lse, ws, stream, not capturing, tune_budget_ms, mass,
                            self.key_mass_window)
            if target is not None:
                if case.Sq > 1:
                    target.copy_(out.transpose(1, 2))
                out = target
        if mass is not None:
            return (out, lse, mass) if return_lse else (out, mass)
        return (out, lse) if return_lse else out

    def tune(self, q=None, k=None, v=None, attn_mask=None) -> AttentionPlan:
        """Resolve every GEMM's algorithm now (tuning classes not yet cached, on these tensors' data or on random
        data of the planned shapes), so that no later ``run`` tunes. Returns the plan."""
        if self.backend != "lt":
            return self
        if q is None:
            q, k, v, attn_mask = _random_like(self)
        self.run(q, k, v, attn_mask)  # checks the signature
        self._execute(q, k, v, attn_mask, None, False, None, self.signature, tune_budget_ms=float("inf"))
        torch.cuda.synchronize(q.device)
        return self

    def explain(self) -> Explanation:
        """The route, its reasons, the chunk plan and, per GEMM shape class, how many GEMMs it holds and their
        algorithm: where it came from once the plan has run, what the cache holds for the class before."""
        gemms = ()
        if self.backend == "lt":
            from .lt.algos import GemmClass, class_status
            from .lt.path import plan_gemm_keys
            from .lt.scores import SOURCE, runs_native

            if self._program is not None:
                members = [(g.key, g.algo_source) for _, qk, pv in self._program.gemms() for g in (qk, pv)]
            else:
                dev = None if self.device is None else self.device.index
                members = [(key, SOURCE if dev is not None and runs_native(dev, key) else None)
                           for pair in plan_gemm_keys(self.case, self.chunks, self.out_align) for key in pair]
            by_class: dict = {}
            for key, source in members:
                cls = GemmClass.of(key)
                row = by_class.get(cls)
                if row is None:
                    row = by_class[cls] = {"role": key.role, "class": str(cls), "example": str(key), "keys": set(),
                                           "sources": []}
                row["keys"].add(key)
                if source is not None and source not in row["sources"]:
                    row["sources"].append(source)
            rows = []
            for cls, row in by_class.items():
                algorithm = "; ".join(row["sources"]) if row["sources"] else class_status(cls, self.policy)
                rows.append({"role": row["role"], "class": row["class"], "gemms": len(row["keys"]),
                             "example": row["example"], "algorithm": algorithm})
            gemms = tuple(rows)
        return Explanation(self.case, self.decision, self.chunks, gemms, self.fused)

    def __repr__(self) -> str:
        return f"AttentionPlan({self.case}, backend={self.backend!r})"


def _random_like(p: AttentionPlan):
    """Random tensors with a plan's shapes and strides (for ``tune`` without the caller's data)."""
    c = p.case
    dev = p.device
    dt = p.signature[0][_DTYPE]

    def rnd(shape, strides):
        n = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        return torch.randn(n, device=dev, dtype=dt).as_strided(shape, strides)

    q = rnd((c.B, c.Hq, c.Sq, c.D), c.q_strides)
    k = rnd((c.B, c.Hkv, c.Sk, c.D), c.k_strides)
    v = k[..., :c.Dv] if c.v_in_k else rnd((c.B, c.Hkv, c.Sk, c.Dv), c.v_strides)
    m = None
    if p.signature[0][_MASK] is not None:
        shape, strides, mdt = p.signature[0][_MASK][:3]
        n = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        base = torch.rand(n, device=dev) > 0.1 if mdt == torch.bool else torch.randn(n, device=dev).to(mdt)
        m = base.as_strided(shape, strides)
    return q, k, v, m


def _plan_case(case: Case, backend: str, workspace_bytes, threshold, algo_policy, signature=None,
               out_align: int = 256, return_key_mass: bool = False, key_mass_window=None,
               out_layout: str = "bhsd") -> AttentionPlan:
    check_options(case, workspace_bytes=workspace_bytes, threshold=threshold, return_key_mass=return_key_mass,
                  key_mass_window=key_mass_window, out_layout=out_layout)
    decision = select(case, backend, threshold, key_mass=bool(return_key_mass), key_mass_window=key_mass_window)
    policy = config.algo_policy(algo_policy)
    chunks = None
    if decision.backend == "lt":
        chunks = plan_chunks(case, workspace_bytes, key_tiles=config.current().key_tiles and not return_key_mass)
    fused = None
    if decision.backend == "wmma":
        device = None if signature is None else _device_of(signature[0][_DEVICE]).index
        fused = fused_launch(case, device_facts(device))
    return AttentionPlan(case, decision, chunks, signature, policy, out_align, bool(return_key_mass),
                         key_mass_window, fused, out_layout)


def plan(q, k, v, *, attn_mask=None, causal: bool = False, scale: float | None = None, backend: str = "auto",
         workspace_bytes: int | None = None, threshold: int | None = None, algo_policy: str | None = None,
         return_key_mass: bool = False, key_mass_window: int | None = None, out=None,
         out_layout: str = "bhsd", window=None, softcap: float | None = None, sinks=None) -> AttentionPlan:
    """Plan attention for tensors like these (validated once; no GPU work): returns an :class:`AttentionPlan`
    whose ``run`` takes tensors of the same shapes, strides, dtypes and device. Arguments as in
    :func:`attention`; pass ``out`` if ``run`` will write into a preallocated output (its alignment counts), and
    ``sinks`` if the runs will (they pass theirs)."""
    if getattr(k, "dtype", None) == FP8_KV_DTYPE:
        raise ValueError("plan() takes no FP8 K/V yet: attention() runs an FP8 KV cache and the FP8 prefill (keeping "
                         "its launch per case); varlen_attention, paged_attention and BatchStep run FP8 caches")
    case = check_tensors(q, k, v, attn_mask, causal, scale, window=window, softcap=softcap, sinks=sinks)
    out_align = 256 if out is None else address_alignment(out.data_ptr())
    sig = call_signature(q, k, v, attn_mask, out_align)
    p = _plan_case(case, backend, workspace_bytes, threshold, algo_policy, sig, out_align, return_key_mass,
                   key_mass_window, out_layout)
    if p.backend == "wmma":  # the launch arguments (host memory only) built now rather than on the first run
        p._prepared(q.device.index)
    return p


#: attention()'s plans by call key. Each plan's ``_used`` stamp (from ``_uses``) orders them for eviction, least
#: recently used first out: a hit stamps its plan, cheaper than reordering an OrderedDict on every call.
_plans: dict = {}
_uses = itertools.count()
_plans_lock = threading.Lock()


def clear_plans() -> None:
    """Forget every plan ``attention()`` keeps (e.g. after a new calibration; new settings do it themselves)."""
    with _plans_lock:
        _plans.clear()
        fastpath.clear()


config.on_change(clear_plans)


def cached_plans() -> int:
    """How many plans ``attention()`` keeps now."""
    return len(_plans)


def attention(q, k, v, *, attn_mask=None, causal: bool = False, scale: float | None = None,
              backend: str = "auto", return_lse: bool = False, out=None, workspace_bytes: int | None = None,
              threshold: int | None = None, algo_policy: str | None = None, return_key_mass: bool = False,
              key_mass_window: int | None = None, out_layout: str = "bhsd", window=None,
              softcap: float | None = None, sinks=None, k_descale=None, v_descale=None, q_descale=None):
    """Scaled dot-product attention, ``softmax(scale * q @ k^T + mask) @ v``.

    Args:
        q: (B, Hq, Sq, D) fp16 or bf16, on a CUDA device (torch.Tensor or cupy.ndarray). Views whose last
            dimension has stride 1, e.g. a (B, S, H, D) tensor transposed to (B, H, S, D), are read in place.
        k: (B, Hkv, Sk, D), same dtype and device; ``Hq % Hkv == 0`` (grouped-query attention when Hkv < Hq).
        v: (B, Hkv, Sk, Dv); Dv may differ from D (the long path: any; the fused path on Hopper: MLA prefill's
            192/128 and MLA decode's 576/512), and v may be a view of k's memory (e.g. ``k[..., :Dv]``, which MLA
            decode's fused kernel requires).
        attn_mask: optional, broadcastable to (B, Hq, Sq, Sk): bool (True = may attend, as in SDPA) or float
            (added to the scaled scores; fp32 or q's dtype).
        causal: query i sees keys j <= i + (Sk - Sq) (bottom-right aligned, the KV-cache convention; equal to
            SDPA's ``is_causal`` when Sq == Sk). Combines with ``attn_mask``.
        scale: default ``D ** -0.5``; finite and positive.
        backend: "auto" (the hybrid selector), "lt" (cuBLASLt long path) or "wmma" (fused short path); a forced
            backend that cannot run the case raises ValueError naming every reason.
        return_lse: also return the FP32 log-sum-exp of each row's scaled, masked scores.
        out: optional preallocated output, contiguous (B, Hq, Sq, Dv) — (B, Sq, Hq, Dv) with ``out_layout="bshd"``
            — of q's dtype and device, written in full.
        workspace_bytes: budget of the long path's workspace (default ``ATTN_LT_WORKSPACE_MB``, 1 GiB).
        threshold: key length from which "auto" takes the long path, for every case (default: ``ATTN_LT_THRESHOLD``,
            else the rules ``attn-lt calibrate`` measured on this GPU or shipped for its model, else 4096).
        algo_policy: cuBLASLt algorithm choice: "tune" (tune a GEMM shape class on first use unless cached;
            default), "cache" (cached algorithms, never tune) or "heuristic" (default ``ATTN_LT_ALGO_POLICY``).
        return_key_mass: also return the attention mass per key, FP32 (B, Hq, Sk): the sum over the query rows
            of the probabilities P, 0 for keys a row does not see — what score-based KV-cache compression (H2O,
            SnapKV, ...) needs. The fused path computes it after its call, in a pass over the keys that recomputes
            the scores of the rows it sums and takes each row's P = exp(s - lse) in FP32 from the call's LSE (no
            P·V, no score matrix in memory; q/k head dims 64, 128, 256); the long path sums the P it holds (in the
            input dtype, summed in FP32).
        key_mass_window: sum only over the last ``key_mass_window`` query rows (SnapKV's observation window):
            the fused path's pass then reads those rows alone.
        out_layout: "bhsd" (default) or "bshd": the output as (B, Sq, Hq, Dv), contiguous — FlashAttention's and
            transformers' layout, written so by the fused path (no transpose after the call).
        window: a sliding window, FlashAttention's ``window_size``: ``(left, right)``, query i sees keys
            [i' - left, i' + right] where i' = i + Sk - Sq is its bottom-right aligned diagonal; -1 for an
            unbounded edge; with ``causal`` the right edge is the causal one. Key tiles outside every row's window
            are skipped, so the cost follows the window (Mistral, Gemma 2/3 local layers, gpt-oss).
        softcap: logit softcapping (Gemma 2): each scaled score s becomes ``softcap * tanh(s / softcap)`` before
            masks and the softmax.
        sinks: attention sinks (gpt-oss): FP32 (Hq,), one logit a query head that joins every row's softmax
            denominator (softmax over [scores, sink], the sink's column dropped); the LSE includes it.
        k_descale, v_descale: with k and v an FP8 KV cache (both torch.float8_e4m3fn; q and the output stay fp16 or
            bf16): the factors their elements are multiplied by, None (1), a number, or FP32 one value or (Hkv,)
            on q's device. D = Dv in 64/128/256 (or MLA decode's latent cache), ``backend`` "auto" or "wmma". Up to
            64 query rows a kv head (Sq x Hq / Hkv: decode, speculative decoding) the fused decode blocks read the
            cache's bytes (a 16-row block for each 16 rows); with more rows (prefill) or ``return_key_mass`` the
            cache is converted to q's dtype first (each element times its factor in FP32, rounded once; a new cache
            of k's and v's shapes each call) and the 16-bit call runs.
        q_descale: the FP8 prefill: q, k and v all torch.float8_e4m3fn, q's values its elements times
            ``q_descale`` (as k_descale: None, a number, or FP32 one value or (Hkv,), a row's kv head's factor),
            FlashAttention-3's FP8 forward. Hopper, D = Dv 64, 128 or 256, no mask (causal, window, softcap and sinks
            run); the output is bf16 (``out``, if given, bf16); V is transposed into a workspace of
            B x Hkv x Dv x Sk bytes (Sk rounded up to 128) first.

    Returns:
        out: (B, Hq, Sq, Dv) in the input dtype, contiguous ((B, Sq, Hq, Dv) with ``out_layout="bshd"``); with ``return_lse``, ``(out, lse)`` with lse FP32
        (B, Hq, Sq). A row whose keys are all masked gives zeros in out and -inf in lse, never NaN. With
        ``return_key_mass`` the mass comes last: ``(out, mass)`` or ``(out, lse, mass)``. A row whose keys are all
        hidden but that has a sink gives zeros and the sink as its LSE.

    Raises:
        TypeError, ValueError: bad input (types, dtypes, shapes, head counts, mask, devices), before GPU work.
        NotImplementedError: inputs that require grad with grad mode on (attn_lt is forward only).

    Each distinct case (shapes, strides, dtypes, device, options) is planned once and kept (up to
    ``PLAN_CACHE_SIZE`` plans); later calls only launch. A fused call without a mask, ``out``, LSE or key mass is
    also remembered by the compiled fast path (:mod:`attn_lt.fastpath`), which runs the later calls of its family
    (the same tensors but the key length and the K/V strides: a decode loop's steps) on the same plan, as the fused
    kernels take the key length as data. Use :func:`plan` to hold a plan yourself.
    """
    if isinstance(q, torch.Tensor) and torch.compiler.is_compiling():
        if out is not None:
            raise ValueError("out= is not supported inside torch.compile (attention returns a new output there)")
        causal, window, softcap = op_variants(causal, window, softcap)
        got = torch.ops.attn_lt.attention(q, k, v, attn_mask, causal, scale, backend, workspace_bytes, threshold,
                                          algo_policy, window, softcap, sinks, bool(return_key_mass),
                                          key_mass_window, out_layout,
                                          *(descale_tensor(n, x, q.device) for n, x in
                                            (("k_descale", k_descale), ("v_descale", v_descale),
                                             ("q_descale", q_descale))), return_lse=bool(return_lse))
        return call_results(got[0], got[1], bool(return_lse), got[2] if return_key_mass else None)
    if (k_descale is not None or v_descale is not None or q_descale is not None
            or getattr(k, "dtype", None) == FP8_KV_DTYPE):
        return _attention_fp8(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend,
                              return_lse=return_lse, out=out, return_key_mass=return_key_mass,
                              key_mass_window=key_mass_window, out_layout=out_layout, window=window, softcap=softcap,
                              sinks=sinks, k_descale=k_descale, v_descale=v_descale, q_descale=q_descale)
    if isinstance(q, torch.Tensor):
        if fastpath.call is not None:  # a remembered family's cached fused call, launched in C++; else None
            res = fastpath.call(q, k, v, attn_mask, causal, scale, backend, return_lse, out, workspace_bytes,
                                threshold, algo_policy, return_key_mass, key_mass_window, out_layout, window, softcap,
                                sinks)
            if res is not None:
                return res
    elif _is_cupy(q):
        return _attention_cupy(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend,
                               return_lse=return_lse, out=out, workspace_bytes=workspace_bytes,
                               threshold=threshold, algo_policy=algo_policy, return_key_mass=return_key_mass,
                               key_mass_window=key_mass_window, out_layout=out_layout, window=window,
                               softcap=softcap, sinks=sinks)
    try:
        out_align = 256 if out is None else address_alignment(out.data_ptr())
        sig = call_signature(q, k, v, attn_mask, out_align)
        settings = config.current()
        key = (sig, causal, scale, backend, workspace_bytes, threshold, algo_policy, return_key_mass,
               key_mass_window, out_layout, None if window is None else tuple(window), softcap, sinks is None,
               settings)
        p = _plans.get(key)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # not 4-D tensors, unhashable options:
        # the validation explains
        check_tensors(q, k, v, attn_mask, causal, scale, window=window, softcap=softcap, sinks=sinks)
        raise
    if p is None:
        p = plan(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend,
                 workspace_bytes=workspace_bytes, threshold=threshold, algo_policy=algo_policy,
                 return_key_mass=return_key_mass, key_mass_window=key_mass_window, out=out, out_layout=out_layout,
                 window=window, softcap=softcap, sinks=sinks)
        log.debug("attention: new plan %s -> %s", p.case, p.backend)
        with _plans_lock:
            _keep(key, p)
    elif sinks is not None:
        check_sinks(sinks, p.case.Hq, p.device)
    p._used = next(_uses)  # least recently used first out of the plan cache
    res = p._execute(q, k, v, attn_mask, out, return_lse, None, sig, sinks=sinks)
    if fastpath.call is not None and attn_mask is None and out is None and not return_lse:
        p._remember_fast(q, k, v, sinks, (causal, scale, backend, workspace_bytes, threshold, algo_policy,
                                          key_mass_window, out_layout, window, softcap), settings, backend, threshold)
    return res


def _fp8_case(q, k, v, attn_mask, causal, scale, window, softcap, sinks, backend, return_key_mass, key_mass_window,
              out_layout, require_cuda: bool = True) -> Case:
    """The case of a call against an FP8 KV cache (q fp16/bf16: decode rows) or of the FP8 prefill (q e4m3 too),
    every rule of that path checked (TypeError / ValueError)."""
    case = check_tensors(q, k, v, attn_mask, causal, scale, require_cuda, window=window, softcap=softcap,
                         sinks=sinks, kv_fp8=True)
    check_options(out_layout=out_layout, return_key_mass=return_key_mass, key_mass_window=key_mass_window)
    if backend not in ("auto", "wmma"):
        raise ValueError(f"FP8 K/V run on the fused kernels (backend 'auto' or 'wmma'), not {backend!r}")
    if return_key_mass and (case.dtype == "e4m3" or (case.D, case.Dv) == MLA_DECODE):
        raise ValueError("return_key_mass is not available for the FP8 prefill or an FP8 latent cache")
    if case.dtype == "e4m3":  # (explained without a GPU: as on the Hopper GPU fused plans assume)
        hopper = hopper_kernel(q.device.index) if require_cuda else hopper_kernel() or device_facts() is None
        why = fp8_prefill_refusal(case, hopper)
    else:
        why = fp8_refusal(case.D, case.Dv)
        if why is None and (case.D, case.Dv) == MLA_DECODE:  # an FP8 latent cache: MLA decode's own rules
            why = "; ".join(WMMA.not_supported_reasons(case)) or None
    if why is not None:
        raise ValueError(f"{why}; {case}")
    for name, t in (("q", q), ("k", k), ("v", v)) if case.dtype == "e4m3" else (("k", k), ("v", v)):
        if any(st % 16 for st in t.stride()[:3]) or case.ptr_align % 16:
            raise ValueError(f"{name} {tuple(t.shape)} (FP8) with strides {tuple(t.stride())} is not a layout the "
                             "kernels read: strides of whole 16-byte chunks (multiples of 16 elements), 16-byte "
                             "aligned")
    return case


def _attention_fp8(q, k, v, *, attn_mask, causal, scale, backend, return_lse, out, return_key_mass, key_mass_window,
                   out_layout, window, softcap, sinks, k_descale, v_descale, q_descale):
    """:func:`attention` with FP8 K/V: against an FP8 KV cache (q fp16/bf16), native/flash.cu's decode blocks,
    which read the cache's bytes and convert them to fp16 in registers, the keys split as
    :func:`attn_lt.fused.fp8_decode_launch` plans them; the FP8 prefill (q e4m3 too), native/flash_sm90.cu in
    e4m3 (:func:`attn_lt.fused.fp8_prefill_launch`), the output bf16."""
    case = _fp8_case(q, k, v, attn_mask, causal, scale, window, softcap, sinks, backend, return_key_mass,
                     key_mass_window, out_layout)
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        raise NotImplementedError(_NO_BACKWARD)
    dev = q.device
    prefill = case.dtype == "e4m3"
    if not prefill:
        if q_descale is not None:
            raise ValueError("q_descale applies to the FP8 prefill (q torch.float8_e4m3fn too) only")
        kd, vd, sh = check_kv_descale(k_descale, v_descale, True, case.Hkv, dev)
        qd = None
        if _converted(case, return_key_mass):
            k, v = _converted_kv(case, k, v, kd, vd, sh, q.dtype)
            return attention(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend,
                             return_lse=return_lse, out=out, return_key_mass=return_key_mass,
                             key_mass_window=key_mass_window, out_layout=out_layout, window=window,
                             softcap=softcap, sinks=sinks)
    else:
        qd, kd, vd, sh = check_descale({"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale},
                                       case.Hkv, dev)
    program = _fp8_program(case, out_layout, dev.index)
    out_dtype = torch.bfloat16 if prefill else q.dtype
    if out is None:
        out = torch.empty(out_shape(case, out_layout), dtype=out_dtype, device=dev)
    else:
        check_out(out, case, q, out_layout, out_dtype)
    lse = torch.empty((case.B, case.Hq, case.Sq), dtype=torch.float32, device=dev) if return_lse else None
    need = program.launch.workspace_bytes
    with torch.cuda.device(dev) if _current_device() != dev.index else contextlib.nullcontext():
        stream = _raw_stream(dev.index)
        ws = scratch_buffer(dev, stream, need, torch.cuda.is_current_stream_capturing()) if need else None
        program.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                    stream, 0 if attn_mask is None else attn_mask.data_ptr(), 0 if ws is None else ws.data_ptr(),
                    sinks=0 if sinks is None else sinks.data_ptr(),
                    descale=tuple(0 if x is None else x.data_ptr() for x in (kd, vd)) + (sh,)
                    + (0 if qd is None else qd.data_ptr(),))
    return (out, lse) if return_lse else out


def _converted(case: Case, return_key_mass) -> bool:
    """Whether a dense call against an FP8 KV cache converts it first (:func:`attn_lt.fused.fp8_converted`)."""
    return case.dtype != "e4m3" and fp8_converted(case.Sq * case.group, case.D, case.Dv, bool(return_key_mass))


def _converted_kv(case: Case, k, v, kd, vd, sh: int, dtype) -> tuple:
    """A dense FP8 KV cache (B, Hkv, Sk, D) as new contiguous ``dtype`` tensors for the 16-bit kernels
    (:func:`attn_lt.fused.convert_fp8_kv`), in the current stream."""
    k16, v16 = (torch.empty(t.shape, dtype=dtype, device=t.device) for t in (k, v))
    with torch.cuda.device(k.device) if _current_device() != k.device.index else contextlib.nullcontext():
        convert_fp8_kv(case, k.data_ptr(), v.data_ptr(), k16.data_ptr(), v16.data_ptr(),
                       tuple(0 if x is None else x.data_ptr() for x in (kd, vd)) + (sh,), _raw_stream(k.device.index))
    return k16, v16


@functools.lru_cache(maxsize=64)
def _fp8_program(case: Case, out_layout: str, device: int) -> FusedProgram:
    """The launch of an FP8 case (arguments built once; each run sets the addresses and factors)."""
    launch = fp8_prefill_launch(case) if case.dtype == "e4m3" else fp8_decode_launch(case, device_facts(device))
    log.debug("attention: FP8 K/V %s -> %s", case, launch)
    return FusedProgram(case, out_strides(case, out_layout), launch, fp8_kv=True)


def _keep(key, p: AttentionPlan) -> None:
    """Put ``p`` in the plan cache, evicting the least recently used plan beyond its size (under the lock)."""
    p._used = next(_uses)
    _plans[key] = p
    if len(_plans) > PLAN_CACHE_SIZE:
        del _plans[min(_plans, key=lambda k: _plans[k]._used)]


def _attention_cupy(q, k, v, *, out=None, return_lse=False, attn_mask=None, sinks=None, **kw):
    import cupy

    def to_t(x):
        return None if x is None else torch.from_dlpack(x)

    with _cupy_stream():
        res = attention(to_t(q), to_t(k), to_t(v), attn_mask=to_t(attn_mask), out=to_t(out),
                        return_lse=return_lse, sinks=to_t(sinks), **kw)
    return tuple(cupy.from_dlpack(r) for r in res) if isinstance(res, tuple) else cupy.from_dlpack(res)


def explain_case(case: Case, backend: str = "auto", workspace_bytes: int | None = None,
                 threshold: int | None = None, algo_policy: str | None = None,
                 return_key_mass: bool = False, out_layout: str = "bhsd",
                 key_mass_window: int | None = None) -> Explanation:
    """What a call of ``case`` would do (no GPU work)."""
    return _plan_case(case, backend, workspace_bytes, threshold, algo_policy, return_key_mass=return_key_mass,
                      key_mass_window=key_mass_window, out_layout=out_layout).explain()


def explain(q, k, v, *, attn_mask=None, causal: bool = False, scale: float | None = None, backend: str = "auto",
            workspace_bytes: int | None = None, threshold: int | None = None, algo_policy: str | None = None,
            return_key_mass: bool = False, key_mass_window: int | None = None, out_layout: str = "bhsd",
            window=None, softcap: float | None = None, sinks=None) -> Explanation:
    """What ``attention`` would do with these arguments (tensors on any device, "meta" included); no GPU work."""
    if getattr(k, "dtype", None) == FP8_KV_DTYPE:
        case = _fp8_case(q, k, v, attn_mask, causal, scale, window, softcap, sinks, backend, return_key_mass,
                         key_mass_window, out_layout, require_cuda=False)
        if _converted(case, return_key_mass):
            contiguous = Case.contiguous(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D)
            ex = explain_case(replace(case, k_strides=contiguous.k_strides, v_strides=contiguous.v_strides), backend,
                              workspace_bytes, threshold, algo_policy, return_key_mass, out_layout, key_mass_window)
            why = (f"an FP8 KV cache with {case.Sq * case.group} query rows a kv head"
                   + (" and the mass per key" if return_key_mass else "") + ": converted to q's dtype first (each "
                   "element times its descale factor in FP32, rounded once; a new B x Hkv x Sk x (D + Dv) x 2 bytes "
                   "each call), then")
            return replace(ex, decision=replace(ex.decision, reasons=(why,) + ex.decision.reasons))
        fused = fp8_prefill_launch(case) if case.dtype == "e4m3" else fp8_decode_launch(case, device_facts())
        why = fused.why if case.dtype == "e4m3" else fp8_kv_why(case.D, case.Dv)
        decision = Decision("wmma", (why,), (("lt", ("the long path takes no FP8 K/V",)),))
        return Explanation(case, decision, None, fused=fused)
    case = check_tensors(q, k, v, attn_mask, causal, scale, require_cuda=False, window=window, softcap=softcap,
                         sinks=sinks)
    return explain_case(case, backend, workspace_bytes, threshold, algo_policy, return_key_mass, out_layout,
                        key_mass_window)


# torch.compile: attention() dispatches to this custom op while compiling (no out=); it returns (out, lse, mass), an
# empty FP32 tensor for an LSE or mass not asked for (op_results). The fake implementation gives shapes (and the same
# validation errors) without GPU work.
@torch.library.custom_op("attn_lt::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool,
                  scale: float | None, backend: str, workspace_bytes: int | None, threshold: int | None,
                  algo_policy: str | None, window: list[int] | None = None, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None, return_key_mass: bool = False, key_mass_window: int | None = None,
                  out_layout: str = "bhsd", k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None,
                  q_descale: torch.Tensor | None = None,
                  return_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = attention(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, backend=backend, return_lse=return_lse,
                    workspace_bytes=workspace_bytes, threshold=threshold, algo_policy=algo_policy,
                    return_key_mass=return_key_mass, key_mass_window=key_mass_window, out_layout=out_layout,
                    window=window, softcap=softcap, sinks=sinks, k_descale=k_descale, v_descale=v_descale,
                    q_descale=q_descale)
    return op_results(got, return_lse, return_key_mass, q)


def _no_backward(ctx, *grads):
    raise NotImplementedError(_NO_BACKWARD)


_attention_op.register_autograd(_no_backward)


@_attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, causal, scale, backend, workspace_bytes, threshold, algo_policy, window=None,
                    softcap=0.0, sinks=None, return_key_mass=False, key_mass_window=None, out_layout="bhsd",
                    k_descale=None, v_descale=None, q_descale=None, return_lse=True):
    if k.dtype == FP8_KV_DTYPE:
        case = _fp8_case(q, k, v, attn_mask, causal, scale, window, softcap, sinks, backend, return_key_mass,
                         key_mass_window, out_layout, require_cuda=False)
        dtype = torch.bfloat16 if case.dtype == "e4m3" else q.dtype
    else:
        case = check_tensors(q, k, v, attn_mask, causal, scale, require_cuda=False, window=window, softcap=softcap,
                             sinks=sinks)
        check_options(case, workspace_bytes=workspace_bytes, threshold=threshold, return_key_mass=return_key_mass,
                      key_mass_window=key_mass_window, out_layout=out_layout)
        dtype = q.dtype
    mass = (case.B, case.Hq, case.Sk) if return_key_mass else (0,)
    lse = (case.B, case.Hq, case.Sq) if return_lse else (0,)
    return (q.new_empty(out_shape(case, out_layout), dtype=dtype), q.new_empty(lse, dtype=torch.float32),
            q.new_empty(mass, dtype=torch.float32))
