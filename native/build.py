#!/usr/bin/env python3
"""Build attn_lt's native parts: the CUDA library ``libattn_lt.so`` (nvcc) and the compiled fast path (a C++
extension against the installed torch). The one place that says how they are built: ``pip install .`` /
``pip wheel .`` (setup.py) and ``make native`` call it.

    python native/build.py [--out DIR] [--jobs N] [--force]      (default DIR: attn_lt/_native, in place)

Rules:
* CUDA library: every ``native/*.cu`` compiled for sm_80 and sm_90 machine code plus sm_90 PTX (newer GPUs JIT
  it); the Hopper kernels (``*_sm90.cu``: wgmma, setmaxnreg) only for the arch-specific sm_90a target, linked
  into the same library. The CUDA runtime is linked statically: the library needs only the driver.
* Fast path: ``native/fastpath.cpp`` against the headers of the torch that the building Python has (in-process, or
  where pip isolates the build, that Python's own environment); its file name carries the Python and torch
  versions (:func:`attn_lt.native.fastpath_filename`), so another torch simply does not load it. No rpath: torch
  has loaded its libraries before attn_lt loads the extension.
* Each artifact carries the hash of its sources (``attn_lt.native.source_hash`` / ``fastpath_source_hash``), and a
  build whose hash matches is kept. ``BUILD.txt`` beside them records what was built and what was not, and why;
  ``attn-lt info`` and the library's errors quote it.
* Without nvcc (``NVCC``, ``PATH``, ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin``) or a C++ compiler, or with
  ``ATTN_LT_SKIP_NATIVE=1``, that part is skipped with one line; the package imports and explains without it.
  A compiler error is an error (exit 1) with the end of the log, which is written to ``build/native/build.log``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "native"
BUILD = ROOT / "build" / "native"
sys.path.insert(0, str(ROOT))
from attn_lt import native  # noqa: E402  (torch-free: the source hashes and file names)

GENCODE = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-gencode", "arch=compute_90,code=compute_90"]
SM90A_GENCODE = ["-gencode", "arch=compute_90a,code=sm_90a"]
NVCCFLAGS = ["-O3", "-std=c++17", "-Xcompiler", f"-fPIC,-Wall,-ffile-prefix-map={ROOT}/=", "-Xptxas", "-warn-spills",
             "--expt-relaxed-constexpr"]
LIBRARY = "libattn_lt.so"
SKIP_ENV = "ATTN_LT_SKIP_NATIVE"


def say(msg: str) -> None:
    print(f"attn_lt build: {msg}", flush=True)


def skipped() -> bool:
    """Whether ``ATTN_LT_SKIP_NATIVE`` asks for a pure-Python package."""
    return os.environ.get(SKIP_ENV, "").strip() not in ("", "0")


def skip_reason() -> str | None:
    """Why the CUDA library is not built here (``ATTN_LT_SKIP_NATIVE`` set, or no nvcc), else None."""
    if skipped():
        return f"{SKIP_ENV} is set"
    if find_nvcc() is None:
        return "nvcc not found (CUDA 12 or 13 toolkit; set NVCC or put it on PATH)"
    return None


def find_nvcc() -> str | None:
    """nvcc from ``NVCC``, ``PATH``, ``$CUDA_HOME/bin`` or ``/usr/local/cuda/bin``; None if there is none."""
    explicit = os.environ.get("NVCC")
    if explicit:
        return explicit if shutil.which(explicit) else None
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def _stamp_holds(path: Path, want: str) -> bool:
    stamp = Path(str(path) + ".hash")
    return path.is_file() and stamp.is_file() and stamp.read_text().strip() == want


def _install(built: Path, dest: Path, want: str) -> None:
    """Put ``built`` at ``dest`` whole or not at all, with its source hash beside it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.copyfile(built, tmp)
    os.replace(tmp, dest)
    Path(str(dest) + ".hash").write_text(want + "\n")


def _kept(dest: Path, want: str, force: bool) -> str | None:
    """Whether ``dest`` need not be built: "" when it holds sources ``want`` already, " (the in-place build)" when
    the in-place build does and was copied there, None when it must be built."""
    if force:
        return None
    if _stamp_holds(dest, want):
        return ""
    in_place = ROOT / "attn_lt" / "_native" / dest.name
    if in_place != dest and _stamp_holds(in_place, want):
        _install(in_place, dest, want)
        return " (the in-place build)"
    return None


def _run_logged(cmd: list[str], log) -> int:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(proc.stdout)
    log.flush()
    return proc.returncode


def compile_command(nvcc: str, cu: Path, obj: Path, *extra: str) -> list[str]:
    """nvcc's command line for one native/*.cu to the object ``obj``: the library's flags, and its targets (sm_90a
    alone for the *_sm90 units, else sm_80 and sm_90), then ``extra``."""
    gencode = SM90A_GENCODE if cu.stem.endswith("_sm90") else GENCODE
    return [nvcc, *NVCCFLAGS, *gencode, "--threads", "0", *extra, "-c", "-o", str(obj), str(cu)]


