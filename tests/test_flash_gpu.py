"""native/flash.cu, the fused kernel of every GPU: GQA heads folded into rows, the key range split and merged by LSE
(flash-decoding), dense masks of every broadcast shape — forced kernel and split count, against the FP32 reference
with PyTorch's own error as the bound, outputs poisoned first; and the same cases through ``attention()``."""

import pytest
import torch
from conftest import DT, check, rand_qkv

import attn_lt
from attn_lt import fused
from attn_lt.testing import forced_flash, reference, rel_error, sdpa, tolerance
from attn_lt.fused import hopper_kernel

pytestmark = pytest.mark.gpu


def flash(q, k, v, attn_mask=None, causal=False, splits=1):
    """native/flash.cu forced, ``splits`` parts of the key range; returns (out, lse), both poisoned first."""
    run, out, lse = forced_flash(q, k, v, attn_mask, causal, splits)
    run()
    return out, lse


def check_flash(q, k, v, attn_mask=None, causal=False, splits=1):
    o, lse = flash(q, k, v, attn_mask, causal, splits)
    ref, ref_lse = reference(q, k, v, attn_mask, causal)
    # SDPA's memory-efficient kernel faults on a bf16 mask view at a 6-byte offset: it gets an aligned copy
    m = None if attn_mask is None else attn_mask.clone()
    err, torch_err = rel_error(o, ref), rel_error(sdpa(q, k, v, m, causal), ref)
    assert err <= tolerance(torch_err), f"flash error {err:.3e}, PyTorch {torch_err:.3e}"
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 * (1 + ref_lse[fin].abs().max().item())
    return o, lse


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("Sk", [1, 97, 4095, 4097, 33000])
@pytest.mark.parametrize("Sq,Hkv", [(1, 32), (1, 8), (1, 1), (4, 8), (16, 8), (16, 32)])
def test_decode_splits(Sq, Hkv, Sk, splits):
    check_flash(*rand_qkv(2, 32, Hkv, Sq, Sk, 128, "bf16"), causal=Sq > 1, splits=splits)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Sk", [(1, 4096), (17, 1000), (97, 4097), (1000, 1000), (4095, 333)])
def test_sizes_and_head_dims(Sq, Sk, D, dtype):
    check_flash(*rand_qkv(1, 8, 2, Sq, Sk, D, dtype), splits=1 if Sq * 4 > 64 else 4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", [(300, 97), (97, 300), (1000, 4096), (64, 64)])
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["mha", "gqa4", "mqa8"])
def test_gqa_folding_and_causal(Hkv, Sq, Sk, causal):
    check_flash(*rand_qkv(2, 8, Hkv, Sq, Sk, 128, "bf16"), causal=causal, splits=2)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq,Hkv,Sk,splits", [(1, 8, 4097, 1), (1, 8, 9000, 3), (16, 8, 3000, 2), (200, 8, 1500, 1)])
def test_scores_growing_along_the_keys(Sq, Hkv, Sk, D, splits):
    """Keys whose scale grows along the sequence (scores up to ~40 in the exp2 domain), so that rows pass their
    softmax reference many times, by small steps and by large ones, on tiles after the first."""
    q, k, v = rand_qkv(2, 32, Hkv, Sq, Sk, D, "bf16")
    ramp = torch.linspace(0.2, 4.0, Sk, device=k.device) ** 2
    k = (k.float() * ramp[:, None]).to(k.dtype)
    check_flash(q, k, v, causal=Sq > 1, splits=splits)


def test_views():
    check_flash(*rand_qkv(2, 8, 2, 7, 5000, 64, "fp16", layout="bshd"), causal=True, splits=5)


def _mask(kind, shape, dtype):
    if kind == "bool":
        return torch.rand(shape, device="cuda") > 0.3
    return (torch.randn(shape, device="cuda") * 2).to(DT.get(dtype, torch.float32) if kind == "q" else torch.float32)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("splits", [29, 37, 133])
def test_merge_of_many_splits(D, splits):
    """The LSE merge with each of its warps holding several splits (29, 37) and more than 32 a warp (133, most of
    them with no key at all: LSE -inf, weighing nothing), causal too."""
    check_flash(*rand_qkv(1, 8, 2, 1, 4160, D, "bf16"), splits=splits)
    check_flash(*rand_qkv(1, 4, 4, 3, 1000, D, "bf16"), causal=True, splits=splits)


