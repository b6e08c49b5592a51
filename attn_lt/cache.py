"""The per-shape algorithm cache: which cuBLASLt configuration won for each GEMM, on which GPU and library.

The store is an SQLite database (the standard library's ``sqlite3``, WAL mode), ``algos.sqlite`` in
``config.cache_dir()``: one row per (environment, GEMM key) holding the winner's configuration, its time, the
heuristic's time, the workspace it needs, up to four runners-up and when it was tuned::

    attn_lt_schema(name TEXT PRIMARY KEY, version INTEGER)          -- ("algo_cache", DB_SCHEMA_VERSION)
    entries(env TEXT, gemm TEXT, config TEXT (JSON), median_ms REAL, heuristic_ms REAL, workspace INTEGER,
            runners_up TEXT (JSON), tuned_at TEXT, PRIMARY KEY (env, gemm))   -- + an index on gemm

The environment (GPU name, compute capability, SM count, cuBLASLt version) makes an entry valid: entries of other
environments are kept but never used. The GEMM key is an opaque, canonical string (:func:`key_string`); the cache
does not know which fields a key has, so shape-class keys fit the same table.

Rules:

* Writes are per row (``INSERT OR REPLACE`` in a short transaction, with a busy timeout), so their cost does not
  depend on the size of the store and processes sharing it never undo each other's writes or a ``clear``.
* Every row is validated when read; a row that fails is skipped and reported once, never the whole store.
* Nothing about the store is fatal: an unusable directory, a file where the directory should be, a symlink loop,
  a device or a directory as the database, a locked or foreign database degrade to memory with one warning
  (logger ``attn_lt``); a damaged database is moved aside (``algos.sqlite.bad-<time>``) and rebuilt, and the
  warning says whether the move really happened. ``get`` and ``put`` never raise because of the store.
* JSON is the human and exchange format: :meth:`AlgoCache.export` / :meth:`AlgoCache.import_file` stream a
  document ``{"schema": "attn_lt.algo_cache", "version": 1, "entries": {env: {gemm: entry}}}`` (one entry a
  line); an import is validated entry by entry and applied in one transaction (all or nothing). FIFOs, devices and
  other non-regular files are refused before anything is read. An ``algos.json`` left by an older attn_lt is
  migrated once and renamed ``algos.json.migrated``.
"""

from __future__ import annotations

import atexit
import codecs
import datetime
import functools
import heapq
import json
import logging
import math
import operator
import os
import re
import sqlite3
import stat
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger("attn_lt")

SCHEMA = "attn_lt.algo_cache"
VERSION = 1  # of the JSON document (export / import, and the old algos.json)
DB_SCHEMA_VERSION = 1  # of the SQLite store
DB_FILE = "algos.sqlite"
LEGACY_FILE = "algos.json"
MAX_IMPORT_BYTES = 2 << 30  # an import is streamed: memory stays bounded whatever the size up to this cap
MAX_ENTRY_CHARS = 1 << 16  # one entry's JSON text
MAX_KEY_CHARS = 512
MAX_RUNNERS_UP = 4
BUSY_TIMEOUT_MS = 2000  # how long a write waits for another process's write
IMPORT_BATCH = 1000  # entries an import writes a transaction: other processes' writes interleave between them
IMPORT_WAIT_S = 60.0  # how long an import waits, at most, for its turn to write one batch
EXIT_FLUSH_WAIT_S = 10.0  # how long, at exit, a process waits to write the entries a busy store made it keep


class CacheError(ValueError):
    """A cache file or entry that is malformed, hostile, or of another schema; the message says which part."""


class CacheStoreError(OSError):
    """The store could not do what was asked (not writable, full, locked, unusable); nothing was changed."""


@dataclass(frozen=True)
class Env:
    """What makes a measured algorithm valid: the GPU and the cuBLASLt library it was measured with."""

    gpu: str
    cc: str  # "9.0"
    sms: int
    cublaslt: int

    def key(self) -> str:
        return f"{self.gpu}|sm{self.cc}|{self.sms}sm|cublasLt{self.cublaslt}"

    @classmethod
    def parse(cls, s: str) -> Env:
        m = _ENV_RE.fullmatch(s) if isinstance(s, str) else None
        if not m:
            raise CacheError(f"malformed environment key {str(s)[:80]!r}")
        return cls(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))

    @classmethod
    def current(cls, device: int = 0) -> Env:
        import torch
        from nvmath.bindings import cublasLt

        p = torch.cuda.get_device_properties(device)
        return cls(p.name, f"{p.major}.{p.minor}", p.multi_processor_count, int(cublasLt.get_version()))


_ENV_RE = re.compile(r"(.{1,128})\|sm(\d{1,2}\.\d{1,2})\|(\d{1,5})sm\|cublasLt(\d{1,10})")


@functools.lru_cache(maxsize=16)
def current_env(device: int = 0) -> Env:
    """The :class:`Env` of ``device`` (GPU properties and cuBLASLt version), looked up once per process."""
    return Env.current(device)


@dataclass(frozen=True)
class AlgoConfig:
    """A full cuBLASLt algorithm configuration (cublasLtMatmulAlgoConfigAttributes_t)."""

    algo_id: int
    tile: int = 0
    stages: int = 0
    splitk: int = 1
    reduction: int = 0
    swizzle: int = 0
    custom: int = 0
    cluster: int = 0
    inner: int = 0

    def __str__(self) -> str:
        return (f"algo {self.algo_id} tile {self.tile} stages {self.stages} split-K {self.splitk} "
                f"reduction {self.reduction} swizzle {self.swizzle} custom {self.custom} cluster {self.cluster}")


@dataclass(frozen=True)
class Entry:
    """The winner for one GEMM key, its median time, the heuristic's time, and the runners-up."""

    config: AlgoConfig
    median_ms: float
    heuristic_ms: float | None
    workspace: int
    runners_up: tuple[tuple[AlgoConfig, float], ...] = ()
    tuned_at: str = ""

    def to_dict(self) -> dict:
        return {"config": _cfg(self.config), "median_ms": self.median_ms, "heuristic_ms": self.heuristic_ms,
                "workspace": self.workspace, "runners_up": [[_cfg(c), t] for c, t in self.runners_up],
                "tuned_at": self.tuned_at}

    @classmethod
    def from_dict(cls, d) -> Entry:
        """Strictly typed: anything unexpected raises :class:`CacheError`."""
        if not isinstance(d, dict) or set(d) != {"config", "median_ms", "heuristic_ms", "workspace", "runners_up",
                                                 "tuned_at"}:
            raise CacheError(f"entry must have exactly config, median_ms, heuristic_ms, workspace, runners_up, "
                             f"tuned_at; got {sorted(d)[:8] if isinstance(d, dict) else type(d).__name__}"[:300])
        runners = d["runners_up"]
        if not isinstance(runners, list) or len(runners) > MAX_RUNNERS_UP or not all(
                isinstance(r, list) and len(r) == 2 for r in runners):
            raise CacheError(f"runners_up must be a list of at most {MAX_RUNNERS_UP} [config, ms] pairs")
        return cls(_config(d["config"]), _ms(d["median_ms"]), None if d["heuristic_ms"] is None else _ms(
            d["heuristic_ms"]), _int(d["workspace"], 0, 1 << 40, "workspace"),
            tuple((_config(c), _ms(t)) for c, t in runners), _str(d["tuned_at"], 40, "tuned_at"))


