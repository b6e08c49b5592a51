"""The per-shape algorithm cache: which cuBLASLt configuration won for each GEMM, on which GPU and library.

File format (JSON, data only)::

    {"schema": "attn_lt.algo_cache", "version": 1,
     "entries": {"<environment>": {"<gemm key>": {"config": {...}, "median_ms": .., "heuristic_ms": ..,
                                                   "workspace": .., "runners_up": [[{...}, ms], ..],
                                                   "tuned_at": "..."}}}}

The environment (GPU name, compute capability, SM count, cuBLASLt version) makes an entry valid: entries of other
environments are kept but never used. Writes are atomic (temporary file + rename) and made under an exclusive lock
on ``<file>.lock`` after re-reading the file, so processes sharing one file merge their entries instead of losing
them. A file that cannot be read as this schema and version is reported once, renamed aside
(``<file>.bad-<time>``) and rebuilt; a write that fails (full disk, read-only directory) is reported once and the
entries stay in memory.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .lt.cublaslt import GemmKey

log = logging.getLogger("attn_lt")

SCHEMA = "attn_lt.algo_cache"
VERSION = 1
MAX_FILE_BYTES = 64 << 20
MAX_RUNNERS_UP = 4


class CacheError(ValueError):
    """A cache file or entry that is malformed, hostile, or of another schema; the message says which part."""


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
        m = re.fullmatch(r"(.{1,128})\|sm(\d{1,2}\.\d{1,2})\|(\d{1,5})sm\|cublasLt(\d{1,10})", s)
        if not m:
            raise CacheError(f"malformed environment key {s[:80]!r}")
        return cls(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)))

    @classmethod
    def current(cls, device: int = 0) -> Env:
        import torch
        from nvmath.bindings import cublasLt

        p = torch.cuda.get_device_properties(device)
        return cls(p.name, f"{p.major}.{p.minor}", p.multi_processor_count, int(cublasLt.get_version()))


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
        return {"config": asdict(self.config), "median_ms": self.median_ms, "heuristic_ms": self.heuristic_ms,
                "workspace": self.workspace, "runners_up": [[asdict(c), t] for c, t in self.runners_up],
                "tuned_at": self.tuned_at}

    @classmethod
    def from_dict(cls, d) -> Entry:
        """Strictly typed: anything unexpected raises :class:`CacheError`."""
        if not isinstance(d, dict) or set(d) != {"config", "median_ms", "heuristic_ms", "workspace", "runners_up",
                                                 "tuned_at"}:
            raise CacheError(f"entry must have exactly config, median_ms, heuristic_ms, workspace, runners_up, "
                             f"tuned_at; got {sorted(d) if isinstance(d, dict) else type(d).__name__}")
        runners = d["runners_up"]
        if not isinstance(runners, list) or len(runners) > MAX_RUNNERS_UP or not all(
                isinstance(r, list) and len(r) == 2 for r in runners):
            raise CacheError("runners_up must be a list of at most 4 [config, ms] pairs")
        return cls(_config(d["config"]), _ms(d["median_ms"]), None if d["heuristic_ms"] is None else _ms(
            d["heuristic_ms"]), _int(d["workspace"], 0, 1 << 40, "workspace"),
            tuple((_config(c), _ms(t)) for c, t in runners), _str(d["tuned_at"], 40, "tuned_at"))


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
    names = [f.name for f in fields(AlgoConfig)]
    if not isinstance(d, dict) or set(d) != set(names):
        raise CacheError(f"config must have exactly the fields {names}")
    return AlgoConfig(**{n: _int(d[n], 0, 1 << 31, n) for n in names})


# ---- keys -----------------------------------------------------------------------------------------------------

_KEY_RE = re.compile(r"(qk|pv)\|(bf16|fp16)\|m(\d+)\|n(\d+)\|k(\d+)\|b(\d+)\|([NT])([NT])\|ld(\d+),(\d+),(\d+)"
                     r"\|st(\d+),(\d+),(\d+)\|al(\d+),(\d+),(\d+)")


def key_string(k: GemmKey) -> str:
    """The stable text form of a GEMM key, used in the file and on the command line."""
    return (f"{k.role}|{k.dtype}|m{k.m}|n{k.n}|k{k.k}|b{k.batch}|{'T' if k.trans_a else 'N'}"
            f"{'T' if k.trans_b else 'N'}|ld{k.lda},{k.ldb},{k.ldc}|st{k.stride_a},{k.stride_b},{k.stride_c}"
            f"|al{k.align_a},{k.align_b},{k.align_c}")


def parse_key(s: str) -> GemmKey:
    m = _KEY_RE.fullmatch(s) if isinstance(s, str) and len(s) < 300 else None
    if not m:
        raise CacheError(f"malformed GEMM key {str(s)[:80]!r}")
    g = m.groups()
    nums = [int(x) for x in g[2:6]] + [int(x) for x in g[8:]]
    if any(n >= 1 << 48 for n in nums):
        raise CacheError(f"GEMM key {s[:80]!r} has out-of-range numbers")
    m_, n_, k_, b_, lda, ldb, ldc, sa, sb, sc, aa, ab, ac = nums
    return GemmKey(g[0], g[1], m_, n_, k_, b_, g[6] == "T", g[7] == "T", lda, ldb, ldc, sa, sb, sc, aa, ab, ac)


def parse_document(doc) -> dict[str, dict[str, Entry]]:
    """Validate a whole cache document; raises :class:`CacheError` naming the first problem."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise CacheError(f"not an attn_lt algorithm cache (schema {SCHEMA!r} expected)")
    if doc.get("version") != VERSION:
        raise CacheError(f"cache version {doc.get('version')!r}, this attn_lt reads version {VERSION}")
    if set(doc) != {"schema", "version", "entries"} or not isinstance(doc["entries"], dict):
        raise CacheError("a cache document has exactly schema, version and entries (an object)")
    out: dict[str, dict[str, Entry]] = {}
    for env, per in doc["entries"].items():
        Env.parse(env)
        if not isinstance(per, dict):
            raise CacheError(f"entries of {env[:60]!r} must be an object")
        for key, e in per.items():
            parse_key(key)
            try:
                out.setdefault(env, {})[key] = Entry.from_dict(e)
            except CacheError as err:
                raise CacheError(f"entry {key}: {err}") from None
    return out


