"""The fused path's launch rule (CPU): which kernel, how many key splits, and the workspace they take."""

import pytest

from attn_lt import fused
from attn_lt.validate import Case, MaskInfo
from attn_lt.fused import ASSUMED_DEVICE, DeviceFacts, fused_launch, hopper_mask_refusal, split_count

H100 = ASSUMED_DEVICE
A100 = DeviceFacts(108, False, 166912)


def test_split_count_fills_the_gpu_and_never_splits_a_full_grid():
    assert split_count(264, 264) == 1
    assert split_count(64, 264) == 4  # 256 CTAs: one nearly full wave
    s = split_count(8, 264)
    assert 8 * s >= 0.85 * 264 and s <= 128
    assert 100 <= split_count(1, 264) <= fused.MAX_SPLITS  # capped


def test_the_launch_does_not_depend_on_the_key_length():
    """One plan serves a decode loop's every step: the split count is planned for long keys (the launchers cut it
    to the parts each call's keys fill), so the launch and its workspace are those of any other key length."""
    for Sq, Hq, Hkv in ((1, 32, 8), (16, 32, 8), (1, 32, 32)):
        launches = {fused_launch(Case.contiguous(1, Hq, Hkv, Sq, Sk, 128), H100) for Sk in (1, 97, 4096, 4097, 10**6)}
        assert len(launches) == 1, launches


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk", [(8, 32, 8, 1, 32768), (1, 32, 8, 1, 32768), (8, 32, 32, 1, 8192),
                                            (8, 32, 8, 16, 32768), (32, 128, 1, 1, 8192)])
def test_decode_takes_the_split_kernel(B, Hq, Hkv, Sq, Sk):
    c = Case.contiguous(B, Hq, Hkv, Sq, Sk, 128)
    f = fused_launch(c, H100)
    rows = Sq * Hq // Hkv
    assert f.kernel == ("sm90_decode" if rows >= 32 and Sq <= 64 else "sm90" if rows > 64 else "flash")
    assert fused_launch(c, A100).kernel == ("flash" if rows <= 64 else "flash")
    if f.kernel == "flash":
        assert f.block_rows == (16 if rows <= 16 else 64) and f.splits >= 1
        assert f.workspace_bytes == (0 if f.splits == 1 else f.splits * B * Hq * Sq * 129 * 4)
        assert "split" in str(f) or f.splits == 1


def test_prefill_takes_the_hopper_kernel_unless_its_mask_or_gpu_rules_it_out():
    c = Case.contiguous(1, 16, 16, 4096, 4096, 128)
    assert fused_launch(c, H100).kernel == "sm90"
    assert fused_launch(c, A100).kernel == "flash" and fused_launch(c, A100).block_rows == 128
    m = MaskInfo("float", "fp32", (1, 1, 4096, 4096), (0, 0, 4096, 1))
    f = fused_launch(Case.contiguous(1, 16, 16, 4096, 4096, 128, mask=m), H100)
    assert f.kernel == "flash" and f.block_rows == 64 and f.splits == 1 and "fp32 mask" in f.why


def test_mla_prefill_head_dims_take_the_hopper_kernel_only(monkeypatch):
    """q/k head dim 192 with v's 128: the Hopper kernel's row blocks, no mask; the declaration says why not."""
    from attn_lt import fused

    c = Case.contiguous(1, 128, 128, 8192, 8192, 192, causal=True, Dv=128)
    assert fused_launch(c, H100).kernel == "sm90" and fused.WMMA.not_supported_reasons(c) == []
    m = MaskInfo("bool", "bool", (1, 1, 8192, 8192), (0, 0, 8192, 1))
    masked = Case.contiguous(1, 128, 128, 8192, 8192, 192, mask=m, Dv=128)
    assert "no masked build" in fused.WMMA.not_supported_reasons(masked)[0]
    decode = Case.contiguous(4, 128, 128, 16, 8192, 192, Dv=128)  # 16 rows a kv head
    assert "more than 64 rows a kv head (16 here)" in fused.WMMA.not_supported_reasons(decode)[0]
    assert fused.WMMA.not_supported_reasons(Case.contiguous(1, 128, 2, 8, 8192, 192, Dv=128)) == []  # 512 rows
    monkeypatch.setattr(fused, "device_facts", lambda device=None: A100)
    assert "(sm_90a), not on this GPU" in fused.WMMA.not_supported_reasons(c)[0]


