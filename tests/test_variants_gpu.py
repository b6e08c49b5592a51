"""The attention variants on the GPU (sliding window, logit softcap, attention sinks): every fused kernel that runs
them (Hopper prefill, native/flash.cu's prefill and decode blocks with their key splits, the serving batches)
against an FP64 reference, outputs poisoned with NaN first; the error bound is PyTorch's own error computing the
same variant eagerly at the input precision."""

import math

import pytest
import torch

import attn_lt
from attn_lt.fused import device_facts
from attn_lt.testing import cu_seqlens, forced_flash, reference, rel_error, tolerance, window_mask

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


def check(q, k, v, out, lse=None, *, causal=False, window=None, softcap=None, sinks=None, attn_mask=None):
    """out (and lse) against the FP64 reference; the bound from the eager computation at q's precision."""
    kw = dict(causal=causal, window=window, softcap=softcap, sinks=sinks, attn_mask=attn_mask)
    ref, ref_lse = reference(q, k, v, dtype=torch.float64, **kw)
    eager, _ = reference(q, k, v, dtype=q.dtype, **kw)
    assert not torch.isnan(out).any(), "NaN in the output"
    err, bound = rel_error(out, ref), tolerance(rel_error(eager, ref))
    assert err <= bound, (err, bound)
    if lse is not None:
        assert not torch.isnan(lse).any()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-2


def rand(B, Hq, Hkv, Sq, Sk, D, dtype):
    return (torch.randn(B, Hq, Sq, D, dtype=dtype, device="cuda"), torch.randn(B, Hkv, Sk, D, dtype=dtype, device="cuda"),
            torch.randn(B, Hkv, Sk, D, dtype=dtype, device="cuda"))


