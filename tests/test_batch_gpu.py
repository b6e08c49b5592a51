"""Serving batches on the GPU: varlen_attention and paged_attention against an FP64 reference built request by
request (PyTorch SDPA per request at the input precision gives the error bound), outputs poisoned first; bad
metadata recorded and never read out of bounds; one CUDA graph replayed with new lengths and block tables."""

import math
import random

import pytest
import torch

import attn_lt
from attn_lt import batch
from attn_lt.fused import DeviceFacts, device_facts
from attn_lt.testing import (cu_seqlens, fp8_kv, fp8_values, paged_gather, paged_reference, random_pages, rel_error,
                             sdpa, tolerance, varlen_key_mass_reference, varlen_reference)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]


cu = cu_seqlens


def torch_varlen(q, k, v, cu_q, cu_k, causal):
    """PyTorch SDPA request by request at the input precision (the error scale the bound is built from)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b] and ck[b + 1] > ck[b]:
            o = sdpa(q[cq[b]:cq[b + 1]].transpose(0, 1)[None], k[ck[b]:ck[b + 1]].transpose(0, 1)[None],
                     v[ck[b]:ck[b + 1]].transpose(0, 1)[None], causal=causal)
            out[cq[b]:cq[b + 1]] = o[0].transpose(0, 1)
    return out


def check_against(out, lse, ref, ref_lse, torch_out):
    owned = ~torch.isnan(ref[:, 0, 0])
    assert not torch.isnan(out[owned]).any() and not torch.isnan(lse[:, owned]).any()
    err, torch_err = rel_error(out[owned], ref[owned]), rel_error(torch_out[owned], ref[owned])
    assert err <= tolerance(torch_err), f"error {err:.3e}, PyTorch {torch_err:.3e}"
    r, l = ref_lse[:, owned], lse[:, owned]
    assert torch.equal(torch.isneginf(l), torch.isneginf(r))
    fin = torch.isfinite(r)
    if fin.any():
        assert (l[fin].double() - r[fin]).abs().max().item() <= 1e-3 * (1 + r[fin].abs().max().item())


def captured(call):
    """A CUDA graph of ``call()``, run once first outside the capture (the error flag, the kernels' attributes)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def check_bad_block_reported(call, table, row, col, num_blocks):
    """``call(table)`` with entry (row, col) of a copy of the block table past the cache's ``num_blocks``: its output
    has no NaN and :func:`attn_lt.check_batch_errors` names the bad block."""
    bad = table.clone()
    bad[row, col] = num_blocks + 5
    assert not torch.isnan(call(bad)).any()
    with pytest.raises(ValueError, match="block id outside"):
        attn_lt.check_batch_errors()


def run_varlen(q_lens, k_lens, Hq, Hkv, D, dtype, causal, facts=None, monkeypatch=None):
    if facts is not None:
        monkeypatch.setattr(batch, "device_facts", lambda *a: facts)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(max(1, sum(k_lens)), Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    cu_q, cu_k = cu(q_lens), cu(k_lens)
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=max(q_lens), max_seqlen_k=max(1, *k_lens),
                                        causal=causal, return_lse=True, out=out, check=True)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, causal=causal)
    check_against(out, lse, ref, ref_lse, torch_varlen(q, k, v, cu_q, cu_k, causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_prefill(dtype, D, Hq, Hkv, causal):
    # documents of odd lengths (0 and 1 included), chunked prefill (Sq < Sk) and Sq > Sk
    q_lens = [97, 0, 1, 300, 64, 129, 5, 40]
    k_lens = [97, 5, 1, 300, 1000, 129, 0, 17]
    run_varlen(q_lens, k_lens, Hq, Hkv, D, dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hopper", [True, False])
def test_varlen_row_kernels(dtype, hopper, monkeypatch):
    """The row blocks on each kernel (the Hopper kernel where it runs, native/flash.cu forced by planning for a GPU
    without it), long documents."""
    from attn_lt.fused import device_facts
    facts = device_facts()
    if hopper and not facts.hopper:
        pytest.skip("no Hopper kernel on this GPU")
    facts = DeviceFacts(facts.sms, hopper, facts.smem_optin)
    run_varlen([4095, 1, 4097, 700], [4095, 3000, 4097, 9000], 16, 4, 128, dtype, True, facts, monkeypatch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_decode_rows(dtype, Hq, Hkv, causal):
    """Decode and speculative rows (at most 16 rows a kv head) with long and empty keys: the split decode blocks."""
    q_lens = [1, 1, 2, 1, 1, 1]
    k_lens = [4097, 0, 33000, 1, 63, 65]
    run_varlen(q_lens, k_lens, Hq, Hkv, 128, dtype, causal)


def run_paged(seqlens, q_lens, block_size, Hq, Hkv, D, dtype, causal=True, decode=False):
    k_cache, v_cache, table, seqlens_k = random_pages(seqlens, block_size, Hkv, D, dtype)
    cu_q = None if decode else cu(q_lens)
    q = torch.randn(len(seqlens) if decode else sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cu_q,
                                       max_seqlen_q=None if decode else max(q_lens), causal=causal,
                                       return_lse=True, out=out, check=True)
    ref, ref_lse = paged_reference(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cu_q, causal=causal)
    k, v, cu_k = paged_gather(k_cache, v_cache, table, seqlens_k)
    cq = torch.arange(q.shape[0] + 1, dtype=torch.int32, device="cuda") if decode else cu_q
    check_against(out, lse, ref, ref_lse, torch_varlen(q, k, v, cq, cu_k, causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (8, 8, 64), (16, 2, 256)])
def test_paged_decode(dtype, block_size, Hq, Hkv, D):
    bs = block_size
    seqlens = [0, 1, bs - 1, bs, bs + 1, 5000, 3 * bs + 7, 777]
    run_paged(seqlens, None, bs, Hq, Hkv, D, dtype, decode=True)


def facts_with(monkeypatch, hopper: bool):
    """Plan for this GPU with (or without) the Hopper kernel; skips where it does not run."""
    from attn_lt.fused import device_facts
    facts = device_facts()
    if hopper and not facts.hopper:
        pytest.skip("no Hopper kernel on this GPU")
    monkeypatch.setattr(batch, "device_facts", lambda *a: DeviceFacts(facts.sms, hopper, facts.smem_optin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 64, 256])
@pytest.mark.parametrize("hopper", [True, False])
def test_paged_mixed_batch(dtype, block_size, hopper, monkeypatch):
    """Prefill chunks against cached prefixes, speculative rows and decode rows in one call, the row blocks on each
    kernel."""
    facts_with(monkeypatch, hopper)
    seqlens = [2048 + 3000, 1, 500, 129, 4000, 0, 65]
    q_lens = [2048, 1, 4, 129, 1, 0, 3]
    run_paged(seqlens, q_lens, block_size, 32, 8, 128, dtype)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("hopper", [True, False])
def test_paged_prefill_head_dims(D, hopper, monkeypatch):
    facts_with(monkeypatch, hopper)
    run_paged([700, 300, 1000], [300, 300, 97], 16, 8, 2, D, torch.float16, causal=True)


@pytest.mark.parametrize("hopper", [True, False])
def test_paged_bad_block_in_prefill_rows(hopper, monkeypatch):
    """A block id past the cache inside a prefill request: not read, its keys not attended, reported."""
    facts_with(monkeypatch, hopper)
    dtype, bs = torch.bfloat16, 16
    k_cache, v_cache, table, seqlens_k = random_pages([600, 400], bs, 8, 128, dtype)
    q = torch.randn(200, 32, 128, dtype=dtype, device="cuda")
    cu_q = cu([100, 100])
    bad = table.clone()
    bad[0, 2] = -3
    out = attn_lt.paged_attention(q, k_cache, v_cache, bad, seqlens_k, cu_seqlens_q=cu_q, max_seqlen_q=100)
    with pytest.raises(ValueError, match="block id"):
        attn_lt.check_batch_errors()
    # the reference: the same request with that block's keys hidden (a -inf additive mask over keys 32..47)
    k, v, cu_k = paged_gather(k_cache, v_cache, table, seqlens_k)
    from attn_lt.testing import reference
    keys = torch.arange(600, device="cuda")
    hide = torch.zeros(1, 1, 100, 600, dtype=torch.float32, device="cuda")
    hide[..., (keys >= 2 * bs) & (keys < 3 * bs)] = -math.inf
    causal = (keys[None, :] <= torch.arange(100, device="cuda")[:, None] + 500)
    hide = hide.masked_fill(~causal, -math.inf)
    ref, _ = reference(q[:100].transpose(0, 1)[None], k[:600].transpose(0, 1)[None], v[:600].transpose(0, 1)[None],
                       attn_mask=hide, dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel_error(out[:100], ref[0].transpose(0, 1)) < 2e-2


def test_paged_bad_metadata_is_reported_not_read():
    dtype = torch.bfloat16
    k_cache, v_cache, table, seqlens_k = random_pages([300, 200, 100], 16, 8, 128, dtype)
    q = torch.randn(3, 32, 128, dtype=dtype, device="cuda")
    good = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, check=True)
    bad_table = table.clone()
    bad_table[0, 3] = k_cache.shape[0] + 1000  # past the cache
    with pytest.raises(ValueError, match="block id"):
        attn_lt.paged_attention(q, k_cache, v_cache, bad_table, seqlens_k, check=True)
    out = attn_lt.paged_attention(q, k_cache, v_cache, bad_table, seqlens_k)
    with pytest.raises(ValueError, match="block id"):
        attn_lt.check_batch_errors()
    assert torch.isfinite(out).all()
    assert torch.equal(out[1:], good[1:])  # the other requests are untouched
    too_long = seqlens_k.clone()
    too_long[2] = table.shape[1] * 16 + 1  # past the table row
    with pytest.raises(ValueError, match="block table"):
        attn_lt.paged_attention(q, k_cache, v_cache, table, too_long, check=True)
    neg = seqlens_k.clone()
    neg[1] = -5
    out, lse = attn_lt.paged_attention(q, k_cache, v_cache, table, neg, return_lse=True)
    with pytest.raises(ValueError, match="negative"):
        attn_lt.check_batch_errors()
    assert torch.all(out[1] == 0) and torch.isneginf(lse[:, 1]).all()


def test_varlen_bad_offsets_are_reported():
    q = torch.randn(10, 8, 64, dtype=torch.float16, device="cuda")
    k = torch.randn(20, 8, 64, dtype=torch.float16, device="cuda")
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda")
    for cu_k in ([0, 15, 30], [0, 15, 10]):  # past the packed keys; decreasing
        with pytest.raises(ValueError, match="cu_seqlens_k decreasing, negative or past the packed keys"):
            attn_lt.varlen_attention(q, k, k, cu_q, torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                                     max_seqlen_q=5, max_seqlen_k=20, check=True)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        attn_lt.varlen_attention(q, k, k, cu_q, torch.tensor([0, 10, 20], dtype=torch.int32, device="cuda"),
                                 max_seqlen_q=4, max_seqlen_k=20, check=True)


def owned_slots(k_cache, table, seqlens):
    """(num_blocks, block_size) bool: the cache slots some request owns."""
    bs = k_cache.shape[1]
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device="cuda")
    for row, n in zip(table.tolist(), seqlens):
        for j in range(-(-n // bs)):
            owned[row[j], :min(bs, n - j * bs)] = True
    return owned


def mla_cache(seqlens, block_size, Hkv, dtype, poison_unused=True):
    """A paged latent cache (num_blocks, bs, Hkv, 576) and its v view (the first 512 columns); the slots no request
    owns (its last block's tail, the spare blocks) NaN when ``poison_unused``: MLA decode must never let them in."""
    k_cache, _, table, seqlens_k = random_pages(seqlens, block_size, Hkv, 576, dtype)
    if poison_unused:
        k_cache[~owned_slots(k_cache, table, seqlens)] = math.nan
    return k_cache, k_cache[..., :512], table, seqlens_k


def mla_torch(q, k_cache, v_cache, table, seqlens_k):
    k, v, cu_k = paged_gather(k_cache, v_cache, table, seqlens_k)
    return torch_varlen(q, k, v, torch.arange(q.shape[0] + 1, dtype=torch.int32, device="cuda"), cu_k, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("Hq", [16, 128])
def test_mla_paged_decode(dtype, block_size, Hq):
    """MLA decode on a paged latent cache: lengths 0, 1 and around a block, requests of one part (written directly)
    and of several (merged), unwritten slots NaN, against FP64."""
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    seqlens = [0, 1, 63, 64, 65, 5000, 1000, 3 * block_size + 7, 2500]
    k_cache, v_cache, table, seqlens_k = mla_cache(seqlens, block_size, 1, dtype)
    q = torch.randn(len(seqlens), Hq, 576, dtype=dtype, device="cuda")
    out = torch.full((len(seqlens), Hq, 512), math.nan, dtype=dtype, device="cuda")
    plan = batch.plan_batch(len(seqlens), Hq, 1, 576, Dv=512, max_seqlen_q=1, max_seqlen_k=table.shape[1] * block_size,
                            block_size=block_size)
    assert plan.parts > 1  # 5000 keys take several parts, the short requests one
    out, lse = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, return_lse=True, out=out, check=True)
    ref, ref_lse = paged_reference(q, k_cache, v_cache, table, seqlens_k, causal=False)
    check_against(out, lse, ref, ref_lse, mla_torch(q, k_cache, v_cache, table, seqlens_k))


def test_mla_paged_bad_block_and_refusals():
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    dtype, bs = torch.bfloat16, 64
    seqlens = [3000, 700]
    k_cache, v_cache, table, seqlens_k = mla_cache(seqlens, bs, 1, dtype, poison_unused=False)
    q = torch.randn(2, 64, 576, dtype=dtype, device="cuda")
    bad = table.clone()
    bad[0, 5] = k_cache.shape[0] + 7
    out, lse = attn_lt.paged_attention(q, k_cache, v_cache, bad, seqlens_k, return_lse=True)
    with pytest.raises(ValueError, match="block id"):
        attn_lt.check_batch_errors()
    good = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k)
    assert torch.equal(out[1], good[1])
    k, v, _ = paged_gather(k_cache, v_cache, table, seqlens_k)
    from attn_lt.testing import reference
    hide = torch.zeros(1, 1, 1, 3000, dtype=torch.float32, device="cuda")
    hide[..., 5 * bs:6 * bs] = -math.inf
    ref, _ = reference(q[:1].transpose(0, 1)[None], k[:3000].transpose(0, 1)[None], v[:3000].transpose(0, 1)[None],
                       attn_mask=hide, dtype=torch.float64)
    assert torch.isfinite(out).all()
    assert rel_error(out[:1], ref[0].transpose(0, 1)) < 2e-2
    with pytest.raises(ValueError, match="same memory"):
        attn_lt.paged_attention(q, k_cache, k_cache[..., :512].clone(), table, seqlens_k)
    with pytest.raises(ValueError, match="one query row a request"):
        attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cu([1, 1]), max_seqlen_q=2)


def test_mla_graph_replay():
    """One capture of an MLA decode step, replayed while lengths grow and block tables change."""
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    rng = random.Random(1)
    dtype, B, Hq, bs, max_blocks = torch.bfloat16, 12, 64, 64, 48
    k_cache = torch.randn(B * max_blocks, bs, 1, 576, dtype=dtype, device="cuda")
    v_cache = k_cache[..., :512]
    table = torch.randperm(B * max_blocks).to(torch.int32).view(B, max_blocks).cuda()
    lengths = [rng.randrange(0, 1500) for _ in range(B)]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 576, dtype=dtype, device="cuda")
    out = torch.empty(B, Hq, 512, dtype=dtype, device="cuda")

    def call():
        attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, out=out)

    graph = captured(call)
    for step in range(30):
        lengths = [min(max_blocks * bs, n + rng.randrange(0, 200)) if rng.random() > 0.1 else 0 for n in lengths]
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        if step % 7 == 0:
            table.copy_(torch.randperm(B * max_blocks).to(torch.int32).view(B, max_blocks))
        q.copy_(torch.randn_like(q))
        out.fill_(math.nan)
        graph.replay()
        replayed = out.clone()
        assert torch.equal(replayed, attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens)), f"step {step}"
    attn_lt.check_batch_errors()


