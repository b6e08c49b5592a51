"""attention()'s plan cache (CPU): a decode loop runs its family's last plan, or derives one where the launch
changes, which the step's other calls then find by their family; derived plans take no place in the plan cache
(the plans themselves are stand-ins where only the bookkeeping around them is tested)."""

import torch

import attn_lt
from attn_lt import api


class StandIn:
    """A fused plan as attention() sees it: derives a plan for another key length, runs."""

    backend, case, same_launch = "wmma", "a decode case", False

    def __init__(self, signature=None, derived=False):
        self.signature, self.derived = signature, derived

    def runs_keys_of(self, signature, backend, threshold):
        return self.same_launch or signature == self.signature  # a plan runs its own call

    def with_keys(self, signature, backend, threshold):
        return StandIn(signature, derived=True)

    def _execute(self, *args):
        return self

    def _remember_fast(self, *args):  # a stand-in runs nothing the fast path could launch
        pass


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
        for _layer in range(3):  # the other layers of the step find the step's plan by their family
            assert attn_lt.attention(q, k, k) is first
        assert attn_lt.api.cached_plans() == n  # derived plans live in their family only
    assert len(made) == 1  # one full plan; every step derived
    assert attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100]) is full  # the full plan stayed
    other = torch.empty(2, 8, 200, 64, dtype=torch.bfloat16)  # another family: a plan of its own
    attn_lt.attention(q[..., :64].contiguous(), other[:, :, :50], other[:, :, :50])
    assert len(made) == 2 and attn_lt.api.cached_plans() == n + 1
    attn_lt.api.clear_plans()


def test_a_plan_whose_launch_stays_runs_every_step_itself(monkeypatch):
    """Where the family's plan runs the new key length as it is (same launch), no plan is made or derived and no
    key is added: every call of every step finds the same plan by its family."""
    made = []

    def plan(q, k, v, **kw):
        made.append(StandIn())
        made[-1].same_launch = True
        return made[-1]

    def aligned(*shape):  # 256-byte aligned, as CUDA allocations are (the alignment is part of the family)
        n = 1
        for d in shape:
            n *= d
        buf = torch.empty(n + 128, dtype=torch.bfloat16)
        skip = (-buf.data_ptr() % 256) // 2
        return buf[skip:skip + n].view(shape)

    monkeypatch.setattr(api, "plan", plan)
    attn_lt.api.clear_plans()
    q = aligned(2, 32, 1, 128)
    kc = aligned(2, 8, 200, 128)
    full = attn_lt.attention(q, kc[:, :, :100], kc[:, :, :100])
    n = attn_lt.api.cached_plans()
    for step in range(1, 30):
        k = aligned(2, 8, 100 + step, 128)  # new strides too (a cache that torch.cat grows)
        for _layer in range(4):
            assert attn_lt.attention(q, k, k) is full
        assert attn_lt.api.cached_plans() == n
    assert len(made) == 1
    attn_lt.api.clear_plans()


def test_a_derived_plan_words_the_reason_a_fresh_plan_would_give(monkeypatch):
    """with_keys (CPU, real plans): the family's route is looked up once and reused while Sq < Sk stays; the
    derived plan's decision reads as a fresh plan's; a length the route sends to lt derives nothing."""
    from attn_lt import fused
    from attn_lt.select import select
    from attn_lt.validate import Case

    monkeypatch.setattr(api, "device_facts", lambda device=None: fused.ASSUMED_DEVICE)
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "4096")
    looked_up = []
    real_route_of = api.route_of
    monkeypatch.setattr(api, "route_of", lambda *a: looked_up.append(1) or real_route_of(*a))
    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
    kc = torch.empty(2, 8, 6000, 128, dtype=torch.bfloat16)

    sig = api.call_signature(q, kc[:, :, :1000], kc[:, :, :1000], None, 256)

    def case(n):
        c = Case.contiguous(2, 32, 8, 1, n, 128)
        return Case(**{**c.__dict__, "k_strides": kc.stride(), "v_strides": kc.stride()})

    def full_plan(backend):
        c = case(1000)
        return api.AttentionPlan(c, select(c, backend), None, sig, "tune",
                                 fused=fused.fused_launch(c, fused.ASSUMED_DEVICE))

    base = p = full_plan("auto")
    assert base.backend == "wmma"
    for n in (1001, 1002, 4095):  # a decode loop: each step derives from the last
        k = kc[:, :, :n]
        s = api.call_signature(q, k, k, None, 256)
        last, p = p, p.with_keys(s, "auto", None)
        assert p.derived and p.case.Sk == n and p.decision.reasons == select(case(n)).reasons
        assert p.decision.rejected == select(case(n)).rejected
        assert p.fused == fused.fused_launch(case(n), fused.ASSUMED_DEVICE)
        # the launch is looked up again only where the key length changes the most splits it allows
        same = fused.most_splits(n) == fused.most_splits(last.case.Sk)
        assert (p.fused is last.fused) == same
        assert p.signature is s and base.case.Sk == 1000 and base.signature is sig  # the base plan unchanged
    assert len(looked_up) == 1
    s = api.call_signature(q, kc[:, :, :4096], kc[:, :, :4096], None, 256)
    assert p.with_keys(s, "auto", None) is None  # the threshold: a full plan (lt) instead
    assert base.decision.reasons == select(case(1000)).reasons  # the base plan's own reason, unchanged
    assert full_plan("wmma").with_keys(s, "wmma", None).decision.reasons == ("forced by the caller",)
    s = api.call_signature(q, kc[:, :, :1001], kc[:, :, :1002], None, 256)
    assert base.with_keys(s, "auto", None) is None  # v of another length: a full plan's validation refuses it


