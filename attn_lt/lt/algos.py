"""Algorithm choice for one GEMM: cuBLASLt's heuristic, the per-shape cache, or a bounded tuned search.

Policy (``config.algo_policy``): ``tune`` looks the GEMM up in the cache and, on a miss, searches and stores the
winner; ``cache`` uses cached winners and never tunes; ``heuristic`` uses cuBLASLt's top-1 only.

The search: candidate configurations are cuBLASLt's heuristic top results plus, for each algorithm id from
``matmul_algo_get_ids``, explicit configurations from its capabilities (the ``TILES_PER_ALGO`` tiles of ``TILE_IDS``
that pad the GEMM's m x n least, times the last ``STAGES_PER_ALGO`` of ``STAGES_IDS``); each is varied over split-K
in {1, 2, 4, ..., 64} (where ``SPLITK_SUPPORT`` allows) times every scheme of ``REDUCTION_SCHEME_MASK``; every
configuration is validated by ``matmul_algo_check`` within the workspace budget (at most ``MAX_CANDIDATES``: the
heuristic's first, then the split-K variants, then the rest). On Hopper the heuristic's algorithm (id 66) takes no
split-K configuration at all, so split-K comes from the older algorithm ids. Candidates are timed with CUDA events
on the call's own operands (real data) in random order, the heuristic's choice first, until the time budget
(``ATTN_LT_TUNE_MS``) runs out; the winner must beat the heuristic, else the heuristic's choice is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..cache import AlgoConfig, Entry, current_env, default_cache, now
from .cublaslt import CUDA_R_32F, CUDA_TYPES, CublasLtError, GemmKey, call, compute_32f, lib

log = logging.getLogger("attn_lt")

SPLITS = (1, 2, 4, 8, 16, 32, 64)
MAX_CANDIDATES = 64
HEURISTIC_TOP = 8
MAX_ALGO_IDS = 24
TILES_PER_ALGO = 2
STAGES_PER_ALGO = 2
_CONFIG_FIELDS = ("algo_id", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "cluster", "inner")


def _attrs():
    A = lib().MatmulAlgoConfigAttribute
    return dict(zip(_CONFIG_FIELDS, (A.ID, A.TILE_ID, A.STAGES_ID, A.SPLITK_NUM, A.REDUCTION_SCHEME, A.CTA_SWIZZLING,
                                     A.CUSTOM_OPTION, A.CLUSTER_SHAPE_ID, A.INNER_SHAPE_ID)))


def read_config(algo: np.ndarray) -> AlgoConfig:
    """The full configuration of a cublasLtMatmulAlgo_t (a 1-element ``matmul_algo_dtype`` array)."""
    L = lib()
    vals = {}
    written = np.zeros(1, dtype=np.uint64)
    for name, attr in _attrs().items():
        buf = np.zeros(1, dtype=L.get_matmul_algo_config_attribute_dtype(attr))
        L.matmul_algo_config_get_attribute(algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes,
                                           written.ctypes.data)
        vals[name] = int(buf[0])
    return AlgoConfig(**vals)


def make_algo(gemm, cfg: AlgoConfig) -> np.ndarray:
    """A cublasLtMatmulAlgo_t for ``cfg`` (not yet validated)."""
    L = lib()
    algo = np.zeros(1, dtype=L.matmul_algo_dtype)
    k = gemm.key
    call(f"cublasLtMatmulAlgoInit (algo {cfg.algo_id})", L.matmul_algo_init, gemm.handle,
          compute_32f(), CUDA_R_32F, CUDA_TYPES[k.dtype], CUDA_TYPES[k.dtype], CUDA_TYPES[k.out_dtype],
          CUDA_TYPES[k.out_dtype], cfg.algo_id, algo.ctypes.data)
    for name, attr in _attrs().items():
        if name == "algo_id":
            continue
        buf = np.array([getattr(cfg, name)], dtype=L.get_matmul_algo_config_attribute_dtype(attr))
        call(f"cublasLtMatmulAlgoConfigSetAttribute ({name})", L.matmul_algo_config_set_attribute,
              algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes)
    return algo


def check(gemm, algo: np.ndarray) -> int | None:
    """Workspace bytes ``algo`` needs for this GEMM, or None when cuBLASLt refuses it."""
    L = lib()
    result = np.zeros(1, dtype=L.matmul_heuristic_result_dtype)
    try:
        L.matmul_algo_check(gemm.handle, gemm.desc, gemm.a, gemm.b, gemm.c, gemm.c, algo.ctypes.data,
                            result.ctypes.data)
    except L.cuBLASLtError:
        return None
    return int(result[0]["workspace_size"])


def _cap(algo: np.ndarray, attr) -> int:
    L = lib()
    buf = np.zeros(1, dtype=L.get_matmul_algo_cap_attribute_dtype(attr))
    written = np.zeros(1, dtype=np.uint64)
    L.matmul_algo_cap_get_attribute(algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return int(buf[0])


def _cap_list(algo: np.ndarray, attr) -> list[int]:
    """A variable-length capability (TILE_IDS, STAGES_IDS): size first, then the values."""
    L = lib()
    written = np.zeros(1, dtype=np.uint64)
    L.matmul_algo_cap_get_attribute(algo.ctypes.data, int(attr), 0, 0, written.ctypes.data)
    n = int(written[0]) // 4
    if n == 0:
        return []
    buf = np.zeros(n, dtype=np.uint32)
    L.matmul_algo_cap_get_attribute(algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return [int(x) for x in buf]


def _tile_waste(tile: int, m: int, n: int) -> tuple[float, int]:
    """(padding factor, -area) of covering m x n with this tile; unknown tiles last."""
    import re

    try:
        name = lib().MatmulTile(tile).name
    except ValueError:
        return (float("inf"), 0)
    mt = re.search(r"(\d+)x(\d+)", name)
    if not mt:
        return (float("inf"), 0)
    tm, tn = int(mt.group(1)), int(mt.group(2))
    return (-(-m // tm) * tm * -(-n // tn) * tn / (m * n), -tm * tn)


class _Caps:
    """Capabilities of one algorithm id for one GEMM (they do not depend on the configuration)."""

    def __init__(self, gemm, algo_id: int):
        C = lib().MatmulAlgoCapAttribute
        probe = make_algo(gemm, AlgoConfig(algo_id))
        self.splitk = bool(_cap(probe, C.SPLITK_SUPPORT))
        self.schemes = [r for r in (1, 2, 4) if _cap(probe, C.REDUCTION_SCHEME_MASK) & r] or [0]
        self.tiles = [t for t in _cap_list(probe, C.TILE_IDS) if t]
        self.stages = [s for s in _cap_list(probe, C.STAGES_IDS) if s]


def _explicit_configs(gemm, caps: _Caps, algo_id: int) -> list[AlgoConfig]:
    """Configurations of one algorithm id built from its tile and stage capabilities."""
    tiles = sorted(caps.tiles, key=lambda t: _tile_waste(t, gemm.key.m, gemm.key.n))[:TILES_PER_ALGO] or [0]
    stages = caps.stages[-STAGES_PER_ALGO:] or [0]
    return [AlgoConfig(algo_id, tile=t, stages=st) for t in tiles for st in stages]


def candidates(gemm, workspace_limit: int) -> list[tuple[AlgoConfig, np.ndarray, int]]:
    """Valid (config, algo, workspace) candidates, the heuristic's top-1 first."""
    L = lib()
    bases: list[AlgoConfig] = []
    for h in gemm.heuristic(workspace_limit, HEURISTIC_TOP):
        a = np.zeros(1, dtype=L.matmul_algo_dtype)
        a[0] = h["algo"]
        bases.append(read_config(a))
    k = gemm.key
    ids: tuple = ()
    try:  # nvmath returns the ids as a tuple
        ids = L.matmul_algo_get_ids(gemm.handle, compute_32f(), CUDA_R_32F,
                                    CUDA_TYPES[k.dtype], CUDA_TYPES[k.dtype], CUDA_TYPES[k.out_dtype],
                                    CUDA_TYPES[k.out_dtype],
                                    MAX_ALGO_IDS)
    except L.cuBLASLtError as e:
        log.debug("cublasLtMatmulAlgoGetIds failed for %s: %s", k, e)
    caps: dict[int, _Caps | None] = {}

    def caps_of(algo_id: int) -> _Caps | None:  # once per id
        if algo_id not in caps:
            try:
                caps[algo_id] = _Caps(gemm, algo_id)
            except CublasLtError:
                caps[algo_id] = None
        return caps[algo_id]

    n_heuristic = len(bases)
    known = {b.algo_id for b in bases}
    for i in map(int, ids):
        if i not in known and caps_of(i) is not None:
            bases += _explicit_configs(gemm, caps_of(i), i)
    split_variants: list[AlgoConfig] = []
    for base in bases:
        c = caps_of(base.algo_id)
        if c is not None and c.splitk and gemm.key.k >= 1024:
            split_variants += [dataclasses.replace(base, splitk=s, reduction=r) for s in SPLITS if s > 1
                               for r in c.schemes if gemm.key.k // s >= 256]
    ordered = bases[:n_heuristic] + split_variants + bases[n_heuristic:]
    out: list[tuple[AlgoConfig, np.ndarray, int]] = []
    seen: set[AlgoConfig] = set()
    for cfg in ordered:
        if cfg in seen or len(out) >= MAX_CANDIDATES:
            continue
        seen.add(cfg)
        try:
            algo = make_algo(gemm, cfg)
        except CublasLtError:
            continue
        ws = check(gemm, algo)
        if ws is not None and ws <= workspace_limit:
            out.append((cfg, algo, ws))
    return out


def _time(gemm, algo, operands, reps: int) -> float:
    """Median milliseconds of ``reps`` runs after one warm-up, CUDA events on the operands' stream."""
    import torch

    a, b, c, alpha_ptr, ws, ws_size, stream = operands
    gemm.run(a, b, c, alpha_ptr, ws, ws_size, stream, algo=algo)
    s_ = torch.cuda.ExternalStream(stream) if stream else torch.cuda.default_stream()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record(s_)
        gemm.run(a, b, c, alpha_ptr, ws, ws_size, stream, algo=algo)
        e.record(s_)
    ev[-1][1].synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in ev]))