def test_graph_replay_with_changing_lengths_and_tables():
    """One capture for a capacity, 200 replays: lengths grow, requests join and leave, block tables change."""
    rng = random.Random(0)
    dtype, B, Hq, Hkv, D, bs, max_blocks = torch.bfloat16, 24, 32, 8, 128, 16, 128
    num_blocks = B * max_blocks
    k_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    seqlens = torch.zeros(B, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)

    def call():
        attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens, out=out)

    lengths = [rng.randrange(0, 300) for _ in range(B)]
    perm = torch.randperm(num_blocks).to(torch.int32).view(B, max_blocks)
    table.copy_(perm)
    seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
    graph = captured(call)
    for step in range(200):
        for b in range(B):
            r = rng.random()
            if r < 0.05:
                lengths[b] = 0  # leaves
            elif r < 0.1:
                lengths[b] = rng.randrange(1, 1500)  # a new request joins
            else:
                lengths[b] = min(max_blocks * bs, lengths[b] + 1)
        if step % 10 == 0:
            table.copy_(torch.randperm(num_blocks).to(torch.int32).view(B, max_blocks))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(math.nan)
        graph.replay()
        replayed = out.clone()
        eager = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens)
        assert torch.equal(replayed, eager), f"step {step}"
    attn_lt.check_batch_errors()


