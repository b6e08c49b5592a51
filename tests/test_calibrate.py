"""Calibration v2 (CPU): the grid, the rules derived from measured points, their lookup by head dim / causal /
query length, the precedence of the sources ``auto`` listens to, version-1 and shipped files, the reasons."""

import json
import logging

import pytest

from attn_lt import calibrate
from attn_lt.calibrate import PREFILL, Calibration, Figure, Rule, derive_rules
from attn_lt.select import current_threshold, select
from attn_lt.validate import Case

H100 = calibrate.Gpu("NVIDIA H100 80GB HBM3", "9.0", "NVIDIA H100 80GB HBM3|sm9.0|132sm|cublasLt130100")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """An empty cache directory and shipped directory, no threshold in the environment, an H100 as the GPU."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "shipped").mkdir()
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(calibrate, "current_gpu", lambda: H100)
    monkeypatch.delenv("ATTN_LT_THRESHOLD", raising=False)
    calibrate.clear_cache()
    yield tmp_path
    calibrate.clear_cache()


def pts(D=128, causal=False, Sq=1, rows=()):
    """Points of one (D, causal, Sq): rows of (Sk, wmma_ms, lt_ms); Sq=None means Sq = Sk."""
    return [{"D": D, "causal": causal, "Sq": Sk if Sq is None else Sq, "Sk": Sk, "wmma_ms": w, "lt_ms": l}
            for Sk, w, l in rows]


def case(Sq=1, Sk=8192, D=128, causal=False, **kw):
    return Case.contiguous(1, 8, 8, Sq, Sk, D, causal=causal, **kw)


def only(rules):
    assert len(rules) == 1
    return rules[0]


# ---- rules from points -----------------------------------------------------------------------------------------

def test_crossover_is_the_first_sk_of_lts_winning_run():
    r = only(derive_rules(pts(rows=[(1024, 1, 2), (4096, 3, 2.5), (16384, 9, 4), (65536, 30, 10)])))
    assert (r.D, r.causal, r.Sq, r.lt_from) == (128, False, 1, 4096)
    assert r.lt_wins == Figure(4096, 2.5, 3.0) and r.wmma_wins == Figure(1024, 2.0, 1.0)
    assert r.prefers_lt(4096) and r.prefers_lt(10**6) and not r.prefers_lt(4095)


def test_never_when_the_fused_path_wins_at_the_longest_length():
    r = only(derive_rules(pts(rows=[(1024, 2, 1), (4096, 3, 2), (16384, 4, 5)])))
    assert r.lt_from is None and r.lt_wins is None and r.wmma_wins == Figure(16384, 5.0, 4.0)
    assert not r.prefers_lt(10**6)
    tie = only(derive_rules(pts(rows=[(1024, 2, 2)])))  # a tie goes to the fused path
    assert tie.lt_from is None


def test_lt_everywhere_and_non_monotone_points():
    r = only(derive_rules(pts(rows=[(1024, 2, 1), (65536, 9, 3)])))
    assert r.lt_from == 1024 and r.wmma_wins is None
    # lt wins at 1024, loses at 4096, wins from 16384 on: only the run that reaches the longest length counts
    r = only(derive_rules(pts(rows=[(1024, 2, 1), (4096, 2, 3), (16384, 9, 4), (65536, 30, 10)])))
    assert r.lt_from == 16384 and r.wmma_wins.Sk == 4096
    # the input order does not matter
    r2 = only(derive_rules(pts(rows=[(65536, 30, 10), (4096, 2, 3), (1024, 2, 1), (16384, 9, 4)])))
    assert r2 == r


def test_buckets_per_d_causal_and_prefill():
    points = (pts(Sq=1, rows=[(1024, 1, 2), (4096, 4, 2)])
              + pts(Sq=1024, rows=[(1024, 1, 2), (4096, 4, 3)])  # (1024, 1024) is also a prefill point
              + pts(Sq=None, rows=[(4096, 10, 20)])
              + pts(D=64, causal=True, Sq=16, rows=[(1024, 1, 0.5)]))
    rules = {(r.D, r.causal, r.Sq): r for r in derive_rules(points)}
    assert set(rules) == {(128, False, 1), (128, False, 1024), (128, False, PREFILL), (64, True, 16)}
    assert rules[128, False, 1024].lt_from == 4096
    pre = rules[128, False, PREFILL]
    assert pre.lt_from is None and pre.wmma_wins.Sk == 4096  # prefill points: (1024, 1024) and (4096, 4096)
    assert rules[64, True, 16].lt_from == 1024
    assert [(r.D, r.causal, r.Sq) for r in derive_rules(points)] == [
        (64, True, 16), (128, False, 1), (128, False, 1024), (128, False, PREFILL)]


def test_failed_and_malformed_points_are_skipped():
    points = pts(rows=[(1024, 1, 2), (4096, 4, 2)]) + [
        {"D": 128, "causal": False, "Sq": 1, "Sk": 16384, "error": "RuntimeError: out of memory"},
        {"D": 128, "causal": False, "Sq": 1, "Sk": 65536, "wmma_ms": float("nan"), "lt_ms": 1},
        {"D": "128", "Sq": 1, "Sk": 2, "wmma_ms": 1, "lt_ms": 2}, "junk"]
    assert only(derive_rules(points)).lt_from == 4096
    assert derive_rules([]) == []


def test_rules_round_trip_and_refuse_bad_fields():
    r = only(derive_rules(pts(rows=[(1024, 1, 2), (4096, 3, 2.5)])))
    assert Rule.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    for bad in [{"D": 0, "causal": False, "Sq": 1, "lt_from": 1}, {"D": 64, "causal": 1, "Sq": 1, "lt_from": 1},
                {"D": 64, "causal": False, "Sq": "x", "lt_from": 1}, {"D": 64, "causal": False, "Sq": 1, "lt_from": 0},
                {"D": 64, "causal": False, "Sq": 1, "lt_from": 1, "lt_wins": {"Sk": 1, "lt_ms": -1, "wmma_ms": 1}},
                [1]]:
        with pytest.raises(ValueError):
            Rule.from_dict(bad)


# ---- the grid ------------------------------------------------------------------------------------------------

def test_default_grid():
    g = calibrate.grid((64, 128, 256))
    keys = [(c["D"], c["causal"], c["mask"], c["Sq"], c["Sk"]) for c in g]
    # per head dim: 7 + 3 * 9 plain and causal cases; masked (non-causal, mask <= 8 GiB): Sq 1, 16, 128, 1024 and
    # Sq = Sk at Sk 1024 (4 cases), 4096, 16384 and 65536 (5 each)
    assert len(keys) == len(set(keys)) == 3 * (7 + 3 * 9 + 4 + 5 + 5 + 5)
    masked = [c for c in g if c["mask"]]
    assert not any(c["causal"] for c in masked) and {c["Sk"] for c in masked} == {1024, 4096, 16384, 65536}
    assert all(c["B"] * c["Sq"] * c["Sk"] * 2 <= calibrate.MASK_BYTES_MAX for c in masked)
    assert len(calibrate.grid((64,), masks=False)) == 7 + 3 * 9
    assert all(c["Sq"] >= calibrate.CAUSAL_MIN_SQ for c in g if c["causal"])
    assert all(c["Sq"] <= c["Sk"] for c in g)
    assert {c["Sk"] for c in g} == {1024, 4096, 16384, 65536}
    for c in g:
        bh, kv = c["B"] * c["Hq"], c["B"] * c["Hkv"] * c["Sk"] * c["D"] * 4
        assert kv <= calibrate.KV_BYTES_MAX and c["Hq"] % c["Hkv"] == 0
        if c["Sq"] <= 16:
            assert (c["B"], c["Hq"], c["Hkv"]) == (4, 32, 8)  # decode: GQA 4, B·Hq = 128
        elif c["Sq"] < c["Sk"]:
            assert 64 <= bh <= 256
        else:
            assert bh * c["Sq"] == 1 << 18


def test_head_dim_192_is_measured_as_mla_prefill_where_the_fused_path_runs_it():
    from attn_lt.fused import WMMA

    g = calibrate.grid((192,))
    assert {(c["D"], c["Dv"]) for c in g} == {(192, 128)} and calibrate.HEAD_DIMS == (64, 128, 192, 256, 576)
    runnable = [c for c in g if not WMMA.not_supported_reasons(calibrate.job_case(c))]
    # decode buckets (Sq 1 and 16 at GQA 4: 4 and 64 rows a kv head) and masks stay with the long path
    assert runnable and all(c["Sq"] >= 128 and not c["mask"] for c in runnable)
    assert len(runnable) == len([c for c in g if c["Sq"] >= 128 and not c["mask"]])
    case = calibrate.job_case(next(c for c in g if c["mask"]))
    assert case.Dv == 128 and case.mask.shape[1] == 1 and case.v_strides[2] == 128


def test_head_dim_576_is_measured_as_mla_decode_with_v_in_k():
    from attn_lt.fused import WMMA

    g = calibrate.grid((576,))
    assert all(c["v_in_k"] and (c["D"], c["Dv"]) == (576, 512) for c in g)
    runnable = [c for c in g if not WMMA.not_supported_reasons(calibrate.job_case(c))]
    assert [(c["Sq"], c["B"], c["Hq"], c["Hkv"]) for c in runnable] == [(1, 8, 128, 1)] * 4  # decode, each Sk
    case = calibrate.job_case(runnable[0])
    assert case.v_in_k and case.v_strides == case.k_strides


def test_grid_options():
    g = calibrate.grid([64], [1024, 8192], [1], prefill=False, masks=False)
    assert [(c["Sq"], c["Sk"], c["causal"]) for c in g] == [(1, 1024, False), (1, 8192, False)]
    g = calibrate.grid([64], [1024], [1, 16, 4096], masks=False)  # Sq > Sk is not measured
    assert [(c["Sq"], c["causal"]) for c in g] == [(1, False), (16, False), (16, True), (1024, False),
                                                     (1024, True)]


# ---- the lookup ----------------------------------------------------------------------------------------------

def calib(*rules, **kw):
    return Calibration("this GPU", "GPU", "2026-11-22", tuple(rules), **kw)


def rule(D=128, causal=False, Sq=1, lt_from=4096):
    return Rule(D, causal, Sq, lt_from)


@pytest.mark.parametrize("Sq,Sk,bucket", [(1, 8192, 1), (8, 8192, 1), (16, 8192, 16), (1000, 8192, 128),
                                          (4096, 8192, 1024), (8192, 8192, PREFILL), (9000, 8192, PREFILL),
                                          (1024, 1024, PREFILL)])
def test_nearest_bucket_at_or_below(Sq, Sk, bucket):
    c = calib(*(rule(Sq=s) for s in (1, 16, 128, 1024, PREFILL)))
    assert c.rule_for(128, False, Sq, Sk).Sq == bucket


def test_lookup_by_head_dim_and_causal():
    c = calib(rule(D=64, Sq=1), rule(D=128, Sq=1, lt_from=1024), rule(D=128, Sq=16),
              rule(D=128, causal=True, Sq=16, lt_from=None))
    assert c.rule_for(256, False, 1, 4096) is None  # head dim not measured
    assert c.rule_for(64, False, 1, 4096).D == 64
    assert c.rule_for(128, True, 16, 4096) == rule(D=128, causal=True, Sq=16, lt_from=None)
    assert c.rule_for(128, True, 1, 4096) == rule(D=128, Sq=1, lt_from=1024)  # below every causal bucket
    assert c.rule_for(64, True, 100, 4096) == rule(D=64, Sq=1)  # no causal rule of D64 at all
    assert calib(rule(Sq=16)).rule_for(128, False, 1, 4096) is None  # nothing at or below Sq=1
    assert calib(rule(Sq=PREFILL)).rule_for(128, False, 100, 4096) is None  # prefill only for Sq >= Sk


# ---- the sources auto listens to, in order ----------------------------------------------------------------

def entry(points, gpu=H100.name, date="2026-11-22"):
    return calibrate.make_entry(points, gpu, "9.0", date=date)


LOCAL = pts(rows=[(1024, 0.2, 0.3), (4096, 0.93, 0.41), (16384, 3, 1)])  # D128 Sq1: lt from 4096
SHIPPED = pts(rows=[(1024, 0.2, 0.1), (4096, 0.9, 0.4)]) + pts(D=256, rows=[(1024, 1, 2), (65536, 5, 6)])


def test_precedence(isolated, monkeypatch):
    c = case(Sq=1, Sk=2048)
    assert select(c).reasons[0] == "Sk=2048 < threshold 4096 (design default)"
    calibrate.write_shipped(isolated / "shipped", entry(SHIPPED))
    assert select(c).backend == "lt" and "shipped calibration, measured on the NVIDIA H100 80GB HBM3, 2026-11-22" \
        in select(c).reasons[0]
    calibrate.store(H100.env_key, entry(LOCAL))
    d = select(c)
    assert d.backend == "wmma" and "measured on this GPU (NVIDIA H100 80GB HBM3, 2026-11-22)" in d.reasons[0]
    # a case this GPU's calibration does not cover goes to the shipped one, then to the default
    assert "shipped" in select(case(Sq=1, Sk=2048, D=256)).reasons[0]
    d = select(case(Sq=1, Sk=2048, D=64))
    assert d.backend == "wmma" and d.reasons[0] == ("Sk=2048 < threshold 4096 (design default; no calibration of "
                                                    "this GPU covers D64 Sq=1)")
    monkeypatch.setenv("ATTN_LT_THRESHOLD", "100")
    assert select(c).reasons[0] == "Sk=2048 >= threshold 100 (ATTN_LT_THRESHOLD)"
    assert select(c, threshold=99999).reasons[0] == "Sk=2048 < threshold 99999 (threshold argument)"


def test_reasons_show_the_figures_behind_the_choice(isolated):
    calibrate.store(H100.env_key, entry(LOCAL + pts(Sq=1024, rows=[(1024, 1, 2), (65536, 5, 9)])
                                        + pts(Sq=None, rows=[(1024, 1, 2)])))
    src = "measured on this GPU (NVIDIA H100 80GB HBM3, 2026-11-22)"
    assert select(case(Sq=1, Sk=65536)).reasons == (
        f"Sk=65536 >= 4096 ({src}: at D128 Sq1 lt wins from Sk 4096 (lt 0.41 ms vs wmma 0.93 ms at Sk 4096; "
        "wmma 0.2 ms vs lt 0.3 ms at Sk 1024))",)
    assert select(case(Sq=4, Sk=1024)).reasons == (
        f"Sk=1024 < 4096, Sq=4 in bucket Sq1 ({src}: at D128 Sq1 lt wins from Sk 4096 (lt 0.41 ms vs wmma 0.93 ms "
        "at Sk 4096; wmma 0.2 ms vs lt 0.3 ms at Sk 1024))",)
    d = select(case(Sq=2000, Sk=65536))
    assert d.backend == "wmma" and d.reasons == (
        f"Sk=65536: wmma at every Sk, Sq=2000 in bucket Sq1024 ({src}: at D128 Sq1024 lt does not win at the "
        "longest measured Sk (wmma 5 ms vs lt 9 ms at Sk 65536))",)
    assert "at D128 Sq=Sk" in select(case(Sq=1024, Sk=1024)).reasons[0]
    # a path the case cannot take: the measured preference, and why it was overridden
    import dataclasses

    unaligned = dataclasses.replace(case(Sq=1, Sk=1024), ptr_align=8)  # the fused kernels need 16-byte rows
    d = select(unaligned)
    assert d.backend == "lt" and d.reasons[0].startswith("Sk=1024 < 4096 (") and \
        d.reasons[0].endswith(", but wmma cannot run it")
    # explain prints the reasons
    from attn_lt.api import explain_case

    assert "lt wins from Sk 4096 (lt 0.41 ms vs wmma 0.93 ms at Sk 4096" in str(explain_case(case(Sq=1, Sk=65536)))


def test_current_threshold_says_what_decides(isolated):
    assert current_threshold() == (4096, "design default")
    calibrate.store(H100.env_key, entry(LOCAL))
    assert current_threshold() == ("per case", "measured on this GPU (NVIDIA H100 80GB HBM3, 2026-11-22): 1 rules, "
                                               "head dims 128")
    assert current_threshold(77) == (77, "threshold argument")


def test_no_gpu_no_calibration(isolated, monkeypatch):
    calibrate.store(H100.env_key, entry(LOCAL))
    monkeypatch.setattr(calibrate, "current_gpu", lambda: None)
    assert calibrate.calibrations() == ()
    assert "design default" in select(case()).reasons[0]


def test_lookup_is_cached_per_cache_dir_and_gpu(isolated, monkeypatch):
    calibrate.store(H100.env_key, entry(LOCAL))
    first = calibrate.calibrations()
    assert first and calibrate.calibrations() is first  # read once
    (isolated / "cache" / "calibration.json").write_text("{}")  # changed behind its back: still the cached one
    assert calibrate.calibrations() is first
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(isolated / "elsewhere"))
    assert calibrate.calibrations() == ()
    calibrate.clear_cache()
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(isolated / "cache"))
    assert calibrate.calibrations() == ()  # read again: "{}" is not a calibration file (reported, ignored)


# ---- files: version 1, newer versions, bad entries, shipped ---------------------------------------------------

def test_a_version_1_file_applies_its_threshold_to_every_case(isolated, caplog):
    v1 = {"schema": "attn_lt.calibration", "thresholds": {H100.env_key: {"threshold": 777, "points": [
        {"D": 64, "Sk": 2048, "H": 32, "wmma_ms": 0.1, "lt_ms": 0.4}]}}}
    (isolated / "cache" / "calibration.json").write_text(json.dumps(v1))
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        for c in (case(Sq=1, Sk=1000), case(Sq=4096, Sk=4096, D=64, causal=True)):
            assert select(c).reasons[0].endswith("threshold 777 (measured on this GPU by attn-lt calibrate)")
    assert not caplog.records
    assert current_threshold() == (777, "measured on this GPU by attn-lt calibrate")
    # storing a v2 entry keeps the other environments' v1 entries, and makes the file version 2
    calibrate.store("NVIDIA H200|sm9.0|132sm|cublasLt130100", entry(LOCAL, gpu="NVIDIA H200"))
    doc = calibrate.read()
    assert doc["version"] == 2 and doc["thresholds"][H100.env_key]["threshold"] == 777


def test_what_an_older_attn_lt_reads_in_a_version_2_file(isolated):
    """The v1 reader kept an entry's ``threshold`` when it was a positive int, and otherwise used its default."""
    where = calibrate.store(H100.env_key, entry(LOCAL))
    doc = json.loads(where.read_text())
    assert doc["schema"] == "attn_lt.calibration" and isinstance(doc["thresholds"], dict)
    assert "threshold" not in doc["thresholds"][H100.env_key]


