"""Plan once, run lean (GPU): plan reuse and invalidation, the plan cache of attention(), CUDA graph capture, shape
classes that keep a growing decode loop from tuning every step."""

import math

import pytest
import torch

import attn_lt
from attn_lt.lt import algos
from attn_lt.testing import reference, rel_error, sdpa, tolerance

from conftest import rand_qkv

pytestmark = pytest.mark.gpu


def assert_close(o, q, k, v, **kw):
    ref, _ = reference(q, k, v, **kw)
    assert not torch.isnan(o).any()
    assert rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v, **kw), ref))


@pytest.mark.parametrize("backend", ["lt", "wmma"])
def test_plan_run_matches_attention_and_reuses_on_new_data(backend):
    q, k, v = rand_qkv(2, 8, 2, 97, 1000, 64, "bf16")
    p = attn_lt.plan(q, k, v, causal=True, backend=backend)
    assert p.backend == backend and "forced" in str(p.explain())
    assert (p.program is not None) == (backend == "wmma")  # the fused launch's arguments are built by plan()
    for _ in range(2):  # fresh data, same plan
        q2, k2, v2 = (torch.randn_like(x) for x in (q, k, v))
        out = torch.full_like(q2, math.nan)
        o, lse = p.run(q2, k2, v2, out=out, return_lse=True)
        assert o is out and lse.shape == (2, 8, 97)
        assert_close(o, q2, k2, v2, causal=True)


def test_plan_refuses_other_shapes_strides_and_alignment():
    q, k, v = rand_qkv(1, 4, 4, 64, 256, 64, "bf16")
    p = attn_lt.plan(q, k, v, backend="lt")
    with pytest.raises(ValueError, match="cannot run these tensors"):
        p.run(q, k[:, :, :200], v[:, :, :200])
    with pytest.raises(ValueError, match="cannot run these tensors"):
        p.run(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)  # other strides
    big = torch.randn(q.numel() + 8, device="cuda", dtype=q.dtype)
    with pytest.raises(ValueError, match="alignment"):
        p.run(big[1:q.numel() + 1].view(q.shape), k, v)  # 2-byte aligned q


def test_attention_keeps_one_plan_per_case():
    q, k, v = rand_qkv(1, 4, 4, 16, 512, 64, "bf16")
    attn_lt.api.clear_plans()
    attn_lt.attention(q, k, v, backend="lt")
    n = attn_lt.api.cached_plans()
    for _ in range(3):
        attn_lt.attention(torch.randn_like(q), k, v, backend="lt")
    assert attn_lt.api.cached_plans() == n
    attn_lt.attention(q, k, v, backend="lt", causal=True)
    assert attn_lt.api.cached_plans() == n + 1


@pytest.mark.parametrize("backend,Sq,Sk", [("lt", 1, 16384), ("lt", 16, 4097), ("wmma", 64, 1000)])
def test_cuda_graph_capture_and_replay_with_new_values(backend, Sq, Sk):
    q, k, v = rand_qkv(2, 8, 2, Sq, Sk, 128, "bf16")
    attn_lt.attention(q, k, v, backend=backend)  # planned (and tuned) before capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn_lt.attention(q, k, v, backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attn_lt.attention(q, k, v, backend=backend)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        out.fill_(math.nan)
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v)


def test_capture_never_tunes(tmp_path, monkeypatch):
    """A call first met inside a capture takes cached or heuristic algorithms; it is tuned on a later eager call."""
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "tune")
    monkeypatch.setenv("ATTN_LT_TUNE_MS", "30")
    algos.forget()
    q, k, v = rand_qkv(1, 8, 8, 1, 3000, 64, "bf16")
    tuned = algos.stats["tuned"]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = attn_lt.attention(q, k, v, backend="lt")
    g.replay()
    torch.cuda.synchronize()
    assert algos.stats["tuned"] == tuned
    assert_close(out, q, k, v)