def test_step_replays_one_capture_over_many_plans():
    """BatchStep: one capture of run() for a capacity; plan() between replays with requests joining and leaving
    (B below the capacity), new lengths and tables; equal to paged_attention on the same requests."""
    rng = random.Random(2)
    dtype, cap, Hq, Hkv, D, bs, max_blocks = torch.bfloat16, 16, 32, 8, 128, 16, 64
    num_blocks = cap * max_blocks
    k_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    step = attn_lt.BatchStep(cap, Hq, Hkv, D, max_seqlen_k=max_blocks * bs, block_size=bs, dtype=dtype)
    q = torch.randn(cap, Hq, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    table = torch.randperm(num_blocks).to(torch.int32).view(cap, max_blocks).cuda()
    seqlens = torch.tensor([rng.randrange(0, 600) for _ in range(cap)], dtype=torch.int32, device="cuda")
    step.plan(None, seqlens, table)
    graph = captured(lambda: step.run(q, k_cache, v_cache, out=out))
    twin = attn_lt.BatchStep(cap, Hq, Hkv, D, max_seqlen_k=max_blocks * bs, block_size=bs, dtype=dtype)
    for it in range(40):
        B = rng.randrange(1, cap + 1)
        lens = torch.tensor([rng.randrange(0, max_blocks * bs + 1) for _ in range(B)], dtype=torch.int32).cuda()
        tab = torch.randperm(num_blocks)[:B * max_blocks].to(torch.int32).view(B, max_blocks).cuda()
        step.plan(None, lens, tab)
        twin.plan(None, lens, tab)
        q.copy_(torch.randn_like(q))
        out.fill_(math.nan)
        graph.replay()
        assert torch.equal(out[:B], twin.run(q[:B], k_cache, v_cache)), f"iteration {it}"  # the same plan, eager
        one_call = attn_lt.paged_attention(q[:B], k_cache, v_cache, tab, lens)  # its own capacity's split
        assert rel_error(out[:B], one_call) < 1e-2, f"iteration {it}"
    attn_lt.check_batch_errors()


@pytest.mark.parametrize("paged", [True, False])
def test_step_mixed_rows(paged):
    """Prefill chunks and decode rows planned with cu_seqlens_q, run per layer with two caches; varlen too."""
    dtype, Hq, Hkv, D, bs = torch.float16, 16, 4, 128, 64
    k_lens, q_lens = [3000, 1, 700, 0, 65], [1000, 1, 4, 0, 65]
    cap = 8
    step = attn_lt.BatchStep(cap, Hq, Hkv, D, max_seqlen_q=1024, max_seqlen_k=4096, block_size=bs if paged else 0,
                             dtype=dtype)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    if paged:
        layers = [random_pages(k_lens, bs, Hkv, D, dtype) for _ in range(2)]
        table, seqlens = layers[0][2], layers[0][3]
        layers = [(kc, vc) for kc, vc, _, _ in layers]
        # the second layer's cache uses the first one's table: same block ids, other contents
        step.plan(cu(q_lens), seqlens, table)
    else:
        layers = [(torch.randn(sum(k_lens), Hkv, D, dtype=dtype, device="cuda"),
                   torch.randn(sum(k_lens), Hkv, D, dtype=dtype, device="cuda")) for _ in range(2)]
        step.plan(cu(q_lens), cu_seqlens_k=cu(k_lens))
    for kc, vc in layers:
        out, lse = step.run(q, kc, vc, return_lse=True)
        if paged:
            ref, ref_lse = paged_reference(q, kc, vc, table, seqlens, cu_seqlens_q=cu(q_lens), causal=True)
            k, v, cu_k = paged_gather(kc, vc, table, seqlens)
        else:
            ref, ref_lse = varlen_reference(q, kc, vc, cu(q_lens), cu(k_lens), causal=True)
            k, v, cu_k = kc, vc, cu(k_lens)
        check_against(out, lse, ref, ref_lse, torch_varlen(q, k, v, cu(q_lens), cu_k, True))
    attn_lt.check_batch_errors()


def test_step_mla_below_capacity():
    """An MLA decode step planned for 8 requests, run with 5 (q holds 5 rows)."""
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    dtype, bs = torch.bfloat16, 64
    seqlens = [4000, 0, 1, 130, 2000]
    k_cache, v_cache, table, seqlens_k = mla_cache(seqlens, bs, 1, dtype)
    step = attn_lt.BatchStep(8, 128, 1, 576, head_dim_v=512, max_seqlen_k=4096, block_size=bs, dtype=dtype)
    assert "MLA decode blocks" in step.explain()
    q = torch.randn(5, 128, 576, dtype=dtype, device="cuda")
    step.plan(None, seqlens_k, table)
    out, lse = step.run(q, k_cache, v_cache, return_lse=True)
    ref, ref_lse = paged_reference(q, k_cache, v_cache, table, seqlens_k, causal=False)
    check_against(out, lse, ref, ref_lse, mla_torch(q, k_cache, v_cache, table, seqlens_k))
    attn_lt.check_batch_errors()


# ---- FP8 KV caches ---------------------------------------------------------------------------------------------

def fp8_pages(seqlens, block_size, Hkv, D, dtype):
    """A random paged cache stored in FP8 (per-head factors): (k8, v8, table, seqlens_k, k_desc, v_desc, kf, vf),
    kf / vf the caches' FP32 values (what the reference attends)."""
    k, v, table, seqlens_k = random_pages(seqlens, block_size, Hkv, D, dtype)
    k8, kd = fp8_kv(k)
    v8, vd = fp8_kv(v * 3)
    return k8, v8, table, seqlens_k, kd, vd, fp8_values(k8, kd), fp8_values(v8, vd)


def check_fp8_against(out, lse, q, kf, vf, cq, ck, causal, ref, ref_lse):
    """The FP8 call against the FP64 reference of the cache's values; PyTorch's error bound from SDPA on those
    values rounded to q's dtype (e4m3 elements are exact in fp16 and bf16; the factor's rounding only widens it)."""
    check_against(out, lse, ref, ref_lse, torch_varlen(q, kf.to(q.dtype), vf.to(q.dtype), cq, ck, causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 8, 128), (8, 8, 64), (16, 2, 256), (4, 1, 128), (32, 2, 128), (24, 2, 64)])
