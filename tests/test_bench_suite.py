"""The benchmark suite's pure parts (tools/bench_suite.py): formulas, the case generator, ratios, the writers on
synthetic rows, the comparison of two runs; and tools/bench.py's commands that need no GPU."""

import csv
import json
import math
import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools")
sys.path.insert(0, TOOLS)
import bench  # noqa: E402
import bench_suite as suite  # noqa: E402

CEIL = {"gemm_tflops": 800.0, "hbm_tbs": 4.0}


# ---- formulas --------------------------------------------------------------------------------------------------

def test_flops_follow_the_flashattention_convention():
    c = suite.Case("long", 1, 32, 32, 32768, 32768, 128)
    assert suite.flops(c) == 4 * 32 * 32768 * 32768 * 128
    causal = suite.Case("long", 1, 32, 32, 32768, 32768, 128, causal=True)
    assert suite.flops(causal) == suite.flops(c) / 2
    gqa = suite.Case("decode", 8, 32, 8, 1, 8192, 128)  # FLOPs count query heads
    assert suite.flops(gqa) == 4 * 8 * 32 * 1 * 8192 * 128


def test_io_bytes_count_q_k_v_o_and_the_mask_once():
    c = suite.Case("decode", 8, 32, 8, 16, 8192, 128)
    q_and_o = 2 * 8 * 32 * 16 * 128 * 2
    k_and_v = 2 * 8 * 8 * 8192 * 128 * 2
    assert suite.io_bytes(c) == q_and_o + k_and_v
    masked = suite.Case("decode", 8, 32, 8, 16, 8192, 128, mask=True)
    assert suite.io_bytes(masked) == q_and_o + k_and_v + 8 * 16 * 8192 * 2


def test_unfused_path_adds_twelve_bytes_a_score():
    c = suite.Case("fa3", 1, 16, 16, 16384, 16384, 128)
    assert suite.path_bytes(c, "unfused") - suite.path_bytes(c, "fused") == 12 * 16 * 16384**2
    causal = suite.Case("fa3", 1, 16, 16, 16384, 16384, 128, causal=True)
    assert suite.path_bytes(causal, "unfused") - suite.path_bytes(causal, "fused") == 6 * 16 * 16384**2
    with pytest.raises(ValueError, match="path"):
        suite.path_bytes(c, "hybrid")


def test_roofline_of_the_unfused_path_is_181_tflops_at_d128():
    """BENCHMARKS.md: 12 B a score for 4 D FLOPs gives ~181 TFLOP/s at D=128 from 4.24 TB/s of HBM."""
    c = suite.Case("long", 1, 32, 32, 65536, 65536, 128)
    ms = suite.roofline_ms(c, "unfused", peak_tflops=1e9, peak_tbs=4.24)  # memory-bound only
    assert suite.flops(c) / ms / 1e9 == pytest.approx(4 * 128 / 12 * 4.24, rel=2e-3)  # + Q, K, V, O
    assert suite.flops(c) / ms / 1e9 == pytest.approx(181, rel=0.01)
    # the fused path is compute-bound here: its roofline is the GEMM rate
    assert suite.roofline_ms(c, "fused", 800, 4.24) == pytest.approx(suite.flops(c) / 800e9)


def test_metrics_at_the_roofline_are_100_percent():
    c = suite.Case("decode", 8, 32, 32, 1, 65536, 128)
    ms = suite.roofline_ms(c, "fused", CEIL["gemm_tflops"], CEIL["hbm_tbs"])
    m = suite.metrics(c, "fused", ms, CEIL)
    assert m["roofline_pct"] == pytest.approx(100, abs=0.1)
    assert m["tbs"] == pytest.approx(4.0, rel=1e-3)
    assert m["io_tbs"] == m["tbs"]  # the fused path's bytes are the inputs and output
    assert m["tflops"] == pytest.approx(suite.flops(c) / ms / 1e9, rel=1e-3)
    assert suite.metrics(c, "fused", 2 * ms, CEIL)["roofline_pct"] == pytest.approx(50, abs=0.1)


def test_provider_paths():
    assert suite.provider_path("lt") == "unfused"
    assert suite.provider_path("cudnn") == "fused"
    assert suite.provider_path("math") == "unfused"
    assert suite.provider_path("auto", "wmma") == "fused"
    assert suite.provider_path("auto", "lt") == "unfused"
    with pytest.raises(ValueError, match="route"):
        suite.provider_path("auto")