def test_a_newer_file_is_ignored_and_left_alone(isolated, caplog):
    p = isolated / "cache" / "calibration.json"
    p.write_text(json.dumps({"schema": "attn_lt.calibration", "version": 3, "thresholds": {H100.env_key: {}}}))
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert "design default" in select(case()).reasons[0]
        assert "design default" in select(case(Sk=100)).reasons[0]
        assert calibrate.store(H100.env_key, entry(LOCAL)) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("newer attn_lt" in m for m in msgs) == 2, msgs  # one for the lookup, one for the refused store
    assert json.loads(p.read_text())["version"] == 3


@pytest.mark.parametrize("bad", [{"rules": "x"}, {"rules": [{"D": 128}]}, {"points": []}, [1],
                                 {"rules": [rule().to_dict(), rule().to_dict()]}])
def test_an_unusable_entry_is_reported_once_and_the_next_source_decides(isolated, caplog, bad):
    calibrate.store(H100.env_key, entry(LOCAL))
    doc = calibrate.read()
    doc["thresholds"][H100.env_key] = bad
    (isolated / "cache" / "calibration.json").write_text(json.dumps(doc))
    calibrate.clear_cache()
    calibrate.write_shipped(isolated / "shipped", entry(SHIPPED))
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        for _ in range(3):
            assert "shipped calibration" in select(case(Sq=1, Sk=2048)).reasons[0]
    assert len(caplog.records) == 1 and "calibration of the NVIDIA H100 80GB HBM3" in caplog.records[0].getMessage()


