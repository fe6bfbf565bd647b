"""The shape of the library's code: its largest files and functions, and the medians.

    python benchmarks/code_shape.py [ROOT]

Counts every line (docstrings and comments included) of the ``.py`` files under ``amir_lightning/`` and
``callbacks/`` of ROOT (default: this checkout); a function's size runs from its ``def`` to its last line.
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    files = sorted(p for folder in ("amir_lightning", "callbacks") for p in (root / folder).rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(root)) for p in files), reverse=True)
    functions = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    functions.sort(reverse=True)
    print(f"| {root} | lines |\n|---|---|")
    for lines, name in sizes[:8]:
        print(f"| {name} | {lines} |")
    for lines, name in functions[:5]:
        print(f"| {name} | {lines} |")
    median_file = statistics.median(n for n, _ in sizes)
    median_function = statistics.median(n for n, _ in functions)
    print(f"| {len(files)} files, median file / function | {median_file:g} / {median_function:g} |")


if __name__ == "__main__":
    main()
