"""The FP8 prefill's rules without a GPU: validation, the launch plan and explain (the GPU tests are in
test_fp8_prefill_gpu.py)."""

import pytest
import torch

import attn_lt
from attn_lt.fused import fp8_prefill_launch, fp8_prefill_refusal
from attn_lt.validate import check_descale, check_tensors

F8 = torch.float8_e4m3fn


def fp8(*shape):
    return torch.randn(*shape).to(F8)


def test_case_launch_and_explain():
    q, k, v = fp8(2, 8, 300, 128), fp8(2, 2, 1000, 128), fp8(2, 2, 1000, 128)
    case = check_tensors(q, k, v, causal=True, require_cuda=False, kv_fp8=True)
    assert case.dtype == "e4m3" and case.group == 4
    launch = fp8_prefill_launch(case)
    assert launch.kernel == "sm90" and launch.splits == 1
    assert launch.workspace_bytes == 2 * 2 * 128 * 1024  # V transposed, keys rounded up to 128
    text = str(attn_lt.explain(q, k, v, causal=True))
    assert "e4m3" in text and "FP8 wgmma" in text and "native/flash_sm90.cu" in text


@pytest.mark.parametrize("D,Dv,mask,hopper,match", [
    (96, 96, False, True, "head dims D = Dv 64, 128 or 256"),
    (128, 256, False, True, "head dims D = Dv 64, 128 or 256"),
    (128, 128, True, True, "no dense mask"),
    (128, 128, False, False, "Hopper kernel"),
])
def test_refusals(D, Dv, mask, hopper, match):
    q, k, v = fp8(1, 4, 64, D), fp8(1, 2, 64, D), fp8(1, 2, 64, Dv)
    m = torch.ones(64, 64, dtype=torch.bool) if mask else None
    case = check_tensors(q, k, v, m, require_cuda=False, kv_fp8=True)
    assert match in fp8_prefill_refusal(case, hopper)
    assert fp8_prefill_refusal(check_tensors(*(fp8(1, 2, 8, 128) for _ in range(3)), require_cuda=False,
                                             kv_fp8=True), True) is None


def test_descale_factors():
    one = torch.ones(1)
    qd, kd, vd, sh = check_descale({"q_descale": 0.5, "k_descale": None, "v_descale": one}, 4, torch.device("cpu"))
    assert qd.item() == 0.5 and kd is None and vd is one and sh == 0
    *_, sh = check_descale({"q_descale": torch.ones(4), "k_descale": torch.ones(4)}, 4, torch.device("cpu"))
    assert sh == 1
    with pytest.raises(ValueError, match="all be per kv head or all one value"):
        check_descale({"q_descale": torch.ones(4), "k_descale": 2.0}, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="positive and finite"):
        check_descale({"q_descale": 0.0}, 4, torch.device("cpu"))


def test_attention_refuses_before_gpu_work():
    with pytest.raises(TypeError, match="must both be torch.float8_e4m3fn"):
        attn_lt.attention(fp8(1, 2, 8, 128), fp8(1, 2, 8, 128), torch.randn(1, 2, 8, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="CUDA device"):
        attn_lt.attention(fp8(1, 2, 8, 128), fp8(1, 2, 8, 128), fp8(1, 2, 8, 128), q_descale=1.0)
