#!/usr/bin/env python3
"""Build attn_lt's compiled fast path (native/fastpath.cpp) for the torch and the Python running this script.

    python3 native/build_fastpath.py        (`make native` runs it)

Writes attn_lt/_native/_fastpath-<python>-torch<version>.so (attn_lt.fastpath.extension_path) and, beside it,
the hash of the sources it was built from (`.so.hash`); a build of the same sources is kept. Without a C++ compiler or Python's headers it says so and exits 0: attn_lt runs without the fast
path (the Python path, a few µs more a call). A compiler error exits 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    try:
        import torch
        from torch.utils import cpp_extension

        from attn_lt import fastpath
    except ImportError as e:  # before `pip install -e .` on a fresh machine: `make install` builds it after
        print(f"build_fastpath: not built, {e}; attn_lt runs without its fast path", file=sys.stderr)
        return 0

    out = fastpath.extension_path()
    stamp = Path(str(out) + ".hash")
    want = fastpath.source_hash()
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == want:
        return 0
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [what for what, ok in (("a C++ compiler", cxx), (str(python_h), python_h.is_file())) if not ok]
    if missing:
        print(f"build_fastpath: not built, {' and '.join(missing)} missing; attn_lt runs without its fast path",
              file=sys.stderr)
        return 0
    lib = Path(torch.__file__).resolve().parent / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", "-Wall", "-Wno-c++20-extensions",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f'-DATTN_LT_FASTPATH_HASH="{want}"', f"-I{ROOT / 'native'}",
           f"-I{python_h.parent}", *(f"-I{p}" for p in cpp_extension.include_paths()),
           str(ROOT / "native" / "fastpath.cpp"), f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
           f"-Wl,-rpath,{lib}", "-o", str(out) + ".tmp"]
    print(" ".join(cmd))
    if subprocess.call(cmd) != 0:
        return 1
    os.replace(str(out) + ".tmp", out)  # whole or not at all
    stamp.write_text(want + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
