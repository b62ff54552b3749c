"""Several programs at once, each printing JSON lines, under one deadline (test_vllm.py, test_sglang.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

import pytest


def run_all(python, program, commands: list[list[str]], *, env: dict, cwd, timeout: float) -> list[list[dict]]:
    """Start `python program *command` for every command at once (each its own process group,
    its output to a file of its own: a pipe read one process after another would fill up and
    block a chatty program), wait for all under one deadline, and return each one's JSON
    lines; any that fails, times out or whose last line is not {"ok": true, ...} fails the
    test with every program's output. Every process is killed on the way out."""
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [subprocess.Popen([str(python), str(program), *c], stdout=log, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=cwd, start_new_session=True) for c, log in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p, c, log in zip(procs, commands, logs):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            log.seek(0)
            out = log.read()
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if not (p.returncode == 0 and lines and lines[-1].get("ok") is True):
                others = []
                for q, d, other in zip(procs, commands, logs):
                    if other is not log:
                        other.seek(0)
                        others.append(f"--- {' '.join(d)} (exit {q.poll()}):\n{other.read()[-3000:]}")
                pytest.fail(f"{' '.join(c)} exited {p.returncode} (None: still running after {timeout} s):\n"
                            f"{out[-5000:]}\n" + "\n".join(others))
            outs.append(lines)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    return outs
