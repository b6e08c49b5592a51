"""attention() against an FP8 KV cache on the GPU (k and v float8 e4m3 with descale factors, q and the output
fp16/bf16): native/flash.cu's decode blocks against an FP64 reference of the cache's values, PyTorch SDPA on those
values at q's precision giving the error bound; outputs poisoned first. The serving batches' FP8 tests are in
test_batch_gpu.py."""

import math

import pytest
import torch

import attn_lt
from attn_lt.testing import fp8_kv, fp8_values, reference, rel_error, sdpa, tolerance

pytestmark = pytest.mark.gpu


def dense_fp8(B, Hkv, Sk, D, dtype, scale_v=1.0):
    """A dense (B, Hkv, Sk, D) cache in FP8, per-head factors, laid out (B, Sk, Hkv, D) as transformers keeps it:
    (k8, v8, kd, vd, kf, vf), kf / vf its FP32 values."""
    k8, kd = fp8_kv(torch.randn(B, Sk, Hkv, D, dtype=dtype, device="cuda"))
    v8, vd = fp8_kv(torch.randn(B, Sk, Hkv, D, dtype=dtype, device="cuda") * scale_v)
    kf, vf = fp8_values(k8, kd), fp8_values(v8, vd)
    return (k8.transpose(1, 2), v8.transpose(1, 2), kd, vd, kf.transpose(1, 2), vf.transpose(1, 2))


def check(out, q, kf, vf, ref, **kw):
    torch_out = sdpa(q, kf.to(q.dtype), vf.to(q.dtype), **kw)
    assert not torch.isnan(out).any()
    err, torch_err = rel_error(out, ref), rel_error(torch_out, ref)
    assert err <= tolerance(torch_err), f"error {err:.3e}, PyTorch {torch_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,causal", [(1, False), (4, True), (2, False)])