# ---- the case generator ----------------------------------------------------------------------------------------

def test_full_sweep_covers_the_protocol():
    cases = suite.sweep()
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "case names are unique"
    fa3 = [c for c in cases if c.group == "fa3"]
    assert all(c.B * c.Sq == 16384 and c.Hq * c.D == 2048 and c.Sq == c.Sk for c in fa3)
    assert {(c.D, c.Sk, c.causal) for c in fa3 if not c.mask} == {
        (d, s, cz) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384) for cz in (False, True)}
    long = [c for c in cases if c.group == "long" and not c.mask]
    assert {(c.B, c.Hq, c.D) for c in long} == {(1, 32, 128)}
    assert {(c.Sk, c.causal) for c in long} == {(s, cz) for s in (32768, 65536, 131072) for cz in (False, True)}
    dec = [c for c in cases if c.group == "decode" and not c.mask]
    assert {(c.Sq, c.Sk, c.Hkv) for c in dec} == {
        (sq, sk, h) for sq in (1, 16) for sk in (8192, 16384, 32768, 65536, 131072) for h in (32, 8)}
    assert not any(c.causal for c in dec)
    # the masked variants: every non-causal case once more with a dense additive mask
    plain = {(c.group, c.B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D) for c in cases if not c.mask and not c.causal}
    masked = {(c.group, c.B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D) for c in cases if c.mask}
    assert masked == plain
    assert not any(c.mask and c.causal for c in cases)


def test_quick_is_a_small_subset_of_every_group_and_filters_work():
    full, quick = suite.sweep(), suite.sweep(quick=True)
    assert set(quick) <= set(full)
    assert 5 <= len(quick) <= 12
    assert {c.group for c in quick} == set(suite.GROUPS)
    assert any(c.mask for c in quick) and any(c.causal for c in quick)
    assert all(c.group == "decode" for c in suite.sweep(groups=["decode"]))
    assert not any(c.mask for c in suite.sweep(with_masks=False))
    with pytest.raises(ValueError, match="unknown groups"):
        suite.sweep(groups=["prefill"])


def test_cases_validate_their_fields():
    with pytest.raises(ValueError, match="group"):
        suite.Case("prefill", 1, 8, 8, 64, 64, 64)
    with pytest.raises(ValueError, match="multiple"):
        suite.Case("long", 1, 8, 3, 64, 64, 64)
    with pytest.raises(ValueError, match="positive"):
        suite.Case("long", 0, 8, 8, 64, 64, 64)


def test_case_names_and_panels():
    assert suite.fa3_case(64, 512, causal=True).name == "fa3-d64-s512-causal"
    assert suite.long_case(131072, mask=True).name == "long-s128k-mask"
    assert suite.decode_case(16, 8192, gqa=True).name == "decode-sq16-sk8k-gqa"
    assert suite.decode_case(1, 8192, gqa=False).shape == "B8 H32 Sq1 Sk8192 D128"
    a, b = suite.fa3_case(128, 512), suite.fa3_case(128, 16384)
    assert a.panel == b.panel != suite.fa3_case(128, 512, causal=True).panel


# ---- rows, ratios, writers -------------------------------------------------------------------------------------

def synthetic_rows():
    """Two cases: auto at 2 ms, cudnn 1 ms, unfused 4 ms; flash cannot run the masked one."""
    rows = []
    for c in (suite.fa3_case(128, 4096), suite.fa3_case(128, 4096, mask=True)):
        for p, ms, route in (("auto", 2.0, "lt"), ("cudnn", 1.0, None), ("unfused", 4.0, None)):
            path = suite.provider_path(p, route)
            rows.append(suite.row(c, p, "ok", route=route, ms=ms, peak_mib=100.0 * ms, rel_err=4e-3, reps=50,
                                  **suite.metrics(c, path, ms, CEIL)))
        if c.mask:
            rows.append(suite.row(c, "flash", "n/a", "Flash attention does not support non-null attn_mask"))
        else:
            rows.append(suite.row(c, "flash", "ok", ms=1.5, peak_mib=64.0, rel_err=4e-3, reps=60,
                                  **suite.metrics(c, "fused", 1.5, CEIL)))
    rows.append(suite.row(suite.long_case(131072), "unfused", "skipped", "needs about 1536 GiB at once"))
    return suite.add_ratios(rows)


