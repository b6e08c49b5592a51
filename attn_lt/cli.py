"""``attn-lt`` (also ``python -m attn_lt``): info, explain, demo, calibrate, cache.

Exit codes: 0 ok; 1 a check failed or the command could not do what it was asked (demo error bound, cache verify,
cache show of a missing key, a store that cannot be written: the message says what did and did not happen); 2 bad
arguments or input (a bad import file) or no GPU for a command that needs one; 3 an unexpected error (one line;
``--debug`` or ``ATTN_LT_DEBUG=1`` shows the traceback). Text that comes from files or the environment is escaped
before it reaches the terminal (control characters shown as ``\\xNN``). Output that cannot be written (``/dev/full``)
exits 1 with one line; a reader that leaves (``| head``) ends the command quietly.

Start-up: this module imports only the standard library; torch and the rest of attn_lt are imported by the
commands that need them, so that ``--help`` and the cache commands start at once."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys

from . import __version__

#: Chunks ``explain --chunks`` lists unless told how many (``--chunks N`` or ``--chunks all``).
CHUNKS_SHOWN = 1000

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def safe(text) -> str:
    """``text`` fit for a terminal: control characters (escape sequences included) and bidirectional overrides
    are shown as ``\\xNN`` / ``\\uNNNN`` instead of being interpreted."""
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                       str(text))


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _entries(n: int) -> str:
    return _plural(n, "entry", "entries")


def _int_arg(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {safe(text)!r}")
        return value

    return parse


_positive = _int_arg(1)


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {safe(text)!r}")
    return value


def _calibration_dims() -> tuple[int, ...]:
    from .calibrate import HEAD_DIMS  # imports torch: only once `calibrate --dims` is parsed

    return HEAD_DIMS


def _int_list(allowed=None):
    """A parser of comma-separated positive ints, each one of ``allowed()`` where given."""
    def parse(text: str) -> list[int]:
        choices = allowed() if allowed else None
        parts = [x.strip() for x in text.split(",")]
        try:
            values = [int(x, 10) for x in parts]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values) or (choices and any(v not in choices for v in values)):
            what = " and/or ".join(map(str, choices)) if choices else "positive integers"
            raise argparse.ArgumentTypeError(f"takes {what}, comma-separated; got {safe(text)!r}")
        return values

    return parse


def _add_shape_args(p: argparse.ArgumentParser, *, b=1, h=16, s=16384, d=128) -> None:
    p.add_argument("-b", "--batch", type=_positive, default=b, help=f"batch size B (default {b})")
    p.add_argument("-H", "--heads", type=_positive, default=h, help=f"query heads Hq (default {h})")
    p.add_argument("--kv-heads", type=_positive, default=None, help="kv heads Hkv (default: Hq)")
    p.add_argument("-s", "--seq", type=_positive, default=s, help=f"sequence length for Sq and Sk (default {s})")
    p.add_argument("--sq", type=_positive, default=None, help="query length Sq (default: --seq)")
    p.add_argument("--sk", type=_positive, default=None, help="key length Sk (default: --seq)")
    p.add_argument("-d", "--dim", type=_positive, default=d, help=f"head dim D of q and k (default {d})")
    p.add_argument("--dv", type=_positive, default=None,
                   help="head dim Dv of v and the output (default: --dim; MLA prefill: -d 192 --dv 128)")
    p.add_argument("--v-in-k", action="store_true",
                   help="v is k's first Dv columns, k's memory (an MLA latent cache; decode: -d 576 --dv 512)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mask", choices=("none", "bool", "float"), default="none",
                   help="a dense (1, 1, Sq, Sk) mask of this kind")
    p.add_argument("--backend", choices=("auto", "lt", "wmma"), default="auto")
    p.add_argument("--workspace-mb", type=_positive, default=None,
                   help="workspace budget in MiB (default ATTN_LT_WORKSPACE_MB)")
    p.add_argument("--threshold", type=_positive, default=None, help="hybrid threshold (default ATTN_LT_THRESHOLD)")


def _case(a):
    from .validate import Case, MaskInfo

    Sq = a.seq if a.sq is None else a.sq
    Sk = a.seq if a.sk is None else a.sk
    Hkv = a.heads if a.kv_heads is None else a.kv_heads
    Dv = a.dim if a.dv is None else a.dv
    for name, val in (("batch", a.batch), ("heads", a.heads), ("kv-heads", Hkv), ("sq", Sq), ("sk", Sk),
                      ("dim", a.dim), ("dv", Dv)):
        if val < 1:
            raise ValueError(f"--{name} must be >= 1, got {val}")
    if a.heads % Hkv:
        raise ValueError(f"--heads {a.heads} must be a multiple of --kv-heads {Hkv}")
    mask = None
    if a.mask != "none":
        mask = MaskInfo(a.mask, "bool" if a.mask == "bool" else a.dtype, (1, 1, Sq, Sk), (0, 0, Sk, 1))
    v_in_k = getattr(a, "v_in_k", False)
    if v_in_k and Dv >= a.dim:
        raise ValueError(f"--v-in-k takes v's head dim below k's: --dv {Dv} is not below --dim {a.dim}")
    return Case.contiguous(a.batch, a.heads, Hkv, Sq, Sk, a.dim, a.dtype, a.causal, mask=mask, Dv=Dv, v_in_k=v_in_k,
                           window=getattr(a, "window", None), softcap=getattr(a, "softcap", None),
                           sinks=getattr(a, "sinks", False))


def _window(text: str) -> tuple[int, int]:
    """--window LEFT,RIGHT (-1: unbounded)."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints, -1 for unbounded), got {text!r}") from None
    return left, right


