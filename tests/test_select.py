"""The hybrid selector's rules, declared capabilities and reasons."""

import pytest

from attn_lt.select import LT, WMMA, select
from attn_lt.validate import Case


def case(Sk=8192, **kw):
    return Case.contiguous(1, 8, 8, kw.pop("Sq", 128), Sk, kw.pop("D", 128), **kw)


@pytest.mark.parametrize("Sk", [4096, 4097, 131072])
def test_long_keys_take_lt(Sk):
    d = select(case(Sk))
    assert d.backend == "lt" and "threshold 4096" in d.reasons[0]


def test_short_keys_take_wmma_when_it_can_run_them():
    d = select(case(4095))
    assert d.backend == "wmma" and "Sk=4095 < threshold 4096" in d.reasons[0]


@pytest.mark.parametrize("kw,why", [(dict(D=80), "head dim 80 not in (64, 128, 256)"),
                                    (dict(D=512), "head dim 512"),
                                    (dict(mask="m"), "attn_mask is not supported")])
def test_short_keys_fall_back_to_lt_with_wmma_reasons(kw, why):
    from attn_lt.validate import MaskInfo

    if kw.get("mask"):
        kw["mask"] = MaskInfo("bool", "bool", (1, 1, 128, 100), (0, 0, 100, 1))
    d = select(case(100, **kw))
    assert d.backend == "lt" and "wmma cannot run it" in d.reasons[0]
    assert any(why in r for r in dict(d.rejected)["wmma"])


def test_wmma_needs_aligned_layouts():
    import dataclasses

    c = dataclasses.replace(case(100), ptr_align=2, q_strides=(8 * 128 * 130, 128 * 130, 130, 1))
    reasons = WMMA.not_supported_reasons(c)
    assert any("16-byte aligned" in r for r in reasons) and any("multiples of 8" in r for r in reasons)


def test_threshold_by_argument_and_environment(monkeypatch):
    assert "threshold 100" in select(case(100), threshold=100).reasons[0]
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "50")
    assert "threshold 50" in select(case(100)).reasons[0]
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "abc")
    with pytest.raises(ValueError, match="ATTN_LT_THRESHOLD"):
        select(case(100))


def test_forced_backend_that_cannot_run_names_every_reason():
    import dataclasses

    with pytest.raises(ValueError, match=r"backend='wmma'.*16-byte aligned.*head dim 96 not in"):
        select(dataclasses.replace(case(D=96), ptr_align=4), backend="wmma")


def test_forced_lt_and_unknown_backend():
    assert select(case(100), backend="lt").reasons == ("forced by the caller",)
    with pytest.raises(ValueError, match="backend must be"):
        select(case(), backend="cudnn")


def test_declared_capabilities():
    assert LT.not_supported_reasons(case(D=512)) == []
    assert "head dim 80 not in (64, 128, 256)" in WMMA.not_supported_reasons(case(D=80))
    hopper = WMMA.not_supported_reasons(case(D=256))  # no GPU here: only the Hopper kernel runs head dim 256
    assert hopper == [] or "needs the Hopper (sm_90a) kernel" in hopper[0]


def test_calibrated_threshold_is_used_for_this_gpu_only(tmp_path, monkeypatch):
    from attn_lt import calibrate

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_current_env_key", lambda: "NVIDIA H200|sm9.0|132sm|cublasLt130100")
    calibrate.stored_threshold.cache_clear()
    assert "threshold 4096" in select(case(100)).reasons[0]
    calibrate.store("NVIDIA H100|sm9.0|132sm|cublasLt130100", 777, [])
    assert "threshold 4096" in select(case(100)).reasons[0]  # another GPU's calibration does not apply
    calibrate.store("NVIDIA H200|sm9.0|132sm|cublasLt130100", 12345, [])
    assert "threshold 12345" in select(case(100)).reasons[0]
    other = tmp_path / "other"
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(other))  # the lookup is cached, but per cache directory
    assert "threshold 4096" in select(case(100)).reasons[0]
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    assert "threshold 12345" in select(case(100)).reasons[0]
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "50")  # the environment variable still wins
    assert "threshold 50" in select(case(100)).reasons[0]
    calibrate.stored_threshold.cache_clear()


def test_crossover_rule():
    from attn_lt.calibrate import NEVER, crossover

    pts = [{"D": 64, "Sk": s, "wmma_ms": w, "lt_ms": l} for s, w, l in
           [(1024, 1, 2), (4096, 3, 2.5), (8192, 9, 4), (16384, 30, 10)]]
    assert crossover(pts) == 4096
    assert crossover([{"D": 128, "Sk": 4096, "wmma_ms": 1, "lt_ms": 2}]) == NEVER
    pts.append({"D": 128, "Sk": 16384, "wmma_ms": 5, "lt_ms": 4})
    assert crossover(pts) == 4096
