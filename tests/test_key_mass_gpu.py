"""The attention mass per key from the fused path (GPU): native/flash.cu's attn_lt_key_mass after the fused call,
against an FP64 reference, on fresh random inputs with the outputs poisoned."""

import math

import pytest
import torch

import attn_lt
from attn_lt.testing import cu_seqlens, key_mass_reference, window_mask

pytestmark = pytest.mark.gpu

CASES = [
    dict(B=1, Hq=4, Hkv=4, Sq=300, Sk=1000, D=128),
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, D=128, causal=True),                 # causal, Sq != Sk, GQA
    dict(B=2, Hq=8, Hkv=2, Sq=257, Sk=4097, D=64, causal=True, kmw=64),          # SnapKV's window of 64 rows
    dict(B=1, Hq=4, Hkv=1, Sq=97, Sk=2000, D=256, mask="bool"),
    dict(B=2, Hq=8, Hkv=8, Sq=64, Sk=3000, D=128, mask="float", kmw=17),
    dict(B=1, Hq=6, Hkv=2, Sq=200, Sk=999, D=128, mask="dtype", causal=True),
    dict(B=4, Hq=32, Hkv=8, Sq=1, Sk=8192, D=128),                                # decode: the scores stored
    dict(B=3, Hq=32, Hkv=2, Sq=1, Sk=5000, D=128, causal=True, window=(127, 0), sinks=True),
    dict(B=2, Hq=8, Hkv=8, Sq=1, Sk=3001, D=64, mask="float", softcap=20.0),
    dict(B=2, Hq=64, Hkv=2, Sq=1, Sk=2000, D=128),                                # 32 rows a kv head: K read again
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
    # many rows a head (the Hopper pass on sm_90): Sq > Sk with rows that see no key, tiles of 64 rows at D 256 from
    # a first row inside a tile, views of (B, S, H, D) tensors
    dict(B=2, Hq=6, Hkv=3, Sq=1100, Sk=700, D=64, causal=True),
    dict(B=1, Hq=4, Hkv=1, Sq=300, Sk=4097, D=256, kmw=200),
    dict(B=2, Hq=8, Hkv=2, Sq=1000, Sk=1029, D=128, causal=True, bshd=True),
    dict(B=1, Hq=4, Hkv=2, Sq=129, Sk=4095, D=128, window=(4096, 5), softcap=10.0),
]


def _id(c):
    return "-".join(f"{k}{v}" for k, v in c.items()).replace(" ", "")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_key_mass_matches_fp64(case, dtype):
    c = dict(causal=False, mask=None, kmw=None, window=None, softcap=None, sinks=False, bshd=False) | case
    B, Hq, Hkv, Sq, Sk, D = (c[n] for n in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))
    if c["bshd"]:
        q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
    else:
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


# ---- serving batches: varlen_attention / paged_attention with return_key_mass ----------------------------------

def _close(mass, ref, softcap=None):
    rel = 5e-3 if softcap else 2e-4
    assert not torch.isnan(mass).any()
    err = (mass.double() - ref).abs()
    assert (err <= rel * ref + 1e-6).all(), f"worst {(err / (ref + 1e-6)).max().item():.3g}"