def build_library(out_dir: Path, jobs: int, force: bool, log) -> tuple[str, bool]:
    """``out_dir/libattn_lt.so`` from native/: returns its state in one line and whether this call changed or
    skipped it (worth saying); raises RuntimeError if nvcc fails."""
    want = native.source_hash(SRC)
    dest = out_dir / LIBRARY
    kept = _kept(dest, want, force)
    if kept is not None:
        return f"{LIBRARY}: built from sources {want}{kept}", bool(kept)
    why = skip_reason()
    if why is not None:
        return f"{LIBRARY}: not built, {why}; attn_lt imports and explains, GPU calls need the library", True
    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    say(f"compiling {LIBRARY} with nvcc {version} for sm_80, sm_90, sm_90a (a few minutes the first time; "
        f"log: {BUILD.relative_to(ROOT) / 'build.log'})")
    t0 = time.monotonic()
    obj_dir = BUILD / want
    obj_dir.mkdir(parents=True, exist_ok=True)
    define = f'-DATTN_LT_SOURCE_HASH="{want}"'
    units = [compile_command(nvcc, cu, obj_dir / (cu.stem + ".o"), define) for cu in sorted(SRC.glob("*.cu"))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        codes = list(pool.map(lambda cmd: _run_logged(cmd, log), units))
    if any(codes):
        raise RuntimeError(f"nvcc failed on {[Path(u[-1]).name for u, c in zip(units, codes) if c]}")
    linked = obj_dir / LIBRARY
    if _run_logged([nvcc, *GENCODE, "-shared", "-o", str(linked), *(u[-2] for u in units)], log):
        raise RuntimeError(f"nvcc failed to link {LIBRARY}")
    _install(linked, dest, want)
    return f"{LIBRARY}: built from sources {want} with nvcc {version} in {time.monotonic() - t0:.0f} s", True


_TORCH_PROBE = """
import json, sys, sysconfig, torch
from torch.utils import cpp_extension
print(json.dumps({"version": torch.__version__, "lib": str(__import__("pathlib").Path(torch.__file__).parent / "lib"),
                  "include": cpp_extension.include_paths(), "cxx11_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
                  "python_include": sysconfig.get_paths()["include"], "cache_tag": sys.implementation.cache_tag}))
"""


def torch_build_info() -> dict | None:
    """What the fast path builds against: the torch this Python imports, or where pip isolates the build (its
    overlay on PYTHONPATH, user site off), the torch of this Python's own environment. None without torch."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "pip-build-env" not in p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if not paths:
        del env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, env=env, cwd="/")
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_fastpath(out_dir: Path, force: bool, log) -> tuple[str, bool]:
    """``out_dir/_fastpath-<python>-torch<version>.so``: returns its state in one line and whether this call
    changed or skipped it; raises RuntimeError if the compiler fails."""
    if skipped():
        return f"fast path: not built, {SKIP_ENV} is set", True
    info = torch_build_info()
    if info is None:
        return ("fast path: not built, torch is not importable by this Python (attn_lt runs without it, a few µs "
                "more a call)"), True
    dest = out_dir / native.fastpath_filename(info["cache_tag"], info["version"])
    want = native.fastpath_source_hash(SRC)
    kept = _kept(dest, want, force)
    if kept is not None:
        return f"fast path: {dest.name} built from sources {want}{kept}", bool(kept)
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    python_h = Path(info["python_include"]) / "Python.h"
    missing = [what for what, ok in (("a C++ compiler", cxx), (str(python_h), python_h.is_file())) if not ok]
    if missing:
        return (f"fast path: not built, {' and '.join(missing)} missing (attn_lt runs without it, a few µs more "
                "a call)"), True
    obj_dir = BUILD / want
    obj_dir.mkdir(parents=True, exist_ok=True)
    built = obj_dir / dest.name
    site = Path(info["lib"]).parent.parent  # no build-machine paths in the binary (assertion messages)
    py_include = Path(info["python_include"]).parent
    cmd = [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-Wall", "-Wno-c++20-extensions",
           f"-ffile-prefix-map={site}/=", f"-ffile-prefix-map={ROOT}/=", f"-ffile-prefix-map={py_include}/=",
           f"-D_GLIBCXX_USE_CXX11_ABI={info['cxx11_abi']}", f'-DATTN_LT_FASTPATH_HASH="{want}"', f"-I{SRC}",
           f"-I{info['python_include']}", *(f"-I{p}" for p in info["include"]), str(SRC / "fastpath.cpp"),
           f"-L{info['lib']}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", "-o", str(built)]
    t0 = time.monotonic()
    if _run_logged(cmd, log):
        raise RuntimeError(f"the C++ compiler failed on fastpath.cpp for torch {info['version']}")
    _install(built, dest, want)
    return f"fast path: {dest.name} built from sources {want} in {time.monotonic() - t0:.0f} s", True


def build(out_dir: Path, jobs: int | None = None, force: bool = False) -> list[str]:
    """Build both parts into ``out_dir``; returns their one-line reports (also written to ``out_dir/BUILD.txt``).
    Raises RuntimeError when a compiler fails."""
    jobs = jobs or min(4, os.cpu_count() or 1)
    BUILD.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / native.BUILD_RECORD
    said = set(record.read_text().splitlines()) if record.is_file() else set()  # a skip is said once, not per run
    with open(BUILD / "build.log", "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} -> {out_dir}\n")
        lines = []
        for step in (lambda: build_library(out_dir, jobs, force, log), lambda: build_fastpath(out_dir, force, log)):
            try:
                line, news = step()
            except RuntimeError as e:
                log.flush()
                tail = (BUILD / "build.log").read_text(errors="replace").splitlines()[-40:]
                raise RuntimeError(f"{e}\n" + "\n".join(tail)) from None
            lines.append(line)
            if news and line not in said:
                say(line)
    record.write_text("\n".join(lines) + "\n")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "attn_lt" / "_native", help="output folder")
    ap.add_argument("--jobs", type=int, default=None, help="compile units in parallel (default min(4, CPUs))")
    ap.add_argument("--force", action="store_true", help="rebuild even where the source hashes match")
    a = ap.parse_args(argv)
    try:
        build(a.out, a.jobs, a.force)
    except RuntimeError as e:
        print(f"attn_lt build: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
