"""Text -> AST. Lark (LALR, contextual lexer) plus one Transformer.

Raw Lark errors never escape: each becomes a :class:`ParseError` whose message
names what was found and, in plain words, what could come there instead.

The parse tree of a whole file never exists: Lark reduces one statement at a
time, and at each reduction of the `statement` rule the statement's small tree
(its positions already propagated) becomes AST and is dropped. A file of a
million tensor lines costs its AST, not a parse tree ten times that size.
"""

from __future__ import annotations

import re
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import lark
from lark import Lark, Token, Transformer, v_args
from lark.lexer import PatternStr

from . import ast
from .diagnostics import Note, ParseError, Source, Span, did_you_mean
from .vocabulary import KEYWORDS

MAX_NESTING = 64
_RESERVED = frozenset(KEYWORDS)
_RAGGED = object()  # the `ragged` marker the transformer passes from `over`/`chunk` to the dim
_CYCLIC, _BALANCED = object(), object()  # `over AXES cyclic | balanced` (docs/language.md 14.8)
_PLACEMENTS = {_RAGGED: "ragged", _CYCLIC: "cyclic", _BALANCED: "balanced"}


def _placement(items) -> str:
    """The placement word after `over AXES`, if one is written there ("even" if not)."""
    return _PLACEMENTS.get(items[0], "even") if items else "even"


class _Over(NamedTuple):
    """`over AXES [ragged | balanced | cyclic]` on its way from the parse tree to `ast.Dim`."""

    axes: tuple
    placement: str
_INTERP = re.compile(r"\{([^{}\n#]*)\}")
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "TNAME": "a tensor name",
    "STRING": 'a quoted path ("...")',
    "$END": "the end of the file",
}


class _FlatPad(NamedTuple):
    """`pad K` after a flat dim, on its way to the `ast.Pad` that wraps the `ast.Flat`."""

    multiple: ast.Expr
    span: Span


