"""Golden diagnostics of version-2 matching: a destination key the source lacks (LANGUAGE.md 8.4).

The rule: "A destination key missing in the source is an error that says which
stored tensor declares it and, when a source tensor has a similarly named key or
a fused tensor whose parts have no keys, suggests part keys (`(q: ... as KEY |
...)`)"; issue 10 adds: with the line to edit. It is the message every user
converting HF <-> Megatron <-> vLLM meets first, so it is held to a golden.

Each case is a pair of files in `tests/diagnostics/v2_plan/` (a subfolder: the
single-file cases of tests/test_diagnostics.py do not see them):

    NAME.src.layout, NAME.dst.layout   one mistake: a key of the destination is not in the source
    NAME.expected                      the exact text `layoutc plan NAME.src.layout NAME.dst.layout`
                                       prints on stderr (`PlanError.render()` and a newline)

The `.expected` files were written BY HAND from the rule (not copied from the
compiler): where the compiler prints something else, the case is listed in
REPORTED with what is wrong, as a strict xfail (the marker must go when the
compiler is fixed). Wording-independent checks of the rule follow the goldens.

Regenerating after an intended change of wording:

    REGEN_GOLDEN=1 .venv/bin/pytest tests/test_v2_diagnostics.py

rewrites every golden and FAILS (a regeneration run is never green); then read
`git diff tests/diagnostics/v2_plan/` against the rule above and rerun without it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from layoutlang import LayoutError, compile_plan
from layoutlang.cli import main

ROOT = Path(__file__).resolve().parent.parent
CASES_DIR = Path("tests") / "diagnostics" / "v2_plan"  # relative to ROOT: rendered paths stay stable
REGEN = bool(os.environ.get("REGEN_GOLDEN"))
CASES = sorted(p.name.removesuffix(".src.layout") for p in (ROOT / CASES_DIR).glob("*.src.layout"))

# layoutlang/compiler/match.py `missing_key_error`: cases where it prints something else than the rule, with what is wrong.
REPORTED: dict[str, str] = {}  # none today: layoutlang/compiler/match.py `missing_key_error` follows the rule


def _xfail_if_reported(name: str) -> list:
    reason = REPORTED.get(name)
    return [pytest.mark.xfail(strict=True, reason=f"layoutlang/compiler/match.py: {reason}")] if reason else []


def _reported(names) -> list:
    return [pytest.param(n, id=n, marks=_xfail_if_reported(n)) for n in names]


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _paths(name: str) -> tuple[str, str]:
    return (CASES_DIR / f"{name}.src.layout").as_posix(), (CASES_DIR / f"{name}.dst.layout").as_posix()


def _error(name: str) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        compile_plan(*_paths(name))
    return info.value


def test_the_cases_are_there_and_load():
    assert set(CASES) == {"missing_key_fused_source", "missing_key_fused_parts_without_keys",
                          "missing_key_similar_name", "missing_key_stacked_experts"}
    stray = sorted(p.name for p in (ROOT / CASES_DIR).iterdir()
                   if not any(p.name == f"{n}{ext}" for n in CASES for ext in (".src.layout", ".dst.layout",
                                                                                ".expected")))
    assert not stray, f"files without a case: {stray}"
    for name in CASES:  # each side is a valid layout: the mistake is in the PAIR
        for path in _paths(name):
            assert main(["check", path]) == 0, path


@pytest.mark.parametrize("name", _reported(CASES))
def test_golden(name):
    actual = _error(name).render() + "\n"
    path = ROOT / CASES_DIR / f"{name}.expected"
    if REGEN:
        path.write_text(actual, encoding="utf-8")
        pytest.fail(f"REGEN_GOLDEN: rewrote {path.relative_to(ROOT)}; read `git diff` against LANGUAGE.md 8.4, "
                    "then rerun without REGEN_GOLDEN", pytrace=False)
    assert actual == path.read_text(encoding="utf-8")


def test_goldens_are_diagnostics():
    for name in CASES:
        text = (ROOT / CASES_DIR / f"{name}.expected").read_text(encoding="utf-8")
        dst = _paths(name)[1]
        assert text.startswith(f"{dst}:2:1: error: key `"), name  # at the destination's declaration
        assert "is not in the source layout" in text.splitlines()[0], name
        assert "\nhelp: " in text and text.endswith("\n") and not text.endswith("\n\n"), name
        assert "Traceback" not in text


@pytest.mark.parametrize("name", CASES)
def test_cli_prints_the_same_diagnostic(name, capsys):
    """`layoutc plan` exits 1 and prints exactly what the API renders (whatever the wording)."""
    code = main(["plan", *_paths(name)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err == _error(name).render() + "\n"


# ---------------------------------------------------------------------------
# The rule, wording aside: where each required piece of information must be

# (case, the destination line declaring the key, the stored tensor declaring it)
DECLARED = [
    ("missing_key_fused_source", 2, "q"),
    ("missing_key_fused_parts_without_keys", 2, "model.layers.0.self_attn.q_proj.weight"),
    ("missing_key_similar_name", 2, "model.layers.0.self_attn.qkv_proj.weight"),
    ("missing_key_stacked_experts", 2, "model.layers.0.mlp.experts.w2_weight"),
]
# (case, file and line to edit: the fused tensor whose parts need keys)
TO_EDIT = [
    ("missing_key_fused_source", "src", 2),
    ("missing_key_fused_parts_without_keys", "src", 2),
    ("missing_key_similar_name", "dst", 2),
]
PART_KEY_FORM = re.compile(r"\(\w+: [^|`]* as [^|`]*\|")  # `(q: ... as KEY | ...`


@pytest.mark.parametrize("name,line,stored", DECLARED, ids=[c[0] for c in DECLARED])
def test_the_error_says_which_stored_tensor_declares_the_key(name, line, stored):
    err = _error(name)
    assert (err.span.source.path, err.span.line, err.span.col) == (_paths(name)[1], line, 1)
    said = [err.message] + [n.message for n in err.notes if n.span is None or n.span.line == line]
    caret_line = err.span.source.line_text(line)
    assert any(f"`{stored}`" in s for s in said) or caret_line.startswith(f"tensor {stored} "), said


@pytest.mark.parametrize("name,side,line", [pytest.param(*c, id=c[0], marks=_xfail_if_reported(c[0]))
                                            for c in TO_EDIT])
def test_part_keys_are_suggested_at_the_line_to_edit(name, side, line):
    err = _error(name)
    path = _paths(name)[0 if side == "src" else 1]
    pointed = [(err.span.source.path, err.span.line)] + [(n.span.source.path, n.span.line) for n in err.notes
                                                         if n.span is not None]
    assert (path, line) in pointed, pointed
    assert PART_KEY_FORM.search(err.help or ""), err.help


@pytest.mark.parametrize("name", _reported(["missing_key_fused_parts_without_keys", "missing_key_similar_name"]))
def test_a_similar_key_is_not_offered_as_the_fix_when_parts_lack_keys(name):
    """`did you mean KEY? give the tensor the source's key with as KEY` is the message issue 10
    calls misleading: renaming to another weight's key can only fail next on its shape."""
    err = _error(name)
    assert "did you mean" not in (err.help or ""), err.help


@pytest.mark.parametrize("name", _reported(["missing_key_stacked_experts"]))
def test_a_stacked_key_is_spoken_of_as_a_stack_not_a_part(name):
    err = _error(name)
    assert "part" not in (err.help or ""), err.help
    assert "{e}" in (err.help or "") or any("e = 0" in n.message for n in err.notes), (err.help, err.notes)
