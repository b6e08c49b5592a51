import functools

import pytest
import torch


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    try:
        from nvmath.bindings import cublasLt

        cublasLt.get_version()
    except Exception as e:  # ImportError, or libcublasLt not loadable
        return f"nvmath-python / cuBLASLt unavailable: {e}"
    from attn_lt import native

    try:
        native.load()
    except native.NativeLibraryError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
