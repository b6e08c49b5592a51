"""The algorithm cache as fleets use it, on CPU: many processes at once, a million entries, every kind of damaged or
hostile file where the store or an import should be, a locked, read-only, unreadable or full store, and kill -9 in
the middle of writes. Run with ``-s`` to see the figures (entries lost, write and read times).

Worker processes load ``attn_lt/cache.py`` on its own (it needs only the standard library), so that a worker starts
in milliseconds instead of importing torch. Where the test runs as root (CI does), "another user" is a forked child
that drops to uid 65534, so that file permissions mean something.
"""

import json
import logging
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from attn_lt import cache as cache_mod
from attn_lt.cache import AlgoCache, AlgoConfig, CacheError, CacheStoreError, Entry, Env

ENV = Env("NVIDIA H200", "9.0", 132, 130100)
FIGURES: dict = {}

PRELUDE = textwrap.dedent(f"""
    import importlib.util, json, logging, os, signal, sys, time
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    spec = importlib.util.spec_from_file_location("attn_lt_cache", {cache_mod.__file__!r})
    cache = importlib.util.module_from_spec(spec)
    sys.modules["attn_lt_cache"] = cache
    spec.loader.exec_module(cache)
    ENV = cache.Env("NVIDIA H200", "9.0", 132, 130100)
    def entry(i):
        return cache.Entry(cache.AlgoConfig(21, splitk=1 + i % 4), 0.1 + i % 100, 0.2, 0, (), "2026-11-22T00:00:00+00:00")
    def key(w, i):
        return {{"role": "qk", "w": w, "i": i}}
""")


def entry(i=0, runners=0):
    return Entry(AlgoConfig(21, splitk=1 + i % 4), 0.1 + i % 100, 0.2, 0,
                 tuple((AlgoConfig(6 + r, tile=18, stages=12, splitk=2, reduction=1), 0.3) for r in range(runners)),
                 "2026-11-22T00:00:00+00:00")


def key(w, i):
    return {"role": "qk", "w": w, "i": i}


def worker(code: str, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "attn_lt" and r.levelno >= logging.WARNING]


def integrity(path) -> tuple[str, int]:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0], db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    finally:
        db.close()


