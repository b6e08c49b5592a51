"""The per-shape algorithm cache, on CPU: keys, round trips, environments, export / import (streamed, strict,
hostile input refused with nothing written), the one-time migration of the old algos.json, rows that fail
validation. The store's reliability under concurrency, damage and hostile files: tests/test_cache_reliability.py."""

import json
import logging
import os
import sqlite3

import pytest

from attn_lt.cache import (AlgoCache, AlgoConfig, CacheError, CacheStoreError, Entry, Env, default_cache,
                           key_string, parse_document, parse_key)
from attn_lt.lt.cublaslt import GemmKey

ENV = Env("NVIDIA H200", "9.0", 132, 130100)
OTHER = Env("NVIDIA H100 80GB HBM3", "9.0", 132, 130100)
KEY = GemmKey("pv", "bf16", 128, 4, 131072, 64, False, False, 128, 262144, 128, 16777216, 1048576, 512, 256, 256,
              256)


def entry(ms=0.5, splitk=4):
    return Entry(AlgoConfig(21, tile=18, stages=12, splitk=splitk, reduction=2, swizzle=1), ms, 0.61, 1 << 20,
                 ((AlgoConfig(21), 0.61), (AlgoConfig(6, splitk=8, reduction=4), 0.55)), "2026-11-20T23:00:00+00:00")


def store(tmp_path, name="algos.sqlite"):
    return AlgoCache(tmp_path / name)


# ---- keys ------------------------------------------------------------------------------------------------------

def test_gemm_key_string_is_stable_and_round_trips():
    s = key_string(KEY)
    assert s == "pv|bf16|m128|n4|k131072|b64|NN|ld128,262144,128|st16777216,1048576,512|al256,256,256"
    d = parse_key(s)
    assert isinstance(d, dict) and GemmKey.from_dict(d) == KEY
    assert key_string(KEY.to_dict()) == s  # an object with to_dict() or its dict: the same key
    assert Env.parse(ENV.key()) == ENV


@pytest.mark.parametrize("fields,text", [
    (dict(KEY.to_dict(), cls="decode"), "pv|bf16|m128|n4|k131072|b64|NN|ld128,262144,128|st16777216,1048576,512|"
                                        "al256,256,256|cls=decode"),
    ({"role": "qk", "m": 5, "cls": "pow2", "fold": True}, "cls=pow2|fold=true|m=5|role=qk"),
    ({"role": "pv", "dtype": "fp16", "k_bucket": 65536}, "dtype=fp16|k_bucket=65536|role=pv"),
], ids=["gemm-plus-class", "generic", "bucket"])
def test_other_keys_are_opaque_canonical_strings(fields, text):
    """Shape-class keys (more fields, other fields) fit without a schema change: sorted name=value fields."""
    assert key_string(fields) == text
    assert parse_key(text) == fields


@pytest.mark.parametrize("bad", ["", "qk|bf16", "xx|bf16|m1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1",
                                 "qk|bf16|m-1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1",
                                 "qk|bf16|m1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1;rm -rf /", "a" * 1000,
                                 "qk|bf16|m01|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1",  # not canonical
                                 "role=qk|m=5|cls=x",  # fields not sorted: not canonical
                                 "m=1|m=2", "m=\x1b[2J", "m=1|", "../../etc/passwd",
                                 "qk|bf16|m1|n1|k1|b1|NN|ld1,1,1|st1,1,1|al1,1,1|role=pv"],
                         ids=lambda s: repr(s)[:30])
def test_malformed_keys_rejected(bad):
    with pytest.raises(CacheError):
        parse_key(bad)


@pytest.mark.parametrize("bad", [{}, {"Role": "qk"}, {"m": -1}, {"m": 1 << 60}, {"m": 1.5}, {"s": "a|b"},
                                 {"s": "x=y"}, {"s": "true"}, {"s": "\x1b"}, [1, 2]])
def test_unrepresentable_keys_rejected(bad):
    with pytest.raises(CacheError):
        key_string(bad)


# ---- the store --------------------------------------------------------------------------------------------------