def test_shipped_file_is_keyed_by_gpu_model_not_by_machine(isolated, monkeypatch):
    p = calibrate.write_shipped(isolated / "shipped", entry(SHIPPED))
    assert p.name == "nvidia-h100-80gb-hbm3-sm90.json"
    doc = json.loads(p.read_text())
    assert doc["schema"] == "attn_lt.calibration" and doc["version"] == 2
    assert list(doc["thresholds"]) == ["NVIDIA H100 80GB HBM3|sm9.0"]
    e = doc["thresholds"]["NVIDIA H100 80GB HBM3|sm9.0"]
    assert e["date"] == "2026-11-22" and e["rules"] and e["points"] == SHIPPED
    # another machine with this GPU model: other SM count and cuBLASLt, or no cuBLASLt at all
    for env_key in ("NVIDIA H100 80GB HBM3|sm9.0|114sm|cublasLt120000", None):
        monkeypatch.setattr(calibrate, "current_gpu", lambda k=env_key: calibrate.Gpu(H100.name, "9.0", k))
        assert "shipped calibration" in select(case(Sq=1, Sk=2048)).reasons[0]
    # another model, or the same name with another compute capability: not applied
    for gpu in (calibrate.Gpu("NVIDIA H100 PCIe", "9.0", None), calibrate.Gpu(H100.name, "8.0", None)):
        monkeypatch.setattr(calibrate, "current_gpu", lambda g=gpu: g)
        assert "design default" in select(case(Sq=1, Sk=2048)).reasons[0]


