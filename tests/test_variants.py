"""The attention variants without a GPU: what the window, softcap and sinks arguments accept and refuse, how a case
holds them, which path and kernel the selector and the launch rule give them."""

import math

import pytest
import torch

import attn_lt
from attn_lt import fused
from attn_lt.select import select
from attn_lt.validate import Case, check_sinks, check_softcap, check_window


def test_window_convention():
    assert check_window(None) is None and check_window((-1, -1)) is None
    assert check_window((127, 0)) == (127, 0) and check_window([5, 7]) == (5, 7)
    assert check_window((127, 5), causal=True) == (127, -1)  # the causal edge is the right one
    assert check_window((-1, 9), causal=True) is None  # plain causal
    for bad, err in (((-2, 0), ValueError), ((0, 2**31), ValueError), (("a", 0), TypeError), (3, TypeError),
                     ((1, 2, 3), TypeError), ((True, 0), TypeError), ((1.5, 0), TypeError), ("ab", TypeError)):
        with pytest.raises(err):
            check_window(bad)


def test_softcap_and_sinks_checks():
    assert check_softcap(None) == 0.0 and check_softcap(0) == 0.0 and check_softcap(30) == 30.0
    for bad, err in ((-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError), ("30", TypeError),
                     (True, TypeError)):
        with pytest.raises(err):
            check_softcap(bad)
    cpu = torch.device("cpu")
    check_sinks(torch.zeros(8), 8, cpu)
    for bad, err, words in ((torch.zeros(8, dtype=torch.float16), TypeError, "float32"),
                            (torch.zeros(4), ValueError, "(8,)"), (torch.zeros(8, 2)[:, 0], ValueError, "contiguous"),
                            ([0.0] * 8, TypeError, "torch.Tensor")):
        with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
            check_sinks(bad, 8, cpu)
    with pytest.raises(ValueError, match="device"):
        check_sinks(torch.zeros(8), 8, torch.device("meta"))


def test_cases_paths_and_kernels():
    c = Case.contiguous(1, 32, 8, 1, 32768, 128, causal=True, window=(127, 0), softcap=30.0, sinks=True)
    assert c.variant and c.window == (127, -1) and "window(127, -1) softcap 30 sinks" in str(c)
    d = select(c)
    assert d.backend == "wmma" and any("runs no sliding window / softcap / attention sinks" in r
                                       for _, rs in d.rejected for r in rs)
    with pytest.raises(ValueError, match="runs no sliding window"):
        select(Case.contiguous(1, 8, 8, 64, 64, 128, window=(3, 3)), "lt")
    # head dims only the long path runs: no path for a variant
    with pytest.raises(ValueError, match="no backend"):
        select(Case.contiguous(1, 8, 8, 64, 64, 512, softcap=10.0))
    # the sm90 decode kernel runs no variant: native/flash.cu's decode blocks do
    plain = Case.contiguous(8, 32, 8, 16, 32768, 128)
    windowed = Case.contiguous(8, 32, 8, 16, 32768, 128, window=(4095, 0))
    assert fused.fused_launch(plain, fused.ASSUMED_DEVICE).kernel == "sm90_decode"
    assert fused.fused_launch(windowed, fused.ASSUMED_DEVICE).kernel == "flash"
    with pytest.raises(ValueError, match="without a window"):
        fused.fused_launch(windowed, fused.ASSUMED_DEVICE, kernel="sm90_decode")
    mla = Case.contiguous(4, 128, 1, 1, 4096, 576, Dv=512, v_in_k=True, sinks=True)
    assert any("without a window, softcap or sinks" in r for r in fused.WMMA.not_supported_reasons(mla))


def test_explain_names_the_variants():
    q = torch.empty(1, 8, 100, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 300, 64, dtype=torch.bfloat16, device="meta")
    e = attn_lt.explain(q, k, k, causal=True, window=(31, 0), softcap=20.0,
                        sinks=torch.empty(8, device="meta"))
    assert "window(31, -1) softcap 20 sinks" in str(e) and e.decision.backend == "wmma"