@pytest.mark.parametrize("kind", ["bool", "fp32", "q"])
@pytest.mark.parametrize("shape", ["B1SqSk", "11SqSk", "B11Sk", "BHSqSk", "11Sk-view"])
@pytest.mark.parametrize("Sq,Sk,splits", [(1, 4097, 6), (16, 2000, 3), (300, 1000, 1)])
def test_masks_every_broadcast_shape(kind, shape, Sq, Sk, splits):
    B, Hq, Hkv = 2, 8, 2
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, 128, "bf16")
    full = {"B1SqSk": (B, 1, Sq, Sk), "11SqSk": (1, 1, Sq, Sk), "B11Sk": (B, 1, 1, Sk), "BHSqSk": (B, Hq, Sq, Sk),
            "11Sk-view": (1, 1, Sq, Sk + 8)}[shape]
    m = _mask(kind, full, "bf16")
    if shape == "11Sk-view":
        m = m[..., 3:Sk + 3]  # a strided view: rows of Sk + 8, offset 3
    check_flash(q, k, v, attn_mask=m, causal=Sq > 1 and Sq <= Sk, splits=splits)


@pytest.mark.parametrize("D,dtype", [(64, "bf16"), (128, "fp16"), (256, "bf16")])
@pytest.mark.parametrize("kind", ["bool", "fp32", "q"])
@pytest.mark.parametrize("Sq,Hkv,Sk,splits,per_head", [(1, 8, 4112, 5, False), (4, 2, 1040, 1, True),
                                                         (16, 8, 208, 2, False)])
def test_decode_masks_staged_with_the_key_tiles(D, dtype, kind, Sq, Hkv, Sk, splits, per_head):
    """Decode blocks (16 rows or fewer a kv head) copy mask rows that are 16-byte aligned into shared memory with
    each K/V tile; the key tail of the last tile and the rows past the end are zero-filled."""
    B, Hq = 2, 8
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, dtype)
    m = _mask(kind, (B, Hq if per_head else 1, Sq, Sk), dtype)
    check_flash(q, k, v, attn_mask=m, splits=splits)


@pytest.mark.parametrize("kind", ["bool", "q"])
@pytest.mark.parametrize("Hq,Hkv,Sq,Sk,causal,splits", [(32, 8, 16, 4160, False, 3), (16, 2, 5, 1040, False, 1),
                                                        (12, 2, 100, 640, True, 1), (8, 2, 30, 2048, False, 2),
                                                        (8, 4, 40, 512, False, 1)])
def test_group_masks_staged_by_position(kind, Hq, Hkv, Sq, Sk, causal, splits):
    """64-row blocks whose mask the heads of a group share ((B, 1, Sq, Sk), group of 4 or more) stage one mask row
    per query position with each K/V tile, also when a block's rows straddle positions (group 6); a group of 2
    reads the mask element by element."""
    q, k, v = rand_qkv(2, Hq, Hkv, Sq, Sk, 128, "bf16")
    check_flash(q, k, v, attn_mask=_mask(kind, (2, 1, Sq, Sk), "bf16"), causal=causal, splits=splits)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["bool", "q", "fp32"])
@pytest.mark.parametrize("Hq,Hkv,Sq,Sk,causal,shape", [(4, 4, 1024, 1024, False, "B1"), (4, 4, 200, 1040, True, "B1"),
                                                       (8, 2, 97, 528, False, "BH"), (2, 2, 300, 4112, True, "11")])
def test_prefill_masks_staged_by_row(D, kind, Hq, Hkv, Sq, Sk, causal, shape):
    """64-row blocks whose rows need their own mask rows (no group of 4 sharing them) stage the block's 64 rows
    when an element takes at most 2 bytes (fp32 masks: read by strides); key tails, causal, a mask per head."""
    B = 2
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, "fp16" if D == 64 else "bf16")
    full = {"B1": (B, 1, Sq, Sk), "BH": (B, Hq, Sq, Sk), "11": (1, 1, Sq, Sk)}[shape]
    check_flash(q, k, v, attn_mask=_mask(kind, full, "fp16" if D == 64 else "bf16"), causal=causal)


