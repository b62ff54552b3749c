"""A warm parent for local refit workers: torch imported once, each worker forked from it.

A worker spends most of its start-up importing torch (about 1.3 s of CPU per
process; 8 workers on 2 cores take longer to start than to refit a small
model). `launch.py` starts this process once per launcher (`python -m
layoutlang.runtime.zygote`), and for each worker writes one request line, JSON:
`{"argv": [JOB, OUT], "env": {...}, "cwd": DIR, "stderr": PATH}` (and
`"program": FILE` for a program of the launcher's caller). The zygote forks;
the child starts a session of its own, points stdin and stdout at /dev/null
and stderr at PATH, takes `env` as its whole environment and DIR as its working
folder, and runs `worker.main(JOB, OUT)` as `python -m layoutlang.runtime.worker
JOB OUT` would (or FILE as `python FILE JOB OUT` would: its folder first on
`sys.path`, run as `__main__`; what it imports beyond torch it imports itself). The zygote
answers `{"pid": PID}` for each request, in order, and `{"exit": PID, "code": C}`
when a child ends (C as `subprocess` reports it: negative for a signal).

It stays single-threaded (a fork copies only the calling thread, so no lock can
be held by a thread that does not exist in the child), holds no process group,
and dies with the launcher (the parent-death signal, and end of its stdin), its
children with it (worker.py arms theirs against the zygote). Requests are data:
JSON only, and the launcher is the only writer (its pipe).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def _child(request: dict) -> None:
    """In the forked child: become the worker the request describes; never returns."""
    code = 1
    try:
        os.setsid()
        null_in, null_out = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null_in, 0)
        os.dup2(null_out, 1)
        os.dup2(err, 2)
        for fd in (null_in, null_out, err):
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        program = request.get("program")
        if program is None:
            sys.argv = ["layoutlang.runtime.worker", *request["argv"]]
            from . import worker

            result = worker.main(*request["argv"])
            code = result if isinstance(result, int) else 0
        else:  # as `python PROGRAM ARGV...` runs it: its folder first on the path, as __main__
            import runpy

            sys.argv = [program, *request["argv"]]
            sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
            runpy.run_path(program, run_name="__main__")
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's own crash: its traceback, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _answer(line: dict) -> None:
    os.write(1, (json.dumps(line) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _die_with_launcher() -> None:
    """The parent-death signal (Linux); elsewhere the end of stdin is the sign. No watcher thread:
    the zygote forks, and stays single-threaded."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != int(os.environ.get("LAYOUTLANG_LAUNCHER_PID", os.getppid())):
        os._exit(1)  # the launcher died before the signal was armed


def main() -> int:
    _die_with_launcher()
    from . import worker  # noqa: F401 - what every worker imports (torch): the point of this process
    import torch.distributed  # noqa: F401

    buffered = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the launcher closed its end: no more workers
                return 0
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for raw in lines:
                if not raw.strip():
                    continue
                request = json.loads(raw)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                _answer({"pid": pid})
        _reap()


if __name__ == "__main__":
    sys.exit(main())
