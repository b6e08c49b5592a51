"""The fused path ``wmma`` (the design card's name): its declaration, its launch plan and its launcher.

One tensor-core kernel with an online softmax, no score matrix in memory; fp16/bf16, causal, GQA, any lengths,
LSE, dense masks. Two kernels behind the one name:

* ``native/flash_sm90.cu`` (Hopper, sm_90a): TMA into an mbarrier ring, ``wgmma`` for Q·Kᵀ and P·V with P from
  registers, a producer warpgroup and two consumer warpgroups with register reallocation, the softmax overlapped
  with the next tile's GEMM; head dims 64, 128 and 256, and MLA prefill's q/k head dim 192 with v's 128; dense
  bool masks and additive masks in q's dtype read by TMA tile by tile (:func:`hopper_mask_refusal` says which
  masks). It runs prefill-sized row blocks on Hopper. Beside it, MLA decode (q/k 576, v k's first 512 columns,
  one query a head): 64 query heads a block against one latent cache tile, the keys split in parts; and the
  decode kernel ("sm90_decode": head dim 64 or 128, up to 64 query positions and at least 32 rows of positions × query
  heads a kv head, e.g. Sq 16 with GQA 4, a mask its heads share): 64-row blocks on wgmma, two warpgroups taking
  the key tiles in turn, the keys split.
* ``native/flash.cu`` (every GPU from sm_80): ``mma.sync`` fed by ``cp.async``; the query heads of one kv head
  folded into the rows of a tile (each K/V tile read once per group); dense bool or additive masks read by strides;
  and a split of the key range (flash-decoding): when the row blocks alone cannot fill the GPU — decode, a few query
  rows against long keys — each block's keys are cut into ``splits`` parts whose FP32 partial outputs and LSEs a
  merge kernel joins (the same LSE merge as :mod:`attn_lt.merge`, in CUDA). It runs decode, the masks TMA cannot
  read (fp32, unaligned rows), and everything off Hopper.

:func:`fused_launch` is the one rule for which kernel, how many splits, and the workspace the partials take.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, replace

from . import native
from .backends import Backend
from .device import current_index
from .validate import Case

#: Row blocks of at most this many rows (query positions × query heads of one kv head) take native/flash.cu with
#: one m16 tile a warp, and may split their keys; up to WARP_SPLIT_ROWS the four warps share 16 rows and split
#: every key tile among them (native/flash.cu's launch_dim holds the same rule).
DECODE_ROWS, WARP_SPLIT_ROWS = 64, 16
#: Keys a tile of the split kernels.
KEY_TILE = 64
#: The most parts a launch cuts the keys into. A launch is planned for keys that fill them all (PLANNED_TILES key
#: tiles, 32k keys); shorter keys run fewer parts, as many as they fill at four tiles a part (native/common.cuh's
#: dense_parts, applied by the launchers to each call's key length), so that one plan serves every key length.
MAX_SPLITS = 128
PLANNED_TILES = 512
#: How close to the shortest the chosen split count's critical path must be (see :func:`split_count`).
#: FlashAttention-2's own rule (the fewest splits whose last wave is 85 % as full as the best) picked 15, 29 and 31
#: splits on the H200 (240, 232 and 248 CTAs for 264 slots; at 31 parts of 128 key tiles five CTAs get none),
#: 3–5 % slower than 16 and 32.
SPLIT_FILL = 0.96
#: Decode blocks without a mask split their keys to fill one CTA an SM (not two) where the long keys the launch is
#: planned for keep this many key tiles a part: on the H200 1–3 % faster than two an SM (fewer partials to merge);
#: with a mask, two an SM stay 15–25 % faster (the mask tile's latency needs the second CTA).
ONE_CTA_MIN_TILES = 16
#: Calls of at most SM90_DECODE_ROWS query positions with at least SM90_DECODE_MIN_ROWS rows a kv head take
#: native/flash_sm90.cu's decode kernel on Hopper (head dims SM90_DECODE_HEAD_DIMS, a mask only as
#: :func:`decode_mask_refusal` allows; ``"sm90_decode"``): 64-row blocks (positions × query heads) on wgmma, 64-key
#: tiles, one CTA an SM, the keys split as native/flash.cu's are. native/flash.cu's mma.sync decode blocks are
#: compute-bound from 32 rows (64 rows: 60–72 % of the H200's copy rate at head dim 128, 49 % at 64), and the prefill
#: kernel's 128-row blocks of one head leave Sq <= 64 rows idle and read a GQA group's K and V once a head (Sq 32–64
#: with GQA 4: 1.15–1.22 TB/s on the H200 against 1.5–3.0 here).
SM90_DECODE_MIN_ROWS, SM90_DECODE_ROWS = 32, 64
SM90_DECODE_HEAD_DIMS = ((64, 64), (128, 128))
#: Mask rows (query positions) the decode kernel stages with each key tile: a mask its heads share, of at most this
#: many rows, or one row for every position.
SM90_DECODE_MASK_ROWS = 16
#: Largest workspace the split partials may take (FP32 outputs and LSEs).
MAX_SPLIT_BYTES = 256 << 20
#: Shared memory a CTA of native/flash.cu needs at head dim 256 (64 query rows, two K and two V tiles of 64 keys).
SMEM_D256 = (64 + 4 * KEY_TILE) * 256 * 2
#: (q/k head dim, v head dim) pairs: both kernels run v's head dim = q's; only native/flash_sm90.cu runs MLA
#: prefill's (192, 128) and MLA decode's (576, 512), without a mask (its ``head_dims_built``, ``mask_kind`` and MLA
#: decode rules).
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (256, 256))
MLA_DECODE = (576, 512)
HOPPER_HEAD_DIM_PAIRS = ((192, 128), MLA_DECODE)
#: Query heads a block of the MLA decode kernel.
MLA_ROWS = 64
#: q/k head dims whose attention mass per key the fused path returns (native/flash.cu's attn_lt_key_mass: a pass
#: over the keys after the call, from its LSE).
MASS_HEAD_DIMS = (64, 128, 256)


def prefers_fused_mass(case: Case, key_mass_window: int | None) -> bool:
    """Whether the fused call and its mass pass are faster than the long path's mass for ``case`` summing the last
    ``key_mass_window`` rows (None: all), both able to run it. The long path computes every row's scores, the pass
    only the summed rows', against every key tile: for a decode step (at most :data:`DECODE_ROWS` rows a kv head)
    the long path, as fast as the fused call within a run's spread where its decode blocks store the scores
    (:func:`stores_scores`; H200, B8 H32/8 Sk 32k: 0.307 ms against 0.300, the plain call 0.259; not measured so on
    an H100, where the fused call read K again: 0.56 against 0.78). Every row at head dim 256 takes the
    pass where the Hopper kernel runs (native/mass_sm90.cu; H200, B1 H32 S16k: 20.8 ms against 35.5) and the long
    path elsewhere (the sm_80 pass: 68.8 ms on the H100, against 41.8); a window of rows at any head dim, or every
    row at 64 and 128, takes the pass."""
    if case.Sq * case.group <= DECODE_ROWS:
        return False
    return (key_mass_window is not None and key_mass_window < case.Sq) or case.D <= 128 or hopper_kernel()


def stores_scores(case: Case, kernel: str) -> bool:
    """Whether ``kernel`` runs ``case`` on native/flash.cu's decode blocks for a one-row sequence, which can store
    each head's scores for the mass pass to turn into the mass in place (``attn_lt_flash_args::scores``): a decode
    step's mass then costs a write and a read of it, not a second read of K."""
    return kernel == "flash" and case.Sq == 1 and case.group <= WARP_SPLIT_ROWS


