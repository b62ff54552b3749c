"""The README's main job (scripts/main.sh) runs as written: each of its steps after the setup.

The main job is the first thing a new user runs; no other test runs scripts/checkpoint_demo.py,
and it broke unnoticed once (the rotary q/k rows needed the model's config on save). Each step
runs here as the script runs it (the setup line excepted: the test runs inside the venv it
makes), under one time limit, and must exit 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "main.sh"
TIMEOUT = 300


def _steps() -> list[str]:
    lines = [x.strip() for x in SCRIPT.read_text().splitlines()]
    return [x for x in lines if x.startswith(".venv/bin/")]


def test_the_main_job_has_its_steps():
    steps = _steps()
    assert any("checkpoint_demo.py" in s for s in steps) and any(" run " in s and "--verify" in s for s in steps)


@pytest.mark.parametrize("step", _steps())
def test_each_main_job_step_exits_0(step):
    venv = Path(sys.executable).parent
    if not (ROOT / ".venv" / "bin").exists() or venv.resolve() != (ROOT / ".venv" / "bin").resolve():
        step = step.replace(".venv/bin/", f"{venv}/")  # the venv this test runs in
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(["bash", "-c", step], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:  # past the limit: the step's whole process group goes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, f"{step}\n{out[-3000:]}\n{err[-5000:]}"