def time_algo(gemm, algo, operands, reps: int = 10) -> float:
    """Median milliseconds of ``algo`` (or the GEMM's own algorithm when None) on ``operands`` = (a, b, c, alpha
    address, workspace, workspace bytes, stream)."""
    return _time(gemm, gemm.algo if algo is None else algo, operands, reps)


def tune(gemm, workspace_limit: int, operands, budget_ms: float) -> Entry:
    """Search and time the candidates of ``gemm`` within ``budget_ms``; returns the cache entry of its class
    (the winner, which must beat the heuristic's choice by 1 %, and up to four runners-up, fastest first)."""
    t0 = time.perf_counter()
    cands = candidates(gemm, workspace_limit)
    if not cands:
        raise CublasLtError(f"cuBLASLt offers no algorithm for {gemm.key} within {workspace_limit} bytes")
    first_ms = _time(gemm, cands[0][1], operands, 3)
    reps = int(max(3, min(25, budget_ms / max(1, len(cands)) / max(first_ms, 1e-3) / 2)))
    heuristic_ms = _time(gemm, cands[0][1], operands, reps)
    results = [(heuristic_ms, 0)]
    order = list(range(1, len(cands)))
    random.Random(0).shuffle(order)
    for i in order:
        if (time.perf_counter() - t0) * 1e3 > budget_ms:
            break
        results.append((_time(gemm, cands[i][1], operands, reps), i))
    results.sort()
    best_ms, best = results[0]
    if best_ms > heuristic_ms * 0.99:  # not a clear win over the heuristic: keep the heuristic's choice
        best_ms, best = heuristic_ms, 0
    runners = tuple((cands[i][0], round(ms, 5)) for ms, i in results if i != best)[:4]
    log.info("tuned %s: %s %.4f ms (heuristic %.4f ms), %d of %d candidates timed in %.0f ms", gemm.key,
             cands[best][0], best_ms, heuristic_ms, len(results), len(cands), (time.perf_counter() - t0) * 1e3)
    return Entry(cands[best][0], round(best_ms, 5), round(heuristic_ms, 5), cands[best][2], runners, now())


