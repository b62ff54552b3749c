"""What a name means here, and which integer an expression denotes.

Guarantees: every expression evaluates to an int that fits in a signed 64-bit
integer (`limits.INT64_MAX`), or raises an ElaborationError at the offending
span: an undefined name (with a did-you-mean), an axis whose size differs
between meshes, division by zero, a `/` that is not exact, an unknown function
or a wrong argument count, `x.local` outside a tensor name. A name is defined
once; an arg takes its override (`--set`), and every override must name an arg
(`check_overrides`).

Names resolve innermost first: loop variables (the enclosing `for`s' `LoopFrame`s,
which loops.py checks and pushes), then args and consts, then the size of a mesh axis.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .. import ast
from ..diagnostics import ElaborationError, Note, Span, UsageError, did_you_mean
from ..ir import Mesh
from ..vocabulary import FUNCTIONS
from . import limits


Table = tuple  # a table's value: nested tuples of ints (docs/language.md 14.8)


@dataclass
class LoopFrame:
    """One enclosing `for`: its variable's current value and, with `over`, its blocks."""

    node: ast.ForLoop
    start: int
    stop: int
    value: int = 0
    axis_size: int | None = None  # fixed by the first tensor it governs
    axis_mesh: str | None = None
    block_starts: list[int] = field(default_factory=list)
    read_at: int = -1  # the `Scope.statement` that last read the variable's value

    def block(self) -> tuple[int, int]:
        """(coordinate owning the current value, that block's first value)."""
        starts = self.block_starts
        c = bisect.bisect_right(starts, self.value) - 1
        while c + 1 < len(starts) and starts[c + 1] == self.value:
            c += 1  # skip empty blocks that start at the same value
        return c, starts[c]


@dataclass(slots=True)
class Value:
    """An arg's or a const's value (an int, or a table: nested tuples of ints), and where it was defined."""

    value: int | Table
    kind: str  # "arg" or "const"
    span: Span


def table_value(value, what: str, span: Span | None = None):
    """An override's value (`--set`, the API's `args`) as the layout holds it: an int, or a table
    (lists of ints and tables, any depth) as nested tuples; anything else is a UsageError.

    >>> table_value([[0, 1], [1, 0]], "MAP"), table_value(4, "TP")
    (((0, 1), (1, 0)), 4)
    """
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise UsageError(f"{what}: {value!r} is neither an integer nor a table (a list of integers and lists)",
                         span)
    if isinstance(value, int):
        if not -limits.INT64_MAX - 1 <= value <= limits.INT64_MAX:
            raise UsageError(f"{what}: {value} does not fit in a signed 64-bit integer", span)
        return value
    return tuple(table_value(v, what, span) for v in value)


