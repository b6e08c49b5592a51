"""Serving batches without a GPU: validation (errors before any GPU work, naming the shapes), the capacity plan and
``explain_batch``, and the request-by-request references the GPU tests compare against."""

import math

import pytest
import torch

import attn_lt
from attn_lt import batch
from attn_lt.fused import DeviceFacts
from attn_lt.validate import op_results
from attn_lt.testing import cu_seqlens, paged_gather, paged_reference, random_pages, reference, varlen_reference

H100 = DeviceFacts(132, True, 232448)
A100 = DeviceFacts(108, False, 166912)


def cu(lengths):
    return cu_seqlens(lengths, device="cpu")


def qkv(total_q=10, total_k=20, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16):
    return (torch.randn(total_q, Hq, D, dtype=dtype), torch.randn(total_k, Hkv, D, dtype=dtype),
            torch.randn(total_k, Hkv, D, dtype=dtype))


def test_public_names():
    for name in ("varlen_attention", "paged_attention", "explain_batch", "check_batch_errors"):
        assert name in attn_lt.__all__ and callable(getattr(attn_lt, name))


@pytest.mark.parametrize("change,error,match", [
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.randn(10, 8, 64)), TypeError, "float32"),
    (dict(k=torch.randn(20, 2, 64, dtype=torch.float16)), TypeError, "k and v must have q.s dtype"),
    (dict(q=torch.randn(1, 10, 8, 64, dtype=torch.bfloat16)), ValueError, r"q \(1, 10, 8, 64\)"),
    (dict(v=torch.randn(20, 2, 128, dtype=torch.bfloat16)), ValueError, r"v \(20, 2, 128\)"),
    (dict(q=torch.randn(10, 8, 96, dtype=torch.bfloat16), k=torch.randn(20, 2, 96, dtype=torch.bfloat16),
          v=torch.randn(20, 2, 96, dtype=torch.bfloat16)), ValueError, "head dim 96"),
    (dict(k=torch.randn(20, 3, 64, dtype=torch.bfloat16), v=torch.randn(20, 3, 64, dtype=torch.bfloat16)),
     ValueError, "multiple of Hkv"),
    (dict(cu_q=torch.tensor([0, 5, 10])), TypeError, "cu_seqlens_q must be torch.int32"),
    (dict(cu_k=torch.tensor([0, 20], dtype=torch.int32)), ValueError, r"cu_seqlens_k must be \(3,\)"),
    (dict(cu_q=torch.tensor([0], dtype=torch.int32)), ValueError, "B \\+ 1 >= 2"),
    (dict(max_seqlen_q=torch.tensor(5)), TypeError, "max_seqlen_q must be an int"),
    (dict(max_seqlen_k=0), ValueError, "max_seqlen_k must be >= 1"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(key_mass_window=4), ValueError, "return_key_mass is False"),
    (dict(return_key_mass=True, key_mass_window=0), ValueError, "key_mass_window must be a positive int"),
    (dict(), ValueError, "CUDA device"),  # valid shapes on the CPU: refused at the device check, last
])
def test_varlen_validation(change, error, match):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, cu_q=cu([5, 5]), cu_k=cu([12, 8]), max_seqlen_q=5, max_seqlen_k=12)
    args.update(change)
    kw = {n: args.pop(n) for n in ("scale", "causal", "return_key_mass", "key_mass_window") if n in args}
    with pytest.raises(error, match=match):
        attn_lt.varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                                 max_seqlen_q=args["max_seqlen_q"], max_seqlen_k=args["max_seqlen_k"], **kw)


@pytest.mark.parametrize("change,error,match", [
    (dict(k_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)[:, :, :, :32]), ValueError, "head dims"),
    (dict(k_cache=torch.randn(10, 12, 2, 64, dtype=torch.bfloat16),
          v_cache=torch.randn(10, 12, 2, 64, dtype=torch.bfloat16)), ValueError, "block_size 12"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), TypeError, "block_table must be torch.int32"),
    (dict(seqlens_k=torch.zeros(2, dtype=torch.int32)), ValueError, r"seqlens_k must be \(3,\)"),
    (dict(q=torch.randn(5, 8, 64, dtype=torch.bfloat16)), ValueError, "one row a request"),
    (dict(cu_q=cu([2, 2, 1])), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_q=4), ValueError, "needs cu_seqlens_q"),
    (dict(), ValueError, "CUDA device"),
])
def test_paged_validation(change, error, match):
    args = dict(q=torch.randn(3, 8, 64, dtype=torch.bfloat16), k_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16),
                v_cache=torch.randn(10, 16, 2, 64, dtype=torch.bfloat16),
                block_table=torch.zeros(3, 4, dtype=torch.int32), seqlens_k=torch.ones(3, dtype=torch.int32))
    args.update(change)
    kw = {}
    if "cu_q" in args:
        kw["cu_seqlens_q"] = args.pop("cu_q")
        args["q"] = torch.randn(5, 8, 64, dtype=torch.bfloat16)
    if "max_seqlen_q" in args:
        kw["max_seqlen_q"] = args.pop("max_seqlen_q")
    with pytest.raises(error, match=match):
        attn_lt.paged_attention(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seqlens_k"],
                                **kw)


