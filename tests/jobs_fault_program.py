"""One process of tests/test_jobs_faults.py: a trainer rank or an engine rank, each its own job.

    jobs_fault_program.py DIR trainer RANK
    jobs_fault_program.py DIR engine REPLICA RANK [strided | idle]

DIR/config.json holds the store's address, the layouts, the timeout and the budget (and
the trainer job's "transport", an engine's "engine_transport": "auto" unless given). The
test forks each process from a warm parent (layoutlang/runtime/zygote.py), so a replica restarts in
a fraction of a second; every process is its own job (no default process group, its own
connections), and dies with that parent.

Trainer rank: refit n starts when DIR/refit-<n>.json appears ({"expect": [...]}, or
{"stop": true}: close and exit); its report (or error), with the wall time it began and
returned, goes to DIR/report-<n>-<rank>.json. {"slow": [RANK, BUCKET, SECONDS]} makes that
trainer rank sleep as that bucket starts (so a replica rank killed in it dies mid-bucket).

Engine rank: receives until the trainer job closes, one JSON line per receive in
DIR/engine-<replica>-<rank>-<pid>.jsonl (version and every element checked against it, or
the error). The test's fault: DIR/kill-<replica>-<rank>.json = {"refit": n, "bucket": b,
"after": s} SIGKILLs this process s seconds after bucket b of refit n starts (RefitHooks, a
test seam: nothing in the runtime is patched); with "stop": true it sends itself SIGTERM
instead, as a launcher stopping a replica's other ranks does, and its handler shuts the rank
down gracefully: SystemExit out of `receive`, then `shutdown` seconds alive (an engine
draining its requests) before it exits; with "pause": true it stops itself (SIGSTOP: a
stalled rank, alive, not reading) until the test continues it. `idle`: joins the job and never receives.
Nothing is printed: the test reads stderr, which a healthy job leaves empty.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "jobs"))
from weights import engine_tensors, problems, strided, trainer_tensors  # noqa: E402

from layoutlang import load  # noqa: E402
from layoutlang.runtime import EngineJob, RefitError, RefitHooks, TrainerJob  # noqa: E402


def _write(path: Path, record: dict) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record))
    part.replace(path)  # whole or absent to a reader


class Faults(RefitHooks):
    """Reads this rank's fault instructions as each bucket starts."""

    def __init__(self, where: Path, me: str, trainer_rank: int | None = None):
        self.where, self.me, self.trainer_rank = where, me, trainer_rank

    def before_bucket(self, refitter, step, bucket):
        if self.trainer_rank is not None:
            gate = self.where / f"refit-{step}.json"
            slow = json.loads(gate.read_text()).get("slow") if gate.exists() else None
            if slow and slow[0] == self.trainer_rank and slow[1] == bucket:
                time.sleep(slow[2])
            return
        path = self.where / f"kill-{self.me}.json"
        if not path.exists():
            return
        kill = json.loads(path.read_text())
        if kill["refit"] == step and kill["bucket"] == bucket:
            if kill.get("stop"):  # its launcher stops it (SIGTERM) as it starts this bucket
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if kill.get("pause"):  # it stalls (SIGSTOP) until the test continues it
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            if kill["after"] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Timer(kill["after"], os.kill, (os.getpid(), signal.SIGKILL)).start()


def trainer(where: Path, cfg: dict, rank: int) -> int:
    layout = load(cfg["train"])
    job = TrainerJob(cfg["train"], cfg["infer"], address=cfg["address"], rank=rank, world_size=2,
                     timeout=timedelta(seconds=cfg["timeout"]), budget_bytes=cfg["budget"],
                     hooks=Faults(where, "trainer", rank), connect_timeout=timedelta(seconds=60),
                     transport=cfg.get("transport", "auto"))
    n = 0
    while True:
        n += 1
        gate = where / f"refit-{n}.json"
        while not gate.exists():
            time.sleep(0.005)
        command = json.loads(gate.read_text())
        if command.get("stop"):
            job.close()
            return 0
        tensors = trainer_tensors(layout, rank, 10 * n)
        began = time.time()
        try:
            report = job.refit(tensors, version=10 * n, expect=tuple(command.get("expect", ())))
            record = {"replicas": sorted(report.replicas), "missed": sorted(report.missed), "reasons": report.reasons,
                      "transports": report.transports}
        except RefitError as exc:
            record = {"error": str(exc)}
        _write(where / f"report-{n}-{rank}.json", {**record, "began": began, "at": time.time()})


def engine(where: Path, cfg: dict, rid: str, rank: int, mode: str) -> int:
    layout = load(cfg["infer"])
    tensors = engine_tensors(layout, rank)
    if mode == "strided":
        tensors = strided(tensors)
    eng = EngineJob(cfg["infer"], address=cfg["address"], replica=rid, rank=rank, world_size=2,
                    timeout=timedelta(seconds=cfg["timeout"]), hooks=Faults(where, f"{rid}-{rank}"),
                    connect_timeout=timedelta(seconds=60), transport=cfg.get("engine_transport", {}).get(rid, "auto"))
    signal.signal(signal.SIGTERM, _stop)
    try:
        return _receive(where, cfg, rid, rank, mode, layout, tensors, eng)
    except SystemExit:  # stopped: a graceful shutdown, which takes a while (the process lives on)
        time.sleep(cfg["shutdown"])
        raise


def _stop(signum, frame):
    raise SystemExit(128 + signum)


def _receive(where: Path, cfg: dict, rid: str, rank: int, mode: str, layout, tensors, eng) -> int:
    if mode == "idle":  # alive, never in `receive`
        while not (where / "stop").exists():
            time.sleep(0.05)
        return 0
    with open(where / f"engine-{rid}-{rank}-{os.getpid()}.jsonl", "a") as log:
        while True:
            gone = False
            try:
                version = eng.receive(tensors)
                line = {"version": version, "problems": problems(layout, rank, tensors, version)[:3]}
            except RefitError as exc:
                line = {"error": str(exc), "version": eng.version, "interrupted": eng.interrupted}
                gone = exc.phase == "waiting"
            log.write(json.dumps({**line, "at": time.time()}) + "\n")
            log.flush()
            if gone:
                break
    eng.close()
    return 0


def main() -> int:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    except (OSError, AttributeError):
        pass
    where, role = Path(sys.argv[1]), sys.argv[2]
    cfg = json.loads((where / "config.json").read_text())
    if role == "trainer":
        return trainer(where, cfg, int(sys.argv[3]))
    return engine(where, cfg, sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")


if __name__ == "__main__":
    sys.exit(main())