class Scope:
    """The names visible at the statement being elaborated, and their values.

    `meshes` is the layout's mesh table (shared with the driver): an axis name
    means its size in arithmetic. `loops` is the stack of enclosing `for`
    frames, innermost last (the loops pass pushes and pops them).
    """

    def __init__(self, overrides: dict[str, int], meshes: dict[str, Mesh]):
        self.overrides = dict(overrides)
        self.used_overrides: set[str] = set()
        self.values: dict[str, Value] = {}
        self.arg_values: list[tuple[str, int | Table]] = []  # in declaration order: the layout's args
        self.meshes = meshes
        self.loops: list[LoopFrame] = []
        # counts the statements elaborated inside loops: a frame whose variable the current
        # statement read holds its number (`LoopFrame.read_at`, loops.name_iteration)
        self.statement = 0
        # (template id, local mode) -> its resolved pieces (names.render), inside loops only:
        # dropped with the outermost loop, as the statements whose ids key it are
        self.renders: dict[tuple[int, str], tuple] = {}
        # a table arg whose integer reads are counted (layoutlang/elaborate/rekey.py): a layout
        # can be re-keyed for a new value of it only if its keys are its only readers
        self.watch: str | None = None
        self.watch_reads = 0

    # ---- definitions ------------------------------------------------------------
    def define(self, b: ast.Binding, kind: str) -> None:
        """`arg NAME = EXPR` (kind "arg", overridable) or `const NAME = EXPR`."""
        if b.name in self.values:
            first = self.values[b.name]
            raise ElaborationError(f"`{b.name}` is already defined", b.span,
                                   notes=[Note(f"first defined here as {first.kind}", first.span)],
                                   help="give it another name")
        if kind == "arg" and b.name in self.overrides:
            value = table_value(self.overrides[b.name], f"--set {b.name}")
            self.used_overrides.add(b.name)
            if isinstance(value, tuple) != isinstance(b.value, ast.Table):
                what = "a table" if isinstance(b.value, ast.Table) else "an integer"
                raise UsageError(f"--set {b.name}: `{b.name}` is {what} in the layout", b.span,
                                 help="give it a value of the same kind")
        elif isinstance(b.value, ast.Table):
            value = self.table(b.value)
        else:
            value = self.evaluate(b.value)
        self.values[b.name] = Value(value, kind, b.span)
        if kind == "arg":
            self.arg_values.append((b.name, value))

    def check_overrides(self, unknown_args: str) -> None:
        """Every override named an arg (unless `unknown_args="ignore"`), else UsageError."""
        unknown = sorted(set(self.overrides) - self.used_overrides)
        if not unknown or unknown_args != "error":
            return
        name = unknown[0]
        if name in self.values:
            raise UsageError(f"--set {name}: `{name}` is a const, not an arg", None,
                             help=f"declare it with `arg {name} = ...` to make it overridable")
        args = [n for n, v in self.values.items() if v.kind == "arg"]
        raise UsageError(f"--set {name}: the layout has no arg `{name}`", None,
                         help=("args are: " + ", ".join(args)) if args else "the layout declares no args")

    def table(self, node: ast.Table) -> Table:
        """A table's value: every entry evaluated (an entry may be an expression: `[E, 2*E]`)."""
        return tuple(self.table(x) if isinstance(x, ast.Table) else self.evaluate(x) for x in node.items)

    # ---- expressions ------------------------------------------------------------
    def evaluate(self, expr: ast.Expr, local: str = "forbid") -> int:
        """Evaluate an integer expression; `local` says what `x.local` means here:
        "forbid" (not a tensor name), "value" (a NAME: the index within the loop's
        block), "global" (a default KEY: the loop value), "reject" (an explicit KEY)."""
        match expr:
            case ast.Num(value=v):
                return fit(v, expr)
            case ast.Name(name=n):
                value = self.lookup(n, expr.span)
                return value if value.__class__ is int else self.integer(value, n, expr.span)
            case ast.Index():
                if expr.name == self.watch:
                    self.watch_reads += 1
                return self.integer(self.entry(expr, local), expr_text(expr), expr.span)
            case ast.Local(name=n):
                return self.local_value(n, expr.span, local)
            case ast.Neg(operand=o):
                return fit(-self.evaluate(o, local), expr)
            case ast.BinOp(op=op, left=l, right=r):
                a, b = self.evaluate(l, local), self.evaluate(r, local)
                return fit(binop(op, a, b, expr), expr)
            case ast.Call(func=f, args=args):
                return self.call(f, args, expr, local)
        raise AssertionError(expr)

    def entry(self, expr: ast.Index, local: str) -> int | Table:
        """`T[i][j]...`: the entry (an int, or a table when fewer indices than levels are given)."""
        value = self.lookup(expr.name, expr.span)
        for depth, index in enumerate(expr.indices):
            at = self.evaluate(index, local)
            if not isinstance(value, tuple):
                raise ElaborationError(f"`{expr.name}` has {depth} level{'s' if depth != 1 else ''} of lists; "
                                       f"index {depth + 1} has nothing to index", index.span,
                                       help=f"write at most {depth} index{'es' if depth != 1 else ''}")
            if not 0 <= at < len(value):
                raise ElaborationError(f"index {at} is out of range: `{expr.name}"
                                       + "".join(f"[{expr_text(i)}]" for i in expr.indices[:depth])
                                       + f"` has {len(value)} entries", index.span,
                                       help=f"indices run from 0 to {len(value) - 1}" if value else
                                       "that list is empty")
            value = value[at]
        return value

    @staticmethod
    def integer(value: int | Table, what: str, span: Span) -> int:
        """`value` where an integer is needed: a table there is an error."""
        if isinstance(value, tuple):
            raise ElaborationError(f"`{what}` is a table of {len(value)} entries, not an integer", span,
                                   help=f"index it (`{what}[i]`), or take its length: `len({what})`")
        return value

    def call(self, name: str, args: tuple[ast.Expr, ...], expr: ast.Call, local: str) -> int:
        if name == "len" and len(args) == 1 and isinstance(args[0], (ast.Name, ast.Index)):
            arg = args[0]
            found = self.lookup(arg.name, arg.span) if isinstance(arg, ast.Name) else self.entry(arg, local)
            if not isinstance(found, tuple):
                raise ElaborationError(f"`len` takes a table; `{expr_text(arg)}` is the integer {found}", arg.span)
            return len(found)
        func = FUNCTIONS.get(name)
        if func is None:
            hint = did_you_mean(name, FUNCTIONS)
            raise ElaborationError(f"unknown function `{name}`", expr.span,
                                   help=(hint + " " if hint else "") + "functions are: " + ", ".join(FUNCTIONS))
        if not func.accepts(len(args)):
            raise ElaborationError(f"`{name}` takes {func.arity_text} arguments, got {len(args)}", expr.span)
        if name == "len":
            raise ElaborationError("`len` takes a table: a name or an entry of one (`len(MAP[l])`)",
                                   args[0].span)
        vals = [self.evaluate(a, local) for a in args]
        if name == "min":
            return min(vals)
        if name == "max":
            return max(vals)
        if vals[1] == 0:
            raise ElaborationError(f"`{name}` by zero", expr.span)
        if name == "cdiv":
            return fit(-(-vals[0] // vals[1]), expr)
        return fit(-(-vals[0] // vals[1]) * vals[1], expr)  # roundup

    def lookup(self, name: str, span: Span) -> int | Table:
        for frame in reversed(self.loops):
            if frame.node.var == name:
                frame.read_at = self.statement
                return frame.value
        if name in self.values:
            return self.values[name].value
        sizes = {(a.size, m.name) for m in self.meshes.values() for a in m.axes if a.name == name}
        if sizes:
            distinct = {s for s, _ in sizes}
            if len(distinct) > 1:
                desc = ", ".join(f"{m}: {s}" for s, m in sorted(sizes, key=lambda x: x[1]))
                raise ElaborationError(f"axis `{name}` has different sizes in different meshes ({desc}); its "
                                       "size is ambiguous in arithmetic", span,
                                       help="define a const for the size you mean")
            return distinct.pop()
        options = [f.node.var for f in self.loops] + list(self.values) + \
            [a.name for m in self.meshes.values() for a in m.axes]
        hint = did_you_mean(name, options)
        raise ElaborationError(f"undefined name `{name}`", span,
                               help=hint or "define it with `const`, `arg`, a mesh axis, or a loop variable")

    def local_value(self, name: str, span: Span, mode: str) -> int:
        frame = next((f for f in reversed(self.loops) if f.node.var == name), None)
        if mode == "forbid":
            raise ElaborationError(f"`{name}.local` is allowed only in tensor names", span,
                                   help=f"use `{name}` here")
        if mode == "reject":
            raise ElaborationError(f"a key never contains `.local`: `{name}.local` is rank-local", span,
                                   help=f"write `{{{name}}}` in the key")
        if frame is None:
            raise ElaborationError(f"`{name}.local`: `{name}` is not a loop variable", span)
        if frame.node.over is None:
            raise ElaborationError(f"`{name}.local` needs a loop with `over`; loop `{name}` is not distributed",
                                   span, notes=[Note("the loop", frame.node.head_span)],
                                   help=f"use `{{{name}}}`, or distribute the loop: `over AXIS`")
        if mode == "global":
            frame.read_at = self.statement
            return frame.value
        if not frame.block_starts:
            raise ElaborationError(f"`{name}.local` is used before the loop's axis is known", span)
        frame.read_at = self.statement
        return frame.value - frame.block()[1]


def binop(op: str, a: int, b: int, expr: ast.BinOp) -> int:
    if op in ("/", "//", "%") and b == 0:
        raise ElaborationError(f"division by zero: `{expr_text(expr.right)}` is 0", expr.right.span)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "//":
        return a // b
    if op == "%":
        return a % b
    q, r = divmod(a, b)
    if r:
        raise ElaborationError(f"`{expr_text(expr)}` is not exact: {a} / {b} leaves remainder {r}", expr.span,
                               help="`/` is exact division; use `//` to round down or `cdiv` to round up "
                                    "if that is really meant")
    return q


def fit(v: int, expr: ast.Expr) -> int:
    if not -limits.INT64_MAX - 1 <= v <= limits.INT64_MAX:
        raise ElaborationError("value does not fit in a signed 64-bit integer", expr.span,
                               help="extents, counts and byte sizes must be below 2**63")
    return v


def expr_text(expr: ast.Expr) -> str:
    """An expression as written, for a message: its span's text, which holds the
    parentheses inside it (`(A - B)/(A - 3)`); in canonical form when it spans lines.

    >>> from layoutlang.parser import parse
    >>> e = parse("const C = (A - B)/(A - 3)").statements[0].bindings[0].value
    >>> expr_text(e), expr_text(e.left)
    ('(A - B)/(A - 3)', 'A - B')
    """
    span = expr.span
    if span is None or span.line != span.end_line:
        from ..fmt import format_expr

        return format_expr(expr)
    return span.source.line_text(span.line)[span.col - 1:span.end_col - 1]
