import functools
import math

import pytest
import torch

import attn_lt
from attn_lt.testing import random_qkv, reference, rel_error, sdpa, tolerance


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


@functools.lru_cache(maxsize=1)
def native_unavailable_reason() -> str | None:
    """Why the tests that load the native library (without a GPU) cannot run here, or None when they can."""
    from attn_lt import native

    try:
        native.load()
    except native.NativeLibraryError as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    for marker, reason, what in (("gpu", gpu_unavailable_reason(), "GPU test"),
                                 ("native", native_unavailable_reason(), "needs the native library")):
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=f"{what} skipped: {reason}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's monkeypatch, and attn_lt reads its settings again after a test changes the environment (as a new
    process would), and after the test."""
    from attn_lt import config as settings

    setenv, delenv = monkeypatch.setenv, monkeypatch.delenv

    def setenv_(name, value, prepend=None):
        setenv(name, value, prepend)
        settings.reload()

    def delenv_(name, raising=True):
        delenv(name, raising)
        settings.reload()

    monkeypatch.setenv, monkeypatch.delenv = setenv_, delenv_
    yield monkeypatch
    monkeypatch.undo()
    settings.reload()


@pytest.fixture
def sm90():
    """Skips unless the current GPU is compute capability 9.0; fails if it is and the sm_90a kernels cannot run
    there (the Hopper fused kernel and the long path's Q@K^T share the library's sm_90a build)."""
    from attn_lt import native

    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        pytest.skip(f"the sm_90a kernels need a compute capability 9.0 GPU (H100/H200); this one is {cc}")
    assert native.flash_sm90_supported(), "cc 9.0 GPU, but the library holds no usable sm_90a kernel"


@pytest.fixture(autouse=True, scope="session")
def _private_algo_cache(tmp_path_factory):
    """Tests never touch the user's algorithm cache, and use cuBLASLt's heuristic unless a test asks to tune."""
    import os

    from attn_lt import calibrate, config

    saved = {k: os.environ.get(k) for k in ("ATTN_LT_CACHE_DIR", "ATTN_LT_ALGO_POLICY")}
    os.environ["ATTN_LT_CACHE_DIR"] = str(tmp_path_factory.mktemp("algo_cache"))
    os.environ["ATTN_LT_ALGO_POLICY"] = "heuristic"
    config.reload()
    shipped = calibrate.SHIPPED_DIR  # tests see the design default unless they ship a calibration themselves
    calibrate.SHIPPED_DIR = tmp_path_factory.mktemp("no_shipped_calibrations")
    calibrate.clear_cache()
    yield
    calibrate.SHIPPED_DIR = shipped
    calibrate.clear_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    config.reload()


# ---- helpers shared by the GPU tests of both paths -------------------------------------------------------------

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rand_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd"):
    return random_qkv(B, Hq, Hkv, Sq, Sk, D, DT[dtype], layout)


def check(q, k, v, attn_mask=None, causal=False, backend="lt", **kw):
    """Run attn_lt (output poisoned with NaN first) and compare out and LSE with the FP32 reference; the output
    error must stay within twice PyTorch's own error at the same precision plus a rounding floor."""
    B, Hq, Sq, D = q.shape
    out = torch.full((B, Hq, Sq, D), math.nan, dtype=q.dtype, device=q.device)
    o, lse = attn_lt.attention(q, k, v, attn_mask=attn_mask, causal=causal, backend=backend, return_lse=True,
                               out=out, **kw)
    assert o is out and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    ref, ref_lse = reference(q, k, v, attn_mask, causal)
    err, torch_err = rel_error(o, ref), rel_error(sdpa(q, k, v, attn_mask, causal), ref)
    assert err <= tolerance(torch_err), f"attn_lt error {err:.3e}, PyTorch {torch_err:.3e}"
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 * (1 + ref_lse[fin].abs().max().item())
    return o, lse
