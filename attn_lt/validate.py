"""Input checks at the Python boundary. Everything here runs before any GPU work and needs no GPU.

The result is a :class:`Case`, a frozen description of one call (shapes, strides, dtype, mask, causal, scale)
that the selector and the planner consume.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

import torch

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_MASK_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MaskInfo:
    """A user mask after broadcasting to (B, Hq, Sq, Sk): ``kind`` is ``"bool"`` or ``"float"``."""

    kind: str
    dtype: str  # "bool", "fp16", "bf16", "fp32"
    shape: tuple[int, ...]  # as given
    strides: tuple[int, int, int, int]  # element strides over (B, Hq, Sq, Sk), 0 where broadcast
    align: int = 16  # largest power of two (<= 16) dividing the mask's address


@dataclass(frozen=True)
class Case:
    """One attention call. Shapes follow the contract: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv)."""

    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    dtype: str  # "fp16" | "bf16"
    causal: bool = False
    scale: float = 0.0
    mask: MaskInfo | None = None
    q_strides: tuple[int, int, int, int] = ()
    k_strides: tuple[int, int, int, int] = ()
    v_strides: tuple[int, int, int, int] = ()
    ptr_align: int = 256  # largest power of two (<= 256) dividing every input's address
    Dv: int = 0  # v's head dim (the output's); 0 = D
    v_in_k: bool = False  # v is k's first Dv columns: k's address and strides (an MLA latent cache, V = K[..., :Dv])
    # The attention variants (check_variants): a sliding window's (left, right) edges around each row's bottom-right
    # aligned diagonal (-1: unbounded; with causal the right edge is the causal one, stored -1), a logit softcap
    # (0: none), and whether a sink logit per query head joins every row's softmax denominator.
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    sinks: bool = False

    def __post_init__(self):
        if not self.Dv:
            object.__setattr__(self, "Dv", self.D)

    @property
    def variant(self) -> bool:
        """Whether the call asks for a window, a softcap or sinks."""
        return self.window is not None or self.softcap > 0 or self.sinks

    @property
    def group(self) -> int:
        """Query heads per kv head (1 without grouped-query attention)."""
        return self.Hq // self.Hkv

    @classmethod
    def contiguous(cls, B, Hq, Hkv, Sq, Sk, D, dtype="bf16", causal=False, scale=None, mask=None,
                   Dv=None, v_in_k=False, window=None, softcap=None, sinks=False) -> Case:
        """A case with contiguous (B, H, S, D) inputs; for planning and explaining without tensors. ``v_in_k``: v
        is k's first Dv columns (k's strides); ``sinks``: whether sinks are given."""
        Dv = D if Dv is None else Dv
        k_strides = (Hkv * Sk * D, Sk * D, D, 1)
        check_lengths(B, Hq, Hkv, Sq, Sk, D, Dv, v_in_k)
        window, softcap = check_window(window, causal), check_softcap(softcap)
        return cls(B, Hq, Hkv, Sq, Sk, D, dtype, causal, D**-0.5 if scale is None else check_scale(scale), mask,
                   (Hq * Sq * D, Sq * D, D, 1), k_strides, k_strides if v_in_k else (Hkv * Sk * Dv, Sk * Dv, Dv, 1),
                   Dv=Dv, v_in_k=bool(v_in_k), window=window, softcap=softcap, sinks=bool(sinks))

    def __str__(self) -> str:
        g = f" (GQA x{self.group})" if self.group > 1 else ""
        extra = " causal" if self.causal else ""
        if self.mask is not None:
            extra += f" {self.mask.kind}-mask{list(self.mask.shape)}"
        if self.window is not None:
            extra += f" window{self.window}"
        if self.softcap:
            extra += f" softcap {self.softcap:g}"
        if self.sinks:
            extra += " sinks"
        d = f"D{self.D}" if self.Dv == self.D else f"Dqk{self.D} Dv{self.Dv}{' (v in k)' if self.v_in_k else ''}"
        return f"B{self.B} Hq{self.Hq} Hkv{self.Hkv}{g} Sq{self.Sq} Sk{self.Sk} {d} {self.dtype}{extra}"


def v_is_in_k(k, v) -> bool:
    """Whether v is k's first Dv columns (k's address and strides): an MLA latent cache read once as K and V."""
    return v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[3] < k.shape[3]


def address_alignment(ptr: int) -> int:
    """Largest power of two (at most 256) dividing a device address (256 for 0: no address yet)."""
    return min(256, ptr & -ptr) if ptr else 256


def _shape(t) -> str:
    return f"({', '.join(str(s) for s in t.shape)})"


def check_tensors(q, k, v, attn_mask=None, causal=False, scale=None, require_cuda=True, *, window=None,
                  softcap=None, sinks=None, kv_fp8: bool = False) -> Case:
    """Validate q, k, v (torch tensors), the options and the attention variants (:func:`check_variants`); return
    the :class:`Case` (its dtype q's). ``kv_fp8``: k and v are an FP8 KV cache (:data:`FP8_KV_DTYPE`), not q's
    dtype; q may be FP8 too (the FP8 prefill: the case's dtype "e4m3").

    Raises ``TypeError`` for wrong types or dtypes and ``ValueError`` for wrong shapes, head counts, masks,
    strides or devices, each message naming the shapes involved. ``require_cuda=False`` skips the device checks
    (for planning and explaining with tensors on any device, "meta" included).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or cupy.ndarray, got {type(t).__name__}")
    q_fp8 = kv_fp8 and q.dtype == FP8_KV_DTYPE
    for name, t in () if q_fp8 else (("q", q),) if kv_fp8 else (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attn_lt supports torch.float16 and torch.bfloat16")
    if kv_fp8 and not k.dtype == v.dtype == FP8_KV_DTYPE:
        raise TypeError(f"k and v of an FP8 KV cache must both be {FP8_KV_DTYPE}, got {k.dtype}, {v.dtype}")
    if not kv_fp8 and not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype (or k and v both {FP8_KV_DTYPE}, an FP8 KV cache), got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    shapes = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); got {shapes}")
    B, Hq, Sq, D = q.shape
    _, Hkv, Sk, _ = k.shape
    Dv = v.shape[3]
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"k and v must agree in (B, Hkv, Sk): k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); got {shapes}")
    if k.shape[0] != B:
        raise ValueError(f"batch sizes differ between q and k/v; got {shapes}")
    if k.shape[3] != D:
        raise ValueError(f"head dims differ between q and k/v; got {shapes}")
    if min(B, Hq, Sq, D, Dv, Hkv, Sk) < 1:
        raise ValueError(f"every dimension must be at least 1; got {shapes}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of kv heads Hkv={Hkv}; got {shapes}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(f"{name} {_shape(t)} has strides {tuple(t.stride())}: its last dimension must have "
                             "stride 1 (call .contiguous() on it)")
        if min(t.stride()) < 0:
            raise ValueError(f"{name} {_shape(t)} has negative strides {tuple(t.stride())}")
        if t.shape[2] > 1 and t.stride(2) < t.shape[3]:
            raise ValueError(f"{name} {_shape(t)} has strides {tuple(t.stride())}: its rows overlap (sequence "
                             f"stride {t.stride(2)} < head dim {t.shape[3]}); pass a materialised tensor")
    causal = check_causal(causal)
    scale = D**-0.5 if scale is None else check_scale(scale)
    check_lengths(B, Hq, Hkv, Sq, Sk, D, Dv)  # v in k: v is no larger than k (no data pointer: fake tensors)
    mask = None
    if attn_mask is not None:
        mask = check_mask(attn_mask, (B, Hq, Sq, Sk), q.dtype)
    try:
        addr = q.data_ptr() | k.data_ptr() | v.data_ptr()
        v_in_k = v_is_in_k(k, v)
    except RuntimeError:  # fake/meta tensors while tracing (torch.compile): no addresses yet
        addr, v_in_k = 0, False
    window, softcap = check_variants(window, softcap, sinks, causal, q)
    case = Case(B, Hq, Hkv, Sq, Sk, D, "e4m3" if q_fp8 else _DTYPES[q.dtype], causal, float(scale), mask,
                tuple(q.stride()), tuple(k.stride()), tuple(v.stride()), address_alignment(addr), Dv, v_in_k,
                window, softcap, sinks is not None)
    if require_cuda:
        devices = {t.device for t in (q, k, v)} | ({attn_mask.device} if attn_mask is not None else set())
        if any(d.type != "cuda" for d in devices):
            raise ValueError(f"q, k, v{' and attn_mask' if attn_mask is not None else ''} must be on a CUDA "
                             f"device; got devices {sorted(str(d) for d in devices)} for {shapes}")
        if len(devices) != 1:
            raise ValueError(f"q, k, v and attn_mask must be on one CUDA device; got "
                             f"{sorted(str(d) for d in devices)}")
    return case


_MASK_DTYPE_NAMES = {torch.bool: "bool", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def check_mask(attn_mask, target: tuple[int, int, int, int], qdtype) -> MaskInfo:
    """Check a bool (True = attend) or float (additive) mask broadcastable to ``target`` = (B, Hq, Sq, Sk)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _MASK_FLOAT_DTYPES:
        raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; use torch.bool (True = attend) or a float dtype "
                        "(float16, bfloat16, float32) that is added to the scores")
    if attn_mask.dtype in (torch.float16, torch.bfloat16) and attn_mask.dtype != qdtype:
        raise TypeError(f"a float attn_mask must have q's dtype {qdtype} or float32, got {attn_mask.dtype}")
    tgt = "(" + ", ".join(map(str, target)) + ")"
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask {_shape(attn_mask)} has more than 4 dimensions; it must broadcast to {tgt}")
    try:
        expanded = attn_mask.expand(target)
    except RuntimeError:
        raise ValueError(f"attn_mask {_shape(attn_mask)} does not broadcast to (B, Hq, Sq, Sk) = {tgt}") from None
    strides = tuple(st if sz > 1 else 0 for st, sz in zip(expanded.stride(), target))
    kind = "bool" if attn_mask.dtype == torch.bool else "float"
    return MaskInfo(kind, _MASK_DTYPE_NAMES[attn_mask.dtype], tuple(attn_mask.shape), strides,
                    mask_alignment(attn_mask))


def mask_alignment(attn_mask) -> int:
    """The mask address's alignment as far as any kernel cares: the largest power of two dividing it, at most 16
    (TMA reads 16-byte aligned masks), so that masks of one layout share their plans; 16 for fake tensors."""
    try:
        return min(16, address_alignment(attn_mask.data_ptr()))
    except RuntimeError:  # fake/meta tensors while tracing: no address yet
        return 16


def check_window(window, causal: bool = False) -> tuple[int, int] | None:
    """A sliding window as FlashAttention's ``window_size``: ``(left, right)`` ints >= -1 (-1: unbounded), keys
    [i' - left, i' + right] visible to query i, i' = i + Sk - Sq its bottom-right aligned diagonal. With ``causal``
    the right edge is the causal one (stored -1). None for no window, or one that bounds nothing."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints (-1: unbounded), got {window!r}")
    left, right = window
    for name, edge in (("left", left), ("right", right)):
        if isinstance(edge, bool) or not isinstance(edge, numbers.Integral):
            raise TypeError(f"window's {name} edge must be an int (-1: unbounded), got {edge!r}")
        if edge < -1 or edge >= 2**31 - 1:
            raise ValueError(f"window's {name} edge must be in [-1, 2**31 - 1) (-1: unbounded), got {edge}")
    left, right = int(left), -1 if causal else int(right)
    return None if left == -1 and right == -1 else (left, right)


def check_softcap(softcap) -> float:
    """A logit softcap (scores become ``softcap * tanh(score / softcap)``): a finite positive number, or None / 0
    for none."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive number or None, got {softcap!r}")
    softcap = float(softcap)
    if softcap != 0 and not (0 < softcap < math.inf):
        raise ValueError(f"softcap must be positive and finite (or None), got {softcap}")
    return softcap


def check_sinks(sinks, Hq: int, device) -> None:
    """Attention sinks: a float32 tensor of Hq logits (one a query head), contiguous, on ``device``."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of {Hq} float32 logits, got {type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be float32 (one logit a query head), got {sinks.dtype}")
    if tuple(sinks.shape) != (Hq,) or (Hq > 1 and sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a contiguous ({Hq},) tensor, one logit a query head; got shape "
                         f"{tuple(sinks.shape)}, strides {tuple(sinks.stride())}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device {device}, got {sinks.device}")