def _device_index(device: int | None) -> int | None:
    """``device``, or the current CUDA device when None; None without a GPU."""
    return device if device is not None else current_index()


def hopper_kernel(device: int | None = None) -> bool:
    """Whether the Hopper kernel runs on ``device`` (default: the current one); False without a GPU or library."""
    dev = _device_index(device)
    return dev is not None and _hopper_kernel(dev)


@functools.lru_cache(maxsize=16)
def _hopper_kernel(device: int) -> bool:
    try:
        import torch

        with torch.cuda.device(device):
            return native.flash_sm90_supported()
    except (native.NativeLibraryError, RuntimeError, OSError):
        return False


@dataclass(frozen=True)
class DeviceFacts:
    """What the launch plan needs to know of a GPU."""

    sms: int
    hopper: bool  # the sm_90a kernel runs here
    smem_optin: int  # shared memory a block may opt in to, bytes


#: Assumed when planning without a GPU (``explain`` on a CPU machine): an H100 SXM.
ASSUMED_DEVICE = DeviceFacts(132, True, 232448)


def device_facts(device: int | None = None) -> DeviceFacts | None:
    """The facts of ``device`` (default: the current one; each device looked up once), or None without a GPU."""
    dev = _device_index(device)
    return None if dev is None else _device_facts(dev)


@functools.lru_cache(maxsize=16)
def _device_facts(device: int) -> DeviceFacts | None:
    try:
        import torch

        props = torch.cuda.get_device_properties(device)
        smem = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
        return DeviceFacts(int(props.multi_processor_count), hopper_kernel(device), smem)
    except (RuntimeError, AssertionError):
        return None


