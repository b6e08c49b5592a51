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


def test_short_keys_fall_back_to_lt_while_wmma_is_not_built():
    assert not WMMA.built
    d = select(case(4095))
    assert d.backend == "lt"
    assert "wmma cannot run it" in d.reasons[0]
    assert dict(d.rejected)["wmma"] == ("the wmma kernel is not part of this build",)


def test_threshold_by_argument_and_environment(monkeypatch):
    assert "threshold 100" in select(case(100), threshold=100).reasons[0]
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "50")
    assert "threshold 50" in select(case(100)).reasons[0]
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "abc")
    with pytest.raises(ValueError, match="ATTN_LT_THRESHOLD"):
        select(case(100))


def test_forced_backend_that_cannot_run_names_every_reason():
    with pytest.raises(ValueError, match=r"backend='wmma'.*not part of this build.*head dim 256"):
        select(case(D=256), backend="wmma")


def test_forced_lt_and_unknown_backend():
    assert select(case(100), backend="lt").reasons == ("forced by the caller",)
    with pytest.raises(ValueError, match="backend must be"):
        select(case(), backend="cudnn")


def test_declared_capabilities():
    assert LT.not_supported_reasons(case(D=512)) == []
    assert "head dim 80 not in (64, 128)" in WMMA.not_supported_reasons(case(D=80))
