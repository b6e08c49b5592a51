"""Loading ``libattn_lt.so`` with ctypes, and typed launchers for its kernels.

``native/build.py`` (run by ``pip install .`` and ``make native``) builds the library and the compiled fast path
into ``attn_lt/_native/``, each with the hash of its sources, and records there (``BUILD.txt``) what it built and
what it skipped, and why. In a source checkout a library built from other sources is refused as stale, with the
command that rebuilds it. This module imports no torch (the build script uses its hashes and file names).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path

from . import config

log = logging.getLogger("attn_lt")

ABI_VERSION = 23
_PKG = Path(__file__).resolve().parent
_LIB_PATH = _PKG / "_native" / "libattn_lt.so"
SOURCE_DIR = _PKG.parent / "native"
_BUILD_HINT = "reinstall with nvcc on PATH (`pip install .`), run `make native` in a checkout, or set ATTN_LT_LIB"
#: What native/build.py built and skipped, and why, one line a part (beside the library).
BUILD_RECORD = "BUILD.txt"

DTYPE_CODES = {"none": 0, "fp16": 1, "bf16": 2, "fp32": 3, "bool": 4, "e4m3": 5}
#: Softmax kernels (``SoftmaxArgs.variant``, names from config.SOFTMAX_VARIANTS); "auto" picks by row length and GPU.
SOFTMAX_VARIANTS = dict(zip(config.SOFTMAX_VARIANTS, range(len(config.SOFTMAX_VARIANTS))))


class NativeLibraryError(RuntimeError):
    """The native library is missing, stale, or from another ABI version."""


class CudaError(RuntimeError):
    """A kernel launch of the native library failed; the message names the CUDA error."""


class SoftmaxArgs(ctypes.Structure):
    """Mirror of ``attn_lt_softmax_args`` in native/attn_lt.h."""

    _fields_ = [("scores", ctypes.c_void_p), ("probs", ctypes.c_void_p), ("lse", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("mass", ctypes.c_void_p)] + [
        (n, ctypes.c_int64) for n in ("rows", "cols", "batch", "ld_s", "bs_s", "ld_p", "bs_p", "row0", "gi0",
                                      "e0", "Sq", "Sk", "g", "Hkv", "Hq", "m_sb", "m_sh", "m_sq", "m_sk", "k0",
                                      "mass_q0")] + [
        (n, ctypes.c_int32) for n in ("causal", "out_dtype", "mask_dtype", "variant", "lse_local", "mass_add")]


class TileMergeArgs(ctypes.Structure):
    """Mirror of ``attn_lt_tile_merge_args`` in native/attn_lt.h."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("acc_o", "acc_lse", "part_o", "part_lse", "o", "lse")] + [
        (n, ctypes.c_int64) for n in ("rows", "batch", "Dv", "o_ld", "o_bs", "row0", "gi0", "e0", "Sq", "g", "Hkv",
                                      "Hq")] + [
        (n, ctypes.c_int32) for n in ("out_dtype", "last")]


#: ``FlashArgs``' address fields, in order (its first fields).
FLASH_ADDRESSES = ("q", "k", "v", "o", "lse", "mask", "o_part", "lse_part")


class FlashArgs(ctypes.Structure):
    """Mirror of ``attn_lt_flash_args`` in native/attn_lt.h."""

    _fields_ = [(n, ctypes.c_void_p) for n in FLASH_ADDRESSES] + [
        (n, ctypes.c_int64) for n in ("B", "Hq", "Hkv", "Sq", "Sk", "D", "q_sb", "q_sh", "q_ss", "k_sb", "k_sh",
                                      "k_ss", "v_sb", "v_sh", "v_ss", "o_sb", "o_sh", "o_ss", "m_sb", "m_sh",
                                      "m_sq", "m_sk")] + [
        ("scale", ctypes.c_float)] + [
        (n, ctypes.c_int32) for n in ("causal", "dtype", "variant", "mask_dtype", "splits", "Dv")] + [
        ("sinks", ctypes.c_void_p), ("softcap", ctypes.c_float), ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32), ("scores", ctypes.c_void_p), ("s_sb", ctypes.c_int64),
        ("s_sh", ctypes.c_int64), ("k_descale", ctypes.c_void_p), ("v_descale", ctypes.c_void_p),
        ("descale_sh", ctypes.c_int64), ("kv_dtype", ctypes.c_int32), ("pad_kv_", ctypes.c_int32),
        ("q_descale", ctypes.c_void_p)]

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        no_window(self)


