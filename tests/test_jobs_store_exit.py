"""The trainer's rank 0 hosts the jobs' store and may leave as soon as its `close` returns
(issue 26): in 50 of 50 fresh deployments (a 2-rank trainer, one 2-rank replica), rank 0
refits, closes and `os._exit`s at once, and every engine rank's last `receive` returned
the refit's version with every element exact (examples/jobs/weights.py checks them from
the engine's layout alone). tests/jobs_exit_program.py runs the roles; each round forks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("jobs_exit_program.py")
ROUNDS = 50


@pytest.mark.timeout(300)
def test_store_host_leaves_right_after_close(tmp_path):
    roles = [("trainer", 0), ("trainer", 1), ("engine", 0), ("engine", 1)]
    procs = [subprocess.Popen([sys.executable, str(PROGRAM), role, str(rank), str(ROUNDS), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for role, rank in roles]
    try:
        for p in procs:
            _, err = p.communicate(timeout=280)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            p.kill()
    failed = []
    for k in range(1, ROUNDS + 1):
        at = tmp_path / str(k)
        crashes = sorted(at.glob("*-crash.json"))
        if crashes:
            failed.append((k, [json.loads(c.read_text()) for c in crashes]))
            continue
        trainer = json.loads((at / "trainer.json").read_text())
        if trainer != {"replicas": ["r0"], "missed": []}:
            failed.append((k, trainer))
        for rank in range(2):
            row = json.loads((at / f"engine-{rank}.json").read_text())
            if row != {"version": 10 + k, "problems": []}:
                failed.append((k, rank, row))
    assert not failed, f"{len(failed)} of {ROUNDS} rounds failed: {failed[:3]}"