def test_mla_decode_takes_the_hopper_kernel_with_its_keys_in_parts():
    """q/k 576, v = k[..., :512], one query a head: 64-head blocks, the keys split to fill the SMs (one CTA an SM),
    the partials within their budget; any other layout of those head dims stays with the long path."""
    from attn_lt import fused

    c = Case.contiguous(32, 128, 1, 1, 32768, 576, Dv=512, v_in_k=True)
    f = fused_launch(c, H100)
    assert (f.kernel, f.block_rows, f.splits) == ("sm90", 64, 2) and "MLA decode" in f.why
    assert f.workspace_bytes == 2 * 32 * 128 * 513 * 4 and fused.WMMA.not_supported_reasons(c) == []
    one = fused_launch(Case.contiguous(1, 16, 1, 1, 65536, 576, Dv=512, v_in_k=True), H100)
    assert one.splits > 32 and one.splits * 16 * 513 * 4 <= fused.MAX_SPLIT_BYTES  # one block: many parts
    # planned for long keys: the launcher runs the parts a call's keys fill (one for a tile)
    assert fused_launch(Case.contiguous(1, 16, 1, 1, 64, 576, Dv=512, v_in_k=True), H100) == one
    apart = Case.contiguous(32, 128, 1, 1, 32768, 576, Dv=512)  # v a tensor of its own
    assert "first 512 columns of k's memory" in fused.WMMA.not_supported_reasons(apart)[0]
    two = Case.contiguous(32, 128, 1, 2, 32768, 576, Dv=512, v_in_k=True)
    assert "one query a head (Sq = 2 here)" in fused.WMMA.not_supported_reasons(two)[0]


@pytest.mark.parametrize("mask,refusal", [
    (MaskInfo("bool", "bool", (1, 1, 4096, 4096), (0, 0, 4096, 1)), None),
    (MaskInfo("float", "bf16", (2, 1, 1, 4096), (4096, 0, 0, 1)), None),  # key padding, one row for all
    (MaskInfo("float", "bf16", (2, 16, 4096, 4096), (16 * 4096**2, 4096**2, 4096, 1)), None),
    (MaskInfo("float", "fp16", (1, 1, 4096, 4096), (0, 0, 4096, 1)), "fp16 mask"),  # not q's dtype
    (MaskInfo("float", "fp32", (1, 1, 4096, 4096), (0, 0, 4096, 1)), "fp32 mask"),
    (MaskInfo("bool", "bool", (1, 1, 4096, 4095), (0, 0, 4095, 1)), "row stride of 4095 bytes"),
    (MaskInfo("float", "bf16", (1, 1, 4096, 4100), (0, 0, 4100, 1)), "row stride of 8200 bytes"),
    (MaskInfo("bool", "bool", (1, 1, 4096, 8192), (0, 0, 8192, 2)), "keys 2 elements apart"),
    (MaskInfo("bool", "bool", (1, 1, 4096, 4096), (0, 0, 4096, 1), align=8), "aligned to 8 bytes"),
])
def test_which_masks_the_hopper_kernel_reads(mask, refusal):
    """native/flash_sm90.cu reads bool and q-dtype masks by TMA: contiguous keys, 16-byte strides and address."""
    c = Case.contiguous(2, 16, 16, 4096, 4096, 128, mask=mask)
    assert hopper_mask_refusal(c) is None if refusal is None else refusal in hopper_mask_refusal(c)
    f = fused_launch(c, H100)
    assert f.kernel == ("sm90" if refusal is None else "flash")
    assert "a mask read by TMA" in f.why if refusal is None else f.why.startswith("the Hopper kernel cannot read")
    assert refusal is None or refusal in f.why
    assert fused_launch(c, A100).kernel == "flash"


def test_partials_stay_within_their_budget():
    f = fused_launch(Case.contiguous(1, 1, 1, 64, 2**24, 256), H100)
    assert f.workspace_bytes <= 256 << 20


def test_a_forced_launch_keeps_the_rules_tiling_and_workspace():
    c = Case.contiguous(2, 32, 8, 16, 4097, 128)  # 64 rows a kv head
    f = fused_launch(c, H100, kernel="flash", splits=3)
    assert (f.kernel, f.block_rows, f.splits) == ("flash", 64, 3) and f.why == "forced by the caller"
    assert f.workspace_bytes == 3 * 2 * 32 * 16 * 129 * 4
    assert fused_launch(c, H100, kernel="flash", splits=1).workspace_bytes == 0
    assert fused_launch(Case.contiguous(2, 32, 8, 1, 4097, 128), H100, kernel="flash").block_rows == 16
    assert fused_launch(c, A100, kernel="sm90").kernel == "sm90"
    with pytest.raises(ValueError):
        fused_launch(c, H100, kernel="wgmma")
    with pytest.raises(ValueError):
        fused_launch(c, H100, splits=0)


