"""The Ray deployment of examples/ray/ and the job name's refusals, in one Ray session
(tests/test_ray_jobs.py runs it under .venv's Python).

    ray_jobs_program.py TMP

Starts Ray with its session folder in TMP (`num_cpus=2`; every actor takes 0 CPUs), runs
examples/ray/deploy.py as its `main` runs it, then in the same session, from this driver:

- `missing`: a RayEngineJob for a job name nobody publishes, with a 1 s connect_timeout: its
  error and how long it took;
- `taken`: a second RayTrainerJob (rank 0) under the name of a live one, its error; then the
  first closes and a third takes the name.

Then ray.shutdown() and the session's processes (each names TMP on its command line) must
be gone. Every line printed is JSON; the last is {"ok": true, ...} or the program exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ray"
TIMEOUT = 10.0   # s: the deployment's refit timeout (TrainerJob's `timeout`)


def say(**record) -> None:
    print(json.dumps(record), flush=True)


def ancestors() -> set[int]:
    """This process and the ones above it (whatever started it may name TMP too)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def session_processes(tmp: str) -> list[int]:
    """Live processes of the Ray session in folder `tmp`: its GCS, raylet and workers all name
    the session's folder, which is this run's own, on their command line."""
    pids, mine = [], ancestors()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in mine:
            try:
                if tmp.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def wait_gone(tmp: str, seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := session_processes(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def name_checks() -> None:
    from layoutlang import loads
    from layoutlang.integrations.ray import RayEngineJob, RayTrainerJob
    from layoutlang.runtime import RefitError
    from layoutlang.diagnostics import UsageError

    one = loads("layout one\nmesh m (r=1)\ntensor w [4] fp32", path="<one>")
    began = time.monotonic()
    try:
        RayEngineJob(one, name="nobody-publishes-this", replica="r0", rank=0, world_size=1, connect_timeout=1.0)
        say(missing="no error")
    except RefitError as exc:
        say(missing=str(exc), phase=exc.phase, seconds=round(time.monotonic() - began, 3))
    first = RayTrainerJob(one, one, name="taken-name", rank=0, world_size=1, timeout=5.0)
    try:
        RayTrainerJob(one, one, name="taken-name", rank=0, world_size=1, timeout=5.0)
        say(taken="no error")
    except UsageError as exc:
        say(taken=str(exc))
    first.close()
    began = time.monotonic()
    third = RayTrainerJob(one, one, name="taken-name", rank=0, world_size=1, timeout=5.0)
    say(retaken=True, seconds=round(time.monotonic() - began, 3), node_id=third.node_id, own=third.node_of(0))
    third.close()


def main() -> int:
    tmp = sys.argv[1]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(EXAMPLE))
    import deploy  # noqa: E402  (examples/ray/deploy.py; its actors' classes import it by name)
    import ray

    began = time.monotonic()
    ray.init(num_cpus=2, _temp_dir=tmp, include_dashboard=False, log_to_driver=False)
    say(ray="up", seconds=round(time.monotonic() - began, 3), timeout=TIMEOUT)
    ok = False
    try:
        code = deploy.main(["--timeout", str(TIMEOUT)])
        say(deployed=code, seconds=round(time.monotonic() - began, 3))
        name_checks()
        ok = code == 0
    except Exception:  # noqa: BLE001 - reported, then the session still shuts down
        say(error=traceback.format_exc())
    finally:
        ray.shutdown()
    left = wait_gone(tmp)
    say(ray="down", left=left, seconds=round(time.monotonic() - began, 3))
    say(ok=ok and not left)
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