def test_fp8_paged_decode(dtype, block_size, Hq, Hkv, D):
    bs = block_size
    seqlens = [0, 1, bs - 1, bs, bs + 1, 5000, 3 * bs + 7, 777, 20000]
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages(seqlens, bs, Hkv, D, dtype)
    q = torch.randn(len(seqlens), Hq, D, dtype=dtype, device="cuda")
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, k_descale=kd, v_descale=vd, return_lse=True,
                                       out=out, check=True)
    ref, ref_lse = paged_reference(q, kf, vf, table, seqlens_k)
    k, v, cu_k = paged_gather(kf, vf, table, seqlens_k)
    cq = torch.arange(q.shape[0] + 1, dtype=torch.int32, device="cuda")
    check_fp8_against(out, lse, q, k, v, cq, cu_k, True, ref, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_decode_rows(dtype, causal):
    """Decode and speculative rows (up to 4 rows x 4 heads a kv head) with long, empty and one-key requests."""
    Hq, Hkv, D = 32, 8, 128
    q_lens, k_lens = [1, 1, 4, 1, 2, 1], [4097, 0, 33000, 1, 63, 65]
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    k8, kd = fp8_kv(torch.randn(sum(k_lens), Hkv, D, dtype=dtype, device="cuda"))
    v8, vd = fp8_kv(torch.randn(sum(k_lens), Hkv, D, dtype=dtype, device="cuda"))
    kf, vf = fp8_values(k8, kd), fp8_values(v8, vd)
    cq, ck = cu(q_lens), cu(k_lens)
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.varlen_attention(q, k8, v8, cq, ck, max_seqlen_q=4, max_seqlen_k=33000, causal=causal,
                                        k_descale=kd, v_descale=vd, return_lse=True, out=out, check=True)
    ref, ref_lse = varlen_reference(q, kf, vf, cq, ck, causal=causal)
    check_fp8_against(out, lse, q, kf, vf, cq, ck, causal, ref, ref_lse)


def run_fp8_varlen(q, k8, v8, k_lens, kd, vd):
    cq, ck = cu([1] * len(k_lens)), cu(k_lens)
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.varlen_attention(q, k8, v8, cq, ck, max_seqlen_q=1, max_seqlen_k=max(k_lens), k_descale=kd,
                                        v_descale=vd, return_lse=True, out=out, check=True)
    kf, vf = fp8_values(k8, kd), fp8_values(v8, vd)
    ref, ref_lse = varlen_reference(q, kf, vf, cq, ck)
    check_fp8_against(out, lse, q, kf, vf, cq, ck, False, ref, ref_lse)


@pytest.mark.parametrize("descale", ["none", "number", "one", "per_head"])
def test_fp8_descale_forms(descale):
    """Descale factors as None (1), a number, a one-value tensor and one a kv head."""
    dtype, Hq, Hkv, D = torch.bfloat16, 16, 4, 128
    k_lens = [300, 4000, 1]
    q = torch.randn(len(k_lens), Hq, D, dtype=dtype, device="cuda")
    k8 = (torch.randn(sum(k_lens), Hkv, D, device="cuda") * 4).to(torch.float8_e4m3fn)
    v8 = (torch.randn(sum(k_lens), Hkv, D, device="cuda") * 4).to(torch.float8_e4m3fn)
    kd = {"none": None, "number": 0.1, "one": torch.tensor([0.2], device="cuda"),
          "per_head": torch.rand(Hkv, device="cuda") / 5 + 0.05}[descale]
    vd = {"none": None, "number": 0.5, "one": torch.tensor(0.25, device="cuda"),
          "per_head": torch.rand(Hkv, device="cuda") + 0.1}[descale]
    run_fp8_varlen(q, k8, v8, k_lens, kd, vd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_query_beyond_fp16_range(dtype):
    """q as large as bf16 allows past fp16's range (the decode blocks stage it in fp16 under a power-of-two scale),
    with small K factors, so that the scores stay moderate."""
    Hq, Hkv, D = 8, 2, 64
    k_lens = [1000, 17]
    big = 3e5 if dtype == torch.bfloat16 else 2e4
    q = (torch.randn(len(k_lens), Hq, D, device="cuda") * big).clamp(-6e4, 6e4).to(dtype)
    k8, v8 = (torch.randn(sum(k_lens), Hkv, D, device="cuda") * 8).to(torch.float8_e4m3fn), \
        torch.randn(sum(k_lens), Hkv, D, device="cuda").to(torch.float8_e4m3fn)
    run_fp8_varlen(q, k8, v8, k_lens, torch.full((Hkv,), 0.5 / big, device="cuda"), None)


def test_fp8_variants_and_mass():
    """gpt-oss's decode (a window and sinks) and softcap on an FP8 cache; the mass per key of one-row requests from
    the stored scores."""
    dtype, Hq, Hkv, D, bs = torch.bfloat16, 32, 8, 64, 16
    seqlens = [700, 0, 129, 3000]
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages(seqlens, bs, Hkv, D, dtype)
    q = torch.randn(len(seqlens), Hq, D, dtype=dtype, device="cuda")
    sinks = torch.randn(Hq, device="cuda")
    k, v, cu_k = paged_gather(kf, vf, table, seqlens_k)
    cq = torch.arange(len(seqlens) + 1, dtype=torch.int32, device="cuda")
    for kw in (dict(window=(128, 0), sinks=sinks), dict(softcap=30.0)):
        out = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, k_descale=kd, v_descale=vd, check=True, **kw)
        plain = attn_lt.varlen_attention(q, k.to(dtype), v.to(dtype), cq, cu_k, max_seqlen_q=1, max_seqlen_k=3000,
                                         causal=True, **kw)
        assert rel_error(out, plain) < 3e-2, kw  # against the bf16 call on the same values
    out, mass = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, k_descale=kd, v_descale=vd,
                                        return_key_mass=True)
    ref = varlen_key_mass_reference(q, k, cq, cu_k, causal=True)
    for b, n in enumerate(seqlens):
        got = mass[b, :, :n].double()
        want = ref[:, cu_k[b]:cu_k[b] + n]
        assert torch.allclose(got, want, rtol=2e-2, atol=1e-4), b
        assert (mass[b, :, n:] == 0).all()