def poisoned(q, Dv=None):
    B, Hq, Sq, D = q.shape
    return torch.full((B, Hq, Sq, Dv or D), math.nan, dtype=q.dtype, device=q.device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("left", [0, 127, 4095, 5000], ids=["w1", "w128", "w4096", "w-all"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "both-sides"])
@pytest.mark.parametrize("Sq,Sk", [(1037, 4500), (4097, 4097)], ids=["sq<sk", "sq=sk"])
def test_window_prefill(dtype, left, causal, Sq, Sk):
    """A window of 1, 128, 4096 keys and one wider than the keys, causal or on both sides (left, left), GQA."""
    q, k, v = rand(1, 8, 2, Sq, Sk, 128, dtype)
    window = (left, 0 if causal else left)
    out = poisoned(q)
    o, lse = attn_lt.attention(q, k, v, causal=causal, window=window, out=out, return_lse=True)
    assert o is out
    check(q, k, v, out, lse, causal=causal, window=window)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("variant", ["window", "sinks", "softcap", "window+sinks", "window+softcap"])
def test_variants_each_head_dim(D, variant):
    """Each variant alone and gpt-oss's and Gemma 2's combinations at every head dim, Sq != Sk."""
    q, k, v = rand(2, 8, 4, 777, 1500, D, torch.bfloat16)
    kw = {}
    if "window" in variant:
        kw["window"] = (127, 0)
    if "sinks" in variant:
        kw["sinks"] = torch.randn(8, device="cuda") * 2
    if "softcap" in variant:
        kw["softcap"] = 5.0  # small enough that the cap bites
    out = poisoned(q)
    o, lse = attn_lt.attention(q, k, v, causal=True, out=out, return_lse=True, **kw)
    check(q, k, v, out, lse, causal=True, **kw)


@pytest.mark.parametrize("D,Sk", [(64, 8300), (128, 4200)], ids=["d64", "d128"])
@pytest.mark.parametrize("variant", ["sinks", "softcap", "sinks+softcap"])
def test_variants_on_wide_key_tiles(D, Sk, variant):
    """Sinks and softcap on the Hopper kernel's wide key tiles (calls without a causal edge, window or mask from
    8192 keys at D 64, 4096 at D 128: 192 and 176 keys), a key tail inside a tile, Sq != Sk, GQA."""
    q, k, v = rand(1, 8, 2, 333, Sk, D, torch.bfloat16)
    kw = {}
    if "sinks" in variant:
        kw["sinks"] = torch.randn(8, device="cuda") * 2
    if "softcap" in variant:
        kw["softcap"] = 5.0
    out = poisoned(q)
    o, lse = attn_lt.attention(q, k, v, out=out, return_lse=True, backend="wmma", **kw)
    check(q, k, v, out, lse, **kw)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("cap", [30.0, 56.0, 57.0, 200.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_saturated_scores(D, cap, dtype):
    """Scaled scores of tens (sigma about 40) and rows 0-39 at about -6 cap on every key, so that the capped logits
    reach both ends of [-cap, cap]: the Hopper kernel's fixed softmax reference (bf16 at D 256, cap <= 56.8) and its
    running max (larger caps, fp16, D 64 and 128) both hold, rows whose every key sits at -cap and one-key rows
    included (sinks and a window beside), and V small enough (1e-5) that P V's products would leave FP32's normal
    range below the fixed reference's floor."""
    q, k, v = rand(1, 8, 2, 300, 1200, D, dtype)
    q = q * 40
    k[:, :, :, 0] = 1.0  # rows 0-39 score about -6 cap on every key
    q[:, :, :40] = torch.randn_like(q[:, :, :40]) * 0.01
    q[:, :, :40, 0] = -6 * cap * math.sqrt(D)
    for v_scale in (1.0, 1e-5):
        for kw in (dict(), dict(window=(0, 0), sinks=torch.randn(8, device="cuda")), dict(window=(255, 0))):
            out = poisoned(q)
            o, lse = attn_lt.attention(q, k, v * v_scale, causal=True, softcap=cap, out=out, return_lse=True, **kw)
            check(q, k, v * v_scale, out, lse, causal=True, softcap=cap, **kw)
            if dtype != torch.bfloat16 or "sinks" in kw:
                continue  # (fp16 holds no 1e-7, and a sink beside one key at -cap leaves outputs of e^-cap)
            # element by element too: the rows at -cap average V, none of them may lose digits
            ref, _ = reference(q, k, v * v_scale, dtype=torch.float64, causal=True, softcap=cap, **kw)
            ref = ref[:, :, :40]
            err = (out[:, :, :40].double() - ref).abs()
            assert (err <= 0.02 * ref.abs() + 0.02 * ref.abs().mean()).all(), err.max().item()


@pytest.mark.parametrize("D", [128, 256])
@pytest.mark.parametrize("rise", [-6.0, 3.0, 12.0, 24.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_rising_over_key_tiles(D, rise, dtype):
    """Every row's scores move by `rise` (exp2 units) a key tile of the kernel (64 keys at D 256, 128 at D 128) in the
    order the kernel visits them (the last tile first): rising by less than the Hopper kernel's lazy-rescale threshold
    (8: the reference kept), by more (moved within a tile, 24) or falling (the first tile's max stands), so that O's
    rescaling runs every way."""
    q, k, v = rand(1, 4, 2, 200, 2000, D, dtype)
    tile = 64 if D == 256 else 128
    slope = abs(rise) / (tile * D**-0.5 * math.log2(math.e))
    k[:, :, :, 0] = torch.arange(2000, device="cuda", dtype=torch.float32).to(dtype) * slope
    q[:, :, :, 0] = -1.0 if rise > 0 else 1.0  # scores falling with the key index rise in the kernel's order
    for causal in (False, True):
        out = poisoned(q)
        o, lse = attn_lt.attention(q, k, v, causal=causal, out=out, return_lse=True)
        check(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("Sq", [1, 4, 16], ids=["sq1", "sq4", "sq16"])
@pytest.mark.parametrize("Sk", [1, 97, 4096, 8193])
def test_decode_with_window_and_sinks(Sq, Sk):
    """Decode blocks (native/flash.cu, keys split and merged): a window of 128 (gpt-oss) and sinks joined in the
    merge; a row whose window holds no key (Sq > Sk) gives zeros and the sink as its LSE."""
    q, k, v = rand(3, 64, 8, Sq, Sk, 64, torch.bfloat16)
    sinks = torch.randn(64, device="cuda")
    for window in ((127, 0), (-1, -1)):
        out = poisoned(q)
        o, lse = attn_lt.attention(q, k, v, causal=True, window=window, sinks=sinks, out=out, return_lse=True)
        check(q, k, v, out, lse, causal=True, window=window, sinks=sinks)


@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("variant", ["window", "softcap+sinks"])
def test_flash_kernel_forced(splits, variant):
    """native/flash.cu forced (what runs off Hopper): prefill rows and split decode, each variant."""
    kw = dict(window=(300, 0)) if variant == "window" else dict(softcap=8.0, sinks=torch.randn(16, device="cuda"))
    for Sq in (1, 200):
        q, k, v = rand(2, 16, 4, Sq, 3000, 128, torch.float16)
        run, out, lse = forced_flash(q, k, v, causal=True, splits=splits if Sq == 1 else 1, **kw)
        run()
        torch.cuda.synchronize()
        check(q, k, v, out, lse, causal=True, **kw)


def test_window_with_a_mask():
    """A window and a dense bool mask together (both hide keys)."""
    q, k, v = rand(2, 8, 8, 300, 700, 128, torch.bfloat16)
    mask = torch.rand(2, 1, 300, 700, device="cuda") > 0.3
    out = poisoned(q)
    attn_lt.attention(q, k, v, attn_mask=mask, causal=True, window=(63, 0), out=out)
    check(q, k, v, out, causal=True, window=(63, 0), attn_mask=mask)


def test_plan_run_with_sinks_and_errors():
    q, k, v = rand(1, 8, 8, 64, 640, 64, torch.bfloat16)
    sinks = torch.randn(8, device="cuda")
    p = attn_lt.plan(q, k, v, causal=True, window=(31, 0), sinks=sinks)
    assert "window(31, -1)" in str(p.case) and "sinks" in str(p.case)
    out = p.run(q, k, v, sinks=sinks)
    check(q, k, v, out, causal=True, window=(31, 0), sinks=sinks)
    with pytest.raises(ValueError, match="with sinks"):
        p.run(q, k, v)
    with pytest.raises(ValueError, match="contiguous"):
        attn_lt.attention(q, k, v, sinks=torch.randn(4, device="cuda"))
    with pytest.raises(TypeError, match="float32"):
        attn_lt.attention(q, k, v, sinks=sinks.half())
    with pytest.raises(ValueError, match="cannot run"):
        attn_lt.attention(q, k, v, window=(31, 0), backend="lt")
    e = attn_lt.explain(q, k, v, window=(31, 0), softcap=30.0)
    assert e.decision.backend == "wmma" and "runs no sliding window / softcap" in str(e), str(e)


def test_decode_loop_with_variants_runs_on_one_plan():
    """gpt-oss-like decode steps (window and sinks) through attention(): the fast path runs them (one plan)."""
    from attn_lt import fastpath

    attn_lt.api.clear_plans()
    sinks = torch.randn(64, device="cuda")
    q = torch.randn(1, 64, 1, 64, dtype=torch.bfloat16, device="cuda")
    kc, vc = (torch.randn(1, 8, 700, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    hits = fastpath.stats()["hits"]
    for n in range(500, 520):
        out = attn_lt.attention(q, kc[:, :, :n], vc[:, :, :n], causal=True, window=(127, 0), sinks=sinks)
    check(q, kc[:, :, :519], vc[:, :, :519], out, causal=True, window=(127, 0), sinks=sinks)
    if fastpath.call is not None:
        assert attn_lt.api.cached_plans() == 1 and fastpath.stats()["hits"] - hits == 19


cu = cu_seqlens


@pytest.mark.parametrize("paged", [False, True], ids=["varlen", "paged"])
def test_batches_with_variants(paged):
    """Varlen and paged batches (prefill rows, decode rows, lengths 0 and 1, a permuted block table) with a window,
    softcap and sinks, each request against the dense reference."""
    torch.manual_seed(3)
    Hq, Hkv, D, bs = 16, 4, 128, 16
    q_lens, k_lens = [200, 1, 0, 1, 37, 1], [900, 1, 5, 300, 37, 0]
    sinks = torch.randn(Hq, device="cuda")
    kw = dict(causal=True, window=(63, 0), softcap=20.0, sinks=sinks)
    q = torch.randn(sum(q_lens), Hq, D, dtype=torch.bfloat16, device="cuda")
    ks = [torch.randn(n, Hkv, D, dtype=torch.bfloat16, device="cuda") for n in k_lens]
    vs = [torch.randn(n, Hkv, D, dtype=torch.bfloat16, device="cuda") for n in k_lens]
    out = torch.full_like(q, math.nan)
    if paged:
        max_blocks = -(-max(k_lens) // bs)
        nb = len(k_lens) * max_blocks
        perm = torch.randperm(nb)
        table = perm.view(len(k_lens), max_blocks).to(torch.int32).cuda()
        k_cache = torch.zeros(nb, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        for b, n in enumerate(k_lens):
            for j in range(n):
                blk = table[b, j // bs].item()
                k_cache[blk, j % bs], v_cache[blk, j % bs] = ks[b][j], vs[b][j]
        attn_lt.paged_attention(q, k_cache, v_cache, table, torch.tensor(k_lens, dtype=torch.int32, device="cuda"),
                                cu_seqlens_q=cu(q_lens), max_seqlen_q=max(q_lens), out=out, check=True, **kw)
    else:
        attn_lt.varlen_attention(q, torch.cat(ks), torch.cat(vs), cu(q_lens), cu(k_lens), max_seqlen_q=max(q_lens),
                                 max_seqlen_k=max(k_lens), out=out, check=True, **kw)
    q0 = 0
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        if nq:
            qb = q[q0:q0 + nq].transpose(0, 1)[None]
            o = out[q0:q0 + nq].transpose(0, 1)[None]
            if nk:
                check(qb, ks[b].transpose(0, 1)[None], vs[b].transpose(0, 1)[None], o, **kw)
            else:
                assert torch.equal(o, torch.zeros_like(o))
        q0 += nq


def test_window_mask_helper():
    m = window_mask(3, 5, (1, 0), causal=True)
    assert m.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                          [False, False, False, True, True]]
    assert device_facts() is not None


def test_torch_compile_with_variants_mass_and_fp8():
    """torch.compile (fullgraph) of attention() with a window, softcap and sinks (gpt-oss's and Gemma 2's layers),
    the mass per key, the (B, S, H, D) output and the FP8 prefill: the same results as the eager calls."""
    B, Hq, Hkv, S, D = 2, 8, 2, 700, 128
    q = torch.randn(B, Hq, S, D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(B, Hkv, S, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    sinks = torch.randn(Hq, device="cuda")
    e4m3, hopper = torch.float8_e4m3fn, device_facts().hopper

    def layers(q, k, v):
        local = attn_lt.attention(q, k, v, causal=True, window=(128, 0), sinks=sinks, out_layout="bshd")
        capped, lse = attn_lt.attention(q, k, v, causal=True, softcap=50.0, return_lse=True)
        _, mass = attn_lt.attention(q, k, v, causal=True, return_key_mass=True, key_mass_window=64)
        if not hopper:  # (the FP8 prefill runs on the Hopper kernel)
            return local, capped, lse, mass
        fp8 = attn_lt.attention(q.to(e4m3), k.to(e4m3), v.to(e4m3), causal=True, q_descale=1.0, k_descale=1.0)
        return local, capped, lse, mass, fp8

    got = torch.compile(layers, fullgraph=True)(q, k, v)
    want = layers(q, k, v)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
