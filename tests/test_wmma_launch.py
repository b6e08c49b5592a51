"""The fused path's launch rule (CPU): which kernel, how many key splits, and the workspace they take."""

import pytest

from attn_lt.validate import Case, MaskInfo
from attn_lt.wmma import ASSUMED_DEVICE, DeviceFacts, fused_launch, split_count

H100 = ASSUMED_DEVICE
A100 = DeviceFacts(108, False, 166912)


def test_split_count_fills_the_gpu_and_never_splits_a_full_grid():
    assert split_count(264, 264, 1000) == 1
    assert split_count(64, 264, 512) == 4  # 256 CTAs: one nearly full wave
    s = split_count(8, 264, 512)
    assert 8 * s >= 0.85 * 264 and s <= 512 // 4
    assert split_count(8, 264, 6) == 1  # too few key tiles to split
    assert 100 <= split_count(1, 264, 10**6) <= 128  # capped at MAX_SPLITS


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk", [(8, 32, 8, 1, 32768), (1, 32, 8, 1, 32768), (8, 32, 32, 1, 8192),
                                            (8, 32, 8, 16, 32768), (32, 128, 1, 1, 8192)])
def test_decode_takes_the_split_kernel(B, Hq, Hkv, Sq, Sk):
    c = Case.contiguous(B, Hq, Hkv, Sq, Sk, 128)
    f = fused_launch(c, H100)
    rows = Sq * Hq // Hkv
    assert f.kernel == ("flash" if rows <= 64 else "sm90")
    if f.kernel == "flash":
        assert f.block_rows == (16 if rows <= 16 else 64) and f.splits >= 1
        assert f.workspace_bytes == (0 if f.splits == 1 else f.splits * B * Hq * Sq * 129 * 4)
        assert "split" in str(f) or f.splits == 1


def test_prefill_takes_the_hopper_kernel_unless_masked_or_not_hopper():
    c = Case.contiguous(1, 16, 16, 4096, 4096, 128)
    assert fused_launch(c, H100).kernel == "sm90"
    assert fused_launch(c, A100).kernel == "flash" and fused_launch(c, A100).block_rows == 128
    m = MaskInfo("float", "fp32", (1, 1, 4096, 4096), (0, 0, 4096, 1))
    f = fused_launch(Case.contiguous(1, 16, 16, 4096, 4096, 128, mask=m), H100)
    assert f.kernel == "flash" and f.block_rows == 64 and f.splits == 1 and "mask" in f.why


def test_partials_stay_within_their_budget():
    f = fused_launch(Case.contiguous(1, 1, 1, 64, 2**24, 256), H100)
    assert f.workspace_bytes <= 256 << 20
