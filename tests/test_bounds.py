"""Issue 42: every command bounded in time and memory, no tuned entry lost under contention, read-only commands
that only read, exit codes that match what happened. CPU only; each test a few seconds at most."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from attn_lt import cache as cache_mod
from attn_lt.cache import AlgoCache, CacheStoreError
from attn_lt.cli import main
from test_cache_reliability import ENV, entry, integrity, key, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli(*argv, env=None, **kw):
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "attn_lt", *argv], capture_output=True, text=True, env=e,
                          timeout=120, **kw)


def fill(path, n, w=0):
    c = AlgoCache(path)
    rows = [cache_mod._row(ENV.key(), cache_mod.key_string(key(w, i)), entry(i)) for i in range(n)]
    c._transact(lambda db: db.executemany(cache_mod._INSERT, rows), "stored")
    c.close()


# ---- 1. bounds -------------------------------------------------------------------------------------------------

def test_help_starts_without_torch():
    code = textwrap.dedent("""
        import sys
        import attn_lt.cli
        for argv in (["--help"], ["cache", "--help"], ["explain", "--help"]):
            try:
                attn_lt.cli.main(argv)
            except SystemExit:
                pass
        print("torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"  # after the three help texts


def test_explain_chunks_are_paged_and_streamed(capsys):
    code, out, _ = run(capsys, "explain", "-s", "10000000", "--causal", "--chunks", "5", "--json")
    d = json.loads(out)
    assert code == 0 and len(d["plan"]["chunks"]) == 5 and d["plan"]["n_chunks"] > 100000
    assert d["plan"]["chunks_omitted"] == d["plan"]["n_chunks"] - 5
    code, out, _ = run(capsys, "explain", "-s", "10000000", "--chunks")
    assert code == 0 and out.count("key tile)\n") == 1000 and "more chunks (--chunks N lists N" in out
    code, out, _ = run(capsys, "explain", "-s", "8192", "--workspace-mb", "64", "--chunks", "all", "--json")
    d = json.loads(out)
    assert code == 0 and len(d["plan"]["chunks"]) == d["plan"]["n_chunks"] > 4 and d["plan"]["chunks_omitted"] == 0


def test_plans_are_counted_in_closed_form():
    import importlib

    from attn_lt.validate import Case

    plan = importlib.import_module("attn_lt.chunks")
    t0 = time.perf_counter()
    p = plan.plan_chunks(Case.contiguous(1, 1, 1, 2**31 - 1, 2**31 - 1, 128, "bf16", True))
    assert p.n_chunks > 10**10 and time.perf_counter() - t0 < 2
    for causal in (True, False):  # the counts agree with the chunks listed one by one
        for budget in (16 << 20, 256 << 20):
            p = plan.plan_chunks(Case.contiguous(2, 4, 2, 70000, 90000, 128, "bf16", causal), budget)
            listed = {}
            for c in p.iter_chunks():
                k = (c.s1 - c.s0, c.ne, c.keys, c.tile)
                listed[k] = listed.get(k, 0) + 1
            assert listed == {k: n for k, (_, n) in p.shapes().items()}


def test_lengths_no_gpu_could_hold_are_refused(capsys):
    import torch

    import attn_lt

    t0 = time.perf_counter()
    code, _, err = run(capsys, "explain", "-s", "10000000000000")
    assert code == 2 and "at most 2**31 - 1" in err
    code, _, err = run(capsys, "explain", "--sq", "1", "--sk", str(2**30), "-H", "8")  # K: 2 TiB
    assert code == 2 and "k would take" in err and "2**40" in err
    q = torch.empty(1, 1, 2**40, 128, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 2"):
        attn_lt.explain(q, q, q)
    k = torch.empty(1, 1, 2**40, 128, device="meta", dtype=torch.bfloat16)  # Sk = 2**40 decode
    with pytest.raises(ValueError, match="Sk = 1099511627776"):
        attn_lt.explain(q[:, :, :1], k, k)
    assert time.perf_counter() - t0 < 5


def test_cache_list_streams_rows(capsys, tmp_path, monkeypatch):
    import tracemalloc

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    fill(tmp_path / "algos.sqlite", 20000)
    tracemalloc.start()
    code, out, _ = run(capsys, "cache", "list", "--json")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    d = json.loads(out)
    assert code == 0 and len(d["entries"]) == 20000 and d["skipped_rows"] == 0 and d["state"] == "ok"
    assert peak - len(out) * 2 < 8 << 20, peak  # the output captured, plus little: rows are not held
    code, out, _ = run(capsys, "cache", "list")
    assert code == 0 and "20000 entries" in out and len(out.splitlines()) == 20002


# ---- 2. writes that wait their turn ----------------------------------------------------------------------------

def test_tuners_writing_during_imports_lose_nothing(tmp_path):
    path = tmp_path / "algos.sqlite"
    fill(path, 3)
    srcs = []
    for n in range(2):
        srcs.append(tmp_path / f"in{n}.json")
        with open(srcs[-1], "w") as f:
            cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(100 + n, i)), entry(i, runners=4))
                                         for i in range(6000)))
    importers = [worker("""
        c = cache.AlgoCache(sys.argv[1]); print(c.import_file(sys.argv[2]))
    """, path, src) for src in srcs]
    time.sleep(0.2)
    tuners = [worker("""
        import time
        c = cache.AlgoCache(sys.argv[1]); w = int(sys.argv[2])
        for i in range(50):
            c.put(ENV, key(w, i), entry(i)); time.sleep(0.005)
    """, path, w) for w in range(4)]
    outs = [p.communicate(timeout=120) for p in importers + tuners]
    assert all(p.returncode == 0 for p in importers + tuners), [o[1][-300:] for o in outs]
    assert [int(o[0]) for o in outs[:2]] == [6000, 6000]  # concurrent imports take turns, both complete
    got = {(cache_mod.parse_key(k)["w"], cache_mod.parse_key(k)["i"]) for _, k, _ in AlgoCache(path).items()}
    lost = sum((w, i) not in got for w in range(4) for i in range(50))
    assert lost == 0 and integrity(path) == ("ok", 12000 + 200)  # the 3 filled first are among the tuners' keys


