"""The parser: text -> AST with spans; syntax errors in plain words."""

import pytest

from layoutlang import ast
from layoutlang.diagnostics import ParseError
from layoutlang.parser import parse


def test_tensor_statement_clauses_and_spans():
    f = parse("mesh m (tp=2)\ntensor a.{l}.b as k.{l} [(KV, (q: 2 | k: 1)) over tp chunk g align 16, H] fp32 on m at pp=0")
    t = f.statements[1]
    assert isinstance(t, ast.TensorDecl)
    assert t.name.text == "a.{l}.b" and t.key.text == "k.{l}"
    assert t.name.pieces[0] == "a." and isinstance(t.name.pieces[1], ast.Interp)
    assert (t.name.pieces[1].expr.span.line, t.name.pieces[1].expr.span.col) == (2, 11)
    dim = t.dims[0]
    assert isinstance(dim.mode, ast.Product)
    assert [p.name for p in dim.mode.inner.parts] == ["q", "k"]
    assert [a.name for a in dim.over] == ["tp"] and dim.chunk.axis.name == "g"
    assert dim.chunk.align == ast.Num(16, "16")
    assert t.dtype.name == "fp32" and t.mesh.name == "m"
    assert t.placement[0].axis.name == "pp"
    assert (t.span.line, t.span.col) == (2, 1)


def test_products_nest_to_the_right():
    f = parse("mesh m (tp=1)\ntensor t [(2, 3, 4)]")
    mode = f.statements[1].dims[0].mode
    assert mode == ast.Product(ast.Num(2, "2"), ast.Product(ast.Num(3, "3"), ast.Plain(ast.Num(4, "4"))))


def test_pad_binds_tighter_than_over_and_parens_are_arithmetic():
    f = parse("mesh m (tp=1)\ntensor t [(V) pad 128*TP over tp]")
    dim = f.statements[1].dims[0]
    assert isinstance(dim.mode, ast.Pad) and dim.mode.inner == ast.Plain(ast.Name("V"))
    assert dim.mode.multiple == ast.BinOp("*", ast.Num(128, "128"), ast.Name("TP"))
    assert dim.over == (ast.AxisRef("tp"),)


def test_underscored_integers_and_comments():
    f = parse("# header\nconst V = 128_256  # vocab\n")
    assert f.statements[0].bindings[0].value == ast.Num(128256, "128_256")
    assert [c.text for c in f.comments] == ["# header", "# vocab"]


@pytest.mark.parametrize("text, line, col, words", [
    ("mesh m (tp=2)\ntensor x [4 over tp", 2, 20, "unexpected end of file"),
    ("mesh m (tp=2)\ntensor x [4] bf16 tensor", 2, 25, "expected a tensor name"),
    ("mesh m (tp=2)\nfor l in 0..4 {\n", 3, 1, "unexpected end of file"),
    ("mesh m (tp=2) $", 1, 15, "unexpected character `$`"),
    ("const pad = 3", 1, 7, "`pad` is a reserved word"),
])
def test_syntax_errors_in_plain_words(text, line, col, words):
    with pytest.raises(ParseError) as e:
        parse(text)
    assert (e.value.line, e.value.col) == (line, col)
    assert words in e.value.message


def test_product_count_must_be_plain():
    with pytest.raises(ParseError) as e:
        parse("mesh m (tp=1)\ntensor t [((a: 1 | b: 1), 4)]")
    assert "count of a product" in e.value.message and (e.value.line, e.value.col) == (2, 12)


# ---- one vocabulary: the grammar's words are layoutlang.vocabulary's ---------------

def _grammar_words() -> set[str]:
    from lark.lexer import PatternStr

    from layoutlang.parser import _lark

    return {t.pattern.value for t in _lark().terminals
            if isinstance(t.pattern, PatternStr) and t.pattern.value.isidentifier()}


def test_the_grammars_keywords_are_the_vocabularys():
    from layoutlang.vocabulary import KEYWORDS

    assert _grammar_words() == set(KEYWORDS)
    assert len(set(KEYWORDS)) == len(KEYWORDS)


def test_dtypes_and_functions_are_names_in_the_grammar_not_tokens():
    """They are checked (with a did-you-mean) by elaboration, against the vocabulary."""
    from layoutlang.vocabulary import DTYPES, FUNCTIONS

    assert not _grammar_words() & (set(DTYPES) | set(FUNCTIONS))


@pytest.mark.parametrize("word", __import__("layoutlang.vocabulary").vocabulary.KEYWORDS)
def test_every_keyword_is_reserved(word):
    with pytest.raises(ParseError) as e:
        parse(f"const {word} = 3")
    assert (e.value.line, e.value.col) == (1, 7)
    assert e.value.message == f"`{word}` is a reserved word and cannot be used as a name"


def test_v2_part_keys_stacked_dims_and_transposed():
    f = parse("mesh m (ep=2)\ntensor w [e in 1..E over ep chunk g, (KV, (q: 4 as m.{e}.q | 2 as m.{e}.k)), H] "
              "bf16 transposed on m")
    t = f.statements[1]
    stack = t.dims[0].mode
    assert isinstance(stack, ast.Stack) and stack.var == "e"
    assert stack.start == ast.Num(1, "1") and stack.stop == ast.Name("E")
    assert (stack.var_span.line, stack.var_span.col, stack.span.end_col) == (2, 11, 20)
    assert [a.name for a in t.dims[0].over] == ["ep"] and t.dims[0].chunk.axis.name == "g"
    parts = t.dims[1].mode.inner.parts
    assert [(p.name, p.key.text) for p in parts] == [("q", "m.{e}.q"), (None, "m.{e}.k")]
    assert isinstance(parts[0].key.pieces[1], ast.Interp)
    assert t.transposed == ast.Ident("transposed") and (t.transposed.span.line, t.transposed.span.col) == (2, 86)
    assert t.dtype.name == "bf16" and t.mesh.name == "m"
    one = parse("mesh m (tp=1)\ntensor w [(x: 4 as K)]").statements[1].dims[0].mode
    assert one == ast.Concat((ast.Part("x", ast.Plain(ast.Num(4, "4")), None, ast.NameTemplate("K", ("K",))),))
    assert parse("mesh m (tp=1)\ntensor w [4]").statements[1].transposed is None


@pytest.mark.parametrize("text", ["tensor w [(q: 4 as)]", "tensor w [e in 0.., 4]", "tensor w [e in ..4]",
                                  "tensor w [4] on m transposed", "tensor w [(e in 0..4, 2)]",
                                  "tensor w [e in 0..4 pad 2]"])
def test_v2_syntax_errors(text):
    with pytest.raises(ParseError):
        parse(text)
