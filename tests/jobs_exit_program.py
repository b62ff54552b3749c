"""One role of tests/test_jobs_store_exit.py: a trainer rank or an engine rank, over many rounds.

    python tests/jobs_exit_program.py ROLE RANK ROUNDS DIR      (ROLE: trainer | engine)

Each round is a fresh deployment: this process forks a child that joins it and exits, so a
round costs a fork, not a Python start. Trainer rank 0's child hosts a fresh store (port 0:
the OS picks, written to DIR/<round>/port), waits until both engine ranks wait in
`receive`, refits once, closes and leaves AT ONCE (`os._exit`: no barrier, no teardown).
The engine ranks' children write what their one `receive` returned (or raised) to
DIR/<round>/engine-<rank>.json. Nothing is pickled: ports and results are files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "jobs"))
from weights import engine_tensors, problems, trainer_tensors  # noqa: E402

from layoutlang import load  # noqa: E402
from layoutlang.runtime import EngineJob, RefitError, TrainerJob  # noqa: E402
from layoutlang.runtime.jobs import NAMESPACE, _Store  # noqa: E402
from layoutlang.runtime.jobwait import current_waits  # noqa: E402

TRAIN, INFER = ROOT / "examples" / "jobs" / "train.layout", ROOT / "examples" / "jobs" / "infer.layout"
TIMEOUT = timedelta(seconds=10)
TRAINER_RANKS, ENGINE_RANKS = 2, 2


def _port(at: Path, within: float = 20.0) -> int:
    deadline = time.monotonic() + within
    while not (at / "port").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no store port in {at}")
        time.sleep(0.002)
    return int((at / "port").read_text())


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # readers see the whole file or none


def trainer(rank: int, at: Path, version: int, layout) -> None:
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
        _write(at / "port", str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", _port(at), None, False, TIMEOUT)
    job = TrainerJob(layout, load(str(INFER)), store=store, rank=rank, world_size=TRAINER_RANKS, timeout=TIMEOUT)
    if rank == 0:  # both engine ranks wait in `receive`: the replica is a member of this refit
        kv = _Store(dist.PrefixStore(NAMESPACE, store), "")
        while current_waits(kv, "r0", ENGINE_RANKS) is None:  # (layoutlang/runtime/jobwait.py: this incarnation's waits)
            time.sleep(0.002)
    report = job.refit(trainer_tensors(layout, rank, version), version=version)
    job.close()
    if rank == 0:
        _write(at / "trainer.json", json.dumps({"replicas": list(report.replicas), "missed": list(report.missed)}))
    os._exit(0)  # at once: the store goes with this process


def engine(rank: int, at: Path, version: int, layout) -> None:
    store = dist.TCPStore("127.0.0.1", _port(at), None, False, TIMEOUT)
    eng = EngineJob(layout, store=store, replica="r0", rank=rank, world_size=ENGINE_RANKS, timeout=TIMEOUT)
    tensors = engine_tensors(layout, rank)
    try:
        got = eng.receive(tensors)
        row = {"version": got, "problems": problems(layout, rank, tensors, version)[:3]}
    except RefitError as exc:
        row = {"error": str(exc)}
    _write(at / f"engine-{rank}.json", json.dumps(row))
    os._exit(0)


def main() -> int:
    role, rank, rounds, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    layout = load(str(TRAIN), {"DP": 1}) if role == "trainer" else load(str(INFER))  # once, before the forks
    for k in range(1, rounds + 1):
        at = where / str(k)
        at.mkdir(parents=True, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            try:
                (trainer if role == "trainer" else engine)(rank, at, 10 + k, layout)
            except BaseException as exc:  # noqa: BLE001 - the child reports and leaves, never returns
                _write(at / f"{role}-{rank}-crash.json", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            os._exit(1)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