def grammar_text() -> str:
    """The grammar, shipped as package data `layoutlang/grammar/layout.lark`.

    Installed from a wheel it sits beside this module; in an editable install
    (the repository's top-level `grammar/` folder) it sits one level up.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "grammar" / "layout.lark", here.parent / "grammar" / "layout.lark"):
        if candidate.is_file():
            return candidate.read_text("utf-8")
    raise FileNotFoundError("layoutlang's grammar file layout.lark is missing from the install")


class _Statements:
    """Lark's inline transformer: the parse of one file in progress.

    Lark calls `statement` each time it reduces a top-level statement; the
    statement's tree has its positions propagated by then, so it becomes AST at
    once. A file's errors keep their order of precedence: a syntax error
    anywhere, then an expression nesting too deep, then the first error of the
    tree-to-AST step; after the first error, later statements are only checked.
    `collect` receives the comments from the lexer. One file parse at a time
    owns this (the lock); a `{EXPR}` inside a tensor name is parsed,
    re-entrantly, with the `expr` start rule, which reduces no statement.
    """

    lock = threading.Lock()

    def __init__(self):
        self.to_ast: _ToAst | None = None
        self.comments: list[ast.Comment] | None = None
        self.too_deep: ParseError | None = None
        self.error: ParseError | None = None

    def begin(self, pos: "_Positions", comments: list) -> None:
        self.to_ast, self.comments, self.too_deep, self.error = _ToAst(pos), comments, None, None

    def end(self) -> ParseError | None:
        error = self.too_deep or self.error
        self.to_ast, self.comments, self.too_deep, self.error = None, None, None, None
        return error

    def collect(self, token: Token) -> Token:
        if self.comments is not None:
            self.comments.append(ast.Comment(str(token), token.line, token.column))
        return token

    def statement(self, children):
        (tree,) = children
        if self.too_deep is not None:
            return None
        try:
            _check_depth(tree, self.to_ast.pos, depth=2)  # depth 1 is the file's `start`
        except ParseError as err:
            self.too_deep = err
            return None
        if self.error is not None:
            return None
        try:
            return _transform(tree, self.to_ast.pos, self.to_ast)
        except ParseError as err:
            self.error = err
            return None


_STATEMENTS = _Statements()


class _WholeWords:
    """The contextual lexer's post-lexer, there only for `always_accept`: NAME is lexed in every
    state, so a keyword is a whole word. Without it a state that takes keywords but no NAME (a
    statement's start, after a dim's extent) reads `tensorw` as `tensor w` and `pad2` as
    `pad 2`; with it they are one NAME, which the parser refuses (and names the keyword meant)."""

    always_accept = ("NAME",)

    def process(self, stream):
        return stream


@lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(grammar_text(), parser="lalr", lexer="contextual", postlex=_WholeWords(),
                propagate_positions=True, maybe_placeholders=False,
                start=["start", "expr"], transformer=_STATEMENTS,
                lexer_callbacks={"COMMENT": _STATEMENTS.collect})


def _describe(terminal: str) -> str:
    if terminal in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[terminal]
    for term in _lark().terminals:
        if term.name == terminal and isinstance(term.pattern, PatternStr):
            return f"`{term.pattern.value}`"
    return terminal.lower()


def _expected(names) -> str:
    words = sorted({_describe(n) for n in names}, key=lambda w: (not w.startswith("`"), w))
    if not words:
        return "nothing more"
    if len(words) == 1:
        return words[0]
    if len(words) > 8:
        words = words[:8] + ["..."]
    return "one of " + ", ".join(words)


def _keyword(terminal: str) -> str | None:
    """The keyword a terminal stands for (`tensor`), None for punctuation and word classes."""
    for term in _lark().terminals:
        if term.name == terminal and isinstance(term.pattern, PatternStr):
            return term.pattern.value if term.pattern.value.isidentifier() else None
    return None


def _typo_hint(token: Token, accepts: set[str]) -> str | None:
    """`did you mean `tensor`?` when an unexpected word is close to a keyword that can come here.

    Chosen from every keyword the parser accepts at this point, not from the expected
    list as printed (that one is cut at eight entries). Only for a word that is not a
    keyword itself: a keyword in the wrong place is not a misspelling."""
    if token.type not in ("NAME", "TNAME"):
        return None
    return did_you_mean(str(token), sorted(filter(None, (_keyword(t) for t in accepts))))


def _swallowed_hint(line_text: str, col: int, accepts: set[str]) -> str | None:
    """A misspelt keyword that begins a line can be read as the end of the statement above (a
    tensor's dtype: `tensro v [4]` after `tensor w [4]`); the parser then stops at the word after
    it. When that word begins its line and is close to a keyword that may come there, say so."""
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s+", line_text[:col - 1])
    if m is None or m.group(1) in _RESERVED:
        return None
    hint = did_you_mean(m.group(1), sorted(filter(None, (_keyword(t) for t in accepts))))
    return hint and hint[:-1] + f" instead of `{m.group(1)}`?"


def _found(token: Token) -> str:
    if token.type == "$END":
        return "the end of the file"
    text = str(token)
    return f"`{text[:40]}`"


def _mode_depth(mode: ast.Mode) -> int:
    """Levels of products, parts and `pad` in a mode, counted without recursion.

    Brackets bound every other nesting, but `(1, 1, ..., 1, M)` nests one
    product per item with no bracket: unbounded, it would exhaust Python's
    recursion in every recursive walk of the mode (elaboration, the algebra).
    """
    deepest, stack = 0, [(mode, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, (ast.Product, ast.Pad)):
            stack.append((node.inner, depth + 1))
        elif isinstance(node, ast.Concat):
            stack.extend((part.mode, depth + 1) for part in node.parts)
    return deepest


def _word(tok: Token) -> str:
    """A name as a plain, interned string: the few names of a file are shared
    by all the nodes that use them."""
    return sys.intern(str(tok))


class _Positions:
    """Maps Lark's 1-based positions (of a whole file or of one `{EXPR}`).

    Nodes built one after the other often cover the same text (a dim `32`, its
    mode and its number): they share one Span object.
    """

    def __init__(self, source: Source, line: int = 0, col: int = 0):
        self.source, self.line, self.col = source, line, col
        self.last: Span | None = None

    def span(self, line: int, col: int, end_line: int, end_col: int) -> Span:
        if self.line:  # inside a tensor name: one line, shifted columns
            line, col, end_line, end_col = self.line, self.col + col - 1, self.line, self.col + end_col - 1
        last = self.last
        if (last is not None and last.col == col and last.end_col == end_col and last.line == line
                and last.end_line == end_line):
            return last
        self.last = Span(self.source, line, col, end_line, end_col)
        return self.last

    def of_meta(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return self.span(1, 1, 1, 1)
        return self.span(meta.line, meta.column, meta.end_line, meta.end_column)

    def of_token(self, tok: Token) -> Span:
        return self.span(tok.line, tok.column, tok.end_line, tok.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    """One method per grammar rule; each returns an AST node with its span."""

    def __init__(self, pos: _Positions):
        super().__init__()
        self.pos = pos

    def __default_token__(self, tok: Token):
        # The contextual lexer would accept a keyword as a NAME where no keyword
        # can stand; the language reserves them everywhere, so refuse here.
        if tok.type == "NAME" and str(tok) in _RESERVED:
            raise ParseError(f"`{tok}` is a reserved word and cannot be used as a name",
                             self.pos.of_token(tok), help=f"rename it, e.g. `{tok}_`")
        return tok

    # -- expressions
    def number(self, meta, c):
        text = sys.intern(str(c[0]))  # `64` is written a million times: one string
        digits = text.replace("_", "").lstrip("0") or "0"
        if len(digits) > 19 or int(digits) >= 1 << 63:
            raise ParseError("value does not fit in a signed 64-bit integer", self.pos.of_meta(meta),
                             help="extents, counts and byte sizes must be below 2**63")
        return ast.Num(int(digits), text, self.pos.of_meta(meta))

    def name(self, meta, c):
        return ast.Name(_word(c[0]), self.pos.of_meta(meta))

    def local_name(self, meta, c):
        return ast.Local(_word(c[0]), self.pos.of_meta(meta))

    def call(self, meta, c):
        return ast.Call(_word(c[0]), tuple(c[1:]), self.pos.of_meta(meta))

    def index(self, meta, c):
        return ast.Index(_word(c[0]), tuple(c[1:]), self.pos.of_meta(meta))

    def table(self, meta, c):
        return ast.Table(tuple(x for x in c if x is not None), self.pos.of_meta(meta))

    def neg(self, meta, c):
        return ast.Neg(c[0], self.pos.of_meta(meta))

    def _bin(op):  # noqa: N805 - a small factory for the binary operators
        def rule(self, meta, c):
            return ast.BinOp(op, c[0], c[1], self.pos.of_meta(meta))
        return rule

    add, sub, mul = _bin("+"), _bin("-"), _bin("*")
    exact_div, floor_div, mod = _bin("/"), _bin("//"), _bin("%")

    # -- modes
    def plain(self, meta, c):
        return ast.Plain(c[0], self.pos.of_meta(meta))

    def product(self, meta, c):
        span = self.pos.of_meta(meta)
        inner = c[-1]
        for count in reversed(c[:-1]):
            if not isinstance(count, ast.Plain):
                raise ParseError(
                    "the count of a product `(N, M)` must be an integer expression",
                    count.span,
                    help="only the last item of `( , )` may be a concatenation or `pad`; "
                         "write `(N, (a | b))` to repeat a concatenation N times")
            inner = ast.Product(count.extent, inner, span)
        return inner

    def part_key(self, meta, c):
        return ("key", self._template(c[0]))

    def named_part(self, meta, c):
        key = c[2][1] if len(c) > 2 else None
        return ast.Part(_word(c[0]), c[1], self.pos.of_meta(meta), key)

    def part(self, meta, c):
        key = c[1][1] if len(c) > 1 else None
        return ast.Part(None, c[0], self.pos.of_meta(meta), key)

    def concat(self, meta, c):
        return ast.Concat(tuple(c), self.pos.of_meta(meta))

    def concat_one(self, meta, c):
        span = self.pos.of_meta(meta)
        key = c[2][1] if len(c) > 2 else None
        return ast.Concat((ast.Part(_word(c[0]), c[1], span, key),), span)

    def pad(self, meta, c):
        return ast.Pad(c[0], c[1], self.pos.of_meta(meta))

    def over_one(self, meta, c):
        return _Over((self._axis(c[0]),), _placement(c[1:]))

    def over_tuple(self, meta, c):
        placement = _placement(c[-1:])
        return _Over(tuple(self._axis(t) for t in (c if placement == "even" else c[:-1])), placement)

    def ragged(self, meta, c):
        return _RAGGED

    def cyclic(self, meta, c):
        return _CYCLIC

    def balanced(self, meta, c):
        return _BALANCED

    def chunk(self, meta, c):
        ragged = len(c) > 1 and c[1] is _RAGGED
        align = c[1] if len(c) > 1 and not ragged else None
        return ast.Chunk(self._axis(c[0]), align, self.pos.of_meta(meta), ragged)

    def align(self, meta, c):
        return c[0]

    def dim(self, meta, c):
        mode, over, chunk = c[0], (), None
        depth = _mode_depth(mode)
        if depth > MAX_NESTING:
            raise ParseError(f"this dimension's structure nests {depth} levels deep; at most {MAX_NESTING} "
                             "are supported", mode.span,
                             help="a product `(A, B, C)` nests one level per item; a real layout "
                                  "needs a few levels")
        placement = "even"
        for item in c[1:]:
            if isinstance(item, ast.Chunk):
                chunk = item
            else:
                over, placement = item
        return ast.Dim(mode, over, chunk, self.pos.of_meta(meta), placement)

    def flat_key(self, meta, c):
        return ast.FlatKey(tuple(c[:-1]), self._template(c[-1]), self.pos.of_meta(meta))

    def flat(self, meta, c):
        keys = tuple(x for x in c if isinstance(x, ast.FlatKey))
        align = c[-1] if not isinstance(c[-1], ast.FlatKey) else None
        return ast.Flat(keys, align, self.pos.of_meta(meta))

    def flat_pad(self, meta, c):
        return _FlatPad(c[0], self.pos.of_meta(meta))

    def flat_dim(self, meta, c):
        mode, over, chunk, placement = c[0], (), None, "even"
        for item in c[1:]:
            if isinstance(item, _FlatPad):
                mode = ast.Pad(mode, item.multiple, Span(mode.span.source, mode.span.line, mode.span.col,
                                                         item.span.end_line, item.span.end_col))
            elif isinstance(item, ast.Chunk):
                chunk = item
            else:
                over, placement = item
        return ast.Dim(mode, over, chunk, self.pos.of_meta(meta), placement)

    def stacked_dim(self, meta, c):
        var, start, stop = c[0], c[1], c[2]
        over, chunk, placement = (), None, "even"
        for item in c[3:]:
            if isinstance(item, ast.Chunk):
                chunk = item
            else:
                over, placement = item
        head = self.pos.span(var.line, var.column, stop.span.end_line, stop.span.end_col)
        stack = ast.Stack(_word(var), start, stop, head, self.pos.of_token(var))
        return ast.Dim(stack, over, chunk, self.pos.of_meta(meta), placement)

    def dims(self, meta, c):
        return tuple(c)

    def _axis(self, tok: Token) -> ast.AxisRef:
        return ast.AxisRef(_word(tok), self.pos.of_token(tok))

    def _ident(self, tok: Token) -> ast.Ident:
        return ast.Ident(_word(tok), self.pos.of_token(tok))

    # -- statements
    def binding(self, meta, c):
        return ast.Binding(str(c[0]), c[1], self.pos.of_token(c[0]))

    table_binding = binding

    axis_def = binding

    def header(self, meta, c):
        return ast.Header(str(c[0]), self.pos.of_meta(meta))

    def include(self, meta, c):
        return ast.Include(str(c[0])[1:-1], self.pos.of_meta(meta))

    def arg(self, meta, c):
        return ast.Arg(tuple(c), self.pos.of_meta(meta))

    def const(self, meta, c):
        return ast.Const(tuple(c), self.pos.of_meta(meta))

    def mesh_at(self, meta, c):
        return ("at", c[0])

    def mesh(self, meta, c):
        offset = c[-1][1] if isinstance(c[-1], tuple) else None
        axes = tuple(x for x in c[1:] if isinstance(x, ast.Binding))
        return ast.MeshDecl(str(c[0]), axes, offset, self.pos.of_meta(meta), self.pos.of_token(c[0]))

    def default_dtype(self, meta, c):
        return ast.DefaultDtype(str(c[0]), self.pos.of_meta(meta), self.pos.of_token(c[0]))

    def key(self, meta, c):
        return ("key", self._template(c[0]))

    def dtype(self, meta, c):
        return ("dtype", self._ident(c[0]))

    def transposed(self, meta, c):
        return ("transposed", ast.Ident("transposed", self.pos.of_meta(meta)))

    def on(self, meta, c):
        return ("on", self._ident(c[0]))

    def place(self, meta, c):
        return ast.Place(self._axis(c[0]), c[1], self.pos.of_meta(meta))

    def placement(self, meta, c):
        return ("at", tuple(c))

    def tensor(self, meta, c):
        fields = {"key": None, "dims": (), "dtype": None, "transposed": None, "on": None, "at": ()}
        for item in c[1:]:
            if isinstance(item, tuple) and item and isinstance(item[0], str):
                fields[item[0]] = item[1]
            else:
                fields["dims"] = item
        return ast.TensorDecl(self._template(c[0]), fields["key"], fields["dims"],
                              fields["dtype"], fields["on"], fields["at"],
                              self.pos.of_meta(meta), fields["transposed"])

    def sizes(self, meta, c):
        return ("sizes", tuple(c))

    def loop_over(self, meta, c):
        sizes = c[1][1] if len(c) > 1 else None
        return ("over", self._axis(c[0]), sizes)

    def for_loop(self, meta, c):
        var, start, stop, rest = c[0], c[1], c[2], c[3:]
        over, sizes = None, None
        if rest and isinstance(rest[0], tuple) and rest[0] and rest[0][0] == "over":
            _, over, sizes = rest[0]
            rest = rest[1:]
        head_end = (sizes[-1] if sizes else over or stop).span
        head = self.pos.span(meta.line, meta.column, head_end.end_line, head_end.end_col)
        return ast.ForLoop(str(var), start, stop, over, sizes, tuple(rest),
                           self.pos.of_meta(meta), self.pos.of_token(var), head)

    # -- tensor names
    def _template(self, tok: Token) -> ast.NameTemplate:
        text = str(tok)
        pieces: list[str | ast.Interp] = []
        last = 0
        for m in _INTERP.finditer(text):
            if m.start() > last:
                pieces.append(text[last:m.start()])
            col = tok.column + m.start(1)
            span = Span(self.pos.source, tok.line, col - 1, tok.line, tok.column + m.end())
            if not m.group(1).strip():
                raise ParseError("empty `{}` in a tensor name", span,
                                 help="write an integer expression inside, e.g. `{l}`")
            expr = parse_expr(m.group(1), _Positions(self.pos.source, tok.line, col))
            pieces.append(ast.Interp(expr, span))
            last = m.end()
        if last < len(text):
            pieces.append(text[last:])
        return ast.NameTemplate(text, tuple(pieces), self.pos.of_token(tok))


_BRACKETS = re.compile(r"[(\[{)\]}]")


def _check_nesting(source: Source) -> None:
    """Refuse absurdly deep nesting before Lark and the Transformer recurse."""
    text, depth = source.text, 0
    for m in _BRACKETS.finditer(text):
        if m.group() in "([{":
            depth += 1
            if depth > MAX_NESTING:
                line, col = _line_col(text, m.start())
                raise ParseError(f"brackets nest deeper than {MAX_NESTING} levels",
                                 Span(source, line, col, line, col + 1),
                                 help="a layout never needs this; check for a runaway bracket")
        elif depth:
            depth -= 1


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character index."""
    return text.count("\n", 0, index) + 1, index - text.rfind("\n", 0, index)


@lru_cache(maxsize=1)
def _tensor_words() -> re.Pattern:
    """A lexer in one regular expression: each match skips to the next `tensor`
    keyword (group 1) and takes the tensor name after it (group 2, the grammar's
    own TNAME), or to the end of the text.

    Skipped whole, as the real lexer takes them: comments, paths, a name after
    `as` (`as tensor` names a key), names (`mytensor`, `tensor_`) and integers
    (`pp=0tensor` is `0` then the keyword). Every character is skippable except
    a keyword, so no match attempt restarts a scan: linear time.
    """
    tname = next(t.pattern.value for t in _lark().terminals if t.name == "TNAME")
    word, gap = "A-Za-z0-9_", r"(?:\s|#[^\n]*)*"
    skip = (rf'#[^\n]*|"[^"\n]*"|as(?![{word}]){gap}(?:{tname})?|(?!tensor(?![{word}]))[A-Za-z_][{word}]*'
            rf"|[0-9](?:_?[0-9])*|[^{word}#]")
    return re.compile(rf"(?:{skip})*+(?:(tensor)(?![{word}]){gap}({tname})?|\Z)")


def _check_tensor_count(source: Source, limit: int, before: int) -> None:
    """Refuse the (limit+1)-th `tensor` statement of a layout before parsing.

    A cheap scan, not a parse: a file of millions of tensor lines fails in a
    second, at the statement past the limit, instead of after building them all.
    """
    text = source.text
    budget = limit - before
    if text.count("tensor") <= budget:  # most files: the count cannot exceed it
        return
    seen = 0
    for m in _tensor_words().finditer(text):
        if m.group(1) is None:
            continue
        seen += 1
        if seen > budget:
            start = m.start(1)
            line, col = _line_col(text, start)
            name_end = m.end(2) if m.group(2) and "\n" not in text[start:m.start(2)] else m.end(1)
            raise ParseError(f"more than {limit} tensor statements; a layout holds at most {limit} "
                             "tensor instances", Span(source, line, col, line, col + name_end - start),
                             help="generate repeated tensors with `for` loops, or check the program "
                                  "that wrote this file")


def _accepts(err) -> set[str]:
    """Terminals that really advance the parser here (Lark's `expected` over-approximates)."""
    try:
        if getattr(err, "interactive_parser", None) is not None:
            return set(err.interactive_parser.accepts())
        if getattr(err, "state", None) is not None:
            from lark.lexer import LexerThread
            from lark.parsers.lalr_interactive_parser import InteractiveParser
            return set(InteractiveParser(_lark().parser.parser.parser, err.state,
                                         LexerThread(None, None)).accepts())
    except Exception:  # noqa: BLE001 - best effort: fall back to Lark's own set
        pass
    return set(getattr(err, "expected", None) or getattr(err, "allowed", None) or ())


def _open_block(text: str) -> tuple[int, int] | None:
    """(line, col) of the innermost `{` of a `for` that is never closed."""
    stack: list[tuple[int, int]] = []
    line, col, in_comment, in_string = 1, 0, False, False
    for ch in text:
        col += 1
        if ch == "\n":
            line, col, in_comment, in_string = line + 1, 0, False, False
        elif in_comment:
            continue
        elif ch == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif ch == "#":
            in_comment = True
        elif ch == "{":
            stack.append((line, col))
        elif ch == "}" and stack:
            stack.pop()
    return stack[-1] if stack else None


def _convert_error(err: Exception, pos: _Positions) -> ParseError:
    lines = pos.source.text.split("\n")
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        accepts = _accepts(err)
        if tok.type == "$END":
            line, col = len(lines), len(lines[-1]) + 1
            span = pos.span(line, col, line, col + 1)
            opened = _open_block(pos.source.text) if not pos.line else None
            if "RBRACE" in accepts and opened:
                return ParseError("unexpected end of file; expected `}` to close the `for` block", span,
                                  notes=(Note("the block opened here",
                                              pos.span(opened[0], opened[1], opened[0], opened[1] + 1)),),
                                  help="a `for` block is missing its closing `}`")
            return ParseError(f"unexpected end of file; expected {_expected(accepts)}", span)
        line = tok.line if tok.line is not None else err.line
        col = tok.column if tok.column is not None else err.column
        return ParseError(f"unexpected {_found(tok)}; expected {_expected(accepts)}",
                          pos.span(line, col, line, col + max(1, len(str(tok)))),
                          help=_typo_hint(tok, accepts) or _swallowed_hint(lines[line - 1], col, accepts)
                          or _hint(accepts))
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        ch = err.char
        if ch == '"' and not pos.line:
            rest = lines[err.line - 1] if err.line <= len(lines) else ""
            return ParseError("unterminated string",
                              pos.span(err.line, err.column, err.line, len(rest) + 1),
                              help='close the path with `"` on the same line')
        shown = repr(ch)[1:-1] if not ch.isprintable() else ch
        return ParseError(f"unexpected character `{shown}`; expected {_expected(_accepts(err))}",
                          pos.span(err.line, err.column, err.line, err.column + 1))
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        return ParseError(f"unexpected end of file; expected {_expected(err.expected)}",
                          pos.span(len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2))
    raise err


def _hint(expected: set[str]) -> str | None:
    if "RSQB" in expected and "COMMA" in expected:
        return "separate dimensions with `,` and close the list with `]`"
    return None


def _run(text: str, start: str, pos: _Positions):
    try:
        return _lark().parse(text, start=start)
    except lark.exceptions.UnexpectedInput as err:
        raise _convert_error(err, pos) from None


MAX_DEPTH = 200
_EXPR_RULES = frozenset("add sub mul exact_div floor_div mod neg number name local_name call".split())


def _check_depth(tree, pos: _Positions, depth: int = 1) -> None:
    """Refuse trees deeper than MAX_DEPTH (a chain like `1+1+...+1` of thousands
    of terms) before the recursive Transformer and evaluator meet them. `depth`
    is the root's level: a statement counts from 2, below the file's `start`."""
    stack = [(tree, depth, None)]
    while stack:
        node, depth, root = stack.pop()
        if root is None and node.data in _EXPR_RULES:
            root = node  # the outermost expression on this path
        if depth > MAX_DEPTH:
            raise ParseError(f"expression nests deeper than {MAX_DEPTH} levels",
                             pos.of_meta((root or node).meta),
                             help="split it with `const` definitions")
        stack.extend((child, depth + 1, root) for child in node.children if isinstance(child, lark.Tree))


def _transform(tree, pos: _Positions, to_ast: "_ToAst | None" = None):
    """Tree -> AST; the caller has checked the tree's depth when `to_ast` is given."""
    if to_ast is None:
        _check_depth(tree, pos)
    try:
        return (to_ast or _ToAst(pos)).transform(tree)
    except lark.exceptions.VisitError as err:
        if isinstance(err.orig_exc, ParseError):
            raise err.orig_exc from None
        raise


def parse_expr(text: str, pos: _Positions) -> ast.Expr:
    return _transform(_run(text, "expr", pos), pos)


def decode(data: bytes, path: str) -> Source:
    """Bytes -> Source, with a positioned error for text that is not UTF-8."""
    try:
        return Source(path, data.decode("utf-8"))
    except UnicodeDecodeError as err:
        before = data[:err.start]
        line = before.count(b"\n") + 1
        col = len(before[before.rfind(b"\n") + 1:].decode("utf-8", errors="replace")) + 1
        text = data.decode("utf-8", errors="replace")
        raise ParseError(f"the file is not UTF-8 text (byte 0x{data[err.start]:02x})",
                         Span(Source(path, text), line, col, line, col + 1),
                         help="`.layout` files are UTF-8 text") from None


def parse_source(source: Source, *, max_tensors: int | None = None, tensors_before: int = 0,
                 comments: bool = True) -> ast.File:
    """Parse one file. Raises ParseError; never a raw Lark or Python error.

    With `max_tensors`, a file whose `tensor` statements, after `tensors_before`
    others (earlier files of the layout), exceed it is refused before the parse.
    `comments=False` keeps none (only the formatter needs them; a file of 64 MiB
    of `#` lines would otherwise hold 33 million).
    """
    _check_nesting(source)
    if max_tensors is not None:
        _check_tensor_count(source, max_tensors, tensors_before)
    pos = _Positions(source)
    kept: list[ast.Comment] = []
    hook = _STATEMENTS
    _lark()  # built before the lock: building it parses the grammar, not a layout
    with hook.lock:
        hook.begin(pos, kept if comments else None)
        try:
            tree = _run(source.text, "start", pos)
        finally:
            error = hook.end()
    if error is not None:
        raise error
    return ast.File(tuple(tree.children), tuple(kept), source)


def parse(text: str | bytes, path: str = "<string>") -> ast.File:
    source = decode(text, path) if isinstance(text, bytes) else Source(path, text)
    return parse_source(source)