@pytest.mark.parametrize("content,says", [
    ('{"schema": "attn_lt.calibration", "thresholds": {}}', "has version 1, not 2"),
    ('{"schema": "attn_lt.calibration", "version": 2, "thresholds": {"NVIDIA H200|sm9.0": {}}}', "has no entry"),
    ("garbage", "cannot read the shipped calibration"),
])
def test_a_bad_shipped_file_is_reported_once(isolated, caplog, content, says):
    (isolated / "shipped" / "nvidia-h100-80gb-hbm3-sm90.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert "design default" in select(case()).reasons[0]
        assert "design default" in select(case(Sk=10)).reasons[0]
    assert len(caplog.records) == 1 and says in caplog.records[0].getMessage()


def test_no_shipped_directory_is_fine(isolated, monkeypatch):
    monkeypatch.setattr(calibrate, "SHIPPED_DIR", isolated / "missing")
    assert calibrate.calibrations() == ()


def test_write_shipped_reports_an_unwritable_place(isolated):
    (isolated / "file").write_text("x")
    with pytest.raises(OSError):
        calibrate.write_shipped(isolated / "file", entry(SHIPPED))


def test_store_checks_its_arguments():
    with pytest.raises(TypeError, match="entry must be"):
        calibrate.store("env", "8192")
    with pytest.raises(ValueError, match="threshold must be"):
        calibrate.store("env", 0)


def test_measuring_some_head_dims_again_keeps_the_others(isolated):
    """attn-lt calibrate --dims 192: the stored and shipped entries keep D128/D256's points and rules."""
    mla = pts(D=192, Sq=None, rows=[(1024, 0.1, 0.5), (8192, 2, 9)])
    new = calibrate.make_entry(mla, H100.name, "9.0", grid={"dims": [192]})
    p = calibrate.write_shipped(isolated / "shipped", entry(SHIPPED))
    calibrate.write_shipped(isolated / "shipped", new, merge=True)
    got = json.loads(p.read_text())["thresholds"][calibrate.shipped_key(H100.name, "9.0")]
    assert {pt["D"] for pt in got["points"]} == {128, 192, 256} and got["grid"]["dims"] == [128, 192, 256]
    assert {r["D"] for r in got["rules"]} == {128, 192, 256}
    again = calibrate.make_entry(pts(D=192, Sq=None, rows=[(1024, 0.1, 0.05)]), H100.name, "9.0",
                                 grid={"dims": [192]})
    calibrate.write_shipped(isolated / "shipped", again, merge=True)  # 192 replaced, not appended
    got = json.loads(p.read_text())["thresholds"][calibrate.shipped_key(H100.name, "9.0")]
    assert [pt["Sk"] for pt in got["points"] if pt["D"] == 192] == [1024]
    calibrate.write_shipped(isolated / "shipped", again)  # without merge: the file is the new entry alone
    assert {pt["D"] for pt in json.loads(p.read_text())["thresholds"][calibrate.shipped_key(H100.name, "9.0")]
            ["points"]} == {192}
    where = calibrate.store(H100.env_key, entry(LOCAL))
    calibrate.store(H100.env_key, new, merge=True)
    stored = json.loads(where.read_text())["thresholds"][H100.env_key]
    assert {pt["D"] for pt in stored["points"]} == {128, 192}
    assert calibrate.merged(None, new) is new and calibrate.merged({"points": "junk"}, new) is new


def test_shipped_names():
    assert calibrate.shipped_name("NVIDIA H200", "9.0") == "nvidia-h200-sm90.json"
    assert calibrate.shipped_name("../../x y", "8.6") == "x-y-sm86.json"
    assert calibrate.shipped_key("NVIDIA H200", "9.0") == "NVIDIA H200|sm9.0"


def test_package_data_lists_the_shipped_calibrations():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "pyproject.toml").read_text()
    data = re.search(r"\[tool.setuptools.package-data\]\s*attn_lt = \[([^]]*)\]", text).group(1)
    assert '"calibrations/*.json"' in data
    assert pathlib.Path(calibrate.__file__).parent / "calibrations" == root / "attn_lt" / "calibrations"


