"""The per-shape algorithm cache, on CPU: key stability, round trips, environments, bad files, concurrent writers,
a full disk, and hostile imports."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from attn_lt.cache import (AlgoCache, AlgoConfig, CacheError, Entry, Env, default_cache, key_string, parse_document,
                           parse_key)
from attn_lt.lt.cublaslt import GemmKey

ENV = Env("NVIDIA H200", "9.0", 132, 130100)
OTHER = Env("NVIDIA H100 80GB HBM3", "9.0", 132, 130100)
KEY = GemmKey("pv", "bf16", 128, 4, 131072, 64, False, False, 128, 262144, 128, 16777216, 1048576, 512, 256, 256,
              256)


def entry(ms=0.5, splitk=4):
    return Entry(AlgoConfig(21, tile=18, stages=12, splitk=splitk, reduction=2, swizzle=1), ms, 0.61, 1 << 20,
                 ((AlgoConfig(21), 0.61), (AlgoConfig(6, splitk=8, reduction=4), 0.55)), "2026-11-20T23:00:00+00:00")


def test_key_string_is_stable_and_round_trips():
    s = key_string(KEY)
    assert s == ("pv|bf16|m128|n4|k131072|b64|NN|ld128,262144,128|st16777216,1048576,512|al256,256,256")
    assert parse_key(s) == KEY
    assert Env.parse(ENV.key()) == ENV


@pytest.mark.parametrize("bad", ["", "qk|bf16", "xx|bf16|m1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1",
                                 "qk|bf16|m-1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1",
                                 "qk|bf16|m1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1;rm -rf /", "a" * 1000])
def test_malformed_keys_rejected(bad):
    with pytest.raises(CacheError):
        parse_key(bad)


def test_put_get_round_trip_through_the_file(tmp_path):
    c = AlgoCache(tmp_path / "algos.json")
    assert c.get(ENV, KEY) is None
    assert c.put(ENV, KEY, entry())
    fresh = AlgoCache(tmp_path / "algos.json")
    assert fresh.get(ENV, KEY) == entry()
    doc = json.loads((tmp_path / "algos.json").read_text())
    assert doc["schema"] == "attn_lt.algo_cache" and doc["version"] == 1


def test_entries_are_per_environment(tmp_path):
    c = AlgoCache(tmp_path / "algos.json")
    c.put(OTHER, KEY, entry(0.9))
    assert c.get(ENV, KEY) is None  # measured on another GPU: never used here
    c.put(ENV, KEY, entry(0.5))
    fresh = AlgoCache(tmp_path / "algos.json")
    assert fresh.get(ENV, KEY).median_ms == 0.5 and fresh.get(OTHER, KEY).median_ms == 0.9


@pytest.mark.parametrize("content", [b"\x00\xffgarbage", b'{"schema": "attn_lt.algo_cache", "version": 1, "entr',
                                     json.dumps({"schema": "attn_lt.algo_cache", "version": 2, "entries": {}}).encode(),
                                     json.dumps({"schema": "something.else", "version": 1}).encode(), b"[1, 2, 3]"],
                         ids=["garbage", "truncated", "future-version", "foreign-schema", "not-an-object"])
def test_bad_file_is_reported_once_set_aside_and_rebuilt(tmp_path, caplog, content):
    path = tmp_path / "algos.json"
    path.write_bytes(content)
    c = AlgoCache(path)
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert c.get(ENV, KEY) is None
        assert c.get(ENV, KEY) is None
    warnings = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 1
    aside = list(tmp_path.glob("algos.json.bad-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content  # nothing is lost
    assert c.put(ENV, KEY, entry())
    assert AlgoCache(path).get(ENV, KEY) == entry()


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "algos.json"
    script = textwrap.dedent(f"""
        import sys
        from attn_lt.cache import AlgoCache, AlgoConfig, Entry, Env
        from attn_lt.lt.cublaslt import GemmKey
        w = int(sys.argv[1])
        c = AlgoCache({str(path)!r})
        env = Env("NVIDIA H200", "9.0", 132, 130100)
        for i in range(25):
            key = GemmKey("qk", "bf16", 1000 * w + i, 8, 128, 1, True, False, 128, 128, 1024, 0, 0, 0, 256, 256, 256)
            c.put(env, key, Entry(AlgoConfig(w, splitk=1 + i % 4), 0.1 + i, None, 0, (), ""))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(w)], cwd=os.getcwd()) for w in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    fresh = AlgoCache(path)
    assert len(fresh.items()) == 100