@dataclass(frozen=True)
class FusedBackend(Backend):
    """The fused path's declaration: the head-dim pairs of :data:`HEAD_DIM_PAIRS` (256 where a CTA may take its
    shared memory), and those of :data:`HOPPER_HEAD_DIM_PAIRS` where the Hopper kernel takes the case."""

    def not_supported_reasons(self, case: Case, key_mass: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(case, key_mass)
        facts = device_facts()
        dims = (case.D, case.Dv)
        if dims in HOPPER_HEAD_DIM_PAIRS:
            what = f"q/k head dim {case.D} with v's {case.Dv} runs only in the Hopper kernel"
            rows = case.Sq * case.group
            if facts is not None and not facts.hopper:
                reasons.append(f"{what} (sm_90a), not on this GPU")
            elif case.mask is not None:
                reasons.append(f"{what}, which has no masked build for it")
            elif dims == MLA_DECODE:
                if case.variant:
                    reasons.append(f"{what} for decode, without a window, softcap or sinks")
                if case.Sq != 1:
                    reasons.append(f"{what} for decode, one query a head (Sq = {case.Sq} here)")
                if not case.v_in_k:
                    reasons.append(f"{what} with v the first {case.Dv} columns of k's memory (v = k[..., :{case.Dv}])")
            elif rows <= DECODE_ROWS:
                reasons.append(f"{what}, which takes more than {DECODE_ROWS} rows a kv head ({rows} here)")
        elif dims not in HEAD_DIM_PAIRS:
            same = tuple(d for d, _ in HEAD_DIM_PAIRS)
            if case.D == case.Dv:
                reasons.append(f"head dim {case.D} not in {same}")
            else:
                pairs = ", ".join(map(str, same + tuple(f"{d}/{dv}" for d, dv in HOPPER_HEAD_DIM_PAIRS)))
                reasons.append(f"head dims {case.D}/{case.Dv} (q·k/v) not in ({pairs})")
        if key_mass and case.D not in MASS_HEAD_DIMS:
            reasons.append(f"the attention mass per key at q/k head dim {case.D} (it takes {MASS_HEAD_DIMS})")
        if case.D == 256 and facts is not None and not facts.hopper and facts.smem_optin < SMEM_D256:
            reasons.append(f"head dim 256 needs {SMEM_D256} bytes of shared memory a block; this GPU allows "
                           f"{facts.smem_optin}")
        return reasons


#: What the fused kernels run (head dims: FusedBackend's pairs).
WMMA = FusedBackend("wmma", ("fp16", "bf16"), None, 576, supports_mask=True, supports_value_dim=True,
                    needs_aligned_rows=True, max_batch_heads=65535, supports_variants=True, supports_key_mass=True)


#: The fused path's kernels by the name :class:`FusedLaunch` gives them.
KERNEL_NAMES = {"sm90": "native/flash_sm90.cu (wgmma, TMA)",
                "sm90_decode": "native/flash_sm90.cu's decode kernel (wgmma, TMA)",
                "flash": "native/flash.cu (mma.sync)"}


@dataclass(frozen=True)
class FusedLaunch:
    """How the fused path runs one case: ``kernel`` "sm90" (native/flash_sm90.cu), "sm90_decode" (its decode
    kernel) or "flash" (native/flash.cu), rows a block, ``splits`` of the key range, and the bytes of workspace the
    split partials take."""

    kernel: str
    block_rows: int
    splits: int
    workspace_bytes: int
    why: str

    def __str__(self) -> str:
        name = KERNEL_NAMES[self.kernel]
        split = (f", keys split up to {self.splits} ways (as many as the keys fill, native/common.cuh dense_parts) "
                 "then merged by LSE") if self.splits > 1 else ""
        return f"{name}, {self.block_rows}-row blocks{split} ({self.why})"

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "block_rows": self.block_rows, "splits": self.splits,
                "workspace_bytes": self.workspace_bytes, "why": self.why}


@functools.lru_cache(maxsize=1024)
def split_count(blocks: int, slots: int, fill_first: bool = True) -> int:
    """How many parts (at most :data:`MAX_SPLITS`) to cut each row block's keys into for ``blocks`` CTAs on ``slots``
    (SMs × CTAs an SM): 1 when the blocks already fill 80 % of the slots, else the fewest parts whose critical path —
    the key tiles of a part, ceil(tiles / s), times the waves, ceil(blocks · s / slots) — is within
    :data:`SPLIT_FILL` of the shortest (FlashAttention-2's rule, counted in key tiles so that short last parts and
    empty CTAs count), for keys of :data:`PLANNED_TILES` tiles. The key length does not enter: shorter keys run fewer
    of these parts (see :data:`MAX_SPLITS`). ``fill_first=False``: the critical path decides even when the blocks
    fill the slots (a partial last wave of long blocks)."""
    if fill_first and blocks >= 0.8 * slots:
        return 1
    path = [math.ceil(PLANNED_TILES / s) * math.ceil(blocks * s / slots) for s in range(1, MAX_SPLITS + 1)]
    shortest = min(path)
    return next(s for s, p in enumerate(path, 1) if SPLIT_FILL * p <= shortest)


