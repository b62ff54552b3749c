"""The pygments lexer: registered for `pygmentize -l layout`, no error tokens on examples."""

import subprocess
from pathlib import Path

import pytest
from pygments.lexers import get_lexer_by_name, get_lexer_for_filename
from pygments.token import Comment, Error, Keyword, Name, Number, String

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted(ROOT.glob("examples/**/*.layout"))


def tokens(text):
    return [(t, v) for t, v in get_lexer_by_name("layout").get_tokens(text) if v.strip()]


def test_lexer_is_registered_by_name_and_filename():
    assert get_lexer_by_name("layout").name == "layout"
    assert get_lexer_for_filename("train.layout").name == "layout"


def test_token_classes():
    toks = tokens("tensor a.{l.local}.w as k.{l} [(q: 4 | k: 2) over tp, H] mxfp8  # c")
    assert (Keyword.Declaration, "tensor") in toks
    assert (String.Interpol, "{") in toks and (Keyword.Pseudo, "local") in toks
    assert (Name.Label, "q") in toks and (Keyword, "over") in toks
    assert (Keyword.Type, "mxfp8") in toks and (Number.Integer, "4") in toks
    assert (Comment.Single, "# c") in toks


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_lex_without_errors(path):
    assert not [v for t, v in tokens(path.read_text()) if t is Error]


def test_pygmentize_cli():
    exe = Path(__import__("sys").executable).parent / "pygmentize"
    out = subprocess.run([str(exe), "-l", "layout", "-f", "html", str(EXAMPLES[0])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '<span class="k' in out.stdout


def test_fmt_diff_is_highlighted_on_a_terminal():
    import io

    from rich.console import Console

    from layoutlang.cli import _highlighted_diff

    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor")
    console.print(_highlighted_diff(["--- a\n", "+++ b\n", "@@ -1 +1 @@\n", "-tensor   w [8]\n", "+tensor w [8]\n"]))
    text = console.file.getvalue()
    assert "\x1b[" in text and "tensor" in text and "\x1b[1;32m+" in text


def test_the_vocabulary_is_highlighted():
    from layoutlang.vocabulary import DTYPES, FUNCTIONS, KEYWORDS

    for word in KEYWORDS:
        if word not in ("tensor", "local", "arg", "const", "mesh"):  # rules of their own, below
            assert (Keyword, word) in tokens(f"x {word} y"), word
    assert (Keyword.Declaration, "tensor") in tokens("tensor w [1]")
    assert (Keyword.Pseudo, "local") in tokens("tensor a.{l.local} [1]")
    assert (Keyword.Declaration, "mesh") in tokens("mesh m (tp=2)")
    for word in DTYPES:
        assert (Keyword.Type, word) in tokens(f"tensor w [1] {word}"), word
    for word in FUNCTIONS:
        assert (Name.Builtin, word) in tokens(f"const x = {word}(4, 2)"), word


def test_v2_words_are_highlighted():
    toks = tokens("tensor w13 [e in 0..E over ep, (gate: I as m.{l}.e.{e}.gate | up: I as m.up{e}), H] bf16 transposed")
    assert (Keyword, "in") in toks and (Keyword, "transposed") in toks
    assert (Keyword, "as") in toks and (Name.Variable, "m.") in toks
    assert (Name.Label, "gate") in toks and (Keyword.Type, "bf16") in toks
    assert not [v for t, v in toks if t is Error]
