"""The planner, on CPU: chunk bounds, budget, causal key skipping, GQA folding, batch combining, and the exact
operand offsets/strides, which an emulator executes with torch.as_strided against a float64 reference."""

import itertools
import math

import pytest
import torch

from attn_lt import config
from attn_lt.chunks import (KEY_BLOCK, ONE_CTA_KEYS, chunk_layout, plan_chunks, one_cta_keys, out_strides, score_ld,
                          tile_keys)
from attn_lt.testing import random_qkv, reference
from attn_lt.validate import Case, check_tensors

MiB = 1 << 20


def covered_rows(case, plan):
    """How often each (b, query head, s) row is computed, and the keys each chunk computes for it."""
    count = torch.zeros(case.B, case.Hq, case.Sq, dtype=torch.int64)
    for c in plan.chunks:
        if c.tile in ("first", "mid"):  # a row block's key tiles count once, at the last
            continue
        for e in range(c.e0, c.e0 + c.ne):
            b, h = divmod(e, case.Hkv)
            heads = range(h * case.group, (h + 1) * case.group) if c.gi is None else [h * case.group + c.gi]
            for hq in heads:
                count[b, hq, c.s0:c.s1] += 1
    return count


CASES = [
    Case.contiguous(1, 16, 16, 16384, 16384, 128),
    Case.contiguous(1, 32, 32, 32768, 32768, 128, causal=True),
    Case.contiguous(1, 32, 32, 131072, 131072, 128, causal=True),
    Case.contiguous(8, 32, 8, 1, 131072, 128),
    Case.contiguous(8, 32, 8, 16, 65536, 128, causal=True),
    Case.contiguous(2, 8, 2, 4097, 4095, 80, causal=True),
    Case.contiguous(3, 4, 1, 97, 1, 64),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("budget_mib", [64, 1024])
def test_every_row_once_and_within_budget(case, budget_mib):
    plan = plan_chunks(case, budget_mib * MiB)
    assert plan.workspace_bytes <= budget_mib * MiB
    assert (covered_rows(case, plan) == 1).all()
    next_key = 0  # a row block's key tiles follow each other from key 0
    for c in plan.chunks:
        assert 0 <= c.s0 < c.s1 <= case.Sq and 1 <= c.ne and c.e0 + c.ne <= case.B * case.Hkv
        assert c.ne * plan.rows(c) * score_ld(c.keys) * 4 <= plan.score_bytes
        assert c.k0 == (next_key if c.tile in ("mid", "last") else 0) and c.k0 < c.kend or c.kend == 0
        next_key = c.kend
        if c.tile:
            assert c.keys <= plan.key_tile and (c.keys == plan.key_tile or c.tile == "last")
        if c.tile in ("first", "mid"):
            continue
        last_visible = c.s1 - 1 + case.Sk - case.Sq if case.causal else case.Sk - 1
        assert min(case.Sk, last_visible + 1) <= c.kend <= case.Sk  # every visible key of the chunk is computed
        if case.causal and c.kend < case.Sk:
            assert c.kend % KEY_BLOCK == 0 or c.kend == 0


def test_causal_skips_about_half():
    case = Case.contiguous(1, 32, 32, 32768, 32768, 128, causal=True)
    plan = plan_chunks(case, 1024 * MiB)
    done = sum(c.ne * plan.rows(c) * c.keys for c in plan.chunks)
    assert done / (32 * 32768**2) < 0.54  # the ideal is 0.5 + 1/(2 S)


def test_budget_bounds_memory_whatever_the_length():
    for S in (16384, 65536, 262144):
        plan = plan_chunks(Case.contiguous(1, 8, 8, S, S, 128), 256 * MiB)
        assert plan.workspace_bytes <= 256 * MiB


def test_budget_from_environment_and_too_small(monkeypatch):
    case = Case.contiguous(1, 2, 2, 128, 65536, 64)
    monkeypatch.setenv("ATTN_LT_WORKSPACE_MB", "3")
    assert plan_chunks(case).budget == 3 * MiB
    with pytest.raises(ValueError, match="too small.*Sk65536"):
        plan_chunks(case, 200 * 1024, key_tiles=False)  # one row of scores does not fit
    tiled = plan_chunks(case, 200 * 1024)  # key tiles do
    assert tiled.key_tile and tiled.workspace_bytes <= 200 * 1024
    with pytest.raises(ValueError, match="too small.*Sk65536"):
        plan_chunks(case, 4 * 1024)  # not even a tile
    monkeypatch.setenv("ATTN_LT_WORKSPACE_MB", "0")
    with pytest.raises(ValueError, match="ATTN_LT_WORKSPACE_MB"):
        config.workspace_bytes()
    with pytest.raises(ValueError, match="positive"):
        config.workspace_bytes(-1)


def test_gqa_folds_only_when_layout_allows():
    dec = Case.contiguous(8, 32, 8, 1, 65536, 128)
    assert plan_chunks(dec).fold_group
    q = torch.empty(2, 64, 32, 128, dtype=torch.bfloat16).transpose(1, 2)  # BSHD view, Sq = 64
    k = torch.empty(2, 8192, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
    c = check_tensors(q, k, k, require_cuda=False)
    plan = plan_chunks(c)
    assert not plan.fold_group and not plan.combine_batch
    assert {ch.gi for ch in plan.chunks} == set(range(4))


# ---- the emulator: executes a plan's exact offsets and strides on CPU ---------------------------------------

def view(t, mv, cols=None):
    return torch.as_strided(t, (mv.batch, mv.rows, cols or mv.cols), (mv.batch_stride, mv.row_stride, 1),
                            t.storage_offset() + mv.offset)


def emulate(case, plan, q, k, v, mask):
    """Run ``plan`` the way the GPU path does, in float64: QK^T per chunk into a score block, the softmax
    kernel's row -> (b, head, position) mapping, P@V into a contiguous output; key tiles' partial outputs merged by
    their LSE, the last tile writing the output."""
    out = torch.full((case.B, case.Hq, case.Sq, case.D), math.nan, dtype=torch.float64)
    lse = torch.full((case.B, case.Hq, case.Sq), math.nan, dtype=torch.float64)
    assert out.stride() == out_strides(case)
    mexp = None if mask is None else mask.expand(case.B, case.Hq, case.Sq, case.Sk)
    running = None  # a row block's merged key tiles so far: (output, LSE)
    for c in plan.chunks:
        if c.kend == 0:
            for e in range(c.e0, c.e0 + c.ne):
                b, h = divmod(e, case.Hkv)
                hs = slice(h * case.group, (h + 1) * case.group) if c.gi is None else h * case.group + c.gi
                out[b, hs, c.s0:c.s1] = 0
                lse[b, hs, c.s0:c.s1] = -math.inf
            continue
        lay = chunk_layout(case, plan, c)
        Q, K, V = view(q, lay.q).double(), view(k, lay.k).double(), view(v, lay.v).double()
        S = case.scale * Q @ K.transpose(1, 2)  # (ne, M, N)
        L = torch.empty(S.shape[:2], dtype=torch.float64)
        places = {}
        for e, r in itertools.product(range(lay.s.batch), range(lay.s.rows)):
            R = lay.row0 + r
            pos, gi = R % case.Sq, lay.gi0 + R // case.Sq
            b, hkv = divmod(c.e0 + e, case.Hkv)
            h = hkv * case.group + gi
            places[e, r] = (b, h, pos)
            row = S[e, r].clone()
            if case.causal:
                row[max(0, pos + case.Sk - case.Sq + 1 - lay.col0):] = -math.inf
            if mexp is not None:
                m = mexp[b, h, pos, lay.col0:c.kend]
                row = row.masked_fill(~m, -math.inf) if m.dtype == torch.bool else row + m.double()
            l = torch.logsumexp(row, 0)
            S[e, r] = torch.exp(row - (0 if math.isinf(l) else l))
            L[e, r] = l
        O = S @ V
        if c.tile == "first":
            running = (O, L)
            continue
        if c.tile:  # merge this tile into the running result by LSE
            o0, l0 = running
            lm = torch.logaddexp(l0, L)
            safe = torch.where(torch.isinf(lm), 0, lm)
            O = torch.exp(l0 - safe)[..., None] * o0 + torch.exp(L - safe)[..., None] * O
            O[torch.isinf(lm)] = 0
            L = lm
            if c.tile == "mid":
                running = (O, L)
                continue
        view(out, lay.o).copy_(O)
        for (e, r), (b, h, pos) in places.items():
            lse[b, h, pos] = L[e, r]
    return out, lse


def make_inputs(B, Hq, Hkv, Sq, Sk, D, layout):
    q, k, v = random_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, "bshd" if layout == "bshd" else "bhsd", "cpu")
    if layout == "padded":  # rows longer than D, heads not adjacent
        q = torch.randn(B, Hq, Sq, D + 8, dtype=torch.bfloat16)[..., :D]
    return q, k, v


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,causal,mask,layout,budget", [
    (2, 4, 4, 70, 300, 16, False, None, "bhsd", 64 * 1024),
    (2, 4, 2, 70, 300, 16, True, None, "bhsd", 64 * 1024),
    (2, 8, 2, 3, 600, 16, False, None, "bhsd", 64 * 1024),         # decode-like: GQA folded
    (2, 8, 2, 5, 600, 16, True, "bool", "bhsd", 64 * 1024),
    (2, 4, 2, 40, 200, 16, True, None, "bshd", 64 * 1024),       # no fold, no batch combining
    (1, 4, 1, 300, 97, 16, True, "float", "bshd", 48 * 1024),     # Sq > Sk: fully masked leading rows
    (2, 2, 2, 33, 65, 8, False, "float", "padded", 40 * 1024),
    # key tiles (whole rows would be under 64 rows): first, mid and last tiles merged by LSE
    (1, 2, 2, 200, 1100, 16, False, None, "bhsd", 200 * 1024),
    (2, 4, 2, 150, 1300, 16, True, "bool", "bshd", 200 * 1024),   # causal, Sq < Sk, GQA, a per-row mask
    (1, 2, 1, 700, 600, 8, True, "float", "padded", 200 * 1024),  # Sq > Sk: masked rows, whole-row blocks too
])
def test_emulated_plan_matches_reference(B, Hq, Hkv, Sq, Sk, D, causal, mask, layout, budget):
    torch.manual_seed(0)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, layout)
    m = None
    if mask == "bool":
        m = torch.rand(B, 1, Sq, Sk) > 0.3
    elif mask == "float":
        m = torch.randn(1, Hq, 1, Sk)
    case = check_tensors(q, k, v, m, causal, require_cuda=False)
    plan = plan_chunks(case, budget)
    assert len(plan.chunks) > 1
    out, lse = emulate(case, plan, q, k, v, m)
    ref, ref_lse = reference(q, k, v, m, causal, dtype=torch.float64)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("S,causal", [(1 << 20, True), (10_000_000, True), (10_000_000, False)])
