"""The `layoutc` command line: summaries, exit codes, --help on every verb."""

import subprocess
import sys

import pytest

from layoutlang.cli import main

LAYOUT = """layout demo
arg TP = 4
mesh train (dp=2, tp=TP)
tensor w [16 over tp, 8]
tensor b [8] fp32
"""


@pytest.fixture
def demo(tmp_path):
    path = tmp_path / "demo.layout"
    path.write_text(LAYOUT)
    return str(path)


def test_check_prints_summary(demo, capsys):
    assert main(["check", demo]) == 0
    out = capsys.readouterr().out
    assert f"{demo} (demo): ok" in out
    assert "ranks    8" in out
    assert "mesh     train (dp=2, tp=4) ranks 0..7" in out
    assert "tensors  2 instances, 2 keys" in out
    # 4*8*2 + 8*4 = 96 bytes on every rank
    assert "min 96 B (rank 0), max 96 B (rank 0)" in out
    assert "args     TP=4" in out


def test_check_set_overrides_an_arg(demo, capsys):
    assert main(["check", demo, "--set", "TP=2"]) == 0
    assert "ranks    4" in capsys.readouterr().out


@pytest.mark.parametrize("setting, message", [
    ("TQ=2", "--set TQ: the layout has no arg `TQ`"),
    ("TP", "expected NAME=VALUE"),
    ("TP=x", "'x' is not an integer"),
])
def test_check_bad_set_is_usage_error(demo, capsys, setting, message):
    assert main(["check", demo, "--set", setting]) == 2
    assert message in capsys.readouterr().err


def test_check_diagnostic_exit_1(tmp_path, capsys):
    bad = tmp_path / "bad.layout"
    bad.write_text("mesh m (tp=4)\ntensor x [10 over tp]\n")
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:2:11: error: split 10 over tp=4 leaves remainder 2\n")
    assert "help: use `pad 4` or change tp" in err


def test_missing_file_is_usage_error(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.layout")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"], ["fmt", "--help"]])
def test_help_on_every_verb(argv, capsys):
    assert main(argv) == 0
    assert "usage: layoutc" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["check"]) == 2


def test_version_and_console_script():
    result = subprocess.run([sys.executable, "-m", "layoutlang.cli", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("layoutc ")


def test_progress_bars_only_on_a_terminal_outside_ci(monkeypatch):
    import io

    from rich.console import Console

    from layoutlang.cli import _Progress

    monkeypatch.delenv("CI", raising=False)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert _Progress(terminal, quiet=False).bar is not None
    assert _Progress(terminal, quiet=True).bar is None
    assert _Progress(Console(file=io.StringIO()), quiet=False).bar is None  # a pipe
    monkeypatch.setenv("CI", "true")
    assert _Progress(terminal, quiet=False).bar is None
    monkeypatch.delenv("CI")
    with _Progress(terminal, quiet=False) as progress:
        progress("templates", 5, 10)
        progress("templates", 10, 10)
    assert "templates" in terminal.file.getvalue()


def test_plan_is_silent_in_a_pipe(tmp_path, capsys):
    src = tmp_path / "s.layout"
    src.write_text("mesh m (tp=2)\ntensor w [8 over tp]\n")
    dst = tmp_path / "d.layout"
    dst.write_text("mesh m (tp=1) at 2\ntensor w [8]\n")
    assert main(["plan", str(src), str(dst)]) == 0
    assert capsys.readouterr().err == ""