def test_fp8_bad_block_reported_and_refusals():
    dtype, Hq, Hkv, D, bs = torch.float16, 16, 4, 128, 16
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages([100, 200], bs, Hkv, D, dtype)
    q = torch.randn(2, Hq, D, dtype=dtype, device="cuda")
    check_bad_block_reported(lambda t: attn_lt.paged_attention(q, k8, v8, t, seqlens_k, k_descale=kd, v_descale=vd),
                             table, 1, 3, k8.shape[0])
    with pytest.raises(ValueError, match="FP8 KV cache"):  # factors for a 16-bit cache
        attn_lt.paged_attention(q, kf.to(dtype), vf.to(dtype), table, seqlens_k, k_descale=kd)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        attn_lt.paged_attention(q, k8, v8, table, seqlens_k, k_descale=torch.ones(3, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_fp8_cache_with_prefill_rows(dtype, block_size):
    """Prefill chunks and decode rows in one call against a paged FP8 cache (converted to q's dtype first): lengths
    0, 1, block_size +- 1, a chunk of 512 rows against 3000 keys; permuted tables; per-head factors. Then the same
    with a window and sinks, the mass per key, packed (varlen) keys, and an out-of-range block id reported."""
    Hq, Hkv, D, bs = 16, 4, 128, block_size
    seqlens, q_lens = [0, 1, bs - 1, bs + 1, 3000, 700], [0, 1, bs - 1, 5, 512, 1]
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages(seqlens, bs, Hkv, D, dtype)
    cq = cu(q_lens)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=512, k_descale=kd,
                                       v_descale=vd, return_lse=True, out=out, check=True)
    ref, ref_lse = paged_reference(q, kf, vf, table, seqlens_k, cu_seqlens_q=cq)
    k, v, ck = paged_gather(kf, vf, table, seqlens_k)
    check_fp8_against(out, lse, q, k, v, cq, ck, True, ref, ref_lse)
    # equal to the 16-bit call on the converted values, plain, with the variants and with the mass; the blocks no
    # request uses poisoned (NaN, never read) and the table's entries past each request's keys out of range (never
    # read: nothing reported)
    used = torch.cat([table[b, :-(-n // bs)] for b, n in enumerate(seqlens)]).long()
    spare = torch.ones(k8.shape[0], dtype=torch.bool, device="cuda")
    spare[used] = False
    spare[0] = False  # (block 0 stays finite: the 16-bit kernels read it in place of pages past the keys)
    for x in (k8, v8):
        x.view(torch.uint8)[spare] = 0x7F  # e4m3 NaN
    for b, n in enumerate(seqlens):
        table[b, -(-n // bs):] = -7 if b % 2 else k8.shape[0] + 11
    sinks = torch.randn(Hq, device="cuda")
    k16, v16 = fp8_values(k8, kd).to(dtype), fp8_values(v8, vd).to(dtype)
    for kw in (dict(), dict(window=(100, 0), sinks=sinks), dict(return_key_mass=True, key_mass_window=64)):
        got = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=512,
                                      k_descale=kd, v_descale=vd, check=True, **kw)
        want = attn_lt.paged_attention(q, k16, v16, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=512, **kw)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(g, w), kw
    # packed keys
    kp, kdp = fp8_kv(torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device="cuda"))
    vp, vdp = fp8_kv(torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device="cuda"))
    out, lse = attn_lt.varlen_attention(q, kp, vp, cq, ck, max_seqlen_q=512, max_seqlen_k=3000, causal=True,
                                        k_descale=kdp, v_descale=vdp, return_lse=True, check=True)
    kpf, vpf = fp8_values(kp, kdp), fp8_values(vp, vdp)
    ref, ref_lse = varlen_reference(q, kpf, vpf, cq, ck, causal=True)
    check_fp8_against(out, lse, q, kpf, vpf, cq, ck, True, ref, ref_lse)
    # a block id outside the cache in the chunk's row: skipped and reported
    check_bad_block_reported(lambda t: attn_lt.paged_attention(q, k8, v8, t, seqlens_k, cu_seqlens_q=cq,
                                                               max_seqlen_q=512, k_descale=kd, v_descale=vd),
                             table, 4, 2, k8.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,max_q", [(8, 5), (4, 8)])
def test_fp8_speculative_rows_on_decode_blocks(dtype, Hkv, max_q):
    """Up to 64 query rows a kv head at capacity (speculative decoding: 5 rows a request x GQA 4, 8 x GQA 8) on the
    FP8 decode blocks, a 16-row block for each 16 reading the same key tiles: requests of 0 to max_q rows against 0,
    1, 15, 17, 700 and 3000 keys (the long ones in parts, merged), permuted tables, paged and packed keys, against
    FP64 on the cache's values; explain says so; a bad block in a long request reported."""
    Hq, D, bs = 32, 128, 16
    seqlens, q_lens = [0, 1, 15, 17, 700, 3000], [0, 1, max_q, 2, max_q, max_q - 1]
    assert "blocks of 16 rows a kv head" in attn_lt.explain_batch(
        len(seqlens), Hq, Hkv, D, max_seqlen_q=max_q, max_seqlen_k=3008, block_size=bs, kv_dtype=torch.float8_e4m3fn)
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages(seqlens, bs, Hkv, D, dtype)
    cq = cu(q_lens)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=max_q,
                                       k_descale=kd, v_descale=vd, return_lse=True, out=out, check=True)
    ref, ref_lse = paged_reference(q, kf, vf, table, seqlens_k, cu_seqlens_q=cq)
    k, v, ck = paged_gather(kf, vf, table, seqlens_k)
    check_fp8_against(out, lse, q, k, v, cq, ck, True, ref, ref_lse)
    kp, kdp = fp8_kv(torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device="cuda"))
    vp, vdp = fp8_kv(torch.randn(int(ck[-1]), Hkv, D, dtype=dtype, device="cuda"))
    out, lse = attn_lt.varlen_attention(q, kp, vp, cq, ck, max_seqlen_q=max_q, max_seqlen_k=3000, causal=True,
                                        k_descale=kdp, v_descale=vdp, return_lse=True, check=True)
    kpf, vpf = fp8_values(kp, kdp), fp8_values(vp, vdp)
    ref, ref_lse = varlen_reference(q, kpf, vpf, cq, ck, causal=True)
    check_fp8_against(out, lse, q, kpf, vpf, cq, ck, True, ref, ref_lse)
    # a BatchStep of the same capacity: the same plan, the same bits
    step = attn_lt.BatchStep(len(seqlens), Hq, Hkv, D, max_seqlen_k=table.shape[1] * bs, max_seqlen_q=max_q,
                             block_size=bs, dtype=dtype, kv_dtype=torch.float8_e4m3fn)
    step.plan(cq, seqlens_k, table)
    one_call = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=max_q,
                                       k_descale=kd, v_descale=vd)
    assert torch.equal(step.run(q, k8, v8, k_descale=kd, v_descale=vd), one_call)
    check_bad_block_reported(lambda t: attn_lt.paged_attention(q, k8, v8, t, seqlens_k, cu_seqlens_q=cq,
                                                               max_seqlen_q=max_q, k_descale=kd, v_descale=vd),
                             table, 5, 100, k8.shape[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv,max_q,D", [(32, 8, 5, 128), (32, 4, 8, 128), (32, 1, 1, 128), (48, 1, 1, 64),
                                             (64, 8, 8, 128), (16, 2, 5, 256), (32, 8, 6, 64)])
def test_speculative_rows_on_decode_blocks(dtype, Hq, Hkv, max_q, D):
    """A 16-bit cache's capacity of up to 64 query rows a kv head (speculative decoding: 5 rows x GQA 4, 8 x GQA 8;
    one row of a group of 32 or 48 heads) on the decode blocks, a 16-row block for each 16 reading the same key
    tiles: requests of 0 to max_q rows against 0, 1, 15, 17, 700 and 3000 keys (the long ones in parts, merged),
    permuted tables, paged and packed keys; a BatchStep's bits equal the call's; the mass of many-row requests."""
    bs = 16
    seqlens, q_lens = [0, 1, 15, 17, 700, 3000], [0, 1, max_q, min(2, max_q), max_q, max(max_q - 1, 1)]
    plan = batch.plan_batch(len(seqlens), Hq, Hkv, D, max_seqlen_q=max_q, max_seqlen_k=3008, block_size=bs)
    rows = Hq // Hkv * max_q
    assert plan.decode_rows == -(-rows // 16) * 16 and plan.row_kernel is None
    k_cache, v_cache, table, seqlens_k = random_pages(seqlens, bs, Hkv, D, dtype)
    cq = cu(q_lens)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    out = torch.full_like(q, math.nan)
    out, lse = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=max_q,
                                       return_lse=True, out=out, check=True)
    ref, ref_lse = paged_reference(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cq)
    k, v, ck = paged_gather(k_cache, v_cache, table, seqlens_k)
    check_against(out, lse, ref, ref_lse, torch_varlen(q, k, v, cq, ck, True))
    out, lse = attn_lt.varlen_attention(q, k, v, cq, ck, max_seqlen_q=max_q, max_seqlen_k=3000, causal=True,
                                        return_lse=True, check=True)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, causal=True)
    check_against(out, lse, ref, ref_lse, torch_varlen(q, k, v, cq, ck, True))
    step = attn_lt.BatchStep(len(seqlens), Hq, Hkv, D, max_seqlen_k=table.shape[1] * bs, max_seqlen_q=max_q,
                             block_size=bs, dtype=dtype)
    step.plan(cq, seqlens_k, table)
    one_call, one_mass = attn_lt.paged_attention(q, k_cache, v_cache, table, seqlens_k, cu_seqlens_q=cq,
                                                 max_seqlen_q=max_q, return_key_mass=True)
    got, mass = step.run(q, k_cache, v_cache, return_key_mass=True)
    assert torch.equal(got, one_call) and torch.equal(mass, one_mass)
    want = varlen_key_mass_reference(q, k, cq, ck, causal=True)
    for b, n in enumerate(seqlens):
        assert torch.allclose(mass[b, :, :n].double(), want[:, ck[b]:ck[b] + n], rtol=1e-3, atol=1e-6), b
    check_bad_block_reported(lambda t: attn_lt.paged_attention(q, k_cache, v_cache, t, seqlens_k, cu_seqlens_q=cq,
                                                               max_seqlen_q=max_q), table, 5, 100, k_cache.shape[0])


@pytest.mark.parametrize("hopper", [True, False])
def test_group_rows_beside_prefill_rows(hopper, monkeypatch):
    """A capacity with prefill rows and a group of 32 heads a kv head: the one-row requests on two 16-row decode
    blocks a kv head, the longer ones on row blocks, in one call."""
    facts_with(monkeypatch, hopper)
    dtype, Hq, Hkv, D = torch.bfloat16, 32, 1, 64
    q_lens, k_lens = [1, 300, 1, 0, 2, 1], [5000, 700, 0, 9, 3000, 64]
    plan = batch.plan_batch(len(q_lens), Hq, Hkv, D, max_seqlen_q=300, max_seqlen_k=5000)
    assert plan.decode_rows == 32 and plan.row_kernel == ("sm90" if hopper else "flash")
    run_varlen(q_lens, k_lens, Hq, Hkv, D, dtype, True)


def test_fp8_step_mass_of_speculative_rows():
    """A BatchStep on an FP8 cache with speculative rows returns the mass (its cache converted for it, the plan the
    same as the decode blocks')."""
    dtype, Hq, Hkv, D, bs, max_q = torch.bfloat16, 32, 8, 128, 16, 5
    seqlens, q_lens = [700, 0, 3000, 17], [5, 1, 4, 2]
    k8, v8, table, seqlens_k, kd, vd, kf, vf = fp8_pages(seqlens, bs, Hkv, D, dtype)
    cq = cu(q_lens)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    step = attn_lt.BatchStep(len(seqlens), Hq, Hkv, D, max_seqlen_k=table.shape[1] * bs, max_seqlen_q=max_q,
                             block_size=bs, dtype=dtype, kv_dtype=torch.float8_e4m3fn)
    step.plan(cq, seqlens_k, table)
    out, mass = step.run(q, k8, v8, k_descale=kd, v_descale=vd, return_key_mass=True)
    want_out, want_mass = attn_lt.paged_attention(q, k8, v8, table, seqlens_k, cu_seqlens_q=cq, max_seqlen_q=max_q,
                                                  k_descale=kd, v_descale=vd, return_key_mass=True)
    assert torch.equal(out, want_out) and torch.equal(mass, want_mass)
    k, _, ck = paged_gather(kf, vf, table, seqlens_k)
    ref = varlen_key_mass_reference(q, k.to(dtype), cq, ck, causal=True)
    for b, n in enumerate(seqlens):
        assert torch.allclose(mass[b, :, :n].double(), ref[:, ck[b]:ck[b] + n], rtol=2e-2, atol=1e-4), b
    attn_lt.check_batch_errors()


def test_fp8_step_graph_replay():
    """BatchStep with an FP8 cache: one capture, replays after new plans and new descale values equal eager calls."""
    rng = random.Random(3)
    dtype, cap, Hq, Hkv, D, bs, max_blocks = torch.bfloat16, 8, 32, 8, 128, 16, 64
    num_blocks = cap * max_blocks
    k8, kd = fp8_kv(torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda"))
    v8, vd = fp8_kv(torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device="cuda"))
    step = attn_lt.BatchStep(cap, Hq, Hkv, D, max_seqlen_k=max_blocks * bs, block_size=bs, dtype=dtype,
                             kv_dtype=torch.float8_e4m3fn)
    q = torch.randn(cap, Hq, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    table = torch.randperm(num_blocks).to(torch.int32).view(cap, max_blocks).cuda()
    step.plan(None, torch.full((cap,), 100, dtype=torch.int32, device="cuda"), table)
    graph = captured(lambda: step.run(q, k8, v8, out=out, k_descale=kd, v_descale=vd))
    for it in range(20):
        lens = torch.tensor([rng.randrange(0, max_blocks * bs + 1) for _ in range(cap)], dtype=torch.int32).cuda()
        tab = torch.randperm(num_blocks).to(torch.int32).view(cap, max_blocks).cuda()
        step.plan(None, lens, tab)
        kd.mul_(1.01)
        q.copy_(torch.randn_like(q))
        out.fill_(math.nan)
        graph.replay()
        eager = attn_lt.paged_attention(q, k8, v8, tab, lens, k_descale=kd, v_descale=vd)
        assert rel_error(out, eager) < 1e-2, f"iteration {it}"
    attn_lt.check_batch_errors()


@pytest.mark.parametrize("paged", [True, False])
def test_fp8_step_with_prefill_rows(paged):
    """BatchStep on an FP8 cache with prefill chunks (converted first, as the batch calls convert it): one capture
    replayed after new plans (requests joining and leaving, new lengths and tables) and new factor values equals a
    16-bit step on the converted values, bitwise; so do the LSE and the mass of an eager run."""
    rng = random.Random(7)
    dtype, cap, Hq, Hkv, D, bs, max_q, max_blocks = torch.bfloat16, 4, 16, 4, 128, 16, 96, 32
    max_k = max_blocks * bs
    kw = dict(max_seqlen_k=max_k, max_seqlen_q=max_q, block_size=bs if paged else 0, dtype=dtype)
    step = attn_lt.BatchStep(cap, Hq, Hkv, D, kv_dtype=torch.float8_e4m3fn, **kw)
    twin = attn_lt.BatchStep(cap, Hq, Hkv, D, **kw)
    assert "converted to q's dtype first" in step.explain()
    shape = (cap * max_blocks + 3, bs, Hkv, D) if paged else (cap * max_k, Hkv, D)
    k8, kd = fp8_kv(torch.randn(shape, dtype=dtype, device="cuda"))
    v8, vd = fp8_kv(torch.randn(shape, dtype=dtype, device="cuda"))
    q = torch.randn(cap * max_q, Hq, D, dtype=dtype, device="cuda")

    def new_plan() -> int:
        B = rng.randrange(1, cap + 1)
        q_lens = [rng.choice([1, rng.randrange(0, max_q + 1)]) for _ in range(B)]
        k_lens = [rng.randrange(n, max_k + 1) for n in q_lens]
        table = torch.randperm(shape[0])[:B * max_blocks].to(torch.int32).view(B, max_blocks).cuda()
        for st in (step, twin):
            if paged:
                st.plan(cu(q_lens), torch.tensor(k_lens, dtype=torch.int32, device="cuda"), table)
            else:
                st.plan(cu(q_lens), cu_seqlens_k=cu(k_lens))
        return sum(q_lens)

    def converted():
        return fp8_values(k8, kd).to(dtype), fp8_values(v8, vd).to(dtype)

    rows = new_plan()
    out = torch.empty_like(q)
    graph = captured(lambda: step.run(q, k8, v8, out=out, k_descale=kd, v_descale=vd))
    for it in range(12):
        rows = new_plan()
        kd.mul_(1.01)
        q.copy_(torch.randn_like(q))
        out.fill_(math.nan)
        graph.replay()
        assert torch.equal(out[:rows], twin.run(q, *converted())[:rows]), f"iteration {it}"
    got = step.run(q, k8, v8, k_descale=kd, v_descale=vd, return_lse=True, return_key_mass=True, key_mass_window=8)
    want = twin.run(q, *converted(), return_lse=True, return_key_mass=True, key_mass_window=8)
    assert torch.equal(got[0][:rows], want[0][:rows]) and torch.equal(got[1][:, :rows], want[1][:, :rows])
    assert torch.equal(got[2], want[2])
    attn_lt.check_batch_errors()


@pytest.mark.parametrize("paged", [True, False])
def test_step_returns_the_mass(paged):
    """BatchStep.run(return_key_mass=True): the mass of the one-call form on the same requests (a decode row, a
    one-key request, one without keys, a prefill chunk summed over its last 8 rows); requests past the planned ones
    get zeros."""
    dtype, Hq, Hkv, D, bs, cap = torch.bfloat16, 16, 4, 64, 16, 6
    k_lens, q_lens = [700, 1, 0, 300], [1, 1, 1, 20]
    kw = dict(max_seqlen_q=32, max_seqlen_k=1024)
    step = attn_lt.BatchStep(cap, Hq, Hkv, D, block_size=bs if paged else 0, dtype=dtype, **kw)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device="cuda")
    if paged:
        kc, vc, table, seqlens = random_pages(k_lens, bs, Hkv, D, dtype)
        step.plan(cu(q_lens), seqlens, table)
        _, ref = attn_lt.paged_attention(q, kc, vc, table, seqlens, cu_seqlens_q=cu(q_lens), return_key_mass=True,
                                         key_mass_window=8, **kw)
    else:
        kc, vc = (torch.randn(sum(k_lens), Hkv, D, dtype=dtype, device="cuda") for _ in range(2))
        step.plan(cu(q_lens), cu_seqlens_k=cu(k_lens))
        _, ref = attn_lt.varlen_attention(q, kc, vc, cu(q_lens), cu(k_lens), causal=True, return_key_mass=True,
                                          key_mass_window=8, **kw)
    out, mass = step.run(q, kc, vc, return_key_mass=True, key_mass_window=8)
    got = mass[:len(k_lens)] if paged else mass
    assert not torch.isnan(out).any() and torch.allclose(got, ref, rtol=1e-3, atol=1e-6)
    if paged:
        assert (mass[len(k_lens):] == 0).all()
    attn_lt.check_batch_errors()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,q_scale", [(16, 1.0), (128, 1.0), (64, 3e5)])
def test_fp8_mla_paged_decode(dtype, Hq, q_scale):
    """MLA decode on an FP8 latent cache (e4m3, one factor): lengths 0, 1, around a tile and a block, requests of
    one part and of several, a permuted block table, unwritten slots NaN; q past fp16's range (q_scale, bf16) with
    a small factor. Against FP64 on the cache's values."""
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    if q_scale > 1 and dtype != torch.bfloat16:
        pytest.skip("q past fp16's range is a bf16 case")
    bs = 64
    seqlens = [0, 1, 63, 64, 65, 5000, 1000, 3 * bs + 7, 2500]
    k_cache, _, table, seqlens_k = mla_cache(seqlens, bs, 1, dtype, poison_unused=False)
    k8, kd = fp8_kv(k_cache)
    kd = kd / q_scale
    k8.view(torch.uint8)[~owned_slots(k8, table, seqlens)] = 0x7F  # e4m3 NaN
    kf = fp8_values(k8, kd)
    q = (torch.randn(len(seqlens), Hq, 576, device="cuda") * q_scale).to(dtype)
    out = torch.full((len(seqlens), Hq, 512), math.nan, dtype=dtype, device="cuda")
    out, lse = attn_lt.paged_attention(q, k8, k8[..., :512], table, seqlens_k, k_descale=kd, v_descale=kd * q_scale,
                                       return_lse=True, out=out, check=True)
    vf = fp8_values(k8[..., :512], kd * q_scale)
    ref, ref_lse = paged_reference(q, kf, vf, table, seqlens_k, causal=False)
    check_against(out, lse, ref, ref_lse, mla_torch(q, kf.to(dtype), vf.to(dtype), table, seqlens_k))


def test_fp8_mla_graph_replay_and_step():
    """An FP8 MLA decode step (BatchStep) captured once in a CUDA graph, replayed after each plan of new lengths."""
    if not device_facts().hopper:
        pytest.skip("MLA decode on a paged cache runs on the Hopper kernel")
    dtype, B, Hq, bs, max_blocks = torch.bfloat16, 6, 128, 64, 40
    lat8, kd = fp8_kv(torch.randn(B * max_blocks, bs, 1, 576, dtype=dtype, device="cuda"))
    table = torch.randperm(B * max_blocks).to(torch.int32).view(B, max_blocks).cuda()
    seqlens = torch.ones(B, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 576, dtype=dtype, device="cuda")
    out = torch.empty(B, Hq, 512, dtype=dtype, device="cuda")
    step = attn_lt.BatchStep(B, Hq, 1, 576, head_dim_v=512, max_seqlen_k=max_blocks * bs, block_size=bs,
                             kv_dtype=torch.float8_e4m3fn, dtype=dtype)
    step.plan(seqlens_k=seqlens, block_table=table)
    assert "FP8 latent cache" in step.explain()

    def call():
        step.run(q, lat8, lat8[..., :512], out=out, k_descale=kd, v_descale=kd)

    graph = captured(call)
    kf = fp8_values(lat8, kd)
    for lengths in ([1, 0, 64, 65, 700, 2559], [2000, 1, 129, 1500, 63, 2560]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        step.plan(seqlens_k=seqlens, block_table=table)
        out.fill_(math.nan)
        graph.replay()
        ref, _ = paged_reference(q, kf, kf[..., :512], table, seqlens, causal=False)
        owned = torch.tensor([n > 0 for n in lengths], device="cuda")
        assert not torch.isnan(out[owned]).any()
        assert rel_error(out[owned], ref[owned]) < 1e-2


def test_torch_compile_of_the_batch_calls():
    """torch.compile (fullgraph) of a serving step's attention: a packed prefill with a window, softcap and sinks,
    and paged decode with the mass per key, equal to the eager calls; new lengths, tables and a new total of query
    rows run without recompiling past the first dynamic shape."""
    import torch._dynamo.testing

    Hq, Hkv, D, bs = 8, 2, 128, 16
    sinks = torch.randn(Hq, device="cuda")
    k_cache = torch.randn(64, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)

    def step(q, k, v, cu_q, cu_k, q1, table, lengths):
        pre, lse = attn_lt.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=512, max_seqlen_k=1024, causal=True,
                                            window=(100, 0), softcap=30.0, sinks=sinks, return_lse=True)
        dec, mass = attn_lt.paged_attention(q1, k_cache, v_cache, table, lengths, return_key_mass=True)
        return pre, lse, dec, mass

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    torch.manual_seed(0)
    for q_lens in ([300, 1, 77], [5, 400, 0], [512, 2, 9]):
        k_lens = [n + 50 for n in q_lens]
        q = torch.randn(sum(q_lens), Hq, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(sum(k_lens), Hkv, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        table = torch.randperm(64, device="cuda").to(torch.int32).view(4, 16)
        lengths = torch.randint(0, 16 * bs, (4,), dtype=torch.int32, device="cuda")
        q1 = torch.randn(4, Hq, D, dtype=torch.bfloat16, device="cuda")
        args = (q, k, v, cu(q_lens), cu(k_lens), q1, table, lengths)
        got, want = compiled(*args), step(*args)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert counter.frame_count <= 2  # the first shapes, then dynamic ones
    attn_lt.check_batch_errors()


def test_torch_compile_cuda_graphs_replay_new_lengths():
    """torch.compile's CUDA graphs (mode="reduce-overhead") over paged decode: each call with new lengths and a new
    block table (same shapes) replays the captured graph and equals the eager call."""
    Hq, Hkv, D, bs, B = 16, 4, 128, 16, 8
    k_cache = torch.randn(B * 32, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)

    def decode(q, table, lengths):
        return attn_lt.paged_attention(q, k_cache, v_cache, table, lengths, window=(64, 0))

    compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    rng = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(6):
        q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=rng)
        table = torch.randperm(B * 32, device="cuda", generator=rng).to(torch.int32).view(B, 32)
        lengths = torch.randint(0, 32 * bs, (B,), dtype=torch.int32, device="cuda", generator=rng)
        got = compiled(q, table, lengths).clone()
        assert torch.equal(got, decode(q, table, lengths))
    attn_lt.check_batch_errors()
