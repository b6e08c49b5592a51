"""What a path can run, declared (xformers style). Each path declares itself beside its launcher (``attn_lt/fused.py``,
``attn_lt/lt/path.py``); the selector (``attn_lt/select.py``) asks every declaration why it would refuse a case."""

from __future__ import annotations

from dataclasses import dataclass

from .validate import Case


@dataclass(frozen=True)
class Backend:
    """What one path can run; ``not_supported_reasons`` explains a refusal in words."""

    name: str
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...] | None  # None: any head dim up to max_head_dim
    max_head_dim: int
    built: bool = True
    supports_mask: bool = True
    supports_gqa: bool = True
    supports_value_dim: bool = False  # v's head dim may differ from q's and k's
    supports_key_mass: bool = False  # can return the attention mass per key
    needs_aligned_rows: bool = False  # 16-byte aligned bases and strides (cp.async / TMA tiles)
    supports_variants: bool = False  # a sliding window, a logit softcap and attention sinks
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

    def not_supported_reasons(self, case: Case, key_mass: bool = False) -> list[str]:
        reasons = self.layout_reasons(case) if self.needs_aligned_rows else []
        if self.max_batch_heads is not None and case.B * case.Hq > self.max_batch_heads:
            reasons.append(f"B * Hq = {case.B * case.Hq} > {self.max_batch_heads}")
        if not self.built:
            reasons.append(f"the {self.name} kernel is not part of this build")
        if case.dtype not in self.dtypes:
            reasons.append(f"dtype {case.dtype} not in {self.dtypes}")
        if self.head_dims is not None and case.D not in self.head_dims:
            reasons.append(f"head dim {case.D} not in {self.head_dims}")
        if max(case.D, case.Dv) > self.max_head_dim:
            reasons.append(f"head dim {max(case.D, case.Dv)} > {self.max_head_dim}")
        if case.Dv != case.D and not self.supports_value_dim:
            reasons.append(f"v's head dim {case.Dv} differs from q's and k's {case.D}")
        if case.mask is not None and not self.supports_mask:
            reasons.append("attn_mask is not supported")
        if case.group > 1 and not self.supports_gqa:
            reasons.append("grouped-query attention is not supported")
        if key_mass and not self.supports_key_mass:
            reasons.append("it cannot return the attention mass per key (return_key_mass=True)")
        if case.variant and not self.supports_variants:
            asked = [w for w, on in (("sliding window", case.window is not None), ("softcap", case.softcap > 0),
                                     ("attention sinks", case.sinks)) if on]
            reasons.append(f"it runs no {' / '.join(asked)} (the fused path does)")
        return reasons