def _budget(a):
    return None if a.workspace_mb is None else a.workspace_mb << 20


def cmd_info(a) -> int:
    from .maintenance import environment

    info = environment()
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, val in info.items():
            print(f"{key:<{width}}  {safe(val)}")
    return EXIT_OK


def _chunk_count(text: str):
    if text.lower() == "all":
        return None
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"takes a number of chunks >= 0 or 'all', got {safe(text)!r}")
    return value


def _write_json_streaming(doc: dict, marker: str, items, after=None) -> None:
    """``json.dumps(doc, indent=2)`` with the list at the string ``marker`` written item by item from ``items``
    (an iterable of JSON-ready values): memory bounded by one item whatever their number. ``after``: {marker:
    function} for values after the list that are known once it is written (they must follow it in ``doc``)."""
    out = sys.stdout
    text = json.dumps(doc, indent=2)
    at = text.index(json.dumps(marker))
    head, tail = text[:at], text[at + len(json.dumps(marker)):]
    line = head.rsplit("\n", 1)[-1]
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    out.write(head + "[")
    first = True
    for item in items:
        out.write(("\n" if first else ",\n") + indent + json.dumps(item))
        first = False
    for m, value in (after or {}).items():
        tail = tail.replace(json.dumps(m), json.dumps(value()))
    out.write(("]" if first else "\n" + indent[:-2] + "]") + tail + "\n")


def cmd_explain(a) -> int:
    import itertools

    from .api import explain_case

    case = _case(a)
    e = _explain_fp8(case, a) if a.fp8 else explain_case(case, a.backend, _budget(a), a.threshold)
    listing = a.chunks is not False and e.plan is not None
    total = e.plan.n_chunks if e.plan is not None else 0
    shown = total if not listing or a.chunks is None else min(total, a.chunks)
    chunks = itertools.islice(e.plan.iter_chunks(), shown) if listing else iter(())
    if a.json:
        d = e.to_dict()
        if listing:
            from dataclasses import asdict

            d["plan"]["n_chunks"] = total
            d["plan"]["chunks_omitted"] = total - shown
            d["plan"]["chunks"] = "\x00chunks\x00"
            _write_json_streaming(d, "\x00chunks\x00", (asdict(c) for c in chunks))
        else:
            print(json.dumps(d, indent=2))
        return EXIT_OK
    print("\n".join(safe(line) for line in str(e).splitlines()))
    for c in chunks:
        print(f"  {c}")
    if listing and shown < total:
        print(f"  ... and {total - shown} more chunk{'' if total - shown == 1 else 's'} "
              f"(--chunks N lists N, --chunks all every one)")
    return EXIT_OK


