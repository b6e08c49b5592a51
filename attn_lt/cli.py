"""``attn-lt`` (also ``python -m attn_lt``): info, explain, demo, cache. Exit codes: 0 ok, 1 a check failed
(demo error bound, cache verify, cache show of a missing key), 2 bad arguments or input."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, config

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _add_shape_args(p: argparse.ArgumentParser, *, b=1, h=16, s=16384, d=128) -> None:
    p.add_argument("-b", "--batch", type=int, default=b, help=f"batch size B (default {b})")
    p.add_argument("-H", "--heads", type=int, default=h, help=f"query heads Hq (default {h})")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads Hkv (default: Hq)")
    p.add_argument("-s", "--seq", type=int, default=s, help=f"sequence length for Sq and Sk (default {s})")
    p.add_argument("--sq", type=int, default=None, help="query length Sq (default: --seq)")
    p.add_argument("--sk", type=int, default=None, help="key length Sk (default: --seq)")
    p.add_argument("-d", "--dim", type=int, default=d, help=f"head dim D (default {d})")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mask", choices=("none", "bool", "float"), default="none",
                   help="a dense (1, 1, Sq, Sk) mask of this kind")
    p.add_argument("--backend", choices=("auto", "lt", "wmma"), default="auto")
    p.add_argument("--workspace-mb", type=int, default=None, help="workspace budget (default ATTN_LT_WORKSPACE_MB)")
    p.add_argument("--threshold", type=int, default=None, help="hybrid threshold (default ATTN_LT_THRESHOLD)")


def _case(a):
    from .validate import Case, MaskInfo

    Sq, Sk, Hkv = a.sq or a.seq, a.sk or a.seq, a.kv_heads or a.heads
    for name, val in (("batch", a.batch), ("heads", a.heads), ("kv-heads", Hkv), ("sq", Sq), ("sk", Sk),
                      ("dim", a.dim)):
        if val < 1:
            raise ValueError(f"--{name} must be >= 1, got {val}")
    if a.heads % Hkv:
        raise ValueError(f"--heads {a.heads} must be a multiple of --kv-heads {Hkv}")
    mask = None
    if a.mask != "none":
        mask = MaskInfo(a.mask, "bool" if a.mask == "bool" else a.dtype, (1, 1, Sq, Sk), (0, 0, Sk, 1))
    return Case.contiguous(a.batch, a.heads, Hkv, Sq, Sk, a.dim, a.dtype, a.causal, mask=mask)


def _budget(a):
    return None if a.workspace_mb is None else a.workspace_mb << 20


def environment() -> dict:
    """What ``attn-lt info`` shows (and the benchmarks record): versions, GPU, native library, settings, cache."""
    from . import native

    from .cache import default_cache

    cache = default_cache()
    info = {"attn_lt": __version__, "native_library": native.status(),
            "workspace_budget_mib": config.workspace_bytes() >> 20, "threshold": config.threshold(),
            "algo_policy": config.algo_policy(), "cache": f"{cache.path} ({len(cache.items())} entries)"}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, " \
                          f"{p.total_memory / 2**30:.0f} GiB)"
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


def cmd_info(a) -> int:
    info = environment()
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, val in info.items():
            print(f"{key:<{width}}  {val}")
    return EXIT_OK


def _plan_gemms(case, plan):
    """The distinct (role, GEMM key) of a plan, for contiguous inputs at 256-byte aligned addresses."""
    from .lt.path import chunk_gemms

    seen = {}
    for c in plan.chunks:
        if c.kend:
            for key in chunk_gemms(case, plan, c, (1 << 40,) * 5)[2]:
                seen.setdefault(key, None)
    return list(seen)


def _algo_lines(case, plan):
    """What each GEMM of the plan would use: the cached winner (this GPU, or any other recorded), or not."""
    from .cache import default_cache, key_string

    cache = default_cache()
    env = None
    try:
        import torch

        if torch.cuda.is_available():
            from .cache import current_env

            env = current_env().key()
    except Exception:  # no nvmath / cuBLASLt: entries of every environment are shown
        env = None
    by_key: dict[str, list] = {}
    for e, k, entry in cache.items():
        by_key.setdefault(k, []).append((e, entry))
    lines = []
    for key in _plan_gemms(case, plan):
        ks = key_string(key)
        hits = [(e, x) for e, x in by_key.get(ks, []) if env is None or e == env]
        if hits:
            e, x = hits[0]
            src = f"cached{'' if env else ' for ' + e}: {x.config} {x.median_ms:.4f} ms (heuristic {x.heuristic_ms} ms)"
        else:
            src = f"not cached: {'tuned on first use' if config.algo_policy() == 'tune' else 'heuristic'}"
        lines.append({"gemm": ks, "algorithm": src})
    return lines


def cmd_explain(a) -> int:
    from .api import explain_case

    case = _case(a)
    e = explain_case(case, a.backend, _budget(a), a.threshold)
    algos = _algo_lines(case, e.plan) if e.plan is not None else []
    if a.json:
        d = e.to_dict()
        if d["plan"] is not None and not a.chunks:
            d["plan"]["chunks"] = len(d["plan"]["chunks"])
        d["gemms"] = algos
        print(json.dumps(d, indent=2))
    else:
        print(e)
        for x in algos:
            print(f"  gemm {x['gemm']}\n       {x['algorithm']}")
        if a.chunks and e.plan is not None:
            for c in e.plan.chunks:
                print(f"  {c}")
    return EXIT_OK


def cmd_demo(a) -> int:
    import torch

    case = _case(a)
    if not torch.cuda.is_available():
        from .api import explain_case

        print("No CUDA GPU is visible, so attn_lt cannot run here: its kernels need an NVIDIA GPU (sm_80 or newer)")
        print("with nvmath-python and the native library (`make native`). This is what it would run:\n")
        print(explain_case(case, a.backend, _budget(a), a.threshold))
        return EXIT_OK
    from . import attention
    from .testing import reference, rel_error, sdpa, time_ms, tolerance

    dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
    dev = torch.device("cuda")
    q = torch.randn(case.B, case.Hq, case.Sq, case.D, device=dev, dtype=dt)
    k = torch.randn(case.B, case.Hkv, case.Sk, case.D, device=dev, dtype=dt)
    v = torch.randn(case.B, case.Hkv, case.Sk, case.D, device=dev, dtype=dt)
    mask = None
    if a.mask == "bool":
        mask = torch.rand(1, 1, case.Sq, case.Sk, device=dev) > 0.1
    elif a.mask == "float":
        mask = torch.randn(1, 1, case.Sq, case.Sk, device=dev, dtype=dt)
    kw = dict(attn_mask=mask, causal=case.causal, backend=a.backend, workspace_bytes=_budget(a),
              threshold=a.threshold)
    from .api import explain

    print(explain(q, k, v, **{x: kw[x] for x in ("attn_mask", "causal", "backend", "workspace_bytes",
                                                  "threshold")}))
    out = attention(q, k, v, **kw)
    ref, _ = reference(q, k, v, mask, case.causal)
    ours, theirs = rel_error(out, ref), rel_error(sdpa(q, k, v, mask, case.causal), ref)
    t_ours = time_ms(lambda: attention(q, k, v, **kw))
    t_sdpa = time_ms(lambda: sdpa(q, k, v, mask, case.causal))
    flops = 4 * case.B * case.Hq * case.Sq * case.Sk * case.D * (0.5 if case.causal else 1.0)
    ok = ours <= tolerance(theirs)
    print(f"\n{'':<8}{'ms':>9}{'TFLOP/s':>9}{'rel err vs fp32':>17}")
    print(f"{'attn_lt':<8}{t_ours:9.3f}{flops / t_ours / 1e9:9.1f}{ours:17.2e}")
    print(f"{'sdpa':<8}{t_sdpa:9.3f}{flops / t_sdpa / 1e9:9.1f}{theirs:17.2e}")
    print(f"\n{'PASS' if ok else 'FAIL'}: attn_lt error {ours:.2e} vs allowed {tolerance(theirs):.2e} "
          f"(2 x PyTorch's + {1e-3:g}) on {torch.cuda.get_device_name()}")
    return EXIT_OK if ok else EXIT_FAIL


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    done = width * i // max(n, 1)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:60]:<60}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


_SPEC_KEYS = {"b": "batch", "h": "heads", "hkv": "kv_heads", "s": "seq", "sq": "sq", "sk": "sk", "d": "dim",
              "dtype": "dtype", "causal": "causal"}


def parse_spec(spec: str) -> argparse.Namespace:
    """A shape like ``b=8,h=32,hkv=8,sq=1,sk=65536,d=128[,causal][,dtype=fp16]`` as explain's options."""
    ns = argparse.Namespace(batch=1, heads=16, kv_heads=None, seq=4096, sq=None, sk=None, dim=128, dtype="bf16",
                            causal=False, mask="none")
    for part in filter(None, spec.split(",")):
        name, _, val = part.partition("=")
        if name not in _SPEC_KEYS:
            raise ValueError(f"shape {spec!r}: unknown field {name!r} (fields: {', '.join(_SPEC_KEYS)})")
        if name == "causal":
            ns.causal = val in ("", "1", "true", "yes")
        elif name == "dtype":
            if val not in ("bf16", "fp16"):
                raise ValueError(f"shape {spec!r}: dtype must be bf16 or fp16")
            ns.dtype = val
        else:
            try:
                setattr(ns, _SPEC_KEYS[name], int(val))
            except ValueError:
                raise ValueError(f"shape {spec!r}: {name} must be an integer, got {val!r}") from None
    return ns


