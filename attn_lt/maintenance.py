"""What the ``attn-lt`` commands do besides parsing and printing: the environment report, the demo run, tuning
shapes into the algorithm cache and re-timing its entries. The CLI (``attn_lt/cli.py``) calls these and prints
their results; the benchmarks record :func:`environment`.
"""

from __future__ import annotations

from . import __version__, config


def environment() -> dict:
    """Versions, GPU, native library, settings and cache: what ``attn-lt info`` shows and benchmarks record."""
    from . import native
    from .cache import default_cache
    from .select import current_threshold

    cache = default_cache()
    n = cache.count()
    entries = f"{n} {'entry' if n == 1 else 'entries'}"
    info = {"attn_lt": __version__, "native_library": native.status(),
            "workspace_budget_mib": config.workspace_bytes() >> 20, "threshold": "%s (%s)" % current_threshold(),
            "algo_policy": config.algo_policy(),
            "cache": f"{cache.path} ({entries})" if cache.state == "ok"
            else f"{cache.path} ({cache.state}: {cache.problem}; {entries} in this process)",
            "cache_state": cache.state}
    try:
        import torch

        from . import api, fastpath  # noqa: F401  (api loads the fast path, as a first call would)

        info["fast_path"] = fastpath.status()
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, " \
                          f"{p.total_memory / 2**30:.0f} GiB)"
            from .fused import hopper_kernel

            info["fused_kernel"] = ("sm_90a (wgmma + TMA) for prefill; mma.sync (split keys) for decode and masks"
                                    if hopper_kernel() else "mma.sync (split keys for decode)")
        else:
            info["gpu"] = "none visible"
    except ImportError as e:
        info["torch"] = f"unavailable: {e}"
    try:
        import nvmath
        from nvmath.bindings import cublasLt

        info["nvmath"] = nvmath.__version__
        info["cublasLt"] = str(cublasLt.get_version())
    except Exception as e:  # no nvmath, or no libcublasLt to load
        info["cublasLt"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def random_inputs(case, mask: str = "none"):
    """Fresh random q, k, v (v a view of k's first Dv columns when ``case.v_in_k``; and a (1, 1, Sq, Sk) mask of
    kind ``mask``: none, bool, float) for ``case``."""
    import torch

    dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    q = torch.randn(case.B, case.Hq, case.Sq, case.D, device="cuda", dtype=dt)
    k = torch.randn(case.B, case.Hkv, case.Sk, case.D, device="cuda", dtype=dt)
    v = k[..., :case.Dv] if case.v_in_k else torch.randn(case.B, case.Hkv, case.Sk, case.Dv, device="cuda", dtype=dt)
    m = None
    if mask == "bool":
        m = torch.rand(1, 1, case.Sq, case.Sk, device="cuda") > 0.1
    elif mask == "float":
        m = torch.randn(1, 1, case.Sq, case.Sk, device="cuda", dtype=dt)
    return q, k, v, m


def demo(case, backend: str = "auto", workspace_bytes=None, threshold=None, mask: str = "none") -> dict:
    """One attention call on random inputs: its explanation, its error against an FP32 reference (and PyTorch
    SDPA's, which sets the bound), and both timed."""
    import torch

    from .api import attention, explain
    from .testing import reference, rel_error, sdpa, time_ms, tolerance

    q, k, v, m = random_inputs(case, mask)
    kw = dict(attn_mask=m, causal=case.causal, backend=backend, workspace_bytes=workspace_bytes,
              threshold=threshold)
    text = str(explain(q, k, v, **kw))
    out = attention(q, k, v, **kw)
    ref, _ = reference(q, k, v, m, case.causal)
    ours, theirs = rel_error(out, ref), rel_error(sdpa(q, k, v, m, case.causal), ref)
    t_ours = time_ms(lambda: attention(q, k, v, **kw))
    t_sdpa = time_ms(lambda: sdpa(q, k, v, m, case.causal))
    flops = 2 * case.B * case.Hq * case.Sq * case.Sk * (case.D + case.Dv) * (0.5 if case.causal else 1.0)
    return {"explain": text, "gpu": torch.cuda.get_device_name(), "attn_lt_ms": t_ours, "sdpa_ms": t_sdpa,
            "attn_lt_tflops": flops / t_ours / 1e9, "sdpa_tflops": flops / t_sdpa / 1e9, "error": ours,
            "sdpa_error": theirs, "allowed": tolerance(theirs), "ok": ours <= tolerance(theirs)}


def tune_cases(cases, progress=None) -> int:
    """Run every case once on the long path under the ``tune`` policy (tuning each GEMM class not yet cached);
    returns how many cases ran. ``progress(i, n, label)`` is called before each."""
    import torch

    from .api import attention

    for i, case in enumerate(cases):
        if progress:
            progress(i, len(cases), str(case))
        q, k, v, _ = random_inputs(case)
        attention(q, k, v, causal=case.causal, backend="lt", algo_policy="tune")
        del q, k, v
    torch.cuda.synchronize()
    if progress:
        progress(len(cases), len(cases), "done")
    return len(cases)


def gemm_of_key(fields: dict):
    """The GemmKey a cache key names: a GEMM key as it is; a shape-class key (role, dtypes, m/n/k/batch class
    bounds, transposes, alignments, ``rule``) as the smallest contiguous GEMM of its class."""
    from .lt.cublaslt import GemmKey

    if "rule" not in fields:
        return GemmKey.from_dict(fields)
    d = {k: v for k, v in fields.items() if k not in ("rule", "out")}
    default_out = "fp32" if d["role"] == "qk" else d["dtype"]
    a_rows = d["k"] if d["trans_a"] else d["m"]
    b_rows = d["n"] if d["trans_b"] else d["k"]
    d.update(lda=a_rows, ldb=b_rows, ldc=d["m"], stride_a=d["m"] * d["k"], stride_b=d["k"] * d["n"],
             stride_c=d["m"] * d["n"], out="" if fields.get("out", default_out) == default_out else fields["out"])
    return GemmKey.from_dict(d)


def verify_entry(key, entry, device: int = 0):
    """(cached ms, heuristic ms) of ``entry``'s algorithm and cuBLASLt's heuristic re-timed on random operands
    shaped like ``key`` (a GemmKey); None when cuBLASLt refuses the cached algorithm."""
    import numpy as np
    import torch

    from .lt import algos, cublaslt

    ws_limit = max(entry.workspace, 32 << 20)
    g = cublaslt.Gemm(device, key)
    heuristic, _ = g.heuristic_top(ws_limit)
    algo = algos.make_algo(g, entry.config)
    if algos.check(g, algo) is None:
        return None
    dt = torch.bfloat16 if key.dtype == "bf16" else torch.float16
    out_dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[key.out_dtype]
    a_cols = key.m if key.trans_a else key.k
    b_cols = key.k if key.trans_b else key.n

    def buf(ld, cols, stride, dtype):
        n = stride * (key.batch - 1) + ld * cols
        return torch.randn(n, device="cuda").to(dtype)

    A = buf(key.lda, a_cols, key.stride_a, dt)
    B = buf(key.ldb, b_cols, key.stride_b, dt)
    C = torch.empty(key.stride_c * (key.batch - 1) + key.ldc * key.n, device="cuda", dtype=out_dt)
    ws = torch.empty(ws_limit, dtype=torch.uint8, device="cuda")
    alpha = np.ones(1, dtype=np.float32)
    ops = (A.data_ptr(), B.data_ptr(), C.data_ptr(), alpha.ctypes.data, ws.data_ptr(), ws_limit,
           torch.cuda.current_stream().cuda_stream)
    return algos.time_algo(g, algo, ops, 10), algos.time_algo(g, heuristic, ops, 10)


def verify_cache(cache, tolerance: float, progress=None) -> tuple[str, list[dict], int]:
    """Re-time this GPU's entries against the heuristic: (environment, one row per entry, how many are stale or
    failing). An entry is stale when its algorithm is more than ``tolerance`` slower than the heuristic's."""
    from .cache import current_env, parse_key

    env = current_env().key()
    items = [(k, e) for _, k, e in cache.items(env)]
    rows, bad = [], 0
    for i, (k, e) in enumerate(items):
        if progress:
            progress(i, len(items), k)
        try:
            key = gemm_of_key(parse_key(k))
        except (TypeError, ValueError, KeyError):  # a key of a kind this attn_lt cannot turn into a GEMM
            rows.append({"gemm": k, "status": "skipped (not a GEMM or shape-class key)"})
            continue
        try:
            r = verify_entry(key, e, 0)
        except Exception as err:  # out of memory for a huge shape, a driver error: reported, not fatal
            rows.append({"gemm": k, "status": f"error: {type(err).__name__}: {str(err)[:80]}"})
            bad += 1
            continue
        if r is None:
            rows.append({"gemm": k, "status": "refused by cuBLASLt"})
            bad += 1
            continue
        cached, heur = r
        ok = cached <= heur * (1 + tolerance)
        bad += not ok
        rows.append({"gemm": k, "cached_ms": round(cached, 5), "heuristic_ms": round(heur, 5),
                     "status": "ok" if ok else "stale (no longer beats the heuristic)"})
    if progress:
        progress(len(items), len(items), "done")
    return env, rows, bad