def test_growing_decode_tunes_once_per_class(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "tune")
    monkeypatch.setenv("ATTN_LT_TUNE_MS", "30")
    algos.forget()
    kc, vc = (torch.randn(2, 2, 5000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    tuned = algos.stats["tuned"]
    attn_lt.attention(q, kc[:, :, :4200], vc[:, :, :4200], backend="lt")
    first = algos.stats["tuned"] - tuned
    assert first >= 1
    for n in range(4201, 4230):  # new shapes of few classes: a class is tuned at most once
        o = attn_lt.attention(q, kc[:, :, :n], vc[:, :, :n], backend="lt")
    loop = algos.stats["tuned"] - tuned
    assert loop <= 2 * first  # odd key counts are classes of their own (tuned once, unless a sibling's runs)
    for n in range(4230, 4300):  # every class of this range is known now: nothing tunes
        attn_lt.attention(q, kc[:, :, :n], vc[:, :, :n], backend="lt")
    assert algos.stats["tuned"] - tuned == loop
    assert_close(o, q, kc[:, :, :4229], vc[:, :, :4229])
    e = attn_lt.plan(q, kc[:, :, :4229], vc[:, :, :4229], backend="lt")
    e.run(q, kc[:, :, :4229], vc[:, :, :4229])
    text = str(e.explain())
    assert "class" in text and "cache (" in text and "GEMM shape" in text


def test_plan_tune_without_data_then_run_never_tunes(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "tune")
    monkeypatch.setenv("ATTN_LT_TUNE_MS", "30")
    algos.forget()
    q, k, v = rand_qkv(1, 4, 4, 300, 2000, 64, "bf16")
    p = attn_lt.plan(q, k, v, causal=True, backend="lt").tune()
    n = algos.stats["tuned"]
    assert_close(p.run(q, k, v), q, k, v, causal=True)
    assert algos.stats["tuned"] == n


@pytest.mark.parametrize("Dv", [64, 96])
def test_value_head_dim_differs_and_v_is_a_view_of_k(Dv):
    """MLA-style: D_qk = 192 / D_v = 128 (and D_v a view of k's first columns, without a copy)."""
    q = torch.randn(1, 8, 33, 160, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 700, 160, device="cuda", dtype=torch.bfloat16)
    v = k[..., :Dv]
    out = torch.full((1, 8, 33, Dv), math.nan, device="cuda", dtype=torch.bfloat16)
    o = attn_lt.attention(q, k, v, causal=True, out=out)
    assert o.shape == (1, 8, 33, Dv)
    ref, _ = reference(q, k, v, causal=True)
    assert rel_error(o, ref) < 1e-2


@pytest.mark.parametrize("backend,B,Hq,Hkv,Sq,Sk,D,causal", [
    ("wmma", 2, 32, 8, 1, 5000, 128, False),  # decode: key splits and their merge
    ("wmma", 1, 8, 2, 97, 1000, 64, True),  # flash.cu row blocks, or the Hopper kernel
    ("wmma", 1, 4, 4, 300, 300, 128, True),
    ("lt", 2, 8, 2, 1, 4097, 128, False),  # the long path: the same memory at Sq 1
    ("lt", 1, 4, 2, 97, 4095, 80, True),  # ... a copy after the call beyond
])
def test_output_layout_bshd(backend, B, Hq, Hkv, Sq, Sk, D, causal):
    """out_layout="bshd": (B, Sq, Hq, D), equal to the default's transpose, written in full into a poisoned out;
    a decode loop through the family's plan keeps the layout."""
    q, k, v = rand_qkv(B, Hq, Hkv, Sq, Sk, D, "bf16")
    out = torch.full((B, Sq, Hq, D), math.nan, dtype=q.dtype, device="cuda")
    o, lse = attn_lt.attention(q, k, v, causal=causal, backend=backend, out=out, out_layout="bshd",
                               return_lse=True)
    assert o is out and o.shape == (B, Sq, Hq, D) and lse.shape == (B, Hq, Sq)
    assert_close(o.transpose(1, 2), q, k, v, causal=causal)
    ref = attn_lt.attention(q, k, v, causal=causal, backend=backend)
    assert torch.equal(o, ref.transpose(1, 2))
    p = attn_lt.plan(q, k, v, causal=causal, backend=backend, out_layout="bshd")
    assert torch.equal(p.run(q, k, v), o)
    if Sq == 1:
        kc, vc = (torch.randn(B, Hkv, Sk + 8, D, device="cuda", dtype=q.dtype) for _ in range(2))
        for n in (Sk + 1, Sk + 8):  # new lengths, and new strides
            kn, vn = kc[:, :, :n].contiguous(), vc[:, :, :n].contiguous()
            o = attn_lt.attention(q, kn, vn, backend=backend, out_layout="bshd")
            assert o.shape == (B, 1, Hq, D) and o.is_contiguous()
            assert_close(o.transpose(1, 2), q, kn, vn)


def test_host_us_each_times_every_function_in_every_round():
    from attn_lt.testing import host_us_each

    counts = {"a": 0, "b": 0}

    def bump(name):
        counts[name] += 1

    res = host_us_each({"a": lambda: bump("a"), "b": lambda: bump("b")}, calls=10, rounds=3)
    assert set(res) == {"a", "b"} and all(t > 0 for t in res.values())
    assert counts == {"a": 5 + 30, "b": 5 + 30}  # warm-up, then 3 rounds of 10 each
    from attn_lt.testing import host_us_rounds

    counts = {"a": 0, "b": 0}
    res = host_us_rounds({"a": lambda: bump("a"), "b": lambda: bump("b")}, calls={"a": 4, "b": 7}, rounds=2)
    assert [len(res["a"]), len(res["b"])] == [2, 2] and counts == {"a": 5 + 8, "b": 5 + 14}  # a count each


@pytest.mark.parametrize("D, Sq, Hq, Hkv", [(128, 1, 32, 8), (64, 1, 8, 8), (128, 16, 32, 8), (576, 1, 16, 1)])
def test_fast_path_runs_a_decode_loop_as_the_python_path(D, Sq, Hq, Hkv):
    """attention()'s compiled fast path (attn_lt.fastpath): a decode loop whose cache grows by a key a step takes it
    after the first call of each launch; every step's output equals the Python path's bit for bit and the FP32
    reference; calls it cannot take (a mask, another stream, a graph capture) take the Python path."""
    from attn_lt import fastpath

    if fastpath.call is None:
        pytest.skip(f"fast path: {fastpath.status()}")
    if D == 576 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("MLA decode's fused kernel is Hopper's (elsewhere the long path takes it)")
    attn_lt.api.clear_plans()
    Dv = 512 if D == 576 else D
    B, S0 = (32 if D == 576 else 2), 4000  # MLA at B 32: a few parts, which the wide merge joins
    kc = torch.randn(B, S0 + 40, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (B, S, H, D) cache
    vc = kc if D == 576 else torch.randn_like(kc)
    hits0 = fastpath.stats()["hits"]
    for step in range(12):
        Sk = S0 + step
        q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k, v = kc[:, :, :Sk], vc[:, :, :Sk, :Dv]
        outs = []
        for on in (True, False):
            fastpath.set_enabled(on)
            outs.append(attn_lt.attention(q, k, v, out_layout="bshd"))
        fastpath.set_enabled(True)
        assert torch.equal(outs[0], outs[1]), step
        if step % 4 == 0:
            assert_close(outs[0].transpose(1, 2), q, k, v)
    assert fastpath.stats()["hits"] - hits0 >= 9  # every step but the first of each split count
    p = attn_lt.plan(q, k, v, out_layout="bshd")  # plan.run: its own handle, these tensors' layout exactly
    outs = [p.run(q, k, v) for _ in range(3)]
    fastpath.set_enabled(False)
    outs.append(p.run(q, k, v))
    fastpath.set_enabled(True)
    assert all(torch.equal(o, outs[-1]) for o in outs) and fastpath.stats()["hits"] - hits0 >= 11
    with pytest.raises(ValueError, match="cannot run these tensors"):
        p.run(q, kc[:, :, :S0 + 1], vc[:, :, :S0 + 1, :Dv])
    attn_lt.api.release_scratch()  # the remembered scratch addresses go: both paths take a new buffer
    k, v = kc[:, :, :S0 + 11], vc[:, :, :S0 + 11, :Dv]
    for _ in range(2):
        assert_close(attn_lt.attention(q, k, v, out_layout="bshd").transpose(1, 2), q, k, v)
        assert_close(p.run(q, k, v).transpose(1, 2), q, k, v)
    k, v = kc[:, :, :S0], vc[:, :, :S0, :Dv]
    hits = fastpath.stats()["hits"]
    if D != 576:
        mask = torch.rand(B, 1, Sq, S0, device="cuda") > 0.2
        assert_close(attn_lt.attention(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        o = attn_lt.attention(q, k, v, out_layout="bshd")
    side.synchronize()
    assert_close(o.transpose(1, 2), q, k, v)
    g = torch.cuda.CUDAGraph()
    static = torch.cuda.Stream()
    static.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(static):
        attn_lt.attention(q, k, v, out_layout="bshd")  # remembered on this stream, then captured there
        with torch.cuda.graph(g, stream=static):
            og = attn_lt.attention(q, k, v, out_layout="bshd")
    torch.cuda.current_stream().wait_stream(static)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    assert_close(og.transpose(1, 2), q, k, v)
    assert fastpath.stats()["hits"] == hits  # none of these took the fast path
