"""The Hopper fused kernel (native/flash_sm90.cu: TMA + mbarrier ring + wgmma, producer/consumer warpgroups),
called through its launcher directly, against the FP32 reference: the output error must stay within twice
PyTorch's own error at the same precision plus a rounding floor; outputs and LSE are poisoned with NaN first, inputs
are fresh random numbers every case.

The tests go from the simplest case to the most involved one, so the first failure names the feature that broke:
a single tile (a, both pipeline variants) -> several key tiles and query blocks (b) -> the lengths (c: key tails,
query tails) -> causal with Sq != Sk both ways (d) -> GQA (e) -> strided views (f) -> long (g) -> dense masks read
by TMA (h) -> MLA prefill's head dims, q/k 192 and v 128 (i) -> MLA decode, v in k's memory (j) -> the decode
kernel, 64-row blocks of query positions x heads with the keys in parts (k) -> the rest.
"""

import math
import shutil
import subprocess

import pytest
import torch
from conftest import DT, rand_qkv

from attn_lt import native
from attn_lt.testing import reference, rel_error, sdpa, tolerance

gpu = pytest.mark.gpu
VARIANTS = ["default", "plain"]  # the prefill pipelines: overlapped with ping-pong, and plain


def sm90_attention(q, k, v, causal=False, scale=None, variant="default", out=None, with_lse=True, mask=None):
    """(out, lse) of the Hopper kernel on (B, Hq, Sq, D) q, (B, Hkv, Sk, D) k and (B, Hkv, Sk, Dv) v (any strides
    the launcher accepts), with an optional bool or q-dtype mask broadcast to (B, Hq, Sq, Sk); out (B, Hq, Sq, Dv)
    and lse FP32 (B, Hq, Sq) are poisoned with NaN before the call."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = torch.empty(B, Hq, Sq, Dv, dtype=q.dtype, device=q.device)
    out.fill_(math.nan)
    lse = torch.full((B, Hq, Sq), math.nan, dtype=torch.float32, device=q.device) if with_lse else None
    a = native.FlashArgs()
    a.q, a.k, a.v, a.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    a.lse = lse.data_ptr() if with_lse else None
    a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D, a.Dv = B, Hq, Hkv, Sq, Sk, D, Dv
    a.q_sb, a.q_sh, a.q_ss = q.stride()[:3]
    a.k_sb, a.k_sh, a.k_ss = k.stride()[:3]
    a.v_sb, a.v_sh, a.v_ss = v.stride()[:3]
    a.o_sb, a.o_sh, a.o_ss = out.stride()[:3]
    a.scale = D**-0.5 if scale is None else scale
    a.causal, a.dtype = int(causal), native.DTYPE_CODES["bf16" if q.dtype == torch.bfloat16 else "fp16"]
    a.variant = native.FLASH_SM90_VARIANTS[variant]
    if mask is not None:
        shape = (B, Hq, Sq, Sk)
        a.mask = mask.data_ptr()
        a.mask_dtype = native.DTYPE_CODES["bool" if mask.dtype == torch.bool else a_dtype(mask)]
        a.m_sb, a.m_sh, a.m_sq, a.m_sk = (st if n > 1 else 0 for st, n in zip(mask.expand(shape).stride(), shape))
    native.flash_sm90(a, torch.cuda.current_stream().cuda_stream)
    return out, lse


def a_dtype(t):
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[t.dtype]


def check(q, k, v, causal=False, scale=None, variant="default", rows=None, out=None, mask=None):
    """Run the kernel and compare out and LSE with the FP32 reference (on ``rows`` only, when given)."""
    o, lse = sm90_attention(q, k, v, causal, scale, variant, out=out, mask=mask)
    torch.cuda.synchronize()
    assert not torch.isnan(o).any(), f"{torch.isnan(o).sum().item()} output elements unwritten or NaN"
    assert not torch.isnan(lse).any(), f"{torch.isnan(lse).sum().item()} LSE elements unwritten or NaN"
    ref, ref_lse = reference(q, k, v, mask, causal, scale, rows=rows)
    # SDPA's memory-efficient kernel wants an aligned, contiguous mask: it gets a copy
    theirs = sdpa(q, k, v, None if mask is None else mask.contiguous(), causal, scale)
    o_c, lse_c = (o, lse) if rows is None else (o[:, :, rows], lse[:, :, rows])
    if rows is not None:
        theirs = theirs[:, :, rows]
    err, torch_err = rel_error(o_c, ref), rel_error(theirs, ref)
    assert err <= tolerance(torch_err), f"sm90 error {err:.3e}, PyTorch {torch_err:.3e}"
    assert torch.equal(torch.isneginf(lse_c), torch.isneginf(ref_lse)), "LSE -inf rows differ from the reference"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        dl = (lse_c[fin] - ref_lse[fin]).abs().max().item()
        assert dl <= 1e-3 * (1 + ref_lse[fin].abs().max().item()), f"LSE off by {dl:.3e}"
    return o, lse


# ---- a0: diagnostics that separate the two GEMMs ----------------------------------------------------------------

@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_a0_uniform_attention_checks_pv_alone(sm90, D):
    # q = 0: every score is 0 whatever the Q/K layouts, P is uniform, O = the mean of the V rows (PV and V's
    # N-major descriptor alone; exact up to bf16 rounding of 1/Sk and the sum).
    _, k, v = rand_qkv(1, 1, 1, 128, 128, D, "bf16")
    q = torch.zeros(1, 1, 128, D, dtype=torch.bfloat16, device="cuda")
    o, lse = sm90_attention(q, k, v, variant="plain")
    want = v.float().mean(dim=2, keepdim=True).expand_as(o)
    assert rel_error(o, want) < 1e-2, f"PV wrong: error {rel_error(o, want):.3e}"
    assert torch.allclose(lse, torch.full_like(lse, math.log(128)), atol=1e-4)


@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_a0_identity_values_check_qk_and_softmax(sm90, D):
    # v = identity (Sk = 64 keys <= D): O[:, :Sk] = P, symmetric in V's layout, so QK^T, the mask of the key tail
    # and the softmax are checked on their own.
    q, k, _ = rand_qkv(1, 1, 1, 128, 64, D, "bf16")
    v = torch.eye(64, D, dtype=torch.bfloat16, device="cuda")[None, None]
    o, lse = sm90_attention(q, k, v, variant="plain")
    p = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * D**-0.5, dim=-1)
    assert rel_error(o[..., :64], p) < 2e-2, f"QK^T/softmax wrong: error {rel_error(o[..., :64], p):.3e}"
    assert (o[..., 64:] == 0).all()


# ---- a: one tile (128 queries x one key tile), both pipelines -----------------------------------------------------

@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_a_single_tile(sm90, D, variant):
    n = 64 if D == 256 else 128  # one key tile of the kernel
    check(*rand_qkv(1, 1, 1, 128, n, D, "bf16"), variant=variant)


# ---- b: several key tiles and query blocks, no tails --------------------------------------------------------------

@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Sq,Sk", [(256, 512), (384, 1024)], ids=lambda s: str(s))
def test_b_multi_tile(sm90, Sq, Sk, D, variant):
    check(*rand_qkv(2, 2, 2, Sq, Sk, D, "bf16"), variant=variant)


# ---- c: lengths (key tails, query tails, a single query) -------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("S", [1, 17, 97, 1000, 4095, 4096, 4097], ids=lambda s: f"s{s}")
def test_c_sizes(sm90, S, D, dtype):
    check(*rand_qkv(2, 4, 4, S, S, D, dtype))


@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Sq,Sk", [(1, 4097), (4097, 1), (17, 333), (333, 17)], ids=lambda s: str(s))
def test_c_unequal_lengths(sm90, Sq, Sk, D):
    check(*rand_qkv(2, 2, 2, Sq, Sk, D, "fp16"))


# ---- d: causal, bottom-right aligned, Sq != Sk both ways --------------------------------------------------------

@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Sq,Sk", [(128, 128), (1000, 1000), (97, 4000), (1, 2048), (16, 333), (300, 97),
                                   (4095, 4097), (4097, 4095)], ids=lambda s: str(s))
def test_d_causal(sm90, Sq, Sk, D, variant):
    check(*rand_qkv(2, 2, 2, Sq, Sk, D, "bf16"), causal=True, variant=variant)


@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_d_causal_rows_without_keys_give_zero_and_neg_inf(sm90, D):
    q, k, v = rand_qkv(1, 4, 2, 300, 97, D, "bf16")
    o, lse = check(q, k, v, causal=True)
    assert (o[:, :, :203] == 0).all() and torch.isneginf(lse[:, :, :203]).all()
    assert torch.isfinite(lse[:, :, 203:]).all()


# ---- e: GQA (kv head = q head / (Hq / Hkv)), no copies ----------------------------------------------------------

@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (300, 1500)], ids=lambda s: str(s))
def test_e_gqa(sm90, Sq, Sk, Hkv, D, causal):
    check(*rand_qkv(2, 8, Hkv, Sq, Sk, D, "bf16"), causal=causal)


# ---- f: strided views read in place ------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Hkv,causal", [(8, False), (2, True)], ids=["mha-full", "gqa4-causal"])
def test_f_bshd_transposed_views(sm90, Hkv, causal, D):
    q, k, v = rand_qkv(2, 8, Hkv, 1000, 2000, D, "fp16", layout="bshd")
    out = torch.empty(2, 1000, 8, D, dtype=q.dtype, device="cuda").transpose(1, 2)  # a (B, S, H, D) output too
    o, _ = check(q, k, v, causal=causal, out=out)
    assert o.data_ptr() == out.data_ptr()


@gpu
def test_f_packed_qkv_views(sm90):
    # q, k, v sliced out of one (B, S, 3, H, D) projection: row stride 3 * H * D, head stride D.
    qkv = torch.randn(2, 777, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    check(q, k, v, causal=True)


@gpu
def test_f_custom_scale_and_no_lse(sm90):
    q, k, v = rand_qkv(1, 2, 2, 500, 700, 128, "bf16")
    check(q, k, v, scale=0.3)
    o, lse = sm90_attention(q, k, v, with_lse=False)
    assert lse is None and not torch.isnan(o).any()


# ---- g: long ------------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_g_long_16384(sm90, D, causal):
    q, k, v = rand_qkv(1, 2, 2, 16384, 16384, D, "bf16")
    rows = torch.cat([torch.arange(0, 300), torch.randint(300, 16084, (700,)), torch.arange(16084, 16384)])
    check(q, k, v, causal=causal, rows=rows.cuda())


@gpu
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,causal,variant", [
    (4, 8, 2, 1100, 700, 128, True, "default"),    # causal pairs of an odd count of query blocks (9), GQA, Sq > Sk
    (3, 16, 16, 500, 500, 64, False, "plain"),     # more items than SMs, the plain pipeline
    (2, 8, 4, 1030, 1500, 256, True, "default"),   # O staged in the Q tile (D 256)
    (1, 2, 1, 300, 300, 128, True, "default"),     # fewer items than SMs
    (2, 4, 2, 2048, 2048, 192, True, "default"),   # MLA prefill's head dims (O in the Q tile)
], ids=str)
def test_g_persistent_items_equal_grid(sm90, B, Hq, Hkv, Sq, Sk, D, causal, variant):
    """Persistent CTAs (calls without a mask: one CTA an SM taking items in rounds, causal blocks in pairs) give
    the reference's values and the grid variant's bits (a CTA an item)."""
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, "bf16")
    if D == 192:
        v = v[..., :128].contiguous()
    o, lse = check(q, k, v, causal=causal, variant=variant)
    if variant == "default":  # (the grid variant runs the default pipeline)
        o_grid, lse_grid = sm90_attention(q, k, v, causal, variant="grid")
        torch.cuda.synchronize()
        assert torch.equal(o, o_grid) and torch.equal(lse, lse_grid)


@gpu
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,dtype,causal", [
    (1, 4, 2, 97, 8321, 64, "bf16", False),     # 192-key tiles: a key tail of 65 in the first tile visited, GQA
    (2, 2, 1, 300, 8257, 64, "fp16", False),    # a key tail of 1
    (1, 4, 4, 1, 9000, 64, "bf16", False),      # one query row
    (1, 2, 1, 700, 8193, 64, "bf16", True),     # causal from 8192 keys, Sq < Sk
    (1, 4, 2, 513, 4160, 128, "bf16", False),   # 176-key tiles: a key tail of 112
    (2, 2, 1, 129, 4225, 128, "fp16", False),   # a key tail of 1
    (1, 8, 2, 1100, 4097, 128, "bf16", False),  # a partial last query block (1100 rows), GQA 4
    (3, 16, 4, 300, 8300, 64, "bf16", False),   # more items than SMs: O's own tile and the deferred epilogue
    (2, 16, 4, 700, 4200, 128, "fp16", False),  # more items than SMs, O staged in the Q tile
    (1, 2, 2, 8300, 8300, 128, "fp16", True),   # causal, the diagonal across 176-key tiles
], ids=str)
def test_g_wide_key_tiles(sm90, B, Hq, Hkv, Sq, Sk, D, dtype, causal):
    """Calls without a window or mask from 8192 keys (D 64) or 4096 (D 128), causal ones from 8192, run on 192- or
    176-key tiles (native/flash_sm90.cu's Cfg): key tails inside a tile, the causal diagonal, Sq != Sk, GQA, fp16
    and bf16, persistent CTAs taking several items; the grid variant gives the same bits."""
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, dtype)
    o, lse = check(q, k, v, causal=causal)
    o_grid, lse_grid = sm90_attention(q, k, v, causal, variant="grid")
    torch.cuda.synchronize()
    assert torch.equal(o, o_grid) and torch.equal(lse, lse_grid)


# ---- h: dense masks (bool, or additive in q's dtype), read by TMA with each K tile --------------------------------

def make_mask(kind, shape, dtype, pad=16, offset=0):
    """A random mask of ``shape`` in rows of Sk rounded up to ``pad`` elements (a view, so that key tails of any
    length keep 16-byte aligned rows), starting ``offset`` elements into the row; bool: about 70 % True, else
    N(0, 2) additive values in ``dtype``."""
    *lead, Sk = shape
    width = -(-(Sk + offset) // pad) * pad
    if kind == "bool":
        m = torch.rand(*lead, width, device="cuda") > 0.3
    else:
        m = (torch.randn(*lead, width, device="cuda") * 2).to(DT[dtype])
    return m[..., offset:offset + Sk]


MASK_SHAPES = {"B1SqSk": lambda B, H, Sq, Sk: (B, 1, Sq, Sk), "11SqSk": lambda B, H, Sq, Sk: (1, 1, Sq, Sk),
               "B11Sk": lambda B, H, Sq, Sk: (B, 1, 1, Sk), "BHSqSk": lambda B, H, Sq, Sk: (B, H, Sq, Sk),
               "1HSqSk": lambda B, H, Sq, Sk: (1, H, Sq, Sk), "SqSk": lambda B, H, Sq, Sk: (Sq, Sk)}


@gpu
@pytest.mark.parametrize("kind", ["bool", "q"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
def test_h_masks_every_broadcast_shape(sm90, shape, D, kind):
    B, Hq, Hkv, Sq, Sk = 2, 4, 2, 300, 1000  # key tails of the 128- and 64-key tiles, a query tail
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, "bf16")
    check(q, k, v, mask=make_mask(kind, MASK_SHAPES[shape](B, Hq, Sq, Sk), "bf16"))


@gpu
@pytest.mark.parametrize("kind", ["bool", "q"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (97, 4000), (4097, 4095), (1, 2048), (17, 333)],
                         ids=lambda s: str(s))
def test_h_masks_with_causal_and_lengths(sm90, Sq, Sk, D, dtype, kind):
    q, k, v = rand_qkv(2, 4, 4, Sq, Sk, D, dtype)
    check(q, k, v, causal=True, mask=make_mask(kind, (2, 1, Sq, Sk), dtype))


@gpu
@pytest.mark.parametrize("shape", ["11SqSk", "BHSqSk"])
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
def test_h_masks_with_gqa_and_views(sm90, Hkv, shape):
    # a mask shared by the heads runs groups of heads side by side (a 1-D grid over heads x blocks); one per
    # head does not
    q, k, v = rand_qkv(2, 8, Hkv, 700, 1500, 128, "fp16", layout="bshd")
    m = make_mask("q", MASK_SHAPES[shape](2, 8, 700, 1500), "fp16", pad=64, offset=8)  # a 16-byte offset view
    check(q, k, v, mask=m, causal=Hkv == 2)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_h_head_groups_with_a_partial_last_group(sm90, D, causal):
    # 9 heads sharing the mask run in groups of 8 (or 4 on GPUs with fewer SMs at D 256): the last group has one
    q, k, v = rand_qkv(2, 9, 3, 1100, 900, D, "bf16")
    check(q, k, v, causal=causal, mask=make_mask("q", (2, 1, 1100, 900), "bf16"))


@gpu
@pytest.mark.parametrize("kind", ["bool", "q"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_h_masked_rows_give_zeros_and_minus_inf(sm90, D, kind):
    q, k, v = rand_qkv(1, 2, 2, 256, 640, D, "bf16")
    m = make_mask(kind, (1, 1, 256, 640), "bf16")
    none = False if kind == "bool" else -math.inf
    m[..., 5, :] = none                   # a row that sees nothing
    m[..., 130, :600] = none              # a row whose only keys are in the last (first visited) tile
    m[..., 200, 64:] = none               # a row whose only keys are in the first (last visited) tile
    o, lse = check(q, k, v, mask=m)
    assert (o[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all()
    assert torch.isfinite(lse[:, :, 130]).all() and torch.isfinite(lse[:, :, 200]).all()


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_h_long_bias_16384(sm90, D, causal):
    q, k, v = rand_qkv(1, 2, 2, 16384, 16384, D, "bf16")
    m = make_mask("q", (16384, 16384), "bf16")
    rows = torch.cat([torch.arange(0, 300), torch.randint(300, 16084, (700,)), torch.arange(16084, 16384)])
    check(q, k, v, causal=causal, rows=rows.cuda(), mask=m)


@gpu
def test_h_masked_prefill_through_attention(sm90):
    import attn_lt

    q, k, v = rand_qkv(2, 8, 2, 1000, 1500, 128, "bf16")
    m = make_mask("bool", (2, 1, 1000, 1500), "bf16")
    e = attn_lt.explain(q, k, v, attn_mask=m, backend="wmma")
    assert e.fused.kernel == "sm90" and "a mask read by TMA" in e.fused.why
    out = torch.full_like(q, math.nan)
    o = attn_lt.attention(q, k, v, attn_mask=m, backend="wmma", out=out)
    ref, _ = reference(q, k, v, m)
    assert rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, m.contiguous()), ref))
    fp32 = torch.randn(1000, 1500, device="cuda")  # fp32 masks stay with native/flash.cu
    assert attn_lt.explain(q, k, v, attn_mask=fp32, backend="wmma").fused.kernel == "flash"


# ---- i: MLA prefill (q/k head dim 192, v's 128): Q and K tiles 192 wide, V and O tiles 128 -------------------------

def rand_mla(B, Hq, Hkv, Sq, Sk, dtype="bf16"):
    q, k, _ = rand_qkv(B, Hq, Hkv, Sq, Sk, 192, dtype)
    return q, k, torch.randn(B, Hkv, Sk, 128, device="cuda").to(DT[dtype])


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("Sq,Sk", [(128, 128), (384, 1024)], ids=lambda s: str(s))
def test_i_mla_tiles(sm90, Sq, Sk, variant):
    check(*rand_mla(2, 4, 4, Sq, Sk), variant=variant)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("S", [1, 97, 4095, 4096, 4097], ids=lambda s: f"s{s}")
def test_i_mla_sizes(sm90, S, dtype):
    check(*rand_mla(1, 4, 4, S, S, dtype))


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (97, 4000), (300, 97), (1, 2048)], ids=lambda s: str(s))
def test_i_mla_causal(sm90, Sq, Sk, variant):
    check(*rand_mla(1, 4, 4, Sq, Sk), causal=True, variant=variant)


@gpu
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
def test_i_mla_gqa_and_packed_views(sm90, Hkv):
    # k = [k_nope | k_rope] and v side by side in one (B, S, H, 320) projection, read in place
    B, Hq, S = 2, 8, 1000
    q = torch.randn(B, S, Hq, 192, device="cuda").to(torch.bfloat16).transpose(1, 2)
    kv = torch.randn(B, S, Hkv, 320, device="cuda").to(torch.bfloat16).transpose(1, 2)
    check(q, kv[..., :192], kv[..., 192:], causal=True)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_i_mla_long_16384(sm90, causal):
    q, k, v = rand_mla(1, 2, 2, 16384, 16384)
    rows = torch.cat([torch.arange(0, 300), torch.randint(300, 16084, (700,)), torch.arange(16084, 16384)])
    check(q, k, v, causal=causal, rows=rows.cuda())


@gpu
def test_i_mla_through_attention(sm90):
    import attn_lt

    q, k, v = rand_mla(1, 16, 16, 2048, 2048)
    e = attn_lt.explain(q, k, v, causal=True)
    assert e.decision.backend == "wmma" and e.fused.kernel == "sm90", str(e)
    out = torch.full((1, 16, 2048, 128), math.nan, dtype=q.dtype, device="cuda")
    o = attn_lt.attention(q, k, v, causal=True, out=out)
    ref, _ = reference(q, k, v, causal=True)
    assert o is out and rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, causal=True), ref))
    # what the Hopper kernel has no build for goes to the long path, and explain says why
    m = torch.rand(2048, 2048, device="cuda") > 0.3
    e = attn_lt.explain(q, k, v, attn_mask=m)
    assert e.decision.backend == "lt" and "no masked build" in str(e), str(e)
    e = attn_lt.explain(q[:, :, :4], k, v)  # decode-sized: 4 rows a kv head
    assert e.decision.backend == "lt" and "more than 64 rows a kv head" in str(e), str(e)


# ---- j: MLA decode (q/k head dim 576, v = k's first 512 columns, one query a head), keys split in parts -----------

def rand_latent(B, Hq, Hkv, Sk, dtype="bf16"):
    """q (B, Hq, 1, 576), the latent cache k (B, Hkv, Sk, 576) and v = k[..., :512] (a view, no copy)."""
    q, k, _ = rand_qkv(B, Hq, Hkv, 1, Sk, 576, dtype)
    return q, k, k[..., :512]


def check_mla(q, k, v, splits):
    from attn_lt.testing import forced_flash

    run, out, lse = forced_flash(q, k, v, kernel="sm90", splits=splits)
    run()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref, ref_lse = reference(q, k, v)
    assert rel_error(out, ref) <= tolerance(rel_error(sdpa(q, k, v), ref)), f"error {rel_error(out, ref):.3e}"
    assert (lse - ref_lse).abs().max().item() <= 1e-3 * (1 + ref_lse.abs().max().item())


@gpu
@pytest.mark.parametrize("splits", [1, 2, 7, 12])
@pytest.mark.parametrize("Sk", [1, 63, 64, 97, 1000, 4097], ids=lambda s: f"sk{s}")
def test_j_mla_decode_lengths_and_parts(sm90, Sk, splits):
    # 7 parts of 1 to 17 key tiles: parts without a key (LSE -inf, weight 0) at the short lengths; up to
    # native/common.cuh's kWideMergeMaxSplits parts the wide merge joins them, beyond it the split-parallel one
    check_mla(*rand_latent(2, 128, 1, Sk), splits)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("Hq,Hkv", [(16, 1), (128, 2), (96, 1), (192, 1)], ids=["h16", "h128-kv2", "h96", "h192"])
def test_j_mla_decode_heads(sm90, Hq, Hkv, dtype):
    # 16 heads: one block, 48 rows past the last head; 96: a partial second block; 192: three blocks
    check_mla(*rand_latent(3, Hq, Hkv, 2000, dtype), 3)


@gpu
def test_j_mla_decode_through_attention_and_a_growing_cache(sm90):
    import attn_lt

    B, Hq, cap = 4, 128, 9000
    cache = torch.randn(B, 1, cap, 576, device="cuda").to(torch.bfloat16)
    q = torch.randn(B, Hq, 1, 576, device="cuda").to(torch.bfloat16)
    for n in (8000, 8001, 8064, 8999):  # a decode loop: views of the cache
        k = cache[:, :, :n]
        e = attn_lt.explain(q, k, k[..., :512], backend="wmma")
        assert e.fused.kernel == "sm90" and "MLA decode" in e.fused.why, str(e)
        out = torch.full((B, Hq, 1, 512), math.nan, dtype=q.dtype, device="cuda")
        o, lse = attn_lt.attention(q, k, k[..., :512], out=out, return_lse=True, backend="wmma")
        ref, ref_lse = reference(q, k, k[..., :512])
        assert o is out and rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, k[..., :512]), ref))
        assert (lse - ref_lse).abs().max().item() < 1e-2
    # v of its own (not k's memory), or more than one query: the long path, and explain says why
    k = cache[:, :, :4000]
    e = attn_lt.explain(q, k, k[..., :512].contiguous())
    assert e.decision.backend == "lt" and "first 512 columns of k's memory" in str(e), str(e)
    e = attn_lt.explain(torch.randn(B, Hq, 2, 576, device="cuda").to(q.dtype), k, k[..., :512])
    assert e.decision.backend == "lt" and "one query a head" in str(e), str(e)


@pytest.mark.parametrize("bad,check", [(dict(Sq=2), "MLA decode"), (dict(v=1 << 21), "MLA decode"),
                                       (dict(v_ss=512), "MLA decode"), (dict(splits=2), "null"),
                                       (dict(splits=2, o_part=(1 << 20) + 4, lse_part=1 << 20), "aligned"),
                                       (dict(splits=5000, o_part=1 << 20, lse_part=1 << 20), "length")],
                         ids=["two-queries", "v-elsewhere", "v-strides", "no-partials", "partials-4B", "parts"])
@pytest.mark.native
def test_j_mla_decode_refuses_what_is_not_a_latent_cache(bad, check):
    a = _args(D=576, Dv=512, Hq=128, Hkv=1, Sq=1, Sk=1000, q_sb=128 * 576, q_sh=576, q_ss=576, k_sb=1000 * 576,
              k_sh=1000 * 576, k_ss=576, v_sb=1000 * 576, v_sh=1000 * 576, v_ss=576, o_sb=128 * 512, o_sh=512,
              o_ss=512)
    for name, value in bad.items():
        setattr(a, name, value)
    with pytest.raises(native.CudaError, match=f"precondition failed: .*{check}"):
        native.flash_sm90(a, 0)


# ---- k: the decode kernel (64-row blocks of query positions x query heads of one kv head, D 128, keys in parts) ---

def check_decode(q, k, v, splits, causal=False, mask=None):
    from attn_lt.testing import forced_flash

    run, out, lse = forced_flash(q, k, v, mask, causal=causal, kernel="sm90_decode", splits=splits)
    run()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten or NaN output / LSE"
    ref, ref_lse = reference(q, k, v, mask, causal=causal)
    theirs = sdpa(q, k, v, None if mask is None else mask.contiguous(), causal=causal)
    err, torch_err = rel_error(out, ref), rel_error(theirs, ref)
    assert err <= tolerance(torch_err), f"error {err:.3e}, PyTorch {torch_err:.3e}"
    assert (lse - ref_lse).abs().max().item() <= 1e-3 * (1 + ref_lse.abs().max().item())


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("Sk", [16, 97, 4095, 4096, 4097], ids=lambda s: f"sk{s}")
def test_k_decode_lengths_parts_causal(sm90, Sk, splits, causal):
    # Sq 16 x 4 heads a kv head: one 64-row block; 3 parts of 1 to 11 key tiles, parts without a key at sk16/97
    check_decode(*rand_qkv(2, 32, 8, 16, Sk, 128, "bf16"), splits, causal)


@gpu
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq", [(2, 32, 8, 1), (2, 8, 8, 16), (2, 48, 4, 5), (1, 16, 1, 64),
                                         (3, 64, 4, 3), (1, 40, 8, 7)],
                         ids=["sq1-g4", "mha-sq16", "sq5-g12", "sq64-g16", "sq3-g16", "sq7-g5"])
def test_k_decode_rows(sm90, B, Hq, Hkv, Sq, dtype, D):
    # sq_box (Sq rounded up to a power of two) x 64 / sq_box heads a block: rows past Sq zero-filled, partial last
    # head blocks (g12 in blocks of 8, g16 at Sq 64 in blocks of 1), heads of the next kv head computed, not written
    check_decode(*rand_qkv(B, Hq, Hkv, Sq, 3000, D, dtype), 2, causal=True)


@gpu
def test_k_decode_strided_views(sm90):
    # q as transformers makes it ((B, Sq, Hq, D) transposed: heads D apart, positions Hq * D apart); k and v
    # views of a larger cache (first Sk of cap positions) in the (B, S, H, D) layout
    B, Hq, Hkv, Sq, Sk, cap = 2, 32, 8, 16, 3000, 3500
    q = torch.randn(B, Sq, Hq, 128, device="cuda").to(torch.bfloat16).transpose(1, 2)
    kc, vc = (torch.randn(B, cap, Hkv, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    k, v = kc[:, :Sk].transpose(1, 2), vc[:, :Sk].transpose(1, 2)
    check_decode(q, k, v, 4, causal=True)


@gpu
def test_k_decode_through_attention_and_a_growing_cache(sm90):
    import attn_lt

    B, Hq, Hkv, Sq, cap = 4, 32, 8, 16, 9000
    kc, vc = (torch.randn(B, Hkv, cap, 128, device="cuda").to(torch.bfloat16) for _ in range(2))
    for n in (8000, 8016, 8100, 8999):  # speculative decoding's steps: views of the cache
        q = torch.randn(B, Hq, Sq, 128, device="cuda").to(torch.bfloat16)
        k, v = kc[:, :, :n], vc[:, :, :n]
        e = attn_lt.explain(q, k, v, causal=True, backend="wmma")
        assert e.fused.kernel == "sm90_decode" and "decode kernel" in str(e), str(e)
        out = torch.full((B, Hq, Sq, 128), math.nan, dtype=q.dtype, device="cuda")
        o, lse = attn_lt.attention(q, k, v, causal=True, out=out, return_lse=True, backend="wmma")
        ref, ref_lse = reference(q, k, v, causal=True)
        assert o is out and rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, causal=True), ref))
        assert (lse - ref_lse).abs().max().item() < 1e-2


@gpu
@pytest.mark.parametrize("Sq,Hkv", [(48, 8), (64, 8), (32, 32)], ids=["sq48-g4", "sq64-g4", "mha-sq32"])
def test_k_decode_takes_up_to_64_positions_through_attention(sm90, Sq, Hkv):
    # more than 64 rows a kv head (a GQA group in several blocks) with at most 64 positions: the decode kernel
    import attn_lt

    q, k, v = rand_qkv(2, 32, Hkv, Sq, 3000, 128, "bf16")
    e = attn_lt.explain(q, k, v, causal=True, backend="wmma")
    assert e.fused.kernel == "sm90_decode", str(e)
    out = torch.full((2, 32, Sq, 128), math.nan, dtype=q.dtype, device="cuda")
    o, lse = attn_lt.attention(q, k, v, causal=True, out=out, return_lse=True, backend="wmma")
    ref, ref_lse = reference(q, k, v, causal=True)
    assert o is out and rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, causal=True), ref))
    assert (lse - ref_lse).abs().max().item() < 1e-2


@gpu
@pytest.mark.parametrize("kind", ["bool", "q"])
@pytest.mark.parametrize("shape", ["B1SqSk", "11SqSk", "B11Sk"])
@pytest.mark.parametrize("Sk,splits,causal", [(97, 1, False), (4097, 3, True), (3000, 2, False)],
                         ids=["sk97", "sk4097-causal", "sk3000"])
def test_k_decode_masks_its_heads_share(sm90, Sk, splits, causal, shape, kind):
    # the mask's rows of the block's positions (or one row for all) staged with each K/V tile, rows padded to 16
    B, Hq, Hkv, Sq = 2, 32, 8, 16
    dtype = "fp16" if kind == "q" and causal else "bf16"
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, 128, dtype)
    check_decode(q, k, v, splits, causal, make_mask(kind, MASK_SHAPES[shape](B, Hq, Sq, Sk), dtype))


@gpu
@pytest.mark.parametrize("Sq,Hkv", [(5, 4), (1, 1), (8, 8)], ids=["sq5-g8", "sq1-g32", "sq8-g4"])
def test_k_decode_masks_rows_and_positions(sm90, Sq, Hkv):
    # Sq 5: 8-row mask boxes (rows past Sq zero-filled, never written); Sq 1: one mask row; head dim 64 at Sq 8
    q, k, v = rand_qkv(2, 32, Hkv, Sq, 2000, 64 if Sq == 8 else 128, "bf16")
    check_decode(q, k, v, 4, True, make_mask("bool", (2, 1, Sq, 2000), "bf16"))


@pytest.mark.parametrize("bad", [dict(D=256), dict(Dv=64), dict(Sq=65),
                                 dict(mask=1 << 20, mask_dtype=4, m_sh=16 * 1000, m_sq=1000, m_sk=1),
                                 dict(Sq=17, mask=1 << 20, mask_dtype=4, m_sq=1024, m_sk=1)],
                         ids=["d256", "dv64", "sq65", "mask-per-head", "mask-17-rows"])
@pytest.mark.native
def test_k_decode_refuses_what_it_does_not_run(bad):
    a = _args(Sq=16, Sk=1000, variant=native.FLASH_SM90_VARIANTS["decode"])
    for name, value in bad.items():
        setattr(a, name, value)
    with pytest.raises(native.CudaError, match="precondition failed: .*(variant|head dim)"):
        native.flash_sm90(a, 0)


# ---- the rest -----------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
def test_variants_agree(sm90, D):
    q, k, v = rand_qkv(2, 4, 2, 1000, 1500, D, "bf16")
    a, la = sm90_attention(q, k, v, causal=True, variant="default")
    b, lb = sm90_attention(q, k, v, causal=True, variant="plain")
    assert rel_error(a, b.float()) < 1e-2 and (la - lb).abs().max().item() < 1e-3


@gpu
def test_repeatable_bit_for_bit(sm90):
    q, k, v = rand_qkv(2, 8, 2, 1000, 1500, 128, "bf16")
    a, la = sm90_attention(q, k, v, causal=True)
    b, lb = sm90_attention(q, k, v, causal=True)
    assert torch.equal(a, b) and torch.equal(la, lb)


@gpu
def test_runs_on_a_side_stream(sm90):
    q, k, v = rand_qkv(1, 4, 4, 1000, 1000, 64, "bf16")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        o, _ = sm90_attention(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    ref, _ = reference(q, k, v)
    assert rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v), ref))


def _args(**kw):
    a = native.FlashArgs()
    a.q = a.k = a.v = a.o = 1 << 20  # never dereferenced: the launcher refuses before any GPU work
    a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D = 1, 2, 2, 128, 128, 128
    a.q_sb = a.k_sb = a.v_sb = a.o_sb = 2 * 128 * 128
    a.q_sh = a.k_sh = a.v_sh = a.o_sh = 128 * 128
    a.q_ss = a.k_ss = a.v_ss = a.o_ss = 128
    a.scale, a.dtype = 0.125, native.DTYPE_CODES["bf16"]
    for name, value in kw.items():
        setattr(a, name, value)
    return a


@pytest.mark.parametrize("bad,check", [(dict(D=96), "head dim"), (dict(D=512), "head dim"), (dict(Hkv=3), "Hkv"),
                                       (dict(D=192), "head dim"), (dict(Dv=64), "head dim"),  # pairs not built
                                       (dict(D=192, Dv=128, mask=1 << 20, mask_dtype=4, m_sq=128, m_sk=1), "mask"),
                                       (dict(q_ss=100), "stride"), (dict(k_sh=0), "stride"), (dict(o=8), "aligned"),
                                       (dict(dtype=3), "dtype"), (dict(variant=7), "variant"),
                                       (dict(scale=0.0), "scale"), (dict(Sq=0), "size"), (dict(B=70000), "grid"),
                                       (dict(mask_dtype=4), "mask"),  # a bool mask without a pointer
                                       (dict(mask=1 << 20, mask_dtype=3, m_sq=128, m_sk=1), "mask"),  # fp32
                                       (dict(mask=1 << 20, mask_dtype=4, m_sq=100, m_sk=1), "mask"),  # row stride
                                       (dict(mask=1 << 20, mask_dtype=2, m_sq=128, m_sk=2), "mask"),  # keys
                                       (dict(mask=(1 << 20) + 8, mask_dtype=2, m_sq=128, m_sk=1), "mask"),
                                       (dict(mask=1 << 20, mask_dtype=2, m_sq=128, m_sk=1, variant=1), "variant")],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) if isinstance(d, dict) else d)
@pytest.mark.native
def test_invalid_arguments_refused_before_any_gpu_work(bad, check):
    """Each failed precondition is a status that names the check (native/attn_lt.h, attn_lt_status)."""
    with pytest.raises(native.CudaError, match=f"precondition failed: .*{check}"):
        native.flash_sm90(_args(**bad), 0)


@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not on PATH")
def test_library_holds_sm90a_code_with_wgmma():
    path = str(native.library_path())
    elf = subprocess.run(["cuobjdump", "--list-elf", path], capture_output=True, text=True, check=True).stdout
    assert "sm_90a" in elf
    sass = subprocess.run(["cuobjdump", "--dump-sass", path], capture_output=True, text=True)
    if sass.returncode == 0:  # needs nvdisasm too
        assert "HGMMA" in sass.stdout and "UTMALDG" in sass.stdout and "USETMAXREG" in sass.stdout


@pytest.mark.native
def test_not_supported_without_an_sm90_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has an sm_90 GPU")
    assert not native.flash_sm90_supported()
    with pytest.raises(native.CudaError):
        native.flash_sm90(_args(), 0)
