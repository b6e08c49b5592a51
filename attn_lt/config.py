"""Every tunable default and the environment variable that overrides it, in one place.

=============================  ===========  =====================================================================
variable                       default      meaning
=============================  ===========  =====================================================================
``ATTN_LT_WORKSPACE_MB``       1024         workspace budget of the long path (FP32 score chunks + cuBLASLt
                                            workspace), MiB; the ``workspace_bytes`` argument overrides it
``ATTN_LT_THRESHOLD``          (measured)   key length from which ``backend="auto"`` takes the long path, for every
                                            case (default: the rules ``attn-lt calibrate`` measured, else 4096)
``ATTN_LT_LANES``              2            lanes of the long path: 2 overlaps a chunk's softmax with the next
                                            chunk's GEMMs (two streams, half the budget each); 1 runs in series
``ATTN_LT_KEY_TILES``          1            0: never tile the keys of the long path (each chunk over whole key rows,
                                            as before key tiles; for comparisons)
``ATTN_LT_LIB``                (package)    path of ``libattn_lt.so`` to load instead of the packaged build
``ATTN_LT_SOFTMAX``            auto         force a softmax kernel: ``pipe``, ``pipe_regs`` (unmasked rows of at
                                            most 16384 keys, no mass), ``row``, ``two_pass``
``ATTN_LT_CACHE_DIR``          (user cache) directory of the algorithm cache ``algos.sqlite``
                                            (default ``$XDG_CACHE_HOME/attn_lt`` or ``~/.cache/attn_lt``)
``ATTN_LT_QK``                 cublaslt     the long path's Q@K^T: ``cublaslt``, or ``native`` (on Hopper,
                                            native/scores_sm90.cu where its grid keeps K; faster alone at D128 and
                                            with one lane, slower with two: see attn_lt/lt/scores.py)
``ATTN_LT_ALGO_POLICY``        tune         ``tune`` (tune a GEMM shape on its first use when not cached),
                                            ``cache`` (use cached algorithms, never tune), ``heuristic``
                                            (cuBLASLt's heuristic only, no cache); argument ``algo_policy``
``ATTN_LT_TUNE_MS``            200          time budget of tuning one GEMM shape, milliseconds
``ATTN_LT_TUNE_CALL_MS``       10000        tuning budget of one attention call; GEMM classes it does not reach
                                            keep the heuristic's algorithm and are tuned by later calls
``ATTN_LT_FASTPATH``           1            0: cached fused calls of ``attention()`` and ``plan.run`` take the
                                            Python path, not the compiled one (``attn_lt.fastpath``; read when
                                            attn_lt is imported; for comparisons)
=============================  ===========  =====================================================================
"""

from __future__ import annotations

import functools
import os

DEFAULT_WORKSPACE_MB = 1024
DEFAULT_THRESHOLD = 4096
#: Share of the workspace given to cuBLASLt (split-K partial sums etc.), at most this many bytes.
GEMM_WORKSPACE_MAX = 32 << 20


# CPython keeps os.environ in a dict of encoded names and values that every write to os.environ updates. A lookup
# there costs a tenth of os.environ.get (which encodes the name and decodes the value each time), and ``auto`` reads
# the environment on every call.
_environ = getattr(os.environ, "_data", None)


@functools.lru_cache(maxsize=None)
def _encoded(name: str):
    return os.environ.encodekey(name)


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, cheaper."""
    if _environ is None:  # pragma: no cover - other Pythons
        return os.environ.get(name, default)
    raw = _environ.get(_encoded(name))
    return default if raw is None else os.environ.decodevalue(raw)


def env_snapshot(names: tuple[str, ...]) -> tuple:
    """The values of the variables ``names`` now, raw (equal snapshots: equal settings), for a cache key."""
    if _environ is None:  # pragma: no cover - other Pythons
        return tuple(map(os.environ.get, names))
    keys = _encoded_names.get(names)
    if keys is None:
        keys = _encoded_names[names] = tuple(map(_encoded, names))
    return tuple(map(_environ.get, keys))


_encoded_names: dict[tuple[str, ...], tuple] = {}


def env_source(names: tuple[str, ...]) -> tuple[dict, tuple] | None:
    """Where :func:`env_snapshot` reads ``names``: (the dict of encoded names and values behind os.environ, the
    names encoded), for a reader in C that compares snapshots; None on Pythons without that dict."""
    if _environ is None:  # pragma: no cover - other Pythons
        return None
    env_snapshot(names)
    return _environ, _encoded_names[names]


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = env(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def workspace_bytes(override: int | None = None) -> int:
    """The long path's workspace budget in bytes: the argument, else ``ATTN_LT_WORKSPACE_MB``, else 1 GiB."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise ValueError(f"workspace_bytes must be a positive int, got {override!r}")
        return override
    return _env_int("ATTN_LT_WORKSPACE_MB", DEFAULT_WORKSPACE_MB, 1) << 20