def test_an_entry_a_busy_store_kept_is_written_before_exit(tmp_path):
    path = tmp_path / "algos.sqlite"
    fill(path, 3)
    holder = sqlite3.connect(path, isolation_level=None)  # this process holds the write lock
    holder.execute("BEGIN IMMEDIATE")
    p = worker("""
        c = cache.AlgoCache(sys.argv[1], busy_timeout_ms=200)
        print(c.put(ENV, key(9, 1), entry(1)), c.unsaved(), flush=True)
        sys.stdin.readline()
    """, path, stdin=subprocess.PIPE)
    assert p.stdout.readline().split() == ["False", "1"]
    holder.execute("ROLLBACK")
    holder.close()
    p.communicate("\n", timeout=60)
    assert AlgoCache(path).get(ENV, key(9, 1)) == entry(1)  # written at exit


def test_import_stopped_midway_says_how_far_it_got(tmp_path, monkeypatch):
    c = AlgoCache(tmp_path / "algos.sqlite")
    src = tmp_path / "in.json"
    with open(src, "w") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(5, i)), entry(i)) for i in range(2500)))
    real, calls = c._transact, []

    def flaky(fn, what, wait_s=0.0):
        calls.append(what)
        if len(calls) == 3:  # the second batch
            raise CacheStoreError("the algorithm cache could not be written (database is locked); nothing was "
                                  "imported")
        return real(fn, what, wait_s)

    monkeypatch.setattr(c, "_transact", flaky)
    with pytest.raises(cache_mod.ImportIncomplete, match="1000 of 2500 entries were imported before the store "
                                                         "could not be written") as e:
        c.import_file(src)
    assert e.value.imported == 1000 and AlgoCache(tmp_path / "algos.sqlite").count() == 1000


