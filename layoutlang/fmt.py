"""The canonical formatter: one way to write every `.layout` file.

`format_text(format_text(x)) == format_text(x)` and `parse(format_text(x)) ==
parse(x)` for every `x` that parses; comments and (collapsed) blank lines are
kept.

>>> print(format_text("const  H=4096,F = 14336\\ntensor w [(KV,(q:Q*D|k:D))over tp,H]"), end="")
const H = 4096, F = 14336
tensor w [(KV, (q: Q*D | k: D)) over tp, H]

Canonical style::

    layout NAME                             one statement per line, keyword first
    include "common.layout"
    arg TP = 8                              ` = ` in arg/const bindings, `, ` between them
    const H = 4096, F = 14336
    mesh train (dp=4, tp=TP) at 64          no spaces around `=` in mesh axes and `at`
    default dtype bf16
    tensor NAME as KEY [d0, d1] bf16 transposed on m at pp=0, tp=1
    tensor s []
    for l in 0..L over pp sizes [7, 9] {    body indented 2 spaces per level
      tensor x.{l} [H]  # trailing          two spaces before a trailing comment
    }

- Expressions: `a + b`, `a - b` spaced; `a*b`, `a/b`, `a//b`, `a%b` tight;
  `-x`, `x.local`, `min(a, b)`; integers keep their text (`128_256`). The
  parser drops parentheses; the minimal ones are re-added: a looser operand,
  a right operand of equal precedence (`a - (b - c)`, `a/(b*c)`), and a
  binary operand of unary minus (`-(a*b)`).
- Modes: `E`, `(N, M)` (right-nested products flatten: `(A, B, C)`),
  `(q: A | B)`, `(x: M)`, `M pad K`; a `pad` inside a `pad` is grouped:
  `(M pad 2) pad 4`. Dims: `M over tp`, `M over (dp, tp)`, `M chunk g align 16`.
- Tensor names and keys are printed as written.
- Version 2: a part key follows its part's mode, `(q: Q*D as KEY | k: D as KEY)`;
  a stacked dim is `e in 0..E over ep chunk edp`; `transposed` comes after the
  dtype: `tensor NAME as KEY [d0, d1] bf16 transposed on m at pp=0`.
- Comments: a comment on its own line stays before the statement it preceded,
  at that statement's indentation (or at the end of its block or file); a
  trailing comment stays trailing; a comment inside a multi-line statement
  moves to its own line just before the statement. Text is verbatim, trailing
  whitespace stripped.
- Blank lines: one or more in the source become exactly one; none at the start
  or end of a block or file. The output ends with one newline ("" if empty).
"""

from __future__ import annotations

from typing import assert_never

from . import ast
from .diagnostics import Span
from .parser import parse

__all__ = ["format_text", "format_file", "format_expr", "format_mode", "format_dim"]

INDENT = "  "

# Binding strength of the binary operators; all are left-associative.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2}

Pos = tuple[int, int]  # (line, col), 1-based, compared lexicographically


def format_text(text: str, path: str = "<string>") -> str:
    """Parse `text` and return it in canonical style (ParseError propagates)."""
    return format_file(parse(text, path))


def format_file(file: ast.File) -> str:
    """Render a parsed file in canonical style, its comments included."""
    writer = _Writer(file.comments)
    writer.block(file.statements, 0, None)
    return "".join(line + "\n" for line in writer.lines)


# ---- expressions, modes, dims ------------------------------------------------

def format_expr(expr: ast.Expr) -> str:
    """`BinOp('*', BinOp('+', a, b), c)` -> `(a + b)*c`: minimal parentheses."""
    match expr:
        case ast.Num(value=value, text=text):
            return text or str(value)
        case ast.Name(name=name):
            return name
        case ast.Local(name=name):
            return f"{name}.local"
        case ast.Call(func=func, args=args):
            return f"{func}({', '.join(format_expr(a) for a in args)})"
        case ast.Index(name=name, indices=indices):
            return name + "".join(f"[{format_expr(i)}]" for i in indices)
        case ast.Table(items=items):
            return "[" + ", ".join(format_expr(i) for i in items) + "]"
        case ast.Neg(operand=operand):
            inner = format_expr(operand)
            return f"-({inner})" if isinstance(operand, ast.BinOp) else f"-{inner}"
        case ast.BinOp(op=op, left=left, right=right):
            prec = _PRECEDENCE[op]
            sep = f" {op} " if prec == 1 else op
            return _operand(left, prec, right=False) + sep + _operand(right, prec, right=True)
        case _:
            assert_never(expr)


