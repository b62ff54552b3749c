"""Golden diagnostics: every broken input renders exactly the message we promise.

Each case is a pair in `tests/diagnostics/`:

    NAME.layout     a broken layout (one mistake each; a comment-free, minimal file)
    NAME.expected   the exact text `layoutc check tests/diagnostics/NAME.layout`
                    prints on stderr, i.e. `LayoutError.render()` plus a newline

Files under `tests/diagnostics/inc/` are helpers that cases include; they are
not cases themselves. Paths are rendered relative to the repository root, so
every test here runs with the repository root as the working directory.

An `.expected` file states what the front end SHOULD print (position, wording,
notes, help), decided from LANGUAGE.md — not whatever it happens to print.

Regenerating: after an intended change of wording, rewrite the goldens with

    REGEN_GOLDEN=1 .venv/bin/pytest tests/test_diagnostics.py

(add `-k NAME` to rewrite only some; the run fails on purpose), then READ
`git diff tests/diagnostics/`:
every changed golden is a changed promise to users. A new case is a new
`NAME.layout`; the regeneration run writes its `NAME.expected` for review.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import layoutlang
from layoutlang import LayoutError
from layoutlang.cli import main

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = Path("tests") / "diagnostics"  # relative to ROOT: rendered paths stay stable
REGEN = bool(os.environ.get("REGEN_GOLDEN"))
HEADER = re.compile(r"^tests/diagnostics/[A-Za-z0-9_/.]+\.layout:\d+:\d+: error: \S")

CASES = sorted(p.stem for p in (ROOT / CASES_DIR).glob("*.layout"))

# A handful also run through the CLI (exit code and stderr).
CLI_CASES = ["syntax_missing_rbracket", "syntax_binary_garbage", "undefined_name",
             "over_plain_indivisible", "include_cycle", "loop_uneven", "duplicate_tensor_name"]


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _layout_path(name: str) -> str:
    return (CASES_DIR / f"{name}.layout").as_posix()


def _expected_path(name: str) -> Path:
    return ROOT / CASES_DIR / f"{name}.expected"


def _read_expected(name: str) -> str:
    path = _expected_path(name)
    if not path.exists():
        pytest.fail(f"{path.name} is missing; run REGEN_GOLDEN=1 pytest {__file__} -k {name}")
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def _render(name: str) -> str:
    with pytest.raises(LayoutError) as info:
        layoutlang.load(_layout_path(name))
    return info.value.render() + "\n"


def test_there_are_enough_cases():
    assert len(CASES) >= 40
    for name in CASES:
        assert (ROOT / CASES_DIR / f"{name}.layout").is_file()


@pytest.mark.parametrize("name", CASES)
def test_golden(name):
    actual = _render(name)
    if REGEN:
        with open(_expected_path(name), "w", encoding="utf-8", newline="") as fh:
            fh.write(actual)
        pytest.fail(f"REGEN_GOLDEN: rewrote {name}.expected; read `git diff tests/diagnostics/`, then rerun "
                    "without REGEN_GOLDEN", pytrace=False)  # a regeneration run is never green
    assert actual == _read_expected(name)


@pytest.mark.parametrize("name", CASES)
def test_error_position_is_inside_the_file(name):
    with pytest.raises(LayoutError) as info:
        layoutlang.load(_layout_path(name))
    err = info.value
    assert err.span is not None, "every diagnostic of a file points into it"
    text = (ROOT / err.span.source.path).read_bytes().decode("utf-8", "replace")
    lines = text.split("\n")
    assert 1 <= err.line <= len(lines)
    assert 1 <= err.col <= len(lines[err.line - 1]) + 1
    assert err.message and "Traceback" not in err.render()


def test_goldens_have_the_header_and_no_traceback():
    for name in CASES:
        text = _read_expected(name)
        assert HEADER.match(text), f"{name}.expected does not start with `path:line:col: error:`"
        assert "Traceback" not in text, name
        assert text.endswith("\n") and not text.endswith("\n\n"), name


def test_no_stray_goldens():
    stray = sorted(p.stem for p in (ROOT / CASES_DIR).glob("*.expected") if p.stem not in CASES)
    assert not stray, f"goldens without a case: {stray}"


def test_whole_golden_set_has_no_traceback(capsys):
    """Through the API and the CLI: only diagnostics, never an escaped Python error."""
    problems, out = [], []
    for name in CASES:
        try:
            layoutlang.load(_layout_path(name))
            problems.append(f"{name}: loads without an error")
        except LayoutError as err:
            out.append(err.render())
        except Exception as exc:  # noqa: BLE001 - the point is to catch anything
            problems.append(f"{name}: load raised {type(exc).__name__}: {str(exc)[:200]}")
        try:
            code = main(["check", _layout_path(name)])
            if code != 1:
                problems.append(f"{name}: `layoutc check` exited {code}, not 1")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{name}: `layoutc check` raised {type(exc).__name__}: {str(exc)[:200]}")
        captured = capsys.readouterr()
        out += [captured.out, captured.err]
    text = "\n".join(out)
    assert not problems, "\n".join(problems)
    assert "Traceback" not in text


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_check_prints_the_golden(name, capsys):
    assert name in CASES
    code = main(["check", _layout_path(name)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert captured.err == _read_expected(name)


def test_cli_check_continues_after_a_broken_file(tmp_path, capsys):
    ok = tmp_path / "ok.layout"
    ok.write_text("mesh m (tp=2)\ntensor w [8 over tp]\n")
    code = main(["check", _layout_path("undefined_name"), str(ok)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err == _read_expected("undefined_name")
    assert f"{ok}: ok" in captured.out


def test_cli_set_unknown_arg_is_a_usage_error(tmp_path, capsys):
    ok = tmp_path / "ok.layout"
    ok.write_text("arg TP = 2\nmesh m (tp=TP)\ntensor w [8 over tp]\n")
    assert main(["check", "--set", "TP=4", str(ok)]) == 0
    capsys.readouterr()
    code = main(["check", "--set", "PP=4", str(ok)])
    captured = capsys.readouterr()
    assert code == 2
    assert "PP" in captured.err and "TP" in captured.err  # names the bad arg and the known ones
    assert "Traceback" not in captured.err


def test_cli_set_of_a_const_is_a_usage_error(tmp_path, capsys):
    ok = tmp_path / "ok.layout"
    ok.write_text("const TP = 2\nmesh m (tp=TP)\ntensor w [8 over tp]\n")
    code = main(["check", "--set", "TP=4", str(ok)])
    captured = capsys.readouterr()
    assert code == 2
    assert "const" in captured.err


@pytest.mark.parametrize("item", ["X", "=4", "TP=", "TP=four", "1TP=4"])
def test_cli_malformed_set_is_a_usage_error(item, tmp_path, capsys):
    ok = tmp_path / "ok.layout"
    ok.write_text("arg TP = 2\nmesh m (tp=TP)\ntensor w [8 over tp]\n")
    code = main(["check", "--set", item, str(ok)])
    captured = capsys.readouterr()
    assert code == 2
    assert "--set" in captured.err and "Traceback" not in captured.err


def test_cli_missing_file_is_a_usage_error(capsys):
    code = main(["check", "tests/diagnostics/no_such_file.layout"])
    captured = capsys.readouterr()
    assert code == 2
    assert "no_such_file.layout" in captured.err and "Traceback" not in captured.err


def test_keywords_are_not_names_anywhere():
    """`for in in ...` is the golden case; the same holds for every reserved word."""
    for word in ("tensor", "over", "at", "pad", "local", "sizes"):
        with pytest.raises(LayoutError) as info:
            layoutlang.loads(f"mesh m (tp=2)\nconst {word} = 4\n")
        assert info.value.line == 2 and info.value.col == 7, word
        assert "reserved" in info.value.message


# ---- a misspelt keyword names the keyword (issue 49) -----------------------------------------------

@pytest.mark.parametrize("text,line,col,found,keyword", [
    ("tensr w [4]\n", 1, 1, "tensr", "tensor"),
    ("mesh m (tp=2)\ntensr w [4 over tp]\n", 2, 1, "tensr", "tensor"),  # `tensor` is past the 8 listed
    ("msh m (tp=2)\n", 1, 1, "msh", "mesh"),
    ("mesh m (tp=2)\nconts H = 4\n", 2, 1, "conts", "const"),
    ("defualt dtype bf16\n", 1, 1, "defualt", "default"),
    ('incldue "a.layout"\n', 1, 1, "incldue", "include"),
    ("mesh m (tp=2)\nfro l in 0..4 {\n}\n", 2, 1, "fro", "for"),
    ("mesh m (tp=2)\ntensor w [8 ovr tp]\n", 2, 13, "ovr", "over"),
    ("mesh m (tp=2)\ntensor w [8 pda 2]\n", 2, 13, "pda", "pad"),
    ("mesh m (tp=2)\ntensor w [8 over tp chnk tp]\n", 2, 21, "chnk", "chunk"),
    ("mesh m (tp=2)\ntensor w [9 over tp ragd]\n", 2, 21, "ragd", "ragged"),
    ("mesh m (tp=2)\nfor l in 0..4 ovr tp {\n}\n", 2, 15, "ovr", "over"),
])
def test_a_misspelt_keyword_gets_did_you_mean(text, line, col, found, keyword):
    with pytest.raises(layoutlang.ParseError) as info:
        layoutlang.loads(text, "t.layout")
    err = info.value
    assert err.message.startswith(f"unexpected `{found}`; expected ")
    assert (err.file, err.line, err.col) == ("t.layout", line, col)
    assert err.help == f"did you mean `{keyword}`?"
    rendered = err.render().splitlines()
    assert rendered[0] == f"t.layout:{line}:{col}: error: {err.message}"
    assert rendered[2] == " " * (len(str(line)) + 4) + " | " + " " * (col - 1) + "^" * len(found)
    assert rendered[-1] == f"help: did you mean `{keyword}`?"


def test_a_misspelt_keyword_read_as_the_dtype_above_is_named():
    """`tensro` after a tensor without a dtype is read as that tensor's dtype: the parser stops at
    the next word, and the help names the misspelt keyword that begins the line."""
    text = "mesh m (tp=2)\ntensor w [4 over tp]\ntensro v [4]\n"
    with pytest.raises(layoutlang.ParseError) as info:
        layoutlang.loads(text, "t.layout")
    err = info.value
    assert (err.line, err.col) == (3, 8)
    assert err.message.startswith("unexpected `v`; expected ")
    assert err.help == "did you mean `tensor` instead of `tensro`?"


@pytest.mark.parametrize("text,help_", [
    ("mesh m (tp=2)\nx [4]\n", None),                                  # a word close to no keyword
    ("mesh m (tp=2)\nlayer w [4]\n", None),
    ("mesh m (tp=2)\ntensor c [8, 4] on m transposed\n", None),        # a keyword in the wrong place
    ("mesh m (tp=2)\ntensor w [8 over tp, 16] bf16 )\n", None),        # not a word
    ("mesh m (tp=2)\ntensor w [8 over tp, 16\ntensor v [16]\n",        # the help it had
     "separate dimensions with `,` and close the list with `]`"),
])
def test_no_keyword_is_suggested_where_none_is_close(text, help_):
    with pytest.raises(layoutlang.ParseError) as info:
        layoutlang.loads(text, "t.layout")
    assert info.value.help == help_


# ---- an error inside a `for` names the iteration it depends on (issue 49) ---------------------------

def _loop_error(text: str) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        layoutlang.loads(text, "t.layout")
    return info.value


def test_an_error_in_a_later_iteration_names_it_at_the_loop():
    err = _loop_error("mesh m (tp=2)\nfor l in 0..32 {\n  tensor layers.{l}.w [64 // (7 - l)]\n}\n")
    assert err.message == "division by zero: `7 - l` is 0"
    assert (err.file, err.line, err.col) == ("t.layout", 3, 31)
    assert [(n.message, n.span.line, n.span.col) for n in err.notes] == [
        ("in iteration l = 7 of `for l in 0..32`", 2, 1)]
    assert err.render().splitlines() == [
        "t.layout:3:31: error: division by zero: `7 - l` is 0",
        "    3 |   tensor layers.{l}.w [64 // (7 - l)]",
        "      |                               ^^^^^",
        "t.layout:2:1: note: in iteration l = 7 of `for l in 0..32`",
        "    2 | for l in 0..32 {",
        "      | ^^^^^^^^^^^^^^",
    ]


def test_the_range_is_shown_evaluated_and_the_first_iteration_is_named_when_it_is_read():
    err = _loop_error("const L = 4\nmesh m (tp=2)\nfor l in 0..L {\n  tensor layers.{l}.w [16 / l]\n}\n")
    assert err.message == "division by zero: `l` is 0" and (err.line, err.col) == (4, 29)
    assert [(n.message, n.span.line, n.span.col) for n in err.notes] == [
        ("in iteration l = 0 of `for l in 0..4`", 3, 1)]


def test_nested_loops_name_each_iteration_the_error_depends_on_inner_first():
    err = _loop_error("mesh m (tp=2)\nfor l in 0..4 {\n  for e in 0..3 {\n"
                      "    tensor layers.{l}.experts.{e}.w [8 / (3 - l - e)]\n  }\n}\n")
    assert err.message == "`8 / (3 - l - e)` is not exact: 8 / 3 leaves remainder 2"
    assert (err.line, err.col) == (4, 38)
    assert [(n.message, n.span.line, n.span.col) for n in err.notes] == [
        ("in iteration e = 0 of `for e in 0..3`", 3, 3), ("in iteration l = 0 of `for l in 0..4`", 2, 1)]
    # an inner range read from the outer variable: the outer iteration is named
    err = _loop_error("mesh m (tp=2)\nfor l in 0..4 {\n  for j in l..2 {\n    tensor a.{l}.{j} [4]\n  }\n}\n")
    assert err.message == "empty range 3..2: the end is before the start" and (err.line, err.col) == (3, 3)
    assert [(n.message, n.span.line) for n in err.notes] == [("in iteration l = 3 of `for l in 0..4`", 2)]
    # the inner loop's values are read, not the outer's: only the inner one is named
    err = _loop_error("mesh m (tp=2)\nfor l in 0..2 {\n  for e in 0..4 {\n    tensor x.{l}.{e} [8 / (2 - e)]\n  }\n}\n")
    assert err.message == "division by zero: `2 - e` is 0"
    assert [(n.message, n.span.line) for n in err.notes] == [("in iteration e = 2 of `for e in 0..4`", 3)]


@pytest.mark.parametrize("text", [
    "mesh m (tp=2)\nfor l in 0..4 {\n  tensor layers.{l}.w [8] bf61\n}\n",            # unknown dtype
    "mesh m (tp=2)\nfor l in 0..4 {\n  tensor w{l} [8] mxfp8\n}\n",                  # the same in every one
    "mesh m (tp=2)\nfor l in 0..4 {\n  const H = 16\n}\n",                           # not allowed in a body
    "mesh m (pp=4)\nfor l in 0..30 over pp {\n  tensor layers.{l.local}.w [16]\n}\n",  # the loop itself
])
def test_an_error_of_every_iteration_names_none(text):
    assert not any("iteration" in n.message for n in _loop_error(text).notes)