def test_a_latent_cache_plan_derives_only_while_v_stays_ks_first_columns(monkeypatch):
    from attn_lt import fused
    from attn_lt.select import select
    from attn_lt.validate import Case

    monkeypatch.setattr(api, "device_facts", lambda device=None: fused.ASSUMED_DEVICE)
    q = torch.empty(4, 128, 1, 576, dtype=torch.bfloat16)
    cache = torch.empty(4, 1, 2000, 576, dtype=torch.bfloat16)
    sig = api.call_signature(q, cache[:, :, :1000], cache[:, :, :1000, :512], None, 256)
    c = Case.contiguous(4, 128, 1, 1, 1000, 576, Dv=512, v_in_k=True)
    base = api.AttentionPlan(c, select(c, "wmma"), None, sig, "tune", fused=fused.fused_launch(c, fused.ASSUMED_DEVICE))
    k = cache[:, :, :1001]
    assert base.with_keys(api.call_signature(q, k, k[..., :512], None, 256), "wmma", None).case.v_in_k
    buf = torch.empty(4 * 2000 * 1024, dtype=torch.bfloat16)  # v at k's address (the family) with other strides
    k = buf.as_strided((4, 1, 1001, 576), (2000 * 576, 2000 * 576, 576, 1))
    v = buf.as_strided((4, 1, 1001, 512), (2000 * 1024, 2000 * 1024, 1024, 1))
    assert base.with_keys(api.call_signature(q, k, v, None, 256), "wmma", None) is None


def test_the_least_recently_used_plan_goes_first(monkeypatch):
    """Beyond PLAN_CACHE_SIZE plans, the one whose last use is oldest is evicted (a hit counts as a use)."""
    made = []

    def plan(q, k, v, **kw):
        made.append(StandIn())
        made[-1].backend = "lt"  # no family: every length its own plan
        return made[-1]

    monkeypatch.setattr(api, "plan", plan)
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


def test_runs_keys_of_holds_while_the_launch_and_the_route_stay(monkeypatch):
    """runs_keys_of (CPU, a real fused plan): a longer or shorter cache of the same split count and route runs on
    the plan as it is, strides reallocated or not; another split count, a length the route sends to lt, strides the
    kernel cannot read, or a masked plan do not."""
    from attn_lt import fused
    from attn_lt.select import select
    from attn_lt.validate import Case, MaskInfo

    monkeypatch.setattr(api, "device_facts", lambda device=None: fused.ASSUMED_DEVICE)
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "4096")
    kc = torch.empty(2, 8, 6000, 128, dtype=torch.bfloat16)

    q = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)

    def sig(k, v=None):
        return api.call_signature(q, k, k if v is None else v, None, 256)

    c = Case.contiguous(2, 32, 8, 1, 1000, 128)
    c = Case(**{**c.__dict__, "k_strides": kc.stride(), "v_strides": kc.stride()})
    base = api.AttentionPlan(c, select(c), None, sig(kc[:, :, :1000]), "tune",
                             fused=fused.fused_launch(c, fused.ASSUMED_DEVICE))
    same = [n for n in (990, 1001, 1020) if fused.most_splits(n) == fused.most_splits(1000)]
    assert same
    for n in same:
        assert base.runs_keys_of(sig(kc[:, :, :n]), "auto", None)
        assert base.runs_keys_of(sig(kc[:, :, :n].contiguous()), "auto", None)  # reallocated: new strides
    assert not base.runs_keys_of(sig(kc[:, :, :2000]), "auto", None)  # another split count
    assert not base.runs_keys_of(sig(kc[:, :, :1001, ::2]), "auto", None)  # elements 2 apart: not readable
    forced = api.AttentionPlan(c, select(c, "wmma"), None, sig(kc[:, :, :1000]), "tune",
                               fused=fused.fused_launch(c, fused.ASSUMED_DEVICE))
    lo, hi = fused.keys_of_most(fused.most_splits(1000))
    assert forced.runs_keys_of(sig(kc[:, :, :hi]), "wmma", None)  # forced: the split count alone bounds it
    assert not forced.runs_keys_of(sig(kc[:, :, :hi + 1]), "wmma", None)
    masked = Case(**{**c.__dict__, "mask": MaskInfo("bool", "bool", (2, 1, 1, 1000), (0, 0, 0, 1))})
    mplan = api.AttentionPlan(masked, select(masked), None, sig(kc[:, :, :1000]), "tune",
                              fused=fused.fused_launch(masked, fused.ASSUMED_DEVICE))
    assert not mplan.runs_keys_of(sig(kc[:, :, :1001]), "auto", None)
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "1001")  # the route of the family sends 1001 keys to lt
    fresh = api.AttentionPlan(c, select(c), None, sig(kc[:, :, :1000]), "tune",
                              fused=fused.fused_launch(c, fused.ASSUMED_DEVICE))
    assert not fresh.runs_keys_of(sig(kc[:, :, :1001]), "auto", None)
    assert fresh.runs_keys_of(sig(kc[:, :, :1000]), "auto", None) and fresh.runs_keys_of(sig(kc[:, :, :lo]), "auto",
                                                                                          None)
