"""Local multi-process refits on gloo: spawn, time out, clean up.

Used by `layoutc run`, the multi-process tests and the gloo benchmark. A job
is plain JSON (no pickle): each worker (`python -m layoutlang.runtime.worker`)
reads it, joins a gloo group on 127.0.0.1 at a free port, compiles the same
plan (a pure function of the two layouts), refits, checks every destination
element, and writes its result as JSON. Workers die with the launcher
(worker.py arms a parent-death signal), so a killed `layoutc run` leaves
nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


MAX_PROCESSES = 64  # local workers `layoutc run` starts without --max-nproc (each imports torch: ~300 MB)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerResult:
    rank: int
    returncode: int | None      # None: killed at the deadline
    result: dict | None         # what the worker reported, if it got that far
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.result) and self.result.get("ok", False)

    @property
    def error(self) -> str | None:
        if self.result and self.result.get("error"):
            return self.result["error"]
        if self.returncode != 0:
            tail = self.stderr.strip().splitlines()[-3:]
            return f"exit code {self.returncode}: " + " | ".join(tail)
        return None


def launch(job: dict, nproc: int, *, timeout: float = 120.0, env: dict | None = None,
           program: str | None = None) -> list[WorkerResult]:
    """Run `job` on `nproc` local gloo workers; every worker is gone when this returns.

    `program`: a Python file to run instead of the refit worker (tests of the
    framework bridges), called as `python PROGRAM JOB.json OUT.json` with the
    same environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE); it writes its result
    as JSON to OUT.json (`{"ok": true, ...}`).
    """
    with tempfile.TemporaryDirectory(prefix="layoutlang-") as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        port = free_port()
        procs = []
        for rank in range(nproc):
            worker_env = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              RANK=str(rank), WORLD_SIZE=str(nproc), OMP_NUM_THREADS="1",
                              LAYOUTLANG_LAUNCHER_PID=str(os.getpid()),
                              GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            err = open(Path(tmp) / f"stderr{rank}.txt", "w")
            procs.append((subprocess.Popen(
                [sys.executable, *(["-m", "layoutlang.runtime.worker"] if program is None else [program]),
                 str(job_path), str(Path(tmp) / f"out{rank}.json")],
                env=worker_env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True), err))
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * nproc
        try:
            while time.monotonic() < deadline and any(c is None for c in codes):
                for i, (p, _) in enumerate(procs):
                    if codes[i] is None:
                        codes[i] = p.poll()
                time.sleep(0.05)
        finally:
            for i, (p, err) in enumerate(procs):
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
                    codes[i] = None
                err.close()
        results = []
        for rank in range(nproc):
            out = Path(tmp) / f"out{rank}.json"
            data = json.loads(out.read_text()) if out.exists() else None
            results.append(WorkerResult(rank, codes[rank], data, (Path(tmp) / f"stderr{rank}.txt").read_text()))
        return results
