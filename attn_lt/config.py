"""Settings: every tunable default and the environment variable that overrides it, in one place.

Arguments come first (``workspace_bytes=``, ``threshold=``, ``algo_policy=``), the environment second. The
environment is read once, when attn_lt first needs a setting, and checked then (a bad value raises ``ValueError``
naming it); :func:`reload` reads it again (and drops the plans made under the old settings).

=============================  ===========  =====================================================================
variable                       default      meaning
=============================  ===========  =====================================================================
``ATTN_LT_WORKSPACE_MB``       1024         workspace budget of the long path (FP32 score chunks + cuBLASLt
                                            workspace), MiB; the ``workspace_bytes`` argument overrides it
``ATTN_LT_THRESHOLD``          (measured)   key length from which ``backend="auto"`` takes the long path, for every
                                            case (default: the rules ``attn-lt calibrate`` measured, else 4096);
                                            the ``threshold`` argument overrides it
``ATTN_LT_ALGO_POLICY``        tune         ``tune`` (tune a GEMM shape on its first use when not cached),
                                            ``cache`` (use cached algorithms, never tune), ``heuristic``
                                            (cuBLASLt's heuristic only, no cache); argument ``algo_policy``
``ATTN_LT_TUNE_MS``            200          time budget of tuning one GEMM shape, milliseconds
``ATTN_LT_TUNE_CALL_MS``       10000        tuning budget of one attention call; GEMM classes it does not reach
                                            keep the heuristic's algorithm and are tuned by later calls
``ATTN_LT_CACHE_DIR``          (user cache) directory of the algorithm cache ``algos.sqlite`` and measured
                                            calibrations (default ``$XDG_CACHE_HOME/attn_lt`` or
                                            ``~/.cache/attn_lt``)
``ATTN_LT_LIB``                (package)    path of ``libattn_lt.so`` to load instead of the packaged build (read
                                            when the library is first loaded)
``ATTN_LT_DEBUG``              0            1: the ``attn-lt`` command shows the traceback of an unexpected error
                                            (read by the command itself, even where the others are bad)
=============================  ===========  =====================================================================

Options for tests and benchmarks, not settings (no environment variable; :func:`override` sets them): ``lanes``
(1 runs the long path's chunks in series instead of overlapping two), ``key_tiles`` (False: whole key rows),
``softmax`` (force one softmax kernel: ``row``, ``two_pass``, ``pipe``, ``pipe_regs``) and ``qk`` (``native``: the
Hopper Q@K^T of attn_lt/lt/scores.py instead of cuBLASLt). ``attn_lt.fastpath.set_enabled(False)`` sends cached
fused calls through the Python path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from pathlib import Path

DEFAULT_WORKSPACE_MB = 1024
DEFAULT_THRESHOLD = 4096
#: Share of the workspace given to cuBLASLt (split-K partial sums etc.), at most this many bytes.
GEMM_WORKSPACE_MAX = 32 << 20

SOFTMAX_VARIANTS = ("auto", "row", "two_pass", "pipe", "pipe_regs")  # codes 0.. of attn_lt_softmax_variant
QK_KERNELS = ("cublaslt", "native")
ALGO_POLICIES = ("tune", "cache", "heuristic")

@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """The settings in force: one object until :func:`reload` or :func:`override` makes another. Equal and hashed
    by identity (cheap in a plan cache's key; the compiled fast path compares it so)."""

    workspace_mb: int = DEFAULT_WORKSPACE_MB
    threshold: int | None = None  # None: the calibration, else DEFAULT_THRESHOLD
    algo_policy: str = "tune"
    tune_ms: int = 200
    tune_call_ms: int = 10000
    cache_dir: Path = dataclasses.field(default_factory=lambda: Path(os.path.expanduser("~")) / ".cache" / "attn_lt")
    lib: str | None = None
    # options for tests and benchmarks (never from the environment)
    lanes: int = 2
    key_tiles: bool = True
    softmax: str = "auto"
    qk: str = "cublaslt"

    def __post_init__(self):
        checks = (("lanes", self.lanes in (1, 2), "1 or 2"), ("softmax", self.softmax in SOFTMAX_VARIANTS,
                  f"one of {SOFTMAX_VARIANTS}"), ("qk", self.qk in QK_KERNELS, f"one of {QK_KERNELS}"),
                  ("algo_policy", self.algo_policy in ALGO_POLICIES, f"one of {ALGO_POLICIES}"),
                  ("key_tiles", isinstance(self.key_tiles, bool), "True or False"))
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")


def _env_int(environ, name: str, default: int, minimum: int, maximum: int = 1 << 62) -> int:
    raw = environ.get(name, "").strip()
    if raw == "":
        return default
    try:
        value = int(raw) if len(raw) <= 19 else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"environment variable {name}={raw[:40]!r} is not an integer")
    if not minimum <= value <= maximum:
        raise ValueError(f"environment variable {name}={value} must be between {minimum} and {maximum}")
    return value