def _entries_json(items):
    return [{"env": env, "gemm": k, **e.to_dict()} for env, k, e in items]


def cmd_cache(a) -> int:
    from .cache import CacheError, default_cache

    cache = default_cache()
    if a.cache_cmd == "list":
        items = cache.items()
        if a.json:
            print(json.dumps({"path": str(cache.path), "entries": _entries_json(items)}, indent=2))
            return EXIT_OK
        print(f"{cache.path}: {len(items)} entries")
        if items:
            print(f"{'gemm':<64} {'algo':>5} {'splitk':>6} {'tuned ms':>10} {'heur ms':>10} {'gain':>6}  env")
        for env, k, e in items:
            gain = f"{e.heuristic_ms / e.median_ms:.2f}x" if e.heuristic_ms and e.median_ms else "-"
            print(f"{k:<64} {e.config.algo_id:>5} {e.config.splitk:>6} {e.median_ms:>10.4f} "
                  f"{e.heuristic_ms if e.heuristic_ms is not None else float('nan'):>10.4f} {gain:>6}  {env}")
        return EXIT_OK
    if a.cache_cmd == "show":
        hits = [(env, k, e) for env, k, e in cache.items() if k == a.key]
        if not hits:
            print(f"attn-lt cache show: no entry for {a.key!r} in {cache.path}", file=sys.stderr)
            return EXIT_FAIL
        if a.json:
            print(json.dumps(_entries_json(hits), indent=2))
        else:
            for env, k, e in hits:
                print(f"gemm {k}\nenv  {env}\nwinner {e.config}\n  median {e.median_ms} ms, heuristic "
                      f"{e.heuristic_ms} ms, workspace {e.workspace} B, tuned {e.tuned_at}")
                for c, t in e.runners_up:
                    print(f"  runner-up {c}: {t} ms")
        return EXIT_OK
    if a.cache_cmd == "clear":
        n = len(cache.items())
        cache.clear()
        print(f"removed {n} entries from {cache.path}")
        return EXIT_OK
    if a.cache_cmd == "export":
        n = cache.export(a.file)
        print(f"exported {n} entries to {a.file}")
        return EXIT_OK
    if a.cache_cmd == "import":
        try:
            n = cache.import_file(a.file)
        except (CacheError, OSError) as e:
            print(f"attn-lt cache import: {a.file}: {e}", file=sys.stderr)
            return EXIT_USAGE
        print(f"imported {n} entries into {cache.path}")
        return EXIT_OK
    cases = [_case(parse_spec(s)) for s in a.shapes] if a.cache_cmd == "tune" else []  # checked before GPU work
    import torch

    if not torch.cuda.is_available():
        print(f"attn-lt cache {a.cache_cmd}: needs a CUDA GPU (none visible)", file=sys.stderr)
        return EXIT_USAGE
    try:
        from nvmath.bindings import cublasLt  # noqa: F401
    except ImportError as e:
        print(f"attn-lt cache {a.cache_cmd}: needs nvmath-python ({e})", file=sys.stderr)
        return EXIT_USAGE
    if a.cache_cmd == "tune":
        return _cache_tune(cases, cache)
    return _cache_verify(a, cache)