def as_other_user(fn):
    """Run ``fn()`` in a forked child; as uid/gid 65534 when we are root (so that permissions apply). Returns what
    ``fn`` returned (JSON), or skips when the child cannot drop privileges."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            out = {"result": fn()}
        except BaseException as e:  # report, never raise out of the child
            out = {"error": f"{type(e).__name__}: {e}"}
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data or '{"error": "no answer"}')
    if "error" in out:
        if "setuid" in out["error"] or "Operation not permitted" in out["error"]:
            pytest.skip(f"cannot run as another user here: {out['error']}")
        raise AssertionError(out["error"])
    return out["result"]


@pytest.fixture
def shared_dir():
    """A directory another user can traverse (pytest's tmp_path is private to its owner)."""
    d = tempfile.mkdtemp(prefix="attn_lt_cache_")
    os.chmod(d, 0o755)
    yield Path(d)
    for root, dirs, files in os.walk(d, topdown=False):
        for n in dirs:
            os.chmod(os.path.join(root, n), 0o755)
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\n== algorithm cache reliability figures ==")
        for k, v in FIGURES.items():
            print(f"  {k}: {v}")


# ---- many processes --------------------------------------------------------------------------------------------

def test_concurrent_writers_lose_nothing(tmp_path):
    n_proc, n_each = 8, 250
    path = tmp_path / "algos.sqlite"
    code = """
        w = int(sys.argv[1]); c = cache.AlgoCache(sys.argv[2]); ok = 0
        for i in range(int(sys.argv[3])):
            ok += c.put(ENV, key(w, i), entry(i))
            if i % 50 == 0:
                assert c.get(ENV, key(w, i)) is not None
        print(ok)
    """
    t0 = time.perf_counter()
    procs = [worker(code, w, path, n_each) for w in range(n_proc)]
    outs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.perf_counter() - t0
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    acknowledged = sum(int(o[0]) for o in outs)
    stored = {(k["w"], k["i"]) for k in (cache_mod.parse_key(k) for _, k, _ in AlgoCache(path).items())}
    lost = n_proc * n_each - len(stored)
    FIGURES["concurrent writers"] = (f"{n_proc} processes x {n_each} entries: {len(stored)} stored, {lost} lost, "
                                     f"{acknowledged} acknowledged, {elapsed:.1f} s")
    assert acknowledged == n_proc * n_each and lost == 0, [o[1][-300:] for o in outs]
    assert integrity(path) == ("ok", n_proc * n_each)


def test_clear_is_for_good_while_another_process_runs(tmp_path):
    path = tmp_path / "algos.sqlite"
    p = worker("""
        c = cache.AlgoCache(sys.argv[1])
        for i in range(100): c.put(ENV, key(0, i), entry(i))
        print("first", flush=True)
        sys.stdin.readline()
        for i in range(10): c.put(ENV, key(1, i), entry(i))
        print("second", flush=True)
    """, path, stdin=subprocess.PIPE)
    assert p.stdout.readline().strip() == "first"
    assert AlgoCache(path).clear() == 100
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "second"
    p.wait(timeout=30)
    left = {cache_mod.parse_key(k)["w"] for _, k, _ in AlgoCache(path).items()}
    assert left == {1} and AlgoCache(path).count() == 10  # the cleared 100 did not come back


# ---- a million entries -----------------------------------------------------------------------------------------

def _time_ops(c: AlgoCache, w: int, n: int, rounds: int = 3) -> tuple[float, float]:
    """(ms a put, ms a get): the best of ``rounds`` rounds of ``n`` new entries each (the machine is shared)."""
    puts, gets = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(r * n, (r + 1) * n):
            assert c.put(ENV, key(w, i), entry(i))
        t1 = time.perf_counter()
        for i in range(r * n, (r + 1) * n):
            assert c.get(ENV, key(w, i)) is not None
        puts.append((t1 - t0) / n * 1e3)
        gets.append((time.perf_counter() - t1) / n * 1e3)
    return min(puts), min(gets)


def test_a_million_entries_cost_the_same_per_write(tmp_path):
    big = int(os.environ.get("ATTN_LT_TEST_BIG", "1000000"))
    small = AlgoCache(tmp_path / "small" / "algos.sqlite")
    for i in range(1000):
        small.put(ENV, key(9, i), entry(i))
    w_small, r_small = _time_ops(small, 1, 300)

    path = tmp_path / "big" / "algos.sqlite"
    c = AlgoCache(path)
    assert c.state == "ok" and not path.exists()  # reading creates nothing
    assert c.put(ENV, key(2, 0), entry(0)) and c.remove([(ENV.key(), cache_mod.key_string(key(2, 0)))]) == 1
    c.close()
    e = entry(0).to_dict()  # rows like the ones put() writes below
    cfg, runners = json.dumps(e["config"]), json.dumps(e["runners_up"])
    t0 = time.perf_counter()
    db = sqlite3.connect(path, isolation_level=None)  # a fast fill, for the test: no journal while filling
    db.execute("PRAGMA journal_mode = OFF")
    db.execute("PRAGMA synchronous = OFF")
    db.execute("BEGIN")
    db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   ((ENV.key(), f"i={i}|role=qk|w=0", cfg, 0.5, 0.6, 0, runners, "2026-11-22T00:00:00+00:00")
                    for i in sorted(range(big), key=str)))
    db.execute("COMMIT")
    assert db.execute("PRAGMA journal_mode = WAL").fetchone() == ("wal",)
    db.close()
    fill_s = time.perf_counter() - t0
    c = AlgoCache(path)
    t0 = time.perf_counter()
    assert c.count() == big
    count_ms = (time.perf_counter() - t0) * 1e3
    w_big, r_big = _time_ops(c, 1, 300)
    got = c.get(ENV, key(0, big - 1))
    assert (got.config, got.runners_up, got.median_ms) == (Entry.from_dict(e).config, Entry.from_dict(e).runners_up, 0.5)
    FIGURES["write (put) per entry"] = (f"{w_small:.3f} ms at 1k entries, {w_big:.3f} ms at {big:,} entries "
                                        "(best of 3 rounds of 300)")
    FIGURES["read (get) per entry"] = f"{r_small:.3f} ms at 1k entries, {r_big:.3f} ms at {big:,} entries"
    FIGURES["store of a million"] = (f"{big:,} rows filled in {fill_s:.1f} s (one transaction, no journal), "
                                     f"{os.path.getsize(path) / 2**20:.0f} MiB, count {count_ms:.0f} ms")
    assert w_big < 4 * w_small + 2.0 and r_big < 4 * r_small + 2.0  # loosely: no growth with the size