#: The element type of an FP8 KV cache (e4m3, as vLLM's, FlashInfer's and FlashAttention-3's FP8 caches store it).
FP8_KV_DTYPE = torch.float8_e4m3fn


def check_kv_descale(k_descale, v_descale, fp8: bool, Hkv: int, device) -> tuple | None:
    """The descale factors of an FP8 KV cache (k's values are its elements times ``k_descale``, v's likewise): each
    None (1), a Python number, or an FP32 tensor of one value or of ``Hkv`` (one a kv head, contiguous) on
    ``device``. Returns ``(k_descale, v_descale, head_stride)`` as the kernels read them (tensors or None; stride 1
    for per-head factors, 0 for one value), or None for a cache in q's dtype, which takes no factors."""
    if not fp8:
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale / v_descale apply to an FP8 KV cache (torch.float8_e4m3fn k and v) only")
        return None
    return check_descale({"k_descale": k_descale, "v_descale": v_descale}, Hkv, device)


def descale_tensor(name: str, x, device):
    """A descale factor given as a Python number (positive and finite, else ValueError) as the one-value FP32
    tensor on ``device`` the kernels read; anything else as it is (:func:`check_descale` checks it)."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        if not (0 < float(x) < math.inf):
            raise ValueError(f"{name} must be positive and finite, got {x}")
        return torch.full((1,), float(x), dtype=torch.float32, device=device)
    return x


def check_descale(factors: dict, Hkv: int, device) -> tuple:
    """FP8 descale factors by name (:func:`check_kv_descale`'s rule for each): ``(*factors, head_stride)`` in the
    dict's order, all per kv head or all one value."""
    got, per_head = [], set()
    for name, x in factors.items():
        x = descale_tensor(name, x, device)
        if x is None:
            got.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be None, a number or a float32 tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {x.device}")
        if x.numel() == 1:
            per_head.add(False)
        elif tuple(x.shape) == (Hkv,) and x.stride(0) == 1:
            per_head.add(True)
        else:
            raise ValueError(f"{name} must hold one factor, or one a kv head as a contiguous ({Hkv},) tensor; got "
                             f"shape {tuple(x.shape)}, strides {tuple(x.stride())}")
        got.append(x)
    if len(per_head) > 1:
        raise ValueError(f"{' and '.join(factors)} must all be per kv head or all one value")
    return (*got, int(per_head == {True}))


def check_variants(window, softcap, sinks, causal: bool, q) -> tuple[tuple[int, int] | None, float]:
    """The attention variants of a call on q (its dim 1 the query heads: (B, Hq, Sq, D), or a batch's (rows, Hq, D)):
    (window, softcap) as :class:`Case` holds them; sinks checked (:func:`check_sinks`)."""
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    return check_window(window, causal), check_softcap(softcap)


def check_causal(causal) -> bool:
    """``causal`` as a Python bool. Accepted: ``bool`` and ``numpy.bool_``. Refused with a TypeError: ints (0/1
    are ambiguous next to SDPA's ``is_causal: bool``), strings, None, and tensors (reading a CUDA tensor would
    synchronise the stream, and under torch.compile its value is not known while tracing: pass ``bool(t)``)."""
    if isinstance(causal, bool):
        return causal
    if type(causal).__module__ == "numpy" and type(causal).__name__ in ("bool_", "bool"):
        return bool(causal)
    hint = "; pass bool(t) for a one-element tensor" if isinstance(causal, torch.Tensor) else ""
    raise TypeError(f"causal must be a bool, got {type(causal).__name__}{hint}")


#: The longest query or key length: the kernels take lengths as 32-bit ints (native/flash.cu, flash_sm90.cu).
MAX_LENGTH = 2**31 - 1
#: The most bytes any one of q, k, v or the output may take: 1 TiB, several times what any GPU holds.
MAX_TENSOR_BYTES = 2**40


def check_lengths(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, Dv: int, v_in_k: bool = False,
                  esize: int = 2) -> None:
    """Refuse lengths no GPU could hold, before any planning: Sq and Sk at most :data:`MAX_LENGTH` (2**31 - 1, the
    kernels index rows with 32-bit ints) and q, k, v and the output each at most :data:`MAX_TENSOR_BYTES` (2**40
    bytes, 1 TiB)."""
    for name, n in (("Sq", Sq), ("Sk", Sk)):
        if n > MAX_LENGTH:
            raise ValueError(f"{name} = {n} is longer than attn_lt supports: lengths are at most 2**31 - 1 = "
                             f"{MAX_LENGTH} (its kernels index rows with 32-bit ints)")
    sizes = (("q", B * Hq * Sq * D), ("k", B * Hkv * Sk * D), ("v", 0 if v_in_k else B * Hkv * Sk * Dv),
             ("the output", B * Hq * Sq * Dv))
    for name, n in sizes:
        if n * esize > MAX_TENSOR_BYTES:
            raise ValueError(f"{name} would take {n * esize} bytes (B {B}, Hq {Hq}, Hkv {Hkv}, Sq {Sq}, Sk {Sk}, "
                             f"D {D}, Dv {Dv}): more than the {MAX_TENSOR_BYTES} bytes (2**40, 1 TiB) attn_lt "
                             "accepts for one tensor, more than any GPU holds")


def check_scale(scale) -> float:
    """``scale`` as a float: a real number (int, float, numpy scalar; not bool), finite and > 0 both as given and
    as the kernels see it, in float32 (1e300 would be inf there, 1e-320 zero)."""
    if isinstance(scale, bool) or type(scale).__name__ == "bool_" or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite number > 0 (or None for D ** -0.5), got {value!r}")
    try:
        as_f32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        as_f32 = math.inf
    if not math.isfinite(as_f32) or as_f32 <= 0:
        raise ValueError(f"scale = {value!r} is {'inf' if as_f32 > 0 else '0'} in float32, the precision the "
                         f"kernels use; it must be finite and > 0 there (about 1.4e-45 to 3.4e38)")
    return value


def check_options(case: Case | None = None, *, workspace_bytes=None, threshold=None, return_key_mass=False,
                  key_mass_window=None, out_layout="bhsd") -> None:
    """Options checked whatever path the call takes (before selection): ``workspace_bytes`` and ``threshold``,
    each None or a positive int; ``out_layout`` one of :data:`OUT_LAYOUTS`. Wrong types raise TypeError, values
    < 1 ValueError; ``case`` names the call."""
    where = f" (for {case})" if case is not None else ""
    if out_layout not in OUT_LAYOUTS:
        raise ValueError(f"out_layout must be one of {OUT_LAYOUTS}, got {out_layout!r}{where}")
    for name, value in (("workspace_bytes", workspace_bytes), ("threshold", threshold)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a positive int or None, got {type(value).__name__}{where}")
        if value <= 0:
            raise ValueError(f"{name} must be a positive int or None, got {value}{where}")
    if key_mass_window is not None:
        if isinstance(key_mass_window, bool) or not isinstance(key_mass_window, int) or key_mass_window < 1:
            raise ValueError(f"key_mass_window must be a positive int or None, got {key_mass_window!r}{where}")
        if not return_key_mass:
            raise ValueError(f"key_mass_window={key_mass_window} is given but return_key_mass is False{where}")


#: Layouts of the output: (B, Hq, Sq, Dv) as SDPA returns it, or (B, Sq, Hq, Dv) as FlashAttention and
#: transformers' attention functions return it (no transpose after the call).
OUT_LAYOUTS = ("bhsd", "bshd")


def out_shape(case: Case, layout: str = "bhsd") -> tuple[int, int, int, int]:
    """The output's shape in ``layout`` (see :data:`OUT_LAYOUTS`)."""
    return (case.B, case.Sq, case.Hq, case.Dv) if layout == "bshd" else (case.B, case.Hq, case.Sq, case.Dv)


def check_out(out, case: Case, q, layout: str = "bhsd", dtype=None) -> None:
    """A preallocated output: contiguous, of ``dtype`` (default q's) on q's device, :func:`out_shape` in
    ``layout``."""
    shape = out_shape(case, layout)
    dtype = q.dtype if dtype is None else dtype
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == shape and out.dtype == dtype
            and out.device == q.device and out.is_contiguous()):
        desc = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out)
        raise ValueError(f"out must be a contiguous {shape} {dtype} tensor on {q.device}, got {desc}")


