"""attention()'s plan cache (CPU): each call is planned once by its exact signature and options and found again by
them; the key range a fused plan hands to the compiled fast path (which alone runs a family's other key lengths on
one plan) is the selector's (the plans themselves are stand-ins where only the bookkeeping around them is
tested)."""

import math

import torch

import attn_lt
from attn_lt import api


class StandIn:
    """A plan as attention() sees it: runs."""

    backend, case = "wmma", "a decode case"

    def _execute(self, *args, **kw):
        return self

    def _remember_fast(self, *args):  # a stand-in runs nothing the fast path could launch
        pass


def _planner(made):
    def plan(q, k, v, **kw):
        made.append(StandIn())
        return made[-1]

    return plan


def test_every_call_is_planned_once_by_its_signature(monkeypatch):
    """A call finds its own plan again (the other layers of a step); another key length, other strides or other
    options are another plan (what the Python path does; the compiled fast path runs a family's other key lengths
    on one plan, see tests/test_fastpath.py)."""
    made = []
    monkeypatch.setattr(api, "plan", _planner(made))
    attn_lt.api.clear_plans()
    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    kc = torch.empty(2, 8, 200, 128, dtype=torch.bfloat16)
    first = attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100])
    for _layer in range(3):
        assert attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100]) is first
    assert len(made) == 1 and attn_lt.api.cached_plans() == 1
    longer = attn_lt.attention(q, kc[:, :, :101], kc[:, :, :101])
    moved = attn_lt.attention(q, kc[:, :, :100].contiguous(), kc[:, :, :100].contiguous())
    causal = attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100], causal=True)
    assert len({id(first), id(longer), id(moved), id(causal)}) == 4 and attn_lt.api.cached_plans() == 4
    attn_lt.api.clear_plans()
    assert attn_lt.api.cached_plans() == 0


def test_the_least_recently_used_plan_goes_first(monkeypatch):
    """Beyond PLAN_CACHE_SIZE plans, the one whose last use is oldest is evicted (a hit counts as a use)."""
    made = []
    monkeypatch.setattr(api, "plan", _planner(made))
    monkeypatch.setattr(api, "PLAN_CACHE_SIZE", 3)
    attn_lt.api.clear_plans()
    q = torch.empty(1, 4, 1, 64, dtype=torch.bfloat16)
    kc = torch.empty(1, 4, 10, 64, dtype=torch.bfloat16)

    def call(n):
        return attn_lt.attention(q, kc[:, :, :n], kc[:, :, :n])

    a, b, c = call(1), call(2), call(3)
    assert call(1) is a  # a hit: 1 is now the most recently used
    call(4)  # evicts 2, the least recently used
    assert attn_lt.api.cached_plans() == 3
    assert call(1) is a and call(3) is c and call(4) is made[3]
    assert call(2) is not b and len(made) == 5
    attn_lt.api.clear_plans()


def test_the_fast_paths_key_range_is_the_selectors(monkeypatch):
    """A fused plan lets the fast path run its family's key lengths that its route sends to wmma on its side of
    Sq >= Sk (the kernels take the key length as data: no split count bounds it); every length when forced; a masked
    plan or one of the long path hands nothing over."""
    from attn_lt import fused
    from attn_lt.select import select
    from attn_lt.validate import Case, MaskInfo

    monkeypatch.setenv("ATTN_LT_THRESHOLD", "4096")
    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 8, 1000, 128, dtype=torch.bfloat16)
    sig = api.call_signature(q, k, k, None, 256)
    c = Case.contiguous(2, 32, 8, 1, 1000, 128)

    def plan_of(case, backend):
        return api.AttentionPlan(case, select(case, backend), None, sig, "tune",
                                 fused=fused.fused_launch(case, fused.ASSUMED_DEVICE))

    assert plan_of(c, "auto")._fast_keys("auto", None) == (2, 4095)  # decode side: Sk > Sq, below the threshold
    assert plan_of(c, "wmma")._fast_keys("wmma", None) == (1, math.inf)
    assert plan_of(c, "auto")._fast_keys("auto", 100000) == (2, 99999)  # the caller's threshold
    masked = Case(**{**c.__dict__, "mask": MaskInfo("bool", "bool", (2, 1, 1, 1000), (0, 0, 0, 1))})
    assert plan_of(masked, "wmma")._fast_launch() is None
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "500")
    assert select(c).backend == "lt"