def threshold_setting(override: int | None = None) -> tuple[int, str] | None:
    """The caller's threshold, with where it comes from: the argument, else ``ATTN_LT_THRESHOLD``, else None (the
    selector then asks the calibration, else takes :data:`DEFAULT_THRESHOLD`)."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ValueError(f"threshold must be a positive int, got {override!r}")
        return override, "threshold argument"
    if env("ATTN_LT_THRESHOLD", "").strip():
        return _env_int("ATTN_LT_THRESHOLD", DEFAULT_THRESHOLD, 1), "ATTN_LT_THRESHOLD"
    return None


def lanes() -> int:
    """Lanes of the long path (``ATTN_LT_LANES``, default 2): 2 lets one chunk's softmax run beside the next chunk's
    GEMMs on a second stream; 1 runs every chunk on the caller's stream, one after the other."""
    v = _env_int("ATTN_LT_LANES", 2, 1)
    if v > 2:
        raise ValueError(f"environment variable ATTN_LT_LANES={v} must be 1 or 2")
    return v


def key_tiles() -> bool:
    """Whether the long path may tile the keys of long rows (``ATTN_LT_KEY_TILES``, default 1)."""
    v = _env_int("ATTN_LT_KEY_TILES", 1, 0)
    if v not in (0, 1):
        raise ValueError(f"environment variable ATTN_LT_KEY_TILES={v} must be 0 or 1")
    return bool(v)


def library_override() -> str | None:
    return env("ATTN_LT_LIB") or None


SOFTMAX_VARIANTS = ("auto", "row", "two_pass", "pipe", "pipe_regs")  # codes 0.. of attn_lt_softmax_variant


def softmax_variant() -> str:
    """The softmax kernel to use: ``ATTN_LT_SOFTMAX`` or "auto" (by row length and GPU)."""
    v = env("ATTN_LT_SOFTMAX", "auto").strip() or "auto"
    if v not in SOFTMAX_VARIANTS:
        raise ValueError(f"environment variable ATTN_LT_SOFTMAX={v!r} must be one of {SOFTMAX_VARIANTS}")
    return v


QK_KERNELS = ("cublaslt", "native")


def qk_kernel() -> str:
    """Who runs the long path's Q@K^T: ``ATTN_LT_QK`` or "cublaslt" (see attn_lt/lt/scores.py)."""
    v = env("ATTN_LT_QK", "cublaslt").strip() or "cublaslt"
    if v not in QK_KERNELS:
        raise ValueError(f"environment variable ATTN_LT_QK={v!r} must be one of {QK_KERNELS}")
    return v


ALGO_POLICIES = ("tune", "cache", "heuristic")


def algo_policy(override: str | None = None) -> str:
    """How the long path picks cuBLASLt algorithms: argument, else ``ATTN_LT_ALGO_POLICY``, else "tune"."""
    v = override if override is not None else (env("ATTN_LT_ALGO_POLICY", "").strip() or "tune")
    if v not in ALGO_POLICIES:
        raise ValueError(f"algo_policy must be one of {ALGO_POLICIES}, got {v!r}")
    return v


def tune_ms() -> int:
    """Time budget of tuning one GEMM shape (``ATTN_LT_TUNE_MS``, default 200)."""
    return _env_int("ATTN_LT_TUNE_MS", 200, 1)


def tune_call_ms() -> int:
    """Tuning budget of one attention call (``ATTN_LT_TUNE_CALL_MS``, default 10000). GEMMs are tuned per shape
    class (a few per kind of work), so the first call that meets a class pays for it once and later calls of any
    length in it never tune; the budget only bounds a first call that meets very many classes."""
    return _env_int("ATTN_LT_TUNE_CALL_MS", 10000, 0)


def cache_dir():
    """Directory of the algorithm cache: ``ATTN_LT_CACHE_DIR``, else the user's cache directory. Resolved once
    per value of the variables it depends on (``auto`` asks on every call, for the calibration file)."""
    return _cache_dir(env("ATTN_LT_CACHE_DIR"), env("XDG_CACHE_HOME"), env("HOME"))


@functools.lru_cache(maxsize=8)
def _cache_dir(explicit: str | None, xdg: str | None, home: str | None):
    from pathlib import Path

    if explicit:
        return Path(explicit).expanduser()
    base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn_lt"