_CFG_NAMES = tuple(f.name for f in fields(AlgoConfig))
_CFG_KEYS = frozenset(_CFG_NAMES)
_CFG_VALUES = operator.itemgetter(*_CFG_NAMES)
_CFG_JSON = "{" + ",".join(f'"{n}":%d' for n in _CFG_NAMES) + "}"
_CFG_MAX = 1 << 31
_CONFIGS: dict[tuple, AlgoConfig] = {}  # validated configurations, shared (they repeat across entries)


def _cfg(c: AlgoConfig) -> dict:
    return {n: getattr(c, n) for n in _CFG_NAMES}


def _cfg_json(c: AlgoConfig) -> str:
    """The compact JSON of a configuration (what json.dumps would give, faster)."""
    return _CFG_JSON % (c.algo_id, c.tile, c.stages, c.splitk, c.reduction, c.swizzle, c.custom, c.cluster, c.inner)


def _num(v: float) -> str:
    return repr(float(v))  # finite floats (validated): the shortest round-trip text, valid JSON


def entry_json(e: Entry) -> str:
    """``json.dumps(e.to_dict())`` of a validated entry, written directly (export and the store use it)."""
    runners = ", ".join(f"[{_cfg_json(c)}, {_num(t)}]" for c, t in e.runners_up)
    return (f'{{"config": {_cfg_json(e.config)}, "median_ms": {_num(e.median_ms)}, "heuristic_ms": '
            f'{"null" if e.heuristic_ms is None else _num(e.heuristic_ms)}, "workspace": {e.workspace}, '
            f'"runners_up": [{runners}], "tuned_at": {json.dumps(e.tuned_at)}}}')


def _int(v, lo, hi, what) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise CacheError(f"{what} must be an integer in [{lo}, {hi}], got {v!r}"[:200])
    return v


def _ms(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1e7:
        raise CacheError(f"a time must be a finite number of milliseconds, got {v!r}"[:200])
    return float(v)


def _str(v, n, what) -> str:
    if not isinstance(v, str) or len(v) > n:
        raise CacheError(f"{what} must be a string of at most {n} characters")
    return v


def _config(d) -> AlgoConfig:
    if not isinstance(d, dict) or d.keys() != _CFG_KEYS:
        raise CacheError(f"config must have exactly the fields {list(_CFG_NAMES)}")
    values = _CFG_VALUES(d)
    c = _CONFIGS.get(values)
    if c is not None and all(type(v) is int for v in values):  # True == 1 as a dict key: types checked
        return c
    for n, v in zip(_CFG_NAMES, values):
        if type(v) is not int or not 0 <= v <= _CFG_MAX:
            _int(v, 0, _CFG_MAX, n)  # raises, naming the field
    if len(_CONFIGS) > 4096:
        _CONFIGS.clear()
    c = _CONFIGS[values] = AlgoConfig(*values)
    return c


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---- keys -----------------------------------------------------------------------------------------------------
#
# A key is any object with ``to_dict()`` (a GemmKey, a shape-class key) or a plain dict of fields whose values are
# ints (>= 0), bools or short identifier-like strings. Its text form is canonical (one string per key):
#
# * the GEMM fields in the compact form of attn_lt 0.1 when all of them are present with their usual types:
#   ``pv|bf16|m128|n4|k131072|b64|NN|ld128,262144,128|st16777216,1048576,512|al256,256,256``,
#   followed by any other field as ``|name=value``, sorted by name (``...|al256,256,256|cls=decode``);
# * otherwise every field as ``name=value``, sorted by name (``batch=8|cls=decode|dtype=bf16|...``).
#
# Values: ints in decimal, bools as ``true``/``false``, strings as themselves (a letter first, then letters, digits
# and ``_.+:-``; never ``true`` or ``false``).

_GEMM_FIELDS = ("role", "dtype", "m", "n", "k", "batch", "trans_a", "trans_b", "lda", "ldb", "ldc", "stride_a",
                "stride_b", "stride_c", "align_a", "align_b", "align_c")
_N = r"(0|[1-9]\d{0,14})"
_GEMM_RE = re.compile(rf"(qk|pv)\|(bf16|fp16)\|m{_N}\|n{_N}\|k{_N}\|b{_N}\|([NT])([NT])\|ld{_N},{_N},{_N}"
                      rf"\|st{_N},{_N},{_N}\|al{_N},{_N},{_N}")
_FIELD_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_TEXT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.+:-]{0,63}")
_INT_RE = re.compile(_N)
MAX_KEY_INT = 1 << 48


