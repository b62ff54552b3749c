"""CI draws the same hypothesis examples every run; a developer's machine draws new ones.

tests/conftest.py loads the "ci" profile when LAYOUTLANG_CI is set (.ci/run sets it). Each
run here is a fresh process that loads that conftest and draws 8 integers with a settings
object of its own, as the property tests do.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import sys
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401 - loads the profile, as pytest does before any test module
from hypothesis import given, settings, strategies as st
seen = []

@settings(max_examples=8, deadline=None, database=None)
@given(st.integers())
def draw(x):
    seen.append(x)

draw()
print(seen)
"""


def _draws(env: dict) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("LAYOUTLANG_CI", "HYPOTHESIS_PROFILE", "CI")}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(Path(__file__).parent)], env={**clean, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-1000:]
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_ci_draws_the_same_examples_and_a_developer_new_ones():
    assert _draws({"LAYOUTLANG_CI": "1"}) == _draws({"LAYOUTLANG_CI": "1"})
    assert _draws({"HYPOTHESIS_PROFILE": "ci"}) == _draws({"LAYOUTLANG_CI": "1"})
    assert _draws({}) != _draws({})  # 8 random integers twice: equal by chance ~never
    # a CI machine's `CI` variable makes hypothesis load its own derandomized profile;
    # the developer profile must not inherit it, and LAYOUTLANG_CI still means the same draws
    assert _draws({"CI": "true"}) != _draws({"CI": "true"})
    assert _draws({"CI": "true", "LAYOUTLANG_CI": "1"}) == _draws({"LAYOUTLANG_CI": "1"})
