"""The design card's boundaries, checked on the source (DESIGN.md, "Architecture"; STYLE.md, "What to avoid").

- Presentation stays out of the planner: no module of layoutlang/compiler/ or layoutlang/runtime/
  imports jinja2, rich, pygments or markupsafe, and layoutlang/compiler/ never imports
  `layoutlang.report` (renderers read the plan; the plan knows nothing of them).
  Checked on the syntax tree of every file (imports inside functions count),
  and once more on what `import layoutlang.compiler` and a compile really load.
- One public door: no module outside layoutlang/compiler/ reads a Plan's private state
  (the names below are layoutlang/compiler/plan.py's internals); everything goes through
  `Plan.transfers()`, `templates`, `picks()`, `template_of()`, `op_range()`,
  `ops`, `ops_for_rank()`, `stats`, `send_load`, `recv_load`.
- No import circle: the modules of layoutlang/ (every subpackage), layoutlang/compiler/ and
  layoutlang/runtime/ import each other as a DAG. Every import counts, a lazy one inside a
  function and a `TYPE_CHECKING` one too (a lazy import that breaks a circle at
  run time is still the circle in the design: two modules that import each
  other are missing a third).
- No private name crosses a module: `from .x import _name` (or any absolute
  spelling) imports another module's internals; the name is either that
  module's real interface (then it loses its underscore) or belongs in a third
  module both read. There is no allowlist (issue 50 removed the last ones).
- Stages hand the Plan public records: no module but layoutlang/compiler/plan.py assigns a
  Plan's private field (`plan._picks = ...`); a stage calls `record_stored`,
  `record_templates`, `record_picks`, `record_relays`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
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


PLANNER = _sources("layoutlang/compiler", "layoutlang/runtime")


@pytest.mark.parametrize("path", PLANNER, ids=lambda p: str(p.relative_to(ROOT)))
def test_planner_imports_no_presentation(path):
    package = ".".join(path.relative_to(ROOT).parent.parts)  # layoutlang/compiler/ is layoutlang.compiler
    bad = []
    for line, module in imported_modules(_tree(path), package):
        if module.split(".")[0] in PRESENTATION:
            bad.append(f"{path.relative_to(ROOT)}:{line}: imports {module} (presentation belongs in layoutlang/report/)")
        if path.parts[-2:-1] == ("compiler",) and path.parts[-3] == "layoutlang" and (module == "layoutlang.report" or module.startswith("layoutlang.report.")):
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
    assert not (ROOT / "layoutlang" / "compiler" / "templates").exists()
    assert not {"render.py", "html.py", "explain.py"} & {p.name for p in (ROOT / "layoutlang" / "compiler").glob("*.py")}
    assert sorted(p.name for p in (ROOT / "layoutlang" / "report" / "templates").glob("*.j2"))


CONSUMERS = [p for p in _sources("layoutlang", "benchmarks", "tests") if p not in _sources("layoutlang/compiler")]


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
    assert {"layoutlang/compiler/plan.py", "layoutlang/runtime/__init__.py", "layoutlang/cli.py", "layoutlang/report/html_analysis.py",
            "benchmarks/naive_planner.py", "tests/test_html.py"} <= names


PACKAGES = {"layoutlang": "layoutlang"}


def module_name(path: Path) -> str:
    """The dotted name a source file is imported as (layoutlang/compiler/ is installed as layoutlang.compiler).

    >>> module_name(ROOT / "layoutlang" / "compiler" / "plan.py"), module_name(ROOT / "layoutlang" / "checkpoint" / "__init__.py")
    ('layoutlang.compiler.plan', 'layoutlang.checkpoint')
    """
    rel = path.relative_to(ROOT)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]] + ([] if rel.name == "__init__.py" else [rel.stem])
    return ".".join(parts)


MODULES = {module_name(p): p for p in _sources(*PACKAGES)}


def imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str, str | None]]:
    """(line, absolute module, name or None) of every import statement, anywhere in the file.

    >>> imported_names(ast.parse("from .save import _entries\\nimport os\\nfrom .. import ir"),
    ...                "layoutlang.checkpoint.ranked", False)
    [(1, 'layoutlang.checkpoint.save', '_entries'), (2, 'os', None), (3, 'layoutlang', 'ir')]
    """
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            out.extend((node.lineno, target, a.name) for a in node.names)
    return sorted(out, key=lambda x: (x[0], x[1], x[2] or ""))


def import_graph(modules: dict[str, Path] = MODULES) -> nx.DiGraph:
    """Module -> module it imports (edge attribute `at`: "file:line" of one such import).

    `from P import m` with P.m a module is an edge to P.m (the package P is only passed
    through); `from M import x` with x a name is an edge to M, and so is `import M`.
    """
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for line, target, what in imported_names(_tree(path), name, path.name == "__init__.py"):
            to = f"{target}.{what}" if what and f"{target}.{what}" in modules else target
            if to in modules and to != name and not g.has_edge(name, to):
                g.add_edge(name, to, at=f"{path.relative_to(ROOT)}:{line}")
    return g


def import_cycles(g: nx.DiGraph) -> list[list[str]]:
    """Each group of modules that reach each other through imports (a strongly connected component).

    >>> g = nx.DiGraph([("a", "b"), ("b", "a"), ("b", "c")])
    >>> import_cycles(g)
    [['a', 'b']]
    """
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_no_import_cycle():
    g = import_graph()
    lines = []
    for group in import_cycles(g):
        lines.append("import circle: " + " <-> ".join(group))
        lines.extend(f"  {g.edges[a, b]['at']}: {a} imports {b}" for a, b in g.subgraph(group).edges)
    assert not lines, ("\n".join(lines) + "\ntwo modules that import each other are missing a third: move what "
                       "both need into one module that imports neither")


def private_imports(modules: dict[str, Path] = MODULES) -> set[tuple[str, str]]:
    """("importing file", "module:_name") of each private name imported from another module of ours
    (the module without its leading `layoutlang.`).

    A dunder (`__version__`) is public; a private module name counts too.
    """
    found = set()
    for name, path in modules.items():
        for _, target, what in imported_names(_tree(path), name, path.name == "__init__.py"):
            if target.split(".")[0] != "layoutlang" or target == name or what is None:
                continue
            if what.startswith("_") and not what.startswith("__"):
                found.add((path.relative_to(ROOT).as_posix(), f"{target.removeprefix('layoutlang.')}:{what}"))
    return found


def test_no_private_import_across_modules():
    found = sorted(private_imports())
    assert not found, "\n".join(f"{f}: imports {m} (another module's internals: make it that module's public "
                                 "interface, or move it to a module both read)" for f, m in found)


def test_the_import_scans_see_the_sources():
    """The graph holds every package (a path mix-up would make the two tests above pass on nothing)."""
    g = import_graph()
    assert {"layoutlang", "layoutlang.compiler.plan", "layoutlang.runtime.refit", "layoutlang.checkpoint.save",
            "layoutlang.elaborate.scope", "layoutlang.bridges.families"} <= set(g)
    assert g.has_edge("layoutlang.runtime.refit", "layoutlang.compiler.steps")  # from layoutlang.compiler.steps import
    assert g.has_edge("layoutlang.compiler.plan", "layoutlang.ir")


PLAN_FIELDS = {"_picks", "_selector", "_offsets", "_instance", "_stored", "_after", "_copied", "_cache", "_progress"}


def private_writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every assignment to `x.NAME` (x not `self`) with NAME one of Plan's private fields.

    >>> private_writes(ast.parse("plan._picks, plan.send_load = p, l\\nself._offsets = {}\\nplan.record_picks(p, l)"))
    [(1, '_picks')]
    """
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and t.attr in PLAN_FIELDS
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                    out.append((node.lineno, t.attr))
    return sorted(out)


@pytest.mark.parametrize("path", [p for p in _sources(*PACKAGES) if p != ROOT / "layoutlang" / "compiler" / "plan.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_stages_record_through_the_plans_methods(path):
    found = private_writes(_tree(path))
    assert not found, "\n".join(f"{path.relative_to(ROOT)}:{line}: writes Plan.{name}; record it through Plan's "
                                 "record_stored / record_templates / record_picks / record_relays" for line, name in found)
