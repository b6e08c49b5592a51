"""The architecture rules (CPU): no module, tool or test imports another module's private (``_``) names, and the
package's modules import each other without a circle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "attn_lt"


def python_files(*dirs):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_no_private_names_imported_across_modules():
    bad = []
    for f in python_files("attn_lt", "tools", "tests"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        bad.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {a.name} from {node.module}")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in {"cublaslt", "algos", "native", "cache", "chunks",
                                                              "api", "config", "calibrate", "select", "validate",
                                                              "path", "attn_lt", "suite", "merge", "distributed"}:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} uses {base.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def module_name(f: pathlib.Path) -> str:
    rel = f.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(f: pathlib.Path) -> set[str]:
    """Every attn_lt module ``f`` imports, at any depth (lazy imports inside functions count too)."""
    me = module_name(f)
    pkg = me if f.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("attn_lt"):
                continue
            for a in node.names:  # "from . import config" names a module
                sub = f"{mod}.{a.name}"
                out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists()
                        or (ROOT / sub.replace(".", "/")).is_dir() else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("attn_lt")}
    out.discard(me)
    return {m for m in out if m not in ("attn_lt", "attn_lt.lt")}  # package inits: the public surface


def test_no_import_circle():
    graph = {module_name(f): imports_of(f) for f in PKG.rglob("*.py")}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
