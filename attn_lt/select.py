"""The hybrid selector: each path declares what it supports; one rule picks the path for a case.

Default rule: ``Sk >= threshold`` (4096) takes the long path ``lt``; shorter keys take the fused ``wmma`` kernel
when it can run the case, else ``lt``. Forcing a path that cannot run a case raises ``ValueError`` with every
reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import config
from .validate import Case

BACKENDS = ("lt", "wmma")


@dataclass(frozen=True)
class Backend:
    """What one path can run, declared (xformers style); ``not_supported_reasons`` explains a refusal."""

    name: str
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None  # None: any head dim up to max_head_dim
    max_head_dim: int
    built: bool
    supports_mask: bool = True
    supports_gqa: bool = True
    needs_aligned_rows: bool = False  # 16-byte aligned bases and strides (cp.async tiles)
    max_batch_heads: int | None = None  # B * Hq (one grid dimension of the kernel)

    @staticmethod
    def layout_reasons(case: Case) -> list[str]:
        reasons = []
        if case.ptr_align < 16:
            reasons.append(f"inputs are not 16-byte aligned (address alignment {case.ptr_align})")
        strides = case.q_strides[:3] + case.k_strides[:3] + case.v_strides[:3]
        if any(st % 8 for st in strides):
            reasons.append(f"strides {case.q_strides}, {case.k_strides}, {case.v_strides} are not multiples of 8 "
                           "elements")
        return reasons

    def not_supported_reasons(self, case: Case) -> list[str]:
        reasons = self.layout_reasons(case) if self.needs_aligned_rows else []
        if self.max_batch_heads is not None and case.B * case.Hq > self.max_batch_heads:
            reasons.append(f"B * Hq = {case.B * case.Hq} > {self.max_batch_heads}")
        if not self.built:
            reasons.append(f"the {self.name} kernel is not part of this build")
        if case.dtype not in self.dtypes:
            reasons.append(f"dtype {case.dtype} not in {self.dtypes}")
        if self.head_dims is not None and case.D not in self.head_dims:
            reasons.append(f"head dim {case.D} not in {self.head_dims}")
        if case.D > self.max_head_dim:
            reasons.append(f"head dim {case.D} > {self.max_head_dim}")
        if case.mask is not None and not self.supports_mask:
            reasons.append("attn_mask is not supported")
        if case.group > 1 and not self.supports_gqa:
            reasons.append("grouped-query attention is not supported")
        return reasons


#: The long path runs any head dim cuBLASLt accepts; the softmax does not depend on it.
LT = Backend("lt", ("fp16", "bf16"), None, 4096, built=True)
#: The fused short path (native/flash.cu): head dims 64 and 128, causal, GQA, any lengths; no user mask.
WMMA = Backend("wmma", ("fp16", "bf16"), (64, 128), 128, built=True, supports_mask=False, needs_aligned_rows=True,
               max_batch_heads=65535)
_BY_NAME = {"lt": LT, "wmma": WMMA}


@dataclass(frozen=True)
class Decision:
    """The path a case takes (``backend``), why (``reasons``), and why each other path was not taken."""

    backend: str
    reasons: tuple[str, ...]
    rejected: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __str__(self) -> str:
        lines = [f"backend: {self.backend} ({'; '.join(self.reasons)})"]
        lines += [f"  not {name}: {'; '.join(r)}" for name, r in self.rejected]
        return "\n".join(lines)


def select(case: Case, backend: str = "auto", threshold: int | None = None) -> Decision:
    """Pick the path for ``case``. ``backend`` is "auto", "lt" or "wmma"; ``threshold`` overrides the default."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto', 'lt' or 'wmma', got {backend!r}")
    reasons = {name: b.not_supported_reasons(case) for name, b in _BY_NAME.items()}
    rejected = tuple((n, tuple(r)) for n, r in reasons.items() if r)
    if backend != "auto":
        if reasons[backend]:
            raise ValueError(f"backend={backend!r} cannot run {case}: " + "; ".join(reasons[backend]))
        return Decision(backend, ("forced by the caller",), rejected)
    t = config.threshold(threshold)
    if case.Sk >= t:
        if reasons["lt"]:
            raise ValueError(f"no backend can run {case}: lt: {'; '.join(reasons['lt'])}")
        return Decision("lt", (f"Sk={case.Sk} >= threshold {t}",), rejected)
    if not reasons["wmma"]:
        return Decision("wmma", (f"Sk={case.Sk} < threshold {t}",), rejected)
    if not reasons["lt"]:
        return Decision("lt", (f"Sk={case.Sk} < threshold {t}, but wmma cannot run it",), rejected)
    raise ValueError(f"no backend can run {case}: " + " | ".join(f"{n}: {'; '.join(r)}" for n, r in rejected))
