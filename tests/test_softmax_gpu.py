"""The native softmax kernel alone, every variant, against torch in float64: P, LSE, causal limits, masks,
fully masked rows, in place and out of place."""

import math

import pytest
import torch

from attn_lt import native

pytestmark = pytest.mark.gpu


def run_softmax(scores, *, variant, out_dtype=torch.bfloat16, in_place=True, causal=False, Sq=None, Sk=None,
                mask=None):
    """scores: (batch, rows, ld) FP32 with `cols` = Sk valid columns; one query head per entry (g = 1)."""
    batch, rows, ld = scores.shape
    Sk = Sk or ld
    Sq = Sq or rows
    probs = scores if in_place else torch.full((batch, rows, 2 * ld), math.nan, dtype=out_dtype, device="cuda")
    lse = torch.full((1, batch, Sq), math.nan, device="cuda")
    a = native.SoftmaxArgs()
    a.scores, a.probs, a.lse = scores.data_ptr(), probs.data_ptr(), lse.data_ptr()
    a.rows, a.cols, a.batch = rows, Sk, batch
    a.ld_s, a.bs_s, a.ld_p, a.bs_p = ld, rows * ld, 2 * ld, 2 * rows * ld
    a.row0, a.gi0, a.e0, a.Sq, a.Sk, a.g, a.Hkv, a.Hq = 0, 0, 0, Sq, Sk, 1, batch, batch
    a.causal, a.out_dtype = int(causal), native.DTYPE_CODES["bf16" if out_dtype == torch.bfloat16 else "fp16"]
    a.variant = native.SOFTMAX_VARIANTS[variant]
    if mask is not None:  # (batch, rows, Sk)
        m = mask
        a.mask = m.data_ptr()
        a.mask_dtype = native.DTYPE_CODES[{torch.bool: "bool", torch.float32: "fp32", torch.bfloat16: "bf16",
                                           torch.float16: "fp16"}[m.dtype]]
        a.m_sb, a.m_sh, a.m_sq, a.m_sk = 0, m.stride(0), m.stride(1), m.stride(2)
    native.softmax(a, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    p = probs.view(out_dtype) if in_place else probs
    return p.view(batch, rows, 2 * ld)[..., :Sk], lse[0]


def expected(scores, Sk, causal, mask, Sq):
    s = scores[..., :Sk].double()
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        i = torch.arange(s.shape[1], device="cuda")[:, None]
        s = s.masked_fill(torch.arange(Sk, device="cuda")[None] > i + Sk - Sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None]), lse


