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


@pytest.fixture(autouse=True, scope="session")
def _private_algo_cache(tmp_path_factory):
    """Tests never touch the user's algorithm cache, and use cuBLASLt's heuristic unless a test asks to tune."""
    import os

    saved = {k: os.environ.get(k) for k in ("ATTN_LT_CACHE_DIR", "ATTN_LT_ALGO_POLICY")}
    os.environ["ATTN_LT_CACHE_DIR"] = str(tmp_path_factory.mktemp("algo_cache"))
    os.environ["ATTN_LT_ALGO_POLICY"] = "heuristic"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
