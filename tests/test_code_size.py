"""The guide's size limits on the package: no function over 100 lines, no module over 600 (issue 37)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fitburst"
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 100, 600


def test_no_function_over_100_lines_and_no_module_over_600():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if (n := len(src.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, too_long
