"""The long path where fused kernels cannot go (GPU): any head dim, D_v != D_qk (MLA, V a view of the latent
cache K), and the attention mass per key — each against an FP32/FP64 reference, outputs poisoned with NaN."""

import math

import pytest
import torch

import attn_lt
from attn_lt import config, native
from attn_lt.testing import key_mass_reference, reference, rel_error, sdpa, tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("D", [80, 96, 160, 192, 256, 512, 576, 1024])
def test_any_head_dim(D):
    q = torch.randn(1, 4, 97, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1100, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.full_like(q, math.nan)
    o = attn_lt.attention(q, k, v, causal=True, out=out)
    ref, _ = reference(q, k, v, causal=True)
    assert rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, causal=True), ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_prefill_shape(dtype):
    """D_qk = 192, D_v = 128, causal, against FP64."""
    q = torch.randn(1, 16, 1000, 192, device="cuda", dtype=dtype)
    k = torch.randn(1, 16, 1000, 192, device="cuda", dtype=dtype)
    v = torch.randn(1, 16, 1000, 128, device="cuda", dtype=dtype)
    out = torch.full((1, 16, 1000, 128), math.nan, device="cuda", dtype=dtype)
    o, lse = attn_lt.attention(q, k, v, causal=True, out=out, return_lse=True)
    ref, ref_lse = reference(q, k, v, causal=True, dtype=torch.float64)
    torch_err = rel_error(sdpa(q, k, v, causal=True), ref)
    assert rel_error(o, ref) <= tolerance(torch_err)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("Sk", [1, 4095, 8192])
def test_mla_decode_v_is_a_view_of_the_latent_cache(Sk):
    """One latent head (Hkv = 1) shared by 16 query heads, D_qk = 576, V = K[..., :512] (no copy)."""
    cache = torch.randn(4, 1, Sk, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(4, 16, 1, 576, device="cuda", dtype=torch.bfloat16)
    v = cache[..., :512]
    assert v.data_ptr() == cache.data_ptr()
    out = torch.full((4, 16, 1, 512), math.nan, device="cuda", dtype=torch.bfloat16)
    o = attn_lt.attention(q, cache, v, scale=0.07, out=out)
    ref, _ = reference(q, cache, v, scale=0.07, dtype=torch.float64)
    assert rel_error(o, ref) < 8e-3
    assert "Dqk576 Dv512" in str(attn_lt.explain(q, cache, v))


def test_decode_mass_takes_the_lean_loop_once_resolved(monkeypatch):
    """A prepared decode plan that returns the mass: once its GEMMs are resolved, a call runs the lean loop (the
    softmax writes the mass as it writes P), and gives the first call's output and mass bit for bit."""
    from attn_lt.lt import path as lt_path

    q = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    p = attn_lt.plan(q, k, v, backend="lt", return_key_mass=True)
    o1, m1 = p.run(q, k, v)
    general = []
    run_general = lt_path.Program._run_general
    monkeypatch.setattr(lt_path.Program, "_run_general",
                        lambda self, *a, **kw: general.append(1) or run_general(self, *a, **kw))
    o2, m2 = p.run(q, k, v)
    assert not general, "a resolved decode call with the mass took the general loop"
    assert torch.equal(o1, o2) and torch.equal(m1, m2)
    ref = key_mass_reference(q, k)
    assert ((m2.double() - ref).abs() <= 4e-3 * ref + 1e-6).all()
    # the softmax arguments, which other launches of the program reuse, keep no pointer to the caller's mass
    assert not any(s.args.mass for s in p.program.steps)  # a NULL c_void_p reads None


@pytest.mark.parametrize("case", [
    dict(B=1, Hq=4, Hkv=4, Sq=300, Sk=1000, causal=False, mask=None, window=None),
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, causal=True, mask=None, window=None),
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, causal=True, mask=None, window=64),
    dict(B=1, Hq=4, Hkv=1, Sq=97, Sk=2000, causal=False, mask="bool", window=None),
    dict(B=2, Hq=8, Hkv=8, Sq=64, Sk=3000, causal=False, mask="float", window=17),
    dict(B=4, Hq=32, Hkv=8, Sq=1, Sk=8192, causal=False, mask=None, window=None),   # decode, group folded
    dict(B=2, Hq=32, Hkv=8, Sq=16, Sk=5000, causal=True, mask=None, window=8),     # folded, causal, window
    dict(B=2, Hq=8, Hkv=2, Sq=1, Sk=30000, causal=False, mask=None, window=None),  # decode, 30000 keys (ROW, sm_90)
    # the softmax adds the mass (PIPE): many chunks a head on two lanes, a window, a mask, a causal mix with torch
    dict(B=1, Hq=4, Hkv=2, Sq=1500, Sk=16384, causal=False, mask=None, window=None, ws=128 << 20),
    dict(B=2, Hq=4, Hkv=4, Sq=700, Sk=6001, causal=False, mask="bool", window=300, ws=64 << 20),
    dict(B=1, Hq=8, Hkv=2, Sq=3000, Sk=9000, causal=True, mask="float", window=None, ws=96 << 20),
    # rows of 32000 keys: PIPE in clusters of two CTAs a row adds the mass (causal, Sq != Sk, GQA)
    dict(B=1, Hq=2, Hkv=1, Sq=200, Sk=32000, causal=True, mask=None, window=None, ws=64 << 20),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_key_mass_matches_the_reference(case, monkeypatch):
    c = case
    ws = {"workspace_bytes": c["ws"]} if "ws" in c else {}
    added = []  # chunks whose softmax added their P into the mass (the PIPE kernel)
    adds = native.softmax_adds_mass
    monkeypatch.setattr(native, "softmax_adds_mass", lambda a: added.append(adds(a)) or added[-1])
    q = torch.randn(c["B"], c["Hq"], c["Sq"], 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(c["B"], c["Hkv"], c["Sk"], 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(1, 1, c["Sq"], c["Sk"], device="cuda") > 0.3
    elif c["mask"] == "float":
        mask = torch.randn(c["B"], 1, c["Sq"], c["Sk"], device="cuda")
    o, lse, mass = attn_lt.attention(q, k, v, attn_mask=mask, causal=c["causal"], return_lse=True, backend="lt",
                                     return_key_mass=True, key_mass_window=c["window"], **ws)
    assert mass.shape == (c["B"], c["Hq"], c["Sk"]) and mass.dtype == torch.float32
    ref = key_mass_reference(q, k, mask, c["causal"], key_mass_window=c["window"])
    assert not torch.isnan(mass).any()
    # each row's P sums to 1, so each head's total is the number of rows that see a key, to rounding;
    # elementwise the bound is P's rounding to bf16 (2^-8 relative), summed in FP32
    assert torch.allclose(mass.double().sum(-1), ref.sum(-1), rtol=5e-3)
    assert ((mass.double() - ref).abs() <= 4e-3 * ref + 1e-6).all()
    # asking for the mass keeps whole rows: the output of the same call without it bit for bit when that call keeps
    # whole rows too, and to rounding when it tiles the keys (here the float mask's 9000 keys over 3000 rows)
    with config.override(key_tiles=False):
        o2 = attn_lt.attention(q, k, v, attn_mask=mask, causal=c["causal"], backend="lt", **ws)
    assert torch.equal(o, o2)
    o3 = attn_lt.attention(q, k, v, attn_mask=mask, causal=c["causal"], backend="lt", **ws)
    assert rel_error(o3, o) < 8e-3
    if "ws" in c:  # rows of 4096 keys or more: the softmax added at least one chunk's mass itself
        assert any(added), "no chunk's mass was added by the softmax"