def test_an_entry_a_busy_store_kept_is_written_on_close(tmp_path):
    path = tmp_path / "algos.sqlite"
    fill(path, 3)
    c = AlgoCache(path, busy_timeout_ms=100)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    assert c.put(ENV, key(9, 2), entry(2)) is False and c.unsaved() == 1
    db.execute("ROLLBACK")
    db.close()
    c.close()
    assert AlgoCache(path).get(ENV, key(9, 2)) == entry(2)


# ---- 3. space and exit codes -----------------------------------------------------------------------------------

def test_clear_gives_the_space_back(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    path = tmp_path / "algos.sqlite"
    fill(path, 30000)
    before = os.path.getsize(path)
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and "removed 30000 entries" in out
    assert os.path.getsize(path) < 64 << 10 < before and integrity(path) == ("ok", 0)


def test_clear_removes_an_old_json_store_too(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    with open(tmp_path / cache_mod.LEGACY_FILE, "w") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(4, i)), entry(i)) for i in range(3)))
    assert AlgoCache(tmp_path / "algos.sqlite").count() == 3
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and AlgoCache(tmp_path / "algos.sqlite").count() == 0


def test_readers_of_an_absent_store_in_a_directory_they_cannot_write(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if mode & os.W_OK else real_access(p, mode, **kw))
    code, out, err = run(capsys, "cache", "list")
    assert code == 0 and "0 entries" in out and "memory" not in err
    code, out, err = run(capsys, "cache", "export", str(tmp_path / "out.json"))
    assert code == 0 and "exported 0 entries" in out + err
    assert not (tmp_path / "cache").exists()


def test_clear_on_a_full_disk_removes_the_file(tmp_path, monkeypatch):
    path = tmp_path / "algos.sqlite"
    fill(path, 500)
    other = AlgoCache(path)
    assert other.count() == 500
    c = AlgoCache(path)
    real = c._transact

    def full(fn, what, wait_s=0.0):
        if what == "removed":
            e = CacheStoreError("database or disk is full; nothing was removed")
            e.busy, e.full = False, True
            raise e
        return real(fn, what, wait_s)

    monkeypatch.setattr(c, "_transact", full)
    assert c.clear() == 500 and not path.exists()
    assert other.count() == 0 and other.put(ENV, key(1, 1), entry(1))  # the other process sees the new store
    assert AlgoCache(path).count() == 1


def test_export_of_an_unreadable_store_exits_1(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    fill(tmp_path / "algos.sqlite", 3)
    db = sqlite3.connect(tmp_path / "algos.sqlite")
    db.execute("UPDATE attn_lt_schema SET version = 99")
    db.commit()
    db.close()
    code, out, err = run(capsys, "cache", "export", str(tmp_path / "o.json"))
    assert code == 1 and "nothing was exported" in err and "newer attn_lt" in err
    assert not (tmp_path / "o.json").exists()
    code, out, err = run(capsys, "cache", "export", "-")
    assert code == 1 and out == ""


def test_stale_partial_files_are_cleaned_and_sigterm_leaves_none(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"o.json.partial-{dead.pid}"
    stale.write_text("{")
    live = tmp_path / f"o.json.partial-{os.getppid()}"  # a running process's export is never touched
    live.write_text("{")
    c = AlgoCache(tmp_path / "algos.sqlite")
    c.put(ENV, key(0, 0), entry(0))
    assert c.export(tmp_path / "o.json") == 1
    assert not stale.exists() and live.exists()


def test_export_to_a_closed_pipe_is_quiet(tmp_path):
    fill(tmp_path / "algos.sqlite", 20000)
    r = subprocess.run(f"{sys.executable} -m attn_lt cache export - | head -c 100 >/dev/null", shell=True,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, ATTN_LT_CACHE_DIR=str(tmp_path)))
    assert r.stderr == "", r.stderr


# ---- 4. read-only commands only read ---------------------------------------------------------------------------

def test_read_only_commands_create_and_move_nothing(capsys, tmp_path, monkeypatch):
    import torch

    import attn_lt

    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path / "cache"))
    for argv in (["info"], ["cache", "list"], ["cache", "list", "--json"], ["cache", "show", "m=1|role=qk"],
                 ["explain", "-s", "65536"]):
        run(capsys, *argv)
    q = torch.empty(1, 8, 65536, 128, device="meta", dtype=torch.bfloat16)
    attn_lt.explain(q, q, q, algo_policy="tune")
    cache_mod.default_cache().close()
    assert not (tmp_path / "cache").exists()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "algos.sqlite").write_bytes(os.urandom(8192))  # damaged: reported, left alone
    for argv in (["info"], ["cache", "list"], ["explain", "-s", "65536"]):
        code, out, err = run(capsys, *argv)
        assert code in (0, 1) and "moved" not in err
    code, out, _ = run(capsys, "info", "--json")
    assert json.loads(out)["cache_state"] == "damaged"
    attn_lt.explain(q, q, q, algo_policy="tune")
    cache_mod.default_cache().close()
    assert os.listdir(tmp_path / "cache") == ["algos.sqlite"]