def pipe_fits(cols, mask_esize=0):
    """Mirror of pipe_cluster() in native/softmax.cu: two ring slots of a row segment (+ its mask) within
    220 KiB or, where smaller, the device's opt-in shared memory a block less 512 bytes, the row split over 1 CTA
    or (sm_90) a cluster of 2, 4 or 8."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    ring = min(220 * 1024, getattr(props, "shared_memory_per_block_optin", 227 * 1024) - 512)
    n4 = -(-cols // 4)
    for C in (1, 2, 4, 8) if torch.cuda.get_device_capability()[0] >= 9 else (1,):
        seg4 = n4 if C == 1 else -(-(-(-n4 // C)) // 4) * 4
        if 2 * (seg4 * 16 + min(cols, 4 * seg4) * mask_esize // 16 * 16) <= ring:
            return True
    return False


def variants_for(cols, mask_esize=0):
    v = ["auto", "two_pass"]
    if pipe_fits(cols, mask_esize):
        v.append("pipe")
    if cols <= 32768:
        v.append("row")
    if not mask_esize and cols <= 16384:  # PIPE_REGS: no dense mask, at most 16384 columns
        v.append("pipe_regs")
    return v


@pytest.mark.parametrize("cols", [1, 3, 97, 4096, 4100, 16384, 28160, 40000, 70001, 131072])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_variants_agree_with_torch(cols, causal):
    rows = 3 if cols > 16384 else 5
    ld = -(-cols // 32) * 32
    for variant in variants_for(cols):
        for in_place in (True, False):
            scores = torch.randn(2, rows, ld, device="cuda") * 4
            want, want_lse = expected(scores, cols, causal, None, rows)
            p, lse = run_softmax(scores, variant=variant, in_place=in_place, causal=causal, Sk=cols)
            assert not torch.isnan(p).any(), (variant, in_place)
            torch.testing.assert_close(p.double(), want, atol=2e-3, rtol=1e-2, msg=f"{variant} {in_place}")
            torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cols", [97, 4100, 8193, 16384, 40000])
@pytest.mark.parametrize("mdtype", [None, torch.bool, torch.bfloat16, torch.float32],
                         ids=["nomask", "bool", "bf16", "fp32"])
def test_scores_past_the_causal_limit_are_ignored(cols, mdtype):
    """Causal rows whose limit falls anywhere in the row or before it (Sq = Sk + 8: row r sees keys 0..r-8, the
    first eight none), with every score past the limit NaN, as if nothing had written it (the kernels skip loading
    whole groups past a row's limit, and the mask's bytes there). Every variant gives torch's P, 0 past the limit,
    and LSE (-inf for the rows that see nothing), in place and out of place."""
    rows, ld, Sq = min(300, cols), -(-cols // 32) * 32, cols + 8  # query positions 0..rows-1
    past = torch.arange(ld, device="cuda")[None, :] > torch.arange(rows, device="cuda")[:, None] - 8
    esize = 0 if mdtype is None else torch.empty(0, dtype=mdtype).element_size()
    for variant in variants_for(cols, esize):
        for in_place in (True, False):
            scores = (torch.randn(2, rows, ld, device="cuda") * 4).masked_fill_(past, math.nan)
            mask = None
            if mdtype == torch.bool:
                mask = torch.rand(2, rows, cols, device="cuda") > 0.3
            elif mdtype is not None:
                mask = torch.randn(2, rows, cols, device="cuda").to(mdtype)
            want, want_lse = expected(scores, cols, True, mask, Sq)
            p, lse = run_softmax(scores, variant=variant, in_place=in_place, causal=True, Sq=Sq, Sk=cols, mask=mask)
            lse = lse[:, :rows]
            assert not torch.isnan(p).any() and not torch.isnan(lse).any(), (variant, in_place)
            assert (p[:, past[:, :cols]] == 0).all() and torch.isneginf(lse[:, :8]).all(), (variant, in_place)
            torch.testing.assert_close(p.double(), want, atol=2e-3, rtol=1e-2, msg=f"{variant} {in_place}")
            fin = torch.isfinite(want_lse)
            assert torch.equal(fin, torch.isfinite(lse)), (variant, in_place)
            torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cols", [8193, 12289, 16384])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pipe_regs_is_pipe_bit_for_bit(cols, causal):
    """Many rows a CTA (the ring and the row descriptors turn over): PIPE_REGS writes the P and LSE of PIPE's
    512-thread kernel exactly (the kernel of these rows when AUTO does not take PIPE_REGS, and of calls that add the
    mass) and matches torch; AUTO, whichever it takes here, agrees."""
    rows, ld = 300, -(-cols // 32) * 32
    scores = torch.randn(4, rows, ld, device="cuda") * 4
    want, want_lse = expected(scores, cols, causal, None, rows)
    out = {v: run_softmax(scores.clone(), variant=v, causal=causal, Sk=cols) for v in ("pipe", "pipe_regs", "auto")}
    p, lse = out["pipe_regs"]
    assert not torch.isnan(p).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(p.double(), want, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-5)
    for v in ("pipe", "auto"):
        assert torch.equal(out[v][0], p) and torch.equal(out[v][1], lse), v


@pytest.mark.parametrize("cols", [28161, 32768])
def test_few_decode_rows_past_one_cta_take_row(cols):
    """Decode rows (Sq = 1) that PIPE splits over a cluster, at most 8 an SM: AUTO takes ROW, bit for bit, and a
    call that adds their mass sums it itself (the softmax says it does not add it), so that P is the same with the
    mass and without; more of them, or rows of several query positions, keep PIPE, which adds the mass."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PIPE splits rows over clusters on sm_90 only")
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    ld = -(-cols // 32) * 32
    for batch, Sq, want in ((256, 1, "row"), (8 * sms, 1, "row"), (8 * sms + 1, 1, "pipe"), (4, 64, "pipe")):
        scores = torch.randn(batch, Sq, ld, device="cuda") * 4
        out = {v: run_softmax(scores.clone(), variant=v, Sk=cols, Sq=Sq) for v in ("auto", "row", "pipe")}
        assert not torch.isnan(out["auto"][0]).any()
        assert torch.equal(out["auto"][0], out[want][0]) and torch.equal(out["auto"][1], out[want][1]), (batch, Sq)
        other = "pipe" if want == "row" else "row"  # the two kernels sum in different orders
        assert not (torch.equal(out["auto"][0], out[other][0]) and torch.equal(out["auto"][1], out[other][1]))
        a = native.SoftmaxArgs()
        a.rows, a.cols, a.batch, a.ld_s, a.ld_p = Sq, cols, batch, ld, 2 * ld
        a.Sq, a.Sk, a.g, a.Hkv, a.Hq = Sq, cols, 1, batch, batch
        a.out_dtype, a.variant = native.DTYPE_CODES["bf16"], native.SOFTMAX_VARIANTS["auto"]
        assert native.softmax_adds_mass(a) == (want == "pipe"), (batch, Sq)


def test_pipe_regs_refuses_masks_and_long_rows():
    scores = torch.randn(1, 4, 16416, device="cuda")
    with pytest.raises(native.CudaError):
        run_softmax(scores, variant="pipe_regs", Sk=16385)
    mask = torch.ones(1, 4, 4096, dtype=torch.bool, device="cuda")
    with pytest.raises(native.CudaError):
        run_softmax(torch.randn(1, 4, 4096, device="cuda"), variant="pipe_regs", mask=mask)


@pytest.mark.parametrize("mdtype", [torch.bool, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [97, 4100, 16384, 20000, 50001])
def test_masks_and_fully_masked_rows(mdtype, cols):
    ld = -(-cols // 32) * 32
    for variant in variants_for(cols, torch.empty(0, dtype=mdtype).element_size()):
        scores = torch.randn(2, 4, ld, device="cuda")
        if mdtype == torch.bool:
            mask = torch.rand(2, 4, cols, device="cuda") > 0.3
            mask[1, 2] = False  # a fully masked row
        else:
            mask = torch.randn(2, 4, cols, device="cuda").to(mdtype)
            mask[1, 2] = -math.inf
        odt = torch.float16 if mdtype == torch.float16 else torch.bfloat16
        want, want_lse = expected(scores, cols, False, mask, 4)
        p, lse = run_softmax(scores, variant=variant, mask=mask, Sk=cols, out_dtype=odt)
        assert (p[1, 2] == 0).all() and torch.isneginf(lse[1, 2]).all(), variant
        torch.testing.assert_close(p.double(), want, atol=2e-3, rtol=1e-2, msg=variant)
        fin = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[fin].double(), want_lse[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cols", [1000, 8192, 20000, 40000])
def test_rows_masked_with_finite_minima(cols):
    """Masks of finite minima (torch.finfo(dtype).min, as Hugging Face builds them): a fully masked row is uniform
    with a finite LSE, as in torch, and a row whose first keys are masked is never NaN."""
    ld = -(-cols // 32) * 32
    lowest = torch.finfo(torch.bfloat16).min
    for variant in variants_for(cols, 2):
        scores = torch.randn(2, 4, ld, device="cuda") * 3
        mask = torch.randn(2, 4, cols, device="cuda").to(torch.bfloat16)
        mask[1, 2] = lowest  # fully masked
        mask[0, 1, : cols // 3] = lowest  # its first keys masked
        want, want_lse = expected(scores, cols, False, mask, 4)
        p, lse = run_softmax(scores, variant=variant, mask=mask, Sk=cols)
        assert not torch.isnan(p).any() and torch.isfinite(lse).all(), variant
        got = p.double()[..., :cols]
        torch.testing.assert_close(got.sum(-1), torch.ones_like(got[..., 0]), atol=2e-2, rtol=0, msg=variant)
        torch.testing.assert_close(got[0], want[0, ..., :cols], atol=2e-3, rtol=1e-2, msg=variant)


def test_unaligned_mask_rows_take_the_scalar_path():
    cols = 4133  # odd key count: mask rows start unaligned
    ld = -(-cols // 32) * 32
    mask = torch.randn(1, 6, cols, device="cuda").to(torch.bfloat16)
    for variant in variants_for(cols, 2):
        scores = torch.randn(1, 6, ld, device="cuda")  # fresh: the previous run overwrote its scores with P
        want, _ = expected(scores, cols, False, mask, 6)
        p, _ = run_softmax(scores, variant=variant, mask=mask, Sk=cols)
        torch.testing.assert_close(p.double(), want, atol=2e-3, rtol=1e-2, msg=variant)


def test_refused_variant_reports_cuda_error():
    scores = torch.randn(1, 2, 40000, device="cuda")
    with pytest.raises(native.CudaError, match="precondition failed: the forced kernel variant"):
        run_softmax(scores, variant="row", Sk=40000)  # rows this long do not fit one CTA's registers