def _explain_fp8(case, a):
    """``explain --fp8 kv|qkv``: attn_lt.explain on "meta" tensors of the case with k and v (and q) in e4m3."""
    import torch

    from .api import explain

    f8, half = torch.float8_e4m3fn, {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    q = torch.empty(case.B, case.Hq, case.Sq, case.D, dtype=f8 if a.fp8 == "qkv" else half, device="meta")
    k = torch.empty(case.B, case.Hkv, case.Sk, case.D, dtype=f8, device="meta")
    v = (k[..., :case.Dv] if case.v_in_k  # an MLA latent cache: v is k's first columns
         else torch.empty(case.B, case.Hkv, case.Sk, case.Dv, dtype=f8, device="meta"))
    mask = None
    if case.mask is not None:
        mask = torch.empty(1, 1, case.Sq, case.Sk, dtype=torch.bool if case.mask.dtype == "bool" else half,
                           device="meta")
    sinks = torch.empty(case.Hq, device="meta") if case.sinks else None
    return explain(q, k, v, attn_mask=mask, causal=case.causal, backend=a.backend, window=case.window,
                   softcap=case.softcap or None, sinks=sinks)


def cmd_demo(a) -> int:
    import torch

    case = _case(a)
    if not torch.cuda.is_available():
        from .api import explain_case

        print("No CUDA GPU is visible, so attn_lt cannot run here: its kernels need an NVIDIA GPU (sm_80 or newer)")
        print("with nvmath-python and the native library (built by `pip install .` where nvcc is found). This is "
              "what it would run:\n")
        print("\n".join(safe(line) for line in str(explain_case(case, a.backend, _budget(a), a.threshold))
                                              .splitlines()))
        return EXIT_OK
    from .maintenance import demo

    r = demo(case, a.backend, _budget(a), a.threshold, a.mask)
    print("\n".join(safe(line) for line in r["explain"].splitlines()))
    print(f"\n{'':<8}{'ms':>9}{'TFLOP/s':>9}{'rel err vs fp32':>17}")
    print(f"{'attn_lt':<8}{r['attn_lt_ms']:9.3f}{r['attn_lt_tflops']:9.1f}{r['error']:17.2e}")
    print(f"{'sdpa':<8}{r['sdpa_ms']:9.3f}{r['sdpa_tflops']:9.1f}{r['sdpa_error']:17.2e}")
    print(f"\n{'PASS' if r['ok'] else 'FAIL'}: attn_lt error {r['error']:.2e} vs allowed {r['allowed']:.2e} "
          f"(2 x PyTorch's + {1e-3:g}) on {safe(r['gpu'])}")
    return EXIT_OK if r["ok"] else EXIT_FAIL


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    done = width * i // max(n, 1)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {safe(label)[:60]:<60}")
    sys.stderr.flush()
    if i == n:
        sys.stderr.write("\n")


_SPEC_KEYS = {"b": "batch", "h": "heads", "hkv": "kv_heads", "s": "seq", "sq": "sq", "sk": "sk", "d": "dim",
              "dv": "dv", "dtype": "dtype", "causal": "causal"}


def parse_spec(spec: str) -> argparse.Namespace:
    """A shape like ``b=8,h=32,hkv=8,sq=1,sk=65536,d=128[,dv=64][,causal][,dtype=fp16]`` as explain's options."""
    ns = argparse.Namespace(batch=1, heads=16, kv_heads=None, seq=4096, sq=None, sk=None, dim=128, dv=None,
                            dtype="bf16", causal=False, mask="none")
    shown = safe(spec)[:120]
    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts:
        raise ValueError(f"shape {shown!r} is empty; e.g. b=1,h=16,s=4096,d=128")
    seen = set()
    for part in parts:
        name, eq, val = part.partition("=")
        if name not in _SPEC_KEYS:
            raise ValueError(f"shape {shown!r}: unknown field {safe(name)[:40]!r} (fields: {', '.join(_SPEC_KEYS)})")
        if name in seen:
            raise ValueError(f"shape {shown!r}: {name} is given twice")
        seen.add(name)
        if name == "causal":
            if val.lower() not in ("", "1", "true", "yes", "0", "false", "no") or (eq and not val):
                raise ValueError(f"shape {shown!r}: causal takes no value, or one of true/false/1/0/yes/no")
            ns.causal = val.lower() in ("", "1", "true", "yes")
        elif name == "dtype":
            if val not in ("bf16", "fp16"):
                raise ValueError(f"shape {shown!r}: dtype must be bf16 or fp16")
            ns.dtype = val
        else:
            try:
                setattr(ns, _SPEC_KEYS[name], _positive(val))
            except argparse.ArgumentTypeError:
                raise ValueError(f"shape {shown!r}: {name} must be a positive integer, got {safe(val)[:40]!r}") \
                    from None
    return ns


def _entries_json(items):
    return [{"env": env, "gemm": k, **e.to_dict()} for env, k, e in items]


def _store_note(cache) -> str:
    return "" if cache.state == "ok" else f" ({cache.state}: {cache.problem})"


def _cache_list(a, cache, name: str) -> int:
    """``cache list``: rows streamed from the store (memory independent of their number)."""
    from .cache import CacheStoreError

    out = sys.stdout
    try:
        if a.json:
            doc = {"path": str(cache.path), "state": cache.state, "problem": cache.problem, "entries": "\x00e\x00",
                   "skipped_rows": "\x00s\x00"}
            rows = ({"env": env, "gemm": k, **e.to_dict()} for env, k, e in cache.iter_items())
            _write_json_streaming(doc, "\x00e\x00", rows, after={"\x00s\x00": lambda: cache.skipped_rows})
            return EXIT_OK
        n = cache.count()
        print(safe(f"{cache.path}: {_entries(n)}{_store_note(cache)}"))
        header = True
        for env, k, e in cache.iter_items():
            if header:
                print(f"{'gemm':<64} {'algo':>5} {'splitk':>6} {'tuned ms':>10} {'heur ms':>10} {'gain':>6}  env")
                header = False
            gain = f"{e.heuristic_ms / e.median_ms:.2f}x" if e.heuristic_ms and e.median_ms else "-"
            heur = f"{e.heuristic_ms:>10.4f}" if e.heuristic_ms is not None else f"{'-':>10}"
            out.write(f"{safe(k):<64} {e.config.algo_id:>5} {e.config.splitk:>6} {e.median_ms:>10.4f} {heur} "
                      f"{gain:>6}  {safe(env)}\n")
    except CacheStoreError as e:
        print(f"{name}: {safe(e)}", file=sys.stderr)
        return EXIT_FAIL
    if cache.skipped_rows:
        print(safe(f"{_plural(cache.skipped_rows, 'row', 'rows')} skipped (they fail validation)"))
    return EXIT_OK


def cmd_cache(a) -> int:
    from .cache import default_cache

    cache = default_cache()
    try:
        return _cmd_cache(a, cache)
    finally:
        cache.close()  # the store's WAL files go with the last connection


def _cmd_cache(a, cache) -> int:
    from .cache import CacheError, CacheStoreError, ImportIncomplete, parse_key

    name = f"attn-lt cache {a.cache_cmd}"
    if a.cache_cmd == "list":
        return _cache_list(a, cache, name)
    if a.cache_cmd == "show":
        try:
            parse_key(a.key)
        except CacheError as e:
            print(f"{name}: {safe(e)}", file=sys.stderr)
            return EXIT_USAGE
        hits = cache.lookup(a.key)
        if not hits:
            print(safe(f"{name}: no entry for {a.key!r} in {cache.path}{_store_note(cache)}"), file=sys.stderr)
            return EXIT_FAIL
        if a.json:
            print(json.dumps([{"env": env, "gemm": a.key, **e.to_dict()} for env, e in hits], indent=2))
        else:
            for env, e in hits:
                print(f"gemm {safe(a.key)}\nenv  {safe(env)}\nwinner {e.config}\n  median {e.median_ms} ms, "
                      f"heuristic {e.heuristic_ms} ms, workspace {e.workspace} B, tuned {safe(e.tuned_at)}")
                for c, t in e.runners_up:
                    print(f"  runner-up {c}: {t} ms")
        return EXIT_OK
    if a.cache_cmd == "clear":
        try:
            n = cache.clear()
        except CacheStoreError as e:
            print(f"{name}: {safe(e)}", file=sys.stderr)
            return EXIT_FAIL
        try:
            size = f"; the file is now {os.path.getsize(cache.path)} bytes"
        except OSError:
            size = "; no file is left"
        print(safe(f"removed {_entries(n)} from {cache.path}{size}"))
        return EXIT_OK
    if a.cache_cmd == "export":
        try:
            n = cache.export(sys.stdout if a.file == "-" else a.file)
        except CacheError as e:
            print(f"{name}: {safe(e)}", file=sys.stderr)
            return EXIT_USAGE
        except CacheStoreError as e:
            print(safe(f"{name}: {e}"), file=sys.stderr)
            return EXIT_FAIL
        except (BrokenPipeError, _OutputError):
            raise  # the reader left, or standard output cannot be written: main says so (or nothing)
        except OSError as e:
            print(safe(f"{name}: could not write {a.file}: {e.strerror or e}; nothing was exported"), file=sys.stderr)
            return EXIT_FAIL
        print(safe(f"exported {_entries(n)} to {'standard output' if a.file == '-' else a.file}"
                   f"{_store_note(cache)}"), file=sys.stderr if a.file == "-" else sys.stdout)
        return EXIT_OK
    if a.cache_cmd == "import":
        try:
            n = cache.import_file(a.file)
        except ImportIncomplete as e:
            print(safe(f"{name}: {e}; run the import again to finish (entries already imported are replaced, "
                       "not duplicated)"), file=sys.stderr)
            return EXIT_FAIL
        except CacheStoreError as e:
            print(f"{name}: {safe(e)}", file=sys.stderr)
            return EXIT_FAIL
        except (CacheError, OSError) as e:
            msg = str(e) if isinstance(e, CacheError) else f"{a.file}: {e.strerror or e}"
            print(f"{name}: {safe(msg)}; nothing was imported", file=sys.stderr)
            return EXIT_USAGE
        print(safe(f"imported {_entries(n)} into {cache.path}"))
        return EXIT_OK
    cases = [_case(parse_spec(s)) for s in a.shapes] if a.cache_cmd == "tune" else []  # checked before GPU work
    import torch

    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU (none visible)", file=sys.stderr)
        return EXIT_USAGE
    try:
        from nvmath.bindings import cublasLt  # noqa: F401
    except ImportError as e:
        print(f"{name}: needs nvmath-python ({safe(e)})", file=sys.stderr)
        return EXIT_USAGE
    if a.cache_cmd == "tune":
        return _cache_tune(cases, cache)
    return _cache_verify(a, cache)


def _cache_tune(cases, cache) -> int:
    from .cache import current_env
    from .maintenance import tune_cases

    env = current_env().key()
    before = {k for _, k, _ in cache.items(env)}
    unsaved_before = cache.unsaved()
    tune_cases(cases, _progress)
    after = {k for _, k, _ in cache.items(env)}
    unsaved = cache.unsaved() - unsaved_before
    new = len(after - before)
    if unsaved > 0:
        print(safe(f"attn-lt cache tune: {_entries(unsaved)} tuned but not saved: the store at {cache.path} cannot "
                   f"be written{_store_note(cache)}; they last as long as this process"), file=sys.stderr)
        return EXIT_FAIL
    print(safe(f"{_plural(new, 'new entry', 'new entries')}; {_entries(len(after))} for this GPU in {cache.path}"))
    return EXIT_OK


def _cache_verify(a, cache) -> int:
    from .maintenance import verify_cache

    env, rows, bad = verify_cache(cache, a.tolerance, _progress)
    if a.json:
        print(json.dumps({"env": env, "entries": rows, "stale": bad}, indent=2))
    else:
        for r in rows:
            print(f"{safe(r['gemm']):<64} {r.get('cached_ms', ''):>10} {r.get('heuristic_ms', ''):>10}  "
                  f"{safe(r['status'])}")
        print(safe(f"{_entries(len(rows))} for {env}; {bad} stale or failing"))
    return EXIT_OK if bad == 0 else EXIT_FAIL


def cmd_calibrate(a) -> int:
    import time

    import torch

    from . import calibrate

    if not torch.cuda.is_available():
        print("attn-lt calibrate: needs a CUDA GPU (none visible)", file=sys.stderr)
        return EXIT_USAGE
    from . import plan
    from .cache import current_env
    from .testing import time_ms
    from .fused import WMMA

    start = time.perf_counter()
    prop = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu, cc = prop.name, f"{prop.major}.{prop.minor}"
    dims = a.dims or calibrate.HEAD_DIMS
    grid = calibrate.grid(dims, a.lengths, a.sq, prefill=not a.no_prefill, masks=not a.no_masks)
    jobs = [j for j in grid if not WMMA.not_supported_reasons(calibrate.job_case(j))]  # what the fused path runs
    runs = sorted({j["D"] for j in jobs})
    skipped = sorted(set(a.dims or ()) - set(runs))
    if skipped:
        print(safe(f"attn-lt calibrate: the fused path cannot run head dim {', '.join(map(str, skipped))} on "
                   f"this GPU; not measured"), file=sys.stderr)
    if not runs:
        print("attn-lt calibrate: nothing to measure", file=sys.stderr)
        return EXIT_USAGE
    if len(jobs) < len([j for j in grid if j["D"] in runs]):
        print(safe("attn-lt calibrate: cases of these head dims that the fused path cannot run (e.g. MLA head dims "
                   "with a mask or at other query lengths) are not measured"), file=sys.stderr)
    points, first_s = [], {"wmma": 0.0, "lt": 0.0}
    for i, job in enumerate(jobs):
        D, Dv, causal, Sq, Sk, B, Hq, Hkv = (job[n] for n in ("D", "Dv", "causal", "Sq", "Sk", "B", "Hq", "Hkv"))
        masked = job.get("mask", False)
        _progress(i, len(jobs), f"D{D} Sq{Sq} Sk{Sk}{' causal' if causal else ''}{' masked' if masked else ''}")
        point = dict(job)
        try:
            q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
            v = k[..., :Dv] if job["v_in_k"] else torch.randn(B, Hkv, Sk, Dv, device="cuda", dtype=torch.bfloat16)
            m = torch.randn(B, 1, Sq, Sk, device="cuda", dtype=torch.bfloat16) if masked else None
            out = torch.empty(B, Hq, Sq, Dv, device="cuda", dtype=torch.bfloat16)
            for backend in ("wmma", "lt"):
                pl = plan(q, k, v, attn_mask=m, causal=causal, backend=backend, algo_policy="tune", out=out)
                t0 = time.perf_counter()
                pl.run(q, k, v, m, out=out)  # the first call: for lt, algorithm tuning
                torch.cuda.synchronize()
                first_s[backend] += time.perf_counter() - t0
                point[f"{backend}_ms"] = round(time_ms(lambda: pl.run(q, k, v, m, out=out), warmup_ms=5, rep_ms=40),
                                               5)
        except Exception as e:  # out of memory, a refused case, a cuBLASLt error: recorded, the others go on
            point["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            q = k = v = m = out = pl = None
        if "error" in point:
            torch.cuda.empty_cache()
        points.append(point)
    _progress(len(jobs), len(jobs), "done")
    seconds = round(time.perf_counter() - start, 1)
    entry = calibrate.make_entry(points, gpu, cc, attn_lt=__version__, dtype="bf16", seconds=seconds,
                                 first_call_s={b: round(t, 1) for b, t in first_s.items()},
                                 grid={"dims": runs, "Sk": sorted(set(a.lengths)), "Sq": sorted(set(a.sq)),
                                       "prefill": not a.no_prefill, "masks": not a.no_masks})
    partial = bool(a.dims)  # --dims: the other head dims' measurements are kept
    where = calibrate.store(current_env().key(), entry, merge=partial)
    shipped, ship_error = None, None
    if a.ship is not None:
        try:
            shipped = calibrate.write_shipped(a.ship, entry, merge=partial)
        except OSError as e:
            ship_error = str(e)
    failed = [p for p in points if "error" in p]
    if a.json:
        print(json.dumps({**entry, "file": None if where is None else str(where),
                          "shipped": None if shipped is None else str(shipped), "ship_error": ship_error},
                         indent=1))
    else:
        for p in points:
            kind = "causal" if p["causal"] else "masked" if p.get("mask") else ""
            name = f"D{p['D']:<4}{kind:<7}Sq {p['Sq']:>6} Sk {p['Sk']:>6} " \
                   f"B{p['B']} Hq{p['Hq']} Hkv{p['Hkv']}"
            print(safe(f"{name:<52} {p['error']}" if "error" in p else
                       f"{name:<52} wmma {p['wmma_ms']:>9.4f} ms  lt {p['lt_ms']:>9.4f} ms"))
        print()
        for r in calibrate.derive_rules(points):
            print(safe(str(r)))
        print(safe(f"{len(points)} cases in {seconds} s (first calls: wmma {first_s['wmma']:.1f} s, lt "
                   f"{first_s['lt']:.1f} s with tuning); "
                   + (f"{len(failed)} FAILED (the rules come from the rest)" if failed else "none failed")))
        print(safe(f"stored in {where}" if where is not None else
                   f"NOT stored: {calibrate.path()} could not be written"))
        if a.ship is not None:
            print(safe(f"shipped calibration written to {shipped}" if shipped is not None else
                       f"shipped calibration NOT written: {ship_error}"))
    return EXIT_OK if where is not None and ship_error is None and not failed else EXIT_FAIL


class _Parser(argparse.ArgumentParser):
    """argparse with errors as sentences: ``--sq must be a positive integer, got '0'``, not
    ``argument --sq: invalid int value``; ``name a command: list, show, ...``, not ``required: cache_cmd``."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {safe(self._sentence(message))}\n")

    def _commands(self) -> list[str]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return list(action.choices)
        return []

    def _sentence(self, message: str) -> str:
        commands = self._commands()
        m = re.match(r"the following arguments are required: (.*)", message)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            if "COMMAND" in names and commands:
                return f"name a command: {', '.join(commands)} (see {self.prog} --help)"
            return f"missing {' and '.join(names)} (see {self.prog} --help)"
        m = re.match(r"argument (\S+): invalid choice: '?([^']*?)'? \(choose from (.*)\)$", message)
        if m:
            choices = m.group(3).replace("'", "")
            if m.group(1) == "COMMAND":
                return f"unknown command {m.group(2)!r}; the commands are {choices}"
            return f"{m.group(1)} must be one of {choices}; got {m.group(2)!r}"
        m = re.match(r"argument (\S+): (must be .*|takes .*)$", message)
        if m:
            return f"{m.group(1)} {m.group(2)}"
        m = re.match(r"argument (\S+): expected one argument", message)
        if m:
            return f"{m.group(1)} needs a value"
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            return f"unknown argument(s): {m.group(1)} (see {self.prog} --help)"
        return message


def cmd_explain_batch(a) -> int:
    import torch

    from .batch import explain_batch, fp8_line, mass_line, plan_batch

    shape = dict(max_seqlen_q=a.max_seqlen_q, max_seqlen_k=a.max_seqlen_k, block_size=a.block_size,
                 head_dim_v=a.head_dim_v, return_key_mass=a.key_mass,
                 kv_dtype=torch.float8_e4m3fn if a.fp8_kv else None)
    text = explain_batch(a.requests, a.heads_q, a.heads_kv, a.head_dim, **shape)
    if a.json:
        plan = plan_batch(a.requests, a.heads_q, a.heads_kv, a.head_dim, max_seqlen_q=a.max_seqlen_q,
                          max_seqlen_k=a.max_seqlen_k, block_size=a.block_size, Dv=a.head_dim_v)
        d = plan.to_dict()
        if a.fp8_kv:
            d["kv"] = fp8_line(plan, a.key_mass)
        if a.key_mass:
            d["key_mass"] = mass_line(plan)
        print(json.dumps(d, indent=2))
    else:
        print("\n".join(safe(line) for line in text.splitlines()))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an unexpected error (also ATTN_LT_DEBUG=1)")
    p = _Parser(prog="attn-lt", description="attn_lt: hybrid attention for NVIDIA GPUs", parents=[common])
    p.add_argument("--version", action="version", version=f"attn_lt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    s = sub.add_parser("info", help="GPU, CUDA/cuBLASLt versions, native library, budget, threshold, cache",
                       parents=[common])
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_info)
    s = sub.add_parser("explain", help="which path a case takes, why, and its chunk plan", parents=[common])
    _add_shape_args(s)
    s.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT",
                   help="a sliding window (FlashAttention's window_size; -1 unbounded; with --causal, RIGHT is 0)")
    s.add_argument("--softcap", type=float, default=None, help="logit softcapping (Gemma 2: 50)")
    s.add_argument("--sinks", action="store_true", help="attention sinks, one logit a query head (gpt-oss)")
    s.add_argument("--fp8", choices=("kv", "qkv"), default=None,
                   help="float8 e4m3 k and v (kv: an FP8 KV cache, q in --dtype: decode rows) or q, k and v too (qkv: "
                        "the FP8 prefill, output bf16)")
    s.add_argument("--chunks", type=_chunk_count, nargs="?", const=CHUNKS_SHOWN, default=False, metavar="N",
                   help=f"list the plan's chunks: the first N (default {CHUNKS_SHOWN}) or 'all' (streamed; a plan "
                        "of 10M keys has millions)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_explain)
    s = sub.add_parser("explain-batch", help="how a varlen or paged serving batch of a capacity runs, and why",
                       parents=[common])
    for name, default, what in (("requests", None, "requests a call holds at most"),
                                ("heads-q", 32, "query heads"), ("heads-kv", 8, "kv heads"),
                                ("head-dim", 128, "head dim"),
                                ("head-dim-v", None, "v's head dim (default: --head-dim; MLA decode: -d 576 "
                                 "--head-dim-v 512 --block-size 64)"),
                                ("max-seqlen-q", 1, "query rows a request, at most"),
                                ("max-seqlen-k", None, "keys a request, at most"),
                                ("block-size", 0, "keys a block of a paged cache (0: packed keys)")):
        s.add_argument(f"--{name}", type=int, default=default, required=default is None and name != "head-dim-v",
                       help=what)
    s.add_argument("--key-mass", action="store_true", help="say how return_key_mass=True runs for this batch")
    s.add_argument("--fp8-kv", action="store_true",
                   help="the cache in FP8 (e4m3): how the decode blocks read it, or that prefill rows convert it")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_explain_batch)
    s = sub.add_parser("demo", help="run one attention call, check it against PyTorch and time both",
                       parents=[common])
    _add_shape_args(s)
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("calibrate", help="time wmma against lt on this GPU over query length, key length, head dim "
                       "and causal; store the rules auto follows", parents=[common])
    s.add_argument("--dims", type=_int_list(_calibration_dims), default=None,
                   help="head dims to measure, comma-separated (64, 128, 192 (as MLA prefill: v's head dim 128), "
                        "256, 576 (as MLA decode: v k's first 512 columns); default: those the fused path runs); the "
                        "stored and shipped calibrations keep the other head dims' measurements")
    s.add_argument("--lengths", type=_int_list(), default=[1024, 4096, 16384, 65536],
                   help="key lengths to measure, comma-separated (default 1024,4096,16384,65536)")
    s.add_argument("--sq", type=_int_list(), default=[1, 16, 128, 1024],
                   help="query lengths to measure, comma-separated (default 1,16,128,1024), besides Sq = Sk")
    s.add_argument("--no-prefill", action="store_true", help="do not measure Sq = Sk")
    s.add_argument("--no-masks", action="store_true", help="do not measure cases with a dense mask")
    s.add_argument("--ship", metavar="DIR", default=None,
                   help="also write the calibration as package data for this GPU model into DIR "
                        "(e.g. attn_lt/calibrations)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_calibrate)
    c = sub.add_parser("cache", help="the per-shape cuBLASLt algorithm cache", parents=[common])
    csub = c.add_subparsers(dest="cache_cmd", metavar="COMMAND", required=True, parser_class=_Parser)
    x = csub.add_parser("list", help="every entry", parents=[common])
    x.add_argument("--json", action="store_true")
    x = csub.add_parser("show", help="one entry, by its GEMM key", parents=[common])
    x.add_argument("key", metavar="KEY")
    x.add_argument("--json", action="store_true")
    x = csub.add_parser("tune", help="tune every GEMM of these shapes (needs a GPU)", parents=[common],
                        description="SHAPE: b=1,h=16,hkv=16,s=16384,d=128[,sq=..,sk=..][,causal][,dtype=fp16]")
    x.add_argument("shapes", nargs="+", metavar="SHAPE")
    csub.add_parser("clear", help="remove every entry", parents=[common])
    x = csub.add_parser("export", help="write the entries to FILE as JSON (- for standard output)",
                        parents=[common])
    x.add_argument("file", metavar="FILE")
    x = csub.add_parser("import", help="merge the entries of FILE (validated; nothing is written if it is bad)",
                        parents=[common])
    x.add_argument("file", metavar="FILE")
    x = csub.add_parser("verify", help="re-time this GPU's entries; exit 1 if any no longer beats the heuristic",
                        parents=[common])
    x.add_argument("--tolerance", type=_tolerance, default=0.02, help="allowed slowdown against the heuristic")
    x.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_cache)
    return p


class _TerminalLog(logging.Handler):
    """The library's warnings on the command line: one line each on stderr, escaped."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(safe(record.getMessage()) + "\n")
        except Exception:  # a closed stderr: nothing to say it on
            pass


_LOG_HANDLER = _TerminalLog(logging.WARNING)


class _OutputError(Exception):
    """Standard output could not be written (a full disk, /dev/full, an I/O error): not the command's fault."""

    def __init__(self, err: OSError):
        super().__init__(err.strerror or str(err))
        self.err = err


class _Stdout:
    """Standard output for one command: a write that fails says so as :class:`_OutputError` (a closed pipe stays
    BrokenPipeError), so that the command ends with one clear line instead of an unexpected error."""

    def __init__(self, f):
        self._f = f

    def write(self, text):
        try:
            return self._f.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError(e) from None

    def flush(self):
        try:
            self._f.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError(e) from None

    def __getattr__(self, name):
        return getattr(self._f, name)


def _silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null: the interpreter's last flush then has nowhere to fail."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds: an export's temporary file is removed on the way out


def main(argv=None) -> int:
    """Run one command; never raises (the exit code and one line on stderr say what went wrong)."""
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    log = logging.getLogger("attn_lt")
    if _LOG_HANDLER not in log.handlers:
        log.addHandler(_LOG_HANDLER)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False) or os.environ.get("ATTN_LT_DEBUG", "").strip() not in ("", "0")
    name = "attn-lt " + args.command + (f" {args.cache_cmd}" if args.command == "cache" else "")
    real_stdout = sys.stdout
    sys.stdout = _Stdout(real_stdout)
    old_term = None
    try:
        old_term = signal.signal(signal.SIGTERM, _terminate)
    except (ValueError, OSError):  # not the main thread
        pass
    try:
        code = args.fn(args)
        sys.stdout.flush()
        return code
    except _OutputError as e:
        print(f"{name}: could not write to standard output: {safe(e)}", file=sys.stderr)
        if sys.stdout is not real_stdout and real_stdout is sys.__stdout__:
            _silence_stdout()
        return EXIT_FAIL
    except (ValueError, TypeError) as e:
        if debug:
            traceback.print_exc()
        print(f"{name}: error: {safe(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `attn-lt cache list | head`: the reader left; say nothing more
        if real_stdout is sys.__stdout__:
            _silence_stdout()
        return EXIT_FAIL
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"{name}: unexpected error: {type(e).__name__}: {safe(e)}"
              f"{'' if debug else ' (run with --debug or ATTN_LT_DEBUG=1 for the traceback)'}", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        sys.stdout = real_stdout
        if old_term is not None:
            try:
                signal.signal(signal.SIGTERM, old_term)
            except (ValueError, OSError):
                pass
