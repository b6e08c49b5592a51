"""The hybrid selector's rules, declared capabilities and reasons."""

import pytest

from attn_lt.select import LT, WMMA, select
from attn_lt.validate import Case


@pytest.fixture(autouse=True)
def no_calibration(tmp_path_factory, monkeypatch):
    """The design default unless a test says otherwise, on a GPU machine too: no shipped calibration, an empty
    cache directory, no threshold from the environment; the lookup's cache forgotten before and after."""
    from attn_lt import calibrate

    monkeypatch.setattr(calibrate, "SHIPPED_DIR", tmp_path_factory.mktemp("shipped"))
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("ATTN_LT_THRESHOLD", raising=False)
    calibrate.clear_cache()
    yield
    calibrate.clear_cache()


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
                                    (dict(D=512), "head dim 512")])
def test_short_keys_fall_back_to_lt_with_wmma_reasons(kw, why):
    d = select(case(100, **kw))
    assert d.backend == "lt" and "wmma cannot run it" in d.reasons[0]
    assert any(why in r for r in dict(d.rejected)["wmma"])


def test_masks_run_on_both_paths():
    from attn_lt.validate import MaskInfo

    masked = case(100, mask=MaskInfo("bool", "bool", (1, 1, 128, 100), (0, 0, 100, 1)))
    d = select(masked)
    assert d.backend == "wmma" and not dict(d.rejected).get("wmma")
    assert select(masked, backend="lt").backend == "lt"


@pytest.mark.parametrize("Sk", [100, 131072])
def test_key_mass_takes_the_fused_pass_where_it_is_faster(Sk, monkeypatch):
    import attn_lt.fused

    monkeypatch.setattr(attn_lt.fused, "hopper_kernel", lambda device=None: False)
    d = select(case(Sk), key_mass=True)
    assert d.backend == "wmma" and "attn_lt_key_mass" in d.reasons[0]
    mla = select(case(Sk, D=192, Dv=128), key_mass=True)  # MLA prefill: the fused path runs it, but not its mass
    assert mla.backend == "lt" and "long path's probabilities" in mla.reasons[0]
    assert any("mass per key at q/k head dim 192" in r for r in dict(mla.rejected)["wmma"])
    # every row at head dim 256 without the Hopper pass, and a decode step's few rows: the long path's mass is faster
    assert select(case(Sk, D=256), key_mass=True).backend == "lt"
    monkeypatch.setattr(attn_lt.fused, "hopper_kernel", lambda device=None: True)
    assert select(case(Sk, D=256), key_mass=True).backend == "wmma"
    monkeypatch.setattr(attn_lt.fused, "hopper_kernel", lambda device=None: False)
    assert select(case(Sk, D=256), key_mass=True, key_mass_window=64).backend == "wmma"
    for Sq in (1, 4):
        decode = select(case(Sk, Sq=Sq), key_mass=True)
        assert decode.backend == "lt" and "prefers_fused_mass" in decode.reasons[0]
        assert select(case(Sk, Sq=Sq), backend="wmma", key_mass=True).backend == "wmma"


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
    assert "head dim 192 not in (64, 128, 256)" in WMMA.not_supported_reasons(case(D=192))
    assert WMMA.not_supported_reasons(case(D=192, Dv=128)) == []  # MLA prefill: the Hopper kernel (assumed here)
    assert "head dims 128/64 (q·k/v) not in" in WMMA.not_supported_reasons(case(D=128, Dv=64))[0]
    hopper = WMMA.not_supported_reasons(case(D=256))  # no GPU here: only the Hopper kernel runs head dim 256
    assert hopper == [] or "needs the Hopper (sm_90a) kernel" in hopper[0]


def test_calibrated_threshold_is_used_for_this_gpu_only(tmp_path, monkeypatch):
    from attn_lt import calibrate

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "current_gpu",
                        lambda: calibrate.Gpu("NVIDIA H200", "9.0", "NVIDIA H200|sm9.0|132sm|cublasLt130100"))
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


def test_measured_rules_route_auto_and_say_so(tmp_path, monkeypatch):
    """The per-case rules (tests/test_calibrate.py has the details): the reason names the measurement."""
    from attn_lt import calibrate

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "current_gpu", lambda: calibrate.Gpu("NVIDIA H100 80GB HBM3", "9.0", "env"))
    points = [{"D": 128, "causal": False, "Sq": 1, "Sk": s, "wmma_ms": w, "lt_ms": l}
              for s, w, l in [(1024, 0.2, 0.3), (4096, 0.93, 0.41), (16384, 3.0, 1.2)]]
    calibrate.store("env", calibrate.make_entry(points, "NVIDIA H100 80GB HBM3", "9.0", date="2026-11-22"))
    d = select(case(4096, Sq=1))
    assert d.backend == "lt" and d.reasons[0] == (
        "Sk=4096 >= 4096 (measured on this GPU (NVIDIA H100 80GB HBM3, 2026-11-22): at D128 Sq1 lt wins from "
        "Sk 4096 (lt 0.41 ms vs wmma 0.93 ms at Sk 4096; wmma 0.2 ms vs lt 0.3 ms at Sk 1024))")
    assert select(case(2048, Sq=1)).backend == "wmma"
    assert "design default; no calibration of this GPU covers D64" in select(case(100, D=64)).reasons[0]


def test_a_routes_wmma_keys_are_those_it_sends_to_wmma():
    """Route.wmma_keys(Sq): the key lengths on the route's side of Sq >= Sk that it does not send to lt."""
    from attn_lt.select import Route

    for lt_from in (None, 3, 50, 4096):
        for prefill in (False, True):
            r = Route(lt_from, None if lt_from is None else f"{lt_from}", "", prefill)
            for Sq in (1, 16, 40):
                lo, hi = r.wmma_keys(Sq)
                inside = {Sk for Sk in range(1, 5000) if (Sq >= Sk) == prefill and not r.prefers_lt(Sk)}
                got = {Sk for Sk in range(1, 5000) if lo <= Sk and (hi is None or Sk <= hi)}
                assert got == inside, (lt_from, prefill, Sq)