def test_full_disk_keeps_entries_in_memory_and_reports_once(tmp_path, caplog, monkeypatch):
    c = AlgoCache(tmp_path / "algos.json")

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert c.put(ENV, KEY, entry()) is False
        assert c.put(OTHER, KEY, entry()) is False
    assert [r.getMessage() for r in caplog.records].count(next(
        r.getMessage() for r in caplog.records if "cannot write" in r.getMessage())) == 1
    assert c.get(ENV, KEY) == entry() and c.get(OTHER, KEY) == entry()
    assert not list(tmp_path.glob("*.tmp"))  # no half-written temporary files left behind


def test_clear_remove_export_import(tmp_path):
    c = AlgoCache(tmp_path / "a.json")
    c.put(ENV, KEY, entry())
    c.put(OTHER, KEY, entry(0.7))
    assert c.export(tmp_path / "out.json") == 2
    c.remove([(OTHER.key(), key_string(KEY))])
    assert AlgoCache(tmp_path / "a.json").get(OTHER, KEY) is None
    c.clear()
    assert AlgoCache(tmp_path / "a.json").items() == []
    assert c.import_file(tmp_path / "out.json") == 2
    assert AlgoCache(tmp_path / "a.json").get(OTHER, KEY).median_ms == 0.7


def valid_doc():
    return {"schema": "attn_lt.algo_cache", "version": 1,
            "entries": {ENV.key(): {key_string(KEY): entry().to_dict()}}}


def mutate(fn):
    d = valid_doc()
    fn(d)
    return d


HOSTILE = {
    "extra-top-field": mutate(lambda d: d.update(code="__import__('os')")),
    "extra-entry-field": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)].update(exec="x")),
    "negative-int": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)]["config"].update(splitk=-1)),
    "huge-int": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)].update(workspace=1 << 60)),
    "string-int": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)]["config"].update(tile="7")),
    "bool-int": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)]["config"].update(tile=True)),
    "nan-time": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)].update(median_ms=float("nan"))),
    "bad-key": mutate(lambda d: d["entries"][ENV.key()].update({"../../etc/passwd": entry().to_dict()})),
    "bad-env": mutate(lambda d: d["entries"].update({"anything": {}})),
    "too-many-runners": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)].update(
        runners_up=[[AlgoConfig(1).__dict__, 1.0]] * 9)),
    "entry-not-object": mutate(lambda d: d["entries"][ENV.key()].update({key_string(KEY): [1, 2]})),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_or_malformed_import_rejected_and_nothing_written(tmp_path, name):
    c = AlgoCache(tmp_path / "a.json")
    c.put(OTHER, KEY, entry(0.7))
    before = (tmp_path / "a.json").read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(HOSTILE[name]))
    with pytest.raises(CacheError):
        c.import_file(bad)
    assert (tmp_path / "a.json").read_bytes() == before


def test_import_rejects_non_json_and_deep_nesting(tmp_path):
    c = AlgoCache(tmp_path / "a.json")
    (tmp_path / "x.json").write_bytes(b"\x80\x81 not json")
    with pytest.raises(CacheError):
        c.import_file(tmp_path / "x.json")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CacheError):
        c.import_file(tmp_path / "deep.json")


def test_parse_document_accepts_valid():
    assert parse_document(valid_doc())[ENV.key()][key_string(KEY)] == entry()


def test_default_location_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache().path == tmp_path / "c" / "algos.json"
    monkeypatch.delenv("ATTN_LT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache().path == tmp_path / "x" / "attn_lt" / "algos.json"


def test_policy_setting(monkeypatch):
    from attn_lt import config

    monkeypatch.delenv("ATTN_LT_ALGO_POLICY")
    assert config.algo_policy() == "tune"
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "cache")
    assert config.algo_policy() == "cache" and config.algo_policy("heuristic") == "heuristic"
    with pytest.raises(ValueError, match="algo_policy"):
        config.algo_policy("fastest")
