"""The compiled fast path of :func:`attn_lt.attention`: a cached fused call checked and launched in C++.

A decode loop calls ``attention()`` once a layer and a step with tensors of one family (all but the key length and
the K/V strides fixed) and the same options; the family's last fused plan runs each of those calls. In Python that
takes ~80 k instructions a call (the signature, the plan lookup, the output, the launch arguments); the extension
``native/fastpath.cpp`` does it in a few hundred nanoseconds. ``attention()`` offers every call to :data:`call`
first, which returns the output or None (not a remembered family, options or environment; a mask, ``out=``, the
LSE or the key mass asked for; grad; another stream or device; a graph capture), and remembers a fused plan here
after it ran one. ``AttentionPlan.run`` does the same with a handle of its own (:func:`bind`, :data:`run`).
Whatever the fast path declines takes the Python path, which also raises every error.

The extension is built with the package (``native/build.py``) for the torch and the Python that build it (a file
of its own for each: :func:`extension_path`), and carries the hash of its sources; without a matching build,
:data:`call` is None and nothing changes but the host time. :func:`set_enabled` turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import torch

from . import config, native

log = logging.getLogger("attn_lt")

_PKG = Path(__file__).resolve().parent

#: The extension's ``call`` while it is loaded and enabled, else None: ``call(q, k, v, attn_mask, causal, scale,
#: backend, return_lse, out, workspace_bytes, threshold, algo_policy, return_key_mass, key_mass_window, out_layout,
#: window, softcap, sinks)`` returns attention()'s output or None.
call = None
#: The extension's ``run`` while it is on, else None: ``run(handle, q, k, v)`` returns the output of the plan that
#: :func:`bind` made ``handle`` for, or None.
run = None
_ext = None
_why = "not loaded"


def extension_path() -> Path:
    """Where the build puts the extension for this Python and this torch (C++ extensions bind to both)."""
    return _PKG / "_native" / native.fastpath_filename(sys.implementation.cache_tag, torch.__version__)


def _load():
    path = extension_path()
    if not path.is_file():
        return None, (f"not built for this torch and Python ({path.name}); reinstalling attn_lt with this torch "
                      f"(or `make native` in a checkout) builds it")
    try:
        spec = importlib.util.spec_from_file_location("attn_lt._fastpath", path)  # a .so: an extension's loader
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
    except (ImportError, OSError) as e:
        return None, f"cannot load {path.name}: {e}; reinstalling attn_lt (or `make native` in a checkout) rebuilds it"
    expected = native.fastpath_source_hash()
    if expected is not None and ext.SOURCE_HASH != expected:
        return None, f"{path.name} is stale (built from sources {ext.SOURCE_HASH}, now {expected}): `make native`"
    return ext, None


def setup(current_device, raw_stream, capturing) -> None:
    """Load the extension and enable it. ``current_device()``, ``raw_stream(device)`` and ``capturing()`` are the
    calls attention()'s Python path asks (the current CUDA device, its current stream as an int, whether that stream
    captures a graph). The extension compares each call's settings with those a launch was remembered under
    (:func:`attn_lt.config.snapshot_source`)."""
    global _ext, _why
    _ext, _why = _load()
    if _ext is not None:
        _ext.configure(current_device, raw_stream, capturing, *config.snapshot_source())
        log.debug("fast path loaded: %s", extension_path().name)
    else:
        log.debug("fast path off: %s", _why)
    set_enabled(True)


def set_enabled(on: bool) -> bool:
    """Turn the fast path on or off (on only where it is loaded); returns whether it is on now. What it
    remembered stays (it stays valid: whatever moves the plans or their scratch clears it)."""
    global call, run
    on = on and _ext is not None
    call, run = (_ext.call, _ext.run) if on else (None, None)
    return on


def generation() -> int:
    """The scratch's generation: read it before taking the scratch addresses that :func:`remember` or :func:`bind`
    get, which take nothing if a :func:`clear` came in between (another thread grew the scratch)."""
    return _ext.generation() if _ext is not None else 0


def remember(q, k, v, sinks, options: tuple, settings: tuple, keys: tuple[int, float], gen: int, out_shape: tuple,
             args: bytes, launcher: int, lse_part_offset: int, stream: int, workspace: int, lse: int) -> None:
    """Run later calls of q, k, v's family, with sinks or without as ``sinks`` (FP32 (Hq,) or None), with
    ``options`` (causal, scale, backend, workspace_bytes, threshold, algo_policy, key_mass_window, out_layout,
    window, softcap) under ``settings`` (a 1-tuple of the Settings object), whose key length lies in ``keys`` (lo,
    hi), through this launch: the argument struct's bytes, the launcher's address, the LSE partials' offset in the
    workspace, the stream and the scratch addresses (workspace, LSE) that serve it, read in generation ``gen``.
    Takes nothing where the fast path would not take the call (tensor subclasses, options other than None, bool,
    int, float, str or tuples of them), or after a clear since ``gen``."""
    if call is not None:
        _ext.remember(q, k, v, sinks, options, settings, keys[0], float(keys[1]), gen, out_shape, args, launcher,
                      lse_part_offset, stream, workspace, lse)


def bind(q, k, v, gen: int, out_shape: tuple, args: bytes, launcher: int, lse_part_offset: int, stream: int,
         workspace: int, lse: int):
    """A handle for :data:`run` that launches exactly q, k, v's family, key length and K/V strides (one plan's
    ``run``) through this launch (as in :func:`remember`), valid until :func:`clear`; None while off, for tensors
    :data:`run` would not take, or after a clear since ``gen``."""
    if run is None:
        return None
    return _ext.bind(q, k, v, gen, out_shape, args, launcher, lse_part_offset, stream, workspace, lse)


def clear() -> None:
    """Forget every remembered launch and invalidate every handle (the plans were cleared, or the scratch they write
    moved)."""
    if _ext is not None:
        _ext.clear()


def stats() -> dict:
    """``{"on": bool, "entries": families remembered, "hits": calls it ran}``."""
    entries, hits = _ext.stats() if _ext is not None else (0, 0)
    return {"on": call is not None, "entries": entries, "hits": hits}


def status() -> str:
    """One line for ``attn-lt info``."""
    if call is not None:
        return f"on ({extension_path().name})"
    return "off (set_enabled(False))" if _ext is not None else f"off: {_why}"