def _cache_tune(cases, cache) -> int:
    import torch

    from . import attention

    before = len(cache.items())
    for i, case in enumerate(cases):
        _progress(i, len(cases), str(case))
        dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
        q = torch.randn(case.B, case.Hq, case.Sq, case.D, device="cuda", dtype=dt)
        k, v = (torch.randn(case.B, case.Hkv, case.Sk, case.D, device="cuda", dtype=dt) for _ in range(2))
        attention(q, k, v, causal=case.causal, backend="lt", algo_policy="tune")
        del q, k, v
    torch.cuda.synchronize()
    _progress(len(cases), len(cases), "done")
    cache.reload()
    print(f"{len(cache.items()) - before} new entries; {len(cache.items())} in {cache.path}")
    return EXIT_OK


def _verify_entry(key, entry, device: int):
    """(cached ms, heuristic ms) re-timed on random operands shaped like ``key``; None when refused."""
    import torch

    from .lt import algos, cublaslt

    ws_limit = max(entry.workspace, 32 << 20)
    g = cublaslt.Gemm(device, key, ws_limit)
    algo = algos.make_algo(g, entry.config)
    if algos.check(g, algo) is None:
        return None
    dt = torch.bfloat16 if key.dtype == "bf16" else torch.float16
    a_cols = key.m if key.trans_a else key.k
    b_cols = key.k if key.trans_b else key.n

    def buf(ld, cols, stride, dtype):
        n = stride * (key.batch - 1) + ld * cols
        return torch.randn(n, device="cuda").to(dtype)

    A = buf(key.lda, a_cols, key.stride_a, dt)
    B = buf(key.ldb, b_cols, key.stride_b, dt)
    C = torch.empty(key.stride_c * (key.batch - 1) + key.ldc * key.n, device="cuda",
                    dtype=torch.float32 if key.role == "qk" else dt)
    ws = torch.empty(ws_limit, dtype=torch.uint8, device="cuda")
    ops = (A.data_ptr(), B.data_ptr(), C.data_ptr(), 1.0, ws.data_ptr(), ws_limit,
           torch.cuda.current_stream().cuda_stream)
    return algos._time(g, algo, ops, 10), algos._time(g, g.algo, ops, 10)