def test_put_get_round_trip_through_the_database(tmp_path):
    c = store(tmp_path)
    assert c.get(ENV, KEY) is None
    assert c.put(ENV, KEY, entry()) is True
    fresh = store(tmp_path)
    assert fresh.get(ENV, KEY) == entry() and fresh.state == "ok" and fresh.count() == 1
    db = sqlite3.connect(tmp_path / "algos.sqlite")
    assert db.execute("SELECT version FROM attn_lt_schema").fetchone() == (1,)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("SELECT env, gemm FROM entries").fetchall() == [(ENV.key(), key_string(KEY))]


def test_entries_are_per_environment(tmp_path):
    c = store(tmp_path)
    c.put(OTHER, KEY, entry(0.9))
    assert c.get(ENV, KEY) is None  # measured on another GPU: never used here
    c.put(ENV, KEY, entry(0.5))
    fresh = store(tmp_path)
    assert fresh.get(ENV, KEY).median_ms == 0.5 and fresh.get(OTHER, KEY).median_ms == 0.9
    assert [e for e, _, _ in fresh.items()] == sorted([ENV.key(), OTHER.key()])
    assert [e for e, _, _ in fresh.items(ENV.key())] == [ENV.key()]
    assert sorted(e for e, _ in fresh.lookup(key_string(KEY))) == sorted([ENV.key(), OTHER.key()])


def test_put_replaces_and_never_raises_for_bad_entries(tmp_path, caplog):
    c = store(tmp_path)
    c.put(ENV, KEY, entry(0.5))
    c.put(ENV, KEY, entry(0.4))
    assert store(tmp_path).get(ENV, KEY).median_ms == 0.4 and c.count() == 1
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert c.put(ENV, KEY, Entry(AlgoConfig(1), float("nan"), None, 0)) is False
        assert c.put(ENV, {"m": -1}, entry()) is False
        assert c.put(ENV, KEY, "not an entry") is False
    assert store(tmp_path).get(ENV, KEY).median_ms == 0.4  # nothing it could not read back was written


def test_clear_remove_export_import(tmp_path):
    c = store(tmp_path)
    c.put(ENV, KEY, entry())
    c.put(OTHER, KEY, entry(0.7))
    assert c.export(tmp_path / "out.json") == 2
    assert c.remove([(OTHER.key(), key_string(KEY))]) == 1
    assert store(tmp_path).get(OTHER, KEY) is None
    assert c.clear() == 1
    assert store(tmp_path).items() == []
    assert c.import_file(tmp_path / "out.json") == 2
    assert store(tmp_path).get(OTHER, KEY).median_ms == 0.7
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_export_is_a_readable_document_one_entry_a_line(tmp_path):
    c = store(tmp_path)
    for n in range(3):
        c.put(ENV, dict(KEY.to_dict(), v=n + 1), entry())
    c.put(OTHER, KEY, entry())
    c.export(tmp_path / "out.json")
    text = (tmp_path / "out.json").read_text()
    doc = json.loads(text)
    assert doc["schema"] == "attn_lt.algo_cache" and doc["version"] == 1
    assert sum(len(v) for v in doc["entries"].values()) == 4
    assert sum('"config"' in line for line in text.splitlines()) == 4  # one entry a line
    assert parse_document(doc)[ENV.key()][key_string(dict(KEY.to_dict(), v=2))] == entry()


def test_import_order_of_fields_does_not_matter_and_version_is_checked_at_the_end(tmp_path):
    c = store(tmp_path)
    body = json.dumps({ENV.key(): {key_string(KEY): entry().to_dict()}})
    (tmp_path / "late.json").write_text(f'{{"entries": {body}, "version": 1, "schema": "attn_lt.algo_cache"}}')
    assert c.import_file(tmp_path / "late.json") == 1
    c.clear()
    (tmp_path / "v2.json").write_text(f'{{"entries": {body}, "schema": "attn_lt.algo_cache", "version": 2}}')
    with pytest.raises(CacheError, match="version 2"):
        c.import_file(tmp_path / "v2.json")
    assert c.count() == 0  # rolled back: the entries read before the version were not kept


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
    "entries-not-object": mutate(lambda d: d.update(entries=[1])),
    "missing-version": mutate(lambda d: d.pop("version")),
    "long-tuned-at": mutate(lambda d: d["entries"][ENV.key()][key_string(KEY)].update(tuned_at="x" * 41)),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_or_malformed_import_rejected_and_nothing_written(tmp_path, name):
    c = store(tmp_path)
    c.put(OTHER, KEY, entry(0.7))
    before = c.items()
    bad = tmp_path / "bad.json"
    good_first = {ENV.key(): {key_string(dict(KEY.to_dict(), v=1)): entry().to_dict()}}
    doc = HOSTILE[name]
    if isinstance(doc.get("entries"), dict):  # a valid entry before the bad one: it must not be kept either
        doc = dict(doc, entries={**good_first, **{k: v for k, v in doc["entries"].items() if k != ENV.key()},
                                 ENV.key(): {**good_first[ENV.key()], **doc["entries"].get(ENV.key(), {})}})
    bad.write_text(json.dumps(doc))
    with pytest.raises(CacheError):
        c.import_file(bad)
    assert store(tmp_path).items() == before