# ---- torch.compile: the custom ops' conventions (attn_lt::attention, ::varlen_attention, ::paged_attention) ------

def op_variants(causal, window, softcap) -> tuple[bool, list[int] | None, float]:
    """A call's ``causal``, ``window`` and ``softcap`` as its custom op takes them while torch.compile traces it,
    checked as the call checks them."""
    causal = check_causal(causal)
    window = check_window(window, causal)
    return causal, None if window is None else list(window), check_softcap(softcap)


def call_results(out, lse, return_lse: bool, mass=None):
    """What attention() and the batch calls return: out, then lse when asked for, then the mass when asked for (not
    None)."""
    got = (out,) + ((lse,) if return_lse else ()) + ((mass,) if mass is not None else ())
    return got if len(got) > 1 else out


def op_results(got, return_lse: bool, return_key_mass: bool, like: torch.Tensor) -> tuple:
    """A call's results (:func:`call_results`) as its custom op returns them: (out, lse, mass), a new empty FP32
    tensor on ``like``'s device for each one not asked for (an op's outputs never alias)."""
    got = got if isinstance(got, tuple) else (got,)
    return (got[0], got[1] if return_lse else like.new_empty(0, dtype=torch.float32),
            got[-1] if return_key_mass else like.new_empty(0, dtype=torch.float32))
