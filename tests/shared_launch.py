"""Several refit jobs in one launch: the same gloo workers run them one after another.

Starting a worker costs more than most refits it runs (each process imports torch), so
tests of the runtime (test_runtime.py, test_runtime_families.py, test_runtime_faults.py)
share one launch between cases that need the same number of ranks. `launch_cases` runs
this file as the launch's program (`python shared_launch.py JOB.json OUT.json`); every
rank runs each case's job exactly as `python -m layoutlang.runtime.worker` would
(`layoutlang.runtime.worker.run`: a fresh Refitter, the job's sources filled, every
destination element checked), in the default process group, and records each case's
result under its name.

Between cases every rank posts its verdict to the default store and reads every other
rank's (not a collective: a failed case may leave transfers that a collective could
meet): if some rank failed a case, every rank stops there, unless the case is expected
to fail (`may_fail`), so a case never runs in a group a fault has left behind. The
launcher side maps each case back to a list of `WorkerResult`s, one per rank, as a
launch of that job alone returns them; a case the launch did not reach is `None`, and
`results_for` then launches it alone (a failure elsewhere costs time, never a verdict).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

VERDICT_TIMEOUT = 90  # seconds a rank waits for the others' verdicts on a case


def launch_cases(cases: list[tuple[str, dict]], nproc: int, *, timeout: float,
                 may_fail: tuple[str, ...] = ()) -> dict[str, list | None]:
    """Run `cases` ((name, job), in order) in one launch of `nproc` workers: name -> its results
    (a list of WorkerResult, by rank), or None where the launch stopped before that case."""
    from layoutlang.runtime.launch import WorkerResult, launch

    names = [name for name, _ in cases]
    assert len(set(names)) == len(names), names
    job = {"cases": [{"name": name, "job": case, "may_fail": name in may_fail} for name, case in cases]}
    ranks = launch(job, nproc, timeout=timeout, program=__file__)
    out: dict[str, list | None] = {}
    for i, name in enumerate(names):
        reports = [(r.result or {}).get("cases", {}) for r in ranks]
        if not all(name in rep for rep in reports):
            out[name] = None
            continue
        results = []
        for r, rep in zip(ranks, reports):
            last = (r.result or {}).get("last") == name
            # a rank that went on to the next case exited this one as the worker would have; the last
            # case a rank ran carries the process's own exit code (a crash, a fault's exit, a clean end)
            code = r.returncode if last else (0 if rep[name].get("ok") else 1)
            results.append(WorkerResult(r.rank, code, rep[name], r.stderr))
        out[name] = results
    return out


class SharedLaunches:
    """Lazily launched batches: `results_for(name)` runs the batch holding `name` once (only the
    cases of it that this pytest session selected), and falls back to a launch of that case alone
    when the batch did not reach it."""

    def __init__(self, batches: dict[str, tuple[int, list[tuple[str, dict]]]], selected: set[str], *,
                 timeout_per_case: float, alone_timeout: float, may_fail: tuple[str, ...] = ()):
        self.batches = batches  # batch id -> (nproc, [(case name, job)])
        self.selected = selected
        self.timeout_per_case = timeout_per_case
        self.alone_timeout = alone_timeout
        self.may_fail = may_fail
        self.results: dict[str, list | None] = {}
        self.where: dict[str, str] = {}  # case -> which launch it ran in (for failure messages)

    def _batch_of(self, name: str):
        for nproc, cases in self.batches.values():
            if any(n == name for n, _ in cases):
                return nproc, cases
        raise KeyError(name)

    def results_for(self, name: str) -> list:
        from layoutlang.runtime.launch import launch

        nproc, cases = self._batch_of(name)
        if name not in self.results:
            chosen = [(n, job) for n, job in cases if n in self.selected or n == name]
            chosen = [(n, job) for n, job in chosen if n not in self.results]
            if len(chosen) > 1:
                got = launch_cases(chosen, nproc, timeout=self.alone_timeout + self.timeout_per_case * (len(chosen) - 1),
                                   may_fail=self.may_fail)
                together = ", ".join(n for n, _ in chosen)
                for n, res in got.items():
                    self.results[n] = res
                    self.where[n] = f"in one launch of {nproc} ranks with: {together}"
        if self.results.get(name) is None:  # alone, or not reached by its batch
            self.results[name] = launch(dict(cases)[name], nproc, timeout=self.alone_timeout)
            self.where[name] = f"in a launch of its own ({nproc} ranks)"
        return self.results[name]


def selected_params(request, function: str) -> set[str]:
    """The param ids of `function` that this session collected (a -k or a node id may select some)."""
    prefix = function + "["
    return {item.name[len(prefix):-1] for item in request.session.items if item.name.startswith(prefix)}


# ---- the program each rank runs ---------------------------------------------------------------

def _write(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, path)  # a launch killed at its deadline reads the cases finished so far


def main(job_path: str, out_path: str) -> int:
    import torch.distributed as dist
    from layoutlang.runtime import worker

    worker.exit_with_launcher()
    job = json.loads(Path(job_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    report: dict = {"rank": rank, "cases": {}, "last": None}
    cases = job["cases"]
    pg_timeout = max(max(600, 10 * c["job"].get("timeout", 60)) for c in cases)
    go_on, linger, ok = True, 0, False
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # noqa: BLE001 - reported to the launcher as data
        report["error"] = f"{type(exc).__name__}: {exc}"
        go_on, linger = False, 2
    for i, case in enumerate(cases if go_on else ()):
        name, case_job = case["name"], case["job"]
        assert not case_job.get("groups"), "sub-group jobs run alone"
        result: dict = {"rank": rank, "ok": False}
        try:
            result.update(worker.run(case_job, rank))
            result["ok"] = not result.get("check_errors") and not result.get("error")
        except Exception as exc:  # noqa: BLE001 - reported to the launcher as data
            result["error"] = f"{type(exc).__name__}: {exc}"
        report["cases"][name], report["last"] = result, name
        _write(out_path, report)
        # the worker's exit after its job (worker.py): the last case's code and linger
        ok, linger = result["ok"], case_job.get("linger", 0 if result["ok"] else 2)
        if i == len(cases) - 1:
            break
        # every rank's verdict before the next case, through the store
        keys = [f"tests/shared_launch/{i}/{r}" for r in range(world)]
        try:
            store.set(keys[rank], "1" if result["ok"] else "0")
            store.wait(keys, timedelta(seconds=VERDICT_TIMEOUT))
            failed = [r for r, k in enumerate(keys) if store.get(k) != b"1"]
        except Exception as exc:  # noqa: BLE001 - a rank (or the store's host) is gone
            failed, report["stopped"] = None, f"after `{name}`: {type(exc).__name__}: {exc}"
        if failed is None or (failed and not case["may_fail"]):
            report.setdefault("stopped", f"after `{name}`: ranks {failed} failed it")
            linger = max(linger, 2)  # rank 0 hosts the store: the others are still reading verdicts
            break
    _write(out_path, report)
    time.sleep(linger)  # rank 0 hosts the store: a late rank must still find it (worker.py)
    if not ok:
        sys.stderr.flush()
        os._exit(1)  # transfers may be in flight: do not wait on the process group at exit
    dist.destroy_process_group()
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
