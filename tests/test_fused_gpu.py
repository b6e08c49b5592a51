"""The fused path (native/flash_sm90.cu on Hopper, native/flash.cu elsewhere) against the FP32 reference with the long path's tolerances, and the
hybrid selector agreeing with both forced paths around the threshold."""

import pytest
import torch
from conftest import check, rand_qkv

import attn_lt
from attn_lt.testing import rel_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1, 17, 97, 1000, 4095])
def test_sizes(S, D, dtype):
    check(*rand_qkv(2, 4, 4, S, S, D, dtype), backend="wmma")


@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (97, 4000), (1, 2048), (16, 333), (300, 97), (128, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Hkv", [8, 2, 1], ids=["mha", "gqa4", "mqa8"])
def test_gqa_and_causal(Hkv, causal, Sq, Sk):
    check(*rand_qkv(2, 8, Hkv, Sq, Sk, 128, "bf16"), causal=causal, backend="wmma")


def test_causal_more_queries_than_keys_gives_zero_rows():
    o, lse = check(*rand_qkv(1, 4, 2, 300, 97, 64, "bf16"), causal=True, backend="wmma")
    assert (o[:, :, :203] == 0).all() and torch.isneginf(lse[:, :, :203]).all()


@pytest.mark.parametrize("Hkv,causal", [(8, False), (2, True)])
def test_bshd_transposed_views(Hkv, causal):
    check(*rand_qkv(2, 8, Hkv, 1000, 2000, 64, "fp16", layout="bshd"), causal=causal, backend="wmma")


@pytest.mark.parametrize("Sk", [4095, 4096, 4097])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_auto_agrees_with_both_paths_around_the_threshold(Sk, causal):
    q, k, v = rand_qkv(1, 4, 2, 512, Sk, 128, "bf16")
    auto = attn_lt.attention(q, k, v, causal=causal)
    assert attn_lt.explain(q, k, v, causal=causal).decision.backend == ("lt" if Sk >= 4096 else "wmma")
    for backend in ("lt", "wmma"):
        other = attn_lt.attention(q, k, v, causal=causal, backend=backend)
        assert rel_error(auto, other.float()) < 1e-2


def test_mask_runs_on_the_fused_kernel():
    q, k, v = rand_qkv(1, 2, 2, 64, 256, 64, "bf16")
    m = torch.rand(64, 256, device="cuda") > 0.2
    e = attn_lt.explain(q, k, v, attn_mask=m)
    assert e.decision.backend == "wmma" and e.fused.kernel == "flash"
    check(q, k, v, attn_mask=m, backend="auto")


def test_repeatable_bit_for_bit():
    q, k, v = rand_qkv(2, 8, 2, 1000, 1500, 128, "bf16")
    assert torch.equal(attn_lt.attention(q, k, v, causal=True), attn_lt.attention(q, k, v, causal=True))


def test_torch_compile_matches_eager():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16)
            self.proj = torch.nn.Linear(256, 256, dtype=torch.bfloat16)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, 4, 64).permute(2, 0, 3, 1, 4)
            return self.proj(attn_lt.attention(q, k, v, causal=True).transpose(1, 2).reshape(B, S, 256))

    m = Block().cuda()
    x = torch.randn(2, 1000, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # attn_lt is forward only
        eager = m(x)
        compiled = torch.compile(m, fullgraph=True)(x)
    assert torch.equal(compiled, eager) or rel_error(compiled, eager.float()) < 1e-2
    # the LSE only where asked for: the op's placeholder otherwise (the call keeps its LSE-free route), both equal to
    # the eager call's
    q, k, v = rand_qkv(2, 8, 2, 97, 300, 128, "bf16")
    f = torch.compile(lambda q, k, v, r: attn_lt.attention(q, k, v, causal=True, return_lse=r), fullgraph=True)
    out, lse = f(q, k, v, True)
    e_out, e_lse = attn_lt.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse) and torch.equal(f(q, k, v, False), e_out)
    with pytest.raises(NotImplementedError, match="no backward"):
        m(x)  # weights require grad: a clear error instead of silently detached outputs


def test_calibrate_stores_rules_that_select_uses(tmp_path, monkeypatch, capsys):
    import json

    from attn_lt import calibrate
    from attn_lt.cli import main
    from attn_lt.select import current_threshold, select
    from attn_lt.validate import Case

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "SHIPPED_DIR", tmp_path / "none")
    monkeypatch.delenv("ATTN_LT_THRESHOLD", raising=False)
    assert main(["calibrate", "--dims", "64", "--lengths", "1024,8192", "--sq", "1", "--ship", str(tmp_path / "ship"),
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # Sq 1 and Sq = Sk (causal too) at two key lengths, and masked (non-causal) at both; every point timed on both
    # paths
    assert len(d["points"]) == 10 and all(p["wmma_ms"] > 0 and p["lt_ms"] > 0 for p in d["points"])
    assert {(r["causal"], r["mask"], r["Sq"]) for r in d["rules"]} == {
        (False, False, 1), (False, False, "Sk"), (True, False, "Sk"), (False, True, 1), (False, True, "Sk")}
    assert (tmp_path / "cache" / "calibration.json").exists() and d["file"] and d["shipped"]
    name = torch.cuda.get_device_name()
    decode = Case.contiguous(4, 32, 8, 1, 8192, 64)
    try:
        assert current_threshold()[0] == "per case"
        reason = select(decode).reasons[0]
        assert f"measured on this GPU ({name}, {d['date']}): at D64 Sq1 " in reason
        monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "other"))  # no local calibration: the shipped one
        monkeypatch.setattr(calibrate, "SHIPPED_DIR", tmp_path / "ship")
        assert f"shipped calibration, measured on the {name}, {d['date']}: at D64 Sq1 " in select(decode).reasons[0]
    finally:
        calibrate.clear_cache()