def test_fp8_dense_decode(dtype, D, Sq, causal):
    B, Hq, Hkv, Sk = 2, 16, 4, 4097
    k8, v8, kd, vd, kf, vf = dense_fp8(B, Hkv, Sk, D, dtype, 2.0)
    q = torch.randn(B, Hq, Sq, D, dtype=dtype, device="cuda")
    out = torch.full((B, Hq, Sq, D), math.nan, dtype=dtype, device="cuda")
    out, lse = attn_lt.attention(q, k8, v8, causal=causal, k_descale=kd, v_descale=vd, out=out, return_lse=True)
    ref, ref_lse = reference(q, kf, vf, causal=causal, dtype=torch.float64)
    check(out, q, kf, vf, ref, causal=causal)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3 * (1 + ref_lse.abs().max().item())


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_decode_scores_growing_along_the_keys(D):
    """An FP8 cache whose keys grow along the sequence (e4m3 values times a per-key ramp folded into the cache), so
    that rows pass their softmax reference many times on tiles after the first."""
    B, Hq, Hkv, Sk, dtype = 2, 16, 4, 6000, torch.bfloat16
    ramp = torch.linspace(0.2, 4.0, Sk, device="cuda") ** 2
    k8, kd = fp8_kv(torch.randn(B, Sk, Hkv, D, dtype=dtype, device="cuda") * ramp[:, None, None])
    v8, vd = fp8_kv(torch.randn(B, Sk, Hkv, D, dtype=dtype, device="cuda"))
    kf, vf = fp8_values(k8, kd).transpose(1, 2), fp8_values(v8, vd).transpose(1, 2)
    q = torch.randn(B, Hq, 1, D, dtype=dtype, device="cuda")
    out = torch.full((B, Hq, 1, D), math.nan, dtype=dtype, device="cuda")
    out, lse = attn_lt.attention(q, k8.transpose(1, 2), v8.transpose(1, 2), k_descale=kd, v_descale=vd, out=out,
                                 return_lse=True)
    ref, ref_lse = reference(q, kf, vf, dtype=torch.float64)
    check(out, q, kf, vf, ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3 * (1 + ref_lse.abs().max().item())


def test_fp8_dense_mask_variants_and_layout():
    """A key-padding mask, gpt-oss's window and sinks, softcap, the (B, Sq, Hq, D) output, a one-value factor."""
    dtype, B, Hq, Hkv, Sk, D = torch.bfloat16, 3, 32, 8, 3000, 64
    k8, v8, kd, vd, kf, vf = dense_fp8(B, Hkv, Sk, D, dtype)
    q = torch.randn(B, Hq, 1, D, dtype=dtype, device="cuda")
    mask = torch.rand(B, 1, 1, Sk, device="cuda") > 0.3
    out = attn_lt.attention(q, k8, v8, attn_mask=mask, k_descale=kd, v_descale=vd)
    check(out, q, kf, vf, reference(q, kf, vf, attn_mask=mask, dtype=torch.float64)[0], attn_mask=mask)
    sinks = torch.randn(Hq, device="cuda")
    out = attn_lt.attention(q, k8, v8, causal=True, window=(128, 0), sinks=sinks, k_descale=kd, v_descale=vd,
                            out_layout="bshd")
    ref = reference(q, kf, vf, causal=True, window=(128, 0), sinks=sinks, dtype=torch.float64)[0]
    assert rel_error(out.transpose(1, 2), ref) < 1e-2
    out = attn_lt.attention(q, k8, v8, softcap=20.0, k_descale=kd, v_descale=vd)
    assert rel_error(out, reference(q, kf, vf, softcap=20.0, dtype=torch.float64)[0]) < 1e-2
    one = torch.tensor([0.05], device="cuda")
    out = attn_lt.attention(q, k8, v8, k_descale=one, v_descale=0.5)
    ref = reference(q, fp8_values(k8, one), fp8_values(v8, 0.5), dtype=torch.float64)[0]
    assert rel_error(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_dense_rows_past_the_decode_blocks(dtype):
    """More than 16 query rows a kv head against a dense FP8 cache (a strided view). Up to 64 (speculative decoding:
    5 and 8 rows x GQA 8) a 16-row decode block for each 16, against FP64 on the cache's values with the variants and
    the LSE; more (a prefill chunk) or the mass per key: converted to q's dtype first, then the 16-bit call, bitwise
    equal to it on the converted values, with every option."""
    B, Hq, Hkv, Sk, D = 2, 32, 4, 1000, 128
    k8, v8, kd, vd, kf, vf = dense_fp8(B, Hkv, Sk + 24, D, dtype)
    k8, v8, kf, vf = (x[:, :, 24:] for x in (k8, v8, kf, vf))  # views: the kernels read their strides
    sinks = torch.randn(Hq, device="cuda")
    mask = torch.rand(B, 1, 5, Sk, device="cuda") > 0.3  # (the heads share it; read by strides)
    for Sq, kw in ((5, dict(causal=True)), (8, dict(causal=True, window=(64, 0), sinks=sinks)), (3, dict()),
                   (5, dict(attn_mask=mask))):
        q = torch.randn(B, Hq, Sq, D, dtype=dtype, device="cuda")
        out, lse = attn_lt.attention(q, k8, v8, k_descale=kd, v_descale=vd, return_lse=True, **kw)
        ref, ref_lse = reference(q, kf, vf, dtype=torch.float64, **kw)
        if "sinks" in kw:
            assert rel_error(out, ref) < 1e-2, (Sq, kw)
        else:  # (within PyTorch's own error on the values in q's dtype)
            check(out, q, kf, vf, ref, **{n: x for n, x in kw.items() if n in ("causal", "attn_mask")})
        assert (lse - ref_lse).abs().max() < 1e-2, (Sq, kw)
        assert "converted" not in str(attn_lt.explain(q, k8, v8, **kw)), Sq
    k16, v16 = (x.to(dtype).contiguous() for x in (kf, vf))
    for Sq, kw in ((300, dict(causal=True, out_layout="bshd")), (1, dict(return_key_mass=True)),
                   (37, dict(causal=True, return_key_mass=True, key_mass_window=8, return_lse=True))):
        q = torch.randn(B, Hq, Sq, D, dtype=dtype, device="cuda")
        got = attn_lt.attention(q, k8, v8, k_descale=kd, v_descale=vd, **kw)
        want = attn_lt.attention(q, k16, v16, **kw)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(g, w), (Sq, kw)
    assert "converted to q's dtype first" in str(attn_lt.explain(q, k8, v8, causal=True))


def test_fp8_dense_refusals():
    dtype, B, Hq, Hkv, Sk, D = torch.bfloat16, 1, 8, 2, 256, 128
    k8, v8, kd, vd, _, _ = dense_fp8(B, Hkv, Sk, D, dtype)
    q = torch.randn(B, Hq, 1, D, dtype=dtype, device="cuda")
    with pytest.raises(ValueError, match="fused kernels"):
        attn_lt.attention(q, k8, v8, backend="lt")
    with pytest.raises(TypeError, match="must both be torch.float8_e4m3fn"):
        attn_lt.attention(q, k8, v8.to(dtype))
    ragged = torch.zeros(B, Hkv, Sk, 72, device="cuda").to(torch.float8_e4m3fn)[..., :64]  # rows 72 bytes apart
    with pytest.raises(ValueError, match="16-byte chunks"):
        attn_lt.attention(q[..., :64], ragged, ragged)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        attn_lt.attention(q, k8, v8, k_descale=torch.ones(3, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_mla_dense_decode(dtype):
    """MLA decode on a dense FP8 latent cache (B, 1, Sk, 576), v = its first 512 columns: the Hopper MLA kernel,
    the keys split in parts, against FP64 on the cache's values; explain says how it reads the cache."""
    from attn_lt.fused import device_facts
    if not device_facts().hopper:
        pytest.skip("MLA decode runs on the Hopper kernel")
    B, Hq, Sk = 3, 128, 3001
    lat8, kd = fp8_kv(torch.randn(B, Sk, 1, 576, dtype=dtype, device="cuda"))
    k8 = lat8.transpose(1, 2)
    q = torch.randn(B, Hq, 1, 576, dtype=dtype, device="cuda")
    out = torch.full((B, Hq, 1, 512), math.nan, dtype=dtype, device="cuda")
    out, lse = attn_lt.attention(q, k8, k8[..., :512], k_descale=kd, v_descale=kd, out=out, return_lse=True)
    kf = fp8_values(lat8, kd).transpose(1, 2)
    ref, ref_lse = reference(q, kf, kf[..., :512], dtype=torch.float64)
    check(out, q, kf, kf[..., :512], ref)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3 * (1 + ref_lse.abs().max().item())
    assert "FP8 latent cache" in str(attn_lt.explain(q, k8, k8[..., :512]))
    with pytest.raises(ValueError, match="one query a head"):
        attn_lt.attention(torch.randn(B, Hq, 2, 576, dtype=dtype, device="cuda"), k8, k8[..., :512], k_descale=kd)
