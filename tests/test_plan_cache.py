"""attention()'s plan cache (CPU): a decode loop derives one plan a step from its family, the step's other calls
hit it, and the cache keeps only the newest derived plan of a family (the plans themselves are stand-ins; what is
tested is the bookkeeping around them)."""

import torch

import attn_lt
from attn_lt import api


class StandIn:
    """A fused plan as attention() sees it: derives a plan for another key length, runs."""

    backend, case = "wmma", "a decode case"

    def __init__(self, signature=None, derived=False):
        self.signature, self.derived = signature, derived

    def with_keys(self, k, v, signature, backend, threshold):
        return StandIn(signature, derived=True)

    def _execute(self, *args):
        return self


def test_a_decode_loop_keeps_one_derived_plan_a_family(monkeypatch):
    made = []

    def plan(q, k, v, **kw):
        made.append(StandIn())
        return made[-1]

    monkeypatch.setattr(api, "plan", plan)
    attn_lt.api.clear_plans()
    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    kc = torch.empty(2, 8, 200, 128, dtype=torch.bfloat16)
    full = attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100])
    n = attn_lt.api.cached_plans()
    for step in range(1, 30):
        k = kc[:, :, :100 + step]
        first = attn_lt.attention(q, k, k)
        assert first is not full and first.derived
        for _layer in range(3):  # the other layers of the step hit the step's plan
            assert attn_lt.attention(q, k, k) is first
        assert attn_lt.api.cached_plans() == n + 1
    assert len(made) == 1  # one full plan; every step derived
    assert attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100]) is full  # the full plan stayed
    other = torch.empty(2, 8, 200, 64, dtype=torch.bfloat16)  # another family: a plan of its own
    attn_lt.attention(q[..., :64].contiguous(), other[:, :, :50], other[:, :, :50])
    assert len(made) == 2 and attn_lt.api.cached_plans() == n + 2
    attn_lt.api.clear_plans()
