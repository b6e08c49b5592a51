"""The hybrid threshold measured on the user's GPU: ``attn-lt calibrate`` times the fused path against the long
path over key lengths and stores the crossover in ``calibration.json`` beside the algorithm cache, per environment
(the same GPU / cuBLASLt key as the cache). The selector (``select.threshold``) uses it when neither an argument nor
``ATTN_LT_THRESHOLD`` says otherwise."""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from pathlib import Path

from . import config

log = logging.getLogger("attn_lt")

SCHEMA = "attn_lt.calibration"
NEVER = 2**31 - 1  # the long path never wins: auto keeps the fused path whenever it can run the case


FILE = "calibration.json"


def path() -> Path:
    return config.cache_dir() / FILE


MAX_FILE_BYTES = 1 << 20


def _read(p: Path) -> dict:
    """The calibration document at ``p``; a missing file is empty; anything unreadable (a FIFO, a device, a
    directory, a symlink loop, a huge or malformed file) is reported and ignored, never fatal."""
    empty = {"schema": SCHEMA, "thresholds": {}}
    from .cache import CacheError, read_regular_file

    if not os.path.lexists(p):
        return empty
    try:
        doc = json.loads(read_regular_file(p, MAX_FILE_BYTES).decode("utf-8"))
    except CacheError as e:
        log.warning("attn_lt: cannot read the calibration file (%s); ignoring it", e)
        return empty
    except (OSError, ValueError, RecursionError) as e:
        log.warning("attn_lt: cannot read the calibration file %s (%s); ignoring it", p, e)
        return empty
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA and isinstance(doc.get("thresholds"), dict):
        return doc
    log.warning("attn_lt: %s is not a calibration file; ignoring it", p)
    return empty


def read(p: Path | None = None) -> dict:
    """The calibration document (``{"schema": .., "thresholds": {env key: {"threshold": .., "points": ..}}}``) at
    ``p`` (default :func:`path`); empty when missing or unreadable (reported), never raises."""
    return _read(path() if p is None else p)


def store(env_key: str, threshold: int, points: list) -> Path | None:
    """Record ``threshold`` (and the measurements behind it) for ``env_key`` by an atomic replace; returns the
    file, or None (with a warning saying why) when it could not be written."""
    p = path()
    doc = _read(p)
    doc["thresholds"][env_key] = {"threshold": int(threshold), "points": points}
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except (OSError, ValueError, TypeError) as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        log.warning("attn_lt: could not store the calibration in %s (%s)", p, e)
        return None
    finally:
        stored_threshold.cache_clear()
    return p


@functools.lru_cache(maxsize=16)
def _stored(cache_dir: Path, env_key: str) -> int | None:
    entry = _read(cache_dir / FILE)["thresholds"].get(env_key)
    t = entry.get("threshold") if isinstance(entry, dict) else None
    return t if isinstance(t, int) and not isinstance(t, bool) and t >= 1 else None


def _current_env_key() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        from .cache import current_env

        return current_env(torch.cuda.current_device()).key()
    except Exception:  # a CPU build of torch, or no nvmath / cuBLASLt: no environment, no calibration
        return None


def stored_threshold() -> int | None:
    """The calibrated threshold of the current GPU, or None. Every ``auto`` call asks: the file is read once per
    (calibration file, GPU environment)."""
    key = _current_env_key()
    return None if key is None else _stored(config.cache_dir(), key)


stored_threshold.cache_clear = _stored.cache_clear  # type: ignore[attr-defined]


def crossover(points: list[dict]) -> int:
    """Smallest measured Sk from which the long path is faster at every longer measured Sk (per head dim, the
    smallest over head dims); NEVER when the fused path wins at the longest length of every head dim."""
    best = NEVER
    for d in sorted({p["D"] for p in points}):
        rows = sorted((p for p in points if p["D"] == d), key=lambda p: p["Sk"])
        t = NEVER
        for p in reversed(rows):
            if p["lt_ms"] < p["wmma_ms"]:
                t = p["Sk"]
            else:
                break
        best = min(best, t)
    return best