def test_masked_rules_decide_masked_cases_only(isolated):
    plain = pts(Sq=1024, rows=[(1024, 1, 2), (16384, 5, 9)])
    masked = [dict(p, mask=True) for p in pts(Sq=1024, rows=[(1024, 3, 2), (16384, 20, 9)])]
    rules = calibrate.derive_rules(plain + masked)
    assert {(r.mask, r.lt_from) for r in rules} == {(False, None), (True, 1024)}
    assert any("masked" in str(r) for r in rules)
    calibrate.store(H100.env_key, entry(LOCAL + plain + masked))
    from attn_lt.validate import MaskInfo

    m = MaskInfo("float", "bf16", (1, 1, 2000, 16384), (0, 0, 16384, 1))
    assert select(case(Sq=2000, Sk=16384)).backend == "wmma"
    d = select(case(Sq=2000, Sk=16384, mask=m))
    assert d.backend == "lt" and "masked" in d.reasons[0]
    # a calibration without masked rules decides no masked case: the design default does
    calibrate.store(H100.env_key, entry(LOCAL + plain))
    calibrate.clear_cache()
    d = select(case(Sq=2000, Sk=16384, mask=m))
    assert "design default" in d.reasons[0] and "masked" in d.reasons[0]


def test_a_head_dim_whose_new_points_all_failed_keeps_its_old_ones():
    old = calibrate.make_entry(SHIPPED, H100.name, "9.0")
    failed = [{"D": 256, "causal": False, "Sq": 1, "Sk": 1024, "error": "OutOfMemoryError: ..."}]
    got = calibrate.merged(old, calibrate.make_entry(failed, H100.name, "9.0", grid={"dims": [256]}))
    assert [p for p in got["points"] if p["D"] == 256 and "error" not in p] == [p for p in SHIPPED if p["D"] == 256]
