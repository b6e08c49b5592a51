"""Context parallelism (attn_lt.distributed): sharding, the causal block schedule, the communication rule, input
checks, and multi-process runs over gloo on CPU (2, 3 and 4 processes, the plain-PyTorch reference as the local
attention) equal to the attention of the whole sequence. The GPU test (NCCL, 2 GPUs) runs attn_lt's own paths."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attn_lt.distributed as cp
from attn_lt.distributed import (Block, block_schedule, choose_comm, context_parallel_attention, rank_chunks,
                                 shard, unshard)
from attn_lt.testing import attention_reference, rel_error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- sharding ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dim", [2, -1, 0])
def test_shard_unshard_round_trip(world, layout, dim):
    x = torch.randn(2 * world * 3, 3, 2 * world * 5, 2 * world * 7)
    parts = [shard(x, r, world, layout, dim) for r in range(world)]
    assert all(p.is_contiguous() and p.shape[dim] == x.shape[dim] // world for p in parts)
    assert torch.equal(unshard(parts, layout, dim), x)


def test_zigzag_ownership():
    world, c = 4, 3
    x = torch.arange(2 * world * c)
    for r in range(world):
        assert rank_chunks(r, world) == (r, 2 * world - 1 - r)
        late = 2 * world - 1 - r
        want = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange(late * c, (late + 1) * c)])
        assert torch.equal(shard(x, r, world, "zigzag", dim=0), want)
        assert torch.equal(shard(x, r, world, "contiguous", dim=0), torch.arange(r * 2 * c, (r + 1) * 2 * c))


def test_shard_errors():
    with pytest.raises(ValueError, match=r"\(1, 2, 10, 4\).*divisible by 12"):
        shard(torch.zeros(1, 2, 10, 4), 0, 6)
    with pytest.raises(ValueError, match="layout"):
        shard(torch.zeros(1, 2, 12, 4), 0, 2, "striped")
    with pytest.raises(ValueError, match="rank"):
        shard(torch.zeros(1, 2, 12, 4), 2, 2)
    with pytest.raises(ValueError, match="one shape"):
        unshard([torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 6, 2)])


# ---- the causal block schedule -----------------------------------------------------------------------------------

def _coverage(world, layout, causal, split_cols):
    """Per rank: {(query chunk, key chunk): 'full' | 'diag'} over all ring steps, and the blocks of each step."""
    result = []
    for r in range(world):
        qc = rank_chunks(r, world, layout)
        cov, steps = {}, []
        for t in range(world):
            kc = rank_chunks((r - t) % world, world, layout)
            blocks = block_schedule(qc, kc, causal, split_cols)
            steps.append((kc, blocks))
            for b in blocks:
                if split_cols:
                    assert all(kc[j] == kc[j - 1] + 1 for j in range(b.k0 + 1, b.k1)), (b, kc)
                if b.causal:
                    assert b.q1 - b.q0 == b.k1 - b.k0
                for i in range(b.q0, b.q1):
                    for j in range(b.k0, b.k1):
                        g, h = qc[i], kc[j]
                        li, lj = i - b.q0, j - b.k0
                        if b.causal and lj > li:
                            assert h > g, "a causal block masks only future chunks"
                            continue
                        kind = "diag" if b.causal and lj == li else "full"
                        assert (g, h) not in cov, f"pair {(g, h)} computed twice"
                        cov[(g, h)] = kind
        result.append((qc, cov, steps))
    return result


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_cols", [False, True])
def test_block_schedule_covers_each_allowed_pair_once(world, layout, causal, split_cols):
    nchunks = world * len(rank_chunks(0, world, layout))
    for qc, cov, steps in _coverage(world, layout, causal, split_cols):
        for g in qc:
            for h in range(nchunks):
                if not causal:
                    assert cov[(g, h)] == "full"
                elif h < g:
                    assert cov[(g, h)] == "full", "a past chunk runs without the causal mask"
                elif h == g:
                    assert cov[(g, h)] == "diag", "the diagonal chunk runs with the causal mask"
                else:
                    assert (g, h) not in cov, "future chunks are never computed"
        if layout == "zigzag" and not split_cols:
            assert all(len(blocks) <= 1 for _, blocks in steps), "zigzag: one local call per ring step"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    def work(layout):
        return [sum(1 if k == "full" else 0.5 for k in cov.values()) for _, cov, _ in
                _coverage(world, layout, True, False)]
    # rank r's chunks r and 2N-1-r see r + 0.5 and 2N-1-r + 0.5 chunks of keys: 2N whatever r
    assert work("zigzag") == [2 * world] * world
    contiguous = work("contiguous")
    assert contiguous == [r + 0.5 for r in range(world)]


def test_block_schedule_examples():
    # zigzag, 4 ranks, rank 1 holds chunks (1, 6): own K/V -> one causal call over the concatenation
    assert block_schedule((1, 6), (1, 6), True) == (Block(0, 2, 0, 2, True),)
    # K/V of rank 0 (chunks 0, 7): both query chunks see chunk 0, neither sees chunk 7
    assert block_schedule((1, 6), (0, 7), True) == (Block(0, 2, 0, 1, False),)
    # K/V of rank 2 (chunks 2, 5): only the late query chunk 6 sees them, both
    assert block_schedule((1, 6), (2, 5), True) == (Block(1, 2, 0, 2, False),)
    # with a mask sliced by columns, chunks 2 and 5 are not adjacent: two calls
    assert block_schedule((1, 6), (2, 5), True, split_cols=True) == (Block(1, 2, 0, 1, False),
                                                                      Block(1, 2, 1, 2, False))
    assert block_schedule((1, 6), (1, 6), True, split_cols=True) == (
        Block(0, 1, 0, 1, True), Block(1, 2, 1, 2, True), Block(1, 2, 0, 1, False))


def test_choose_comm_rule():
    assert choose_comm(1, 1 << 40) == "ring"
    assert choose_comm(2, cp.ALLGATHER_MAX_KV_BYTES) == "allgather"
    assert choose_comm(8, cp.ALLGATHER_MAX_KV_BYTES + 1) == "ring"


def test_single_gpu_import_does_not_pull_in_distributed():
    code = "import sys, attn_lt; print('attn_lt.distributed' in sys.modules, 'attn_lt.merge' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "False"


# ---- one process (world 1) ---------------------------------------------------------------------------------------

@pytest.fixture
def world1():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_not_initialized_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("a process group is initialized")
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4, 4))


@pytest.mark.parametrize("causal", [False, True])
def test_world1_equals_reference(world1, causal):
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    out, lse = context_parallel_attention(q, k, v, causal=causal, return_lse=True,
                                          local_attention=attention_reference)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, return_lse=True)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)


def test_input_errors_name_shapes(world1):
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    ref = dict(local_attention=attention_reference)
    with pytest.raises(ValueError, match=r"causal.*q \(1, 4, 10, 8\), k \(1, 2, 12, 8\)"):
        context_parallel_attention(q, torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), causal=True, **ref)
    with pytest.raises(ValueError, match=r"zigzag.*even.*\(1, 4, 9, 8\)"):
        context_parallel_attention(q[:, :, :9], k[:, :, :9], v[:, :, :9], **ref)
    with pytest.raises(ValueError, match=r"attn_mask \(1, 1, 7, 10\)"):
        context_parallel_attention(q, k, v, attn_mask=torch.ones(1, 1, 7, 10, dtype=torch.bool), **ref)
    with pytest.raises(ValueError, match="comm"):
        context_parallel_attention(q, k, v, comm="alltoall", **ref)
    with pytest.raises(ValueError, match="layout"):
        context_parallel_attention(q, k, v, layout="striped", **ref)
    with pytest.raises(TypeError, match="dtype"):
        context_parallel_attention(q, k.double(), v, **ref)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv.*\(1, 3, 10, 8\)"):
        context_parallel_attention(q, torch.randn(1, 3, 10, 8), torch.randn(1, 3, 10, 8), **ref)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        context_parallel_attention(None, k, v, **ref)


def test_default_local_attention_refuses_cpu_before_communicating(world1):
    q = torch.randn(1, 2, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        context_parallel_attention(q, q, q)


# ---- several processes over gloo ---------------------------------------------------------------------------------

# (name, causal, layout, comm, Hq, Hkv, D, Dv, q chunk, k chunk, mask kind, return_lse)
CASES = [
    ("causal-zigzag-ring", True, "zigzag", "ring", 4, 4, 8, 8, 5, 5, None, True),
    ("causal-zigzag-allgather", True, "zigzag", "allgather", 4, 4, 8, 8, 5, 5, None, True),
    ("causal-contig-ring-gqa", True, "contiguous", "ring", 4, 2, 8, 8, 7, 7, None, True),
    ("causal-contig-allgather-gqa", True, "contiguous", "allgather", 4, 1, 8, 8, 7, 7, None, False),
    ("causal-zigzag-ring-gqa-auto", True, "zigzag", "auto", 6, 2, 8, 8, 3, 3, None, True),
    ("plain-zigzag-ring-sq-ne-sk", False, "zigzag", "ring", 4, 2, 8, 6, 3, 5, None, True),
    ("plain-contig-allgather", False, "contiguous", "allgather", 2, 2, 8, 8, 4, 6, None, True),
    ("mask-rows-zigzag-ring", False, "zigzag", "ring", 4, 2, 8, 8, 4, 4, "bool-rows", True),
    ("mask-full-causal-zigzag-ring", True, "zigzag", "ring", 4, 2, 8, 8, 4, 4, "float-full", True),
    ("mask-rows-causal-zigzag-allgather", True, "zigzag", "allgather", 4, 4, 8, 8, 4, 4, "bool-rows", True),
    ("mask-keypad-causal-contig-ring", True, "contiguous", "ring", 4, 2, 8, 8, 5, 5, "keypad", True),
    ("mask-dead-rows-ring", False, "zigzag", "ring", 2, 1, 8, 8, 3, 3, "dead-rows", True),
]


def _make_mask(kind, B, Hq, Sq, Sk, gen):
    if kind is None:
        return None
    if kind in ("bool-rows", "dead-rows"):
        m = torch.rand(B, 1, Sq, Sk, generator=gen) > 0.4
        if kind == "dead-rows":
            m[:, :, ::4] = False  # rows with every key masked: 0 and -inf
        return m
    if kind == "float-full":
        return torch.randn(1, Hq, Sq, Sk, generator=gen)
    if kind == "keypad":
        m = torch.ones(B, 1, 1, Sk, dtype=torch.bool)
        m[:, :, :, torch.randperm(Sk, generator=gen)[: Sk // 3]] = False
        m[:, :, :, 0] = True  # every causal row keeps a key
        return m
    raise AssertionError(kind)


def _run_case(rank, world, seed, case):
    name, causal, layout, comm, Hq, Hkv, D, Dv, cq, ck, mkind, ret_lse = case
    cpr = 2 if layout == "zigzag" else 1
    B, Sq, Sk = 2, cq * cpr * world, ck * cpr * world
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, Hq, Sq, D, generator=gen), torch.randn(B, Hkv, Sk, D, generator=gen), \
        torch.randn(B, Hkv, Sk, Dv, generator=gen)
    mask = _make_mask(mkind, B, Hq, Sq, Sk, gen)
    ref, ref_lse = attention_reference(q, k, v, attn_mask=mask, causal=causal, return_lse=True)  # float64 inside
    fp32, _ = attention_reference(q, k, v, attn_mask=mask, causal=causal, return_lse=True, dtype=torch.float32)
    ref64 = attention_reference(q.double(), k.double(), v.double(), attn_mask=mask, causal=causal)
    # a mask's rows: this rank's own (bool-rows) or the full mask, sliced inside (float-full, keypad)
    m = shard(mask, rank, world, layout) if mkind in ("bool-rows", "dead-rows") else mask
    trace = cp.CommTrace()
    res = context_parallel_attention(shard(q, rank, world, layout), shard(k, rank, world, layout),
                                     shard(v, rank, world, layout), causal=causal, attn_mask=m, layout=layout,
                                     comm=comm, return_lse=ret_lse, local_attention=attention_reference,
                                     trace=trace)
    out, lse = res if ret_lse else (res, None)
    assert out.shape == (B, Hq, Sq // world, Dv) and out.dtype == q.dtype, name
    assert not torch.isnan(out).any(), name
    mine = shard(ref64, rank, world, layout)
    bound = 2 * rel_error(shard(fp32, rank, world, layout), mine) + 1e-6
    assert rel_error(out, mine) <= bound, (name, rel_error(out, mine), bound)
    if ret_lse:
        want = shard(ref_lse, rank, world, layout)
        assert lse.dtype == torch.float32 and not torch.isnan(lse).any(), name
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want)), name
        fin = torch.isfinite(want)
        assert (lse[fin] - want[fin]).abs().max().item() <= 1e-5 * (1 + want[fin].abs().max().item()), name
    # every rank's rows together are the whole attention
    full = unshard(out, layout)
    assert rel_error(full, ref64) <= 2 * rel_error(fp32, ref64) + 1e-6, name
    summary = trace.summary()
    assert summary["compute"] >= 0 and summary["steps"] >= 1, name


def _disagreements(rank, world):
    """Inconsistent ranks raise on every rank (none is left waiting), and the group stays usable."""
    q = torch.randn(1, 2, 4, 8)
    ref = dict(local_attention=attention_reference)
    k = torch.randn(1, 2, 6 if rank == world - 1 else 4, 8)
    with pytest.raises(ValueError, match="disagree on Sk"):
        context_parallel_attention(q, k, k, **ref)
    bad_mask = torch.ones(1, 1, 3, 4 * world, dtype=torch.bool) if rank == 0 else None
    with pytest.raises(ValueError, match=r"attn_mask \(1, 1, 3|rank\(s\) \[0\] rejected"):
        context_parallel_attention(q, q, q, attn_mask=bad_mask, **ref)
    out = context_parallel_attention(q, q, q, **ref)  # still works
    assert out.shape == q.shape


def _worker(rank, world, port, seed, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for i, case in enumerate(cases):
            _run_case(rank, world, seed + i, case)
        _disagreements(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_processes_equal_full_attention(world):
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process (forked workers would inherit it)")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs each run; in the traceback on failure
    # fork (where there is one) starts the workers in well under a second; spawn re-imports torch in each
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_worker, args=(world, _free_port(), seed, CASES), nprocs=world, join=True,
                       start_method=method)


# ---- two GPUs over NCCL (the lead's 2-GPU machine) ---------------------------------------------------------------

# (name, S, Hq, Hkv, causal, layout, comm, backend, mask)
GPU_CASES = [
    ("causal-zigzag-ring-lt", 16384, 8, 8, True, "zigzag", "ring", "lt", False),
    ("causal-zigzag-ring-wmma-gqa", 16384, 8, 2, True, "zigzag", "ring", "wmma", False),
    ("causal-zigzag-allgather-auto", 8192, 8, 8, True, "zigzag", "allgather", "auto", False),
    ("causal-contig-ring-auto-gqa", 8192, 8, 2, True, "contiguous", "ring", "auto", False),
    ("plain-zigzag-ring-auto", 8192, 8, 8, False, "zigzag", "ring", "auto", False),
    ("mask-causal-zigzag-ring-lt", 8192, 8, 2, True, "zigzag", "ring", "lt", True),
    ("mask-plain-zigzag-allgather-lt", 4096, 8, 8, False, "zigzag", "allgather", "lt", True),
]


def _gpu_worker(rank, world, port, seed):
    from attn_lt.testing import reference, sdpa, tolerance

    import attn_lt

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        for i, (name, S, Hq, Hkv, causal, layout, comm, backend, with_mask) in enumerate(GPU_CASES):
            gen = torch.Generator(device="cuda").manual_seed(seed + i)
            q = torch.randn(1, Hq, S, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(1, Hkv, S, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(1, Hkv, S, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            mask = (torch.rand(1, 1, S, S, device="cuda", generator=gen) > 0.3) if with_mask else None
            out, lse = context_parallel_attention(
                shard(q, rank, world, layout), shard(k, rank, world, layout), shard(v, rank, world, layout),
                causal=causal, attn_mask=None if mask is None else shard(mask, rank, world, layout),
                layout=layout, comm=comm, backend=backend, return_lse=True)
            idx = torch.arange(0, S // world, 97, device="cuda")  # sampled local rows, and their global index
            rows = shard(torch.arange(S, device="cuda"), rank, world, layout, dim=0)[idx]
            ref, ref_lse = reference(q, k, v, mask, causal, rows=rows)
            got, got_lse = out[:, :, idx], lse[:, :, idx]
            torch_err = rel_error(sdpa(q, k, v, mask, causal)[:, :, rows], ref)
            single = attn_lt.attention(q, k, v, attn_mask=mask, causal=causal)[:, :, rows]
            err = rel_error(got, ref)
            assert err <= tolerance(torch_err), (name, err, torch_err, rel_error(single, ref))
            assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
            fin = torch.isfinite(ref_lse)
            assert (got_lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 * (1 + ref_lse[fin].abs().max().item())
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA GPUs (NCCL context parallelism)")
def test_two_gpus_nccl_equal_single_gpu():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    mp.spawn(_gpu_worker, args=(2, _free_port(), seed), nprocs=2, join=True)


# ---- the benchmark script, on CPU --------------------------------------------------------------------------------

def _load_bench():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench_cp.py")
    spec = importlib.util.spec_from_file_location("bench_cp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_plan_needs_no_gpu(capsys):
    bench = _load_bench()
    assert bench.main(["--plan", "--world", "8", "--seqlens", "262144,1048576"]) == 0
    text = capsys.readouterr().out
    assert "S=1048576: 9.01 PFLOP" in text and "choose_comm -> ring" in text


def _bench_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    bench = _load_bench()
    rc = bench.main(["--cpu-smoke", "--seqlens", "48,96", "--modes", "zigzag-ring,contiguous-allgather",
                     "--single-max-s", "48", "--reps", "1", "--check-rows", "8", "--out", out])
    assert rc == 0, f"bench_cp exited {rc}"


def test_bench_cpu_smoke_two_processes(tmp_path):
    """The whole benchmark program (sharded inputs, one-GPU baseline, both communications, the FP32 reference on
    sampled rows, the phase trace, the report) on CPU with gloo and the plain-PyTorch local attention."""
    import json

    if dist.is_initialized() or "fork" not in mp.get_all_start_methods():
        pytest.skip("needs fork and no process group in this process")
    mp.start_processes(_bench_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    res = json.loads((tmp_path / "results.json").read_text())
    rows = res["rows"]
    assert [(r["S"], r["mode"]) for r in rows] == [(48, "1-GPU"), (48, "zigzag-ring"), (48, "contiguous-allgather"),
                                                 (96, "zigzag-ring")]
    assert all(r["status"] == "ok" and r["check"] == "ok" for r in rows)
    assert rows[1]["ranks"] == 2 and len(rows[1]["ms_per_rank"]) == 2 and rows[3]["baseline_s"] == 48
    assert res["metadata"]["world"] == 2
