"""docs/runtime.md's failure table stays backed by tests.

Every row names the tests that assert its message and its reusability; each
named test must exist, and every fault test must be named by some row, so a
new failure mode cannot land undocumented.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _table_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "runtime.md").read_text()
    section = text.split("## Timeouts and failures", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| what happens | what every other rank's error says | Refitter reusable | tested by |")
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _runtime_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests").glob("test_runtime*.py"):
        tree = ast.parse(path.read_text())
        names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return names


def test_every_row_is_backed_by_existing_tests():
    rows = _table_rows()
    assert len(rows) >= 10
    existing = _runtime_tests()
    for row in rows:
        assert len(row) == 4, row
        assert row[2].split(":")[0].split(" ")[0] in {"yes", "no", "the"}, row
        named = re.findall(r"`(test_\w+)`", row[3])
        assert named, row
        assert set(named) <= existing, set(named) - existing


def test_every_fault_test_is_in_the_table():
    named = {n for row in _table_rows() for n in re.findall(r"`(test_\w+)`", row[3])}
    tree = ast.parse((ROOT / "tests" / "test_runtime_faults.py").read_text())
    fault_tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_rank")}
    assert fault_tests and fault_tests <= named, fault_tests - named