def _document(entries: dict[str, dict[str, Entry]]) -> dict:
    return {"schema": SCHEMA, "version": VERSION,
            "entries": {env: {k: e.to_dict() for k, e in sorted(per.items())} for env, per in sorted(entries.items())}}


def default_path() -> Path:
    """``$ATTN_LT_CACHE_DIR/algos.json``, else ``$XDG_CACHE_HOME/attn_lt/algos.json``, else ~/.cache/attn_lt."""
    from . import config

    return config.cache_dir() / "algos.json"


class AlgoCache:
    """The cache file at ``path`` (default :func:`default_path`), read once, kept in memory, merged on write."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path is not None else default_path()
        self._entries: dict[str, dict[str, Entry]] | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # -- reading ------------------------------------------------------------------------------------------------
    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg)

    def _read_file(self) -> dict[str, dict[str, Entry]]:
        """The file's entries; a missing file is empty; a bad one is set aside (reported once) and empty."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return {}
        try:
            if size > MAX_FILE_BYTES:
                raise CacheError(f"{size} bytes, more than {MAX_FILE_BYTES}")
            with open(self.path, "rb") as f:
                return parse_document(json.loads(f.read().decode("utf-8")))
        except (CacheError, ValueError, UnicodeDecodeError, RecursionError) as e:
            aside = self.path.with_name(f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            self._warn_once("bad", f"attn_lt: algorithm cache {self.path} is unreadable ({e}); moved it to "
                                   f"{aside.name} and starting a new one")
            return {}
        except OSError as e:
            self._warn_once("read", f"attn_lt: cannot read algorithm cache {self.path}: {e}; using memory only")
            return {}

    def _loaded(self) -> dict[str, dict[str, Entry]]:
        if self._entries is None:
            self._entries = self._read_file()
        return self._entries

    def get(self, env: Env, key: GemmKey) -> Entry | None:
        with self._lock:
            return self._loaded().get(env.key(), {}).get(key_string(key))

    def items(self):
        """(environment key, GEMM key string, Entry) for every entry, sorted."""
        with self._lock:
            return [(env, k, e) for env, per in sorted(self._loaded().items()) for k, e in sorted(per.items())]

    def reload(self) -> None:
        with self._lock:
            self._entries = None

    # -- writing ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _file_lock(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a+") as lf:
            fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lf.fileno(), fcntl.LOCK_UN)

    def _write(self, mutate) -> bool:
        """Under the file lock: re-read the file, apply ``mutate(entries)``, write atomically. False (reported
        once) when the file cannot be written; memory is updated either way."""
        with self._lock:
            mine = self._loaded()
            try:
                with self._file_lock():
                    merged = self._read_file()
                    for env, per in mine.items():  # keep what only this process knows
                        for k, e in per.items():
                            merged.setdefault(env, {}).setdefault(k, e)
                    mutate(merged)
                    fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
                    try:
                        with os.fdopen(fd, "w") as f:
                            json.dump(_document(merged), f, indent=1)
                            f.flush()
                            os.fsync(f.fileno())
                        os.replace(tmp, self.path)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        raise
                self._entries = merged
                return True
            except OSError as e:
                mutate(mine)
                self._warn_once("write", f"attn_lt: cannot write algorithm cache {self.path}: {e}; keeping "
                                         "entries in memory only")
                return False

    def put(self, env: Env, key: GemmKey, entry: Entry) -> bool:
        def mutate(entries):
            entries.setdefault(env.key(), {})[key_string(key)] = entry

        return self._write(mutate)

    def remove(self, keys: list[tuple[str, str]]) -> bool:
        def mutate(entries):
            for env, k in keys:
                entries.get(env, {}).pop(k, None)
            for env in [e for e, per in entries.items() if not per]:
                del entries[env]

        return self._write(mutate)

    def clear(self) -> bool:
        with self._lock:
            self._entries = {}
        return self._write(lambda entries: entries.clear())

    def export(self, dest: Path | str) -> int:
        items = self.items()
        entries: dict[str, dict[str, Entry]] = {}
        for env, k, e in items:
            entries.setdefault(env, {})[k] = e
        Path(dest).write_text(json.dumps(_document(entries), indent=1))
        return len(items)

    def import_file(self, src: Path | str) -> int:
        """Merge a cache file (validated strictly; nothing is written if any part is bad). Returns entries read."""
        src = Path(src)
        if src.stat().st_size > MAX_FILE_BYTES:
            raise CacheError(f"{src} is larger than {MAX_FILE_BYTES} bytes")
        try:
            incoming = parse_document(json.loads(src.read_text(encoding="utf-8")))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            if isinstance(e, CacheError):
                raise
            raise CacheError(f"{src} is not valid JSON: {e}") from None

        def mutate(entries):
            for env, per in incoming.items():
                entries.setdefault(env, {}).update(per)

        self._write(mutate)
        return sum(len(p) for p in incoming.values())


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


_default: AlgoCache | None = None


def default_cache() -> AlgoCache:
    """The process-wide cache at :func:`default_path` (re-created if ATTN_LT_CACHE_DIR changes)."""
    global _default
    if _default is None or _default.path != default_path():
        _default = AlgoCache()
    return _default
