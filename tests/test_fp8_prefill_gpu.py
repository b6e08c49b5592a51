"""The FP8 prefill on the GPU: q, k and v float8 e4m3 with descale factors (one a kv head, FlashAttention-3's
inputs), the output bf16 (native/flash_sm90.cu in e4m3). Checked against an FP64 reference of the inputs' values;
the error bound is PyTorch at the path's precision (FP64 scores and softmax, P rounded to e4m3 as the kernel rounds
it: ``reference(..., p_e4m3=True)``, the output rounded to bf16). Outputs poisoned first; inputs as transformers lays them out ((B, S, H, D)
seen as (B, H, S, D)) unless a case says otherwise."""

import math

import pytest
import torch

import attn_lt
from attn_lt.fused import hopper_kernel
from attn_lt.testing import fp8_kv, fp8_values, reference, rel_error, tolerance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not hopper_kernel(),
                                 reason="the FP8 prefill runs on the Hopper kernel (sm_90)")]
BF16 = torch.bfloat16


def inputs(B, Hq, Hkv, Sq, Sk, D, bshd=True, seed=0):
    """(q8, k8, v8, qd, kd, vd, qf, kf, vf): e4m3 tensors (B, H, S, D) (views of (B, S, H, D) memory when bshd),
    their factors (Hkv,) and FP32 values."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(H, S):  # one factor a kv head (q: its query heads'), the (B, H, S, D) view of (B, S, H, D) memory
        x = torch.randn(B, S, H, D, generator=g, device="cuda") if bshd else \
            torch.randn(B, H, S, D, generator=g, device="cuda").transpose(1, 2)
        x8, d = fp8_kv(x, Hkv)
        x8 = x8.transpose(1, 2) if bshd else x8.transpose(1, 2).contiguous()
        return x8, d, fp8_values(x8.transpose(1, 2), d).transpose(1, 2)

    (q8, qd, qf), (k8, kd, kf), (v8, vd, vf) = one(Hq, Sq), one(Hkv, Sk), one(Hkv, Sk)
    return q8, k8, v8, qd, kd, vd, qf, kf, vf


def check(out, qf, kf, vf, rows=None, **kw):
    """out (B, Hq, Sq, D) against the FP64 reference, bounded by PyTorch at the FP8 path's precision; returns
    (error, bound's error)."""
    assert out.dtype == BF16 and not torch.isnan(out).any()
    ref, _ = reference(qf, kf, vf, dtype=torch.float64, rows=rows, **kw)
    emu, _ = reference(qf, kf, vf, dtype=torch.float64, rows=rows, p_e4m3=True, **kw)
    emu = emu.to(BF16)  # (the output's rounding too)
    got = out if rows is None else out[:, :, rows]
    err, emu_err = rel_error(got, ref), rel_error(emu, ref)
    assert err <= tolerance(emu_err), f"FP8 prefill error {err:.3e}, PyTorch with P in e4m3 {emu_err:.3e}"
    return err, emu_err


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Sk,causal", [(4096, 4096, True), (4097, 4097, False), (97, 4095, True),
                                          (1, 1, False), (1, 97, True), (300, 1, False), (128, 4096, False),
                                          (130, 2113, True), (384, 2304, False)])