def from_environment(environ=None) -> Settings:
    """The settings ``environ`` (default ``os.environ``) gives; raises ``ValueError`` naming a bad variable."""
    environ = os.environ if environ is None else environ
    policy = environ.get("ATTN_LT_ALGO_POLICY", "").strip() or "tune"
    if policy not in ALGO_POLICIES:
        raise ValueError(f"environment variable ATTN_LT_ALGO_POLICY={policy[:40]!r} must be one of {ALGO_POLICIES}")
    explicit = environ.get("ATTN_LT_CACHE_DIR", "").strip()
    if explicit:
        cache = Path(explicit).expanduser()
    else:
        base = environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        cache = Path(base) / "attn_lt"
    threshold = environ.get("ATTN_LT_THRESHOLD", "").strip()
    return Settings(
        workspace_mb=_env_int(environ, "ATTN_LT_WORKSPACE_MB", DEFAULT_WORKSPACE_MB, 1, 1 << 30),
        threshold=_env_int(environ, "ATTN_LT_THRESHOLD", DEFAULT_THRESHOLD, 1, 1 << 40) if threshold else None,
        algo_policy=policy,
        tune_ms=_env_int(environ, "ATTN_LT_TUNE_MS", 200, 1, 3_600_000),
        tune_call_ms=_env_int(environ, "ATTN_LT_TUNE_CALL_MS", 10000, 0, 86_400_000),
        cache_dir=cache,
        lib=environ.get("ATTN_LT_LIB", "").strip() or None)


_lock = threading.Lock()
#: ``{"settings": Settings}``: the compiled fast path reads the entry here (attn_lt.fastpath), Python through
#: :func:`current`.
_state: dict[str, Settings | None] = {"settings": None}
_listeners: list = []


def current() -> Settings:
    """The settings in force, read from the environment on first use."""
    s = _state["settings"]
    if s is None:
        with _lock:
            s = _state["settings"]
            if s is None:
                s = _state["settings"] = from_environment()
    return s


def _install(s: Settings | None) -> None:
    with _lock:
        old, _state["settings"] = _state["settings"], s
    if old is not s:
        for fn in list(_listeners):
            fn()


def on_change(fn) -> None:
    """Call ``fn()`` (which must not read the settings) whenever :func:`reload` or :func:`override` replaces them:
    the plan caches drop the plans made under the old ones."""
    _listeners.append(fn)


def reload() -> None:
    """Read the environment again at the next use (where a bad value raises ``ValueError``), and drop the plans
    made under the old settings."""
    _install(None)


@contextlib.contextmanager
def override(**changes):
    """Settings or test options changed for the ``with`` block (tests and benchmarks; one thread at a time), e.g.
    ``with config.override(lanes=1, softmax="row"): ...``; the old settings come back after it. New settings drop
    the plans ``attention()`` keeps. ``lanes`` and ``key_tiles`` are fixed when a plan is made, ``softmax`` and
    ``qk`` when it first runs."""
    old = current()
    new = dataclasses.replace(old, **changes)
    _install(new)
    try:
        yield new
    finally:
        if _state["settings"] is new:  # not if another override or a reload came in meanwhile
            _install(old)


_budgets: list[int] = []


@contextlib.contextmanager
def tuning_budget(ms: int):
    """The long path's tuning budget of each call inside the ``with`` block, ms (benchmarks: a first call that tunes
    every GEMM class of a case, timed calls that tune nothing). Unlike :func:`override` it keeps every plan."""
    if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
        raise ValueError(f"the tuning budget must be an int >= 0 (ms), got {ms!r}")
    _budgets.append(ms)
    try:
        yield
    finally:
        _budgets.pop()


def tune_call_ms() -> int:
    """The tuning budget of one attention call, ms: :func:`tuning_budget`'s, else ``ATTN_LT_TUNE_CALL_MS``."""
    return _budgets[-1] if _budgets else current().tune_call_ms


def snapshot_source() -> tuple[dict, tuple[str]]:
    """Where the compiled fast path reads the settings in force: (a dict, its key)."""
    current()
    return _state, ("settings",)


def workspace_bytes(override: int | None = None) -> int:
    """The long path's workspace budget in bytes: the argument, else ``ATTN_LT_WORKSPACE_MB``, else 1 GiB."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise ValueError(f"workspace_bytes must be a positive int, got {override!r}")
        return override
    return current().workspace_mb << 20


def threshold_setting(override: int | None = None) -> tuple[int, str] | None:
    """The caller's threshold, with where it comes from: the argument, else ``ATTN_LT_THRESHOLD``, else None (the
    selector then asks the calibration, else takes :data:`DEFAULT_THRESHOLD`)."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ValueError(f"threshold must be a positive int, got {override!r}")
        return override, "threshold argument"
    t = current().threshold
    return None if t is None else (t, "ATTN_LT_THRESHOLD")


def algo_policy(override: str | None = None) -> str:
    """How the long path picks cuBLASLt algorithms: argument, else ``ATTN_LT_ALGO_POLICY``, else "tune"."""
    v = override if override is not None else current().algo_policy
    if v not in ALGO_POLICIES:
        raise ValueError(f"algo_policy must be one of {ALGO_POLICIES}, got {v!r}")
    return v


def cache_dir() -> Path:
    """Directory of the algorithm cache: ``ATTN_LT_CACHE_DIR``, else the user's cache directory."""
    return current().cache_dir