def no_window(a: FlashArgs) -> None:
    """Unbounded window edges (-1): what a zeroed struct must be given before it reaches a kernel."""
    a.window_left = a.window_right = -1


class BatchArgs(ctypes.Structure):
    """Mirror of ``attn_lt_batch_args`` in native/attn_lt.h."""

    _fields_ = [("f", FlashArgs)] + [
        (n, ctypes.c_void_p) for n in ("cu_q", "cu_k", "seqlens_k", "block_table", "error")] + [
        (n, ctypes.c_int64) for n in ("total_q", "total_k", "bt_stride", "max_blocks", "num_blocks", "block_size")] + [
        ("split_keys", ctypes.c_int32), ("decode_rows", ctypes.c_int32), ("workspace_bytes", ctypes.c_int64)]

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        no_window(self.f)


#: ``attn_lt_batch_error`` bits of native/attn_lt.h and what each means.
BATCH_ERRORS = {1: "cu_seqlens_q decreasing, negative or past the packed queries",
                2: "a request with more query rows than max_seqlen_q",
                4: "cu_seqlens_k decreasing, negative or past the packed keys, or a negative seqlens_k",
                8: "a request with more keys than max_seqlen_k or than its block table row holds",
                16: "a block id outside [0, num_blocks)"}
#: ``attn_lt_batch_variant``: which kernel runs a batch's row blocks.
BATCH_VARIANTS = {"flash": 0, "sm90": 1}


class MassArgs(ctypes.Structure):
    """Mirror of ``attn_lt_mass_args`` in native/attn_lt.h."""

    _fields_ = [("f", FlashArgs), ("mass", ctypes.c_void_p), ("q0", ctypes.c_int64), ("from_scores", ctypes.c_int64)]