def test_a_large_valid_import_is_kept_and_read_back(tmp_path):
    """The issue's case: a valid file of many entries (60k with four runners-up each is 45 MB: set
    ATTN_LT_TEST_IMPORT=60000; 15k by default, for time) imported into a store that already holds entries, then
    read back by a fresh instance and exported again: nothing is set aside, nothing is lost."""
    n = int(os.environ.get("ATTN_LT_TEST_IMPORT", "15000"))
    c = AlgoCache(tmp_path / "algos.sqlite")
    for i in range(3):
        c.put(ENV, key(7, i), entry(i))
    src = tmp_path / "big.json"
    with open(src, "w") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(8, i)), entry(i, runners=4))
                                     for i in range(n)))
    t0 = time.perf_counter()
    assert c.import_file(src) == n
    import_s = time.perf_counter() - t0
    fresh = AlgoCache(tmp_path / "algos.sqlite")
    assert fresh.count() == n + 3 and fresh.get(ENV, key(7, 2)) is not None
    assert fresh.get(ENV, key(8, n - 1)) == entry(n - 1, runners=4)
    t0 = time.perf_counter()
    assert fresh.export(tmp_path / "again.json") == n + 3
    export_s = time.perf_counter() - t0
    FIGURES["large import"] = (f"{n} entries, {src.stat().st_size / 2**20:.1f} MB: import {import_s:.1f} s, "
                               f"export of {n + 3} {export_s:.1f} s")
    assert not list(tmp_path.glob("*.bad-*"))


# ---- damaged and hostile files where the store should be -----------------------------------------------------------

def _valid_db(path: Path, rows=3000):
    c = AlgoCache(path)
    for i in range(rows):
        c.put(ENV, key(0, i), entry(i))
    c.close()


def _truncate(path: Path, size: int):
    with open(path, "r+b") as f:
        f.truncate(size)


def _newer_schema(path: Path):
    _valid_db(path, 3)
    db = sqlite3.connect(path)
    db.execute("UPDATE attn_lt_schema SET version = 99")
    db.commit()
    db.close()


def _foreign(path: Path, version=None):
    db = sqlite3.connect(path)
    if version is None:
        db.execute("CREATE TABLE notes (x TEXT)")
    else:
        db.execute("CREATE TABLE attn_lt_schema (name TEXT PRIMARY KEY, version INTEGER)")
        db.execute("CREATE TABLE entries (x)")
        db.execute("INSERT INTO attn_lt_schema VALUES ('algo_cache', ?)", (version,))
    db.commit()
    db.close()


