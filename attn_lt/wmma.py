"""The fused path ``wmma`` (the design card's name): its declaration and its launcher.

One tensor-core kernel with an online softmax, no score matrix in memory; fp16/bf16, causal, GQA, any lengths,
LSE; no user mask. Two kernels behind the one name:

* on Hopper (sm_90, when the library holds the sm_90a build): ``native/flash_sm90.cu`` — TMA into an mbarrier
  ring, ``wgmma`` for Q·Kᵀ and P·V with P from registers, a producer warpgroup and two consumer warpgroups with
  register reallocation, the softmax overlapped with the next tile's GEMM; head dims 64, 128 and 256;
* elsewhere (sm_80): ``native/flash.cu`` — FlashAttention-2 style, ``mma.sync`` fed by ``cp.async``; head dims
  64 and 128.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import native
from .backends import Backend
from .validate import Case


@functools.lru_cache(maxsize=8)
def hopper_kernel(device: int | None = None) -> bool:
    """Whether the Hopper kernel runs on ``device`` (default: the current one); False without a GPU or library."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        with torch.cuda.device(torch.cuda.current_device() if device is None else device):
            return native.flash_sm90_supported()
    except (native.NativeLibraryError, RuntimeError, OSError):
        return False


@dataclass(frozen=True)
class FusedBackend(Backend):
    """The fused path's declaration: head dim 256 only where the Hopper kernel runs."""

    hopper_only_head_dims: tuple[int, ...] = (256,)

    def not_supported_reasons(self, case: Case, key_mass: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(case, key_mass)
        if case.D in self.hopper_only_head_dims and not hopper_kernel():
            reasons.append(f"head dim {case.D} needs the Hopper (sm_90a) kernel, which this GPU or build lacks")
        return reasons


#: What the fused kernels run.
WMMA = FusedBackend("wmma", ("fp16", "bf16"), (64, 128, 256), 256, supports_mask=False, needs_aligned_rows=True,
                    max_batch_heads=65535)


class Program:
    """The fused kernel's launch for one case, its arguments built once; ``run`` sets the addresses."""

    def __init__(self, case: Case, out_strides: tuple[int, ...], device: int | None = None):
        a = self.args = native.FlashArgs()
        a.B, a.Hq, a.Hkv, a.Sq, a.Sk, a.D = case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D
        a.q_sb, a.q_sh, a.q_ss = case.q_strides[:3]
        a.k_sb, a.k_sh, a.k_ss = case.k_strides[:3]
        a.v_sb, a.v_sh, a.v_ss = case.v_strides[:3]
        a.o_sb, a.o_sh, a.o_ss = out_strides[:3]
        a.scale, a.causal, a.dtype = case.scale, int(case.causal), native.DTYPE_CODES[case.dtype]
        a.variant = native.FLASH_SM90_VARIANTS["default"]
        self.kernel = "sm90" if hopper_kernel(device) else "sm80"
        self._launch = native.flash_sm90 if self.kernel == "sm90" else native.flash

    def run(self, q: int, k: int, v: int, o: int, lse: int, stream: int) -> None:
        """Launch on ``stream`` with the device addresses of q, k, v, the output and the FP32 LSE."""
        a = self.args
        a.q, a.k, a.v, a.o, a.lse = q, k, v, o, lse
        self._launch(a, stream)
