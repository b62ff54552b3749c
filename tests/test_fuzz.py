"""Fuzzing the front end: any input gives a Layout or a LayoutError, nothing else.

Properties, for every input text or byte string:

* `layoutlang.loads(...)` returns a `Layout` or raises `LayoutError`; any other
  exception (IndexError, RecursionError, a raw Lark error, ...) is a bug;
* a raised `LayoutError` renders, and its line and column lie inside the text;
* `layoutc check FILE` exits 0 or 1 and never prints a traceback.

Inputs are random text and bytes, token soup drawn from the language's own
vocabulary, and grammar-aware mutations of small realistic layouts (delete,
duplicate, swap tokens; numbers replaced by 0, -1, 2**40, 10**30, ...; names
swapped; punctuation inserted). Budgets are bounded (the file runs in seconds);
`FUZZ_EXAMPLES=20000 pytest tests/test_fuzz.py` hunts longer.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import layoutlang
from layoutlang import Layout, LayoutError, ParseError, ast
from layoutlang.cli import main
from layoutlang.diagnostics import Source
from layoutlang.parser import parse, parse_source

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))  # FUZZ_EXAMPLES=20000 for a long hunt
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Includes resolve relative to the layout's path: keep them inside an empty folder.
_DIR = tempfile.TemporaryDirectory(prefix="layoutlang-fuzz-")
PATH = str(Path(_DIR.name) / "fuzz.layout")


# ---- seeds: small realistic layouts --------------------------------------------

SEED_TP_GTP = """\
layout llama_train
arg TP = 4
arg GTP = 2
const L = 2, H = 256, F = 512, Q = 8, KV = 2, D = 32, V = 1000
mesh train (dp=2, gtp=GTP, tp=TP)

tensor embedding.word_embeddings.weight [V pad 128*TP over tp, H]
tensor decoder.final_layernorm.weight [H]
for l in 0..L {
  tensor decoder.layers.{l}.self_attention.linear_qkv.weight
         [(KV, (q: Q/KV*D | k: D | v: D)) over tp chunk gtp align 16, H]
  tensor decoder.layers.{l}.self_attention.linear_proj.weight [H chunk gtp, Q*D over tp]
  tensor decoder.layers.{l}.mlp.linear_fc1.weight [(gate: F | up: F) over tp chunk gtp, H]
  tensor decoder.layers.{l}.mlp.linear_fc2.weight [H chunk gtp, F over tp] fp32
}
"""

SEED_PP = """\
layout gpt_pp
arg PP = 4
const L = 10, H = 128, V = 512
mesh pp_mesh (pp=PP, dp=2, tp=2)
default dtype bf16