def _fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="cuda")  # (inside a FakeTensorMode: no GPU needed)


def test_batch_custom_ops_give_shapes_and_errors_without_a_gpu():
    """The torch.library ops behind torch.compile: the outputs' shapes (an empty tensor for what was not asked for)
    and the calls' own validation errors, on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, cu_s = _fake_cuda(100, 8, 128), _fake_cuda(300, 2, 128), _fake_cuda(5, dtype=torch.int32)
        out, lse, mass = torch.ops.attn_lt.varlen_attention(q, k, k, cu_s, cu_s, 64, 128, True, None, True, False,
                                                            [32, 0], 30.0, None, True, None, None, None)
        assert (out.shape, lse.shape, mass.shape) == ((100, 8, 128), (8, 100), (8, 300))
        assert out.dtype == torch.bfloat16 and lse.dtype == mass.dtype == torch.float32
        kc, table, lengths = _fake_cuda(40, 16, 2, 128), _fake_cuda(4, 10, dtype=torch.int32), _fake_cuda(
            4, dtype=torch.int32)
        out, lse, mass = torch.ops.attn_lt.paged_attention(_fake_cuda(4, 8, 128), kc, kc, table, lengths, None, None,
                                                           None, True, None, False, False, None, 0.0, None, True,
                                                           None, None, None)
        assert (out.shape, lse.shape, mass.shape) == ((4, 8, 128), (0,), (4, 8, 160))
        with pytest.raises(ValueError, match="one row a request"):
            torch.ops.attn_lt.paged_attention(_fake_cuda(3, 8, 128), kc, kc, table, lengths, None, None, None, True,
                                              None, False, False, None, 0.0, None, False, None, None, None)
        with pytest.raises(ValueError, match="softcap must be positive"):
            torch.ops.attn_lt.varlen_attention(q, k, k, cu_s, cu_s, 64, 128, True, None, False, False, None, -2.0,
                                               None, False, None, None, None)


@pytest.mark.parametrize("strict", [False, True])
def test_batch_calls_trace_into_their_custom_ops(strict):
    """torch.export (and so torch.compile's graph capture) takes the batch calls and dense attention with their
    variants as one op each; capacities made symbolic (a dynamic max_seqlen) trace too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export import Dim

    class Step(torch.nn.Module):
        def forward(self, q, k, cu_q, cu_k, rows, kc, table, lengths, q1, sinks, dq, dk):
            out, lse = attn_lt.varlen_attention(q, k, k, cu_q, cu_k, max_seqlen_q=rows.shape[0],
                                                max_seqlen_k=k.shape[0], causal=True, window=(32, 0), softcap=30.0,
                                                return_lse=True)
            paged, mass = attn_lt.paged_attention(q1, kc, kc, table, lengths, sinks=sinks, return_key_mass=True,
                                                  k_descale=None)
            dense = attn_lt.attention(dq, dk, dk, window=(8, -1), softcap=20.0, sinks=sinks, out_layout="bshd")
            return out, lse, paged, mass, dense

    with FakeTensorMode():
        args = (_fake_cuda(100, 8, 128), _fake_cuda(300, 2, 128), _fake_cuda(5, dtype=torch.int32),
                _fake_cuda(5, dtype=torch.int32), _fake_cuda(64), _fake_cuda(40, 16, 2, 128),
                _fake_cuda(4, 10, dtype=torch.int32), _fake_cuda(4, dtype=torch.int32), _fake_cuda(4, 8, 128),
                _fake_cuda(8, dtype=torch.float32), _fake_cuda(2, 8, 33, 128), _fake_cuda(2, 2, 97, 128))
        dims = ({0: Dim("total_q", min=2, max=4096)}, {0: Dim("total_k", min=2, max=65536)}, None, None,
                {0: Dim("max_q", min=2, max=4096)}) + (None,) * 7
        program = torch.export.export(Step(), args, dynamic_shapes=dims, strict=strict)
    code = program.graph_module.code
    for op in ("attn_lt.varlen_attention", "attn_lt.paged_attention", "attn_lt.attention"):
        assert code.count(op) == 1, code
    assert "[32, -1], 30.0" in code and "[8, -1], 20.0" in code


def test_batch_op_results_never_alias():
    """A custom op's outputs may not alias each other: what was not asked for is a fresh empty tensor each."""
    q = torch.randn(3, 2, 64)
    out, lse, mass = op_results(q.clone(), False, False, q)
    assert lse.shape == mass.shape == (0,) and lse is not mass and lse.untyped_storage() is not mass.untyped_storage()


def test_batch_calls_refuse_out_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out= is not supported inside torch.compile"):
        attn_lt.varlen_attention(q, k, v, cu([5, 5]), cu([12, 8]), max_seqlen_q=5, max_seqlen_k=12, out=q)


def test_plan_decode_parts_follow_the_capacity():
    p = batch.plan_batch(64, 32, 8, 128, max_seqlen_q=1, max_seqlen_k=8192, block_size=16, facts=H100)
    assert p.decode_blocks and p.row_kernel is None
    assert p.split_keys % batch.KEY_TILE == 0 and p.split_keys >= batch.SPLIT_MIN_KEYS
    assert p.parts == -(-8192 // p.split_keys) > 1
    # at capacity the parts give about SPLIT_WAVES CTAs a slot
    ctas = 64 * 8 * p.parts
    assert ctas >= batch.SPLIT_WAVES * 2 * 132 * 0.5
    assert p.workspace_bytes == p.parts * 64 * 8 * batch.SMALL_ROWS * 129 * 4
    one = batch.plan_batch(1, 32, 8, 128, max_seqlen_q=1, max_seqlen_k=200, facts=H100)
    assert one.parts == 1 and one.split_keys == 0 and one.workspace_bytes == 0


def test_plan_small_batches_take_long_parts(monkeypatch):
    """Few (request, kv head) pairs: parts of PART_KEYS keys where one wave of CTAs still fills the slots at
    capacity, else as many as fill them once; from half as many pairs as slots, the waves rule alone."""
    def plan(B, Hkv, keys):
        return batch.plan_batch(B, 32, Hkv, 128, max_seqlen_q=1, max_seqlen_k=keys, block_size=16, facts=H100)

    slots = 2 * H100.sms
    mqa = plan(64, 1, 8192)
    assert mqa.split_keys == batch.PART_KEYS and 64 * mqa.parts <= slots
    assert plan(1, 8, 131072).split_keys == batch.PART_KEYS
    one = plan(1, 8, 8192)  # PART_KEYS would leave slots empty: as many parts as fill them once
    assert one.split_keys == 256 and one.parts == 32 and 8 * one.parts <= slots
    wide = plan(32, 8, 4096)  # 256 pairs for 264 slots: about SPLIT_WAVES CTAs a slot
    assert wide.split_keys == 512 and 256 * wide.parts >= batch.SPLIT_WAVES * slots * 0.5
    # explain names the rule that set the parts
    assert "64 (request, kv head) pairs for 264 slots" in str(mqa) and mqa.to_dict()["split_rule"] == mqa.split_rule
    assert f"about {batch.SPLIT_WAVES} CTAs a slot" in str(wide)
    # the planner's constants as the benchmarks vary them: plans made again after clear_plan_cache
    monkeypatch.setattr(batch, "PART_KEYS", 0)
    batch.clear_plan_cache()
    try:
        assert plan(64, 1, 8192).split_keys == 256
    finally:
        monkeypatch.undo()
        batch.clear_plan_cache()
    assert plan(64, 1, 8192).split_keys == batch.PART_KEYS


def test_plan_row_kernel():
    prefill = dict(max_seqlen_q=4096, max_seqlen_k=4096)
    assert batch.plan_batch(16, 32, 8, 128, facts=H100, **prefill).row_kernel == "sm90"
    assert batch.plan_batch(16, 32, 8, 128, facts=A100, **prefill).row_kernel == "flash"
    assert batch.plan_batch(16, 32, 8, 128, facts=H100, block_size=64, **prefill).row_kernel == "sm90"
    # more than 64 query heads a kv head: no decode blocks, every request on row blocks
    mqa = batch.plan_batch(8, 128, 1, 128, max_seqlen_q=1, max_seqlen_k=4096, facts=H100)
    assert not mqa.decode_blocks and mqa.row_kernel == "sm90"


@pytest.mark.parametrize("Hq,Hkv,max_q,rows,row_kernel", [
    (32, 8, 1, 16, False), (32, 8, 4, 16, False), (32, 8, 5, 32, False),  # speculative decoding: 20 rows a kv head
    (32, 8, 16, 64, False), (32, 8, 17, 16, True),  # 68 rows: prefill rows, the row blocks take them
    (32, 1, 1, 32, False), (48, 1, 1, 48, False),  # one row of a group of 32 / 48 heads: two / three 16-row blocks
    (32, 1, 4096, 32, True), (128, 1, 1, 16, True), (64, 1, 1, 64, False)])
def test_plan_decode_rows(Hq, Hkv, max_q, rows, row_kernel):
    """The decode blocks take the capacity's rows a kv head up to MAX_DECODE_ROWS (a 16-row block for each 16); past
    that one row's group, the longer requests on row blocks. The same plan for a 16-bit and an FP8 cache."""
    p = batch.plan_batch(64, Hq, Hkv, 128, max_seqlen_q=max_q, max_seqlen_k=8192, block_size=16, facts=H100)
    g = Hq // Hkv
    assert p.decode_rows == rows and p.decode_blocks == (g <= rows) and (p.row_kernel is not None) == row_kernel
    assert p.workspace_bytes == (p.parts * 64 * Hkv * rows * 129 * 4 if p.parts > 1 else 0)
    a = batch._plan_args(p, "bf16", 1.0, True, torch.zeros(1, dtype=torch.int32), None)
    assert a.decode_rows == rows and a.split_keys == p.split_keys
    if p.decode_blocks and rows > 16:  # (a 16-bit cache: one 64-row block; an FP8 one: a 16-row block for each 16)
        assert "one group block a kv head" in str(p) and f"{rows // 16} blocks of 16 rows" in str(p)


def test_plan_decode_rows_at_d256():
    """D 256 runs a 16-row decode block for each 16 rows on a 16-bit cache too (its 64-row block spills)."""
    p = batch.plan_batch(64, 32, 8, 256, max_seqlen_q=5, max_seqlen_k=8192, facts=H100)
    assert p.decode_rows == 32 and "group block" not in str(p) and "2 blocks of 16 rows" in str(p)


def test_plan_partials_bounded():
    p = batch.plan_batch(4095, 64, 16, 256, max_seqlen_q=1, max_seqlen_k=2**20, facts=H100)
    assert p.workspace_bytes <= batch.MAX_PARTIAL_BYTES and p.parts <= batch.MAX_PARTS


def test_explain_batch_says_what_runs():
    text = attn_lt.explain_batch(64, 32, 8, 128, max_seqlen_q=1, max_seqlen_k=8192, block_size=16)
    assert "paged batch" in text and "decode blocks" in text and "parts of" in text
    text = attn_lt.explain_batch(16, 32, 8, 128, max_seqlen_q=4096, max_seqlen_k=16384)
    assert "row blocks" in text and "varlen batch" in text
    text = attn_lt.explain_batch(64, 32, 8, 128, max_seqlen_q=1, max_seqlen_k=8192, block_size=16,
                                 return_key_mass=True)
    assert "(B, Hq, max_seqlen_k), 64.0 MiB" in text and "scores their decode blocks store" in text
    assert "recomputes" not in text  # one-row requests only
    text = attn_lt.explain_batch(16, 32, 8, 128, max_seqlen_q=4096, max_seqlen_k=16384, return_key_mass=True)
    assert "(Hq, total_k)" in text and "recomputes the summed rows' scores" in text
    assert "not available" in attn_lt.explain_batch(8, 128, 1, 576, max_seqlen_q=1, max_seqlen_k=4096, block_size=64,
                                                     head_dim_v=512, return_key_mass=True)
    with pytest.raises(ValueError, match="block_size 24"):
        attn_lt.explain_batch(4, 8, 8, 64, max_seqlen_q=1, max_seqlen_k=100, block_size=24)
    with pytest.raises(ValueError, match="head dim 80"):
        attn_lt.explain_batch(4, 8, 8, 80, max_seqlen_q=1, max_seqlen_k=100)


def test_plan_mla_decode():
    p = batch.plan_batch(64, 128, 1, 576, Dv=512, max_seqlen_q=1, max_seqlen_k=8192, block_size=64, facts=H100)
    assert p.latent and p.decode_blocks and p.row_kernel is None
    assert p.split_keys % batch.KEY_TILE == 0 and p.split_keys >= batch.MLA_SPLIT_MIN_KEYS
    assert p.parts == -(-8192 // p.split_keys) > 1
    assert p.workspace_bytes == p.parts * 64 * 128 * 513 * 4 <= batch.MAX_PARTIAL_BYTES
    assert p.to_dict()["head_dim_v"] == 512
    small = batch.plan_batch(1, 16, 1, 576, Dv=512, max_seqlen_q=1, max_seqlen_k=512, block_size=64, facts=H100)
    assert small.parts == 1 and small.workspace_bytes == 0
    text = attn_lt.explain_batch(64, 128, 1, 576, head_dim_v=512, max_seqlen_q=1, max_seqlen_k=8192, block_size=64)
    assert "MLA decode blocks" in text and "v in k" in text and "parts of" in text
    with pytest.raises(ValueError, match="blocks of at least 64"):
        attn_lt.explain_batch(4, 16, 1, 576, head_dim_v=512, max_seqlen_q=1, max_seqlen_k=100, block_size=16)
    with pytest.raises(ValueError, match="one query row a request"):
        attn_lt.explain_batch(4, 16, 1, 576, head_dim_v=512, max_seqlen_q=2, max_seqlen_k=100, block_size=64)
    with pytest.raises(ValueError, match="head dim 576"):
        attn_lt.explain_batch(4, 16, 1, 576, max_seqlen_q=1, max_seqlen_k=100)


def test_mla_paged_validation():
    k_cache = torch.randn(8, 64, 1, 576, dtype=torch.bfloat16)
    q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    table, seqlens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="same memory"):
        attn_lt.paged_attention(q, k_cache, k_cache[..., :512].clone(), table, seqlens)
    small = torch.randn(8, 16, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="blocks of at least 64"):
        attn_lt.paged_attention(q, small, small[..., :512], table, seqlens)
    with pytest.raises(ValueError, match="one query row a request"):
        attn_lt.paged_attention(torch.randn(3, 16, 576, dtype=torch.bfloat16), k_cache, k_cache[..., :512], table,
                                seqlens, cu_seqlens_q=cu([2, 1]), max_seqlen_q=2)
    with pytest.raises(ValueError, match="head dims must agree"):  # 576/512 only from one latent cache
        attn_lt.varlen_attention(q, k_cache[:, 0], k_cache[:, 0, :, :512], cu([1, 1]), cu([1, 1]), max_seqlen_q=1,
                                 max_seqlen_k=1)
    with pytest.raises(ValueError, match="not available for MLA decode"):
        attn_lt.paged_attention(q, k_cache, k_cache[..., :512], table, seqlens, return_key_mass=True)
    with pytest.raises(ValueError, match="CUDA device"):
        attn_lt.paged_attention(q, k_cache, k_cache[..., :512], table, seqlens)


def test_describe_errors():
    assert len(batch.describe_errors(31)) == 5
    assert batch.describe_errors(16) == ["a block id outside [0, num_blocks)"]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_matches_dense_reference(causal):
    q_lens, k_lens = [3, 0, 7, 2], [5, 4, 7, 0]
    q, k, v = qkv(sum(q_lens), sum(k_lens), 4, 2, 64, torch.float32)
    out, lse = varlen_reference(q, k, v, cu(q_lens), cu(k_lens), causal=causal)
    cq, ck = cu(q_lens).tolist(), cu(k_lens).tolist()
    o, l = reference(q[0:3].transpose(0, 1)[None], k[0:5].transpose(0, 1)[None], v[0:5].transpose(0, 1)[None],
                     causal=causal, dtype=torch.float64)
    assert torch.allclose(out[0:3], o[0].transpose(0, 1)) and torch.allclose(lse[:, 0:3], l[0])
    assert torch.all(out[cq[3]:cq[4]] == 0) and torch.isneginf(lse[:, cq[3]:cq[4]]).all()
    assert not torch.isnan(out).any() and ck[-1] == 16


def test_paged_gather_and_reference():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, seqlens = random_pages([0, 1, 17, 40], 16, 2, 64, torch.float32, device="cpu",
                                                    generator=gen)
    assert sorted(table[:, :3].flatten().tolist())[-1] < k_cache.shape[0]
    k, v, cu_k = paged_gather(k_cache, v_cache, table, seqlens)
    assert cu_k.tolist() == [0, 0, 1, 18, 58]
    b3 = table[3].tolist()
    assert torch.equal(k[18:34], k_cache[b3[0]]) and torch.equal(v[50:58], v_cache[b3[2], :8])
    q = torch.randn(4, 4, 64)
    out, lse = paged_reference(q, k_cache, v_cache, table, seqlens)
    assert torch.all(out[0] == 0) and torch.isneginf(lse[:, 0]).all()
    assert math.isfinite(lse[:, 1:].sum().item())


def test_capacity_limits_refused_before_gpu_work():
    with pytest.raises(ValueError, match="65535"):
        attn_lt.explain_batch(4096, 32, 16, 128, max_seqlen_q=1, max_seqlen_k=100)
    with pytest.raises(ValueError, match="2\\*\\*30"):
        attn_lt.explain_batch(4, 32, 1, 128, max_seqlen_q=2**26, max_seqlen_k=100)


def test_out_of_the_wrong_type_is_a_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        attn_lt.varlen_attention(q, k, v, cu([5, 5]), cu([12, 8]), max_seqlen_q=5, max_seqlen_k=12, out=[1])


@pytest.mark.native
def test_batch_launcher_refuses_bad_arguments_without_touching_the_gpu():
    """attn_lt_batch_fwd's host-side checks (fake addresses: nothing is read before they pass)."""
    import ctypes

    from attn_lt import native

    lib = native.load()

    def args(**change):
        a = native.BatchArgs()
        f = a.f
        f.q, f.k, f.v, f.o = 0x10000, 0x20000, 0x30000, 0x40000
        f.B, f.Hq, f.Hkv, f.Sq, f.Sk, f.D, f.Dv = 2, 8, 2, 1, 4096, 128, 128
        f.q_ss, f.q_sh, f.o_ss, f.o_sh = 1024, 128, 1024, 128
        f.k_ss, f.k_sh, f.v_ss, f.v_sh = 256, 128, 256, 128
        f.scale, f.dtype = 0.1, native.DTYPE_CODES["bf16"]
        a.cu_q, a.cu_k, a.error = 0x50000, 0x50100, 0x50200
        a.total_q, a.total_k = 2, 100
        a.split_keys, a.decode_rows = 1024, 16
        parts_rows = 4 * 2 * 2 * batch.SMALL_ROWS
        f.o_part, f.lse_part = 0x100000, 0x100000 + parts_rows * 128 * 4
        a.workspace_bytes = parts_rows * 129 * 4
        for name, value in change.items():
            obj = f if hasattr(f, name) and not hasattr(native.BatchArgs, name) else a
            setattr(obj, name, value)
        return lib.attn_lt_batch_fwd(ctypes.byref(a), None)

    if not torch.cuda.is_available():  # (with a GPU these fake addresses would be launched on)
        assert args() < 10000  # every check passes: the launch then fails for want of a GPU (a CUDA error)
    for change, status in ((dict(error=None), 10001), (dict(cu_q=None, total_q=1), 10013),
                           (dict(cu_k=0x50101), 10005), (dict(workspace_bytes=100), 10013),
                           (dict(lse_part=0x100010), 10013), (dict(split_keys=100), 10013), (dict(D=96), 10003),
                           (dict(block_table=0x60000), 10013), (dict(decode_rows=0), 10013),
                           (dict(decode_rows=24), 10013), (dict(decode_rows=80), 10013),
                           # an FP8 cache runs every request on decode blocks: 4 x 4 rows a kv head > 16
                           (dict(kv_dtype=native.DTYPE_CODES["e4m3"], Sq=5), 10007)):
        assert args(**change) == status, change
    if not torch.cuda.is_available():
        assert args(kv_dtype=native.DTYPE_CODES["e4m3"], Sq=4) < 10000  # 16 rows a kv head: the decode blocks'
        rows32 = 4 * 2 * 2 * 32  # (the partials of 32 decode rows)
        assert args(kv_dtype=native.DTYPE_CODES["e4m3"], Sq=5, decode_rows=32, lse_part=0x100000 + rows32 * 128 * 4,
                    workspace_bytes=rows32 * 129 * 4) < 10000


@pytest.mark.native
def test_batch_mass_launcher_refuses_bad_arguments_without_touching_the_gpu():
    """attn_lt_batch_key_mass's host-side checks (fake addresses: nothing is read before they pass)."""
    import ctypes

    from attn_lt import native

    lib = native.load()

    def args(**change):
        m = native.BatchMassArgs()
        a, f = m.b, m.b.f
        f.q, f.k, f.lse = 0x10000, 0x20000, 0x30000
        f.B, f.Hq, f.Hkv, f.Sq, f.Sk, f.D, f.Dv = 2, 8, 2, 1, 4096, 128, 128
        f.q_ss, f.q_sh, f.k_ss, f.k_sh = 1024, 128, 256, 128
        f.scale, f.dtype = 0.1, native.DTYPE_CODES["bf16"]
        a.cu_q, a.cu_k, a.error = 0x50000, 0x50100, 0x50200
        a.total_q, a.total_k, a.decode_rows = 2, 100, 16
        m.mass, m.window = 0x70000, 1
        for name, value in change.items():
            obj = m if hasattr(native.BatchMassArgs, name) else f if not hasattr(native.BatchArgs, name) else a
            setattr(obj, name, value)
        return lib.attn_lt_batch_key_mass(ctypes.byref(m), None)

    if not torch.cuda.is_available():
        assert args() < 10000  # every check passes: the launch then fails for want of a GPU (a CUDA error)
    for change, status in ((dict(mass=None), 10001), (dict(lse=None), 10001), (dict(window=0), 10001),
                           (dict(error=None), 10001), (dict(cu_k=0x50101), 10005), (dict(D=96), 10003),
                           (dict(block_table=0x60000), 10013), (dict(mass=0x70002), 10005),
                           (dict(from_scores=2), 10001)):
        assert args(**change) == status, change
    if not torch.cuda.is_available():
        assert args(q_sb=3) < 10000  # a batch's q has no batch stride: not checked


def test_batch_struct_matches_header():
    import ctypes

    from attn_lt import native

    # the flash arguments, 5 pointers, 6 int64, 2 int32, 1 int64
    assert ctypes.sizeof(native.BatchArgs) == ctypes.sizeof(native.FlashArgs) + 5 * 8 + 6 * 8 + 2 * 4 + 8
    assert native.BatchArgs.workspace_bytes.offset == ctypes.sizeof(native.BatchArgs) - 8


# ---- FP8 KV caches ------------------------------------------------------------------------------------------------

F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("change,error,match", [
    (dict(v=torch.randn(20, 2, 64).to(F8)), TypeError, "both torch.float8_e4m3fn"),
    (dict(k=torch.randn(20, 2, 64).to(F8), v=torch.randn(20, 2, 64).to(F8), max_seqlen_q=5), ValueError,
     "CUDA device"),  # prefill rows: valid (the cache converted first), refused at the device check
    (dict(k=torch.randn(20, 2, 64).to(F8), v=torch.randn(20, 2, 64).to(F8), max_seqlen_q=2, return_key_mass=True),
     ValueError, "CUDA device"),
    (dict(q=torch.randn(10, 8, 64).to(F8)), TypeError, "q has dtype"),
    (dict(k=torch.randn(20, 2, 64).to(F8), v=torch.randn(20, 2, 64).to(F8), max_seqlen_q=4), ValueError,
     "CUDA device"),  # 16 rows a kv head: valid, refused at the device check
])
def test_fp8_cache_validation(change, error, match):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, cu_q=cu([5, 5]), cu_k=cu([12, 8]), max_seqlen_q=1, max_seqlen_k=12)
    args.update(change)
    kw = {n: args.pop(n) for n in ("return_key_mass",) if n in args}
    with pytest.raises(error, match=match):
        attn_lt.varlen_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                                 max_seqlen_q=args["max_seqlen_q"], max_seqlen_k=args["max_seqlen_k"], **kw)