def test_rows_validate_their_fields():
    c = suite.fa3_case(64, 512)
    with pytest.raises(ValueError, match="provider"):
        suite.row(c, "xformers", "ok")
    with pytest.raises(ValueError, match="status"):
        suite.row(c, "auto", "fine")
    with pytest.raises(ValueError, match="fields"):
        suite.row(c, "auto", "ok", speed=1)


def test_ratios_are_peer_time_over_attn_lt_time():
    rows = synthetic_rows()
    r = suite.ratios(rows)["fa3-d128-s4k"]
    assert r == {"auto/cudnn": 0.5, "auto/unfused": 2.0, "auto/flash": 0.75}
    assert "auto/flash" not in suite.ratios(rows)["fa3-d128-s4k-mask"]
    vs = {(x["case"], x["provider"]): x.get("vs_auto") for x in rows}
    assert vs[("fa3-d128-s4k", "unfused")] == 2.0 and vs[("fa3-d128-s4k", "auto")] == 1.0
    assert vs[("fa3-d128-s4k-mask", "flash")] is None


def test_json_and_csv_writers_round_trip(tmp_path):
    rows = synthetic_rows()
    meta = {"date": "2026-11-20 12:00 UTC", "gpu": "test GPU"}
    suite.write_json(tmp_path / "r.json", meta, rows)
    meta2, rows2 = suite.read_json(tmp_path / "r.json")
    assert meta2 == meta and rows2 == rows
    assert json.loads((tmp_path / "r.json").read_text())["ratios"]["fa3-d128-s4k"]["auto/unfused"] == 2.0
    suite.write_csv(tmp_path / "r.csv", rows)
    with open(tmp_path / "r.csv") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(suite.CSV_FIELDS) == list(suite.ROW_FIELDS[:-1])
    assert len(got) == len(rows)
    assert got[0]["provider"] == "auto" and float(got[0]["ms"]) == 2.0 and got[0]["route"] == "lt"
    na = next(g for g in got if g["status"] == "n/a")
    assert na["ms"] == "" and "attn_mask" in na["reason"]
    (tmp_path / "bad.json").write_text('{"rows": 3}')
    with pytest.raises(ValueError, match="schema"):
        suite.read_json(tmp_path / "bad.json")


def test_tables_show_rates_ratios_and_why_a_provider_did_not_run():
    rows = synthetic_rows()
    text = suite.render_text(rows)
    assert "fa3: TFLOP/s" in text and "long: TFLOP/s" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("fa3-d128-s4k "))
    tflops = suite.flops(suite.fa3_case(128, 4096)) / 2.0 / 1e9
    assert f"{tflops:.1f}" in line and "0.50x (cudnn)" in line and "2.00x" in line
    assert "flash n/a: Flash attention does not support non-null attn_mask [fa3-d128-s4k-mask]" in text
    assert "unfused skipped: needs about 1536 GiB at once [long-s128k]" in text
    md = suite.render_markdown({"date": "2026-11-20 12:00 UTC", "gpu": "test GPU", "command": "x"}, rows)
    assert md.startswith("2026-11-20 12:00 UTC, test GPU")
    assert "| case | shape | auto | cudnn | flash | unfused | auto via | auto/best SDPA | auto/unfused |" in md
    assert "| fa3-d128-s4k-mask | B4 H16 S4096 D128 |" in md and "| n/a |" in md


def test_tables_name_the_providers_timed_on_a_clock_held_down():
    c = suite.fa3_case(128, 4096)
    held = dict(gpu_sm_mhz=1620.0, gpu_sm_mhz_min=1605.0, gpu_sm_mhz_rated=1980.0, gpu_power_w_max=None,
                gpu_samples=5, gpu_clock_held="power cap 60 %")
    full = dict(gpu_sm_mhz=1980.0, gpu_sm_mhz_min=1965.0, gpu_sm_mhz_rated=1980.0, gpu_power_w_max=600.0,
                gpu_samples=4, gpu_clock_held="")
    ceil = {"gemm_tflops": 700.0, "hbm_tbs": 4.0}
    rows = suite.add_ratios([suite.row(c, "auto", "ok", route="wmma", ms=1.0, **suite.metrics(c, "fused", 1.0, ceil),
                                       **full),
                             suite.row(c, "cudnn", "ok", ms=1.0, **suite.metrics(c, "fused", 1.0, ceil), **held)])
    line = "fa3-d128-s4k cudnn: SM clock 1620 MHz median of 1980, 1605 lowest (power cap 60 % of 5 samples)"
    assert suite.clock_lines(rows) == [line]
    assert f"clock held down while timed:\n  {line}\n" in suite.render_text(rows)
    assert f"Clock held down while timed:\n\n- {line}\n" in suite.render_markdown({"date": "d", "gpu": "g"}, rows)
    assert "clock held" not in suite.render_text(rows[:1])