# name: (make(dir) -> path of the store, expected state after use, set aside?)
HOSTILE_STORES = {
    "random-bytes": (lambda d: (d / "algos.sqlite").write_bytes(os.urandom(16384)), "ok", True),
    "text-file": (lambda d: (d / "algos.sqlite").write_text("not a database\n" * 100), "ok", True),
    "truncated-db": (lambda d: (_valid_db(d / "algos.sqlite"), _truncate(d / "algos.sqlite", 300000)), "ok", True),
    "truncated-header": (lambda d: (_valid_db(d / "algos.sqlite", 3), _truncate(d / "algos.sqlite", 50)), "ok", True),
    "zero-length": (lambda d: (d / "algos.sqlite").write_bytes(b""), "ok", False),
    "newer-schema": (lambda d: _newer_schema(d / "algos.sqlite"), "memory", False),
    "foreign-sqlite": (lambda d: _foreign(d / "algos.sqlite"), "ok", True),
    "wrong-schema-version": (lambda d: _foreign(d / "algos.sqlite", version=0), "ok", True),
    "directory": (lambda d: (d / "algos.sqlite").mkdir(), "memory", False),
    "fifo": (lambda d: os.mkfifo(d / "algos.sqlite"), "memory", False),
    "dev-zero": (lambda d: os.symlink("/dev/zero", d / "algos.sqlite"), "memory", False),
    "dev-null": (lambda d: os.symlink("/dev/null", d / "algos.sqlite"), "memory", False),
    "symlink-loop": (lambda d: os.symlink(d / "algos.sqlite", d / "algos.sqlite"), "memory", False),
    "dangling-symlink": (lambda d: os.symlink(d / "no" / "such" / "dir", d / "algos.sqlite"), "memory", False),
    "dir-is-a-file": (lambda d: (d / "sub").write_text("x"), "memory", False),
    "dir-under-a-file": (lambda d: (d / "file").write_text("x"), "memory", False),
    "dir-symlink-loop": (lambda d: os.symlink(d / "loop", d / "loop"), "memory", False),
}
STORE_PATH = {"dir-is-a-file": "sub/algos.sqlite", "dir-under-a-file": "file/sub/algos.sqlite",
              "dir-symlink-loop": "loop/algos.sqlite"}


@pytest.mark.parametrize("name", list(HOSTILE_STORES))
def test_damaged_or_hostile_store_is_never_fatal(tmp_path, caplog, name):
    make, want_state, set_aside = HOSTILE_STORES[name]
    make(tmp_path)
    path = tmp_path / STORE_PATH.get(name, "algos.sqlite")
    before = sorted(os.listdir(tmp_path))
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="attn_lt"):
        c = AlgoCache(path)
        assert c.get(ENV, key(0, 5)) is None
        stored = c.put(ENV, key(1, 1), entry(1))
        assert c.get(ENV, key(1, 1)) == entry(1)  # in the store or, failing that, in memory
        c.items(), c.count(), c.get(ENV, key(0, 6))
        assert c.state == want_state
        assert stored == (want_state == "ok")
    assert time.perf_counter() - t0 < 10  # nothing hangs (FIFO) or reads forever (/dev/zero)
    msgs = warnings_of(caplog)
    aside = sorted(p.name for p in tmp_path.glob("algos.sqlite.bad-*"))
    FIGURES.setdefault("hostile store files tried", 0)
    FIGURES["hostile store files tried"] += 1
    if set_aside:  # the read (get) says it is damaged and leaves it; the write (put) moves it aside
        assert len(aside) == 1 and len(msgs) == 2, msgs
        assert "is damaged" in msgs[0] and "left as it is" in msgs[0] and "moved it to algos.sqlite.bad-" in msgs[1]
        assert AlgoCache(path).get(ENV, key(1, 1)) == entry(1)  # the new store works
    elif want_state == "memory":
        assert not aside and len(msgs) == 1 and "unusable" in msgs[0], msgs
        if name != "dangling-symlink":
            assert sorted(os.listdir(tmp_path)) == before  # nothing moved, nothing created
    else:
        assert not aside and msgs == []