def test_fp8_latent_cache_and_prefill_rows_explained():
    text = attn_lt.explain_batch(4, 128, 1, 576, head_dim_v=512, max_seqlen_q=1, max_seqlen_k=8192, block_size=64,
                                 kv_dtype=F8)
    assert "MLA decode blocks" in text and "FP8 latent cache" in text
    q, lat = torch.randn(1, 16, 1, 576, dtype=torch.bfloat16), torch.randn(1, 1, 64, 576).to(F8)
    assert "FP8 latent cache" in str(attn_lt.explain(q, lat, lat[..., :512]))
    with pytest.raises(ValueError, match="one query a head"):
        attn_lt.explain(q.expand(1, 16, 3, 576).contiguous(), lat, lat[..., :512])
    with pytest.raises(ValueError, match="head dims D = Dv in .* or MLA decode's 576/512"):
        attn_lt.explain(q[..., :192], lat[..., :192], lat[..., :128])
    decode = attn_lt.explain_batch(8, 32, 8, 128, max_seqlen_q=4, max_seqlen_k=4096, block_size=16, kv_dtype=F8)
    prefill = attn_lt.explain_batch(8, 32, 8, 128, max_seqlen_q=512, max_seqlen_k=4096, block_size=16, kv_dtype=F8)
    assert "decode blocks" in decode and "converted" not in decode
    assert "converted to q's dtype first" in prefill and "1 + B x max_blocks" in prefill


