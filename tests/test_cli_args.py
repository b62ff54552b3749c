"""Args of a pair: `--set` reaches both layouts (and says which took it), `--set-src`/`--set-dst` one.

Expected values come from the layouts: llama3_8b_train declares TP (8), GTP, DP;
llama3_8b_infer declares TP (2), DP, AT.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.diagnostics import UsageError

EX = Path(__file__).parent.parent / "examples"
TRAIN, INFER = str(EX / "llama3_8b_train.layout"), str(EX / "llama3_8b_infer.layout")


def _layoutc(*argv):
    return subprocess.run([sys.executable, "-m", "layoutlang.cli", *argv], capture_output=True, text=True,
                          timeout=120)


def test_set_src_changes_only_the_source():
    plan = compile_plan(TRAIN, INFER, src_args={"TP": 4})
    assert dict(plan.src.args)["TP"] == 4 and dict(plan.dst.args)["TP"] == 2
    plan = compile_plan(TRAIN, INFER, dst_args={"TP": 4})
    assert dict(plan.src.args)["TP"] == 8 and dict(plan.dst.args)["TP"] == 4


def test_a_side_arg_the_side_does_not_declare_is_an_error():
    with pytest.raises(UsageError) as info:
        compile_plan(TRAIN, INFER, dst_args={"GTP": 4})
    assert info.value.render() == ("error: --set-dst GTP: " + INFER + " has no arg `GTP`\n"
                                   "help: its args: TP, DP, AT")


def test_plain_set_says_which_layouts_took_it():
    proc = _layoutc("plan", TRAIN, INFER, "--set", "TP=4", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert (f"note: --set TP=4 applies to both layouts; taken by {TRAIN} and {INFER}"
            in proc.stderr.splitlines())
    assert json.loads(proc.stdout)["dst"]["args"]["TP"] == 4
    proc = _layoutc("plan", TRAIN, INFER, "--set", "GTP=1")
    assert (f"note: --set GTP=1 applies to both layouts; taken by {TRAIN} (use --set-src / --set-dst for "
            "one side)") in proc.stderr.splitlines()


def test_set_src_on_the_command_line_keeps_the_engine():
    both = _layoutc("plan", TRAIN, INFER, "--set", "TP=4", "--format", "json")
    src_only = _layoutc("plan", TRAIN, INFER, "--set-src", "TP=4", "--format", "json")
    assert both.returncode == src_only.returncode == 0
    assert "note:" not in src_only.stderr
    # the engine at TP=2 x DP=2 holds ranks 0..3; at TP=4 it would hold 0..7
    assert json.loads(src_only.stdout)["dst"]["args"] == {"TP": 2, "DP": 2, "AT": 0}
    assert json.loads(src_only.stdout)["dst"]["ranks"] == [0, 1, 2, 3]
    assert json.loads(src_only.stdout)["src"]["args"]["TP"] == 4
    assert json.loads(both.stdout)["dst"]["ranks"] == list(range(8))