# ---- shape classes ----------------------------------------------------------------------------------------------

#: The rule that maps a GEMM to its class; stored with every class key, so that a later rule never reads entries
#: of an earlier one.
CLASS_RULE = "pow2-div8"


def bucket(x: int) -> int:
    """The class of a dimension: the power of two at or below it (so [2^i, 2^(i+1)) is one class; a cache that
    grows from a round length stays in its class until it doubles)."""
    return 1 << (max(1, int(x)).bit_length() - 1)


@dataclass(frozen=True)
class GemmClass:
    """GEMMs whose algorithms transfer: the same role, dtypes, transposes and operand alignments, with m, n, k
    and batch in the same octave [2^i, 2^(i+1)) and the same divisibility of m, n, k by 8 (kernels that need
    aligned sizes are fastest where they run: an odd key count, as a decode loop meets seven steps in eight, is a
    class of its own); leading dimensions and batch strides do not count. A decode loop
    whose cache grows one key a step, and the many key lengths of a causal prefill's chunks, meet a few classes,
    not one shape per step. A class's algorithm is checked against each real GEMM (``matmul_algo_check``)
    before it is used; one cuBLASLt refuses falls back to the heuristic."""

    role: str
    dtype: str
    out: str
    m: int
    n: int
    k: int
    batch: int
    trans_a: bool
    trans_b: bool
    align_a: int
    align_b: int
    align_c: int
    div8: str = "mnk"  # which of m, n, k are multiples of 8 ("none": none of them)
    rule: str = CLASS_RULE

    @classmethod
    def of(cls, key: GemmKey) -> GemmClass:
        div8 = "".join(name for name, x in (("m", key.m), ("n", key.n), ("k", key.k)) if x % 8 == 0) or "none"
        return cls(key.role, key.dtype, key.out_dtype, bucket(key.m), bucket(key.n), bucket(key.k),
                   bucket(key.batch), key.trans_a, key.trans_b, key.align_a, key.align_b, key.align_c, div8)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        return (f"{self.role} {self.dtype}->{self.out} {t} m~{self.m} n~{self.n} k~{self.k} "
                f"batch~{self.batch} align({self.align_a},{self.align_b},{self.align_c}) 8|{self.div8}")