def test_one_program_serves_one_call_at_a_time():
    """The library reads a program's argument struct while other Python threads run (ctypes lets go of the GIL):
    each launch must see the addresses of its own call, never a mix of two threads' calls."""
    import threading
    import time

    from attn_lt.chunks import out_strides
    from attn_lt.fused import Program

    case = Case.contiguous(8, 32, 8, 1, 32768, 128)
    launch = fused_launch(case, H100)
    seen, errors = [], []

    def fake_launch(a, stream):  # what the library would read, read slowly
        first = (a.q, a.k, a.v)
        time.sleep(0.0002)
        seen.append(first == (a.q, a.k, a.v) and a.q == a.k - 1 == a.v - 2 and stream == a.q)

    for other_keys in (False, True):  # the case's key length, or each call's (a decode loop's steps)
        program = Program(case, out_strides(case), launch)
        program._launch = fake_launch

        def call(base, program=program, other_keys=other_keys):
            try:
                for i in range(40):
                    x = base + 16 * i
                    keys = (4096 + i, case.k_strides, case.v_strides) if other_keys else ()
                    program.run(x, x + 1, x + 2, 0, 0, x, 0, 0, *keys)
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=call, args=(1 << (20 + t),)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and len(seen) == 2 * 4 * 40 and all(seen)


@pytest.mark.parametrize("B,Hkv,Sk,masked,splits,alone", [
    (8, 8, 8192, False, 2, True),      # 64 blocks: one CTA an SM, parts of 64 key tiles
    (1, 8, 32768, False, 16, True),    # 8 blocks: 128 CTAs, parts of 32 tiles
    (1, 8, 8192, False, 16, True),     # planned for long keys: the launcher cuts 8k keys to 16 parts of 8 tiles
    (4, 32, 32768, False, 1, False),   # 128 blocks already fill one CTA an SM
    (8, 8, 8192, True, 4, False),      # a mask: two CTAs an SM
    (1, 8, 32768, True, 32, False),
])
def test_decode_splits_for_one_or_two_ctas_an_sm(B, Hkv, Sk, masked, splits, alone):
    import dataclasses

    c = Case.contiguous(B, 32, Hkv, 1, Sk, 128)
    if masked:
        c = dataclasses.replace(c, mask=MaskInfo("float", "bf16", (B, 1, 1, Sk), (Sk, 0, Sk, 1)))
    f = fused_launch(c, H100)
    assert f.splits == splits
    assert ("one CTA an SM" in f.why) == alone


def test_split_count_counts_the_critical_path_in_key_tiles():
    # 8 blocks, 264 slots, 512 key tiles: 32 parts of 16 tiles in one wave (33 would start a second)
    assert split_count(8, 264) == 32
    # one wave either way: the fewest parts among those within SPLIT_FILL of the shortest path
    assert split_count(64, 132) == 2


@pytest.mark.parametrize("Hq,Hkv,Sq,blocks", [(32, 8, 16, 8 * 8), (32, 8, 8, 8 * 8), (64, 4, 4, 8 * 4),
                                              (32, 4, 5, 8 * 4), (48, 4, 5, 8 * 4 * 2)],
                         ids=["sq16-g4", "sq8-g4", "sq4-g16", "sq5-g8", "sq5-g12"])
def test_hopper_decode_blocks_of_32_to_64_rows_take_the_wgmma_decode_kernel(Hq, Hkv, Sq, blocks):
    """32-64 rows a kv head, head dim 128, no mask, on Hopper: native/flash_sm90.cu's decode kernel, 64-row blocks
    of sq_box positions (Sq rounded up to a power of two) x 64 / sq_box heads, the keys split for one CTA an SM;
    the same cases elsewhere, with a mask per head or in fp32, or at head dim 256 stay on native/flash.cu."""
    c = Case.contiguous(8, Hq, Hkv, Sq, 32768, 128)
    f = fused_launch(c, H100)
    assert (f.kernel, f.block_rows) == ("sm90_decode", 64) and f"{blocks} blocks" in f.why, f.why
    assert f.splits == split_count(blocks, H100.sms)
    assert f.workspace_bytes == (0 if f.splits == 1 else f.splits * 8 * Hq * Sq * 129 * 4)
    assert "decode kernel" in str(f)
    assert fused_launch(c, A100).kernel == "flash"
    shared = MaskInfo("bool", "bool", (8, 1, Sq, 32768), (Sq * 32768, 0, 32768, 1))
    fm = fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 128, mask=shared), H100)
    assert fm.kernel == "sm90_decode" and "a mask its heads share" in fm.why
    per_head = MaskInfo("bool", "bool", (8, Hq, Sq, 32768), (Hq * Sq * 32768, Sq * 32768, 32768, 1))
    fp32 = MaskInfo("float", "fp32", (8, 1, Sq, 32768), (Sq * 32768, 0, 32768, 1))
    for m in (per_head, fp32):
        assert fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 128, mask=m), H100).kernel == "flash"
    assert fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 256), H100).kernel == "flash"
    assert fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 64), H100).kernel == "sm90_decode"
    # the key length does not enter: a decode loop's steps share the launch
    assert fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32769, 128), H100) == f