def test_set_aside_is_claimed_only_when_the_rename_happened(shared_dir):
    """A damaged store in a directory we may not write: it stays where it is, and the warning says so."""
    (shared_dir / "algos.sqlite").write_bytes(os.urandom(8192))
    os.chmod(shared_dir / "algos.sqlite", 0o666)

    def probe():
        logging.getLogger("attn_lt").handlers[:] = []
        seen = []
        h = logging.Handler()
        h.emit = lambda r: seen.append(r.getMessage())
        logging.getLogger("attn_lt").addHandler(h)
        c = AlgoCache(shared_dir / "algos.sqlite")
        ok = c.put(ENV, key(0, 0), entry(0))
        return {"state": c.state, "put": ok, "warnings": seen}

    r = as_other_user(probe) if os.geteuid() == 0 else pytest.skip("needs root to drop to another user")
    assert r["state"] == "memory" and r["put"] is False
    assert len(r["warnings"]) == 1 and "could not be moved aside" in r["warnings"][0], r["warnings"]
    assert "moved it to" not in r["warnings"][0]
    assert (shared_dir / "algos.sqlite").exists() and not list(shared_dir.glob("*.bad-*"))


def test_unreadable_directory_degrades_to_memory(shared_dir):
    (shared_dir / "private").mkdir()
    _valid_db(shared_dir / "private" / "algos.sqlite", 3)
    os.chmod(shared_dir / "private", 0o700 if os.geteuid() == 0 else 0o000)

    def probe():
        c = AlgoCache(shared_dir / "private" / "algos.sqlite")
        return {"state": c.state, "get": c.get(ENV, key(0, 1)) is not None, "put": c.put(ENV, key(1, 1), entry(1)),
                "mem": c.get(ENV, key(1, 1)) is not None}

    r = as_other_user(probe)
    assert r == {"state": "memory", "get": False, "put": False, "mem": True}


def test_read_only_store_is_read_and_commands_say_nothing_was_removed(shared_dir):
    path = shared_dir / "algos.sqlite"
    _valid_db(path, 20)
    if os.geteuid() != 0:
        os.chmod(shared_dir, 0o555)

    def probe():
        import contextlib
        import io

        from attn_lt import cli

        c = AlgoCache(path)
        res = {"state": c.state, "count": len(c.items()), "put": c.put(ENV, key(1, 1), entry(1)),
               "mem": c.get(ENV, key(1, 1)) is not None}
        try:
            c.clear()
            res["clear"] = "cleared"
        except CacheStoreError as e:
            res["clear"] = str(e)
        os.environ["ATTN_LT_CACHE_DIR"] = str(shared_dir)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            res["cli_clear"] = cli.main(["cache", "clear"])
        res["cli_err"] = err.getvalue()
        res["after"] = AlgoCache(path).count()
        return res

    r = as_other_user(probe)
    assert r["state"] == "read-only" and r["count"] == 20 and r["put"] is False and r["mem"] is True
    assert "nothing was removed" in r["clear"]
    assert r["cli_clear"] == 1 and "nothing was removed" in r["cli_err"] and r["after"] == 20
    assert integrity(path) == ("ok", 20)


def test_locked_store_at_open_degrades_with_one_warning(tmp_path, caplog):
    path = tmp_path / "algos.sqlite"
    _valid_db(path, 3)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys, time
        db = sqlite3.connect({str(path)!r}, isolation_level=None)
        db.execute("PRAGMA locking_mode = EXCLUSIVE")
        db.execute("BEGIN EXCLUSIVE"); db.execute("DELETE FROM entries WHERE 0")
        print("locked", flush=True); time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with caplog.at_level(logging.WARNING, logger="attn_lt"):
            c = AlgoCache(path, busy_timeout_ms=200)
            assert c.get(ENV, key(0, 1)) is None and c.put(ENV, key(1, 1), entry(1)) is False
            assert c.state == "memory" and c.get(ENV, key(1, 1)) == entry(1)
        msgs = warnings_of(caplog)
        assert len(msgs) == 1 and "locked" in msgs[0]
    finally:
        holder.kill()
        holder.wait()
    assert integrity(path) == ("ok", 3)