def _operand(expr: ast.Expr, prec: int, *, right: bool) -> str:
    """An operand of a binary operator of precedence `prec`, parenthesized if needed."""
    text = format_expr(expr)
    if isinstance(expr, ast.BinOp):
        inner = _PRECEDENCE[expr.op]
        if inner < prec or (right and inner == prec):
            return f"({text})"
    return text


def format_mode(mode: ast.Mode) -> str:
    """`Product(N, Product(M, Plain(D)))` -> `(N, M, D)`; `Pad(Pad(E, 2), 4)` -> `(E pad 2) pad 4`.
    """
    match mode:
        case ast.Plain(extent=extent):
            return format_expr(extent)
        case ast.Product():
            items: list[str] = []
            inner: ast.Mode = mode
            while isinstance(inner, ast.Product):  # `(A, (B, C))` is `(A, B, C)`
                items.append(format_expr(inner.count))
                inner = inner.inner
            items.append(format_mode(inner))
            return f"({', '.join(items)})"
        case ast.Concat(parts=parts):
            if len(parts) == 1 and parts[0].name is None:
                raise ValueError("a one-part concatenation must name its part: `(x: M)`")
            return f"({' | '.join(_part(p) for p in parts)})"
        case ast.Flat(keys=keys, align=align):
            inner = " | ".join(f"[{', '.join(format_mode(m) for m in k.shape)}] as {k.key.text}" for k in keys)
            return f"flat({inner})" + (f" align {format_expr(align)}" if align is not None else "")
        case ast.Pad(inner=inner, multiple=multiple):
            text = format_mode(inner)
            if isinstance(inner, ast.Pad):  # `M pad 2 pad 4` does not parse
                text = f"({text})"
            return f"{text} pad {format_expr(multiple)}"
        case _:
            assert_never(mode)


def _part(part: ast.Part) -> str:
    text = format_mode(part.mode)
    if part.key is not None:
        text += f" as {part.key.text}"
    return text if part.name is None else f"{part.name}: {text}"


def format_dim(dim: ast.Dim) -> str:
    """`MODE [over AXES [ragged | balanced | cyclic]] [chunk AXIS [align K | ragged]]`; a stacked dim `e in 0..E over ep`."""
    if isinstance(dim.mode, ast.Stack):
        stack = dim.mode
        text = f"{stack.var} in {format_expr(stack.start)}..{format_expr(stack.stop)}"
    else:
        text = format_mode(dim.mode)
    if len(dim.over) == 1:
        text += f" over {dim.over[0].name}"
    elif dim.over:
        text += f" over ({', '.join(a.name for a in dim.over)})"
    if dim.placement != "even":
        text += f" {dim.placement}"
    if dim.chunk is not None:
        text += f" chunk {dim.chunk.axis.name}"
        if dim.chunk.align is not None:
            text += f" align {format_expr(dim.chunk.align)}"
        if dim.chunk.ragged:
            text += " ragged"
    return text


# ---- statements ----------------------------------------------------------------

def _statement(stmt: ast.Stmt) -> str:
    """One statement on one line; for a `for` loop, its head up to `{`."""
    match stmt:
        case ast.Header(name=name):
            return f"layout {name}"
        case ast.Include(path=path):
            return f'include "{path}"'
        case ast.Arg(bindings=bindings):
            return f"arg {_bindings(bindings, ' = ')}"
        case ast.Const(bindings=bindings):
            return f"const {_bindings(bindings, ' = ')}"
        case ast.MeshDecl(name=name, axes=axes, offset=offset):
            text = f"mesh {name} ({_bindings(axes, '=')})"
            return text if offset is None else f"{text} at {format_expr(offset)}"
        case ast.DefaultDtype(dtype=dtype):
            return f"default dtype {dtype}"
        case ast.TensorDecl():
            return _tensor(stmt)
        case ast.ForLoop(var=var, start=start, stop=stop, over=over, sizes=sizes):
            text = f"for {var} in {format_expr(start)}..{format_expr(stop)}"
            if over is not None:
                text += f" over {over.name}"
            if sizes is not None:
                if over is None:
                    raise ValueError("`sizes` needs `over AXIS` in a `for` loop")
                text += f" sizes [{', '.join(format_expr(s) for s in sizes)}]"
            return text + " {"
        case _:
            assert_never(stmt)


def _bindings(bindings: tuple[ast.Binding, ...], eq: str) -> str:
    return ", ".join(f"{b.name}{eq}{format_expr(b.value)}" for b in bindings)