def test_fp8_prefill(D, Sq, Sk, causal):
    B, Hq, Hkv = (1, 8, 2) if Sq * Sk > 1 << 22 else (2, 8, 2)
    q8, k8, v8, qd, kd, vd, qf, kf, vf = inputs(B, Hq, Hkv, Sq, Sk, D)
    out = torch.full((B, Hq, Sq, D), math.nan, dtype=BF16, device="cuda")
    res, lse = attn_lt.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, out=out,
                                 return_lse=True)
    assert res is out
    rows = torch.randperm(Sq, device="cuda")[:512] if Sq > 512 else None
    check(out, qf, kf, vf, rows=rows, causal=causal)
    _, ref_lse = reference(qf, kf, vf, causal=causal, dtype=torch.float64, rows=rows)
    got = lse if rows is None else lse[:, :, rows]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(got))
    assert (got.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-3 * (1 + ref_lse[finite].abs().max())


def test_fp8_prefill_variants_layouts_and_factors():
    """gpt-oss's window and sinks, Gemma 2's softcap, contiguous (B, H, S, D) inputs with a (B, S, H, D) output,
    one-value and absent factors, and the error of a bf16 call beside the FP8 one's."""
    B, Hq, Hkv, S, D = 2, 16, 4, 1500, 128
    q8, k8, v8, qd, kd, vd, qf, kf, vf = inputs(B, Hq, Hkv, S, S, D, bshd=False, seed=1)
    sinks = torch.randn(Hq, device="cuda")
    out = attn_lt.attention(q8, k8, v8, causal=True, window=(128, 0), sinks=sinks, q_descale=qd, k_descale=kd,
                            v_descale=vd, out_layout="bshd")
    assert out.shape == (B, S, Hq, D)
    check(out.transpose(1, 2), qf, kf, vf, causal=True, window=(128, 0), sinks=sinks)
    out = attn_lt.attention(q8, k8, v8, softcap=20.0, q_descale=qd, k_descale=kd, v_descale=vd)
    check(out, qf, kf, vf, softcap=20.0)
    one = torch.tensor([0.02], device="cuda")
    out = attn_lt.attention(q8, k8, v8, causal=True, q_descale=one, k_descale=0.03, v_descale=None)
    err, _ = check(out, q8.float() * 0.02, k8.float() * 0.03, v8.float(), causal=True)
    bf16 = attn_lt.attention(qf.to(BF16), kf.to(BF16), vf.to(BF16), causal=True)  # the same values in bf16
    ref, _ = reference(qf, kf, vf, causal=True, dtype=torch.float64)
    assert rel_error(bf16, ref) < err  # the bf16 call is the more exact (its inputs hold the FP8 values exactly)


@pytest.mark.parametrize("D", [64, 128])
def test_fp8_prefill_wide_tiles_with_sinks_and_softcap(D):
    """D 64 and 128 from 2048 keys (causal from 4096 at D 64) run wide key tiles: sinks and softcap on them, the last
    tile partial."""
    B, Hq, Hkv, Sq, Sk = 1, 8, 2, 200, 4200
    q8, k8, v8, qd, kd, vd, qf, kf, vf = inputs(B, Hq, Hkv, Sq, Sk, D, seed=2)
    sinks = torch.randn(Hq, device="cuda")
    out = attn_lt.attention(q8, k8, v8, causal=True, sinks=sinks, q_descale=qd, k_descale=kd, v_descale=vd)
    check(out, qf, kf, vf, causal=True, sinks=sinks)
    out = attn_lt.attention(q8, k8, v8, softcap=30.0, q_descale=qd, k_descale=kd, v_descale=vd)
    check(out, qf, kf, vf, softcap=30.0)


def test_fp8_prefill_refusals():
    B, Hq, Hkv, S = 1, 4, 2, 256
    q8, k8, v8, qd, kd, vd, *_ = inputs(B, Hq, Hkv, S, S, 128)
    with pytest.raises(ValueError, match="head dims D = Dv 64, 128 or 256"):
        attn_lt.attention(*(x[..., :96].contiguous() for x in (q8, k8, v8)))
    with pytest.raises(ValueError, match="no dense mask"):
        attn_lt.attention(q8, k8, v8, attn_mask=torch.ones(S, S, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="fused kernels"):
        attn_lt.attention(q8, k8, v8, backend="lt")
    with pytest.raises(ValueError, match="out must be a contiguous"):
        attn_lt.attention(q8, k8, v8, out=torch.empty(B, Hq, S, 128, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="q_descale applies to the FP8 prefill"):
        attn_lt.attention(torch.randn(B, Hq, 1, 128, dtype=BF16, device="cuda"), k8, v8, q_descale=1.0)
    with pytest.raises(ValueError, match="all be per kv head or all one value"):
        attn_lt.attention(q8, k8, v8, q_descale=qd, k_descale=0.5)
    with pytest.raises(TypeError, match="must both be torch.float8_e4m3fn"):
        attn_lt.attention(q8, k8, v8.to(BF16))
