"""The long path's Hopper Q@K^T (native/scores_sm90.cu) alone: FP32 scores against a float64 reference, within
twice the error of torch's FP32 GEMM of the same inputs; odd sizes, strided operands, padded score rows (written
only up to each row's last 16-byte chunk), K kept and Q kept, resident blocks reloaded, both dtypes; preconditions
refused before any GPU work; the rule that gives the long path's chunks to it."""

import math

import pytest
import torch

from attn_lt import config, native
from attn_lt.testing import rel_error, scores_args


@pytest.mark.gpu
@pytest.mark.usefixtures("sm90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,rows,cols,D,strided", [
    (1, 1, 1, 64, False), (2, 97, 4097, 128, True), (1, 4096, 4095, 64, False), (3, 300, 1000, 128, True),
    (1, 129, 4096, 128, False), (5, 64, 97, 64, True),
    (2, 300, 17001, 64, True), (3, 700, 20000, 128, False), (4, 1000, 4097, 128, True)])
def test_scores_match_the_reference(dtype, batch, rows, cols, D, strided):
    torch.manual_seed(rows * 7 + cols)
    if strided:  # heads interleaved: (S, batch, D) memory seen as (batch, S, D)
        q = torch.randn(rows, batch, D, device="cuda", dtype=dtype).transpose(0, 1)
        k = torch.randn(cols, batch, D, device="cuda", dtype=dtype).transpose(0, 1)
    else:
        q = torch.randn(batch, rows, D, device="cuda", dtype=dtype)
        k = torch.randn(batch, cols, D, device="cuda", dtype=dtype)
    ld = -(-cols // 4) * 4 + (8 if strided else 0)
    s = torch.full((batch, rows, ld), math.nan, device="cuda")
    alpha = 1 / math.sqrt(D)
    native.scores_sm90(scores_args(q, k, s, alpha), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = alpha * (q.double() @ k.double().transpose(1, 2))
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch_err = rel_error(alpha * (q.float() @ k.float().transpose(1, 2)), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    err = rel_error(s[..., :cols], ref)
    assert err <= 2 * torch_err + 1e-7, f"error {err} against torch's {torch_err}"
    # TMA stores whole 16-byte chunks: a row's last chunk gets zeros past its last key (K's rows there are zero)
    edge = -(-cols // 4) * 4
    assert (s[..., cols:edge] == 0).all(), "the last 16-byte chunk of a row is not zero past the row's last key"
    assert torch.isnan(s[..., edge:]).all(), "the kernel wrote past the 16-byte chunk of the row's last key"


@pytest.mark.gpu
@pytest.mark.usefixtures("sm90")
def test_scores_repeated_calls_agree_bit_for_bit():
    q = torch.randn(3, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 8192, 128, device="cuda", dtype=torch.bfloat16)
    s1 = torch.full((3, 2048, 8192), math.nan, device="cuda")
    s2 = torch.full_like(s1, math.nan)
    stream = torch.cuda.current_stream().cuda_stream
    native.scores_sm90(scores_args(q, k, s1, 0.125), stream)
    native.scores_sm90(scores_args(q, k, s2, 0.125), stream)
    torch.cuda.synchronize()
    assert torch.equal(s1, s2)


@pytest.mark.parametrize("field,value,status", [
    ("D", 80, "head dim"), ("dtype", 3, "dtype"), ("q_ld", 100, "stride"), ("s_ld", 4098, "stride"),
    ("rows", 0, "argument"), ("q", 8, "align"), ("cols", 4097, "stride"), ("batch", 1 << 31, "length"),
    ("q_ld", 1 << 39, "stride"), ("s_ld", 1 << 38, "stride")])  # TMA strides: below 2^40 bytes
def test_scores_preconditions_refused_before_any_gpu_work(field, value, status):
    try:
        native.load()
    except native.NativeLibraryError as e:
        pytest.skip(f"native library unavailable: {e}")
    a = native.ScoresArgs()
    a.q, a.k, a.s = 1 << 20, 1 << 21, 1 << 22  # never dereferenced: the checks come first
    a.rows, a.cols, a.batch, a.D = 128, 4096, 1, 128
    a.q_ld, a.q_bs, a.k_ld, a.k_bs, a.s_ld, a.s_bs = 128, 128 * 128, 128, 4096 * 128, 4096, 128 * 4096
    a.alpha, a.dtype = 1.0, native.DTYPE_CODES["bf16"]
    setattr(a, field, value)
    with pytest.raises(native.CudaError, match=status):
        native.scores_sm90(a, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="past its checks the launcher would launch on fake addresses")
@pytest.mark.parametrize("field,value", [("q_ld", (1 << 39) - 8), ("q_bs", (1 << 39) - 8), ("k_bs", (1 << 39) - 8),
                                         ("s_ld", (1 << 38) - 4), ("s_bs", (1 << 38) - 4)])
def test_scores_strides_just_below_2_40_bytes_pass_the_checks(field, value):
    """The bound of the refusals above is TMA's (2^40 bytes), not a tighter one: such a stride gets past the stride
    check and fails only at the device check (no GPU here)."""
    try:
        native.load()
    except native.NativeLibraryError as e:
        pytest.skip(f"native library unavailable: {e}")
    a = native.ScoresArgs()
    a.q, a.k, a.s = 1 << 20, 1 << 21, 1 << 22
    a.rows, a.cols, a.batch, a.D = 128, 4096, 2, 128  # batch 2: the block strides are checked too
    a.q_ld, a.q_bs, a.k_ld, a.k_bs, a.s_ld, a.s_bs = 128, 128 * 128, 128, 4096 * 128, 4096, 128 * 4096
    a.alpha, a.dtype = 1.0, native.DTYPE_CODES["bf16"]
    setattr(a, field, value)
    with pytest.raises(native.CudaError) as got:
        native.scores_sm90(a, 0)
    assert "stride" not in str(got.value), got.value


def qk_key(**kw) -> "GemmKey":
    from attn_lt.lt.cublaslt import GemmKey

    d = dict(role="qk", dtype="bf16", m=16384, n=2048, k=128, batch=3, trans_a=True, trans_b=False, lda=128,
             ldb=128, ldc=16384, stride_a=16384 * 128, stride_b=2048 * 128, stride_c=2048 * 16384, align_a=256,
             align_b=256, align_c=256)
    d.update(kw)
    return GemmKey(**d)


def test_native_reasons_take_the_long_paths_chunks_and_refuse_the_rest():
    from attn_lt.lt.scores import native_reasons

    for key in (qk_key(), qk_key(k=64, lda=64, ldb=64), qk_key(m=97, ldc=100, n=1, batch=1), qk_key(m=8192),
                qk_key(stride_b=(1 << 39) - 8), qk_key(stride_c=(1 << 38) - 4)):
        assert native_reasons(key, 132) == [], key
    cases = {"head dim 80": qk_key(k=80, lda=80, ldb=80), "16-byte aligned": qk_key(align_b=8),
             "multiple of 16 bytes": qk_key(ldc=16386), "FP32 scores": qk_key(role="pv", trans_a=False),
             "last 16-byte chunk": qk_key(m=97, ldc=97, n=1, batch=1), "dtype": qk_key(dtype="fp32"),
             "more than the 132 SMs": qk_key(m=28160, ldc=28160), "uses 100 of 132 SMs": qk_key(m=12800, ldc=12800),
             "tiles": qk_key(batch=1 << 31), "below 2^40 bytes": qk_key(stride_b=1 << 39),
             "below 2^40": qk_key(stride_c=1 << 38)}
    for words, key in cases.items():
        assert any(words in r for r in native_reasons(key, 132)), (words, native_reasons(key, 132))


def test_qk_option():
    from attn_lt import config

    assert config.current().qk == "cublaslt"
    with config.override(qk="native"):
        assert config.current().qk == "native"
    assert config.current().qk == "cublaslt"
    with pytest.raises(ValueError, match="qk must be one of"):
        with config.override(qk="fast"):
            pass


@pytest.mark.gpu
@pytest.mark.usefixtures("sm90")
@pytest.mark.parametrize("D,causal,Hkv", [(128, False, 4), (64, True, 2), (128, True, 1)])
def test_long_path_with_the_native_qk_matches_cublaslt(D, causal, Hkv):
    """The same long-path call with its Q@K^T by the native kernel and by cuBLASLt: the explanation names the
    kernel, and the outputs agree to FP32 rounding of the scores."""
    import attn_lt
    from attn_lt.testing import random_qkv

    q, k, v = random_qkv(1, 4, Hkv, 1000, 8000, D, torch.bfloat16)  # 63 key blocks: a grid of 126 keeps K
    outs = {}
    for choice in ("native", "cublaslt"):
        with config.override(qk=choice):
            p = attn_lt.plan(q, k, v, causal=causal, backend="lt")
            out = torch.full_like(q, math.nan)
            p.run(q, k, v, out=out)
            torch.cuda.synchronize()
            sources = [g["algorithm"] for g in p.explain().gemms if g["role"] == "qk"]
            assert all(("scores_sm90" in s) == (choice == "native") for s in sources), sources
        outs[choice] = out
    assert not torch.isnan(outs["native"]).any()
    assert rel_error(outs["native"], outs["cublaslt"]) < 1e-3
