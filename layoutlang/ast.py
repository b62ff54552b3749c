"""The syntax tree of a `.layout` file: frozen dataclasses, each with its span.

Spans are excluded from equality so that two parses of equivalent text
compare equal (the formatter's round-trip test relies on it). Nodes are
slotted: a generated file of a million tensor lines holds ten million of them.

Notation::

    Expr := Num | Name | Local | BinOp | Neg | Call | Index
    Binding.value := Expr | Table                   (v2: tables, `arg MAP = [[0, 1], [1, 0]]`)
    Mode := Plain | Product | Concat | Pad          (one dimension's structure)
    Dim.mode := Mode | Stack                        (v2: `e in 0..E` is a stacked dim)
    Stmt := Header | Include | Arg | Const | MeshDecl | DefaultDtype | TensorDecl | ForLoop
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .diagnostics import Span


def _span() -> Span:
    return field(default=None, compare=False, repr=False)  # type: ignore[return-value]


# ---- expressions -----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Num:
    value: int
    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Name:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Local:
    """`x.local`: a loop variable's index within the rank's block."""

    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class BinOp:
    op: str  # one of + - * / // %
    left: "Expr"
    right: "Expr"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Neg:
    operand: "Expr"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Call:
    func: str  # checked against vocabulary.FUNCTIONS when elaborated
    args: tuple["Expr", ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Index:
    """`T[i][j]`: an entry of a table (docs/language.md 14.8)."""

    name: str
    indices: tuple["Expr", ...]
    span: Span = _span()


Expr = Num | Name | Local | BinOp | Neg | Call | Index


@dataclass(frozen=True, slots=True)
class Table:
    """`[1, 2, [3, 4]]` on the right of `arg` / `const`: integers in nested lists."""

    items: tuple["Expr | Table", ...]
    span: Span = _span()


# ---- tensor names ----------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Interp:
    """`{EXPR}` inside a tensor name."""

    expr: Expr
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class NameTemplate:
    """A dotted tensor name: literal text and interpolations, in order."""

    text: str
    pieces: tuple[str | Interp, ...]
    span: Span = _span()


# ---- dimension modes -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Plain:
    extent: Expr
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Product:
    """`(N, M)`: N consecutive copies of M, outer first."""

    count: Expr
    inner: "Mode"
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Part:
    """`name: M` or `name: M as KEY` (v2: a part key, LANGUAGE.md 8.1)."""

    name: str | None
    mode: "Mode"
    span: Span = _span()
    key: "NameTemplate | None" = None


@dataclass(frozen=True, slots=True)
class Concat:
    """`(a: M1 | b: M2)`: parts in order (packed or strided storage)."""

    parts: tuple[Part, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Pad:
    """`M pad K`: stored extent rounded up to a multiple of K."""

    inner: "Mode"
    multiple: Expr
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class FlatKey:
    """`[M, ...] as KEY` inside `flat(...)`: one whole key, a mode per dim (plain extents, or
    products and parts without padding: rotary halves `(Q, (re: D/2 | im: D/2))`)."""

    shape: tuple["Mode", ...]
    key: NameTemplate
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Flat:
    """`flat(SHAPE as KEY | ...) [align A]` (docs/language.md 14.9): whole keys flattened row-major,
    one after another, each starting at a multiple of A. Only a dim's whole mode (or under its `pad`)."""

    keys: tuple[FlatKey, ...]
    align: Expr | None
    span: Span = _span()


Mode = Plain | Product | Concat | Pad | Flat


@dataclass(frozen=True, slots=True)
class Stack:
    """`VAR in A..B` (v2, LANGUAGE.md 8.2): a stacked dim, one key per index.

    Stored like a plain extent B - A; index i holds VAR = A + i in the keys."""

    var: str
    start: Expr
    stop: Expr
    span: Span = _span()
    var_span: Span = _span()


@dataclass(frozen=True, slots=True)
class AxisRef:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Chunk:
    axis: AxisRef
    align: Expr | None
    span: Span = _span()
    ragged: bool = False  # `chunk AXIS ragged` (v2): torch.chunk's cut of the local storage


@dataclass(frozen=True, slots=True)
class Dim:
    mode: Mode | Stack
    over: tuple[AxisRef, ...]  # empty: not split; several: a combined axis
    chunk: Chunk | None
    span: Span = _span()
    # `over AXES PLACEMENT` (v2, LANGUAGE.md 8.5, docs/language.md 14.8): "even" (none written), "ragged", "balanced", "cyclic"
    placement: str = "even"


# ---- statements ------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Binding:
    name: str
    value: Expr | Table
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Header:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Include:
    path: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Arg:
    bindings: tuple[Binding, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Const:
    bindings: tuple[Binding, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class MeshDecl:
    name: str
    axes: tuple[Binding, ...]
    offset: Expr | None
    span: Span = _span()
    name_span: Span = _span()


@dataclass(frozen=True, slots=True)
class DefaultDtype:
    dtype: str
    span: Span = _span()
    dtype_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Ident:
    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Place:
    axis: AxisRef
    coord: Expr
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class TensorDecl:
    name: NameTemplate
    key: NameTemplate | None
    dims: tuple[Dim, ...]
    dtype: Ident | None
    mesh: Ident | None
    placement: tuple[Place, ...]
    span: Span = _span()
    transposed: Ident | None = None  # v2 (LANGUAGE.md 8.3): the word `transposed`, with its span


@dataclass(frozen=True, slots=True)
class ForLoop:
    var: str
    start: Expr
    stop: Expr
    over: AxisRef | None
    sizes: tuple[Expr, ...] | None
    body: tuple["Stmt", ...]
    span: Span = _span()
    var_span: Span = _span()
    head_span: Span = _span()


Stmt = Header | Include | Arg | Const | MeshDecl | DefaultDtype | TensorDecl | ForLoop


@dataclass(frozen=True, slots=True)
class Comment:
    """A `#` comment, kept for the formatter."""

    text: str
    line: int
    col: int


@dataclass(frozen=True, slots=True)
class File:
    statements: tuple[Stmt, ...]
    comments: tuple[Comment, ...] = field(default=(), compare=False, repr=False)
    source: object = field(default=None, compare=False, repr=False)
