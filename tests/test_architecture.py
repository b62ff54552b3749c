"""The design card's boundaries, checked on the source (DESIGN.md, "Architecture"; STYLE.md, "What to avoid").

- Presentation stays out of the planner: no module of compiler/ or runtime/
  imports jinja2, rich, pygments or markupsafe, and compiler/ never imports
  `layoutlang.report` (renderers read the plan; the plan knows nothing of them).
  Checked on the syntax tree of every file (imports inside functions count),
  and once more on what `import layoutlang.compiler` and a compile really load.
- One public door: no module outside compiler/ reads a Plan's private state
  (the names below are compiler/plan.py's internals); everything goes through
  `Plan.transfers()`, `templates`, `picks()`, `template_of()`, `op_range()`,
  `ops`, `ops_for_rank()`, `stats`, `send_load`, `recv_load`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRESENTATION = {"jinja2", "rich", "pygments", "markupsafe"}
PLAN_PRIVATE = {"_template_of", "_offsets", "_picks", "_instance", "_cache", "piece_list", "_src_shards"}
PUBLIC_DOOR = ("transfers", "templates", "picks", "template_of", "op_range", "ops", "ops_for_rank", "stats",
               "send_load", "recv_load")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text("utf-8"), str(path))


def imported_modules(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import, anywhere in the file; relative ones resolved in `package`.

    `from X import a` yields X and X.a (a may be a module), so `from layoutlang import report` is seen.

    >>> imported_modules(ast.parse("from ..report import units\\nimport rich.table"), "layoutlang.compiler")
    [(1, 'layoutlang.report'), (1, 'layoutlang.report.units'), (2, 'rich.table')]
    """
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            out.extend((node.lineno, f"{module}.{a.name}") for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "id", None) == "__import__"
                   or getattr(node.func, "attr", None) == "import_module")):
            out.append((node.lineno, node.args[0].value))
    return sorted(out)


PLANNER = _sources("compiler", "runtime")


@pytest.mark.parametrize("path", PLANNER, ids=lambda p: str(p.relative_to(ROOT)))
def test_planner_imports_no_presentation(path):
    package = "layoutlang." + ".".join(path.relative_to(ROOT).parent.parts)  # compiler/ is layoutlang.compiler
    bad = []
    for line, module in imported_modules(_tree(path), package):
        if module.split(".")[0] in PRESENTATION:
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (presentation belongs in layoutlang/report/)")
        if path.parts[-2] == "compiler" and (module == "layoutlang.report" or module.startswith("layoutlang.report.")):
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (the compiler never reads its renderers)")
    assert not bad, "\n".join(bad)


def test_compiling_loads_no_presentation():
    """What the interpreter really loads: the package, a compile, its ops and step graph."""
    code = ("import sys\n"
            "from layoutlang.compiler import compile_plan\n"
            "from layoutlang.compiler.graph import buckets\n"
            "p = compile_plan('examples/small/llama_train.layout', 'examples/small/llama_infer.layout')\n"
            "p.ops, p.stats, buckets(p, None)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(PRESENTATION)!r}"
            " or m.startswith('layoutlang.report')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_presentation_left_in_the_compiler():
    """The renderers moved to layoutlang/report/ (no shims, no templates left behind)."""
    assert not (ROOT / "compiler" / "templates").exists()
    assert not {"render.py", "html.py", "explain.py"} & {p.name for p in (ROOT / "compiler").glob("*.py")}
    assert sorted(p.name for p in (ROOT / "layoutlang" / "report" / "templates").glob("*.j2"))


CONSUMERS = _sources("layoutlang", "runtime", "benchmarks", "tests")


def private_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every `x.NAME` and `getattr(x, "NAME")` with NAME one of Plan's private names.

    >>> private_reads(ast.parse("plan._picks[0]\\ngetattr(plan, '_offsets')\\nplan.picks(0, 1)"))
    [(1, '_picks'), (2, '_offsets')]
    """
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PLAN_PRIVATE:
            out.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in PLAN_PRIVATE):
            out.append((node.lineno, node.args[1].value))
    return sorted(out)


@pytest.mark.parametrize("path", CONSUMERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_consumer_reads_plan_internals(path):
    found = private_reads(_tree(path))
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{line}: reads Plan.{name}; use the public door "
                                f"({', '.join(PUBLIC_DOOR)})" for line, name in found)


def test_the_public_door_exists():
    """The names the message above points to are real (a rename in plan.py must update this file)."""
    from layoutlang.compiler import compile_plan

    plan = compile_plan(ROOT / "examples/small/llama_train.layout", ROOT / "examples/small/llama_infer.layout")
    for name in PUBLIC_DOOR:
        assert hasattr(plan, name), name
    t = plan.templates[0]
    assert t.geometry.requests and t.members
    assert len(plan.picks(0, 0)) == len(t.members)
    assert plan.template_of(t.members[0]) == (0, 0)
    assert len(list(plan.transfers(instance=t.members[0]))) == len(plan.op_range(t.members[0]))


def test_the_scans_see_the_sources():
    """A path mix-up would make every check above pass on nothing."""
    names = {p.relative_to(ROOT).as_posix() for p in PLANNER + CONSUMERS}
    assert {"compiler/plan.py", "runtime/__init__.py", "layoutlang/cli.py", "layoutlang/report/html_analysis.py",
            "benchmarks/naive_planner.py", "tests/test_html.py"} <= names