# ---- 5. the smaller ones ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["info"], ["cache", "list", "--json"]])
def test_output_to_a_full_device_is_one_clear_line(tmp_path, argv):
    fill(tmp_path / "algos.sqlite", 200)
    with open("/dev/full", "w") as full:
        r = cli(*argv, env={"ATTN_LT_CACHE_DIR": str(tmp_path)}, stdout=full, stderr=subprocess.PIPE) \
            if False else subprocess.run([sys.executable, "-m", "attn_lt", *argv], stdout=full,
                                         stderr=subprocess.PIPE, text=True, timeout=120,
                                         env=dict(os.environ, PYTHONPATH=ROOT, ATTN_LT_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 1 and "could not write to standard output: No space left on device" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "unexpected" not in r.stderr


def test_import_of_a_huge_integer_and_of_a_bom_file(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_LT_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "big.json"
    bad.write_text('{"schema": "attn_lt.algo_cache", "version": ' + "9" * 5000 + ', "entries": {}}')
    code, _, err = run(capsys, "cache", "import", str(bad))
    assert code == 2 and "too many digits" in err and "Exceeds the limit" not in err and "nothing was imported" in err
    doc = tmp_path / "bom.json"
    with open(doc, "w", encoding="utf-8-sig") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(1, i)), entry(i)) for i in range(3)))
    code, out, err = run(capsys, "cache", "import", str(doc))
    assert code == 0 and "imported 3 entries" in out, err


@pytest.mark.parametrize("scale", [1e300, 1e-320, 3.5e38])
def test_scale_is_checked_as_float32(scale):
    import torch

    import attn_lt
    from attn_lt.validate import Case, check_scale

    with pytest.raises(ValueError, match="float32"):
        check_scale(scale)
    with pytest.raises(ValueError, match="float32"):
        Case.contiguous(1, 1, 1, 16, 16, 64, scale=scale)
    q = torch.empty(1, 1, 16, 64, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        attn_lt.explain(q, q, q, scale=scale)
    assert check_scale(1e-40) == 1e-40 and check_scale(3e38) == 3e38  # subnormal and near-max float32 pass


def test_distributed_mismatches_name_dtypes(monkeypatch):
    import torch

    from attn_lt import distributed as cp  # white-box: _agree without a process group

    rows = [[0] * len(cp._FIELDS) for _ in range(3)]
    i = cp._FIELDS.index("dtype")
    rows[0][i], rows[1][i], rows[2][i] = 1, 0, 0

    def all_gather(got, t, group=None):
        for g, r in zip(got, rows):
            g.copy_(torch.tensor(r))

    monkeypatch.setattr(cp.dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(cp.dist, "all_gather", all_gather)
    with pytest.raises(ValueError) as e:
        cp._agree(None, "cpu", rows[0], None)
    msg = str(e.value)
    assert "disagree on dtype" in msg and "rank 0: torch.bfloat16" in msg and "rank 1: torch.float16" in msg
    assert "[1, 0, 0]" not in msg
