"""Local gloo workers for the benchmarks that run one job on several processes.

`launch` starts `world` copies of a worker program (argv: the job's JSON file, the rank's
output file) with torchrun's environment on 127.0.0.1, waits for them up to a timeout,
and leaves none behind: each worker is its own process group that dies with its parent
(PR_SET_PDEATHSIG), a stuck one first dumps its Python stacks (SIGUSR1: the workers
register faulthandler), then the group is killed. `Terminated` / `on_sigterm` turn a
SIGTERM of the benchmark into an exception, so its `finally` blocks still clean up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from refit_gloo import _free_port


def _die_with_parent() -> None:
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Terminated(Exception):
    """The benchmark got SIGTERM (`on_sigterm`)."""


def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Terminated()


def launch(worker: Path, job: dict, world: int, tmp: Path, timeout: float,
           tail: int = 8) -> tuple[list[dict | None], list[str], bool]:
    """Run the job on `world` local workers; (results, the last `tail` lines of each stderr,
    timed out). No worker outlives it."""
    job_path = tmp / "job.json"
    job_path.write_text(json.dumps(job))
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                       GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            err = open(tmp / f"stderr{rank}.txt", "w")
            procs.append((subprocess.Popen([sys.executable, str(worker), str(job_path), str(tmp / f"out{rank}.json")],
                                           env=env, stdout=subprocess.DEVNULL, stderr=err,
                                           preexec_fn=_die_with_parent), err))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(2.0)  # a rank failed: give the others a moment to write what they have
                break
            time.sleep(0.1)
        timed_out = any(p.poll() is None for p, _ in procs)
        if timed_out:  # every live worker's Python stacks into its stderr, then they go
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
    finally:
        for p, err in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            err.close()
    results, errs = [], []
    for rank in range(world):
        out = tmp / f"out{rank}.json"
        results.append(json.loads(out.read_text()) if out.exists() else None)
        errs.append("\n".join((tmp / f"stderr{rank}.txt").read_text().strip().splitlines()[-tail:]))
    return results, errs, timed_out