#: CTAs an SM native/flash.cu's FP8-cache decode blocks run, by head dim (its flash_min_ctas).
FP8_CTAS_PER_SM = {64: 3, 128: 3, 256: 2}


def fp8_refusal(D: int, Dv: int) -> str | None:
    """Why an FP8 KV cache of head dims D / Dv cannot be read, or None: native/flash.cu's decode blocks and the
    conversion (:func:`fp8_converted`) take D = Dv in :data:`HEAD_DIM_PAIRS` (its fp8_ok and the convert kernels
    hold the same rule), MLA decode's kernel an FP8 latent cache (None here: the MLA decode rules apply, as without
    FP8)."""
    if (D, Dv) == MLA_DECODE or (D, Dv) in HEAD_DIM_PAIRS:
        return None
    dims = ", ".join(str(d) for d, _ in HEAD_DIM_PAIRS)
    return (f"an FP8 KV cache takes head dims D = Dv in {dims}, or MLA decode's {MLA_DECODE[0]}/{MLA_DECODE[1]}; "
            f"got {D}/{Dv}")


#: The most query rows a kv head native/flash.cu's decode blocks run: a 16-row block for each 16, all reading the
#: same key tiles (native/batch.cuh's kMaxDecodeRows). A dense call on an FP8 cache with more converts it first; a
#: batch's at capacity sets its plan's decode rows (attn_lt/batch.py's _decode_rows).
MAX_DECODE_ROWS = 64


def fp8_converted(rows: int, D: int, Dv: int, mass: bool = False) -> bool:
    """Whether a call against an FP8 KV cache converts it to q's dtype first (one kernel, native/attn_lt.h's
    attn_lt_flash_convert_kv and attn_lt_batch_convert_kv: each element times its factor in FP32, rounded once) and
    runs the 16-bit kernels: ``rows`` query rows a kv head (query rows x Hq / Hkv; a batch: at capacity) more than
    native/flash.cu's decode blocks take (:data:`MAX_DECODE_ROWS`), or ``mass``: the mass per key where they do not
    give it (a dense call; a batch's requests past one row or one 16-row block). Never MLA's latent cache (its
    decode takes one row)."""
    return (D, Dv) in HEAD_DIM_PAIRS and (rows > MAX_DECODE_ROWS or mass)


def convert_fp8_kv(case: Case, k: int, v: int, k_out: int, v_out: int, descale: tuple, stream: int) -> None:
    """Convert a dense call's FP8 KV cache (``case``'s shapes and K/V strides; k and v its addresses) into contiguous
    (B, Hkv, Sk, D) tensors of q's dtype at ``k_out`` / ``v_out`` on ``stream`` (native/flash.cu's
    attn_lt_flash_convert_kv; :func:`fp8_converted` says when). ``descale``: (k_descale, v_descale, head stride), the
    factors' addresses (0: 1)."""
    a = native.FlashArgs()
    a.k, a.v = k, v
    a.B, a.Hq, a.Hkv, a.Sk, a.D, a.Dv = case.B, case.Hq, case.Hkv, case.Sk, case.D, case.Dv
    a.k_sb, a.k_sh, a.k_ss = case.k_strides[:3]
    a.v_sb, a.v_sh, a.v_ss = case.v_strides[:3]
    a.dtype, a.kv_dtype = native.DTYPE_CODES[case.dtype], native.DTYPE_CODES["e4m3"]
    a.k_descale, a.v_descale, a.descale_sh = descale[0] or None, descale[1] or None, descale[2]
    native.flash_convert_kv(a, k_out, v_out, stream)


#: How MLA decode reads an FP8 latent cache (fp8_kv_why's line for it).
FP8_LATENT = ("an FP8 latent cache (e4m3, a descale factor a kv head or one for all): native/flash_sm90.cu's MLA "
              "decode kernel reads its bytes (half a 16-bit cache's) and widens each tile to fp16 in shared memory "
              "(q rounded to fp16 under a power-of-two scale, FP32 sums)")
