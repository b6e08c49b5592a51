"""The LSE merge (attn_lt.merge) on CPU: partial attentions over disjoint key slices, merged, equal the attention
over all keys; empty and fully masked slices; the accumulate form; shape and dtype errors."""

import math

import pytest
import torch

from attn_lt.merge import merge, merge_into
from attn_lt.testing import attention_reference, rel_error


def _case(B=2, H=3, Sq=37, Sk=61, D=16, Dv=12, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, H, Sk, D, generator=g)
    v = torch.randn(B, H, Sk, Dv, generator=g)
    return q, k, v, g


def _partials(q, k, v, cuts, mask=None, causal=False, out_dtype=torch.float32):
    """Partial (out, lse) of the key slices [cuts[i], cuts[i+1]) in FP32 (causal: bottom-right over all keys,
    expressed as a mask so that each slice keeps the global alignment)."""
    Sq, Sk = q.shape[2], k.shape[2]
    if causal:
        cm = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)
        mask = cm if mask is None else mask & cm
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        m = None if mask is None else mask[..., a:b]
        o, l = attention_reference(q, k[:, :, a:b], v[:, :, a:b], attn_mask=m, return_lse=True,
                                   dtype=torch.float32)
        outs.append(o.to(out_dtype))
        lses.append(l)
    return outs, lses, mask


@pytest.mark.parametrize("nslices", [1, 2, 3, 7])
@pytest.mark.parametrize("kind", ["plain", "causal", "mask", "empty-slice"])
def test_merge_equals_full_attention(nslices, kind):
    q, k, v, g = _case()
    Sk = k.shape[2]
    inner = sorted(torch.randperm(Sk - 1, generator=g)[:nslices - 1].add(1).tolist())
    cuts = [0] + inner + [Sk]
    if kind == "empty-slice":  # a slice with no keys at all: LSE -inf, output 0
        cuts = [0, 0] + cuts[1:] + [Sk]
    mask = None
    if kind == "mask":  # random bool mask; a few rows fully masked in every slice
        mask = torch.rand(q.shape[0], 1, q.shape[2], Sk, generator=g) > 0.5
        mask[:, :, :3] = False
    outs, lses, mask = _partials(q, k, v, cuts, mask, causal=(kind == "causal"))
    out, lse = merge(outs, lses)
    ref, ref_lse = attention_reference(q, k, v, attn_mask=mask, return_lse=True)  # float64 inside
    ref64, _ = attention_reference(q.double(), k.double(), v.double(), attn_mask=mask, return_lse=True)
    fp32_full, _ = attention_reference(q, k, v, attn_mask=mask, return_lse=True, dtype=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # the merge may lose what one more FP32 rounding step loses: twice the FP32 full computation's error
    assert rel_error(out, ref64) <= 2 * rel_error(fp32_full, ref64) + 1e-6
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-5 * (1 + ref_lse[fin].abs().max().item())
    if kind == "mask":
        assert torch.isneginf(lse[:, :, :3]).all() and (out[:, :, :3] == 0).all()


def test_merge_into_matches_merge_and_accepts_bf16_partials():
    q, k, v, g = _case(Sq=20, Sk=50)
    outs, lses, _ = _partials(q, k, v, [0, 10, 10, 31, 50], out_dtype=torch.bfloat16)
    want, want_lse = merge(outs, lses)
    acc = torch.full_like(want, math.nan)  # poisoned, then set to the documented start
    acc.zero_()
    acc_lse = torch.full_like(want_lse, -math.inf)
    for o, l in zip(outs, lses):
        merge_into(acc, acc_lse, o, l)
    assert torch.allclose(acc, want, rtol=1e-5, atol=1e-6) and torch.allclose(acc_lse, want_lse)
    # starting from the first partial converted to float32 gives the same
    acc2, acc2_lse = outs[0].float(), lses[0].clone()
    for o, l in zip(outs[1:], lses[1:]):
        merge_into(acc2, acc2_lse, o, l)
    assert torch.allclose(acc2, want, rtol=1e-5, atol=1e-6)


def test_merge_into_row_slice_of_a_larger_accumulator():
    q, k, v, _ = _case(Sq=24, Sk=30)
    outs, lses, _ = _partials(q, k, v, [0, 13, 30])
    acc = torch.zeros(2, 3, 24, 12)
    acc_lse = torch.full((2, 3, 24), -math.inf)
    merge_into(acc[:, :, 8:], acc_lse[:, :, 8:], outs[0][:, :, 8:], lses[0][:, :, 8:])
    merge_into(acc[:, :, 8:], acc_lse[:, :, 8:], outs[1][:, :, 8:], lses[1][:, :, 8:])
    full, full_lse = merge(outs, lses)
    assert (acc[:, :, :8] == 0).all() and torch.isneginf(acc_lse[:, :, :8]).all()
    assert torch.allclose(acc[:, :, 8:], full[:, :, 8:], rtol=1e-5, atol=1e-6)


def test_all_neg_inf_rows_give_zero_never_nan():
    out = torch.randn(1, 2, 5, 4)
    lse = torch.randn(1, 2, 5)
    out2 = torch.full((1, 2, 5, 4), math.nan)  # garbage where its LSE is -inf: must be ignored
    lse2 = torch.full((1, 2, 5), -math.inf)
    lse[0, 0, 1] = -math.inf
    out[0, 0, 1] = math.inf
    o, l = merge([out, out2], [lse, lse2])
    assert not torch.isnan(o).any()
    assert (o[0, 0, 1] == 0).all() and torch.isneginf(l[0, 0, 1])
    assert torch.allclose(o[0, 1], out[0, 1]) and torch.allclose(l[0, 1], lse[0, 1])
    acc, acc_lse = torch.zeros(1, 2, 5, 4), torch.full((1, 2, 5), -math.inf)
    merge_into(acc, acc_lse, out2, lse2)
    merge_into(acc, acc_lse, out, lse)
    assert not torch.isnan(acc).any() and torch.allclose(acc, o) and torch.equal(acc_lse, l)


def test_errors_name_shapes():
    o, l = torch.zeros(2, 3, 5, 4), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"\(2, 3, 5, 4\).*\(2, 3, 6\)"):
        merge([o], [torch.zeros(2, 3, 6)])
    with pytest.raises(ValueError, match=r"\(2, 3, 6, 4\).*\(2, 3, 5, 4\)"):
        merge([o, torch.zeros(2, 3, 6, 4)], [l, torch.zeros(2, 3, 6)])
    with pytest.raises(ValueError, match="at least one"):
        merge([], [])
    with pytest.raises(ValueError, match="2 outputs and 1 LSEs"):
        merge([o, o], [l])
    with pytest.raises(TypeError, match="float32"):
        merge([o], [l.double()])
    with pytest.raises(TypeError, match="floating"):
        merge([o.long()], [l])
    with pytest.raises(TypeError, match="accumulator must be float32"):
        merge_into(o.bfloat16(), l, o, l)
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 4\).*\(2, 3, 5, 4\)"):
        merge_into(o, l, o[:, :, :4], l[:, :, :4])
