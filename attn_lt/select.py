"""The hybrid selector: each path declares what it supports (beside its launcher); one rule picks the path.

Rule: ``Sk >= threshold`` takes the long path ``lt``; shorter keys take the fused ``wmma`` kernel when it can run
the case, else ``lt``. The threshold is the caller's (argument or ``ATTN_LT_THRESHOLD``), else the one ``attn-lt
calibrate`` measured on this GPU, else the design default 4096. A call that asks for the attention mass per key
takes the path that can give it (``lt``). Forcing a path that cannot run a case raises ``ValueError`` with every
reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import calibrate, config
from .lt.path import LT
from .validate import Case
from .wmma import WMMA

BACKENDS = ("lt", "wmma")
DECLARATIONS = {"lt": LT, "wmma": WMMA}


def current_threshold(override: int | None = None) -> tuple[int, str]:
    """(key length from which ``auto`` prefers the long path, where that number comes from)."""
    explicit = config.threshold_setting(override)
    if explicit is not None:
        return explicit
    stored = calibrate.stored_threshold()
    if stored is not None:
        return stored, "measured on this GPU by attn-lt calibrate"
    return config.DEFAULT_THRESHOLD, "design default"


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


def select(case: Case, backend: str = "auto", threshold: int | None = None, key_mass: bool = False) -> Decision:
    """Pick the path for ``case``. ``backend`` is "auto", "lt" or "wmma"; ``threshold`` overrides the
    threshold; ``key_mass``: the call asks for the attention mass per key."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto', 'lt' or 'wmma', got {backend!r}")
    reasons = {name: b.not_supported_reasons(case, key_mass) for name, b in DECLARATIONS.items()}
    rejected = tuple((n, tuple(r)) for n, r in reasons.items() if r)
    if backend != "auto":
        if reasons[backend]:
            raise ValueError(f"backend={backend!r} cannot run {case}: " + "; ".join(reasons[backend]))
        return Decision(backend, ("forced by the caller",), rejected)
    t, source = current_threshold(threshold)
    shown = "never" if t >= calibrate.NEVER else str(t)
    if key_mass and not reasons["lt"]:
        return Decision("lt", ("the attention mass per key comes from the long path's probabilities",), rejected)
    if case.Sk >= t:
        if reasons["lt"]:
            raise ValueError(f"no backend can run {case}: lt: {'; '.join(reasons['lt'])}")
        return Decision("lt", (f"Sk={case.Sk} >= threshold {shown} ({source})",), rejected)
    if not reasons["wmma"]:
        return Decision("wmma", (f"Sk={case.Sk} < threshold {shown} ({source})",), rejected)
    if not reasons["lt"]:
        return Decision("lt", (f"Sk={case.Sk} < threshold {shown} ({source}), but wmma cannot run it",), rejected)
    raise ValueError(f"no backend can run {case}: " + " | ".join(f"{n}: {'; '.join(r)}" for n, r in rejected))