def test_write_lock_held_by_another_process_delays_then_keeps_in_memory(tmp_path, caplog):
    path = tmp_path / "algos.sqlite"
    _valid_db(path, 3)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys
        db = sqlite3.connect({str(path)!r}, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        print("locked", flush=True); sys.stdin.readline(); db.execute("ROLLBACK")
        print("released", flush=True); sys.stdin.readline()
    """)], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with caplog.at_level(logging.WARNING, logger="attn_lt"):
            c = AlgoCache(path, busy_timeout_ms=200)
            assert c.get(ENV, key(0, 1)) == entry(1)  # readers are not blocked (WAL)
            assert c.put(ENV, key(1, 1), entry(1)) is False and c.unsaved() == 1
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "released"
            assert c.put(ENV, key(1, 2), entry(2)) is True and c.state == "ok"
        assert len(warnings_of(caplog)) == 1
    finally:
        holder.kill()
        holder.wait()


def test_full_disk_is_reported_and_nothing_half_written(tmp_path):
    """RLIMIT_FSIZE in a worker: writes fail as on a full disk; put says False, the store stays consistent and
    holds every entry put() reported stored."""
    path = tmp_path / "algos.sqlite"
    p = worker("""
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        c = cache.AlgoCache(sys.argv[1])
        c.put(ENV, key(0, 0), entry(0))
        limit = max(os.path.getsize(sys.argv[1]), os.path.getsize(sys.argv[1] + "-wal")) + 65536
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        ok, failed = [], 0
        for i in range(3000):
            if c.put(ENV, key(1, i), entry(i)):
                ok.append(i)
            else:
                failed += 1
        print(json.dumps({"ok": ok, "failed": failed, "unsaved": c.unsaved(),
                          "mem": c.get(ENV, key(1, 2999)) is not None}))
    """, path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    r = json.loads(out)
    assert r["failed"] > 0 and r["unsaved"] == r["failed"] and r["mem"]
    assert err.count("could not be written (") == 1, err  # reported once
    assert err.count("before exit") == 1 and "they are lost" in err, err  # retried at exit, and said so
    status, n = integrity(path)
    stored = {cache_mod.parse_key(k)["i"] for _, k, _ in AlgoCache(path).items() if cache_mod.parse_key(k)["w"] == 1}
    assert status == "ok" and set(r["ok"]) <= stored
    FIGURES["full disk (RLIMIT_FSIZE)"] = f"{len(r['ok'])} puts stored, {r['failed']} refused and kept in memory"


def test_import_on_a_full_disk_says_nothing_was_imported(tmp_path):
    from attn_lt.cache import write_document

    path = tmp_path / "algos.sqlite"
    _valid_db(path, 3)
    src = tmp_path / "in.json"
    with open(src, "w") as f:
        write_document(f, ((ENV.key(), cache_mod.key_string(key(5, i)), entry(i, runners=4)) for i in range(5000)))
    limit = os.path.getsize(path) + 32768

    def preexec():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    env = dict(os.environ, ATTN_LT_CACHE_DIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "attn_lt", "cache", "import", str(src)], env=env,
                       capture_output=True, text=True, preexec_fn=preexec, timeout=120)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "nothing was imported" in r.stderr and "imported 5000" not in r.stdout and "Traceback" not in r.stderr
    assert integrity(path) == ("ok", 3)


# ---- kill -9 -------------------------------------------------------------------------------------------------------

def test_kill_9_during_writes_loses_nothing_acknowledged_and_leaves_no_files(tmp_path):
    path = tmp_path / "algos.sqlite"
    procs = [worker("""
        c = cache.AlgoCache(sys.argv[1]); w = int(sys.argv[2])
        for i in range(100000):
            if c.put(ENV, key(w, i), entry(i)):
                print(i, flush=True)
    """, path, w) for w in range(3)]
    acked = {}
    for w, p in enumerate(procs):
        last = -1
        while last < 200:
            last = int(p.stdout.readline())
        acked[w] = last
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for w, p in enumerate(procs):
        rest = p.communicate()[0].split()
        acked[w] = int(rest[-1]) if rest else acked[w]
    c = AlgoCache(path)
    have = {}
    for _, k, _ in c.items():
        d = cache_mod.parse_key(k)
        have[d["w"]] = max(have.get(d["w"], -1), d["i"])
    assert c.state == "ok" and all(have.get(w, -1) >= acked[w] for w in acked), (have, acked)
    c.close()
    assert integrity(path)[0] == "ok"
    assert sorted(os.listdir(tmp_path)) == ["algos.sqlite"]  # no journal, no temporary file left
    FIGURES["kill -9 during writes"] = (f"3 writers killed after {sum(acked.values()) + 3} acknowledged writes: "
                                        "0 lost, integrity ok, no stray files")


def test_kill_9_during_an_import_keeps_all_or_nothing(tmp_path):
    path = tmp_path / "algos.sqlite"
    _valid_db(path, 3)
    src = tmp_path / "in.json"
    with open(src, "w") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(5, i)), entry(i, runners=4))
                                     for i in range(40000)))
    p = worker("""
        c = cache.AlgoCache(sys.argv[1]); c.count()
        print("start", flush=True)
        c.import_file(sys.argv[2])
        print("done", flush=True)
    """, path, src)
    assert p.stdout.readline().strip() == "start"
    time.sleep(0.3)
    p.send_signal(signal.SIGKILL)
    finished = "done" in p.communicate()[0]
    status, n = integrity(path)  # written in batches: a prefix of whole batches, or everything
    assert status == "ok" and (n == 40003 if finished else (n - 3) % cache_mod.IMPORT_BATCH == 0)
    assert sorted(os.listdir(tmp_path)) == ["algos.sqlite", "in.json"]


# ---- hostile imports -----------------------------------------------------------------------------------------------

HOSTILE_IMPORTS = {
    "fifo": lambda d: os.mkfifo(d / "x.json"),
    "dev-zero": lambda d: os.symlink("/dev/zero", d / "x.json"),
    "dev-urandom": lambda d: os.symlink("/dev/urandom", d / "x.json"),
    "directory": lambda d: (d / "x.json").mkdir(),
    "symlink-loop": lambda d: os.symlink(d / "x.json", d / "x.json"),
    "missing": lambda d: None,
    "over-the-cap": lambda d: os.truncate(open(d / "x.json", "wb").name, cache_mod.MAX_IMPORT_BYTES + 1),
}


@pytest.mark.parametrize("name", list(HOSTILE_IMPORTS))
def test_hostile_import_is_refused_before_reading(tmp_path, name):
    HOSTILE_IMPORTS[name](tmp_path)
    c = AlgoCache(tmp_path / "store" / "algos.sqlite")
    c.put(ENV, key(0, 0), entry(0))
    t0 = time.perf_counter()
    with pytest.raises(CacheError) as e:
        c.import_file(tmp_path / "x.json")
    assert time.perf_counter() - t0 < 2 and str(tmp_path / "x.json") in str(e.value)
    assert c.count() == 1
    FIGURES.setdefault("hostile import files tried", 0)
    FIGURES["hostile import files tried"] += 1


def test_import_stops_at_the_cap_while_streaming(tmp_path, monkeypatch):
    """A file that grows past the cap while it is read (or lies about its size) is cut off, not read forever."""
    src = tmp_path / "x.json"
    with open(src, "w") as f:
        cache_mod.write_document(f, ((ENV.key(), cache_mod.key_string(key(5, i)), entry(i)) for i in range(3000)))
    c = AlgoCache(tmp_path / "algos.sqlite")
    f = cache_mod.open_regular(src, 1 << 30)
    with f, pytest.raises(CacheError, match="larger than the limit"):
        list(cache_mod.read_document(f, "x.json", max_bytes=100000))
    assert c.count() == 0


def test_export_refuses_fifos_and_devices_and_leaves_no_partial_file(tmp_path):
    c = AlgoCache(tmp_path / "algos.sqlite")
    c.put(ENV, key(0, 0), entry(0))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CacheError, match="FIFO"):
        c.export(tmp_path / "fifo")
    with pytest.raises(CacheError, match="character device"):
        c.export("/dev/null")
    with pytest.raises(OSError):
        c.export(tmp_path / "no" / "such" / "dir" / "x.json")
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode)