#: What resolve() did in this process: GEMMs served from the cache, tuned, deferred (call budget spent),
#: refused (a cached algorithm cuBLASLt would not take for the real shape).
stats = {"cache": 0, "tuned": 0, "deferred": 0, "refused": 0}

_memo: dict[tuple[str, GemmClass], Entry | None] = {}
_memo_lock = threading.Lock()


def forget() -> None:
    """Drop this process's memory of class lookups (after ``attn-lt cache clear`` or import, and in tests)."""
    with _memo_lock:
        _memo.clear()
        _algos.clear()


def lookup(env_key: str, env, cls: GemmClass) -> Entry | None:
    """The cached entry of ``cls`` (read once per process; misses are remembered until this process tunes)."""
    k = (env_key, cls)
    try:
        return _memo[k]
    except KeyError:
        pass
    entry = default_cache().get(env, cls)
    with _memo_lock:
        _memo[k] = entry
    return entry


def _store(env, cls: GemmClass, entry: Entry) -> None:
    with _memo_lock:
        _memo[(env.key(), cls)] = entry
    default_cache().put(env, cls, entry)


_algos: dict[tuple[int, GemmClass, AlgoConfig], np.ndarray] = {}


def _class_algo(gemm, cls: GemmClass, cfg: AlgoConfig) -> np.ndarray:
    """The cublasLtMatmulAlgo_t of ``cfg`` for GEMMs of ``cls`` (it depends on the types and the configuration,
    not on the sizes): built once per process, so that a new shape of a known class costs one check."""
    k = (gemm.device, cls, cfg)
    algo = _algos.get(k)
    if algo is None:
        algo = _algos[k] = make_algo(gemm, cfg)
    return algo


def _sibling_algo(gemm, env, cls: GemmClass, workspace_limit: int):
    """(algorithm, workspace, source) from a cached class that differs from ``cls`` only in which of m, n, k divide
    by 8 (a decode loop meets both kinds, step after step), when cuBLASLt accepts it for this GEMM; else None."""
    env_key = env.key()
    for div8 in ("mnk", "mn", "nk", "mk", "m", "n", "k", "none"):
        if div8 == cls.div8:
            continue
        other = dataclasses.replace(cls, div8=div8)
        entry = lookup(env_key, env, other)
        if entry is None:
            continue
        for cfg in (entry.config,) + tuple(c for c, _ in entry.runners_up):
            try:
                algo = _class_algo(gemm, other, cfg)
                ws = check(gemm, algo)
            except CublasLtError:
                continue
            if ws is not None and ws <= workspace_limit:
                with _memo_lock:  # this process serves the class from its sibling from now on (not stored)
                    _memo[(env_key, cls)] = dataclasses.replace(entry, config=cfg, runners_up=())
                return algo, ws, f"cache (sibling class {other})"
    return None


