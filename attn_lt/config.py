"""Every tunable default and the environment variable that overrides it, in one place.

=============================  ===========  =====================================================================
variable                       default      meaning
=============================  ===========  =====================================================================
``ATTN_LT_WORKSPACE_MB``       1024         workspace budget of the long path (FP32 score chunks + cuBLASLt
                                            workspace), MiB; the ``workspace_bytes`` argument overrides it
``ATTN_LT_THRESHOLD``          4096         key length from which ``backend="auto"`` takes the long path
``ATTN_LT_LIB``                (package)    path of ``libattn_lt.so`` to load instead of the packaged build
``ATTN_LT_SOFTMAX``            auto         force a softmax kernel: ``pipe``, ``row``, ``cluster``, ``two_pass``
=============================  ===========  =====================================================================
"""

from __future__ import annotations

import os

DEFAULT_WORKSPACE_MB = 1024
DEFAULT_THRESHOLD = 4096
#: Share of the workspace given to cuBLASLt (split-K partial sums etc.), at most this many bytes.
GEMM_WORKSPACE_MAX = 32 << 20


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
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


def threshold(override: int | None = None) -> int:
    """Key length from which the selector prefers the long path: argument, else ``ATTN_LT_THRESHOLD``, else 4096."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise ValueError(f"threshold must be a positive int, got {override!r}")
        return override
    return _env_int("ATTN_LT_THRESHOLD", DEFAULT_THRESHOLD, 1)


def library_override() -> str | None:
    return os.environ.get("ATTN_LT_LIB") or None


SOFTMAX_VARIANTS = ("auto", "row", "cluster", "two_pass", "pipe")


def softmax_variant() -> str:
    """The softmax kernel to use: ``ATTN_LT_SOFTMAX`` or "auto" (by row length and GPU)."""
    v = os.environ.get("ATTN_LT_SOFTMAX", "auto").strip() or "auto"
    if v not in SOFTMAX_VARIANTS:
        raise ValueError(f"environment variable ATTN_LT_SOFTMAX={v!r} must be one of {SOFTMAX_VARIANTS}")
    return v
