"""Shape classes of GEMMs (CPU): the rule that lets a growing decode loop and a causal prefill's many chunk
lengths tune a few classes instead of one shape per step."""

import pytest

from attn_lt.lt.algos import GemmClass, bucket
from attn_lt.lt.path import plan_gemm_keys
from attn_lt.chunks import plan_chunks
from attn_lt.validate import Case


def test_bucket_is_the_octave():
    assert [bucket(x) for x in (1, 2, 3, 4, 5, 4096, 4097, 32767, 32768, 65535)] == [1, 2, 2, 4, 4, 4096, 4096,
                                                                                      16384, 32768, 32768]


def classes(case):
    keys = plan_gemm_keys(case, plan_chunks(case))
    return {GemmClass.of(k) for pair in keys for k in pair}


def test_a_growing_decode_cache_stays_in_four_classes():
    seen = set()
    for sk in range(32768, 33768, 7):  # 1000 steps of a decode loop from a round length, sampled
        seen |= classes(Case.contiguous(8, 32, 8, 1, sk, 128))
    assert len(seen) == 4  # qk and pv, each with the key count a multiple of 8 or not
    assert {c.role for c in seen} == {"qk", "pv"}


def test_leading_dimensions_and_strides_do_not_count():
    a = Case.contiguous(8, 32, 8, 1, 40000, 128)
    cap = Case(8, 32, 8, 1, 40000, 128, "bf16", False, 128**-0.5, None, (32 * 128, 128, 128, 1),
               (8 * 50000 * 128, 50000 * 128, 128, 1), (8 * 50000 * 128, 50000 * 128, 128, 1))  # a cache view
    assert classes(a) == classes(cap)


@pytest.mark.parametrize("S,most", [(32768, 24), (131072, 40)])
def test_causal_prefill_meets_few_classes(S, most):
    case = Case.contiguous(1, 32, 32, S, S, 128, causal=True)
    keys = plan_gemm_keys(case, plan_chunks(case))
    assert len(classes(case)) <= most < len({k for pair in keys for k in pair})


def test_class_keys_are_data():
    c = GemmClass.of(plan_gemm_keys(Case.contiguous(1, 4, 4, 64, 1000, 64), plan_chunks(
        Case.contiguous(1, 4, 4, 64, 1000, 64)))[0][0])
    d = c.to_dict()
    assert d["rule"] == "pow2-div8" and d["k"] == 64 and d["div8"] == "mnk" and "lda" not in d
    assert "m~512" in str(c)