def test_decode_tables_show_bandwidth():
    c = suite.decode_case(1, 65536, gqa=False)
    rows = suite.add_ratios([suite.row(c, "auto", "ok", route="lt", ms=2.0, peak_mib=1.0, rel_err=1e-3, reps=9,
                                       **suite.metrics(c, "unfused", 2.0, CEIL))])
    text = suite.render_text(rows)
    assert "decode: effective TB/s" in text
    assert rows[0]["io_tbs"] == pytest.approx(suite.io_bytes(c) / 2.0 / 1e9, abs=1e-3)
    assert f"{rows[0]['io_tbs']:.2f}" in text  # not the path's bytes: comparable across paths
    assert rows[0]["tbs"] > rows[0]["io_tbs"]


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    made = suite.plot(synthetic_rows(), tmp_path)
    assert [os.path.basename(p) for p in made] == ["rate.png", "memory.png"]
    for p in made:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) < 400_000


def test_compare_reports_the_largest_ratio_difference():
    a = synthetic_rows()
    b = [dict(r) for r in a]
    for r in b:
        if r["provider"] == "cudnn" and r["case"] == "fa3-d128-s4k":
            r["ms"] = 1.04  # 4% slower in run b
    d = suite.compare(a, b)
    assert d["n"] == 5
    assert d["max_pct"] == pytest.approx(100 * (1 - 0.5 / 0.52), abs=0.01)
    assert d["worst"][0]["case"] == "fa3-d128-s4k" and d["worst"][0]["ratio"] == "auto/cudnn"
    assert d["within_3pct"] == 4 and d["within_5pct"] == 5
    assert suite.compare(a, a)["max_pct"] == 0
    assert suite.compare(a, [])["n"] == 0


def test_progress_bar_counts_and_estimates(capsys):
    import io

    buf = io.StringIO()
    bar = suite.Progress(4, stream=buf)
    assert "0/4" in bar.line("x") and "~? left" in bar.line("x")
    bar.step("first")
    bar.step("second")
    assert "2/4" in bar.line("third") and "~? left" not in bar.line("third")
    bar.close()
    assert buf.getvalue().endswith("\n") and "4/4" in buf.getvalue()


def test_reference_on_sampled_rows_equals_the_full_reference():
    """The benchmark checks every output on sampled rows: the same numbers as the whole reference there, with
    causal (Sq != Sk, bottom-right), a mask and GQA."""
    import torch

    from attn_lt.testing import reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k, v = torch.randn(2, 2, 53, 16, generator=g), torch.randn(2, 2, 53, 16, generator=g)
    mask = torch.randn(2, 1, 37, 53, generator=g)
    rows = torch.tensor([0, 5, 36])
    full, full_lse = reference(q, k, v, mask, causal=True, dtype=torch.float64)
    part, part_lse = reference(q, k, v, mask, causal=True, dtype=torch.float64, rows=rows)
    assert part.shape == (2, 4, 3, 16)
    torch.testing.assert_close(part, full[:, :, rows])
    torch.testing.assert_close(part_lse, full_lse[:, :, rows])


# ---- tools/bench.py without a GPU ------------------------------------------------------------------------------