def test_long_keys_are_tiled_and_the_grid_stays_bounded(S, causal):
    """Past a few hundred thousand keys whole-row chunks would be slivers: the keys are tiled instead, the chunk
    shapes stay few whatever the length, and the plan is read (summary, shapes) without listing its chunks."""
    import time

    case = Case.contiguous(1, 32, 32, S, S, 128, causal=causal)
    t0 = time.perf_counter()
    plan = plan_chunks(case, 1024 * MiB)
    summary = plan.summary()
    elapsed = time.perf_counter() - t0
    assert plan.key_tile and plan.row_block >= 1024 and "tiles of" in summary
    assert len(plan.shapes()) < 400
    assert elapsed < 5  # about 0.3 s here; generous for slow CI machines
    assert plan.workspace_bytes <= 1024 * MiB


@pytest.mark.parametrize("Sq,Sk,causal,masked,tiled", [
    (2048, 65536, False, False, True),
    (4096, 32768, True, False, True),
    (512, ONE_CTA_KEYS + 1, False, False, True),
    (2048, ONE_CTA_KEYS, False, False, False),  # rows one CTA of the softmax holds: whole rows
    (511, 65536, False, False, False),  # decode-sized calls keep whole rows (a clustered row is faster there)
    (2048, 65536, False, True, True),  # a dense mask: tiles of at most what two CTAs an SM hold beside the mask
    (2048, 11265, False, True, True),
    (2048, 11264, False, True, False),
])
@pytest.mark.parametrize("Hkv", [16, 4])  # GQA: a call whose group would fold into rows is tiled too
def test_rows_longer_than_the_softmax_full_rate_are_tiled(Sq, Sk, causal, masked, tiled, Hkv):
    """Prefill-sized calls whose score rows are longer than one softmax CTA holds (with a bool mask in the ring,
    than two CTAs an SM hold) tile the keys at most that long, however large the budget (whole rows would run on
    clusters of CTAs, or one CTA an SM)."""
    from attn_lt.validate import MaskInfo

    mask = MaskInfo("bool", "bool", (1, 1, Sq, Sk), (0, 0, Sk, 1)) if masked else None
    case = Case.contiguous(1, 16, Hkv, Sq, Sk, 128, causal=causal, mask=mask)
    most = tile_keys(case)
    assert most == (11264 if masked else ONE_CTA_KEYS)
    plan = plan_chunks(case, 1024 * MiB)
    assert bool(plan.key_tile) == tiled, plan.summary()
    if tiled:
        assert plan.key_tile <= most and plan.row_block >= 512
        assert all(c.keys <= most for c, _ in plan.shapes().values())
        assert "full rate" in plan.summary()
    assert plan_chunks(case, 1024 * MiB, key_tiles=False).key_tile == 0


