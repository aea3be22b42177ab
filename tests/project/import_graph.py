"""The import graph of the gpucoll package, read from the source with ast (nothing is imported or run).

    python tests/project/import_graph.py            # summary: circles, function-level imports, per file
    python tests/project/import_graph.py --edges    # also every file -> file edge

Counted:
- circles: groups of files that reach each other through imports (strongly connected components of more than one
  file), imports anywhere in a file (module top or function body) counted alike;
- function-level imports of gpucoll's own modules (``gpucoll._C`` included): imports inside a def or class body.
  Optional heavy packages (torch, cupy, mpi4py, matplotlib, tqdm) imported lazily are not counted: they stay lazy
  on purpose, so that ``import gpucoll`` never loads them. Nor is the package's own lazy attribute gate, the
  module-level ``__getattr__`` of ``gpucoll/__init__.py`` (``gpucoll.init`` and the rest load on first use, so that
  ``import gpucoll`` does not load the native core): those are listed apart, as "lazy attributes". Nor are those of
  an entry point that another program loads (ENTRY_POINTS: torch runs gpucoll/_torch_plugin.py inside every
  ``import torch``, which must not load gpucoll.torch and its native core): listed apart too.

Importing a submodule also runs its parent package's ``__init__``; those implicit edges are not drawn (they would
tie every package to its own files), only what the ``import`` statements name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpucoll"
# Modules that other programs load through an entry point (pyproject.toml), whose function-level imports are deferred
# on purpose: what they import would otherwise load wherever that program runs.
ENTRY_POINTS = {"gpucoll._torch_plugin"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict:
    """module name -> path, for every .py file of the package."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(node, here: str, is_package: bool, modules: dict) -> list:
    """The gpucoll modules an import statement names (names that are not files, such as gpucoll._C, included)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "gpucoll"]
    if node.level:
        base = here.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != "gpucoll":
        return []
    out = []
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        # `from gpucoll import config` names the module gpucoll.config; `from gpucoll.errors import X` a name in it.
        out.append(sub if sub in modules or sub == "gpucoll._C" else mod)
    return out


def _walk(tree, is_package: bool):
    """(import node, where) for every import of a module: where is "top", "function" (inside a def or class body)
    or "lazy" (inside a package's module-level __getattr__, PEP 562)."""
    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                lazy = where == "top" and is_package and getattr(child, "name", "") == "__getattr__"
                yield from visit(child, "lazy" if lazy else where if where != "top" else "function")
            else:
                yield from visit(child, where)
    yield from visit(tree, "top")


def graph(lazy=None):
    """(edges: module -> set of modules, nested: [(file, line, module)] function-level imports of gpucoll); the
    package's lazy attributes and the entry points' deferred imports are appended to `lazy` when given."""
    modules = _files()
    edges = {m: set() for m in modules}
    nested = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node, where in _walk(tree, is_package):
            for target in _targets(node, mod, is_package, modules):
                row = (str(path.relative_to(ROOT)), node.lineno, target)
                if where == "function" and mod not in ENTRY_POINTS:
                    nested.append(row)
                elif where in ("lazy", "function") and lazy is not None:
                    lazy.append(row)
                if target in modules and target != mod:
                    edges[mod].add(target)
    return edges, nested


def circles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(out)


def main(argv) -> int:
    lazy: list = []
    edges, nested = graph(lazy)
    found = circles(edges)
    print(f"files: {len(edges)}; import edges: {sum(len(v) for v in edges.values())}")
    print(f"circles: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))
    statements = {(path, line) for path, line, _ in nested}
    native = {(path, line) for path, line, t in nested if t == "gpucoll._C"}
    print(f"function-level import statements of gpucoll modules: {len(statements)} (naming gpucoll._C: "
          f"{len(native)}; modules named: {len(nested)})")
    per_file: dict = {}
    for path, _ in statements:
        per_file[path] = per_file.get(path, 0) + 1
    for path, n in sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:3d}  {path}")
    print(f"lazy attributes of a package (module-level __getattr__) and entry points' deferred imports, not counted "
          f"above: {len(lazy)}")
    for path, line, target in lazy:
        print(f"  {path}:{line} {target}")
    if "--edges" in argv:
        for mod in sorted(edges):
            for target in sorted(edges[mod]):
                print(f"{mod} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
