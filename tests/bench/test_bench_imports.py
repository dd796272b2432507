"""bench/ stands alone: it imports nothing from tests/ (what both need, such as the hostile-input matrix and the
tiny tokenizer, lives in bench/ and the tests import it from there)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_bench_imports_nothing_from_tests() -> None:
    offenders = {str(p.relative_to(BENCH.parent)): sorted(m for m in imported_modules(p)
                                                           if m == "tests" or m.startswith("tests."))
                 for p in sorted(BENCH.rglob("*.py"))}
    assert {p: m for p, m in offenders.items() if m} == {}
