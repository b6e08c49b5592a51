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
import time

import numpy as np

from ..cache import AlgoConfig, Entry, current_env, default_cache, now
from .cublaslt import _CUDA_R_32F, _DTYPE, CublasLtError, _call, _lt

log = logging.getLogger("attn_lt")

SPLITS = (1, 2, 4, 8, 16, 32, 64)
MAX_CANDIDATES = 64
HEURISTIC_TOP = 8
MAX_ALGO_IDS = 24
TILES_PER_ALGO = 2
STAGES_PER_ALGO = 2
_CONFIG_FIELDS = ("algo_id", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "cluster", "inner")


def _attrs():
    A = _lt().MatmulAlgoConfigAttribute
    return dict(zip(_CONFIG_FIELDS, (A.ID, A.TILE_ID, A.STAGES_ID, A.SPLITK_NUM, A.REDUCTION_SCHEME, A.CTA_SWIZZLING,
                                     A.CUSTOM_OPTION, A.CLUSTER_SHAPE_ID, A.INNER_SHAPE_ID)))


def read_config(algo: np.ndarray) -> AlgoConfig:
    """The full configuration of a cublasLtMatmulAlgo_t (a 1-element ``matmul_algo_dtype`` array)."""
    L = _lt()
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
    from nvmath.bindings import cublas

    L = _lt()
    algo = np.zeros(1, dtype=L.matmul_algo_dtype)
    k = gemm.key
    _call(f"cublasLtMatmulAlgoInit (algo {cfg.algo_id})", L.matmul_algo_init, gemm.handle,
          int(cublas.ComputeType.COMPUTE_32F), _CUDA_R_32F, _DTYPE[k.dtype], _DTYPE[k.dtype], _DTYPE[k.out_dtype],
          _DTYPE[k.out_dtype], cfg.algo_id, algo.ctypes.data)
    for name, attr in _attrs().items():
        if name == "algo_id":
            continue
        buf = np.array([getattr(cfg, name)], dtype=L.get_matmul_algo_config_attribute_dtype(attr))
        _call(f"cublasLtMatmulAlgoConfigSetAttribute ({name})", L.matmul_algo_config_set_attribute,
              algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes)
    return algo


def check(gemm, algo: np.ndarray) -> int | None:
    """Workspace bytes ``algo`` needs for this GEMM, or None when cuBLASLt refuses it."""
    L = _lt()
    result = np.zeros(1, dtype=L.matmul_heuristic_result_dtype)
    try:
        L.matmul_algo_check(gemm.handle, gemm.desc, gemm.a, gemm.b, gemm.c, gemm.c, algo.ctypes.data,
                            result.ctypes.data)
    except L.cuBLASLtError:
        return None
    return int(result[0]["workspace_size"])


def _cap(algo: np.ndarray, attr) -> int:
    L = _lt()
    buf = np.zeros(1, dtype=L.get_matmul_algo_cap_attribute_dtype(attr))
    written = np.zeros(1, dtype=np.uint64)
    L.matmul_algo_cap_get_attribute(algo.ctypes.data, int(attr), buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return int(buf[0])


def _cap_list(algo: np.ndarray, attr) -> list[int]:
    """A variable-length capability (TILE_IDS, STAGES_IDS): size first, then the values."""
    L = _lt()
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
        name = _lt().MatmulTile(tile).name
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
        C = _lt().MatmulAlgoCapAttribute
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
    L = _lt()
    from nvmath.bindings import cublas

    bases: list[AlgoConfig] = []
    for h in gemm.heuristic(workspace_limit, HEURISTIC_TOP):
        a = np.zeros(1, dtype=L.matmul_algo_dtype)
        a[0] = h["algo"]
        bases.append(read_config(a))
    k = gemm.key
    ids: tuple = ()
    try:  # nvmath returns the ids as a tuple
        ids = L.matmul_algo_get_ids(gemm.handle, int(cublas.ComputeType.COMPUTE_32F), _CUDA_R_32F,
                                    _DTYPE[k.dtype], _DTYPE[k.dtype], _DTYPE[k.out_dtype], _DTYPE[k.out_dtype],
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

    a, b, c, alpha, ws, ws_size, stream = operands
    gemm.run(a, b, c, alpha, ws, ws_size, stream, algo=algo)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        gemm.run(a, b, c, alpha, ws, ws_size, stream, algo=algo)
        e.record()
    ev[-1][1].synchronize()
    return float(np.median([s.elapsed_time(e) for s, e in ev]))


def tune(gemm, workspace_limit: int, operands, budget_ms: float) -> Entry:
    """Search and time the candidates of ``gemm`` within ``budget_ms``; returns the cache entry."""
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


def heuristic_choice(gemm, workspace_limit: int) -> None:
    """Set ``gemm.algo`` (and its workspace need) to the heuristic's best algorithm."""
    results = gemm.heuristic(workspace_limit, count=1)
    if len(results) == 0:
        raise CublasLtError(f"cuBLASLt found no algorithm for {gemm.key} within {workspace_limit} bytes of "
                            "workspace")
    gemm.algo[0] = results[0]["algo"]
    gemm.workspace_size = int(results[0]["workspace_size"])
    gemm.algo_source = "heuristic"


#: What resolve() did in this process: GEMMs served from the cache, tuned, deferred (call budget spent), refused.
stats = {"cache": 0, "tuned": 0, "deferred": 0, "refused": 0}


def resolve(gemm, policy: str, workspace_limit: int, operands, deadline: float = float("inf")) -> None:
    """Give ``gemm`` its algorithm under ``policy``: cached, tuned now, or the heuristic's. Past ``deadline``
    (``time.perf_counter()``) a cache miss keeps the heuristic's algorithm and stays unresolved, for a later call."""
    if policy == "heuristic":
        gemm.resolved = True
        return
    env = current_env(gemm.device)
    cache = default_cache()
    entry = cache.get(env, gemm.key)
    if entry is not None:
        try:
            algo = make_algo(gemm, entry.config)
            ws = check(gemm, algo)
        except CublasLtError:
            ws = None
        if ws is not None and ws <= workspace_limit:
            gemm.algo[:] = algo
            gemm.workspace_size, gemm.algo_source, gemm.resolved = ws, "cache", True
            stats["cache"] += 1
            return
        stats["refused"] += 1
        log.warning("attn_lt: cuBLASLt refuses the cached algorithm for %s (%s) within %d bytes of workspace; %s",
                    gemm.key, entry.config, workspace_limit, "re-tuning" if policy == "tune" else "using the "
                    "heuristic")
    if policy != "tune":  # "cache": a miss or a refused entry keeps the heuristic's algorithm
        gemm.resolved = True
        return
    if time.perf_counter() > deadline:
        stats["deferred"] += 1
        return
    from .. import config

    entry = tune(gemm, workspace_limit, operands, config.tune_ms())
    algo = make_algo(gemm, entry.config)
    gemm.algo[:] = algo
    gemm.workspace_size, gemm.algo_source, gemm.resolved = entry.workspace, "tuned", True
    stats["tuned"] += 1
    cache.put(env, gemm.key, entry)
