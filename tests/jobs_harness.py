"""Separately launched jobs on this machine: a trainer job and engine replicas, each its own
process tree and torchrun-style world (its own MASTER_PORT), meeting only at the refit's store.

The programs are the shipped examples (examples/jobs/trainer.py, engine.py). Every process
dies with the test (a parent-death signal) and `close` kills whatever is left, so no test
can leave a job behind or hang on one.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from layoutlang.runtime.jobs import NAMESPACE, _Store
from layoutlang.runtime.jobwait import current_waits
from layoutlang.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "jobs"


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Jobs:
    """The jobs of one test: start them, drive the trainer's steps, read what each rank wrote."""

    def __init__(self, tmp: Path, *, timeout: float):
        self.tmp, self.timeout = tmp, timeout
        self.out, self.gates = tmp / "out", tmp / "gates"
        self.out.mkdir()
        self.gates.mkdir()
        self.address = f"127.0.0.1:{free_port()}"
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.launches: dict[str, int] = {}  # replica id -> how many times it was started
        self._store = None

    def _start(self, name: str, program: Path, world: int, args: list[str]) -> list[subprocess.Popen]:
        port = free_port()
        self.launches[name] = self.launches.get(name, 0) + 1
        out = self.out if name == "trainer" else self.out / f"{name}.{self.launches[name]}"
        out.mkdir(exist_ok=True)
        started = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
            log = open(self.tmp / f"{name}-{rank}-{len(self.procs)}.log", "w")
            p = subprocess.Popen([sys.executable, str(program), "--address", self.address, "--out", str(out),
                                  "--timeout", str(self.timeout), *args], env=env, stdout=log,
                                 stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, cwd=ROOT)
            self.procs[(name, rank)] = p
            started.append(p)
        return started

    def trainer(self, world: int, *args: str) -> list[subprocess.Popen]:
        return self._start("trainer", EXAMPLES / "trainer.py", world, ["--gate", str(self.gates), *args])

    def replica(self, rid: str, world: int, *args: str) -> list[subprocess.Popen]:
        return self._start(rid, EXAMPLES / "engine.py", world, ["--replica", rid, *args])

    def store(self):
        if self._store is None:
            host, port = self.address.rsplit(":", 1)
            self._store = dist.PrefixStore(NAMESPACE, dist.TCPStore(host, int(port), None, False,
                                                                    timedelta(seconds=60)))
        return self._store

    def wait_waiting(self, replicas: dict[str, int], within: float = 90.0) -> None:
        """Until every rank of these replicas waits in `receive` (what makes them members)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            kv = _Store(self.store(), "")
            if all(current_waits(kv, rid, n) is not None for rid, n in replicas.items()):
                return  # (a wait a dead rank left behind does not count: layoutlang/runtime/jobwait.py)
            time.sleep(0.05)
        raise AssertionError(f"replicas {sorted(replicas)} did not all wait within {within} s: {self.logs()}")

    def step(self, n: int) -> None:
        (self.gates / f"refit-{n}").touch()

    def report(self, n: int, within: float = 60.0) -> dict:
        path = self.out / f"trainer-report-{n}.json"
        deadline = time.monotonic() + within
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert path.exists(), f"no trainer report for refit {n}: {self.logs()}"
        return json.loads(path.read_text())  # (whole: the trainer renames it into place)

    def lines(self, rid: str, rank: int, count: int, within: float = 60.0) -> list[dict]:
        """The first `count` receives of a replica's rank in its latest launch (waiting for them)."""
        path = self.out / f"{rid}.{self.launches[rid]}" / f"engine-{rid}-{rank}.jsonl"
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            text = path.read_text() if path.exists() else ""
            # whole lines only: the engine may be mid-way through writing the last one
            rows = [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines()]
            if len(rows) >= count:
                return rows
            time.sleep(0.02)
        raise AssertionError(f"replica {rid} rank {rank} wrote fewer than {count} receives: {self.logs()}")

    def trainer_errors(self, world: int, n: int, within: float = 60.0) -> dict[int, dict]:
        deadline = time.monotonic() + within
        paths = {r: self.out / f"trainer-{r}-error-{n}.json" for r in range(world)}
        while time.monotonic() < deadline and not all(p.exists() for p in paths.values()):
            time.sleep(0.02)
        return {r: json.loads(p.read_text()) for r, p in paths.items() if p.exists()}

    def kill(self, rid: str, rank: int) -> None:
        p = self.procs[(rid, rank)]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)

    def logs(self) -> str:
        tails = []
        for path in sorted(self.tmp.glob("*.log")):
            text = path.read_text(errors="replace").strip().splitlines()[-4:]
            tails.append(f"\n--- {path.name}: " + " | ".join(text))
        return "".join(tails)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