def test_all_masked_rows_give_zeros_and_minus_inf():
    q, k, v = rand_qkv(1, 4, 2, 16, 3000, 64, "bf16")
    m = torch.rand(1, 1, 16, 3000, device="cuda") > 0.5
    m[..., 5, :] = False
    m[..., 6, 1000:] = False  # every split but the first sees nothing of row 6
    o, lse = check_flash(q, k, v, attn_mask=m, splits=4)
    assert (o[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()


@pytest.mark.parametrize("Sq,Hkv,Sk", [(1, 8, 32768), (1, 32, 8192), (16, 8, 20000), (1, 1, 100000)])
def test_decode_through_attention(Sq, Hkv, Sk):
    """The production call: auto-planned splits, the shared scratch, and the fused path's explanation."""
    q, k, v = rand_qkv(2, 32, Hkv, Sq, Sk, 128, "bf16")
    check(q, k, v, causal=Sq > 1, backend="wmma")
    e = attn_lt.explain(q, k, v, causal=Sq > 1, backend="wmma")
    rows = Sq * 32 // Hkv  # 32 to 64 rows a kv head: the Hopper decode kernel there
    hopper = hopper_kernel() and fused.SM90_DECODE_MIN_ROWS <= rows <= fused.DECODE_ROWS
    kernel, name = ("sm90_decode", "flash_sm90.cu's decode kernel") if hopper else ("flash", "flash.cu")
    assert e.fused is not None and e.fused.kernel == kernel and name in str(e), str(e)


def test_masked_prefill_through_attention():
    q, k, v = rand_qkv(1, 8, 8, 1024, 1024, 128, "bf16")
    bias = torch.randn(1, 1, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    check(q, k, v, attn_mask=bias, backend="wmma")
    # on Hopper the wgmma kernel reads this mask by TMA; elsewhere native/flash.cu runs it
    want = "sm90" if hopper_kernel() else "flash"
    assert attn_lt.explain(q, k, v, attn_mask=bias, backend="wmma").fused.kernel == want
    fp32 = torch.randn(1, 1, 1024, 1024, device="cuda")  # an fp32 mask: native/flash.cu on every GPU
    check(q, k, v, attn_mask=fp32, backend="wmma")
    assert attn_lt.explain(q, k, v, attn_mask=fp32, backend="wmma").fused.kernel == "flash"


def test_graph_capture_of_a_split_decode():
    q, k, v = rand_qkv(1, 32, 8, 1, 16384, 128, "bf16")
    p = attn_lt.plan(q, k, v, backend="wmma")
    assert p.fused.splits > 1 and p.workspace_bytes > 0
    out = torch.empty(1, 32, 1, 128, dtype=q.dtype, device="cuda")
    p.run(q, k, v, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        p.run(q, k, v, out=out)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        g.replay()
        ref, _ = reference(q, k, v)
        assert rel_error(out, ref) <= tolerance(rel_error(sdpa(q, k, v), ref))


@pytest.mark.parametrize("Sq,Hq,causal", [(1, 32, False), (8, 32, True), (16, 32, False)],
                         ids=["decode", "sq8-causal-sm90-decode", "sq16"])
def test_a_decode_loop_runs_on_one_plan_across_the_split_cuts(Sq, Hq, causal):
    """The kernels take the key length as data: the launcher cuts the plan's key split (planned for long keys) to
    the parts each call's keys fill, so one plan runs a decode loop's every step (through the compiled fast path,
    where it is built: the plan cache keeps one plan), correct on each side of every cut (multiples of 256 keys) and
    at one key."""
    from attn_lt import fastpath

    attn_lt.api.clear_plans()
    q = torch.randn(2, Hq, Sq, 128, dtype=torch.bfloat16, device="cuda")
    kc, vc = (torch.randn(2, 8, 9000, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    first = 8193
    attn_lt.attention(q, kc[:, :, :first], vc[:, :, :first], causal=causal, backend="wmma")
    n, hits = attn_lt.api.cached_plans(), fastpath.stats()["hits"]
    lengths = (Sq, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, 8999)
    for Sk in lengths:
        k, v = kc[:, :, :Sk], vc[:, :, :Sk]
        out = attn_lt.attention(q, k, v, causal=causal, backend="wmma")
        ref, _ = reference(q, k, v, causal=causal)
        assert rel_error(out, ref) <= tolerance(rel_error(sdpa(q, k, v, causal=causal), ref)), Sk
    if fastpath.call is not None:
        assert attn_lt.api.cached_plans() == n and fastpath.stats()["hits"] - hits == len(lengths)


@pytest.mark.parametrize("backend", ["wmma", "auto"])
def test_growing_kv_cache_stays_correct(backend):
    """A decode loop over a static cache (views of growing length, fixed strides) and over a cache that is
    reallocated each step (new strides): every step correct, whichever plan runs it."""
    q = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
    kc, vc = (torch.randn(2, 8, 9000, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for n in (4000, 4001, 4002, 4100, 8191, 8999, 1):
        k, v = kc[:, :, :n], vc[:, :, :n]
        for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
            out = attn_lt.attention(q, kk, vv, backend=backend)
            ref, _ = reference(q, kk, vv)
            assert rel_error(out, ref) <= tolerance(rel_error(sdpa(q, kk, vv), ref)), n