class BatchMassArgs(ctypes.Structure):
    """Mirror of ``attn_lt_batch_mass_args`` in native/attn_lt.h."""

    _fields_ = [("b", BatchArgs), ("mass", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("from_scores", ctypes.c_int64)]


class ConvertArgs(ctypes.Structure):
    """Mirror of ``attn_lt_convert_args`` in native/attn_lt.h."""

    _fields_ = [("b", BatchArgs)] + [(n, ctypes.c_void_p) for n in ("k_out", "v_out", "table_out")]


class ScoresArgs(ctypes.Structure):
    """Mirror of ``attn_lt_scores_args`` in native/attn_lt.h."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "k", "s")] + [
        (n, ctypes.c_int64) for n in ("rows", "cols", "batch", "D", "q_ld", "q_bs", "k_ld", "k_bs", "s_ld",
                                      "s_bs")] + [
        ("alpha", ctypes.c_float), ("dtype", ctypes.c_int32)]


def flash_addresses(args: FlashArgs) -> ctypes.Array:
    """The address fields of ``args`` as one array over its memory: set in one assignment (a launch's hot path)."""
    return (ctypes.c_void_p * len(FLASH_ADDRESSES)).from_buffer(args)


def files_hash(files) -> str:
    """sha256 of ``files`` concatenated in the order given, 16 hex digits (the hash a native build embeds)."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def source_hash(src_dir: Path | None = None) -> str | None:
    """The hash the Makefile embeds: :func:`files_hash` of native/*.cu, *.cuh, *.h in name order."""
    src_dir = SOURCE_DIR if src_dir is None else src_dir
    files = sorted(p for p in src_dir.glob("*") if p.suffix in (".cu", ".cuh", ".h")) if src_dir.is_dir() else []
    return files_hash(sorted(files, key=lambda p: f"native/{p.name}")) if files else None


def fastpath_source_hash(src_dir: Path | None = None) -> str | None:
    """The hash the compiled fast path embeds: :func:`files_hash` of native/attn_lt.h and native/fastpath.cpp."""
    src_dir = SOURCE_DIR if src_dir is None else src_dir
    files = [src_dir / "attn_lt.h", src_dir / "fastpath.cpp"]
    return files_hash(files) if all(p.is_file() for p in files) else None


def fastpath_filename(cache_tag: str, torch_version: str) -> str:
    """The compiled fast path's file name for one Python (``sys.implementation.cache_tag``) and one torch: a C++
    extension binds to both, so another Python or torch finds no file and runs without it."""
    return f"_fastpath-{cache_tag}-torch{torch_version}.so"


def build_record(skipped_only: bool = False) -> str:
    """What the build said about the native parts (``BUILD.txt``; with ``skipped_only``, what it did not build and
    why), one line, or "" where there is none."""
    try:
        lines = (_PKG / "_native" / BUILD_RECORD).read_text().splitlines()
    except OSError:
        return ""
    return "; ".join(line for line in lines if line and (not skipped_only or "not built" in line))


def library_path() -> Path:
    override = config.current().lib
    return Path(override) if override else _LIB_PATH


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """Load and check the native library; raises :class:`NativeLibraryError` saying how to fix it."""
    path = library_path()
    if not path.is_file():
        record = build_record(skipped_only=True) if config.current().lib is None else ""
        raise NativeLibraryError(f"native library not found at {path}"
                                 f"{f' (the build said: {record})' if record else ''}; {_BUILD_HINT}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeLibraryError(f"cannot load {path}: {e}; {_BUILD_HINT}") from e
    if not hasattr(lib, "attn_lt_abi_version"):
        raise NativeLibraryError(f"{path} is not an attn_lt library (it has no attn_lt_abi_version); {_BUILD_HINT}")
    lib.attn_lt_abi_version.restype = ctypes.c_int
    abi = lib.attn_lt_abi_version()
    if abi != ABI_VERSION:
        raise NativeLibraryError(f"{path} has ABI version {abi}, this package expects {ABI_VERSION}; {_BUILD_HINT}")
    try:
        lib.attn_lt_source_hash.restype = ctypes.c_char_p
        lib.attn_lt_error_string.restype = ctypes.c_char_p
        lib.attn_lt_error_string.argtypes = [ctypes.c_int]
        lib.attn_lt_softmax_max_resident_cols.restype = ctypes.c_int64
        lib.attn_lt_softmax.restype = ctypes.c_int
        lib.attn_lt_softmax.argtypes = [ctypes.POINTER(SoftmaxArgs), ctypes.c_void_p]
        lib.attn_lt_softmax_adds_mass.restype = ctypes.c_int
        lib.attn_lt_softmax_adds_mass.argtypes = [ctypes.POINTER(SoftmaxArgs)]
        lib.attn_lt_tile_merge.restype = ctypes.c_int
        lib.attn_lt_tile_merge.argtypes = [ctypes.POINTER(TileMergeArgs), ctypes.c_void_p]
        lib.attn_lt_flash_fwd.restype = ctypes.c_int
        lib.attn_lt_flash_fwd.argtypes = [ctypes.POINTER(FlashArgs), ctypes.c_void_p]
        lib.attn_lt_flash_sm90_fwd.restype = ctypes.c_int
        lib.attn_lt_flash_sm90_fwd.argtypes = [ctypes.POINTER(FlashArgs), ctypes.c_void_p]
        lib.attn_lt_flash_sm90_supported.restype = ctypes.c_int
        lib.attn_lt_flash_sm90_supported.argtypes = []
        lib.attn_lt_scores_sm90.restype = ctypes.c_int
        lib.attn_lt_scores_sm90.argtypes = [ctypes.POINTER(ScoresArgs), ctypes.c_void_p]
        lib.attn_lt_flash_convert_kv.restype = ctypes.c_int
        lib.attn_lt_flash_convert_kv.argtypes = [ctypes.POINTER(FlashArgs), ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_void_p]
        for name, args in (("attn_lt_batch_fwd", BatchArgs), ("attn_lt_key_mass", MassArgs),
                           ("attn_lt_batch_key_mass", BatchMassArgs), ("attn_lt_batch_convert_kv", ConvertArgs)):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.POINTER(args), ctypes.c_void_p]  # a stream is 64 bits, not an int
    except AttributeError as e:  # the right ABI number but not our symbols
        raise NativeLibraryError(f"{path} is not a complete attn_lt library ({e}); {_BUILD_HINT}") from None
    built = lib.attn_lt_source_hash().decode()
    expected = source_hash()
    if config.current().lib is None and expected is not None and built != expected:
        raise NativeLibraryError(f"{path} is stale: built from sources {built}, native/ is now {expected}; "
                                 f"{_BUILD_HINT}")
    log.debug("loaded %s (ABI %d, sources %s)", path, abi, built)
    return lib


def status() -> str:
    """One line on the native library, for `attn-lt info`; never raises."""
    try:
        lib = load()
    except NativeLibraryError as e:
        return f"unavailable: {e}"
    return f"ok ({lib._name}, ABI {ABI_VERSION}, sources {lib.attn_lt_source_hash().decode()})"


def _raise(name: str, err: int, describe: str) -> None:
    raise CudaError(f"{name} failed: {load().attn_lt_error_string(err).decode()} (status {err}); {describe}")


def _launch(name: str, args: ctypes.Structure, stream: int, describe) -> None:
    """Call launcher ``name`` of the library on ``stream`` (a cudaStream_t as int); a nonzero status becomes
    :class:`CudaError` naming the error (a CUDA error, or the native precondition that failed) and the launch
    (``describe(args)``)."""
    err = getattr(load(), name)(ctypes.byref(args), stream)
    if err:
        _raise(name, err, describe(args))


@functools.lru_cache(maxsize=1)
def _softmax_fn():
    return load().attn_lt_softmax


def softmax(args: SoftmaxArgs, stream: int) -> None:
    """Launch the row softmax of the long path; raises :class:`CudaError` on failure."""
    err = _softmax_fn()(ctypes.byref(args), stream)  # the hot path: one foreign call
    if err:
        _raise("attn_lt_softmax", err, f"rows={args.rows} cols={args.cols} batch={args.batch} ld_s={args.ld_s}")


def softmax_adds_mass(args: SoftmaxArgs) -> bool:
    """Whether :func:`softmax` can add these arguments' P into their attention mass (``mass_add``) on the current
    device: the PIPE kernel runs them, each CTA's columns within its accumulators."""
    return bool(load().attn_lt_softmax_adds_mass(ctypes.byref(args)))


def tile_merge(args: TileMergeArgs, stream: int) -> None:
    """Launch the LSE merge of a key tile of the long path; raises :class:`CudaError` on failure."""
    _launch("attn_lt_tile_merge", args, stream,
            lambda a: f"rows={a.rows} batch={a.batch} Dv={a.Dv} last={a.last}")


def flash(args: FlashArgs, stream: int) -> None:
    """Launch the fused kernel of native/flash.cu (mma.sync; masks; split over the keys, then the LSE merge);
    raises :class:`CudaError` on failure."""
    _launch("attn_lt_flash_fwd", args, stream,
            lambda a: f"B={a.B} Hq={a.Hq} Hkv={a.Hkv} Sq={a.Sq} Sk={a.Sk} D={a.D} Dv={a.Dv or a.D} splits={a.splits} "
                      f"mask_dtype={a.mask_dtype}")


def batch(args: BatchArgs, stream: int) -> None:
    """Launch a serving batch (native/flash.cu's attn_lt_batch_fwd: varlen or paged keys, lengths read from device
    memory); raises :class:`CudaError` on failure."""
    _launch("attn_lt_batch_fwd", args, stream,
            lambda a: f"requests={a.f.B} Hq={a.f.Hq} Hkv={a.f.Hkv} max_q={a.f.Sq} max_k={a.f.Sk} D={a.f.D} "
                      f"total_q={a.total_q} total_k={a.total_k} block_size={a.block_size} "
                      f"split_keys={a.split_keys} decode_rows={a.decode_rows} variant={a.f.variant}")


def flash_convert_kv(args: FlashArgs, k_out: int, v_out: int, stream: int) -> None:
    """Convert a dense call's FP8 KV cache for the 16-bit kernels (native/flash.cu's attn_lt_flash_convert_kv: into
    contiguous (B, Hkv, Sk, D) at ``k_out`` / ``v_out``); raises :class:`CudaError` on failure."""
    err = load().attn_lt_flash_convert_kv(ctypes.byref(args), k_out, v_out, stream)
    if err:
        _raise("attn_lt_flash_convert_kv", err, f"B={args.B} Hkv={args.Hkv} Sk={args.Sk} D={args.D}")


def batch_convert_kv(args: ConvertArgs, stream: int) -> None:
    """Convert a batch's FP8 KV cache for the 16-bit kernels (native/flash.cu's attn_lt_batch_convert_kv: the packed
    rows, or the blocks each request's keys use and a table of their places); raises :class:`CudaError` on
    failure."""
    _launch("attn_lt_batch_convert_kv", args, stream,
            lambda a: f"requests={a.b.f.B} Hkv={a.b.f.Hkv} D={a.b.f.D} total_k={a.b.total_k} "
                      f"block_size={a.b.block_size} max_blocks={a.b.max_blocks}")


def key_mass(args: MassArgs, stream: int) -> None:
    """Launch the attention mass per key of a finished fused call (native/flash.cu's attn_lt_key_mass: column sums
    of exp(s - lse) from the call's LSE); raises :class:`CudaError` on failure."""
    _launch("attn_lt_key_mass", args, stream,
            lambda a: f"B={a.f.B} Hq={a.f.Hq} Hkv={a.f.Hkv} Sq={a.f.Sq} Sk={a.f.Sk} D={a.f.D} q0={a.q0} "
                      f"mask_dtype={a.f.mask_dtype}")


def batch_key_mass(args: BatchMassArgs, stream: int) -> None:
    """Launch the attention mass per key of a finished serving batch (native/flash.cu's attn_lt_batch_key_mass: each
    request's last ``window`` rows, from the batch call's LSE); raises :class:`CudaError` on failure."""
    _launch("attn_lt_batch_key_mass", args, stream,
            lambda a: f"requests={a.b.f.B} Hq={a.b.f.Hq} Hkv={a.b.f.Hkv} max_q={a.b.f.Sq} max_k={a.b.f.Sk} "
                      f"D={a.b.f.D} block_size={a.b.block_size} window={a.window}")


#: ``FlashArgs.variant`` values of :func:`flash_sm90` (``attn_lt_flash_sm90_variant`` in native/attn_lt.h).
FLASH_SM90_VARIANTS = {"default": 0, "plain": 1, "decode": 2, "grid": 3}


def launcher_address(name: str) -> int:
    """The address of launcher ``name`` of the library (``attn_lt_flash_fwd``, ``attn_lt_flash_sm90_fwd``), for a
    caller in C (attn_lt.fastpath) that passes it an ``attn_lt_flash_args`` and a stream."""
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


def flash_sm90_supported() -> bool:
    """True when the current CUDA device is compute capability 9.0 and the library holds the sm_90a kernel."""
    return bool(load().attn_lt_flash_sm90_supported())


def flash_sm90(args: FlashArgs, stream: int) -> None:
    """Launch the Hopper fused kernel (native/flash_sm90.cu: TMA + wgmma, D 64/128/256, D 192 with Dv 128, MLA
    decode's D 576 with Dv 512, the decode variant's 64-row blocks at D 64 and 128); raises :class:`CudaError` on
    failure (cudaErrorNotSupported off sm_90, an attn_lt_status when a precondition fails)."""
    _launch("attn_lt_flash_sm90_fwd", args, stream,
            lambda a: f"B={a.B} Hq={a.Hq} Hkv={a.Hkv} Sq={a.Sq} Sk={a.Sk} D={a.D} Dv={a.Dv or a.D} "
                      f"splits={a.splits} variant={a.variant}")


@functools.lru_cache(maxsize=1)
def _scores_fn():
    return load().attn_lt_scores_sm90


def scores_sm90(args: ScoresArgs, stream: int) -> None:
    """Launch the long path's Hopper Q@K^T (native/scores_sm90.cu: FP32 scores, TMA stores overlapping the next
    tile's MMAs); raises :class:`CudaError` on failure."""
    err = _scores_fn()(ctypes.byref(args), stream)  # the hot path: one foreign call
    if err:
        _raise("attn_lt_scores_sm90", err, f"rows={args.rows} cols={args.cols} batch={args.batch} D={args.D} "
                                           f"ld=({args.q_ld},{args.k_ld},{args.s_ld})")
