"""The shape of the code that review alone does not keep: no function in src/ longer than MAX_LINES."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from tests.helpers import ROOT

MAX_LINES = 80


def long_functions(paths: Iterable[Path], limit: int = MAX_LINES) -> list[str]:
    """Every function, method or nested function in `paths` longer than `limit` lines (from its first decorator
    or `def` to its last line, docstring included), as 'path:line name (n lines)'."""
    out = []
    for path in sorted(paths):
        nodes = [n for n in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = node.end_lineno - first + 1
            if n > limit:
                out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_in_src_is_longer_than_the_limit() -> None:
    long = long_functions((ROOT / "src").rglob("*.py"))
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(long)


def test_the_check_finds_long_methods_and_nested_functions(tmp_path: Path) -> None:
    def lines(indent: int) -> str:
        return "".join(" " * indent + f"x{i} = {i}\n" for i in range(MAX_LINES))

    code = ("class A:\n    @staticmethod\n    def method():\n" + lines(8) +
            "\ndef short():\n    return 1\n\n"
            "def outer():\n    def inner():\n" + lines(8) + "        return 0\n    return inner\n")
    f = tmp_path / "m.py"
    f.write_text(code)
    found = long_functions([f])
    assert [s.split()[1] for s in found] == ["method", "outer", "inner"], found
    assert f"method ({MAX_LINES + 2} lines)" in found[0]  # the decorator counts