@pytest.mark.parametrize("dtype,keys,two_cta_keys", [("bool", 22528, 11264), ("bf16", 18688, 9472),
                                                    ("fp16", 18688, 9472), ("fp32", 14080, 7168)])
def test_one_cta_keys_fit_the_ring_beside_the_mask(dtype, keys, two_cta_keys):
    """one_cta_keys mirrors native/softmax.cu's pipe_layout: two slots of FP32 scores and (a mask contiguous over
    keys) its bytes fit kPipeSmem; a mask strided over keys is read from global memory, not through the ring.
    tile_keys is the longest masked row whose two slots, each CTA's 1 KB reserve and its static shared memory (under
    1 KB) fit two CTAs in a Hopper SM's 228 KB."""
    from attn_lt.chunks import PIPE_RING_BYTES
    from attn_lt.validate import MaskInfo

    def slot(c, esize):  # pipe_layout's slot_bytes, one CTA a row
        return -(-c // 4) * 16 + c * esize // 16 * 16

    esize = {"bool": 1, "fp32": 4}.get(dtype, 2)
    kind = "bool" if dtype == "bool" else "float"
    case = Case.contiguous(1, 4, 4, 1024, 65536, 64, mask=MaskInfo(kind, dtype, (1, 1, 1024, 65536), (0, 0, 65536, 1)))
    assert one_cta_keys(case) == keys and keys % KEY_BLOCK == 0
    assert 2 * slot(keys, esize) <= PIPE_RING_BYTES < 2 * slot(keys + KEY_BLOCK, esize)
    assert tile_keys(case) == two_cta_keys and two_cta_keys % KEY_BLOCK == 0
    assert 2 * (2 * slot(two_cta_keys, esize) + 2048) <= 228 * 1024
    transposed = MaskInfo(kind, dtype, (1, 1, 65536, 1024), (0, 0, 1, 1024))
    strided = Case.contiguous(1, 4, 4, 1024, 65536, 64, mask=transposed)
    assert one_cta_keys(strided) == tile_keys(strided) == ONE_CTA_KEYS


@pytest.mark.parametrize("Sk", [28161, 30000, 65536 + 100])
def test_key_tiles_are_balanced(Sk):
    """Without causal masking a row block's key tiles are as even as the tile unit allows: no short last tile
    (28161 keys: two tiles of 14336 and 13825, not 26624 and 1537). Causal row blocks end at different keys, so
    their tiles keep the longest length (the rule measured on causal calls)."""
    longest = ONE_CTA_KEYS // 2048 * 2048
    plan = plan_chunks(Case.contiguous(1, 8, 8, 2048, Sk, 128), 1024 * MiB)
    n = -(-Sk // plan.key_tile)
    assert n == -(-Sk // longest), plan.summary()
    assert Sk - (n - 1) * plan.key_tile > plan.key_tile - 2048 * n, plan.summary()
    assert plan_chunks(Case.contiguous(1, 8, 8, 2048, Sk, 128, causal=True), 1024 * MiB).key_tile == longest


def test_one_cta_keys_is_what_the_softmax_ring_holds():
    """ONE_CTA_KEYS mirrors native/softmax.cu: two ring slots of an FP32 row within kPipeSmem bytes."""
    import pathlib
    import re

    from attn_lt.chunks import PIPE_RING_BYTES

    src = (pathlib.Path(__file__).resolve().parents[1] / "native" / "softmax.cu").read_text()
    kb = int(re.search(r"constexpr int64_t kPipeSmem = (\d+) \* 1024;", src).group(1))
    assert PIPE_RING_BYTES == kb * 1024
    assert ONE_CTA_KEYS == kb * 1024 // 2 // 4


def test_shapes_count_what_the_chunks_list():
    case = Case.contiguous(2, 8, 2, 3000, 9000, 64, causal=True)
    plan = plan_chunks(case, 6 * MiB)
    assert plan.key_tile
    counted = {}
    for c in plan.iter_chunks():
        k = (plan.rows(c) if c.gi is not None else None, c.ne, c.keys, c.tile)
        counted[k] = counted.get(k, 0) + 1
    assert counted == {k: n for k, (_, n) in plan.shapes().items()}
    assert plan.to_dict()["chunks"] == len(plan.chunks) == sum(counted.values())


def test_key_tiles_option():
    case = Case.contiguous(1, 2, 2, 128, 65536, 64)
    assert plan_chunks(case, 8 * MiB).key_tile
    with config.override(key_tiles=False):
        assert plan_chunks(case, 8 * MiB).key_tile == 0
    assert plan_chunks(case, 8 * MiB).key_tile
    with pytest.raises(ValueError, match="key_tiles must be True or False"):
        with config.override(key_tiles=2):
            pass