def test_fp8_step_refuses_other_kv_dtypes():
    with pytest.raises(TypeError, match="kv_dtype"):
        attn_lt.BatchStep(4, 32, 8, 128, max_seqlen_k=4096, block_size=16, kv_dtype=torch.float32, device="cpu")


def test_attention_fp8_cache_validation():
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 16, 128).to(F8)
    with pytest.raises(TypeError, match="must both be torch.float8_e4m3fn"):
        attn_lt.attention(q, k, k.to(torch.bfloat16))
    with pytest.raises(TypeError, match="k and v both torch.float8_e4m3fn"):
        attn_lt.attention(q, k.to(torch.float16), k.to(torch.float16))
    with pytest.raises(ValueError, match="CUDA device"):  # valid otherwise
        attn_lt.attention(q, k, k, k_descale=0.5)


def test_check_kv_descale():
    from attn_lt.validate import check_kv_descale

    cpu = torch.device("cpu")
    assert check_kv_descale(None, None, False, 4, cpu) is None
    assert check_kv_descale(None, None, True, 4, cpu) == (None, None, 0)
    kd, vd, sh = check_kv_descale(0.5, torch.tensor([2.0]), True, 4, cpu)
    assert sh == 0 and kd.item() == 0.5 and vd.item() == 2.0
    assert check_kv_descale(torch.ones(4), torch.ones(4), True, 4, cpu)[2] == 1
    for k, v, error, match in ((1.0, None, ValueError, "FP8 KV cache"), ):
        with pytest.raises(error, match=match):
            check_kv_descale(k, v, False, 4, cpu)
    for k, v, error, match in ((torch.ones(4), torch.ones(1), ValueError, "all be per kv head or all one value"),
                               (torch.ones(3), None, ValueError, r"\(4,\)"),
                               (torch.ones(8)[::2], None, ValueError, "contiguous"),
                               (torch.ones(4, dtype=torch.float16), None, TypeError, "float32"),
                               (-1.0, None, ValueError, "positive"), ("2", None, TypeError, "number")):
        with pytest.raises(error, match=match):
            check_kv_descale(k, v, True, 4, cpu)


