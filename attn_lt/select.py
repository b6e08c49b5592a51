"""The hybrid selector: each path declares what it supports (beside its launcher); one rule picks the path.

``auto`` prefers the long path ``lt`` where it is measured faster, else the fused ``wmma`` kernel when it can run
the case (else ``lt``). What decides, in order: the caller's threshold (argument, else ``ATTN_LT_THRESHOLD``:
``Sk >= threshold`` takes ``lt``); the calibration of this GPU (``attn-lt calibrate``); the calibration shipped for
this GPU model; the design default ``Sk >= 4096``. A calibration decides a case by the rule of its head dim, causal
flag, mask or not, and query length (``attn_lt.calibrate.Calibration.rule_for``); a case it has no rule for goes
to the next source. A call that asks for the attention mass per key takes the path that can give it (``lt``). Forcing a path
that cannot run a case raises ``ValueError`` with every reason. The reasons say which measurement decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import calibrate, config
from .lt.path import LT
from .validate import Case
from .fused import WMMA, prefers_fused_mass

BACKENDS = ("lt", "wmma")
DECLARATIONS = {"lt": LT, "wmma": WMMA}


def _shown(t: int) -> str:
    return "never" if t >= calibrate.NEVER else str(t)


def current_threshold(override: int | None = None) -> tuple[int | str, str]:
    """(key length from which ``auto`` prefers the long path, where that comes from); the first element is
    ``"per case"`` when a measured calibration decides by head dim, causal flag and query length (``explain``
    shows a case's figures)."""
    explicit = config.threshold_setting(override)
    if explicit is not None:
        return explicit
    for cal in calibrate.calibrations():
        if cal.threshold is not None:
            return cal.threshold, cal.source
        if cal.rules:
            dims = sorted({r.D for r in cal.rules})
            return "per case", f"{cal.source}: {len(cal.rules)} rules, head dims {', '.join(map(str, dims))}"
    return config.DEFAULT_THRESHOLD, "design default"


@dataclass(frozen=True)
class Route:
    """What decides ``auto`` for a case, as a bound on the key length: ``lt`` from ``lt_from`` keys on (None:
    never). It holds for every key length of the case's family (same everything else) on the same side of Sq >= Sk
    (``prefill``), so that the compiled fast path may run a decode loop's later steps on one plan over the key
    lengths :meth:`wmma_keys` gives (until ``attn_lt.api.clear_plans()``, e.g. after a new calibration)."""

    lt_from: int | None
    bound: str | None  # what Sk is compared with, in words (None: a rule under which wmma wins at every Sk)
    source: str  # where the bound comes from, and its figures
    prefill: bool  # decided for Sq >= Sk

    def prefers_lt(self, Sk: int) -> bool:
        return self.lt_from is not None and Sk >= self.lt_from

    def why(self, Sk: int) -> str:
        if self.bound is None:
            return f"Sk={Sk}: wmma at every Sk{self.source}"
        return f"Sk={Sk} {'>=' if self.prefers_lt(Sk) else '<'} {self.bound}{self.source}"

    def wmma_keys(self, Sq: int) -> tuple[int, int | None]:
        """The key lengths (lo, hi; None: no bound) this route sends to wmma on its own side of Sq >= Sk."""
        lo, hi = (1, Sq) if self.prefill else (Sq + 1, None)
        if self.lt_from is not None:
            hi = self.lt_from - 1 if hi is None else min(hi, self.lt_from - 1)
        return lo, hi


def route_of(case: Case, threshold: int | None = None) -> Route:
    """The :class:`Route` of ``case``: the one place of the rule described at the top of this module."""
    prefill = case.Sq >= case.Sk
    explicit = config.threshold_setting(threshold)
    if explicit is not None:
        t, source = explicit
        return Route(t, f"threshold {_shown(t)}", f" ({source})", prefill)
    cals = calibrate.calibrations()
    for cal in cals:
        if cal.threshold is not None:
            return Route(cal.threshold, f"threshold {_shown(cal.threshold)}", f" ({cal.source})", prefill)
        rule = cal.rule_for(case.D, case.causal, case.Sq, case.Sk, mask=case.mask is not None)
        if rule is None:
            continue
        bucket = "" if rule.Sq == case.Sq or (rule.Sq == calibrate.PREFILL and prefill) else \
            f", Sq={case.Sq} in bucket {rule.bucket}"
        bound = None if rule.lt_from is None else f"{rule.lt_from}{bucket}"
        return Route(rule.lt_from, bound, (bucket if bound is None else "") + f" ({cal.source}: {rule})", prefill)
    t = config.DEFAULT_THRESHOLD
    missing = ""
    if cals:
        missing = (f"; no calibration of this GPU covers D{case.D}{' causal' if case.causal else ''}"
                   f"{' masked' if case.mask is not None else ''} Sq={case.Sq}")
    return Route(t, f"threshold {t}", f" (design default{missing})", prefill)


def route(case: Case, threshold: int | None = None) -> tuple[bool, str]:
    """(whether ``auto`` prefers ``lt`` for ``case`` when both paths can run it, the reason in words)."""
    r = route_of(case, threshold)
    return r.prefers_lt(case.Sk), r.why(case.Sk)


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


#: Why a call that asks for the attention mass per key takes each path.
KEY_MASS_WHY = {"wmma": "the attention mass per key: the fused call, then a pass over its keys that sums each row's "
                        "probabilities from the call's LSE (native/flash.cu attn_lt_key_mass; on Hopper, "
                        "native/mass_sm90.cu's wgmma pass for many rows)",
                "lt": "the attention mass per key comes from the long path's probabilities",
                "lt_faster": "the attention mass per key: the long path's probabilities, faster here than the fused "
                             "path's pass (a few rows a kv head, or every row at head dim 256 without the Hopper "
                             "pass: attn_lt.fused.prefers_fused_mass)"}


def select(case: Case, backend: str = "auto", threshold: int | None = None, key_mass: bool = False,
           key_mass_window: int | None = None) -> Decision:
    """Pick the path for ``case``. ``backend`` is "auto", "lt" or "wmma"; ``threshold`` overrides the
    threshold; ``key_mass``: the call asks for the attention mass per key (of the last ``key_mass_window`` rows,
    None: all)."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be 'auto', 'lt' or 'wmma', got {backend!r}")
    reasons = {name: b.not_supported_reasons(case, key_mass) for name, b in DECLARATIONS.items()}
    rejected = tuple((n, tuple(r)) for n, r in reasons.items() if r)
    if backend != "auto":
        if reasons[backend]:
            raise ValueError(f"backend={backend!r} cannot run {case}: " + "; ".join(reasons[backend]))
        return Decision(backend, ("forced by the caller",), rejected)
    prefer_lt, why = route(case, threshold)
    if key_mass:
        if not reasons["wmma"] and (reasons["lt"] or prefers_fused_mass(case, key_mass_window)):
            return Decision("wmma", (KEY_MASS_WHY["wmma"],), rejected)
        if not reasons["lt"]:
            return Decision("lt", (KEY_MASS_WHY["lt" if reasons["wmma"] else "lt_faster"],), rejected)
    if prefer_lt:
        if not reasons["lt"]:
            return Decision("lt", (why,), rejected)
        if not reasons["wmma"]:
            return Decision("wmma", (f"{why}, but lt cannot run it",), rejected)
        raise ValueError(f"no backend can run {case}: " + " | ".join(f"{n}: {'; '.join(r)}" for n, r in rejected))
    if not reasons["wmma"]:
        return Decision("wmma", (why,), rejected)
    if not reasons["lt"]:
        return Decision("lt", (f"{why}, but wmma cannot run it",), rejected)
    raise ValueError(f"no backend can run {case}: " + " | ".join(f"{n}: {'; '.join(r)}" for n, r in rejected))