def test_bench_list_and_compare_commands(tmp_path, capsys):
    assert bench.main(["list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "fa3-d128-s4k" in out and f"{len(suite.sweep(quick=True))} cases x 9 providers" in out
    assert bench.main(["list", "--groups", "decode", "--cases", "sk128k", "--providers", "auto,cudnn"]) == 0
    out = capsys.readouterr().out
    assert "decode-sq1-sk128k-mha" in out and "fa3" not in out and "x 2 providers" in out
    assert bench.main(["list", "--providers", "xformers"]) == 2
    assert "unknown providers" in capsys.readouterr().err
    a = synthetic_rows()
    suite.write_json(tmp_path / "a.json", {}, a)
    b = [dict(r, ms=r["ms"] * (1.2 if r["provider"] == "cudnn" else 1)) if r["status"] == "ok" else r for r in a]
    suite.write_json(tmp_path / "b.json", {}, b)
    assert bench.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert bench.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "max 16.67%" in capsys.readouterr().out


def test_timer_refuses_an_unknown_flush_before_touching_the_gpu():
    with pytest.raises(ValueError, match="flush must be one of read, write"):
        bench.Timer(10.0, 7, flush="none")
    with pytest.raises(ValueError, match="--settle-ms >= 0"):
        bench.Timer(10.0, 7, settle_ms=-1)


def simulated_event(clock: list):
    """A stand-in for torch.cuda.Event on a simulated GPU clock (``clock[0]``, ms)."""
    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

        def synchronize(self):
            pass

    return Event


def test_l2_flusher_refuses_an_unknown_mode_before_touching_the_gpu():
    from attn_lt import testing

    with pytest.raises(ValueError, match="must be one of read, write, got 'none'"):
        testing.l2_flusher("none")


def test_time_ms_flushes_before_every_call_and_takes_the_median(monkeypatch):
    """attn_lt.testing.time_ms: a first call, five flushed calls for the estimate, warm-up calls for warmup_ms,
    then as many flushed calls between events as fit rep_ms (at least 5); the median (on a simulated GPU clock)."""
    import torch

    from attn_lt import testing

    clock, log, flushes = [0.0], [], []

    costs = iter([1.0] * 11 + [4.0, 1.0, 1.0, 9.0, 2.0, 2.0, 3.0, 2.0] + [1.0] * 100)

    def fn():
        log.append("call")
        clock[0] += next(costs)

    monkeypatch.setattr(torch.cuda, "Event", simulated_event(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(testing, "l2_flusher", lambda mode: lambda: (flushes.append(mode), log.append("flush")))
    assert testing.time_ms(fn, warmup_ms=5, rep_ms=8) == 2.0  # 8 timed calls (8 ms / 1 ms): median of the 8 above
    assert log[0] == "call" and log[1:] == ["flush", "call"] * (5 + 5 + 8)
    assert set(flushes) == {"read"}
    log.clear()
    testing.time_ms(fn, warmup_ms=0, rep_ms=1, flush="write")
    assert log == ["call"] + ["flush", "call"] * (5 + 1 + 5) and flushes[-1] == "write"


def test_timed_rounds_times_settles_and_drops_failures():
    """bench.timed_rounds, shared by both benchmarks: each provider settled then timed once a round; one that runs
    out of memory is skipped, one that raises is an error, neither timed further; the round rules."""
    import torch

    class FakeTimer:
        rounds, slow_rounds = 4, 2

        def __init__(self, ms):
            self.ms, self.log = ms, []

        def settle(self, fn):
            self.log.append(("settle", fn))

        def samples(self, fn):
            self.log.append(("time", fn))
            fn()
            return [self.ms, self.ms]

    calls_b = []

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    def flaky():
        calls_b.append(1)
        if len(calls_b) == 2:
            raise RuntimeError("second round")

    def ok():
        pass

    t = FakeTimer(2.0)
    timed, failed = bench.timed_rounds({"a": ok, "b": flaky, "c": oom}, t)
    assert failed == {"b": ("error", "RuntimeError: second round"),
                      "c": ("skipped", "out of memory: CUDA out of memory. Tried to allocate 2 GiB")}
    assert list(timed) == ["a"] and timed["a"] == {"ms": 2.0, "reps": 8, "rounds": 4, "spread_pct": 0.0}
    assert all(t.log[i] == ("settle", t.log[i + 1][1]) for i in range(0, len(t.log), 2))  # settled, then timed
    slow = FakeTimer(600.0)  # the first round over SLOW_ROUND_MS: slow_rounds; under FAST_CALL_MS: fast_rounds
    assert bench.timed_rounds({"a": ok, "b": ok}, slow)[0]["a"]["rounds"] == 2
    fast = FakeTimer(0.5)
    assert bench.timed_rounds({"a": ok}, fast, fast_rounds=6)[0]["a"]["rounds"] == 6
    assert bench.timed_rounds({"a": ok}, FakeTimer(0.5))[0]["a"]["rounds"] == 4


def test_timer_settles_with_untimed_calls_for_its_time(monkeypatch):
    """settle(): nothing at 0 ms; otherwise calls (as timed ones are made) until settle_ms has passed, at least one."""
    now = [0.0]

    def clock():  # every reading of the clock is 1 ms later
        now[0] += 1e-3
        return now[0]

    monkeypatch.setattr(bench.time, "perf_counter", clock)
    t = bench.Timer.__new__(bench.Timer)  # no GPU buffer: once() is stubbed
    calls = []
    t.once = lambda fn: calls.append(fn)
    t.settle_ms = 0.0
    t.settle("f")
    assert calls == []
    t.settle_ms = 5.0
    t.settle("f")
    assert calls == ["f"] * 5  # readings at 1 (end 6), then 2..6 between the calls
    calls.clear()
    t.settle_ms = 0.5
    t.settle("g")
    assert calls == ["g"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_bench_run_without_a_gpu_says_so(tmp_path, capsys):
    assert bench.main(["run", "--quick", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_run_measures_a_case_end_to_end(tmp_path):
    """One small case through every provider: rows for all, attn_lt checked and timed, files written."""
    rc = bench.main(["run", "--cases", "fa3-d128-s512", "--groups", "fa3", "--no-masks", "--rep-ms", "10",
                     "--flush", "write", "--out", str(tmp_path)])
    assert rc == 0
    meta, rows = suite.read_json(tmp_path / "results.json")
    assert {r["case"] for r in rows} == {"fa3-d128-s512", "fa3-d128-s512-causal"}
    assert len(rows) == 2 * len(suite.PROVIDERS)
    for r in rows:
        if r["provider"] in ("auto", "lt", "wmma", "cudnn", "unfused"):
            assert r["status"] == "ok", r
            assert r["rel_err"] < bench.CHECK_TOL and r["ms"] > 0 and math.isfinite(r["tflops"])
    assert {r["route"] for r in rows if r["provider"] == "auto"} == {"wmma"}
    assert meta["ceilings"]["gemm_tflops"] > 0 and meta["versions"]["torch"] and meta["flush"] == "write"
    assert (tmp_path / "summary.md").exists() and (tmp_path / "results.csv").exists()
    assert meta["clock_monitor"].endswith("samples") and not meta["clock_monitor"].startswith("no")
    assert any(r.get("gpu_sm_mhz") for r in rows if r["status"] == "ok")  # the SM clock sampled beside the times


def test_sdpa_refusals_keep_the_reasons_not_the_noise():
    class W:
        def __init__(self, m):
            self.message = UserWarning(m)

    caught = [W("Memory efficient kernel not used because: (Triggered internally at /pytorch/sdp_utils.cpp:1)"),
              W("Memory Efficient attention has been runtime disabled. (Triggered internally at /x.cpp:2)"),
              W("Flash attention kernel not used because: (Triggered internally at /x.cpp:3)"),
              W("Flash attention does not support non-null attn_mask. (Triggered internally at /x.cpp:4)"),
              W("Flash attention does not support non-null attn_mask. (Triggered internally at /x.cpp:4)")]
    assert bench.sdpa_reasons(caught, RuntimeError("No available kernel")) == \
        "Flash attention does not support non-null attn_mask."
    assert bench.sdpa_reasons([], RuntimeError("cuDNN error:\n  bad shape")) == "cuDNN error: bad shape"


def test_reasons_group_one_cause_per_line():
    rows = [suite.row(suite.fa3_case(64, s, mask=True), "wmma", "n/a",
                      f"backend='wmma' cannot run B{16384 // s} Hq32 Hkv32 Sq{s} Sk{s} D64 bf16 "
                      f"float-mask[{16384 // s}, 1, {s}, {s}]: attn_mask is not supported") for s in (512, 1024)]
    rows += [suite.row(suite.long_case(s), "math", "skipped", f"needs about {n} GiB at once for its score matrices; "
                       f"{f} GiB free") for s, n, f in ((32768, 321, 138), (65536, 1282, 137))]
    rows.append(suite.row(suite.decode_case(1, 8192, gqa=True), "efficient", "n/a",
                          "For dense input, both fused kernels require query, key and value to have the same "
                          "num_heads. Query.sizes(): [8, 32, 1, 128], Key sizes(): [8, 8, 8192, 128]"))
    lines = suite.reasons(rows)
    assert lines == [
        "wmma n/a: attn_mask is not supported [fa3-d64-s512-mask, fa3-d64-s1k-mask]",
        "math skipped: its score matrices (FP32 scores, their softmax and P at once) need more than the free memory "
        "[long-s32k, long-s64k]",
        "efficient n/a: For dense input, both fused kernels require query, key and value to have the same num_heads. "
        "[decode-sq1-sk8k-gqa]"]


def test_splice_replaces_the_readme_block():
    text = f"# T\nbefore\n{suite.README_BEGIN}\nold table\n{suite.README_END}\nafter\n"
    assert suite.splice(text, "new\n") == f"# T\nbefore\n{suite.README_BEGIN}\nnew\n{suite.README_END}\nafter\n"
    with pytest.raises(ValueError, match="block"):
        suite.splice("# no markers\n", "new")


def test_report_rewrites_summary_plots_and_the_readme_block(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    suite.write_json(run / "results.json", {"date": "2026-11-20 12:00 UTC", "gpu": "test GPU"}, synthetic_rows())
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{suite.README_BEGIN}\n{suite.README_END}\n")
    assert bench.main(["report", str(run / "results.json"), "--readme", str(readme)]) == 0
    assert "fa3-d128-s4k" in capsys.readouterr().out
    assert (run / "summary.md").read_text().startswith("2026-11-20 12:00 UTC, test GPU")
    text = readme.read_text()
    assert "![rate.png](run/rate.png) ![memory.png](run/memory.png)" in text
    assert "| fa3-d128-s4k | B4 H16 S4096 D128 |" in text and text.endswith(f"{suite.README_END}\n")


def test_source_hash_names_the_code():
    h = bench.source_hash()
    assert len(h) == 12 and int(h, 16) >= 0 and h == bench.source_hash()


@pytest.mark.gpu
def test_bench_lt_details_record_kernels_and_gemms(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "tune")  # so that the cache holds the GEMMs (tests' own cache dir)
    rc = bench.main(["run", "--cases", "fa3-d128-s1k", "--groups", "fa3", "--no-masks", "--providers", "lt,cudnn",
                     "--rep-ms", "10", "--rounds", "2", "--warm-up-s", "0", "--lt-details", "--out", str(tmp_path)])
    assert rc == 0
    meta, rows = suite.read_json(tmp_path / "results.json")
    lt = next(r for r in rows if r["provider"] == "lt" and r["case"] == "fa3-d128-s1k")
    assert lt["details"]["kernels_ms"].get("softmax", 0) > 0 and lt["details"]["kernels_ms"].get("gemm", 0) > 0
    assert lt["details"]["gemms"] and all(g["gemm"] for g in lt["details"]["gemms"])
    assert meta["host_cost"]["plan_run_us"] > 0
    assert all("details" not in r for r in rows if r["provider"] != "lt")


def test_time_turns_alternates_the_order_and_keeps_the_best(monkeypatch):
    """attn_lt.testing.time_turns: every other turn in the reverse order, the best median a call, None out of memory."""
    import torch

    from attn_lt import testing

    order, ms = [], {"a": iter([3.0, 2.0]), "b": iter([1.0, 4.0])}

    def fake_time_ms(fn, warmup_ms, rep_ms):
        name = fn()
        order.append(name)
        if name == "c":
            raise torch.OutOfMemoryError("out of memory")
        return next(ms[name])

    monkeypatch.setattr(testing, "time_ms", fake_time_ms)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    best = testing.time_turns({n: (lambda n=n: n) for n in "abc"}, turns=2)
    assert order == ["a", "b", "c", "c", "b", "a"]
    assert best == {"a": 2.0, "b": 1.0, "c": None}


def test_time_interleaved_shuffles_the_calls_and_takes_medians(monkeypatch):
    """attn_lt.testing.time_interleaved: every call once a round (as many rounds as the warm-up's times give
    rep_ms, at least 5) in shuffled orders, each after a pause and an L2 flush and between its own events; medians;
    None for a call that ran out of memory (on a simulated GPU clock)."""
    import torch

    from attn_lt import testing

    clock, order, before = [0.0], [], []

    costs = {"a": iter([5.0, 2.0] + [1.0, 2.0, 9.0, 3.0, 2.0] + [2.0] * 100), "b": iter([7.0] * 200)}

    def call(name):
        def fn():
            if name == "c":
                raise torch.OutOfMemoryError("out of memory")
            order.append(name)
            before.append(name)
            clock[0] += next(costs[name])
        return fn

    monkeypatch.setattr(torch.cuda, "Event", simulated_event(clock))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: before.append("pause"))
    monkeypatch.setattr(testing, "l2_flusher", lambda mode, mib: lambda: before.append(f"flush {mode} {mib}"))
    got = testing.time_interleaved({n: call(n) for n in "abc"}, warmup_ms=0, rep_ms=40)
    assert got["c"] is None and got["b"] == 7.0
    assert got["a"] == 2.0  # the median of 1, 2, 9, 3, 2: 5 rounds (40 ms over the warm-up's 2 + 7)
    timed = order[4:]  # after the first call of each and the warm-up's timed one
    assert sorted(timed) == ["a"] * 5 + ["b"] * 5
    assert any(timed[i] == "b" for i in range(0, 10, 2))  # not always the same order
    assert before[4:7] == ["pause", "flush read 256", timed[0]]  # a pause and a flush before each timed call


def test_protocol_command_line_and_cases(tmp_path, monkeypatch):
    """The FA3-protocol benchmarks' shared command line: cases in order (head dims, lengths, causal), no GPU said
    before any directory is made."""
    import bench_flash_sm90 as fa3

    ap = fa3.protocol_parser("doc", "x.json", "64,128", "512,4096")
    a = ap.parse_args(["--out", str(tmp_path / "o"), "--causal", "1,0"])
    assert fa3.protocol_cases(a) == [(64, 512, True), (64, 512, False), (64, 4096, True), (64, 4096, False),
                                     (128, 512, True), (128, 512, False), (128, 4096, True), (128, 4096, False)]
    monkeypatch.setattr(fa3.torch.cuda, "is_available", lambda: False)
    assert fa3.protocol_start(ap, ["--out", str(tmp_path / "o")], "t") is None
    assert not (tmp_path / "o").exists()


def experiment(name: str):
    """tools/experiments/<name>.py, imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_library_ab_wants_the_other_build_and_says_when_no_gpu(tmp_path, monkeypatch, capsys):
    """tools/experiments/ab_library.py: --other is required; without a GPU it says so and returns 2, making no
    directory."""
    ab = experiment("ab_library")
    with pytest.raises(SystemExit):
        ab.main(["--out", str(tmp_path / "o")])
    monkeypatch.setattr(ab.torch.cuda, "is_available", lambda: False)
    assert ab.main(["--out", str(tmp_path / "o"), "--other", "/nonexistent/libattn_lt.so"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_decode_blocks_probe_says_when_no_gpu_and_leaves_the_planner(tmp_path, monkeypatch, capsys):
    """tools/experiments/probe_decode_blocks.py: without a GPU it says so and returns 2, writing nothing and leaving
    the planner's least part size as it was."""
    from attn_lt import batch

    probe = experiment("probe_decode_blocks")
    least = batch.SPLIT_MIN_KEYS
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--out", str(tmp_path / "o")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert batch.SPLIT_MIN_KEYS == least


def test_batch_flush_probe_says_when_no_gpu(monkeypatch, capsys):
    """tools/experiments/probe_batch_flush.py: without a GPU it says so on stderr and returns 2."""
    probe = experiment("probe_batch_flush")
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main() == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_protocol_rates_and_line(monkeypatch):
    """A protocol case's TFLOP/s from the timed milliseconds (FA3's count, halved when causal) and its printed line."""
    import bench_flash_sm90 as fa3

    monkeypatch.setattr(fa3, "time_turns", lambda calls, rep_ms: {"a": 1.0, "b": 2.0})
    tf = fa3.protocol_rates({"a": None, "b": None}, 2, 16, 1024, 128, True, 40.0)
    flops = 4 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert tf == pytest.approx({"a": flops / 1e9, "b": flops / 2e9})
    line = fa3.protocol_line(128, 1024, True, tf, [("a", "b")], " same True")
    assert line.startswith("D128 S1024  causal a ") and line.endswith("| a/b 2.000 same True")