@pytest.mark.parametrize("content", [b"\x80\x81 not json", b"[" * 100000 + b"]" * 100000, b"",
                                     b'{"schema": "attn_lt.algo_cache", "version": 1, "entries": {"x',
                                     b'{"schema": "attn_lt.algo_cache", "version": 1, "entries": {}} trailing',
                                     b'{"schema": "attn_lt.algo_cache", "schema": "attn_lt.algo_cache"}',
                                     b'{"schema": "attn_lt.algo_cache", "version": 1, "entries": {"' + b"e" * 10**6],
                         ids=["binary", "deep", "empty", "truncated", "trailing", "duplicate-field", "huge-name"])
def test_import_rejects_non_json_truncated_and_deep_input(tmp_path, content):
    c = store(tmp_path)
    (tmp_path / "x.json").write_bytes(content)
    with pytest.raises(CacheError):
        c.import_file(tmp_path / "x.json")
    assert c.count() == 0


def test_parse_document_accepts_valid():
    assert parse_document(valid_doc())[ENV.key()][key_string(KEY)] == entry()
    with pytest.raises(CacheError):
        parse_document([1, 2, 3])


def test_default_location_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache().path == tmp_path / "c" / "algos.sqlite"
    monkeypatch.delenv("ATTN_LT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache().path == tmp_path / "x" / "attn_lt" / "algos.sqlite"


def test_policy_setting(monkeypatch):
    from attn_lt import config

    monkeypatch.delenv("ATTN_LT_ALGO_POLICY")
    assert config.algo_policy() == "tune"
    monkeypatch.setenv("ATTN_LT_ALGO_POLICY", "cache")
    assert config.algo_policy() == "cache" and config.algo_policy("heuristic") == "heuristic"
    with pytest.raises(ValueError, match="algo_policy"):
        config.algo_policy("fastest")


# ---- rows that fail validation, the old JSON file ----------------------------------------------------------------

def test_a_bad_row_is_skipped_and_reported_once_never_the_whole_store(tmp_path, caplog):
    c = store(tmp_path)
    for n in range(1, 6):
        c.put(ENV, dict(KEY.to_dict(), v=n), entry())
    c.close()
    db = sqlite3.connect(tmp_path / "algos.sqlite")
    bad = {1: "UPDATE entries SET config = '{\"algo_id\": -1}' WHERE gemm LIKE '%v=1'",
           2: "UPDATE entries SET median_ms = 'fast' WHERE gemm LIKE '%v=2'",
           3: "UPDATE entries SET runners_up = '[[' WHERE gemm LIKE '%v=3'"}
    for sql in bad.values():
        db.execute(sql)
    db.execute("INSERT INTO entries VALUES ('not an env', 'k=1', '{}', 1, 1, 0, '[]', '')")
    db.commit()
    db.close()
    c = store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        items = c.items()
        assert c.get(ENV, dict(KEY.to_dict(), v=1)) is None
        assert c.get(ENV, dict(KEY.to_dict(), v=4)) == entry()
    assert [k.rsplit("=", 1)[1] for _, k, _ in items] == ["4", "5"]
    assert c.skipped_rows >= 4
    assert len([r for r in caplog.records if "fails validation" in r.getMessage()]) == 1
    assert c.put(ENV, dict(KEY.to_dict(), v=1), entry())  # a re-tuned entry replaces the bad row
    assert c.get(ENV, dict(KEY.to_dict(), v=1)) == entry()


def legacy_doc(n=3, bad=0):
    entries = {key_string(dict(KEY.to_dict(), v=i + 1)): entry().to_dict() for i in range(n)}
    for i in range(bad):
        entries[key_string(dict(KEY.to_dict(), v=100 + i))] = dict(entry().to_dict(), median_ms=-1)
    return {"schema": "attn_lt.algo_cache", "version": 1, "entries": {ENV.key(): entries}}


def test_old_algos_json_is_migrated_once_and_renamed(tmp_path, caplog):
    (tmp_path / "algos.json").write_text(json.dumps(legacy_doc(3, bad=2), indent=1))
    with caplog.at_level(logging.INFO, logger="attn_lt"):
        c = store(tmp_path)
        assert c.count() == 3  # read as it is: a read never moves a file
        assert (tmp_path / "algos.json").exists() and not (tmp_path / "algos.sqlite").exists()
        c.put(ENV, KEY, entry())  # the first write migrates it
    assert not (tmp_path / "algos.json").exists() and (tmp_path / "algos.json.migrated").exists()
    assert any("migrated 3 entries" in r.getMessage() and "skipped 2" in r.getMessage() for r in caplog.records)
    assert store(tmp_path).count() == 4  # not migrated again


def test_truncated_old_json_keeps_what_was_read_and_is_set_aside(tmp_path):
    text = json.dumps(legacy_doc(5), indent=1)
    (tmp_path / "algos.json").write_text(text[: int(len(text) * 0.7)])
    c = store(tmp_path)
    assert 1 <= c.count() < 5
    c.put(ENV, KEY, entry())
    assert 2 <= c.count() < 6
    assert not (tmp_path / "algos.json").exists() and list(tmp_path.glob("algos.json.bad-*"))


def test_old_json_is_read_into_memory_when_the_store_is_unusable(tmp_path, caplog):
    (tmp_path / "algos.json").write_text(json.dumps(legacy_doc(2)))
    (tmp_path / "algos.sqlite").mkdir()  # a directory where the database should be
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        c = store(tmp_path)
        assert c.state == "memory" and c.count() == 2
        assert c.get(ENV, dict(KEY.to_dict(), v=1)) == entry()
    assert (tmp_path / "algos.json").exists()  # left as it is
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1


def test_store_refuses_to_write_in_memory_mode_and_says_so(tmp_path):
    (tmp_path / "algos.sqlite").mkdir()
    c = store(tmp_path)
    assert c.put(ENV, KEY, entry()) is False and c.get(ENV, KEY) == entry() and c.unsaved() == 1
    with pytest.raises(CacheStoreError, match="nothing was removed"):
        c.clear()
    (tmp_path / "in.json").write_text(json.dumps(valid_doc()))
    with pytest.raises(CacheStoreError, match="nothing was imported"):
        c.import_file(tmp_path / "in.json")


# ---- the calibration file beside the cache: read and written, never fatal ---------------------------------------

@pytest.mark.parametrize("make", [
    lambda p: os.mkfifo(p), lambda p: os.symlink("/dev/zero", p), lambda p: os.symlink(p, p), lambda p: p.mkdir(),
    lambda p: p.write_bytes(b"\xff\xfe garbage"), lambda p: p.write_text("[1, 2]"),
    lambda p: p.write_text('{"schema": "attn_lt.calibration", "thresholds": {"e": ' + "[" * 50000 + "]" * 50000 + "}}"),
    lambda p: p.write_bytes(b" " * (2 << 20)),
], ids=["fifo", "dev-zero", "symlink-loop", "directory", "garbage", "not-an-object", "deep", "huge"])
def test_calibration_file_is_never_fatal(tmp_path, monkeypatch, caplog, make):
    from attn_lt import calibrate

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    make(tmp_path / "calibration.json")
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert calibrate.read()["thresholds"] == {}
    assert len(caplog.records) == 1
    where = calibrate.store("env", 8192, [])
    if where is not None:  # replaced by a proper file (the old entry is gone, not followed)
        assert calibrate.read(where)["thresholds"]["env"]["threshold"] == 8192
    assert not list(tmp_path.glob("calibration.json.*.tmp"))


def test_calibration_store_reports_an_unwritable_place(tmp_path, monkeypatch, caplog):
    from attn_lt import calibrate

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "file"))
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        assert calibrate.store("env", 8192, []) is None
    assert any("could not store the calibration" in r.getMessage() for r in caplog.records)
