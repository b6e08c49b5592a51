#!/usr/bin/env python3
"""The compiler's report on every kernel instantiation in native/: registers, shared memory, stack and spills, as
ptxas gives them. Each native/*.cu is compiled as native/build.py compiles it (its flags and targets, imported
from it) plus ``-Xptxas -v``, into a scratch directory; nothing is installed.

    python tools/dev/kernel_report.py [--only flash_sm90,mass_sm90] [--jobs N] [--out FILE.md]

Prints a line a (kernel, target) and a summary; ``--out`` writes the same as a Markdown table. Registers are the
launch's: the Hopper kernels (sm_90a) then move them between warpgroups with ``setmaxnreg`` (producer 24 or 40,
consumers 240 or 232, native/flash_sm90.cu), where a spill would show as spill stores here. Shared memory is the
static part; the Hopper kernels' dynamic shared memory is their layouts' ``kSmem``, held within 227 KB by
``static_assert``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse(text: str) -> list[dict]:
    """ptxas -v output to one dict a compiled entry function: kernel (mangled), target, registers, smem (static
    bytes), stack, spill_stores, spill_loads. A device function's own properties (outside an entry's block) are
    not counted."""
    rows, cur = [], None
    for line in text.splitlines():
        m = ENTRY.search(line)
        if m:
            cur = dict(kernel=m.group(1), target=m.group(2), registers=None, smem=0, stack=0, spill_stores=0,
                       spill_loads=0)
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = PROPS.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = USED.search(line)
        if m:
            cur.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
            cur = None  # the entry's block ends with its usage line
    return rows


def short_name(demangled: str) -> str:
    """A demangled kernel name without its namespace and parameter list: ``flash_sm90_fwd<128, 128, ...>``."""
    name = demangled.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):  # cut at the parameter list: the first '(' outside the template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def demangle(names: list[str]) -> list[str]:
    """Short demangled names (c++filt), or the mangled ones where it is not installed."""
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return [short_name(d) for d in out] if len(out) == len(names) else names


def load_build():
    """native/build.py as a module (the flags and targets the library is built with)."""
    spec = importlib.util.spec_from_file_location("attn_lt_native_build", ROOT / "native" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_unit(build, nvcc: str, cu: Path, out_dir: Path) -> str:
    cmd = build.compile_command(nvcc, cu, out_dir / (cu.stem + ".o"), "-Xptxas", "-v")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {cu.name}:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated source stems (flash_sm90,...); default: every native/*.cu")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--out", help="write a Markdown table here too")
    a = ap.parse_args(argv)
    build = load_build()
    nvcc = build.find_nvcc()
    if nvcc is None:
        print("kernel_report: nvcc not found (native/build.py's search)", file=sys.stderr)
        return 2
    units = sorted((ROOT / "native").glob("*.cu"))
    if a.only:
        wanted = set(a.only.split(","))
        units = [u for u in units if u.stem in wanted]
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        logs = list(pool.map(lambda cu: compile_unit(build, nvcc, cu, Path(tmp)), units))
    rows = []
    for cu, log in zip(units, logs):
        for r in parse(log):
            rows.append(dict(r, source=cu.name))
    for r, name in zip(rows, demangle([r["kernel"] for r in rows])):
        r["name"] = name
    rows.sort(key=lambda r: (r["source"], r["name"], r["target"]))
    lines = [f"{r['source']:<16} {r['target']:<7} regs {r['registers']:>3}  smem {r['smem']:>6}  stack {r['stack']:>4}"
             f"  spills {r['spill_stores']:>4}/{r['spill_loads']:<4} {r['name']}" for r in rows]
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    summary = (f"{len(rows)} kernel builds ({len({r['name'] for r in rows})} instantiations) in "
               f"{len(units)} sources; {len(spilling)} spill: " +
               (", ".join(f"{r['name']} {r['target']} {r['spill_stores']}/{r['spill_loads']} B" for r in spilling)
                or "none"))
    print("\n".join(lines + [summary]))
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# Compiler report\n\nEvery kernel instantiation of native/ as ptxas reports it (nvcc "
                    f"{build.nvcc_version(nvcc)}, {datetime.date.today()}, `python tools/dev/kernel_report.py --out "
                    f"FILE`). Registers are the launch's: the sm_90a kernels\nmove them between warpgroups with "
                    f"`setmaxnreg`. Shared memory is the static part: the Hopper kernels' dynamic shared memory is "
                    f"their\nlayouts' `kSmem`, held within 227 KB by `static_assert`.\n\n")
            f.write("| source | target | registers | static smem | stack | spill stores / loads | kernel |\n"
                    "|---|---|---|---|---|---|---|\n")
            for r in rows:
                f.write(f"| {r['source']} | {r['target']} | {r['registers']} | {r['smem']} | {r['stack']} | "
                        f"{r['spill_stores']} / {r['spill_loads']} | `{r['name']}` |\n")
            f.write(f"\n{summary}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
