"""Hypothesis profiles: random examples on a developer's machine, the same ones in CI.

A property test draws new examples every run, which is how it finds what nobody wrote
down; in CI that also means a run can turn red on an example no earlier run drew, for a
change that did not touch it. `.ci/run` sets LAYOUTLANG_CI=1, which loads the "ci"
profile: examples derived from each test's name (`derandomize`), so CI runs the same
examples every time, and a failure prints the blob that reproduces it. Tests that set
their own `@settings(...)` inherit the profile (it is loaded before they are imported).
HYPOTHESIS_PROFILE=ci (or =dev) picks one explicitly.

Both profiles derive from hypothesis's "default" profile, not from whatever is loaded:
hypothesis itself loads a derandomized "ci" profile when it sees a `CI` variable, and a
profile registered without a parent would inherit that, so a CI machine would run the
developer profile derandomized too.
"""

import importlib.util
import os

from hypothesis import HealthCheck, settings

_BASE = settings.get_profile("default")
# no per-example deadline or too-slow check in CI: on a shared, noisy machine they would be
# timing assertions; no example database either (a clean clone has none to replay)
settings.register_profile("ci", _BASE, derandomize=True, print_blob=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", _BASE, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("LAYOUTLANG_CI") else "dev"))

# --doctest-modules imports every module here; tests/vllm_hosts.py imports vLLM, which only
# .venv-vllm has (tests/test_vllm_clients.py runs it there, as a program's helper)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_hosts.py"]