def _tensor(t: ast.TensorDecl) -> str:
    text = f"tensor {t.name.text}"
    if t.key is not None:
        text += f" as {t.key.text}"
    text += f" [{', '.join(format_dim(d) for d in t.dims)}]"
    if t.dtype is not None:
        text += f" {t.dtype.name}"
    if t.transposed is not None:
        text += " transposed"
    if t.mesh is not None:
        text += f" on {t.mesh.name}"
    if t.placement:
        text += " at " + ", ".join(f"{p.axis.name}={format_expr(p.coord)}" for p in t.placement)
    return text


# ---- layout: statements, comments and blank lines -------------------------------

def _start(span: Span) -> Pos:
    return (span.line, span.col)


def _end(span: Span) -> Pos:
    return (span.end_line, span.end_col)


def _pos(comment: ast.Comment) -> Pos:
    return (comment.line, comment.col)


class _Writer:
    """Emits lines, placing each comment by its position among the statement spans.

    Comments are consumed in source order. `prev_line` is the last source line
    already accounted for; an item starting more than one line after it gets a
    blank line before it, unless it opens a block.
    """

    def __init__(self, comments: tuple[ast.Comment, ...]):
        self.comments = sorted(comments, key=_pos)
        self.next = 0
        self.lines: list[str] = []
        self.prev_line = 0
        self.block_start = True

    # -- comments
    def _take_before(self, limit: Pos | None) -> list[ast.Comment]:
        """Consume the comments that start before `limit` (all when None)."""
        taken = []
        while self.next < len(self.comments):
            c = self.comments[self.next]
            if limit is not None and _pos(c) >= limit:
                break
            taken.append(c)
            self.next += 1
        return taken

    def _take_trailing(self, line: int, after: Pos, before: Pos | None) -> str:
        """The comment on `line` after code ending at `after`, as `  # ...`, or ""."""
        if self.next < len(self.comments):
            c = self.comments[self.next]
            if c.line == line and _pos(c) >= after and (before is None or _pos(c) < before):
                self.next += 1
                return "  " + c.text.rstrip()
        return ""

    # -- lines
    def _emit(self, indent: int, text: str, src_line: int | None) -> None:
        """Append a line; `src_line` (None: never) may earn a blank line before it."""
        if src_line is not None and not self.block_start and src_line > self.prev_line + 1:
            self.lines.append("")
        self.lines.append(INDENT * indent + text)
        self.block_start = False

    def _comment_line(self, indent: int, comment: ast.Comment) -> None:
        self._emit(indent, comment.text.rstrip(), comment.line)
        self.prev_line = comment.line

    # -- structure
    def block(self, stmts: tuple[ast.Stmt, ...], indent: int, limit: Pos | None) -> None:
        """Statements of a file (`limit` None) or of a `for` body (`limit` at its `}`)."""
        self.block_start = True
        for i, stmt in enumerate(stmts):
            following = _start(stmts[i + 1].span) if i + 1 < len(stmts) else limit
            for c in self._take_before(_start(stmt.span)):
                self._comment_line(indent, c)
            self._statement(stmt, indent, following)
        for c in self._take_before(limit):
            self._comment_line(indent, c)

    def _statement(self, stmt: ast.Stmt, indent: int, following: Pos | None) -> None:
        span = stmt.span
        if isinstance(stmt, ast.ForLoop):
            head_end = _end(stmt.head_span)
            if stmt.sizes:
                head_end = max(head_end, _end(stmt.sizes[-1].span))
            code_end = head_end
        else:
            code_end = _end(span)
        inside = self._take_before(code_end)
        for c in inside:  # comments within a multi-line statement go before it
            self._emit(indent, c.text.rstrip(), span.line)
            self.prev_line = span.line
        if not isinstance(stmt, ast.ForLoop):
            trailing = self._take_trailing(span.end_line, code_end, following)
            self._emit(indent, _statement(stmt) + trailing, span.line)
            self.prev_line = span.end_line
            return
        close = (span.end_line, span.end_col - 1)  # the `}`
        body_start = _start(stmt.body[0].span) if stmt.body else close
        trailing = self._take_trailing(head_end[0], head_end, body_start)
        self._emit(indent, _statement(stmt) + trailing, span.line)
        self.prev_line = head_end[0]
        self.block(stmt.body, indent + 1, close)
        trailing = self._take_trailing(span.end_line, _end(span), following)
        self._emit(indent, "}" + trailing, None)
        self.prev_line = span.end_line
