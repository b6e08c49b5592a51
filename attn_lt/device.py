"""Which CUDA device a call runs on: one rule for the modules that ask (the fused path's launch facts, the
calibration's GPU). ``torch.cuda.is_available()`` asks NVML, too slow for a decode step, so it is asked once."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (asked once per process)."""
    import torch

    return torch.cuda.is_available()


def current_index() -> int | None:
    """The current CUDA device's index, or None without a GPU (a CPU build of torch, or a broken CUDA setup)."""
    try:
        if not cuda_available():
            return None
        import torch

        return torch.cuda.current_device()
    except (RuntimeError, AssertionError):
        return None


@functools.lru_cache(maxsize=1)
def stream_queries() -> tuple:
    """(the current device's index, a device's current cudaStream_t as int, whether the current stream captures a
    CUDA graph): PyTorch's own C calls, which its extensions use — the public functions around them cost a few µs
    on a decode step's hot path. Every launcher of the library asks these."""
    import torch

    try:
        return (torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream,
                torch._C._cuda_isCurrentStreamCapturing)
    except AttributeError:  # pragma: no cover - other PyTorch builds
        return (torch.cuda.current_device, lambda device: torch.cuda.current_stream(device).cuda_stream,
                torch.cuda.is_current_stream_capturing)
