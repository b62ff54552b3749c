"""One rank of `benchmarks/transports.py --jobs` (a refit between jobs; see there).

Usage: python benchmarks/transports_jobs_worker.py JOB OUT   (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

6 processes in one gloo world (barriers only, and the floor's address table): ranks 0-1 the
trainer job, ranks 2-5 two engine replicas of 2 ranks (replica slot s, rank t is world rank
2 + 2 t + s, its plan rank in the jobs' plan: `compile_plan(train, replicate(infer, 2,
first=2), relay=False)`, the plan `MemberPlanner(train, infer).plan(2)` makes). Methods:

  floor         each engine rank copies its pieces out of the trainer ranks' memory, one
                `process_vm_readv` per piece (transports_worker.Floor)
  jobs_memory   `TrainerJob(..., transport="memory")` / `EngineJob(..., transport="memory")`
  jobs_group    the same on transport="group" (gloo), a second pair of jobs on its own store
  jobs_nixl     the same on transport="nixl" (NIXL's UCX agents), a third, where the package is installed

A jobs step: every engine rank waits in `receive` (a thread started before the barrier), the
trainer ranks `refit(..., expect=every replica)`; a step is timed between two world barriers.
The reports must name both replicas and miss none; destinations are checked as in
transports_worker (the first method against the layout, the others bit for bit).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit_gloo import round_order  # noqa: E402
from transports_worker import Checks, Floor, finish  # noqa: E402

from layoutlang.compiler import compile_plan  # noqa: E402
from layoutlang.compiler.members import replicate  # noqa: E402
from layoutlang.elaborate import loads  # noqa: E402
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor  # noqa: E402
from layoutlang.runtime.jobs import EngineJob, TrainerJob  # noqa: E402
from layoutlang.runtime.nixlagent import nixl_module  # noqa: E402
from layoutlang.diagnostics import UsageError  # noqa: E402

COPIES = 2


def main(job_path: str, out_path: str) -> int:
    cfg = json.loads(Path(job_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    result: dict = {"rank": rank, "ok": False, "methods": {}, "skipped": {}, "device": "cpu"}
    try:
        timeout = timedelta(seconds=cfg["timeout"])
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        src = loads(Path(cfg["src"]).read_text(), cfg["src"])
        one = loads(Path(cfg["dst"]).read_text(), cfg["dst"])
        n = src.ranks
        trainer = rank < n
        slot, local = (None, None) if trainer else ((rank - n) % COPIES, (rank - n) // COPIES)
        plan = compile_plan(src, replicate(one, COPIES, n), relay=False)
        result["bytes"] = plan.stats["network_bytes"]
        srcs = {t.name: source_tensor(t, rank) for t in plan.src.tensors if trainer and t.holds(rank)}
        dst_ts = [t for t in one.tensors if not trainer and t.holds(local)]
        dst = {t.name: empty_destination(t, rank=local) for t in dst_ts}
        floor = Floor(plan, rank, srcs, {t.name: dst[t.name] for t in dst_ts} if not trainer else {})
        run = {"floor": floor.step}
        version = [0]
        jobs = {}
        kinds = [("jobs_memory", "memory", cfg["addresses"][0]), ("jobs_group", "group", cfg["addresses"][1])]
        try:
            nixl_module()
            kinds.append(("jobs_nixl", "nixl", cfg["addresses"][2]))
        except UsageError as exc:  # (every rank alike: one environment)
            result["skipped"]["jobs_nixl"] = str(exc).splitlines()[0]
        for name, transport, address in kinds:
            if rank == 0:
                jobs[name] = TrainerJob(cfg["src"], cfg["dst"], address=address, rank=0, world_size=n,
                                        timeout=timeout, transport=transport)
            dist.barrier()  # its store is up
            if trainer and rank:
                jobs[name] = TrainerJob(cfg["src"], cfg["dst"], address=address, rank=rank, world_size=n,
                                        timeout=timeout, transport=transport)
            for i in range(COPIES):  # replicas register in slot order: r{i} is slot i
                if not trainer and slot == i and local == 0:
                    jobs[name] = EngineJob(cfg["dst"], address=address, replica=f"r{i}", rank=0,
                                           world_size=one.ranks, timeout=timeout, transport=transport)
                dist.barrier()
            if not trainer and local:
                jobs[name] = EngineJob(cfg["dst"], address=address, replica=f"r{slot}", rank=local,
                                       world_size=one.ranks, timeout=timeout, transport=transport)
            dist.barrier()

            def step(job=jobs[name]) -> None:
                if trainer:
                    report = job.refit(srcs, version=version[0], expect=[f"r{i}" for i in range(COPIES)])
                    if report.missed or len(report.replicas) != COPIES:
                        raise RuntimeError(f"refit {report.refit}: replicas {report.replicas}, missed {report.missed}: "
                                           f"{report.reasons}")
                    result.setdefault("transports", {})[job.transport] = report.transports
                else:
                    job.receive(dst)

            run[name] = step
        order = list(run)
        times = {m: [] for m in order}
        last = None

        def timed(m: str) -> float:
            version[0] += 1
            box: dict = {}
            thread = None
            if m != "floor" and not trainer:  # waiting in receive before the step starts
                def receive() -> None:
                    try:
                        run[m]()
                    except Exception as exc:  # noqa: BLE001 - reported
                        box["error"] = f"{type(exc).__name__}: {exc}"
                thread = threading.Thread(target=receive, daemon=True)
                thread.start()
            dist.barrier()
            t = time.perf_counter()
            if thread is None:
                run[m]()
            else:
                thread.join(cfg["timeout"])
                if thread.is_alive() or "error" in box:
                    raise RuntimeError(f"{m}: {box.get('error', 'receive did not return')}")
            dist.barrier()
            return time.perf_counter() - t

        for i in range(1 + cfg["rounds"]):
            for m in round_order(order, i, last):
                t = timed(m)
                if i:
                    times[m].append(t)
                last = m
        checks = Checks(result)
        for m in order:
            for t in dst_ts:
                dst[t.name].fill_(float("nan"))
            timed(m)
            errors = [] if trainer else checks(m, dst, lambda: [e for t in dst_ts
                                                                for e in [check_destination(t, local, dst[t.name])] if e])
            result["methods"][m] = {"seconds": times[m], "errors": errors[:3]}
        dist.barrier()
        for job in jobs.values():  # engines leave first, then the trainer jobs let their stores go
            if not trainer:
                job.close()
        dist.barrier()
        for job in jobs.values():
            if trainer:
                job.close()
        result["ok"] = True
    except Exception:  # noqa: BLE001 - the launcher prints it
        result["error"] = traceback.format_exc()
    return finish(result, out_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
