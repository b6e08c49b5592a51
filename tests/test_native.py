"""The native build (nvcc, sm_80 + sm_90) and its loader; the tests marked native need the built library, not a
GPU."""

import ctypes
import shutil
import subprocess

import pytest

from attn_lt import native


@pytest.mark.native
def test_library_loads_with_matching_abi_and_sources():
    lib = native.load()
    assert lib.attn_lt_abi_version() == native.ABI_VERSION
    assert lib.attn_lt_source_hash().decode() == native.source_hash()
    assert lib.attn_lt_softmax_max_resident_cols() >= 16384
    assert native.status().startswith("ok")


def test_struct_matches_header():
    # 5 pointers + 20 int64 + 5 int32 (+ 4 bytes of tail padding, as in C): a mismatch would shift every field the
    # kernel reads.
    assert ctypes.sizeof(native.SoftmaxArgs) == 5 * 8 + 21 * 8 + 6 * 4
    assert ctypes.sizeof(native.TileMergeArgs) == 6 * 8 + 12 * 8 + 2 * 4
    # ... scale, 6 int32, padding, sinks, softcap, the window's 2 int32, padding, the scores' pointer and 2 strides,
    # the FP8 descale pointers, their head stride, kv_dtype and padding
    assert ctypes.sizeof(native.FlashArgs) == (8 * 8 + 22 * 8 + 4 + 6 * 4 + 4 + 8 + 4 + 2 * 4 + 4 + 3 * 8 + 3 * 8 + 2 * 4
                                               + 8)
    assert native.FlashArgs.kv_dtype.offset == ctypes.sizeof(native.FlashArgs) - 16  # (ABI 20: q_descale last)
    assert ctypes.sizeof(native.MassArgs) == ctypes.sizeof(native.FlashArgs) + 3 * 8
    assert ctypes.sizeof(native.BatchMassArgs) == ctypes.sizeof(native.BatchArgs) + 3 * 8
    assert ctypes.sizeof(native.ConvertArgs) == ctypes.sizeof(native.BatchArgs) + 3 * 8
    assert native.FlashArgs().window_left == native.BatchArgs().f.window_right == -1  # no window unless asked
    header = (native.SOURCE_DIR / "attn_lt.h").read_text()
    assert f"#define ATTN_LT_ABI_VERSION {native.ABI_VERSION}" in header


@pytest.mark.native
def test_invalid_arguments_refused_without_touching_the_gpu():
    with pytest.raises(native.CudaError, match="rows=0"):
        native.softmax(native.SoftmaxArgs(), 0)  # all-zero arguments: refused by the host-side checks


@pytest.mark.native
def test_mass_launcher_refuses_stored_scores_where_no_decode_block_stores_them():
    """attn_lt_key_mass with from_scores: one query row and at most 16 rows a kv head, else refused (fake addresses:
    nothing is read before the checks pass)."""
    import torch

    lib = native.load()

    def status(**change):
        m = native.MassArgs()
        f = m.f
        f.q, f.k, f.lse, m.mass = 0x10000, 0x20000, 0x30000, 0x40000
        f.B, f.Hq, f.Hkv, f.Sq, f.Sk, f.D = 2, 8, 2, 1, 4096, 128
        f.q_sh, f.q_ss, f.k_sh, f.k_ss, f.q_sb, f.k_sb = 128, 1024, 128, 256, 1024, 1048576
        f.scale, f.dtype = 0.1, native.DTYPE_CODES["bf16"]
        m.from_scores = 1
        for name, value in change.items():
            setattr(m if hasattr(native.MassArgs, name) and name != "f" else f, name, value)
        return lib.attn_lt_key_mass(ctypes.byref(m), None)

    if not torch.cuda.is_available():
        assert status() < 10000  # every check passes: the launch then fails for want of a GPU (a CUDA error)
    assert status(Sq=2) == 10001
    assert status(Hq=64, Hkv=2) == 10001  # 32 rows a kv head: the sm90 decode kernel, which stores none
    assert status(from_scores=3) == 10001
    assert status(kv_dtype=native.DTYPE_CODES["e4m3"]) == 10007  # a dense call on an FP8 cache stores no scores


@pytest.mark.native
def test_dense_forward_on_an_fp8_cache_refuses_to_store_scores():
    """attn_lt_flash_fwd with an FP8 KV cache and a scores buffer: ATTN_LT_ERR_DTYPE before any GPU work (only a
    serving batch's decode blocks store scores with FP8 K/V; fake addresses)."""
    lib = native.load()
    f = native.FlashArgs()
    f.q, f.k, f.v, f.o, f.lse = 0x10000, 0x20000, 0x30000, 0x40000, 0x50000
    f.B, f.Hq, f.Hkv, f.Sq, f.Sk, f.D, f.Dv = 2, 8, 2, 1, 4096, 128, 128
    f.q_sh, f.q_ss, f.q_sb = 128, 1024, 1024
    f.k_sh, f.k_ss, f.k_sb = 128, 256, 1048576
    f.v_sh, f.v_ss, f.v_sb = 128, 256, 1048576
    f.o_sh, f.o_ss, f.o_sb = 128, 1024, 1024
    f.scale, f.dtype, f.kv_dtype, f.splits = 0.1, native.DTYPE_CODES["bf16"], native.DTYPE_CODES["e4m3"], 1
    f.scores, f.s_sb, f.s_sh = 0x60000, 8 * 4096, 4096
    assert lib.attn_lt_flash_fwd(ctypes.byref(f), None) == 10007


@pytest.mark.native
@pytest.mark.skipif(shutil.which("cuobjdump") is None, reason="cuobjdump not on PATH")
def test_built_for_sm80_and_sm90():
    out = subprocess.run(["cuobjdump", "--list-elf", str(native.library_path())], capture_output=True,
                         text=True, check=True).stdout
    assert "sm_80" in out and "sm_90" in out


@pytest.mark.native
def test_missing_and_stale_library_say_how_to_build(tmp_path, monkeypatch):
    native.load.cache_clear()
    monkeypatch.setattr(native, "_LIB_PATH", tmp_path / "nope.so")
    with pytest.raises(native.NativeLibraryError, match="make native"):
        native.load()
    native.load.cache_clear()
    monkeypatch.undo()
    src = tmp_path / "native"
    shutil.copytree(native.SOURCE_DIR, src)
    (src / "softmax.cu").write_text((src / "softmax.cu").read_text() + "\n// edited\n")
    monkeypatch.setattr(native, "SOURCE_DIR", src)
    native.load.cache_clear()
    with pytest.raises(native.NativeLibraryError, match="stale.*make native"):
        native.load()
    native.load.cache_clear()


@pytest.mark.native
def test_precondition_statuses_name_the_check():
    """Launchers return an attn_lt_status naming the failed precondition (no GPU needed to read the names)."""
    header = (native.SOURCE_DIR / "attn_lt.h").read_text()
    lib = native.load()
    for name, code in (("ARGS", 10001), ("HEAD_DIM", 10003), ("STRIDES", 10006), ("TENSOR_MAP", 10011),
                       ("LATENT", 10012)):
        assert f"ATTN_LT_ERR_{name} = {code}" in header
        assert lib.attn_lt_error_string(code).decode().startswith("precondition failed:")
    assert "head dim" in lib.attn_lt_error_string(10003).decode()