def _cache_verify(a, cache) -> int:
    from .cache import current_env, parse_key

    env = current_env().key()
    items = [(k, e) for en, k, e in cache.items() if en == env]
    rows, bad = [], 0
    for i, (k, e) in enumerate(items):
        _progress(i, len(items), k)
        try:
            r = _verify_entry(parse_key(k), e, 0)
        except Exception as err:  # out of memory for a huge shape, a driver error: reported, not fatal
            rows.append({"gemm": k, "status": f"error: {type(err).__name__}: {str(err)[:80]}"})
            bad += 1
            continue
        if r is None:
            rows.append({"gemm": k, "status": "refused by cuBLASLt"})
            bad += 1
            continue
        cached, heur = r
        ok = cached <= heur * (1 + a.tolerance)
        bad += not ok
        rows.append({"gemm": k, "cached_ms": round(cached, 5), "heuristic_ms": round(heur, 5),
                     "status": "ok" if ok else "stale (no longer beats the heuristic)"})
    _progress(len(items), len(items), "done")
    if a.json:
        print(json.dumps({"env": env, "entries": rows, "stale": bad}, indent=2))
    else:
        for r in rows:
            print(f"{r['gemm']:<64} {r.get('cached_ms', ''):>10} {r.get('heuristic_ms', ''):>10}  {r['status']}")
        print(f"{len(rows)} entries for {env}; {bad} stale or failing")
    return EXIT_OK if bad == 0 else EXIT_FAIL