def test_the_decode_kernel_forced_checks_what_it_runs():
    f = fused_launch(Case.contiguous(2, 8, 8, 1, 1024, 128), H100, kernel="sm90_decode", splits=3)
    assert (f.kernel, f.splits, f.why) == ("sm90_decode", 3, "forced by the caller")
    for bad in (Case.contiguous(2, 8, 8, 65, 1024, 128), Case.contiguous(2, 8, 8, 1, 1024, 256)):
        with pytest.raises(ValueError, match="decode kernel runs head dims 64 and 128"):
            fused_launch(bad, H100, kernel="sm90_decode")
    per_head = MaskInfo("bool", "bool", (2, 8, 1, 1024), (8192, 1024, 1024, 1))
    with pytest.raises(ValueError, match="a mask per head"):
        fused_launch(Case.contiguous(2, 8, 8, 1, 1024, 128, mask=per_head), H100, kernel="sm90_decode")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fused_launch(Case.contiguous(2, 8, 8, 1, 1024, 128), H100, kernel="sm100")


def test_decode_mask_refusal_names_what_the_decode_kernel_cannot_stage():
    from attn_lt.fused import decode_mask_refusal

    def case(Hq, Sq, shape, strides, dtype="bool"):
        return Case.contiguous(2, Hq, 1, Sq, 1024, 128, mask=MaskInfo("bool" if dtype == "bool" else "float",
                                                                        dtype, shape, strides))

    assert decode_mask_refusal(Case.contiguous(2, 8, 1, 16, 1024, 128)) is None  # no mask
    assert decode_mask_refusal(case(8, 16, (2, 1, 16, 1024), (16384, 0, 1024, 1))) is None
    assert decode_mask_refusal(case(1, 16, (2, 1, 16, 1024), (16384, 0, 1024, 1))) is None  # one head
    assert decode_mask_refusal(case(8, 32, (2, 1, 1, 1024), (1024, 0, 0, 1))) is None  # one row for all positions
    assert "a mask per head" in decode_mask_refusal(case(8, 4, (2, 8, 4, 1024), (32768, 4096, 1024, 1)))
    assert "32 mask rows" in decode_mask_refusal(case(8, 32, (2, 1, 32, 1024), (32768, 0, 1024, 1)))
    assert "fp32 mask" in decode_mask_refusal(case(8, 4, (2, 1, 4, 1024), (4096, 0, 1024, 1), "fp32"))


@pytest.mark.parametrize("Hq,Hkv,Sq", [(32, 8, 32), (32, 8, 64), (32, 4, 48), (128, 1, 1), (32, 32, 64)],
                         ids=["sq32-g4", "sq64-g4", "sq48-g8", "sq1-g128", "mha-sq64"])
def test_up_to_64_positions_take_the_decode_kernel_beyond_64_rows(Hq, Hkv, Sq):
    """Sq <= 64 with more than 64 rows a kv head: the decode kernel's blocks (sq_box positions x 64 / sq_box heads,
    a GQA group in several blocks) rather than the prefill kernel's 128-row blocks of one head; Sq 65 and a mask
    of more than 16 rows of positions go to the prefill kernel."""
    f = fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 128), H100)
    heads = 64 // (1 << (Sq - 1).bit_length())
    assert f.kernel == "sm90_decode" and f"{-(-(Hq // Hkv) // heads) * 8 * Hkv} blocks" in f.why, f.why
    assert fused_launch(Case.contiguous(8, Hq, Hkv, 65, 32768, 128), H100).kernel == "sm90"
    m = MaskInfo("bool", "bool", (8, 1, Sq, 32768), (Sq * 32768, 0, 32768, 1))
    want = "sm90_decode" if Sq <= 16 else "sm90" if Sq * Hq // Hkv > 64 else "flash"
    assert fused_launch(Case.contiguous(8, Hq, Hkv, Sq, 32768, 128, mask=m), H100).kernel == want


def test_decode_blocks_at_head_dim_64_fill_two_ctas_an_sm():
    """A key tile of head dim 64 is half the bytes: one CTA an SM left B8 H32/8 Sq1 32k at 2.90 TB/s on the H200
    (2 parts) against 4.19 with 4 parts; head dim 128 keeps one CTA an SM."""
    d64 = fused_launch(Case.contiguous(8, 32, 8, 1, 32768, 64), H100)
    d128 = fused_launch(Case.contiguous(8, 32, 8, 1, 32768, 128), H100)
    assert (d64.kernel, d64.splits) == ("flash", 4) and "one CTA an SM" not in d64.why
    assert (d128.kernel, d128.splits) == ("flash", 2) and "one CTA an SM" in d128.why
