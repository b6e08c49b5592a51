"""The attention mass per key from the fused path (GPU): native/flash.cu's attn_lt_key_mass after the fused call,
against an FP64 reference, on fresh random inputs with the outputs poisoned."""

import math

import pytest
import torch

import attn_lt
from attn_lt.testing import key_mass_reference, window_mask

pytestmark = pytest.mark.gpu

CASES = [
    dict(B=1, Hq=4, Hkv=4, Sq=300, Sk=1000, D=128),
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, D=128, causal=True),                 # causal, Sq != Sk, GQA
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, D=64, causal=True, kmw=64),          # SnapKV's window of 64 rows
    dict(B=1, Hq=4, Hkv=1, Sq=97, Sk=2000, D=256, mask="bool"),
    dict(B=2, Hq=8, Hkv=8, Sq=64, Sk=3000, D=128, mask="float", kmw=17),
    dict(B=1, Hq=6, Hkv=2, Sq=200, Sk=999, D=128, mask="dtype", causal=True),
    dict(B=4, Hq=32, Hkv=8, Sq=1, Sk=8192, D=128),                                # decode
    dict(B=3, Hq=16, Hkv=4, Sq=3, Sk=4095, D=64, causal=True),                   # 4 columns a head
    dict(B=2, Hq=8, Hkv=2, Sq=5, Sk=97, D=256),                                   # 8 columns a head
    dict(B=1, Hq=4, Hkv=2, Sq=97, Sk=64, D=128, causal=True),                    # Sq > Sk: rows with no key
    dict(B=1, Hq=4, Hkv=2, Sq=4096, Sk=4096, D=128, causal=True, kmw=1),
    dict(B=1, Hq=4, Hkv=2, Sq=4096, Sk=4096, D=128, causal=True, kmw=4096),
    dict(B=1, Hq=8, Hkv=2, Sq=1000, Sk=1000, D=128, causal=True, window=(127, 0)),
    dict(B=1, Hq=8, Hkv=2, Sq=700, Sk=1500, D=64, window=(1, 1)),
    dict(B=2, Hq=8, Hkv=2, Sq=600, Sk=600, D=128, causal=True, window=(63, 0), sinks=True),   # gpt-oss
    dict(B=1, Hq=8, Hkv=4, Sq=500, Sk=800, D=256, causal=True, window=(99, 0), softcap=30.0),  # Gemma 2
    dict(B=1, Hq=4, Hkv=4, Sq=333, Sk=333, D=128, softcap=20.0, sinks=True),
]


def _id(c):
    return "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", "")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_key_mass_matches_fp64(case, dtype):
    c = dict(causal=False, mask=None, kmw=None, window=None, softcap=None, sinks=False) | case
    B, Hq, Hkv, Sq, Sk, D = (c[n] for n in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(1, 1, Sq, Sk, device="cuda") > 0.3
        mask[..., Sq // 2, :] = False  # a row that sees no key adds nothing
    elif c["mask"] == "float":
        mask = torch.randn(B, 1, Sq, Sk, device="cuda")
    elif c["mask"] == "dtype":
        mask = torch.randn(1, Hq, Sq, Sk, device="cuda", dtype=dtype)
    sinks = torch.randn(Hq, device="cuda") if c["sinks"] else None
    kw = dict(attn_mask=mask, causal=c["causal"], window=c["window"], softcap=c["softcap"], sinks=sinks,
              backend="wmma")
    out = torch.full((B, Hq, Sq, D), math.nan, device="cuda", dtype=dtype)
    o, lse, mass = attn_lt.attention(q, k, v, return_lse=True, return_key_mass=True, key_mass_window=c["kmw"],
                                     out=out, **kw)
    assert mass.shape == (B, Hq, Sk) and mass.dtype == torch.float32 and not torch.isnan(mass).any()
    ref = key_mass_reference(q, k, mask, c["causal"], key_mass_window=c["kmw"], window=c["window"],
                             softcap=c["softcap"], sinks=sinks)
    # P = exp(s - lse) in FP32 from the call's LSE: FP32 scores and ex2 (2^-22), plus tanh.approx's 2^-11 under softcap
    rel = 5e-3 if c["softcap"] else 2e-4
    err = (mass.double() - ref).abs()
    assert (err <= rel * ref + 1e-6).all(), f"worst {(err / (ref + 1e-6)).max().item():.3g}"
    # the output is the plain fused call's, bit for bit
    o2, lse2 = attn_lt.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_mass_of_hidden_keys_is_zero_and_rows_sum_to_one():
    q = torch.randn(1, 8, 640, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 640, 128, device="cuda", dtype=torch.bfloat16)
    _, mass = attn_lt.attention(q, k, k, causal=True, window=(31, 0), return_key_mass=True, key_mass_window=100)
    assert attn_lt.explain(q, k, k, causal=True, return_key_mass=True, key_mass_window=100).decision.backend == "wmma"
    seen = window_mask(640, 640, (31, 0), True, q.device)[-100:].any(0)
    assert (mass[..., ~seen] == 0).all() and (mass[..., seen] > 0).all()
    torch.testing.assert_close(mass.sum(-1), torch.full((1, 8), 100.0, device="cuda"), rtol=1e-4, atol=0)


def test_fused_key_mass_plan_runs_again_and_in_a_graph():
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    p = attn_lt.plan(q, k, k, return_key_mass=True, backend="wmma")
    o1, m1 = p.run(q, k, k)
    o2, m2 = p.run(q, k, k)
    assert torch.equal(o1, o2) and torch.equal(m1, m2)  # deterministic: no atomics
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og, mg = p.run(q, k, k)
    k.copy_(torch.randn_like(k))
    q.copy_(torch.randn_like(q))
    g.replay()
    o3, m3 = p.run(q, k, k)
    assert torch.equal(og, o3) and torch.equal(mg, m3)


def test_key_mass_refusals_name_the_reason():
    q = torch.randn(1, 4, 16, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key_mass_window"):
        attn_lt.attention(q, k, k, key_mass_window=4)
    with pytest.raises(ValueError, match="key_mass_window"):
        attn_lt.attention(q, k, k, return_key_mass=True, key_mass_window=0)