def class_status(cls: GemmClass, policy: str) -> str:
    """What a GEMM of class ``cls`` would run before any call resolved it, for ``explain`` (no GPU needed): the
    cached winner for this GPU (or, without a GPU, for every GPU that has one), else what the policy does."""
    if policy == "heuristic":
        return "cuBLASLt's heuristic (policy 'heuristic')"
    from ..cache import key_string

    env = None
    try:
        import torch

        if torch.cuda.is_available():
            env = current_env(torch.cuda.current_device()).key()
    except Exception:  # no nvmath / cuBLASLt here: show every GPU's entries
        env = None
    hits = [(e, x) for e, x in default_cache().lookup(key_string(cls)) if env is None or e == env]
    if hits:
        return "; ".join(f"cached{'' if env else ' for ' + e}: {x.config} {x.median_ms:.4f} ms (heuristic "
                         f"{x.heuristic_ms} ms)" for e, x in hits[:3])
    return "not cached: tuned on first use" if policy == "tune" else "not cached: cuBLASLt's heuristic"


def resolve(gemm, policy: str, workspace_limit: int, operands=None, deadline: float = float("inf"),
            may_tune: bool = True) -> None:
    """Give ``gemm`` its algorithm under ``policy``.

    ``heuristic``: cuBLASLt's top-1. ``cache``: its class's cached algorithm when cuBLASLt accepts it for this
    shape, else the heuristic's. ``tune``: as ``cache``; a class met for the first time is tuned now on
    ``operands`` (the call's own) and stored, unless ``may_tune`` is False (graph capture, no operands) or the
    call's tuning ``deadline`` (``time.perf_counter()``) has passed — then the heuristic's algorithm runs and the
    GEMM stays unresolved, for a later call."""
    if policy == "heuristic":
        algo, ws = gemm.heuristic_top(workspace_limit)
        gemm.use(algo, ws, "heuristic", True)
        return
    env = current_env(gemm.device)
    cls = GemmClass.of(gemm.key)
    entry = lookup(env.key(), env, cls)
    if entry is not None:
        for n, cfg in enumerate((entry.config,) + tuple(c for c, _ in entry.runners_up)):
            try:  # the class's winner, else its runners-up (fastest first), before the heuristic
                algo = _class_algo(gemm, cls, cfg)
                ws = check(gemm, algo)
            except CublasLtError:
                ws = None
            if ws is not None and ws <= workspace_limit:
                gemm.use(algo, ws, f"cache ({cls}{'' if n == 0 else ', runner-up %d' % n})", True)
                stats["cache"] += 1
                return
        stats["refused"] += 1
        log.info("cuBLASLt refuses the cached algorithm of class %s (%s) for %s within %d bytes of workspace; "
                 "using the heuristic's", cls, entry.config, gemm.key, workspace_limit)
        algo, ws = gemm.heuristic_top(workspace_limit)
        gemm.use(algo, ws, "heuristic (the class's cached algorithm was refused for this shape)", True)
        return
    sibling = _sibling_algo(gemm, env, cls, workspace_limit)
    if sibling is not None:  # the class that differs only in which sizes divide by 8: no tuning stall mid-loop
        algo, ws, source = sibling
        gemm.use(algo, ws, source, True)
        stats["cache"] += 1
        return
    algo, ws = gemm.heuristic_top(workspace_limit)
    if policy != "tune":  # "cache": a miss keeps the heuristic's algorithm
        gemm.use(algo, ws, "heuristic (class not cached)", True)
        return
    if not may_tune or operands is None or time.perf_counter() > deadline:
        stats["deferred"] += 1
        gemm.use(algo, ws, "heuristic (class not tuned yet)", False)
        return
    from .. import config

    entry = tune(gemm, workspace_limit, operands, config.current().tune_ms)
    gemm.use(make_algo(gemm, entry.config), entry.workspace, f"tuned ({cls})", True)
    stats["tuned"] += 1
    _store(env, cls, entry)
