"""The long path on the GPU against an FP32 reference, bounded by twice PyTorch's own error at the same
precision (plus a rounding floor). Fresh random inputs every case; the output is poisoned with NaN first."""

import pytest
import torch
from conftest import check, rand_qkv

import attn_lt
from attn_lt.testing import reference, rel_error, sdpa, tolerance

pytestmark = pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 80, 128, 256, 512])
@pytest.mark.parametrize("S", [1, 97, 4095, 4096, 4097, 16384])
def test_sizes_bf16(S, D):
    check(*rand_qkv(1, 2, 2, S, S, D, "bf16"))


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("S", [97, 4097])
def test_sizes_fp16(S, D):
    check(*rand_qkv(2, 2, 2, S, S, D, "fp16"))


@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (97, 4097), (1, 8192), (16, 4096), (4097, 4097)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["mha", "gqa4", "mqa8"])
def test_gqa_and_causal(Hkv, causal, Sq, Sk):
    check(*rand_qkv(2, 8, Hkv, Sq, Sk, 128, "bf16"), causal=causal)


def test_causal_more_queries_than_keys_gives_zero_rows():
    q, k, v = rand_qkv(1, 4, 2, 300, 97, 64, "bf16")
    o, lse = check(q, k, v, causal=True)
    assert (o[:, :, :203] == 0).all() and torch.isneginf(lse[:, :, :203]).all()


def make_mask(mshape: str, kind: str, B: int, Hq: int, Sq: int, Sk: int) -> torch.Tensor:
    """A random mask of shape ``mshape`` (e.g. "B,1,1,Sk"): bool (a quarter masked out) or additive bf16/fp32."""
    dims = {"B": B, "Hq": Hq, "Sq": Sq, "Sk": Sk, "1": 1}
    shape = [dims[x] for x in mshape.split(",")]
    if kind == "bool":
        return torch.rand(shape, device="cuda") > 0.25
    return torch.randn(shape, device="cuda", dtype=torch.float32 if kind == "fp32" else torch.bfloat16)


