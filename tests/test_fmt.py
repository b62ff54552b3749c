"""The canonical formatter: golden outputs, round trips, idempotence, fuzzing.

Every check that can be stated as a property is: `parse(fmt(x)) == parse(x)`,
`fmt(fmt(x)) == fmt(x)`, comments kept in order, no stray blank lines. The
golden cases pin down the style itself (layoutlang/fmt.py's docstring).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layoutlang import ast
from layoutlang.diagnostics import ParseError
from layoutlang.fmt import format_expr, format_file, format_mode, format_text
from layoutlang.parser import parse

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_format(src: str) -> str:
    """Format `src`; assert every formatter property; return the output."""
    out = format_text(src)
    assert parse(out) == parse(src)
    assert format_text(out) == out
    before = [c.text.rstrip() for c in parse(src).comments]
    after = [c.text.rstrip() for c in parse(out).comments]
    assert after == before
    assert out == "" or (out.endswith("\n") and not out.endswith("\n\n"))
    lines = out.split("\n")[:-1]
    assert all(line == line.rstrip() for line in lines)
    assert "" not in lines[:1]
    for prev, line in zip(lines, lines[1:]):
        assert not (prev == "" and line == ""), "two blank lines"
        assert not (prev.split("  #")[0].endswith("{") and line == ""), "blank line opens a block"
        assert not (prev == "" and line.lstrip().startswith("}")), "blank line closes a block"
    return out


# ---- golden cases: input -> exact output ------------------------------------

GOLDEN = {
    # -- statements
    "header": ("layout   llama3_8b_train", "layout llama3_8b_train\n"),
    "include": ('include"common.layout"', 'include "common.layout"\n'),
    "arg": ("arg TP=8", "arg TP = 8\n"),
    "const several": ("const H=4096,F =14336 ,  V=128_256", "const H = 4096, F = 14336, V = 128_256\n"),
    "mesh": ("mesh train(dp=4,gtp = GTP,tp=TP)", "mesh train (dp=4, gtp=GTP, tp=TP)\n"),
    "mesh at": ("mesh infer (dp=2, tp=2)at 64", "mesh infer (dp=2, tp=2) at 64\n"),
    "default dtype": ("default   dtype\nfp16", "default dtype fp16\n"),
    "tensor every clause": (
        "tensor decoder.layers.{l.local}.w as decoder.layers.{l}.w[H,F]bf16 on m at pp = 0,tp=1",
        "tensor decoder.layers.{l.local}.w as decoder.layers.{l}.w [H, F] bf16 on m at pp=0, tp=1\n"),
    "tensor 0-d": ("tensor s [ ]", "tensor s []\n"),
    # -- version 2 (LANGUAGE.md 8)
    "part keys": ("tensor w [(KV,(q:QG*D as m.{l}.q_proj.weight|k:D  as  m.{l}.k|v : D as m.{l}.v))over tp,H]",
                  "tensor w [(KV, (q: QG*D as m.{l}.q_proj.weight | k: D as m.{l}.k | v: D as m.{l}.v)) "
                  "over tp, H]\n"),
    "part key unnamed and one-part": ("tensor w [(4 as A|(x:4 pad 8 as B))]",
                                      "tensor w [(4 as A | (x: 4 pad 8 as B))]\n"),
    "stacked dims": ("tensor w as k.{e}.{j}[e  in 0 ..E over ep chunk edp align 2,j in 1..3,H]",
                     "tensor w as k.{e}.{j} [e in 0..E over ep chunk edp align 2, j in 1..3, H]\n"),
    "transposed": ("tensor c as h.w[768,2304]bf16   transposed on m at pp=0",
                   "tensor c as h.w [768, 2304] bf16 transposed on m at pp=0\n"),
    "transposed without dtype": ("tensor c [2, 3]\n  transposed", "tensor c [2, 3] transposed\n"),
    "tensor name verbatim": ("tensor a.{ l+1 }.b{e} [1]", "tensor a.{ l+1 }.b{e} [1]\n"),
    "for": ("for l in 0..L{tensor x.{l} [H]}", "for l in 0..L {\n  tensor x.{l} [H]\n}\n"),
    "for over sizes": ("for l in 0 .. L over pp sizes[7,9]{ }",
                       "for l in 0..L over pp sizes [7, 9] {\n}\n"),
    "for empty": ("for l in 0..L {}", "for l in 0..L {\n}\n"),
    "for nested": ("for l in 0..L { for e in 0..E over ep { tensor w{e.local} [1] } }",
                   "for l in 0..L {\n  for e in 0..E over ep {\n    tensor w{e.local} [1]\n  }\n}\n"),
    "two statements on one line": ("arg A = 1 arg B = 2", "arg A = 1\narg B = 2\n"),
    # -- modes and dims
    "plain": ("tensor x [4 * H]", "tensor x [4*H]\n"),
    "plain parenthesized": ("tensor x [(4*H)]", "tensor x [4*H]\n"),
    "product": ("tensor x [(N,M)]", "tensor x [(N, M)]\n"),
    "product flattens": ("tensor x [(A, (B, (C, D)))]", "tensor x [(A, B, C, D)]\n"),
    "product arithmetic": ("tensor x [((KV*QG), (D))]", "tensor x [(KV*QG, D)]\n"),
    "concat": ("tensor x [(q:Q*D|k: D|v :D)]", "tensor x [(q: Q*D | k: D | v: D)]\n"),
    "concat unnamed parts": ("tensor x [(A|b:B|C)]", "tensor x [(A | b: B | C)]\n"),
    "concat one part": ("tensor x [( x : M )]", "tensor x [(x: M)]\n"),
    "concat in product": ("tensor x [(KV,(q:(QG,D)|k:D|v:D))]",
                          "tensor x [(KV, (q: (QG, D) | k: D | v: D))]\n"),
    "pad": ("tensor x [V pad 128*TP over tp]", "tensor x [V pad 128*TP over tp]\n"),
    "pad grouped": ("tensor x [(V pad 128)over tp]", "tensor x [V pad 128 over tp]\n"),
    "pad in pad": ("tensor x [((V pad 2) pad 4) pad 8]", "tensor x [((V pad 2) pad 4) pad 8]\n"),
    "pad of product": ("tensor x [(N, M) pad 8]", "tensor x [(N, M) pad 8]\n"),
    "pad of concat": ("tensor x [(a: A | b: B)pad 8]", "tensor x [(a: A | b: B) pad 8]\n"),
    "pad in product": ("tensor x [(N, M pad 2)]", "tensor x [(N, M pad 2)]\n"),
    "pad in concat": ("tensor x [(a: A pad 2 | B pad 4)]", "tensor x [(a: A pad 2 | B pad 4)]\n"),
    "pad in one part": ("tensor x [(a: (A pad 2) pad 4)]", "tensor x [(a: (A pad 2) pad 4)]\n"),
    "pad expression": ("tensor x [V pad (a+b)]", "tensor x [V pad a + b]\n"),
    "over tuple": ("tensor x [F over(dp,tp)]", "tensor x [F over (dp, tp)]\n"),
    "chunk": ("tensor x [H chunk gtp]", "tensor x [H chunk gtp]\n"),
    "chunk align": ("tensor x [(gate:F|up:F)over tp chunk gtp align 16]",
                    "tensor x [(gate: F | up: F) over tp chunk gtp align 16]\n"),
    # -- expressions
    "spaces": ("const x = a+b-c*d/e//f%g", "const x = a + b - c*d/e//f%g\n"),
    "redundant parens": ("const x = ((a)+(b*c))", "const x = a + b*c\n"),
    "looser left operand": ("const x = (a+b)*c", "const x = (a + b)*c\n"),
    "looser right operand": ("const x = a*(b-c)", "const x = a*(b - c)\n"),
    "right sub": ("const x = a-(b-c)", "const x = a - (b - c)\n"),
    "right add": ("const x = a-(b+c)", "const x = a - (b + c)\n"),
    "left sub": ("const x = (a-b)-c", "const x = a - b - c\n"),
    "right div": ("const x = a/(b*c)", "const x = a/(b*c)\n"),
    "right mod": ("const x = a%(b//c)", "const x = a%(b//c)\n"),
    "left div": ("const x = (a/b)*c", "const x = a/b*c\n"),
    "right assoc add kept": ("const x = a+(b+c)", "const x = a + (b + c)\n"),
    "neg": ("const x = - a", "const x = -a\n"),
    "neg binop": ("const x = -(a*b)", "const x = -(a*b)\n"),
    "neg binds tight": ("const x = (-a)*b", "const x = -a*b\n"),
    "neg neg": ("const x = -(-a)", "const x = --a\n"),
    "neg operand": ("const x = a - (-b)", "const x = a - -b\n"),
    "neg times": ("const x = a*(-b)", "const x = a*-b\n"),
    "calls": ("const x = min( a,b )+cdiv(max(a , 1),roundup(b,m))",
              "const x = min(a, b) + cdiv(max(a, 1), roundup(b, m))\n"),
    "call of sum": ("const x = 2*min(a+b,c)", "const x = 2*min(a + b, c)\n"),
    "local": ("tensor x.{l.local} [l . local + 1]", "tensor x.{l.local} [l.local + 1]\n"),
    "number text": ("const V = 128_256, Z = 007", "const V = 128_256, Z = 007\n"),
    "for bounds": ("for l in (a+1)..(L-1) { }", "for l in a + 1..L - 1 {\n}\n"),
    "placement expr": ("tensor x [1] at pp=(pp-1)", "tensor x [1] at pp=pp - 1\n"),
    # -- comments
    "standalone": ("# a\ntensor x [1]\n  # b\ntensor y [2]", "# a\ntensor x [1]\n# b\ntensor y [2]\n"),
    "trailing": ("tensor x [1]   # one   \narg A=1# two", "tensor x [1]  # one\narg A = 1  # two\n"),
    "trailing after two statements": ("arg A = 1 arg B = 2  # b", "arg A = 1\narg B = 2  # b\n"),
    "comment verbatim": ("#no space\n##  two  \n#", "#no space\n##  two\n#\n"),
    "for head comment": ("for l in 0..L {   # layers\ntensor x [1]\n}",
                         "for l in 0..L {  # layers\n  tensor x [1]\n}\n"),
    "for body comments": ("for l in 0..L {\n# first\ntensor x [1]\n    # last\n}",
                          "for l in 0..L {\n  # first\n  tensor x [1]\n  # last\n}\n"),
    "for only comment": ("for l in 0..L {\n# todo\n}", "for l in 0..L {\n  # todo\n}\n"),
    "for close comment": ("for l in 0..L { tensor x [1] }  # end", "for l in 0..L {\n  tensor x [1]\n}  # end\n"),
    "for last statement trailing": ("for l in 0..L {\n tensor x [1]  # x\n}",
                                    "for l in 0..L {\n  tensor x [1]  # x\n}\n"),
    "comment in for head": ("for l in 0..L over pp sizes [7,  # seven\n 9] {\n}",
                            "# seven\nfor l in 0..L over pp sizes [7, 9] {\n}\n"),
    "end of file": ("tensor x [1]\n# end\n", "tensor x [1]\n# end\n"),
    "end of file after blank": ("tensor x [1]\n\n\n# end\n\n\n", "tensor x [1]\n\n# end\n"),
    "only comments": ("\n\n# a\n\n\n# b\n", "# a\n\n# b\n"),
    "inside multiline tensor": (
        "tensor w [(q: A | k: B),   # qkv\n"
        "          H]               # rows\n",
        "# qkv\ntensor w [(q: A | k: B), H]  # rows\n"),
    "inside multiline tensor after blank": (
        "arg A = 1\n\ntensor w [1,  # first\n  # second\n  2]\n",
        "arg A = 1\n\n# first\n# second\ntensor w [1, 2]\n"),
    "inside nested": ("for l in 0..L {\n  tensor w [1, # a\n  2]\n}",
                      "for l in 0..L {\n  # a\n  tensor w [1, 2]\n}\n"),
    # -- blank lines
    "blank lines collapse": ("arg A = 1\n\n\n\narg B = 2\narg C = 3", "arg A = 1\n\narg B = 2\narg C = 3\n"),
    "no blank at start": ("\n\n\narg A = 1\n", "arg A = 1\n"),
    "blank around comments": ("arg A = 1\n\n\n# about B\n\n\narg B = 2",
                              "arg A = 1\n\n# about B\n\narg B = 2\n"),
    "no blank at block edges": ("for l in 0..L {\n\n\n  tensor x [1]\n\n  tensor y [1]\n\n\n}\n\n\n",
                                "for l in 0..L {\n  tensor x [1]\n\n  tensor y [1]\n}\n"),
    "blank after block": ("for l in 0..L {\n}\n\narg A = 1", "for l in 0..L {\n}\n\narg A = 1\n"),
    "empty": ("", ""),
    "whitespace only": ("  \n\n\t\n", ""),
    "crlf": ("arg A = 1  # a\r\n\r\n\r\narg B = 2\r\n", "arg A = 1  # a\n\narg B = 2\n"),
}


@pytest.mark.parametrize("src, expected", GOLDEN.values(), ids=GOLDEN.keys())
def test_golden(src, expected):
    assert format_text(src) == expected
    check_format(src)


EXAMPLE = """\
layout llama3_8b_train
arg TP = 8
arg GTP = 2
const L = 32, H = 4096, F = 14336, Q = 32, KV = 8, D = 128, V = 128256
mesh train (dp=4, gtp=GTP, tp=TP)