@pytest.mark.native
def test_fp8_launch_refusals_without_touching_the_gpu():
    """The C side refuses FP8 K/V where the decode blocks do not run it (ATTN_LT_ERR_DTYPE, 10007): 17 rows x GQA 4
    is past the 64 rows a kv head a dense call runs."""
    import ctypes

    from attn_lt import native

    lib = native.load()

    def flash(**change):
        a = native.FlashArgs()
        a.q, a.k, a.v, a.o = 0x10000, 0x20000, 0x30000, 0x40000
        a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D = 2, 8, 2, 1, 4096, 128
        a.q_sb, a.q_sh, a.q_ss, a.o_sb, a.o_sh, a.o_ss = 1024, 128, 128, 1024, 128, 128
        a.k_sb, a.k_sh, a.k_ss = a.v_sb, a.v_sh, a.v_ss = 2 * 4096 * 128, 4096 * 128, 128
        a.scale, a.dtype, a.kv_dtype = 0.1, native.DTYPE_CODES["bf16"], native.DTYPE_CODES["e4m3"]
        for name, value in change.items():
            setattr(a, name, value)
        return lib.attn_lt_flash_fwd(ctypes.byref(a), None), lib.attn_lt_flash_sm90_fwd(ctypes.byref(a), None)

    if not torch.cuda.is_available():
        assert flash()[0] < 10000  # every check passes: the launch then fails for want of a GPU
    for change in (dict(Sq=17), dict(k_ss=136), dict(descale_sh=2), dict(kv_dtype=3), dict(k_descale=0x70002)):
        assert flash(**change)[0] == 10007, change
    assert flash()[1] == 10007  # the Hopper prefill kernel takes no FP8 K/V