def _check_value(name: str, v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if not 0 <= v < MAX_KEY_INT:
            raise CacheError(f"key field {name} = {v} is out of range [0, 2^48)")
        return v
    if isinstance(v, str):
        if not _TEXT_RE.fullmatch(v) or v in ("true", "false"):
            raise CacheError(f"key field {name} = {v[:40]!r} is not a short identifier-like string")
        return v
    raise CacheError(f"key field {name} must be an int, a bool or a string, got {type(v).__name__}")


def _key_fields(key) -> dict:
    d = key.to_dict() if hasattr(key, "to_dict") else key
    if not isinstance(d, dict) or not d:
        raise CacheError(f"a key is an object with to_dict() or a non-empty dict, got {type(key).__name__}")
    for name, v in d.items():
        if not isinstance(name, str) or not _FIELD_RE.fullmatch(name):
            raise CacheError(f"key field name {str(name)[:40]!r} is not a lower-case identifier")
        _check_value(name, v)
    return d


def _fmt(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _gemm_prefix(d: dict) -> str | None:
    """The compact GEMM form, when ``d`` has every GEMM field with its usual type."""
    if not all(f in d for f in _GEMM_FIELDS) or d["role"] not in ("qk", "pv") or d["dtype"] not in ("bf16", "fp16"):
        return None
    if not (isinstance(d["trans_a"], bool) and isinstance(d["trans_b"], bool)):
        return None
    if any(isinstance(d[f], bool) or not isinstance(d[f], int) for f in _GEMM_FIELDS[2:6] + _GEMM_FIELDS[8:]):
        return None
    return (f"{d['role']}|{d['dtype']}|m{d['m']}|n{d['n']}|k{d['k']}|b{d['batch']}|{'T' if d['trans_a'] else 'N'}"
            f"{'T' if d['trans_b'] else 'N'}|ld{d['lda']},{d['ldb']},{d['ldc']}|st{d['stride_a']},{d['stride_b']},"
            f"{d['stride_c']}|al{d['align_a']},{d['align_b']},{d['align_c']}")


def key_string(key) -> str:
    """The canonical text form of a key (a GemmKey, any object with ``to_dict()``, or a dict of fields): what the
    store, the JSON files and the command line use. Raises :class:`CacheError` for fields it cannot represent."""
    d = _key_fields(key)
    prefix = _gemm_prefix(d)
    rest = sorted(n for n in d if prefix is None or n not in _GEMM_FIELDS)
    s = "|".join(([prefix] if prefix else []) + [f"{n}={_fmt(d[n])}" for n in rest])
    if len(s) > MAX_KEY_CHARS:
        raise CacheError(f"key is longer than {MAX_KEY_CHARS} characters")
    return s


def _parse_value(name: str, s: str):
    if _INT_RE.fullmatch(s):
        return _check_value(name, int(s))
    if s in ("true", "false"):
        return s == "true"
    return _check_value(name, s)


def parse_key(s: str) -> dict:
    """The fields of a canonical key string (see :func:`key_string`) as a plain dict, names and types checked;
    callers that need a GemmKey build it with ``GemmKey.from_dict``. Raises :class:`CacheError`."""
    if not isinstance(s, str) or not 0 < len(s) <= MAX_KEY_CHARS:
        raise CacheError(f"malformed key {str(s)[:80]!r}")
    out: dict = {}
    rest = s
    m = _GEMM_RE.match(s)
    if m and (m.end() == len(s) or s[m.end()] == "|"):
        g = m.groups()
        nums = [int(x) for x in g[2:6]] + [int(x) for x in g[8:]]
        if any(n >= MAX_KEY_INT for n in nums):
            raise CacheError(f"key {s[:80]!r} has out-of-range numbers")
        out = dict(zip(_GEMM_FIELDS, [g[0], g[1]] + nums[:4] + [g[6] == "T", g[7] == "T"] + nums[4:]))
        rest = s[m.end() + 1:]
    for part in rest.split("|") if rest else ():
        name, eq, val = part.partition("=")
        if not eq or not _FIELD_RE.fullmatch(name) or name in out:
            raise CacheError(f"malformed key {s[:80]!r} (at {part[:40]!r})")
        try:
            out[name] = _parse_value(name, val)
        except CacheError as e:
            raise CacheError(f"malformed key {s[:80]!r}: {e}") from None
    if key_string(out) != s:
        raise CacheError(f"key {s[:80]!r} is not in canonical form (expected {key_string(out)[:80]!r})")
    return out


# ---- reading files safely ------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path, max_bytes: int):
    """Open ``path`` for reading as a binary file object, refusing before reading anything: a missing or
    unreadable path, a FIFO, a device, a directory, a socket, a symlink loop, or a file over ``max_bytes``. Every
    refusal raises :class:`CacheError` naming the path."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise CacheError(f"{p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CacheError(f"{p} is {_kind(st.st_mode)}, not a regular file; refusing to read it")
    if st.st_size > max_bytes:
        raise CacheError(f"{p} is {st.st_size} bytes, more than the limit of {max_bytes}")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CacheError(f"{p}: {e.strerror or e}") from None
    st2 = os.fstat(fd)
    if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise CacheError(f"{p} changed while it was being opened; refusing to read it")
    return os.fdopen(fd, "rb")


def read_regular_file(path, max_bytes: int) -> bytes:
    """The bytes of a small regular file (see :func:`open_regular` for what is refused); at most ``max_bytes``."""
    with open_regular(path, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CacheError(f"{os.fspath(path)} is larger than the limit of {max_bytes} bytes")
    return data


_DECODER = json.JSONDecoder()


class _Reader:
    """A pull reader over a JSON document in a binary stream, for the document's two outer levels; each entry
    is decoded on its own, so memory stays bounded by one entry whatever the file's size."""

    def __init__(self, f, name: str, max_bytes: int):
        self.f, self.name, self.max_bytes = f, name, max_bytes
        self.dec = codecs.getincrementaldecoder("utf-8-sig")("strict")  # a leading byte-order mark is skipped
        self.buf, self.pos, self.eof, self.nbytes, self.consumed = "", 0, False, 0, 0

    def error(self, what: str) -> CacheError:
        return CacheError(f"{self.name}: {what} (near character {self.consumed + self.pos})")

    def fill(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(1 << 20)
        self.nbytes += len(chunk)
        if self.nbytes > self.max_bytes:
            raise CacheError(f"{self.name} is larger than the limit of {self.max_bytes} bytes")
        try:
            text = self.dec.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            raise CacheError(f"{self.name} is not UTF-8 text ({e.reason})") from None
        self.consumed += self.pos
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        self.eof = not chunk
        return True

    def peek(self) -> str:
        """The next non-blank character, "" at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def expect(self, ch: str, what: str) -> None:
        got = self.peek()
        if got != ch:
            raise self.error(f"expected {what}, found {repr(got)[:10] if got else 'the end of the file'}")
        self.pos += 1

    def value(self, max_chars: int):
        self.peek()
        while True:
            try:
                v, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return v
            except json.JSONDecodeError as e:
                if self.eof:
                    raise self.error(f"not valid JSON ({e.msg})") from None
            except RecursionError:
                raise self.error("JSON nested too deeply") from None
            except ValueError as e:  # Python's limit on the digits of an int (sys.get_int_max_str_digits)
                if "digits" in str(e):
                    raise self.error("a number with too many digits (more than "
                                     f"{getattr(sys, 'get_int_max_str_digits', lambda: 4300)()})") from None
                raise self.error(f"not valid JSON ({e})") from None
            if len(self.buf) - self.pos > max_chars:
                raise self.error(f"a value longer than {max_chars} characters")
            self.fill()

    def members(self, what: str):
        """The names of an object's members, positioned before each value; the object's braces are consumed."""
        self.expect("{", f"an object for {what}")
        first = True
        while True:
            if self.peek() == "}":
                self.pos += 1
                return
            if not first:
                self.expect(",", f"',' or '}}' in {what}")
            name = self.value(MAX_KEY_CHARS + 2)
            if not isinstance(name, str):
                raise self.error(f"expected a member name in {what}")
            self.expect(":", "':'")
            yield name
            first = False


def read_document(f, name: str, *, strict: bool = True, max_bytes: int = MAX_IMPORT_BYTES, bad=None):
    """Stream the entries of a cache document from the binary file ``f``: yields (environment key, GEMM key
    string, Entry). ``strict``: the first problem raises :class:`CacheError` (the caller rolls back what it
    took). Otherwise entries that fail validation are skipped and passed to ``bad(env, key, error)``; a broken
    structure still raises. The schema and version are checked whatever their place in the document."""
    r = _Reader(f, name, max_bytes)
    if r.peek() != "{":
        raise CacheError(f"{name} is not an attn_lt algorithm cache (a JSON object with schema {SCHEMA!r} expected)")
    seen = set()
    for top in r.members("the document"):
        if top in seen:
            raise r.error(f"field {top!r} given twice")
        seen.add(top)
        if top == "schema":
            if r.value(200) != SCHEMA:
                raise CacheError(f"{name} is not an attn_lt algorithm cache (schema {SCHEMA!r} expected)")
        elif top == "version":
            v = r.value(200)
            if v != VERSION or isinstance(v, bool):
                raise CacheError(f"{name} has cache version {str(v)[:20]}; this attn_lt reads version {VERSION}")
        elif top == "entries":
            for env in r.members("entries"):
                env_error = None
                try:
                    Env.parse(env)
                except CacheError as e:
                    if strict:
                        raise CacheError(f"{name}: {e}") from None
                    env_error = e
                for key in r.members(f"the entries of {env[:60]!r}"):
                    raw = r.value(MAX_ENTRY_CHARS)
                    try:
                        if env_error is not None:
                            raise env_error
                        parse_key(key)
                        e = Entry.from_dict(raw)
                    except CacheError as err:
                        if strict:
                            raise CacheError(f"{name}: entry {key[:120]!r}: {err}") from None
                        if bad is not None:
                            bad(env, key, err)
                        continue
                    yield env, key, e
        else:
            raise CacheError(f"{name}: unexpected field {top[:40]!r} (a cache document has exactly schema, version "
                             "and entries)")
    if r.peek() != "":
        raise r.error("data after the end of the document")
    if seen != {"schema", "version", "entries"}:
        raise CacheError(f"{name}: a cache document has exactly schema, version and entries; "
                         f"missing {', '.join(sorted({'schema', 'version', 'entries'} - seen))}")


def write_document(f, rows) -> int:
    """Write ``rows`` ((env, key, Entry), sorted by env) to the text file ``f`` as a cache document, one entry a
    line; returns how many."""
    f.write(f'{{"schema": "{SCHEMA}", "version": {VERSION}, "entries": {{')
    cur, n = None, 0
    for env, key, e in rows:
        if env != cur:
            f.write(("\n" if cur is None else "\n },\n") + f" {json.dumps(env)}: {{\n")
            cur = env
        else:
            f.write(",\n")
        f.write(f"  {json.dumps(key)}: {entry_json(e)}")
        n += 1
    f.write("\n }\n}}\n" if cur is not None else "}}\n")
    return n


def parse_document(doc) -> dict[str, dict[str, Entry]]:
    """Validate a whole cache document already in memory (a dict); raises :class:`CacheError` naming the first
    problem. Files are read with :func:`read_document`, which streams."""
    import io

    out: dict[str, dict[str, Entry]] = {}
    try:
        text = json.dumps(doc)
    except (TypeError, ValueError) as e:
        raise CacheError(f"not a JSON document: {e}") from None
    for env, key, e in read_document(io.BytesIO(text.encode()), "document"):
        out.setdefault(env, {})[key] = e
    return out


# ---- the store --------------------------------------------------------------------------------------------------

_CREATE = (
    "CREATE TABLE attn_lt_schema (name TEXT PRIMARY KEY, version INTEGER NOT NULL)",
    "CREATE TABLE entries (env TEXT NOT NULL, gemm TEXT NOT NULL, config TEXT NOT NULL, median_ms REAL NOT NULL, "
    "heuristic_ms REAL, workspace INTEGER NOT NULL, runners_up TEXT NOT NULL, tuned_at TEXT NOT NULL, "
    "PRIMARY KEY (env, gemm)) WITHOUT ROWID",
    "CREATE INDEX entries_by_gemm ON entries (gemm)",
)
_INSERT = ("INSERT OR REPLACE INTO entries (env, gemm, config, median_ms, heuristic_ms, workspace, runners_up, "
           "tuned_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
_COLS = "env, gemm, config, median_ms, heuristic_ms, workspace, runners_up, tuned_at"
_ABANDONED: list = []  # connections inherited across fork: never used, never closed (the parent still owns them)


def _row(env: str, key: str, e: Entry) -> tuple:
    return (env, key, _cfg_json(e.config), e.median_ms, e.heuristic_ms, e.workspace,
            "[" + ",".join(f"[{_cfg_json(c)},{_num(t)}]" for c, t in e.runners_up) + "]", e.tuned_at)


def _entry(row) -> Entry:
    """The Entry of a stored row (config .. tuned_at); any problem raises CacheError."""
    config, median, heuristic, workspace, runners, tuned_at = row
    if not (isinstance(config, str) and isinstance(runners, str) and len(config) < 4096 and len(runners) < 16384):
        raise CacheError("stored config or runners_up is not JSON text of a sane size")
    try:
        d = {"config": json.loads(config), "median_ms": median, "heuristic_ms": heuristic, "workspace": workspace,
             "runners_up": json.loads(runners), "tuned_at": tuned_at}
    except (ValueError, RecursionError) as e:
        raise CacheError(f"stored config or runners_up is not JSON ({e})") from None
    return Entry.from_dict(d)


def _corrupt(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    msg = str(e)
    return "malformed" in msg or "not a database" in msg


def _errname(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return str(e) or type(e).__name__


def default_path() -> Path:
    """``algos.sqlite`` in ``config.cache_dir()``: ``$ATTN_LT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attn_lt``, else
    ``~/.cache/attn_lt``."""
    from . import config

    return Path(config.cache_dir()) / DB_FILE


class AlgoCache:
    """The algorithm cache stored at ``path`` (default :func:`default_path`), opened on first use.

    ``state`` says what it is: ``"ok"`` (the database, read and written), ``"read-only"`` (read; new entries are
    kept in memory) or ``"memory"`` (unusable: memory only); ``problem`` says why in words. ``get``/``put``
    never raise because of the store; ``clear``/``remove``/``import_file``/``export`` report failures as
    exceptions so that commands can say what happened."""

    def __init__(self, path: Path | str | None = None, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS):
        self.path = Path(path) if path is not None else default_path()
        self.busy_timeout_ms = busy_timeout_ms
        self.problem: str | None = None
        self.skipped_rows = 0  # rows that failed validation when read (reported once)
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        self._pid = -1
        # "rw" | "ro" | "memory" (opened to write, see _open); "reader" | "absent" | "unread" (opened to read only,
        # see _open_reader: a read never creates, converts, migrates or moves a file); None: not opened yet
        self._mode: str | None = None
        self._reader_state = "ok"  # the state a reader-mode store reports
        self._legacy_entries: dict[tuple[str, str], Entry] = {}  # an old algos.json, read (not migrated) by readers
        self._ino = None
        self._overlay: dict[tuple[str, str], Entry] = {}  # entries this process could not write
        self._warned: set[str] = set()
        self._retry_at = 0.0  # when put() next retries the entries a failed write kept in memory

    # -- opening ----------------------------------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg)

    def _degrade(self, reason: str) -> None:
        self._close()
        self._mode, self.problem = "memory", reason
        self._warn_once("memory", f"attn_lt: the algorithm cache {self.path} is unusable ({reason}); tuned "
                                  "algorithms are kept in memory for this process only")
        self._load_legacy_into_memory()

    def _close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
        self._db = None

    def _connect(self, uri: str | None = None) -> sqlite3.Connection:
        db = sqlite3.connect(uri or str(self.path), timeout=self.busy_timeout_ms / 1000, isolation_level=None,
                             check_same_thread=False, uri=uri is not None)
        db.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
        return db

    def _open(self) -> None:
        """Open (or create) the database; on any problem, degrade (one warning) or set a damaged one aside."""
        self._close()
        self._legacy_entries = {}
        self._pid = os.getpid()
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        try:
            rebuilt = 0
            while True:
                outcome = self._try_open()
                if outcome == "retry":  # set aside: open the new one (once)
                    rebuilt += 1
                    if rebuilt > 1:
                        self._degrade("it was damaged again right after being rebuilt")
                        return
                elif isinstance(outcome, sqlite3.Error):  # busy: another process is creating or converting it
                    if time.monotonic() > deadline:
                        self._degrade(f"it is locked by another process ({outcome} after {self.busy_timeout_ms} ms)")
                        return
                    time.sleep(0.02)
                else:
                    return
        except Exception as e:  # never fatal: whatever went wrong, memory only
            self._degrade(f"{type(e).__name__}: {_errname(e)}")

    def _try_open(self):
        """One attempt: "done" (opened, or degraded), "retry" (a damaged store was set aside), or the
        sqlite3.Error of a busy database."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._degrade(f"cannot create its directory {self.path.parent}: {_errname(e)}")
            return "done"
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            self._degrade(_errname(e))
            return "done"
        if st is not None and not stat.S_ISREG(st.st_mode):
            self._degrade(f"it is {_kind(st.st_mode)}, not a regular file")
            return "done"
        self._ino = st.st_ino if st is not None else None  # the file a set-aside may move, and no other
        writable = os.access(self.path.parent, os.W_OK) and (st is None or os.access(self.path, os.W_OK))
        if not writable and st is None:
            self._degrade(f"its directory {self.path.parent} is not writable")
            return "done"
        try:
            if writable:
                self._db = self._connect()
                mode = self._db.execute("PRAGMA journal_mode").fetchone()[0]
                if mode != "wal":
                    mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                self._db.execute("PRAGMA synchronous = NORMAL")
                self._db.execute("PRAGMA journal_size_limit = 67108864")
                log.debug("algorithm cache %s opened (journal mode %s)", self.path, mode)
            else:
                self._db = self._open_read_only()
            verdict = self._check_schema(create=writable)
        except sqlite3.Error as e:
            self._close()
            if _corrupt(e):
                return "retry" if self._set_aside(str(e)) else "done"
            if "locked" in str(e) or "busy" in str(e):
                return e
            self._degrade(str(e))
            return "done"
        if verdict == "foreign":
            self._close()
            return "retry" if self._set_aside("it is an SQLite database of another schema or version") else "done"
        if verdict is not None:  # newer schema: leave it alone
            self._close()
            self._degrade(verdict)
            return "done"
        try:
            self._ino = (st or os.stat(self.path)).st_ino
        except OSError:
            self._ino = None
        if writable:
            self._mode, self.problem = "rw", None
            self._migrate_legacy()
        else:
            self._mode = "ro"
            self.problem = "its file or directory is not writable"
            self._warn_once("ro", f"attn_lt: the algorithm cache {self.path} is read-only ({self.problem}); new "
                                  "tuned algorithms are kept in memory for this process only")
        return "done"

    def _open_read_only(self) -> sqlite3.Connection:
        base = "file:" + quote(str(self.path.resolve()))
        try:
            db = self._connect(base + "?mode=ro")
            db.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
            return db
        except sqlite3.Error as e:
            if _corrupt(e):
                raise
            # a WAL database in a directory we cannot write: no shared-memory file can be made; read it as is
            return self._connect(base + "?immutable=1")

    def _check_schema(self, create: bool) -> str | None:
        """None when the schema is ours (created if the database is empty), "foreign", or why not usable."""
        db = self._db
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables and create:
            db.execute("BEGIN IMMEDIATE")
            try:
                if not db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                    for sql in _CREATE:
                        db.execute(sql)
                    db.execute("INSERT INTO attn_lt_schema VALUES ('algo_cache', ?)", (DB_SCHEMA_VERSION,))
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)
                raise
            return None
        if "attn_lt_schema" not in tables or "entries" not in tables:
            return "foreign" if tables or create else "it holds no attn_lt tables"
        row = db.execute("SELECT version FROM attn_lt_schema WHERE name = 'algo_cache'").fetchone()
        v = row[0] if row else None
        if v == DB_SCHEMA_VERSION:
            return None
        if isinstance(v, int) and v > DB_SCHEMA_VERSION:
            return (f"it was written by a newer attn_lt (schema version {v}; this one reads version "
                    f"{DB_SCHEMA_VERSION}), so it is left as it is")
        return "foreign"

    def _set_aside(self, reason: str) -> bool:
        """Move a damaged database (and its WAL) aside; True when that happened and a new one can be made."""
        self._close()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        aside = self.path.with_name(f"{self.path.name}.bad-{stamp}")
        try:
            st = os.stat(self.path)
            if self._ino is not None and st.st_ino != self._ino:
                return True  # another process already replaced it: just open the new one
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True
        except OSError as e:
            self._degrade(f"it is damaged ({reason}) and could not be moved aside: {_errname(e)}")
            return False
        for suffix in ("-wal", "-shm"):  # a stale WAL must never meet the new database
            try:
                os.rename(str(self.path) + suffix, str(aside) + suffix)
            except OSError:
                pass
        self._ino = None
        log.warning("attn_lt: the algorithm cache %s was damaged (%s); moved it to %s and started a new one",
                    self.path, reason, aside.name)
        return True

    def _conn(self, write: bool = False) -> sqlite3.Connection | None:
        """The connection of this process (reopened after a fork, or when the file was removed or replaced), None
        when there is nothing to read. Reads open the store read-only (:meth:`_open_reader`); the first write opens
        it to write (:meth:`_open`: creating it, or setting a damaged one aside)."""
        if self._pid != os.getpid() or (self._mode in ("rw", "reader", "absent") and self._replaced()):
            if self._db is not None:
                _ABANDONED.append(self._db)  # never closed: its close could delete a newer store's WAL by name
                self._db = None
            self._mode = None
        if write and self._mode in (None, "reader", "absent", "unread"):
            self._open()
        elif self._mode is None:
            self._open_reader()
        return self._db

    def _replaced(self) -> bool:
        """Whether the file is no longer the one this process opened (``cache clear`` on a full disk removes it)
        or, for a store read as absent, whether it exists now."""
        try:
            st = os.stat(self.path)
        except OSError:
            return self._mode != "absent"
        return self._mode == "absent" or st.st_ino != self._ino

    def _open_reader(self) -> None:
        self._legacy_entries = {}
        self._open_reader_db()
        try:
            if self._legacy() != self.path and os.path.lexists(self._legacy()):
                self._read_legacy(lambda env, key, e: self._legacy_entries.setdefault((env, key), e))
        except OSError:
            pass

    def _open_reader_db(self) -> None:
        """Open the store to read only: an absent file reads as empty and is not created; a damaged, foreign or
        newer store is reported (``state``, one warning) and left where it is; nothing is converted or migrated.
        A writable store is opened read-write with ``query_only`` (so that SQLite removes its WAL files when the
        last connection closes), any other read-only."""
        self._close()
        self._pid = os.getpid()
        self._ino = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:  # nothing to read, whatever the directory (only writers need to make it)
            self._mode, self.problem, self._reader_state = "absent", None, "ok"
            return
        except OSError as e:
            self._unread("memory", _errname(e))
            return
        if not stat.S_ISREG(st.st_mode):
            self._unread("memory", f"it is {_kind(st.st_mode)}, not a regular file")
            return
        self._ino = st.st_ino
        writable = os.access(self.path.parent, os.W_OK) and os.access(self.path, os.W_OK)
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        while True:
            try:
                if writable:
                    self._db = self._connect("file:" + quote(str(self.path.resolve())) + "?mode=rw")
                    self._db.execute("PRAGMA query_only = ON")
                else:
                    self._db = self._open_read_only()
                verdict = self._check_schema(create=False)
                break
            except sqlite3.Error as e:
                self._close()
                if _corrupt(e):
                    self._unread("damaged", str(e))
                    return
                if ("locked" in str(e) or "busy" in str(e)) and time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                self._unread("memory", f"it is locked by another process ({e} after {self.busy_timeout_ms} ms)"
                             if "locked" in str(e) or "busy" in str(e) else str(e))
                return
            except Exception as e:  # never fatal
                self._close()
                self._unread("memory", f"{type(e).__name__}: {_errname(e)}")
                return
        if verdict == "it holds no attn_lt tables":  # an empty file: an empty store
            self._close()
            self._mode, self.problem, self._reader_state = "absent", None, "ok"
        elif verdict == "foreign":
            self._close()
            self._unread("damaged", "it is an SQLite database of another schema or version")
        elif verdict is not None:
            self._close()
            self._unread("memory", verdict)
        else:
            self._mode = "reader"
            self._reader_state, self.problem = ("ok", None) if writable else (
                "read-only", "its file or directory is not writable")

    def _directory_problem(self) -> str | None:
        """Why the store's directory could not be made or written, or None (it exists and is writable, or the
        nearest existing directory above it is)."""
        d = self.path.parent
        while True:
            try:
                st = os.stat(d)
            except FileNotFoundError:
                if d.parent == d:
                    return f"cannot create its directory {self.path.parent}"
                d = d.parent
                continue
            except OSError as e:
                return f"cannot create its directory {self.path.parent}: {_errname(e)}"
            if not stat.S_ISDIR(st.st_mode):
                return f"cannot create its directory {self.path.parent}: {d} is {_kind(st.st_mode)}"
            if not os.access(d, os.W_OK | os.X_OK):
                return f"its directory {d} is not writable"
            return None

    def _unread(self, state: str, reason: str) -> None:
        """A store a reader cannot use: reported once, left as it is (a write opens it again, and may set it
        aside)."""
        self._close()
        self._mode, self._reader_state, self.problem = "unread", state, reason
        if state == "damaged":
            self._warn_once("damaged", f"attn_lt: the algorithm cache {self.path} is damaged ({reason}); nothing "
                                       "is read from it and it is left as it is (the next write to the cache "
                                       "moves it aside)")
        else:
            self._warn_once("memory", f"attn_lt: the algorithm cache {self.path} is unusable ({reason}); tuned "
                                      "algorithms are kept in memory for this process only")

    # -- the old JSON file ------------------------------------------------------------------------------------
    def _legacy(self) -> Path:
        return self.path.with_name(LEGACY_FILE)

    def _read_legacy(self, sink) -> tuple[int, int, str | None]:
        """Feed the valid entries of the old algos.json to ``sink``; (taken, skipped, structural problem)."""
        skipped = []
        taken = 0
        try:
            with open_regular(self._legacy(), MAX_IMPORT_BYTES) as f:
                for env, key, e in read_document(f, str(self._legacy()), strict=False,
                                                 bad=lambda *a: skipped.append(a)):
                    sink(env, key, e)
                    taken += 1
        except CacheError as e:
            return taken, len(skipped), str(e)
        except OSError as e:
            return taken, len(skipped), _errname(e)
        return taken, len(skipped), None

    def _migrate_legacy(self) -> None:
        legacy = self._legacy()
        if legacy == self.path or not os.path.lexists(legacy):
            return
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            if not os.path.lexists(legacy):  # another process migrated it meanwhile
                db.execute("COMMIT")
                return
            taken, skipped, problem = self._read_legacy(
                lambda env, key, e: db.execute(_INSERT.replace("OR REPLACE", "OR IGNORE"), _row(env, key, e)))
            db.execute("COMMIT")
        except sqlite3.Error as e:
            _rollback(db)
            self._warn_once("legacy", f"attn_lt: could not migrate {legacy} into {self.path.name}: {e}")
            return
        dest = legacy.with_name(LEGACY_FILE + (".migrated" if problem is None else
                                               f".bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"))
        if os.path.lexists(dest):
            dest = dest.with_name(f"{dest.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            os.rename(legacy, dest)
            moved = f"renamed it {dest.name}"
        except FileNotFoundError:
            moved = "another process renamed it"
        except OSError as e:
            moved = f"could not rename it ({_errname(e)})"
        msg = (f"attn_lt: migrated {taken} entries of the old algorithm cache {legacy} into {self.path.name}"
               f"{f', skipped {skipped} that fail validation' if skipped else ''}"
               f"{f', stopped early: {problem}' if problem else ''}; {moved}")
        (log.warning if skipped or problem or "could not" in moved else log.info)(msg)
        for tmp in legacy.parent.glob(LEGACY_FILE + ".*.tmp"):  # temporary files an older attn_lt left behind
            try:
                if time.time() - tmp.stat().st_mtime > 600:
                    tmp.unlink()
            except OSError:
                pass

    def _load_legacy_into_memory(self) -> None:
        try:
            if self._legacy() == self.path or not os.path.lexists(self._legacy()):
                return
        except OSError:
            return
        taken, skipped, problem = self._read_legacy(
            lambda env, key, e: self._overlay.setdefault((env, key), e))
        if taken or skipped or problem:
            log.info("attn_lt: read %d entries of %s into memory (%d skipped%s)", taken, self._legacy(), skipped,
                     f"; {problem}" if problem else "")

    # -- status -----------------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``"ok"``, ``"read-only"``, ``"memory"`` or ``"damaged"`` (a reader found it damaged and left it as it
        is; see the class docstring); opens the store to read if needed (which creates nothing)."""
        with self._lock:
            self._conn()
            return {"rw": "ok", "ro": "read-only", "memory": "memory"}.get(self._mode, self._reader_state)

    def _bad_row(self, env, key, err) -> None:
        self.skipped_rows += 1
        self._warn_once("row", f"attn_lt: skipping a row of the algorithm cache {self.path} that fails "
                               f"validation (environment {str(env)[:80]!r}, gemm {str(key)[:120]!r}): {err}; it is "
                               "replaced when that GEMM is tuned again")

    def _on_error(self, e: sqlite3.Error, what: str) -> bool:
        """Handle a database error of a read or write; True when the operation may be retried once."""
        if _corrupt(e) and self._mode == "reader":
            self._unread("damaged", str(e))
            return False
        if _corrupt(e):
            if self._set_aside(str(e)):
                self._mode = None
                self._conn(write=True)
                return self._mode == "rw"
            return False
        self._warn_once(what, f"attn_lt: the algorithm cache {self.path} could not be {what} ({e})")
        return False

    # -- reading ----------------------------------------------------------------------------------------------
    def _select(self, sql: str, args=()) -> list:
        for attempt in range(2):
            db = self._conn()
            if db is None:
                return []
            try:
                return db.execute(sql, args).fetchall()
            except sqlite3.Error as e:
                if not (self._on_error(e, "read") and attempt == 0):
                    return []
        return []

    def get(self, env: Env, key) -> Entry | None:
        """The stored winner for ``key`` (a GemmKey or any key, see :func:`key_string`) in ``env``, or None."""
        try:
            ks = key_string(key)
        except CacheError as e:
            self._warn_once("key", f"attn_lt: cannot look up a key of the algorithm cache: {e}")
            return None
        ek = env.key()
        with self._lock:
            if (ek, ks) in self._overlay:
                return self._overlay[(ek, ks)]
            rows = self._select(f"SELECT {_COLS} FROM entries WHERE env = ? AND gemm = ?", (ek, ks))
            if not rows:
                return self._legacy_entries.get((ek, ks))
        try:
            return _entry(rows[0][2:])
        except CacheError as err:
            self._bad_row(ek, ks, err)
            return None

    def _valid(self, rows):
        for row in rows:
            try:
                Env.parse(row[0])
                parse_key(row[1])
                yield row[0], row[1], _entry(row[2:])
            except CacheError as err:
                self._bad_row(row[0], row[1], err)

    def _merged(self, rows, env: str | None = None, key: str | None = None):
        """Stored rows (sorted by env, key) merged with this process's unwritten entries (which win) and, for a
        reader, an old algos.json not migrated yet (which loses)."""
        def pick(d):
            return sorted((e, k, x) for (e, k), x in d.items()
                          if (env is None or e == env) and (key is None or k == key))

        extra, legacy = pick(self._overlay), pick(self._legacy_entries)
        if not extra and not legacy:
            yield from self._valid(rows)
            return
        streams = [((e, k, 0, x) for e, k, x in extra), ((e, k, 1, x) for e, k, x in self._valid(rows)),
                   ((e, k, 2, x) for e, k, x in legacy)]
        last = None
        for e, k, _, x in heapq.merge(*streams, key=lambda r: (r[0], r[1], r[2])):
            if (e, k) != last:
                last = (e, k)
                yield e, k, x

    def items(self, env: str | None = None) -> list[tuple[str, str, Entry]]:
        """(environment key, GEMM key string, Entry) for every valid entry (of ``env`` if given), sorted; rows
        that fail validation are skipped (counted in ``skipped_rows``, reported once)."""
        with self._lock:
            if env is None:
                rows = self._select(f"SELECT {_COLS} FROM entries ORDER BY env, gemm")
            else:
                rows = self._select(f"SELECT {_COLS} FROM entries WHERE env = ? ORDER BY gemm", (env,))
            return list(self._merged(rows, env))

    def lookup(self, key) -> list[tuple[str, Entry]]:
        """(environment key, Entry) of every environment that has ``key`` (a key string or key object)."""
        ks = key if isinstance(key, str) else key_string(key)
        with self._lock:
            rows = self._select(f"SELECT {_COLS} FROM entries WHERE gemm = ? ORDER BY env", (ks,))
            return [(e, x) for e, _, x in self._merged(rows, key=ks)]

    def count(self) -> int:
        """How many entries the store holds (rows, valid or not) plus this process's unwritten ones."""
        with self._lock:
            rows = self._select("SELECT COUNT(*) FROM entries")
            return (rows[0][0] if rows else 0) + len(self._overlay) + len(self._legacy_entries)

    def unsaved(self) -> int:
        """How many entries this process holds that the store could not take (read-only, unusable, full)."""
        with self._lock:
            return len(self._overlay)

    def reload(self) -> None:
        """Open the store again on next use (its state is re-evaluated: a directory made writable is used)."""
        with self._lock:
            self._close()
            self._mode = None

    def close(self) -> None:
        """Close the store, first writing what a busy store made this process keep (a warning names what is
        lost)."""
        with self._lock:
            self._flush_at_exit()
            self._close()
            self._mode = None

    # -- writing ----------------------------------------------------------------------------------------------
    def _transact(self, fn, what: str, wait_s: float = 0.0):
        """Run ``fn(db)`` in one write transaction; returns its result, or raises CacheStoreError saying why
        nothing was written. A busy store is waited for ``busy_timeout_ms``, then (``wait_s``) retried until
        ``wait_s`` seconds have passed."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            db = self._conn(write=True)
            if self._mode != "rw":
                raise CacheStoreError(f"the algorithm cache {self.path} cannot be written ({self.problem}); "
                                      f"nothing was {what}")
            try:
                db.execute("BEGIN IMMEDIATE")
                if self._replaced():  # removed while this process waited for the lock: write the new file
                    _rollback(db)
                    self._conn(write=True)
                    continue
                result = fn(db)
                db.execute("COMMIT")
                return result
            except sqlite3.Error as e:
                _rollback(db)
                attempt += 1
                if _corrupt(e) and attempt == 1 and self._on_error(e, "written"):
                    continue
                busy = "locked" in str(e) or "busy" in str(e)
                if busy and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                err = CacheStoreError(f"the algorithm cache {self.path} could not be written ({e}"
                                      f"{f', busy for {wait_s:.0f} s' if busy and wait_s else ''}); nothing was "
                                      f"{what}")
                err.busy, err.full = busy, _full(e)
                raise err from None
            except BaseException:
                _rollback(db)
                raise

    def _pending_rows(self) -> list:
        """Rows of the entries this process kept in memory because a write failed (busy, locked, full) while the
        store itself is writable: they are written with the next write, and before exit."""
        return [_row(e, k, x) for (e, k), x in self._overlay.items()]

    def _write_with_pending(self, db, row=None, pending: bool = True) -> int:
        rows = self._pending_rows() if pending else []
        if rows:
            db.executemany(_INSERT, rows)
        if row is not None:
            db.execute(_INSERT, row)
        return len(rows)

    def put(self, env: Env, key, entry: Entry) -> bool:
        """Store ``entry`` for ``key`` in ``env``; True when it reached the database. Never raises: a store that
        cannot be written keeps the entry in this process's memory (reported once); when the store is writable
        but was busy or full, the entries kept are written with the next write and, at the latest, when the
        process exits."""
        try:
            ks, ek = key_string(key), env.key()
            Env.parse(ek)
            row = _row(ek, ks, Entry.from_dict(entry.to_dict()))  # never store what could not be read back
        except (CacheError, ValueError, TypeError, AttributeError) as e:
            self._warn_once("entry", f"attn_lt: not storing an invalid algorithm cache entry: {e}")
            return False
        with self._lock:
            retry = bool(self._overlay) and time.monotonic() >= self._retry_at  # at most once a second
            try:
                self._transact(lambda db: self._write_with_pending(db, row, retry), "stored")
            except CacheStoreError as e:
                self._retry_at = time.monotonic() + 1.0
                self._overlay[(ek, ks)] = entry
                if self._mode == "rw":  # memory / read-only were reported when opened
                    _PENDING.add(self)
                    self._warn_once("write", f"attn_lt: {e}; keeping new entries in memory and writing them with "
                                             "the next write or before this process exits")
                return False
            except Exception as e:  # never fatal
                self._overlay[(ek, ks)] = entry
                self._warn_once("write", f"attn_lt: could not store an entry in {self.path} "
                                         f"({type(e).__name__}: {e}); keeping it in memory")
                return False
            if retry:
                self._overlay.clear()  # this entry, and every one kept before: written with it
            else:
                self._overlay.pop((ek, ks), None)
            return True

    def flush(self, wait_s: float = 0.0) -> int:
        """Write the entries kept in memory after a failed write (waiting up to ``wait_s`` seconds for a busy
        store); returns how many are still unsaved. Never raises."""
        with self._lock:
            if not self._overlay:
                return 0
            try:
                self._transact(self._write_with_pending, "stored", wait_s=wait_s)
            except Exception:
                return len(self._overlay)
            self._overlay.clear()
            return 0

    def _flush_at_exit(self) -> None:
        n = len(self._overlay)
        if n and self._mode not in ("memory", "ro"):  # kept because the store was busy or full, not unusable
            left = self.flush(EXIT_FLUSH_WAIT_S)
            if left:
                log.warning("attn_lt: %d tuned %s could not be written to the algorithm cache %s before exit "
                            "(it stayed busy or full); they are lost", left, "entry" if left == 1 else "entries",
                            self.path)
            else:
                log.info("attn_lt: wrote %d entries kept in memory to %s before exit", n, self.path)

    def remove(self, keys) -> int:
        """Remove the entries ``keys`` ((environment key, GEMM key string) pairs); returns how many the store
        held. Raises :class:`CacheStoreError` when the store cannot be written (nothing removed)."""
        keys = list(keys)
        with self._lock:
            n = self._transact(lambda db: sum(db.execute("DELETE FROM entries WHERE env = ? AND gemm = ?",
                                                         (e, k)).rowcount for e, k in keys), "removed")
            for k in keys:
                self._overlay.pop(tuple(k), None)
            return n

    def clear(self) -> int:
        """Remove every entry, for good (other processes write per row and never bring them back), and give the
        space back (VACUUM, then the WAL truncated); returns how many the store held. On a full disk, where
        even a delete cannot be written, the file itself is removed under the store's write lock (processes
        that have it open notice and open the new one). A store that does not exist is left absent. Raises
        :class:`CacheStoreError` when the store cannot be written (nothing removed)."""
        with self._lock:
            if self._mode in (None, "absent") and not os.path.lexists(self.path):
                self._conn()
                if self._mode == "absent" and not self._legacy_entries:  # nothing to remove, no file to create
                    self._overlay.clear()
                    return 0
            try:
                n = self._transact(lambda db: db.execute("DELETE FROM entries").rowcount, "removed")
            except CacheStoreError as e:
                if not getattr(e, "full", False):
                    raise
                n = self._remove_file()
            else:
                self._compact()
            self._overlay.clear()
            return n

    def _compact(self) -> None:
        """Give the space of removed rows back to the file system (best effort: a busy store stays its size)."""
        db = self._db
        try:
            db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as e:
            log.info("attn_lt: the algorithm cache %s was cleared but not compacted (%s)", self.path, e)

    def _remove_file(self) -> int:
        """Clear a store on a full disk: take its write lock (which writes nothing), count, remove the database
        and its WAL files; returns how many entries it held. Raises CacheStoreError if it cannot."""
        db = self._conn(write=True)
        try:
            db.execute("BEGIN IMMEDIATE")
            n = db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
            os.unlink(self.path)
        except (sqlite3.Error, OSError) as e:
            _rollback(db)
            raise CacheStoreError(f"the algorithm cache {self.path} could not be cleared on a full disk "
                                  f"({_errname(e) if isinstance(e, OSError) else e}); nothing was removed") from None
        for suffix in ("-wal", "-shm"):
            try:
                os.unlink(str(self.path) + suffix)
            except OSError:
                pass
        _rollback(db)
        _ABANDONED.append(db)  # never closed: its close would delete, by name, the WAL of the next store
        self._db, self._mode = None, None
        log.info("attn_lt: the disk is full: removed the algorithm cache %s (%d entries) instead of deleting its "
                 "rows", self.path, n)
        return n

    def export(self, dest) -> int:
        """Write every valid entry to ``dest`` (a path, or a text file object) as a JSON cache document, one entry
        a line; returns how many. A path is written through a temporary file beside it (``FILE.partial-<pid>``)
        and renamed, so it is never left half-written; those of processes that died (SIGKILL) are removed by the
        next export to the same file. FIFOs and devices are refused. A store that exists but cannot be read
        (damaged, a newer schema, a directory, ...) raises :class:`CacheStoreError`: nothing is exported (unless
        this process holds entries in memory: those are)."""
        with self._lock:
            if self.state in ("memory", "damaged") and not self._overlay:
                raise CacheStoreError(f"the algorithm cache {self.path} cannot be read ({self.problem}); nothing "
                                      "was exported")
        if hasattr(dest, "write"):
            with self._lock:
                try:
                    return write_document(dest, self._export_rows())
                except sqlite3.Error as e:
                    raise CacheStoreError(f"the algorithm cache {self.path} could not be read ({e})") from None
        p = os.fspath(dest)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise CacheError(f"{p} is {_kind(st.st_mode)}; export writes regular files only")
        remove_stale_partials(p)
        tmp = f"{p}.partial-{os.getpid()}"
        try:
            with self._lock, open(tmp, "w", encoding="utf-8") as f:
                n = write_document(f, self._export_rows())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, sqlite3.Error):
                raise CacheStoreError(f"the algorithm cache {self.path} could not be read ({e}); nothing was "
                                      "exported") from None
            raise
        return n

    def _export_rows(self):
        db = self._conn()
        rows = db.execute(f"SELECT {_COLS} FROM entries ORDER BY env, gemm") if db is not None else iter(())
        return self._merged(rows)

    def import_file(self, src) -> int:
        """Merge the entries of the JSON cache document ``src``; returns how many entries were stored.

        The file is read twice, streamed: first validated whole (nothing is written if any part is bad), then
        written :data:`IMPORT_BATCH` entries a transaction, so that other processes' writes (tuning) interleave
        with an import of any size and concurrent imports take turns; a batch waits up to :data:`IMPORT_WAIT_S`
        for the store. Raises :class:`CacheError` for a bad or refused file (nothing imported),
        :class:`CacheStoreError` when the store cannot be written: nothing imported, or (:class:`ImportIncomplete`,
        its ``imported`` and ``total``) the first batches only; importing the file again completes it (entries
        are replaced, never duplicated)."""
        name = os.fspath(src)
        with open_regular(src, MAX_IMPORT_BYTES) as f:
            total = sum(1 for _ in read_document(f, name))
            with self._lock:
                self._transact(lambda db: None, "imported")  # a store that cannot be written says so, even for 0
            f.seek(0)
            n, batch = 0, []

            def write(rows):
                with self._lock:
                    self._transact(lambda db: db.executemany(_INSERT, rows), "imported", wait_s=IMPORT_WAIT_S)

            try:
                for env, key, e in read_document(f, name):
                    batch.append(_row(env, key, e))
                    if len(batch) >= IMPORT_BATCH:
                        write(batch)
                        n += len(batch)
                        batch = []
                if batch:
                    write(batch)
                    n += len(batch)
            except (CacheError, CacheStoreError) as e:
                if n == 0:
                    raise
                what = ("the file changed while it was imported" if isinstance(e, CacheError)
                        else "the store could not be written")
                msg = str(e).replace("; nothing was imported", "")
                raise ImportIncomplete(f"{msg}; {n} of {total} entries were imported before {what}", n, total) \
                    from None
            return n

    # -- streaming -------------------------------------------------------------------------------------------
    def iter_items(self, env: str | None = None):
        """As :meth:`items`, streamed from the database (memory independent of the number of entries; the
        store's lock is held until the iteration ends). Raises :class:`CacheStoreError` if a read fails."""
        with self._lock:
            db = self._conn()
            try:
                if db is None:
                    rows = iter(())
                elif env is None:
                    rows = db.execute(f"SELECT {_COLS} FROM entries ORDER BY env, gemm")
                else:
                    rows = db.execute(f"SELECT {_COLS} FROM entries WHERE env = ? ORDER BY gemm", (env,))
                yield from self._merged(rows, env)
            except sqlite3.Error as e:
                raise CacheStoreError(f"the algorithm cache {self.path} could not be read ({e})") from None


class ImportIncomplete(CacheStoreError):
    """An import that stopped after writing its first batches: ``imported`` of ``total`` entries are stored."""

    def __init__(self, message: str, imported: int, total: int):
        super().__init__(message)
        self.imported, self.total = imported, total


def _full(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return (code is not None and code & 0xFF == 13) or "disk is full" in str(e) or "disk I/O error" in str(e)


def remove_stale_partials(path) -> int:
    """Remove the ``PATH.partial-<pid>`` files that exports by processes no longer running left beside
    ``path``; returns how many."""
    p = Path(os.fspath(path))
    n = 0
    try:
        candidates = list(p.parent.glob(glob_escape(p.name) + ".partial-*"))
    except OSError:
        return 0
    for c in candidates:
        pid = c.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or not ours to signal): its export may be under way
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, OSError):
            continue
        try:
            os.unlink(c)
            n += 1
            log.info("attn_lt: removed %s, left by an export that did not finish", c)
        except OSError:
            pass
    return n


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


_PENDING: "set[AlgoCache]" = set()  # caches holding entries a busy store made them keep (kept alive until written)


@atexit.register
def _flush_pending() -> None:
    for c in list(_PENDING):
        try:
            c._flush_at_exit()
        except Exception:  # never fail an exit
            pass


def _rollback(db) -> None:
    try:
        db.execute("ROLLBACK")
    except sqlite3.Error:
        pass


_default: AlgoCache | None = None


def default_cache() -> AlgoCache:
    """The process-wide cache at :func:`default_path` (re-created if ``ATTN_LT_CACHE_DIR`` changes)."""
    global _default
    path = default_path()
    if _default is None or _default.path != path:
        _default = AlgoCache(path)
    return _default