def cmd_calibrate(a) -> int:
    import torch

    from . import calibrate

    dims = [int(x) for x in a.dims.split(",")]
    lengths = sorted(int(x) for x in a.lengths.split(","))
    if any(d not in (64, 128) for d in dims) or any(s < 1 for s in lengths):
        raise ValueError("--dims takes 64 and/or 128 (the fused path's head dims); --lengths positive integers")
    if not torch.cuda.is_available():
        print("attn-lt calibrate: needs a CUDA GPU (none visible)", file=sys.stderr)
        return EXIT_USAGE
    from . import attention
    from .cache import current_env
    from .testing import time_ms

    points = []
    jobs = [(d, s) for d in dims for s in lengths]
    for i, (d, s) in enumerate(jobs):
        _progress(i, len(jobs), f"D{d} S{s}")
        h = max(1, 2048 // d)
        q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        t = {}
        for backend in ("wmma", "lt"):
            attention(q, k, v, backend=backend)  # warm-up (and, for lt, algorithm tuning)
            t[backend] = time_ms(lambda: attention(q, k, v, backend=backend), warmup_ms=10, rep_ms=100)
        points.append({"D": d, "Sk": s, "H": h, "wmma_ms": round(t["wmma"], 4), "lt_ms": round(t["lt"], 4)})
    _progress(len(jobs), len(jobs), "done")
    threshold = calibrate.crossover(points)
    where = calibrate.store(current_env().key(), threshold, points)
    if a.json:
        print(json.dumps({"threshold": threshold, "points": points, "file": str(where)}, indent=2))
    else:
        for p in points:
            print(f"D{p['D']:<4} Sk {p['Sk']:>7}  wmma {p['wmma_ms']:>9.4f} ms  lt {p['lt_ms']:>9.4f} ms")
        shown = "never (the fused path wins at every length measured)" if threshold == calibrate.NEVER else threshold
        print(f"threshold: {shown}; stored in {where}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attn-lt", description="attn_lt: hybrid attention for NVIDIA GPUs")
    p.add_argument("--version", action="version", version=f"attn_lt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("info", help="GPU, CUDA/cuBLASLt versions, native library, budget, threshold")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_info)
    s = sub.add_parser("explain", help="which path a case takes, why, and its chunk plan")
    _add_shape_args(s)
    s.add_argument("--chunks", action="store_true", help="list every chunk of the plan")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_explain)
    s = sub.add_parser("demo", help="run one attention call, check it against PyTorch and time both")
    _add_shape_args(s)
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("calibrate", help="measure the wmma/lt crossover on this GPU and store it as the threshold")
    s.add_argument("--dims", default="64,128")
    s.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_calibrate)
    c = sub.add_parser("cache", help="the per-shape cuBLASLt algorithm cache")
    csub = c.add_subparsers(dest="cache_cmd", required=True)
    x = csub.add_parser("list", help="every entry")
    x.add_argument("--json", action="store_true")
    x = csub.add_parser("show", help="one entry, by its GEMM key")
    x.add_argument("key")
    x.add_argument("--json", action="store_true")
    x = csub.add_parser("tune", help="tune every GEMM of these shapes (needs a GPU)",
                        description="SHAPE: b=1,h=16,hkv=16,s=16384,d=128[,sq=..,sk=..][,causal][,dtype=fp16]")
    x.add_argument("shapes", nargs="+", metavar="SHAPE")
    csub.add_parser("clear", help="remove every entry")
    x = csub.add_parser("export", help="write the entries to FILE")
    x.add_argument("file")
    x = csub.add_parser("import", help="merge the entries of FILE (validated; nothing is written if it is bad)")
    x.add_argument("file")
    x = csub.add_parser("verify", help="re-time this GPU's entries; exit 1 if any no longer beats the heuristic")
    x.add_argument("--tolerance", type=float, default=0.02, help="allowed slowdown against the heuristic")
    x.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_cache)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"attn-lt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