BATCH_CASES = [
    # (rows a request, keys a request): decode rows, a chunked prefill (Sq != Sk), no keys, one key, no rows
    dict(D=128, Hq=32, Hkv=8, q=[1, 1, 1, 1, 1], k=[1, 97, 4097, 0, 300]),
    dict(D=64, Hq=8, Hkv=2, q=[1, 200, 3, 0, 64], k=[500, 1000, 3, 40, 64], causal=True),
    dict(D=256, Hq=8, Hkv=1, q=[5, 130], k=[2000, 130], causal=True, kmw=64),
    dict(D=128, Hq=8, Hkv=2, q=[300, 1, 17], k=[900, 5000, 17], causal=True, window=(63, 0), sinks=True),
    dict(D=128, Hq=8, Hkv=4, q=[100, 2], k=[700, 99], causal=True, window=(99, 0), softcap=30.0, kmw=1),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", BATCH_CASES, ids=_id)
def test_varlen_key_mass_matches_fp64_per_request(case, dtype):
    from attn_lt.testing import varlen_key_mass_reference

    c = dict(causal=False, kmw=None, window=None, softcap=None, sinks=False) | case
    D, Hq, Hkv = c["D"], c["Hq"], c["Hkv"]
    cq, ck = cu_seqlens(c["q"]), cu_seqlens(c["k"])
    q = torch.randn(sum(c["q"]), Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(sum(c["k"]), Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    sinks = torch.randn(Hq, device="cuda") if c["sinks"] else None
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"], sinks=sinks)
    out, mass = attn_lt.varlen_attention(q, k, v, cq, ck, max_seqlen_q=max(c["q"]), max_seqlen_k=max(c["k"]),
                                         return_key_mass=True, key_mass_window=c["kmw"], check=True, **kw)
    assert mass.shape == (Hq, k.shape[0]) and mass.dtype == torch.float32
    ref = varlen_key_mass_reference(q, k, cq, ck, key_mass_window=c["kmw"], **kw)
    _close(mass, ref, c["softcap"])
    # the output is the call's without the mass, bit for bit
    plain = attn_lt.varlen_attention(q, k, v, cq, ck, max_seqlen_q=max(c["q"]), max_seqlen_k=max(c["k"]), **kw)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_paged_key_mass_matches_fp64_per_request(block_size):
    """Permuted tables; lengths 0, 1, block_size +- 1 and long; decode rows and prefill chunks mixed in one call;
    the mass past each request's length is 0."""
    from attn_lt.testing import paged_gather, random_pages, varlen_key_mass_reference

    dtype, Hq, Hkv, D = torch.bfloat16, 16, 4, 128
    lens = [0, 1, block_size - 1, block_size + 1, 3000, 777]
    rows = [1, 1, 1, 40, 1, 300]
    k_cache, v_cache, table, seqlens = random_pages(lens, block_size, Hkv, D, dtype)
    cq = cu_seqlens(rows)
    q = torch.randn(sum(rows), Hq, D, device="cuda", dtype=dtype)
    out, lse, mass = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, cu_seqlens_q=cq,
                                             max_seqlen_q=max(rows), return_lse=True, return_key_mass=True,
                                             check=True)
    max_k = table.shape[1] * block_size
    assert mass.shape == (len(lens), Hq, max_k)
    k, _, ck = paged_gather(k_cache, v_cache, table, seqlens)
    ref = varlen_key_mass_reference(q, k, cq, ck, causal=True)
    for b, n in enumerate(lens):
        _close(mass[b, :, :n], ref[:, ck[b]:ck[b] + n])
        assert (mass[b, :, n:] == 0).all()
    # the last 8 rows of each request only
    _, m8 = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, cu_seqlens_q=cq, max_seqlen_q=max(rows),
                                    return_key_mass=True, key_mass_window=8)
    ref8 = varlen_key_mass_reference(q, k, cq, ck, causal=True, key_mass_window=8)
    for b, n in enumerate(lens):
        _close(m8[b, :, :n], ref8[:, ck[b]:ck[b] + n])


@pytest.mark.parametrize("bad", ["past", -1, -2])
def test_paged_key_mass_of_a_bad_block_is_zero_and_reported(bad):
    from attn_lt.testing import random_pages

    k_cache, v_cache, table, seqlens = random_pages([100, 100], 16, 2, 64, torch.float16)
    table[1, 2] = k_cache.shape[0] + 5 if bad == "past" else bad  # keys 32..47 of request 1: no block of the cache
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    out, mass = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, return_key_mass=True)
    with pytest.raises(ValueError, match="block id"):
        attn_lt.check_batch_errors()
    assert (mass[1, :, 32:48] == 0).all() and (mass[1, :, :32] > 0).all()
    assert torch.allclose(mass[1].sum(-1), torch.ones(8, device="cuda", dtype=torch.float32), atol=1e-4)


def test_paged_key_mass_in_a_graph_and_on_a_side_stream():
    """One capture replayed with new lengths and tables equals the eager call; a side stream gets the launches."""
    from attn_lt.testing import random_pages

    dtype, Hq, Hkv, D, bs = torch.bfloat16, 32, 8, 128, 16
    k_cache, v_cache, table, seqlens = random_pages([500] * 8, bs, Hkv, D, dtype, spare_blocks=0)
    q = torch.randn(8, Hq, D, device="cuda", dtype=dtype)
    res = {}

    def call():
        res["out"], res["mass"] = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, return_key_mass=True)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        call()
    side.synchronize()
    eager_mass = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, return_key_mass=True)[1]
    assert torch.equal(res["mass"], eager_mass)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step in range(5):
        seqlens.copy_(torch.randint(0, 500, (8,), dtype=torch.int32))
        table.copy_(table[torch.randperm(8)])
        q.copy_(torch.randn_like(q))
        graph.replay()
        out, mass = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, return_key_mass=True)
        assert torch.equal(res["out"], out) and torch.equal(res["mass"], mass), step
    attn_lt.check_batch_errors()
