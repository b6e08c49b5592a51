"""Algorithm selection on the GPU: candidates, tuning, the cache policies, refused cached algorithms."""

import logging

import pytest
import torch

import attn_lt
from attn_lt.cache import AlgoConfig, Entry, Env, current_env, default_cache
from attn_lt.lt import algos, cublaslt
from attn_lt.testing import reference, rel_error, sdpa, tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no GEMM objects resolved in this process."""
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTN_LT_TUNE_MS", "60")
    monkeypatch.setenv("ATTN_LT_TUNE_CALL_MS", "100000")
    new_process()
    yield default_cache()
    new_process()


def new_process():
    """What a new process would have: no plans, no GEMM objects, no memory of cache lookups."""
    attn_lt.api.clear_plans()
    cublaslt.gemm.cache_clear()
    algos.forget()


def decode_qkv(Sk=65536, Hkv=8):
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, Hkv, Sk, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def check_correct(q, k, v, o):
    ref, _ = reference(q, k, v)
    assert rel_error(o, ref) <= tolerance(rel_error(sdpa(q, k, v), ref))


def pv_gemm(q, k, v):
    """The P@V GEMM of the first chunk of attention(q, k, v), as the long path builds it."""
    from attn_lt.lt.path import chunk_gemms

    e = attn_lt.explain(q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    bases = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 1 << 40)
    g = cublaslt.gemm(q.device.index, chunk_gemms(e.case, e.plan, e.plan.chunks[0], bases)[2][1])
    algos.resolve(g, "heuristic", e.plan.gemm_workspace)
    return g


def test_candidates_heuristic_first_within_workspace(fresh):
    q, k, v = decode_qkv()
    pv = pv_gemm(q, k, v)
    cands = algos.candidates(pv, 32 << 20)
    assert len(cands) >= 2
    assert cands[0][0] == algos.read_config(pv.algo)  # the heuristic's top-1 first
    assert len({c for c, _, _ in cands}) == len(cands)
    assert all(ws <= 32 << 20 for _, _, ws in cands)


def test_split_k_offered_for_an_unbatched_long_reduction(fresh):
    """cuBLASLt 13.1 takes split-K only for unbatched GEMMs (every algorithm refuses it at batch > 1, see
    docs/performance-log.md); the search must find those configurations, validated, with every reduction scheme."""
    from attn_lt.lt.cublaslt import GemmKey

    key = GemmKey("pv", "bf16", 128, 4, 65536, 1, False, False, 128, 131072, 128, 0, 0, 0, 256, 256, 256)
    cands = algos.candidates(cublaslt.gemm(0, key), 32 << 20)
    split = [c for c, _, _ in cands if c.splitk > 1]
    assert split, "a K=65536, n=4 unbatched GEMM must be offered split-K"
    assert {c.reduction for c in split} >= {1, 2}


@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_tuning_stores_valid_winners_that_compute_correctly(fresh, shape):
    if shape == "decode":
        q, k, v = decode_qkv()
    else:
        q, k, v = (torch.randn(1, 4, 4097, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = attn_lt.attention(q, k, v, algo_policy="tune")
    check_correct(q, k, v, o)
    items = fresh.items()
    from attn_lt.cache import parse_key

    assert {parse_key(key)["role"] for _, key, _ in items} == {"qk", "pv"}
    env = current_env().key()
    for e, _, entry in items:
        assert e == env and entry.median_ms <= entry.heuristic_ms * 1.0001
    # a new process (simulated: GEMM objects dropped) uses the cache without tuning, under both policies
    for policy in ("cache", "tune"):
        new_process()
        before = dict(algos.stats)
        o2 = attn_lt.attention(q, k, v, algo_policy=policy)
        assert algos.stats["tuned"] == before["tuned"] and algos.stats["cache"] >= before["cache"] + 2
        check_correct(q, k, v, o2)


def test_refused_cached_algorithm_is_reported_and_replaced(fresh, caplog):
    q, k, v = decode_qkv(Sk=8192)
    attn_lt.attention(q, k, v, algo_policy="tune")
    for env, key, _ in fresh.items():  # poison every entry with an algorithm id cuBLASLt does not have
        from attn_lt.cache import parse_key

        fresh.put(Env.parse(env), parse_key(key), Entry(AlgoConfig(99999, splitk=3), 0.001, 0.002, 0, (), ""))
    new_process()
    with caplog.at_level(logging.INFO, logger="attn_lt"):
        o = attn_lt.attention(q, k, v, algo_policy="cache")
    assert any("refuses the cached algorithm" in r.getMessage() for r in caplog.records)
    check_correct(q, k, v, o)


def test_call_budget_defers_tuning(fresh, monkeypatch):
    monkeypatch.setenv("ATTN_LT_TUNE_CALL_MS", "0")
    q, k, v = decode_qkv(Sk=8192)
    before = algos.stats["deferred"]
    o = attn_lt.attention(q, k, v, algo_policy="tune")
    assert algos.stats["deferred"] > before and fresh.items() == []
    check_correct(q, k, v, o)
