"""Local multi-process refits on gloo: spawn, time out, clean up.

Used by `layoutc run`, the multi-process tests and the gloo benchmark. A job
is plain JSON (no pickle): each worker (`python -m layoutlang.runtime.worker`)
reads it, joins a gloo group on 127.0.0.1 at a free port, compiles the same
plan (a pure function of the two layouts), refits, checks every destination
element, and writes its result as JSON. Workers die with the launcher
(worker.py arms a parent-death signal), so a killed `layoutc run` leaves
nothing behind.

Refit workers are forked from a zygote (layoutlang/runtime/zygote.py) that imported torch
once for the launcher's lifetime: a worker then starts in milliseconds instead
of the ~1.3 s of CPU its imports cost. Each is still its own process with its own
session, environment, stderr file and exit code, killed at the deadline as
before; a `program` is run the same way (`python PROGRAM` semantics, torch
already imported). `LAYOUTLANG_LAUNCH=spawn` starts each as a fresh
interpreter (the fallback too, if the zygote cannot serve).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
        zygote = _zygote()
        for rank in range(nproc):
            worker_env = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              RANK=str(rank), WORLD_SIZE=str(nproc), OMP_NUM_THREADS="1",
                              LAYOUTLANG_LAUNCHER_PID=str(os.getpid()),
                              GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            argv = [str(job_path), str(Path(tmp) / f"out{rank}.json")]
            err_path = Path(tmp) / f"stderr{rank}.txt"
            forked = zygote.start(argv, worker_env, str(err_path), program) if zygote is not None else None
            if forked is not None:
                procs.append((forked, None))
                continue
            err = open(err_path, "w")
            procs.append((subprocess.Popen(
                [sys.executable, *(["-m", "layoutlang.runtime.worker"] if program is None else [program]),
                 *argv], env=worker_env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True), err))
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
                if err is not None:
                    err.close()
        results = []
        for rank in range(nproc):
            out = Path(tmp) / f"out{rank}.json"
            data = json.loads(out.read_text()) if out.exists() else None
            results.append(WorkerResult(rank, codes[rank], data, (Path(tmp) / f"stderr{rank}.txt").read_text()))
        return results


# ---- the zygote: workers forked from a process that imported torch once ----------------------

class _Forked:
    """A worker the zygote forked: what `launch` asks of a Popen (pid, poll, wait)."""

    def __init__(self, zygote: "_Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float = 10.0) -> int | None:
        """Its exit code once the zygote reaped it (after a SIGKILL: promptly); None if the zygote
        itself is gone (then so is the worker: it dies with its parent)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None or not self.zygote.alive():
                return code
            time.sleep(0.01)
        return None


class _Zygote:
    """The launcher's end of layoutlang/runtime/zygote.py: requests written, answers read by one thread."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", LAYOUTLANG_LAUNCHER_PID=str(os.getpid()))
        self.proc = _in_kept_thread(lambda: subprocess.Popen(
            [sys.executable, "-m", "layoutlang.runtime.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env))
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = json.loads(raw)
            with self.changed:
                if "pid" in line:  # a reused pid's old exit was reported (and reaped) before this fork
                    self.exits.pop(line["pid"], None)
                    self.pids.append(line["pid"])
                else:
                    self.exits[line["exit"]] = line["code"]
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            return self.exits.get(pid)

    def start(self, argv: list[str], env: dict, stderr: str, program: str | None = None) -> _Forked | None:
        """A forked worker (or `program`), or None if the zygote cannot serve (the caller spawns)."""
        env = dict(env, LAYOUTLANG_LAUNCHER_PID=str(self.proc.pid))  # the worker's parent is the zygote
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stderr": stderr}
        if program is not None:
            request["program"] = os.path.abspath(program)
        line = (json.dumps(request) + "\n").encode()
        with self.lock:
            with self.changed:
                before = len(self.pids)
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                return None
            with self.changed:
                self.changed.wait_for(lambda: len(self.pids) > before or not self.alive(), timeout=60)
                if len(self.pids) <= before:
                    return None
                return _Forked(self, self.pids[before])


_ZYGOTE: _Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()
_KEPT: list = []   # [the queue of the thread that starts zygotes], once started


def _in_kept_thread(make):
    """`make()` run in one thread of this process that never exits, its result (or its exception).

    Why: the zygote arms Linux's parent-death signal, which fires when the THREAD that started
    it exits, not the process. A `launch` from a short-lived thread (a ThreadPoolExecutor's)
    would lose the zygote as that thread ends, and a launch racing its death could wait for an
    answer that never comes. Called under _ZYGOTE_LOCK (`_zygote`)."""
    if not _KEPT:
        requests: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            while True:
                job, box, done = requests.get()
                try:
                    box.append((True, job()))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    box.append((False, exc))
                done.set()

        threading.Thread(target=serve, daemon=True, name="zygote-starter").start()
        _KEPT.append(requests)
    box, done = [], threading.Event()
    _KEPT[0].put((make, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _zygote() -> _Zygote | None:
    """This launcher's zygote (started on first use; again if it died), or None to spawn."""
    global _ZYGOTE
    if os.environ.get("LAYOUTLANG_LAUNCH", "zygote") == "spawn" or not hasattr(os, "fork"):
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None or not _ZYGOTE.alive():
            try:
                _ZYGOTE = _Zygote()
            except OSError:
                return None
        return _ZYGOTE