#: How native/flash.cu's decode blocks read an FP8 KV cache (fp8_kv_why's line for the other head dims).
FP8_BLOCKS = ("an FP8 KV cache (e4m3, descale factors one a kv head or one for all): native/flash.cu's decode blocks "
              "read its bytes (half a 16-bit cache's) and convert them to fp16 in registers on their way into the "
              "MMAs (q staged in fp16 under a power-of-two scale, FP32 sums)")


def fp8_kv_why(D: int, Dv: int) -> str:
    """Which kernel reads an FP8 KV cache of head dims D / Dv, and how (what explain says of a dense call and of a
    serving batch alike)."""
    return FP8_LATENT if (D, Dv) == MLA_DECODE else FP8_BLOCKS


#: How native/flash_sm90.cu's prefill kernel runs a call without a mask.
PERSISTENT = ("persistent where it pays (one CTA an SM taking the (query block, head) items in rounds; "
              "native/flash_sm90.cu persistent_grid)")

#: Head dims (D = Dv) of the FP8 prefill (native/flash_sm90.cu's fp8_prefill holds the same rule).
FP8_PREFILL_HEAD_DIMS = (64, 128, 256)


def fp8_prefill_refusal(case: Case, hopper: bool) -> str | None:
    """Why the FP8 prefill (q, k, v e4m3: native/flash_sm90.cu) cannot run ``case``, or None; ``hopper``: whether
    the Hopper kernel runs here."""
    if not hopper:
        return "the FP8 prefill (e4m3 q, k, v) runs on the Hopper kernel (sm_90), which this GPU or build lacks"
    if case.D != case.Dv or case.D not in FP8_PREFILL_HEAD_DIMS:
        *most, last = FP8_PREFILL_HEAD_DIMS
        return f"the FP8 prefill runs head dims D = Dv {', '.join(map(str, most))} or {last}; got {case.D}/{case.Dv}"
    if case.mask is not None:
        return "the FP8 prefill takes no dense mask (causal, a window, sinks and softcap it runs)"
    return None