tensor embedding.weight [V over tp, H] at pp=0
tensor output_layer.weight as embedding.weight [V over tp, H] at pp=pp-1
for l in 0..L over pp sizes [2, 3, 3, 2] {
  tensor layers.{l.local}.attn.qkv [(q: H | k: H/2 | v: H/2) over tp, H]
  tensor layers.{l.local}.attn.proj [H, H over tp]
  tensor layers.{l.local}.norm [H]
}
tensor final_norm.weight [H] at pp=PP-1
"""

SEED_MOE = """\
layout moe
const L = 2, E = 8, H = 64, F = 128
mesh dense (pp=1, dp=4, tp=2)
mesh experts (pp=1, edp=1, ep=4, etp=2) at 0
for l in 0..L {
  tensor decoder.layers.{l}.router.weight [E, H]
  tensor decoder.layers.{l}.attn.qkv [(4, (q: 2*16 | k: 16 | v: 16)) over tp, H]
  for e in 0..E over ep {
    tensor decoder.layers.{l}.mlp.experts.fc1.weight{e.local} [(gate: F | up: F) over etp, H] on experts
    tensor decoder.layers.{l}.mlp.experts.fc2.weight{e.local} [H, F over etp] on experts
  }
}
"""

SEED_INFER = """\
layout infer
arg TP = 2
const H = 256, V = 1000, NH = 8, KV = 2, D = 32
mesh infer (dp=2, tp=TP) at 64
tensor model.embed_tokens.weight [V pad 64 over tp, H]
tensor model.qkv_proj.weight [(q: (NH, D) | k: (KV, D) | v: (KV, D)) over tp, H] mxfp8
tensor model.o_proj.weight [H, min(NH, 8)*D over tp] fp8_e4m3
tensor model.gate_up.weight [(gate: cdiv(H, 3) * 3 | up: roundup(H, 64)) over tp, H // 2 + H % 7]
tensor model.norm.weight [H] fp32
tensor model.scalar []
"""

SEED_V2 = """\
layout v2_keys_inside
const L = 2, H = 64, E = 4, I = 32, KV = 2, QG = 2, D = 16
mesh infer (ep=2, tp=2)
for l in 0..L {
  tensor layers.{l}.qkv [(KV, (q: QG*D as m.{l}.q | k: D as m.{l}.k | v: D as m.{l}.v)) over tp, H]
  tensor layers.{l}.w13 [e in 0..E over ep, (gate: I as m.{l}.e.{e}.gate | up: I as m.{l}.e.{e}.up) over tp, H] mxfp8
  tensor layers.{l}.w2 as m.{l}.e.{e}.down [e in 0..E over ep, H, I over tp]
  tensor layers.{l}.stk as m.{l}.s.{i}.{j} [i in 1..3, j in 0..2 over ep, H, I]
  tensor layers.{l}.conv as m.{l}.conv [H, 3*H over tp] bf16 transposed
}
"""

SEEDS = [SEED_TP_GTP, SEED_PP, SEED_MOE, SEED_INFER, SEED_V2]

TOKEN = re.compile(r"\s+|#[^\n]*|\"[^\"\n]*\"|[A-Za-z_][A-Za-z0-9_]*|[0-9][0-9_]*|\.\.|//|.", re.S)
WORDS = ("layout include arg const mesh at default dtype tensor as on for in over sizes pad "
         "chunk align local transposed min max cdiv roundup bf16 fp16 fp32 fp8_e4m3 fp8_e5m2 mxfp8").split()
PUNCT = list("()[]{},|:=.*/%+-\"#\n") + ["..", "//", "{}", "\t", "\x00", "é", "\u2028"]
NUMBERS = ["0", "-1", "1", "3", "31", "2**40", str(2**40), str(2**62), str(2**63), str(10**30),
           "1_000_000_000", "99999999999999999999999999999999999999999999"]


def _tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def check(data: str | bytes) -> Layout | None:
    """The property: a Layout, or a LayoutError that renders and points into the text."""
    try:
        layout = layoutlang.loads(data, PATH)
    except LayoutError as err:
        rendered = err.render()
        assert isinstance(rendered, str) and rendered
        assert "Traceback" not in rendered
        assert err.message
        if err.span is not None and err.span.source.path == PATH:
            text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
            lines = text.split("\n")
            assert 1 <= err.line <= len(lines), (err.line, len(lines))
            assert 1 <= err.col <= len(lines[err.line - 1]) + 1, (err.col, lines[err.line - 1])
            assert rendered.startswith(f"{PATH}:{err.line}:{err.col}: error: ")
        return None
    assert isinstance(layout, Layout)
    return layout


def test_seeds_are_valid():
    for seed in SEEDS:
        layout = check(seed)
        assert layout is not None and layout.tensors


# ---- pathological inputs found or feared; each must be a LayoutError ---------------

PATHOLOGICAL = {
    "open_braces": "{" * 10_000,
    "open_parens": "(" * 100_000,
    "braces_in_name": "mesh m (tp=2)\ntensor w{" + "{" * 200 + "} [1]",
    # Found by this file: long operator chains nest the parse tree (and the
    # evaluator) one level per operator; ~480 operators hit Python's recursion
    # limit (RecursionError, or VisitError inside a `{...}`) before the depth bound.
    "unary_minus_chain": "mesh m (tp=2)\ntensor w [" + "-" * 5000 + "1]",
    "sum_chain_const": "const A = " + "1+" * 500 + "1",
    "product_chain_dim": "mesh m (tp=2)\ntensor w [" + "1*" * 3000 + "1]",
    "sum_chain_in_name": "mesh m (tp=2)\nfor l in 0..1 {\n  tensor w{" + "1+" * 500 + "l} [1]\n}",
    "sum_chain_in_key": "mesh m (tp=2)\ntensor w as k{" + "1+" * 500 + "1} [1]",
    "many_statements": "mesh m (tp=2)\n" + "".join(f"tensor w{i} [8 over tp]\n" for i in range(5000)),
    # Found by this file: an integer literal of more than 4300 digits raised
    # ValueError (Python's int-from-str limit) wrapped in a lark VisitError.
    "huge_literal": "const A = " + "9" * 5000,
    # Found by this file: a NUL inside an include path escaped as ValueError.
    "include_nul": 'include "a\x00b"',
    "long_line": "mesh m (tp=2)\ntensor w [" + "1" * 100_000 + "]",
    "long_name": "mesh m (tp=2)\ntensor " + "a." * 50_000 + "a [1]",
    # Hostile input (issue 8): paths that are no layout file (a device would be
    # read until memory runs out), and names the count of tensor statements
    # before parsing must not mistake for the keyword.
    "include_device": 'include "/dev/zero"',
    "include_directory": 'include "."',
    "include_self": 'include "fuzz.layout"',
    "names_spelled_tensor": "mesh m (tp=2)\ntensor tensor.tensor as tensor [1]  # tensor\ntensor\n  tensor [1]",
}
# The ones that are valid layouts, only large or odd: they must LOAD (the tensors they declare).
VALID_EXTREMES = {"many_statements": 5000, "long_name": 1, "names_spelled_tensor": 2}


@pytest.mark.timeout(60)  # reading a device or a FIFO would hang or exhaust memory instead
@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_inputs(name):
    layout = check(PATHOLOGICAL[name])
    if name in VALID_EXTREMES:
        assert layout is not None and len(layout.tensors) == VALID_EXTREMES[name]
    else:
        assert layout is None, f"{name} must be a LayoutError, it loaded"


# ---- (a) random text and bytes ---------------------------------------------------

@FUZZ
@given(st.text())
@example("")
@example("\n\n\n")
@example("tensor")
@example("\ufeffmesh m (tp=2)")
@example("mesh m (tp=2)\r\ntensor w [8 over tp]\r\n")
def test_random_text(text):
    check(text)


@FUZZ
@given(st.binary())
@example(b"\xff")
@example(b"\xc2\x80\xc2\x80\x80")  # found: the error column counted bytes, not characters
@example(b"\x00")
@example(b"mesh m (tp=2)\n\xc3")
@example(b"\xef\xbb\xbfmesh m (tp=2)")
def test_random_bytes(data):
    check(data)


_vocab = st.sampled_from(WORDS + PUNCT + ["m", "tp", "l", "x.y", "{l}", "{l.local}", "8", "0..4",
                                          "w", "(tp=2)", "[8 over tp]", "e in 0..4", "(q: 4 as k.{e} | v: 4 as v)",
                                          "\n", " "])


@FUZZ
@given(st.lists(_vocab, max_size=60))
def test_token_soup(words):
    check(" ".join(words))


@FUZZ
@given(st.lists(_vocab, max_size=40))
def test_token_soup_after_a_valid_prefix(words):
    check("mesh m (pp=2, tp=2)\nconst L = 4\nfor l in 0..L over pp {\n" + " ".join(words))


# ---- (b) grammar-aware mutations of the seeds --------------------------------------

@st.composite
def mutated(draw) -> str:
    seed = draw(st.sampled_from(SEEDS))
    toks = _tokens(seed)
    names = sorted({t for t in toks if re.fullmatch(r"[A-Za-z_]\w*", t)} | set(WORDS))
    for _ in range(draw(st.integers(1, 4))):
        solid = [i for i, t in enumerate(toks) if not t.isspace()]
        if not solid:
            break
        i = draw(st.sampled_from(solid))
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "number", "name",
                                     "punct", "line"]))
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[i])
        elif kind == "swap":
            j = draw(st.sampled_from(solid))
            toks[i], toks[j] = toks[j], toks[i]
        elif kind == "number":
            numbers = [k for k in solid if toks[k][0].isdigit()]
            if numbers:
                k = draw(st.sampled_from(numbers))
                toks[k] = draw(st.sampled_from(NUMBERS) | st.integers(-5, 4096).map(str))
        elif kind == "name":
            idents = [k for k in solid if re.fullmatch(r"[A-Za-z_]\w*", toks[k])]
            if idents:
                k = draw(st.sampled_from(idents))
                toks[k] = draw(st.sampled_from(names))
        elif kind == "punct":
            toks.insert(i + draw(st.integers(0, 1)), draw(st.sampled_from(PUNCT)))
        else:  # duplicate or drop a whole line
            lines = "".join(toks).split("\n")
            n = draw(st.integers(0, len(lines) - 1))
            if draw(st.booleans()):
                lines.insert(n, lines[n])
            else:
                del lines[n]
            toks = _tokens("\n".join(lines))
    return "".join(toks)


@FUZZ
@given(mutated())
def test_mutated_seeds(text):
    check(text)


def _tensor_statements(statements) -> int:
    return sum(1 if isinstance(s, ast.TensorDecl) else
               _tensor_statements(s.body) if isinstance(s, ast.ForLoop) else 0 for s in statements)


@FUZZ
@given(mutated())
def test_tensor_count_before_parsing_is_exact(text):
    """The cap on tensor statements is checked by a scan before the parse; on
    every text that parses, the scan counts exactly the parsed statements."""
    try:
        n = _tensor_statements(parse(text, PATH).statements)
    except LayoutError:
        return
    parse_source(Source(PATH, text), max_tensors=n)
    if n:
        with pytest.raises(ParseError, match=f"more than {n - 1} tensor statements"):
            parse_source(Source(PATH, text), max_tensors=n - 1)


@FUZZ
@given(mutated(), st.sampled_from(["TP", "GTP", "PP"]), st.sampled_from([0, -1, 1, 3, 2**40, 10**30]))
def test_mutated_seeds_with_overrides(text, name, value):
    declared = re.search(rf"^\s*arg\s+{name}\b", text, re.M) is not None
    try:
        layout = layoutlang.loads(text, PATH, {name: value})
    except LayoutError as err:
        assert "Traceback" not in err.render()
        return
    # success is only right when the arg exists and the override took effect
    assert declared, f"--set {name} loaded a layout that declares no arg {name}"
    assert dict(layout.args)[name] == value


def _run_cli(text: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory(prefix="layoutlang-fuzz-cli-") as d:
        path = Path(d) / "case.layout"
        path.write_text(text, encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", str(path)])
        return code, out.getvalue() + err.getvalue()


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_cli_on_mutated_seeds(text):
    code, output = _run_cli(text)
    assert code in (0, 1), output
    assert "Traceback" not in output
    expected_ok = check(text) is not None
    assert (code == 0) == expected_ok, output


@pytest.mark.parametrize("seed", SEEDS, ids=["tp_gtp", "pp", "moe", "infer", "v2"])
def test_cli_on_seeds(seed):
    code, output = _run_cli(seed)
    assert code == 0, output
    assert ": ok" in output