tensor embedding.word_embeddings.weight [V pad 128*TP over tp, H]
tensor output_layer.weight              [V pad 128*TP over tp, H]
tensor decoder.final_layernorm.weight   [H]
for l in 0..L {
  tensor decoder.layers.{l}.self_attention.linear_qkv.weight
         [(KV, (q: Q/KV*D | k: D | v: D)) over tp chunk gtp align 16, H]
  tensor decoder.layers.{l}.self_attention.linear_proj.weight [H chunk gtp, Q*D over tp]
  tensor decoder.layers.{l}.mlp.linear_fc1.weight [(gate: F | up: F) over tp chunk gtp, H]
  tensor decoder.layers.{l}.mlp.linear_fc2.weight [H chunk gtp, F over tp]
  tensor decoder.layers.{l}.input_layernorm.weight [H]
  tensor decoder.layers.{l}.pre_mlp_layernorm.weight [H]
}
"""


def test_spec_example():
    out = check_format(EXAMPLE)
    assert out.splitlines()[10] == (
        "  tensor decoder.layers.{l}.self_attention.linear_qkv.weight "
        "[(KV, (q: Q/KV*D | k: D | v: D)) over tp chunk gtp align 16, H]")
    assert "tensor output_layer.weight [V pad 128*TP over tp, H]" in out


MESSY = [
    EXAMPLE,
    """# vLLM side, non-collocated