def test_explain_an_fp8_cache_without_a_gpu():
    q = torch.empty(64, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(64, 8, 8192, 128, dtype=F8, device="meta")
    e = attn_lt.explain(q, k, k)
    assert e.decision.backend == "wmma" and "FP8 KV cache" in str(e) and e.fused.kernel == "flash"
    assert e.fused.splits > 1  # 512 blocks are 1.3 waves of three CTAs an SM: the keys split
    # up to 64 rows a kv head (16 x GQA 4) a 16-row decode block for each 16
    e = attn_lt.explain(torch.empty(64, 32, 16, 128, dtype=torch.bfloat16, device="meta"), k, k, causal=True)
    assert "converted" not in str(e) and e.fused.kernel == "flash" and e.fused.block_rows == 16
    assert "2048 decode blocks" in str(e)  # 4 row blocks x 512 (b, kv head)
    # 17 rows x GQA 4 = 68 a kv head, or the mass: the cache converted first, then the 16-bit call's route
    for rows, mass in ((17, False), (1, True)):
        e = attn_lt.explain(torch.empty(64, 32, rows, 128, dtype=torch.bfloat16, device="meta"), k, k, causal=True,
                            return_key_mass=mass)
        assert "converted to q's dtype first" in str(e) and e.case.k_strides == (8 * 8192 * 128, 8192 * 128, 128, 1)
    with pytest.raises(ValueError, match="head dims D = Dv in 64, 128, 256"):
        attn_lt.explain(q[..., :96], k[..., :96], k[..., :96])
    with pytest.raises(ValueError, match="plan.. takes no FP8 K/V"):
        attn_lt.plan(q, k, k)
