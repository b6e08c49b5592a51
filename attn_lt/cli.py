"""``attn-lt`` (also ``python -m attn_lt``): info, explain, demo."""

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


def cmd_info(a) -> int:
    from . import native

    info = {"attn_lt": __version__, "native_library": native.status(),
            "workspace_budget_mib": config.workspace_bytes() >> 20, "threshold": config.threshold()}
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
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(map(len, info))
        for key, val in info.items():
            print(f"{key:<{width}}  {val}")
    return EXIT_OK


def cmd_explain(a) -> int:
    from .api import explain_case

    e = explain_case(_case(a), a.backend, _budget(a), a.threshold)
    if a.json:
        d = e.to_dict()
        if d["plan"] is not None and not a.chunks:
            d["plan"]["chunks"] = len(d["plan"]["chunks"])
        print(json.dumps(d, indent=2))
    else:
        print(e)
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
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"attn-lt {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