@pytest.mark.parametrize("mshape", ["1,1,Sq,Sk", "B,1,1,Sk", "B,Hq,Sq,Sk", "Sq,Sk", "1,Hq,1,Sk"])
@pytest.mark.parametrize("kind", ["bool", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masks(kind, mshape, causal):
    B, Hq, Sq, Sk = 2, 4, 333, 4133
    m = make_mask(mshape, kind, B, Hq, Sq, Sk)
    check(*rand_qkv(B, Hq, 2, Sq, Sk, 64, "bf16"), attn_mask=m, causal=causal)


def test_fully_masked_rows_by_user_mask_give_zero_and_neg_inf():
    q, k, v = rand_qkv(1, 2, 2, 64, 4096, 64, "bf16")
    m = torch.rand(1, 1, 64, 4096, device="cuda") > 0.5
    m[..., 5, :] = False
    o, lse = check(q, k, v, attn_mask=m)
    assert (o[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()


@pytest.mark.parametrize("Hkv,causal", [(8, False), (2, True), (1, False)])
def test_bshd_transposed_views(Hkv, causal):
    check(*rand_qkv(2, 8, Hkv, 1000, 4097, 128, "bf16", layout="bshd"), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_small_budget_many_chunks_same_result(causal):
    q, k, v = rand_qkv(1, 4, 2, 4097, 4097, 64, "bf16")
    plan = attn_lt.explain(q, k, v, causal=causal, workspace_bytes=8 << 20).plan
    assert len(plan.chunks) > 8
    o_small = check(q, k, v, causal=causal, workspace_bytes=8 << 20)[0]
    o_big = attn_lt.attention(q, k, v, causal=causal, backend="lt")
    assert rel_error(o_small, o_big.float()) < 5e-3


def test_long_rows_two_pass_softmax():
    """Sk beyond the register-resident limit exercises the two-pass kernel (in place, tile by tile)."""
    check(*rand_qkv(1, 2, 1, 33, 40000, 64, "bf16"), causal=True)
    check(*rand_qkv(1, 2, 2, 5, 70001, 128, "bf16"))


def test_peak_memory_within_budget_plus_output():
    q, k, v = rand_qkv(1, 8, 8, 16384, 16384, 128, "bf16")
    budget = 256 << 20
    attn_lt.attention(q, k, v, backend="lt", workspace_bytes=budget)  # warm: handles, descriptors
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = attn_lt.attention(q, k, v, backend="lt", workspace_bytes=budget)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= budget + o.numel() * 2 + 8 * 16384 * 4 + (2 << 20)


def test_repeatable_bit_for_bit():
    q, k, v = rand_qkv(1, 4, 4, 2048, 8192, 128, "bf16")
    a = attn_lt.attention(q, k, v, causal=True)
    b = attn_lt.attention(q, k, v, causal=True)
    assert torch.equal(a, b)


def test_current_stream_is_used():
    q, k, v = rand_qkv(1, 2, 2, 512, 4096, 64, "bf16")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o = attn_lt.attention(q, k, v)
    s.synchronize()
    ref, _ = reference(q, k, v)
    assert rel_error(o, ref) < tolerance(rel_error(sdpa(q, k, v), ref))


def test_cupy_in_cupy_out():
    cupy = pytest.importorskip("cupy")
    q, k, v = rand_qkv(1, 2, 2, 97, 4097, 64, "fp16")
    o = attn_lt.attention(cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(v))
    assert isinstance(o, cupy.ndarray) and o.shape == (1, 2, 97, 64)
    ref, _ = reference(q, k, v)
    assert rel_error(torch.from_dlpack(o), ref) < tolerance(rel_error(sdpa(q, k, v), ref))


def test_errors_before_gpu_work():
    q, k, v = rand_qkv(1, 2, 2, 16, 100000, 64, "bf16")
    with pytest.raises(ValueError, match="too small"):
        attn_lt.attention(q, k, v, workspace_bytes=10_000)  # not even a key tile of 16 rows
    with pytest.raises(ValueError, match="out must be"):
        attn_lt.attention(q, k, v, out=torch.empty(1, 2, 16, 32, dtype=torch.bfloat16, device="cuda"))


# ---- key tiles: a budget too small for whole rows makes the planner tile the keys and merge the tiles by LSE -----
KEY_TILE_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, causal, dtype, budget
    (1, 4, 4, 2048, 9000, 128, False, "bf16", 6 << 20),
    (2, 8, 2, 1500, 6000, 64, True, "bf16", 3 << 20),       # GQA, causal, Sq < Sk
    (1, 4, 1, 4097, 4095, 80, True, "fp16", 3 << 20),       # Sq > Sk: leading rows fully masked
    (1, 2, 2, 700, 12345, 256, False, "fp16", 8 << 20),
    (1, 2, 2, 1000, 5000, 512, True, "bf16", 6 << 20),
]


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,causal,dtype,budget", KEY_TILE_CASES)
@pytest.mark.parametrize("lanes", ["1", "2"])
def test_key_tiles(B, Hq, Hkv, Sq, Sk, D, causal, dtype, budget, lanes):
    from attn_lt import config
    from attn_lt.chunks import plan_chunks

    with config.override(lanes=int(lanes)):
        q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, dtype)
        p = attn_lt.plan(q, k, v, causal=causal, backend="lt", workspace_bytes=budget)
        assert p.chunks.key_tile and any(c.tile == "mid" for c in p.chunks.chunks), p.chunks.summary()
        check(q, k, v, causal=causal, workspace_bytes=budget)
    assert plan_chunks(p.case, budget, key_tiles=False).key_tile == 0


@pytest.mark.parametrize("causal", [False, True])
def test_rows_longer_than_one_softmax_cta_are_tiled(causal):
    """The default budget fits whole rows here, but rows this long would run on clusters of softmax CTAs: the
    planner tiles the keys at most ONE_CTA_KEYS long (GQA, Sq != Sk)."""
    from attn_lt.chunks import ONE_CTA_KEYS

    q, k, v = rand_qkv(1, 4, 2, 600, ONE_CTA_KEYS + 1841, 64, "bf16")
    p = attn_lt.plan(q, k, v, causal=causal, backend="lt")
    assert 0 < p.chunks.key_tile <= ONE_CTA_KEYS, p.chunks.summary()
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("Sk", [23001, 12001])  # past one CTA's length; past two CTAs an SM's only
@pytest.mark.parametrize("kind", ["bool", "bf16", "fp32"])
def test_masked_rows_past_the_softmax_full_rate_are_tiled(kind, Sk):
    """A dense mask shares the softmax CTA's ring, so fewer keys fit: at the default budget a masked call past what
    two CTAs an SM hold is tiled at most that long (a row masked out in its first tile only, and one everywhere)."""
    from attn_lt.chunks import tile_keys

    B, Hq, Sq = 1, 2, 520
    m = make_mask("1,1,Sq,Sk", kind, B, Hq, Sq, Sk)
    m[..., 7, :Sk // 2] = False if kind == "bool" else float("-inf")
    m[..., 9, :] = False if kind == "bool" else float("-inf")
    q, k, v = rand_qkv(B, Hq, 1, Sq, Sk, 64, "bf16")
    p = attn_lt.plan(q, k, v, attn_mask=m, backend="lt")
    assert 0 < p.chunks.key_tile <= tile_keys(p.case) < Sk, p.chunks.summary()
    check(q, k, v, attn_mask=m)


@pytest.mark.parametrize("mshape", ["1,1,Sq,Sk", "B,1,1,Sk", "B,Hq,Sq,Sk"])
@pytest.mark.parametrize("kind", ["bool", "bf16", "fp32"])
def test_key_tiles_with_masks(mshape, kind):
    B, Hq, Sq, Sk = 2, 4, 1111, 7001
    m = make_mask(mshape, kind, B, Hq, Sq, Sk)
    m_rows = m if m.dim() == 4 else m[None, None]
    if m_rows.shape[2] == Sq:  # a row masked out in one tile only, and a row masked out everywhere
        m_rows[..., 7, :3000] = False if kind == "bool" else float("-inf")
        m_rows[..., 9, :] = False if kind == "bool" else float("-inf")
    q, k, v = rand_qkv(B, Hq, 2, Sq, Sk, 64, "bf16")
    assert attn_lt.plan(q, k, v, attn_mask=m, backend="lt", workspace_bytes=2 << 20).chunks.key_tile
    check(q, k, v, attn_mask=m, causal=True, workspace_bytes=2 << 20)


def test_key_tiles_transposed_views_and_repeat_calls():
    q, k, v = rand_qkv(1, 8, 2, 3000, 9000, 128, "bf16", layout="bshd")
    for _ in range(2):  # the second call runs the prepared (resolved) plan
        check(q, k, v, causal=True, workspace_bytes=4 << 20)


def test_key_mass_plans_are_not_tiled():
    q, k, v = rand_qkv(1, 2, 2, 600, 9000, 64, "bf16")
    p = attn_lt.plan(q, k, v, backend="lt", workspace_bytes=4 << 20, return_key_mass=True)
    assert p.chunks.key_tile == 0
    out, mass = p.run(q, k, v)
    assert torch.isfinite(mass).all()
    torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[..., 0], 600.0), rtol=1e-3, atol=1e-2)
