"""Merging partial attentions by their log-sum-exp (LSE).

Attention over a key set K that is split into disjoint slices K_1 … K_n can be computed slice by slice: each slice
gives a partial output O_i = softmax(S_i) V_i and the log-sum-exp L_i of its scaled, masked scores; then

    L = log Σ_i exp(L_i),        O = Σ_i exp(L_i − L) · O_i

is exactly the attention over K. Context parallelism (``attn_lt.distributed``) merges the blocks of K/V that
arrive from other GPUs this way; the same merge joins key slices of one GPU's long decode.

Two forms, both FP32 (torch tensors on any device):

* :func:`merge` — all partials at once, returns a new ``(out, lse)``;
* :func:`merge_into` — accumulates one partial into FP32 accumulators in place (a ring loop's form).

Rows whose every key is masked have LSE ``-inf`` in a partial; such a partial contributes nothing to those rows
(its output there is ignored, even if it is not finite), and rows whose partial LSEs are all ``-inf`` come out as
0 with LSE ``-inf``, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge", "merge_into"]


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_pair(out, lse, what: str) -> None:
    """One partial: ``out`` (..., S, Dv) of a float dtype, ``lse`` (..., S) FP32 on the same device."""
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(f"{what}: out and lse must be torch tensors, got {type(out).__name__} and "
                        f"{type(lse).__name__}")
    if not out.is_floating_point():
        raise TypeError(f"{what}: out {_shape(out)} has dtype {out.dtype}; a floating dtype is needed")
    if lse.dtype != torch.float32:
        raise TypeError(f"{what}: lse {_shape(lse)} has dtype {lse.dtype}; the LSE must be torch.float32")
    if out.dim() < 2 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(f"{what}: out must be (..., S, Dv) and lse (..., S) with the same leading shape; got out "
                         f"{_shape(out)}, lse {_shape(lse)}")
    if out.device != lse.device:
        raise ValueError(f"{what}: out {_shape(out)} is on {out.device}, lse {_shape(lse)} on {lse.device}")


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0, so that ``exp(l_i - safe)`` is 0 (not NaN) where every partial is -inf."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _finite_rows(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows whose LSE is -inf set to 0 (those rows must contribute nothing, NaN included)."""
    return torch.where(torch.isneginf(lse)[..., None], 0, out)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions over disjoint key sets into the attention over their union.

    Args:
        outs: n >= 1 partial outputs, each (..., S, Dv) (e.g. (B, H, S, Dv)), any float dtype, one shape.
        lses: their log-sum-exps, each (..., S), torch.float32, on the outputs' device. ``-inf`` marks a row with
            no (unmasked) key in that partial; its output row is then ignored.

    Returns:
        ``(out, lse)``: out (..., S, Dv) float32, lse (..., S) float32. A row whose partial LSEs are all ``-inf``
        gives 0 and ``-inf``.

    Raises:
        TypeError: non-tensors, a non-float output, an LSE that is not float32.
        ValueError: no partials, unequal counts, shapes or devices (the message names the shapes).
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge needs as many LSEs as outputs (at least one); got {len(outs)} outputs and "
                         f"{len(lses)} LSEs")
    for i, (o, l) in enumerate(zip(outs, lses)):
        _check_pair(o, l, f"partial {i}")
        if tuple(o.shape) != tuple(outs[0].shape) or o.device != outs[0].device:
            raise ValueError(f"partial {i}: out {_shape(o)} on {o.device} differs from partial 0's "
                             f"{_shape(outs[0])} on {outs[0].device}")
    lse = torch.logsumexp(torch.stack(lses), dim=0) if len(lses) > 1 else lses[0].clone()
    safe = _safe(lse)
    acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for o, l in zip(outs, lses):
        acc.addcmul_(_finite_rows(o, l), torch.exp(l - safe)[..., None])
    return acc, lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Accumulate one partial attention into FP32 accumulators, in place: afterwards ``(acc_out, acc_lse)`` is the
    attention over the union of the keys behind the accumulator and the keys behind ``(out, lse)``.

    Args:
        acc_out: (..., S, Dv) float32, updated in place; any strides (a row slice of a larger accumulator works).
            Start from zeros (with ``acc_lse`` all ``-inf``) or from a first partial converted to float32; rows
            where ``acc_lse`` is ``-inf`` must hold finite values (zeros, as both starts give).
        acc_lse: (..., S) float32, updated in place.
        out: (..., S, Dv) the partial output, any float dtype (e.g. attn_lt's bf16 output).
        lse: (..., S) float32, its log-sum-exp; where it is ``-inf`` the partial contributes nothing.

    Raises:
        TypeError: a non-float32 accumulator or LSE, a non-float output.
        ValueError: shapes or devices that differ (the message names the shapes).
    """
    _check_pair(acc_out, acc_lse, "accumulator")
    _check_pair(out, lse, "partial")
    if acc_out.dtype != torch.float32:
        raise TypeError(f"acc_out {_shape(acc_out)} has dtype {acc_out.dtype}; the accumulator must be float32")
    if tuple(out.shape) != tuple(acc_out.shape) or out.device != acc_out.device:
        raise ValueError(f"partial out {_shape(out)} on {out.device} does not match the accumulator "
                         f"{_shape(acc_out)} on {acc_out.device}")
    new = torch.logaddexp(acc_lse, lse)
    safe = _safe(new)
    acc_out.mul_(torch.exp(acc_lse - safe)[..., None])
    acc_out.addcmul_(_finite_rows(out, lse), torch.exp(lse - safe)[..., None])
    acc_lse.copy_(new)