layout llama3_8b_infer   # inference
include "common.layout"  # shared consts


mesh infer(dp=2,tp=2)at 64   # after the trainer's 64 ranks
default dtype mxfp8
tensor model.embed_tokens.weight as embedding.word_embeddings.weight [V pad 64 over tp,H] bf16
for l in 0..L over pp sizes [ 7 , 9 ]{   # uneven stages
  tensor model.layers.{l.local}.self_attn.qkv_proj.weight as decoder.layers.{l}.qkv
     [ (q: (KV*QG, D) | k: (KV, D) | v: (KV, D)) over tp,   # packed
       H ]
  for e in 0..E over ep {
    # experts
    tensor model.layers.{l.local}.experts.w{e.local} [(gate:F|up:F)over tp,H]on experts at etp=0
  }


  # trailing in body
}
tensor lm_head.weight [ V pad 64 over tp , H ] at pp = pp - 1   # last stage
# end
""",
    "tensor x [-(a+b)*c, (a-b)-(c-d), a/(b/c), a//(b%c), -min(a,-b), ((x pad 2)pad 3)over(dp,tp)]",
    "const A = 1,B=2\n\n\n\n   # c\n\n\n\nconst C = -(A - B)  # d\n\n\n\n",
    "for i in 0..2 { for j in 0..3 { for k in 0..4 { tensor t.{i}.{j}.{k} [1] # deep\n } } }",
]


@pytest.mark.parametrize("src", MESSY)
def test_round_trip_and_idempotent(src):
    check_format(src)


def test_parse_errors_propagate():
    with pytest.raises(ParseError):
        format_text("tensor x [1", "bad.layout")


def test_format_file_matches_format_text():
    f = parse(MESSY[1], "x.layout")
    assert format_file(f) == format_text(MESSY[1])


def test_unrepresentable_mode_is_refused():
    lone = ast.Concat((ast.Part(None, ast.Plain(ast.Name("M"))),))
    with pytest.raises(ValueError):
        format_mode(lone)


# ---- property tests over random text -----------------------------------------

SEP = st.sampled_from([" ", "  ", "\t", "\n   ", "  # note\n  ", " #\n"])  # between words
OPT = st.sampled_from(["", "", "", " ", " ", "\n ", "\n", " # k | (x) pad\n"])  # around punctuation
NAMES = st.sampled_from(["a", "b", "TP", "H", "x_1", "KV"])
NUMS = st.sampled_from(["0", "1", "7", "16", "4096", "128_256", "007"])
LEAF = st.one_of(NAMES, NUMS, st.sampled_from(["l.local", "e . local"]))
FUNCS = st.sampled_from(["min", "max", "cdiv", "roundup"])
OPS = st.sampled_from(["+", "-", "*", "/", "//", "%"])


def _expr_node(children):
    binop = st.tuples(children, OPT, OPS, OPT, children).map("".join)
    neg = st.tuples(st.just("-"), OPT, children).map("".join)
    paren = st.tuples(st.just("("), OPT, children, OPT, st.just(")")).map("".join)
    call = st.tuples(FUNCS, st.just("("), children, st.just(","), OPT, children,
                     st.just(")")).map("".join)
    return st.one_of(binop, binop, neg, paren, call)


EXPRS = st.recursive(LEAF, _expr_node, max_leaves=8)


def _wrap(text):
    return "(" + text + ")"


def _mode_node(children):
    """Mirror the grammar: `mode := group [pad E]`, groups are parenthesized."""
    items = st.lists(EXPRS, min_size=1, max_size=2)
    product = st.tuples(items, children).map(lambda t: _wrap(", ".join([*t[0], t[1]])))
    part = st.tuples(st.sampled_from(["", "q: ", "k :", "up:"]), children,
                     st.sampled_from(["", "", " as m.{l}.q", " as  k{e}.w"])).map("".join)
    concat = st.lists(part, min_size=2, max_size=3).map(lambda ps: _wrap(" | ".join(ps)))
    one = st.tuples(st.sampled_from(["x: ", "gate:"]), children).map(lambda t: _wrap("".join(t)))
    group = st.one_of(product, concat, one, EXPRS.map(_wrap))
    padded_group = st.tuples(group, SEP, EXPRS).map(lambda t: _wrap(f"{t[0]}{t[1]}pad {t[2]}"))
    padded = st.tuples(st.one_of(group, padded_group), SEP, EXPRS).map(
        lambda t: f"{t[0]}{t[1]}pad {t[2]}")
    return st.one_of(group, padded_group, padded)


MODES = st.recursive(EXPRS, _mode_node, max_leaves=6)


@st.composite
def dims(draw):
    if draw(st.integers(0, 5)) == 0:  # v2: a stacked dim
        text = f"{draw(st.sampled_from(['e', 'j']))}{draw(SEP)}in{draw(SEP)}{draw(EXPRS)}..{draw(EXPRS)}"
    else:
        text = draw(MODES)
    over = draw(st.sampled_from(["", "tp", "(dp, tp)", "( dp,ep , tp )"]))
    if over:
        text += f"{draw(SEP)}over{draw(SEP)}{over}"
    if draw(st.booleans()):
        text += f"{draw(SEP)}chunk gtp"
        if draw(st.booleans()):
            text += f" align{draw(SEP)}{draw(EXPRS)}"
    return text


TNAMES = st.sampled_from(["w", "model.layers.{l}.mlp.weight", "decoder.{l.local}.w{e}",
                          "x.{ l + 1 }.y", "a_1.0.b"])


@st.composite
def tensors(draw):
    text = f"tensor{draw(SEP)}{draw(TNAMES)}"
    if draw(st.booleans()):
        text += f"{draw(SEP)}as{draw(SEP)}{draw(TNAMES)}"
    ds = draw(st.lists(dims(), max_size=3))
    text += draw(OPT) + "[" + draw(OPT) + f"{draw(OPT)},{draw(OPT)}".join(ds) + draw(OPT) + "]"
    if draw(st.booleans()):
        text += f"{draw(SEP)}{draw(st.sampled_from(['bf16', 'fp32', 'mxfp8']))}"
    if draw(st.integers(0, 3)) == 0:
        text += f"{draw(SEP)}transposed"
    if draw(st.booleans()):
        text += f"{draw(SEP)}on{draw(SEP)}m"
    places = draw(st.lists(st.tuples(st.sampled_from(["pp", "tp"]), EXPRS), max_size=2))
    if places:
        text += f"{draw(SEP)}at{draw(SEP)}" + ", ".join(f"{a}{draw(OPT)}={draw(OPT)}{e}"
                                                         for a, e in places)
    return text


def _bindings(draw):
    pairs = draw(st.lists(st.tuples(NAMES, EXPRS), min_size=1, max_size=3))
    return ",".join(f"{draw(OPT)}{n}{draw(OPT)}={draw(OPT)}{e}" for n, e in pairs)


@st.composite
def simple_statements(draw):
    kind = draw(st.sampled_from(["layout", "include", "arg", "const", "mesh", "default",
                                 "tensor", "tensor", "tensor"]))
    if kind == "layout":
        return f"layout{draw(SEP)}{draw(NAMES)}"
    if kind == "include":
        return f'include{draw(OPT)}"common.layout"'
    if kind in ("arg", "const"):
        return f"{kind}{draw(SEP)}{_bindings(draw)}"
    if kind == "mesh":
        at = f"{draw(SEP)}at{draw(SEP)}{draw(EXPRS)}" if draw(st.booleans()) else ""
        return f"mesh{draw(SEP)}m{draw(OPT)}({_bindings(draw)}{draw(OPT)}){at}"
    if kind == "default":
        return f"default{draw(SEP)}dtype{draw(SEP)}fp16"
    return draw(tensors())


GAPS = st.sampled_from(["\n", "\n", " ", "\n\n\n", "  # trailing  \n", "\n# own line\n",
                        "\n\n# after blank\n\n", "\n   #a\n  #b\n\n"])


@st.composite
def blocks(draw, depth):
    stmts = []
    for _ in range(draw(st.integers(0, 4))):
        if depth < 2 and draw(st.integers(0, 3)) == 0:
            over = draw(st.sampled_from(["", " over pp", " over pp sizes [7,9]",
                                         f" over{draw(SEP)}pp{draw(SEP)}sizes{draw(OPT)}"
                                         f"[{draw(EXPRS)},{draw(OPT)}{draw(EXPRS)}]"]))
            head = (f"for{draw(SEP)}l in{draw(SEP)}{draw(EXPRS)}{draw(OPT)}.."
                    f"{draw(OPT)}{draw(EXPRS)}{over}")
            body = draw(blocks(depth + 1))
            stmts.append(f"{head}{draw(OPT)}{{{draw(GAPS)}{body}{draw(GAPS)}}}")
        else:
            stmts.append(draw(simple_statements()))
    return "".join(s + draw(GAPS) for s in stmts)


@FUZZ
@given(blocks(0), GAPS)
def test_fuzz_files(text, lead):
    check_format(lead + text)


# ---- property tests over random ASTs -----------------------------------------

AST_LEAF = st.one_of(
    st.integers(0, 999).map(lambda v: ast.Num(v, str(v))),
    NAMES.map(ast.Name),
    st.just(ast.Local("l")),
)


def _ast_node(children):
    return st.one_of(
        st.builds(ast.BinOp, OPS, children, children),
        st.builds(ast.BinOp, OPS, children, children),
        st.builds(ast.Neg, children),
        st.builds(lambda f, a, b: ast.Call(f, (a, b)), FUNCS, children, children),
    )


AST_EXPRS = st.recursive(AST_LEAF, _ast_node, max_leaves=10)


def _parse_expr(text):
    (const,) = parse(f"const x = {text}").statements
    return const.bindings[0].value


def _paren_pairs(text):
    """(open, close) index pairs of grouping parentheses (not call parentheses)."""
    stack, pairs = [], []
    for i, ch in enumerate(text):
        if ch == "(":
            stack.append(None if i and re.match(r"\w", text[i - 1]) else i)
        elif ch == ")":
            j = stack.pop()
            if j is not None:
                pairs.append((j, i))
    return pairs


@FUZZ
@given(AST_EXPRS)
def test_fuzz_expr_ast(expr):
    text = format_expr(expr)
    assert _parse_expr(text) == expr
    for i, j in _paren_pairs(text):  # every parenthesis is needed
        shorter = text[:i] + text[i + 1:j] + text[j + 1:]
        try:
            assert _parse_expr(shorter) != expr, f"redundant parentheses in {text!r}"
        except ParseError:
            pass


def _ast_mode_node(children):
    product = st.builds(ast.Product, AST_EXPRS, children)
    key = st.sampled_from([None, None, "m.{l}.q", "k{e}.w"]).map(
        lambda k: k and parse(f"tensor {k} [1]").statements[0].name)
    part = st.builds(lambda n, m, k: ast.Part(n, m, None, k), st.sampled_from([None, "q", "k"]), children, key)
    concat = st.lists(part, min_size=2, max_size=3).map(lambda ps: ast.Concat(tuple(ps)))
    one = st.builds(lambda n, m: ast.Concat((ast.Part(n, m),)), st.sampled_from(["x", "up"]),
                    children)
    pad = st.builds(ast.Pad, children, AST_EXPRS)
    return st.one_of(product, concat, one, pad)


AST_MODES = st.recursive(AST_EXPRS.map(ast.Plain), _ast_mode_node, max_leaves=6)


@FUZZ
@given(AST_MODES)
def test_fuzz_mode_ast(mode):
    text = format_mode(mode)
    (tensor,) = parse(f"tensor x [{text} over tp]").statements
    assert tensor.dims[0].mode == mode
    assert tensor.dims[0].over == (ast.AxisRef("tp"),)


EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.layout"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_round_trip(path):
    check_format(path.read_text("utf-8"))