def fp8_prefill_launch(case: Case) -> FusedLaunch:
    """The FP8 prefill's launch: the Hopper kernel in e4m3 after V is transposed into the workspace (V's bytes,
    its keys rounded up to 128)."""
    vt = case.B * case.Hkv * case.Dv * (-(-case.Sk // 128) * 128)
    return FusedLaunch("sm90", 128, 1, vt, "e4m3 q, k, v: V transposed into the workspace, then the Hopper kernel "
                       f"with FP8 wgmma (P in e4m3 times 2^8), O in bf16; {PERSISTENT}")


def fp8_decode_launch(case: Case, facts: DeviceFacts | None = None) -> FusedLaunch:
    """The launch of a dense call against an FP8 KV cache (at most :data:`MAX_DECODE_ROWS` rows a kv head:
    native/flash.cu's decode blocks, a 16-row block for each 16): its keys split by :func:`split_count`'s critical
    path for the CTAs those blocks run an SM, even where the blocks fill the SMs, since a partial last wave of
    whole-key blocks costs as much as a full one (B64 H32/8 with one part each: 512 blocks are 1.3 waves of 396
    slots)."""
    facts = facts or device_facts() or ASSUMED_DEVICE
    if (case.D, case.Dv) == MLA_DECODE:  # an FP8 latent cache: the MLA decode kernel, planned as in bf16
        return fused_launch(case, facts)
    per_sm = FP8_CTAS_PER_SM[case.D]
    blocks = -(-case.Sq * case.group // 16) * case.B * case.Hkv  # a 16-row decode block for each 16 rows
    part = case.B * case.Hq * case.Sq * (case.Dv + 1) * 4
    splits = split_count(blocks, facts.sms * per_sm, fill_first=False)
    while splits > 1 and splits * part > MAX_SPLIT_BYTES:
        splits //= 2
    launch = replace(fused_launch(case, facts, kernel="flash", splits=splits), block_rows=16)
    why = f"an FP8 cache: {blocks} decode blocks for {facts.sms} SMs x {per_sm} CTAs, parts by the critical path"
    if facts is ASSUMED_DEVICE:
        why += "; no GPU here: planned for a 132-SM Hopper GPU"
    return replace(launch, why=why)


def fused_launch(case: Case, facts: DeviceFacts | None = None, *, kernel: str | None = None,
                 splits: int | None = None) -> FusedLaunch:
    """The one rule for the fused path's kernel, block rows and key splits of ``case`` on a GPU with ``facts``
    (default: the current GPU, else :data:`ASSUMED_DEVICE`). ``kernel`` (a name of :data:`KERNEL_NAMES`) and
    ``splits`` force a choice (tests, benchmarks, sanitizer runs); the tiling and the workspace still follow the
    rule."""
    if (kernel is not None and kernel not in KERNEL_NAMES) or (splits is not None and splits < 1):
        raise ValueError(f"kernel must be one of {sorted(KERNEL_NAMES)} and splits >= 1; got {kernel!r}, {splits!r}")
    decode_refusal = decode_mask_refusal(case)
    # what the decode kernel can run at all (the rule below adds the rows a kv head that make it the faster one)
    decode_ok = ((case.D, case.Dv) in SM90_DECODE_HEAD_DIMS and case.Sq <= SM90_DECODE_ROWS
                 and decode_refusal is None and not case.variant)
    if kernel == "sm90_decode" and not decode_ok:
        dims = " and ".join(str(d) for d, _ in SM90_DECODE_HEAD_DIMS)
        raise ValueError(f"the sm90 decode kernel runs head dims {dims}, Sq <= {SM90_DECODE_ROWS} and masks its "
                         f"heads share, without a window, softcap or sinks; got D={case.D}, Dv={case.Dv}, "
                         f"Sq={case.Sq}{', variants' if case.variant else ''}: {decode_refusal}")
    assumed = False
    if facts is None:
        facts = device_facts()
        if facts is None:
            facts, assumed = ASSUMED_DEVICE, True
    # the key length does not enter (see MAX_SPLITS): a decode loop's steps share one launch. The mask rules of the
    # Hopper kernels: the decode kernel's, and the prefill kernel's (for row blocks larger than a decode step's)
    refusal = hopper_mask_refusal(case) if case.Sq * case.group > DECODE_ROWS else None
    return _fused_launch(case.B, case.Hq, case.Hkv, case.Sq, case.D, case.Dv, case.mask is not None, refusal,
                         decode_ok, facts, assumed, kernel, splits)


def hopper_mask_refusal(case: Case) -> str | None:
    """Why native/flash_sm90.cu cannot read ``case``'s mask (None when it can, or when there is no mask). It reads
    by TMA a bool mask or an additive one in q's dtype (an fp32 mask tile would not fit beside the K/V ring), whose
    keys are contiguous, whose address is 16-byte aligned and whose batch, head and row strides are 0 (broadcast)
    or multiples of 16 bytes. native/flash_sm90.cu's ``mask_kind`` holds the same rule and refuses what breaks it
    (it is here too because the launch plan is made, and explained, on machines without the library)."""
    m = case.mask
    if m is None:
        return None
    if m.dtype not in ("bool", case.dtype):
        return f"{m.dtype} mask (it reads bool or {case.dtype})"
    es = 1 if m.dtype == "bool" else 2
    sb, sh, sq, sk = m.strides
    if case.Sk > 1 and sk != 1:
        return f"mask keys {sk} elements apart (it reads contiguous keys)"
    for name, stride in (("batch", sb), ("head", sh), ("row", sq)):
        if stride * es % 16:
            return f"mask {name} stride of {stride * es} bytes (it reads multiples of 16)"
    if m.align < 16:
        return f"mask address aligned to {m.align} bytes (it reads 16-byte aligned masks)"
    return None


def decode_mask_refusal(case: Case) -> str | None:
    """Why native/flash_sm90.cu's decode kernel cannot read ``case``'s mask (None when it can, or when there is no
    mask): :func:`hopper_mask_refusal`'s rule, and the block's heads must share the mask (head stride 0, or one
    head) whose rows of query positions it stages with each key tile (at most 16, or one row for every position).
    native/flash_sm90.cu's entry holds the same rule."""
    refusal = hopper_mask_refusal(case)
    if refusal is not None or case.mask is None:
        return refusal
    _, sh, sq, _ = case.mask.strides
    if case.Hq > 1 and sh != 0:
        return "a mask per head (the decode kernel reads one its heads share)"
    if case.Sq > SM90_DECODE_MASK_ROWS and sq != 0:
        return f"{case.Sq} mask rows (the decode kernel stages at most {SM90_DECODE_MASK_ROWS} a key tile)"
    return None


def _splits(blocks: int, slots: int, part: int, forced: int | None) -> int:
    """``forced``, else :func:`split_count`'s parts of the keys, halved while their partials (``part`` bytes each)
    exceed :data:`MAX_SPLIT_BYTES`."""
    if forced is not None:
        return forced
    splits = split_count(blocks, slots)
    while splits > 1 and splits * part > MAX_SPLIT_BYTES:
        splits //= 2
    return splits


@functools.lru_cache(maxsize=4096)
def _fused_launch(B: int, Hq: int, Hkv: int, Sq: int, D: int, Dv: int, masked: bool, mask_refusal: str | None,
                  decode_ok: bool, facts: DeviceFacts, assumed: bool, kernel: str | None,
                  forced_splits: int | None) -> FusedLaunch:
    note = "; no GPU here: planned for a 132-SM Hopper GPU" if assumed else ""
    rows = Sq * (Hq // Hkv)  # query positions x the query heads of one kv head
    part = B * Hq * Sq * (Dv + 1) * 4
    if (D, Dv) == MLA_DECODE:  # one CTA an SM (226 KB of shared memory); the keys split to fill the SMs
        blocks = -(-rows // MLA_ROWS) * B * Hkv
        splits = _splits(blocks, facts.sms, part, forced_splits)
        why = f"MLA decode: {rows} query heads a latent cache; {blocks} blocks for {facts.sms} SMs"
        return FusedLaunch("sm90", MLA_ROWS, splits, splits * part if splits > 1 else 0, why + note)
    if kernel == "sm90_decode" or (kernel is None and facts.hopper and decode_ok and rows >= SM90_DECODE_MIN_ROWS):
        # a block: sq_box positions (the power of two >= Sq) of SM90_DECODE_ROWS / sq_box query heads
        heads = SM90_DECODE_ROWS // (1 << (Sq - 1).bit_length())
        blocks = -(-(Hq // Hkv) // heads) * B * Hkv
        splits = _splits(blocks, facts.sms, part, forced_splits)
        mask = "a mask its heads share" if masked else "no mask"
        why = "forced by the caller" if kernel is not None else (
            f"{rows} rows a kv head, {mask}; {blocks} blocks for {facts.sms} SMs, one CTA an SM")
        return FusedLaunch("sm90_decode", SM90_DECODE_ROWS, splits, splits * part if splits > 1 else 0, why + note)
    if kernel == "sm90" or kernel is None and facts.hopper and mask_refusal is None and rows > DECODE_ROWS:
        mask = "a mask read by TMA" if masked else f"no mask: {PERSISTENT}"
        return FusedLaunch("sm90", 128, 1, 0, f"{rows} rows a kv head, {mask}{note}")
    one = D == 256 or masked or rows <= DECODE_ROWS
    block_rows = 16 if rows <= WARP_SPLIT_ROWS else 64 if one else 128
    # CTAs an SM the split rule fills: two where registers and shared memory allow it (a decode block keeps two
    # K/V tiles in flight; with a mask, two such blocks an SM are what the H200's bandwidth needs), else one
    per_sm = 2 if one and D <= 128 or D == 64 else 1
    blocks = -(-rows // block_rows) * B * Hkv
    slots, splits = facts.sms * per_sm, None
    if rows <= WARP_SPLIT_ROWS and not masked and D >= 128 and forced_splits is None:
        # without a mask a decode block of D >= 128 keeps the memory busy on its own: one CTA an SM (fewer, longer
        # parts, less to merge), unless that cuts the keys into parts of fewer than ONE_CTA_MIN_TILES tiles. At D 64
        # a key tile is half the bytes and one CTA an SM is not enough (B8 H32/8 Sq1 32k on the H200: 2 parts
        # 2.90 TB/s, 4 parts 4.19)
        alone = _splits(blocks, facts.sms, part, None)
        if alone == 1 or alone <= PLANNED_TILES // ONE_CTA_MIN_TILES:
            slots, splits = facts.sms, alone
    if splits is None:
        splits = _splits(blocks, slots, part, forced_splits)
    per_head = f"{rows} row{'' if rows == 1 else 's'} a kv head"
    if rows <= DECODE_ROWS:
        why = per_head + (", a mask" if masked else "")
    elif mask_refusal is not None and facts.hopper:
        why = f"the Hopper kernel cannot read this mask: {mask_refusal}"
    else:
        why = "no Hopper kernel here"
    if forced_splits is not None or kernel is not None:
        why = "forced by the caller"
    elif splits > 1:
        why += f"; {blocks} row blocks for {facts.sms} SMs" + (", one CTA an SM" if slots == facts.sms else "")
    return FusedLaunch("flash", block_rows, splits, splits * part if splits > 1 else 0, why + note)


class Program:
    """The fused kernel's launch for one case, its arguments built once; ``run`` sets the addresses and launches.
    One program serves one call at a time (a lock guards its argument struct, which the library reads while other
    Python threads run)."""

    def __init__(self, case: Case, out_strides: tuple[int, ...], launch: FusedLaunch, fp8_kv: bool = False):
        a = self.args = native.FlashArgs()
        a.kv_dtype = native.DTYPE_CODES["e4m3"] if fp8_kv else 0  # (FP8: the decode blocks, MLA decode)
        a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D, a.Dv = case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, case.Dv
        a.q_sb, a.q_sh, a.q_ss = case.q_strides[:3]
        a.k_sb, a.k_sh, a.k_ss = case.k_strides[:3]
        a.v_sb, a.v_sh, a.v_ss = case.v_strides[:3]
        a.o_sb, a.o_sh, a.o_ss = out_strides[:3]
        a.scale, a.causal, a.dtype = case.scale, int(case.causal), native.DTYPE_CODES[case.dtype]
        a.variant = native.FLASH_SM90_VARIANTS["decode" if launch.kernel == "sm90_decode" else "default"]
        if case.mask is not None:
            a.mask_dtype = native.DTYPE_CODES[case.mask.dtype]
            a.m_sb, a.m_sh, a.m_sq, a.m_sk = case.mask.strides
        a.splits = launch.splits
        if case.window is not None:
            a.window_left, a.window_right = case.window
        a.softcap = case.softcap
        self._addresses = native.flash_addresses(a)
        self.launch = launch
        self.kernel = launch.kernel
        self._lse_part_offset = launch.splits * case.B * case.Hq * case.Sq * case.Dv * 4
        self._launch = native.flash if launch.kernel == "flash" else native.flash_sm90
        self._mass = None  # the attention mass's arguments (native.MassArgs), made on the first call that asks
        self._lock = threading.Lock()

    def fast_launch(self) -> tuple[bytes, int, int]:
        """What attn_lt.fastpath needs to launch this program itself: the argument struct's bytes (its addresses,
        key length and K/V strides set by each call), the launcher's address, the LSE partials' offset in the
        workspace."""
        name = "attn_lt_flash_fwd" if self._launch is native.flash else "attn_lt_flash_sm90_fwd"
        with self._lock:
            return bytes(self.args), native.launcher_address(name), self._lse_part_offset

    def run(self, q: int, k: int, v: int, o: int, lse: int, stream: int, mask: int = 0, workspace: int = 0,
            Sk: int | None = None, k_strides: tuple | None = None, v_strides: tuple | None = None,
            sinks: int = 0, scores: int = 0, descale: tuple = (0, 0, 0, 0)) -> None:
        """Launch on ``stream`` with the device addresses of q, k, v, the output, the FP32 LSE, the mask (0: none),
        the workspace (the split partials; ``launch.workspace_bytes``) and the sinks (a case with sinks); ``Sk`` and
        the K/V element strides, when given, replace the case's (another key length of the same launch, e.g. a
        decode step). ``scores``: where this call stores its scores for :meth:`run_mass` (FP32 (B, Hq, Sk); only
        where :func:`stores_scores` holds). ``descale``: an FP8 program's (k_descale, v_descale, head stride), the
        factors' addresses (0: 1), and the FP8 prefill's q_descale."""
        a = self.args
        with self._lock:  # the partials' addresses are read only with splits > 1
            self._addresses[:] = (q, k, v, o, lse, mask, workspace, workspace + self._lse_part_offset)
            a.sinks = sinks or None
            a.k_descale, a.v_descale, a.descale_sh = descale[0] or None, descale[1] or None, descale[2]
            a.q_descale = descale[3] or None if len(descale) > 3 else None
            if Sk is not None:
                a.Sk = Sk
                a.k_sb, a.k_sh, a.k_ss = k_strides[:3]
                a.v_sb, a.v_sh, a.v_ss = v_strides[:3]
            if scores:
                a.scores, a.s_sb, a.s_sh = scores, a.Hq * a.Sk, a.Sk
            try:
                self._launch(a, stream)
            finally:
                a.scores = None  # this call's only (the arguments serve later calls, the fast path's too)

    def run_mass(self, q: int, k: int, lse: int, mass: int, q0: int, stream: int, mask: int = 0,
                 from_scores: bool = False) -> None:
        """After :meth:`run`: the attention mass per key of the query rows [q0, Sq) into ``mass`` (FP32 (B, Hq, Sk)
        contiguous) from the call's LSE at ``lse`` (native/flash.cu's attn_lt_key_mass); ``from_scores``: that
        call stored its scores in ``mass`` (``run(..., scores=mass)``)."""
        with self._lock:
            m = self._mass
            if m is None:
                m = self._mass = native.MassArgs()
            m.f = self.args  # a copy: the case, its variants and strides
            f = m.f
            f.q, f.k, f.lse, f.mask = q, k, lse, mask or None
            f.v = f.o = f.o_part = f.lse_part = f.sinks = None
            m.mass, m.q0, m.from_scores = mass, q0, int(from_scores)
            native.key_mass(m, stream)
