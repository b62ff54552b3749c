"""Hypothesis profiles: random examples on a developer's machine, the same ones in CI.

A property test draws new examples every run, which is how it finds what nobody wrote
down; in CI that also means a run can turn red on an example no earlier run drew, for a
change that did not touch it. `.ci/run` sets LAYOUTLANG_CI=1, which loads the "ci"
profile: examples derived from each test's name (`derandomize`), so CI runs the same
examples every time, and a failure prints the blob that reproduces it. Tests that set
their own `@settings(...)` inherit the profile (it is loaded before they are imported).
HYPOTHESIS_PROFILE=ci (or =dev) picks one explicitly.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("LAYOUTLANG_CI") else "dev"))
