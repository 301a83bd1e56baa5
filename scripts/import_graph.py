"""The import graph between shardfit's subpackages: cycles, and every function-local import with its place.

Usage: python scripts/import_graph.py [--json]. tests/test_architecture.py asserts on `graph()`.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "shardfit"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted (shardfit.plan.estimate)
    target: str  # what it imports, dotted
    line: int
    local: bool  # inside a function


def package_of(dotted: str) -> str:
    """The subpackage (or top-level module) a shardfit module belongs to: shardfit.plan.estimate -> plan."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports() -> list[Import]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        tree = ast.parse(path.read_text())
        local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                out.append(Import(module, t, node.lineno, id(node) in local_nodes))
    return out


def graph(edges: list[Import] | None = None) -> dict[str, set[str]]:
    """Subpackage -> the subpackages it imports (module-level and local imports alike)."""
    g: dict[str, set[str]] = {}
    for imp in edges if edges is not None else imports():
        if not imp.target.startswith("shardfit"):
            continue
        a, b = package_of(imp.module), package_of(imp.target)
        if a != b and b != "shardfit":
            g.setdefault(a, set()).add(b)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first search from each node (small graphs only)."""
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(g.get(node, ())):
            if nxt == start:
                i = path.index(min(path))
                found.add(tuple(path[i:] + path[:i]))
            elif nxt not in path:
                walk(start, nxt, path + [nxt])

    for n in sorted(g):
        walk(n, n, [n])
    return [list(c) for c in sorted(found)]


def main() -> int:
    edges = imports()
    g = graph(edges)
    local = [e for e in edges if e.local]
    if "--json" in sys.argv:
        print(json.dumps({"graph": {k: sorted(v) for k, v in sorted(g.items())}, "cycles": cycles(g),
                          "local_imports": [e.__dict__ for e in local]}, indent=1))
        return 0
    for k in sorted(g):
        print(f"{k:>10} -> {', '.join(sorted(g[k]))}")
    print("cycles:", cycles(g) or "none")
    print(f"function-local imports: {len(local)} "
          f"({sum(e.target.startswith('shardfit') for e in local)} of shardfit modules)")
    for e in local:
        print(f"  {e.module}:{e.line} {e.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
