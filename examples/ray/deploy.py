"""An RL-style refit deployment on Ray (docs/jobs.md, "Ray"): every step a refit, one rollout
actor killed mid-refit and restarted by Ray.

    python examples/ray/deploy.py          # starts a local Ray (or joins the one this process runs in)

- The trainer: 2 Ray actors, one torch world of their own (gloo). Each builds the model of
  model.layout whole (HF names), shards it with FSDP2 (`fully_shard`), reads its layout off
  the live DTensors (layoutlang.bridges.dtensor) and joins a `RayTrainerJob` named "policy":
  its rank 0 hosts the job's store and publishes the address under that name.
- 3 rollout replicas (rollout-0 .. rollout-2) of 2 actors each, holding infer.layout's TP2
  shards (vLLM's names: fused qkv and gate|up, the vocabulary padded to 64); each actor finds
  the job by its name (`RayEngineJob`) and no replica shares a torch world with another or
  with the trainer. They are created with `max_restarts=1`.
- Every step changes every trainer weight (version v) and refits every replica
  (`expect=` all of them). At step 2, rollout-1's rank 1 pauses as its bucket 1 starts (its
  bucket 0 is written) and this driver `ray.kill(actor, no_restart=False)`s it: the trainer's
  step drops rollout-1 alone and returns; the other replicas are exact. Ray restarts the actor
  (its constructor again: the same replica id, a new process), and rollout-1 is exact from
  step 3.

After every receive each engine actor checks every element of its tensors against the version
it reports: version v's element is `fill.values(key, index) * factor(v)`
(layoutlang/runtime/fill.py: from the key and the logical index alone, no source, no plan).
Prints one JSON line per step and a last {"ok": ...} line; exits 1 where anything is not as
described above.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from layoutlang import load, loads
from layoutlang.integrations.ray import RayEngineJob, RayTrainerJob
from layoutlang.runtime import RefitError, RefitHooks
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor

HERE = Path(__file__).resolve().parent
MODEL, INFER = HERE / "model.layout", HERE / "infer.layout"
TRAINER_RANKS = 2
REPLICAS = ("rollout-0", "rollout-1", "rollout-2")
VICTIM = ("rollout-1", 1)   # the replica and rank killed at --kill-step, as its bucket 1 starts
BUDGET = 8192               # staging bytes: an engine rank's 27 KiB cut into 4 buckets
STARTUP = 120.0             # s every rank waits for the job's name (rank 0 publishes it once its model is sharded)


def factor(version: int) -> float:
    """Version v of every weight is the fill value times this: exact in fp32 and bf16, and
    different in consecutive versions (a stale element shows)."""
    return (-1.0) ** version * 2.0 ** (version % 3)


def say(**record) -> None:
    print(json.dumps(record), flush=True)


@ray.remote(num_cpus=0)
class Trainer:
    """One trainer rank: an FSDP2 shard of the model, in the trainer's own torch world."""

    def __init__(self, job: str, rank: int, timeout: float):
        self.job_name, self.rank, self.timeout = job, rank, timeout
        self.world_store = None

    def world_address(self) -> str:
        """Rank 0: host the trainer's torch world's store (a free port on this node)."""
        host = ray.util.get_node_ip_address()
        self.world_store = dist.TCPStore(host, 0, TRAINER_RANKS, True, timedelta(seconds=60), wait_for_workers=False)
        return f"{host}:{self.world_store.port}"

    def start(self, world: str) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from layoutlang.bridges import dtensor

        if self.world_store is None:
            host, port = world.rsplit(":", 1)
            self.world_store = dist.TCPStore(host, int(port), TRAINER_RANKS, False, timedelta(seconds=60))
        dist.init_process_group("gloo", store=self.world_store, rank=self.rank, world_size=TRAINER_RANKS)
        self.model = torch.nn.Module()
        for t in load(MODEL).tensors:  # the whole model, version 1, then FSDP2 shards it
            *path, leaf = t.name.split(".")
            module = self.model
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(source_tensor(t, 0) * factor(1)))
        fully_shard(self.model, mesh=init_device_mesh("cpu", (TRAINER_RANKS,), mesh_dim_names=("fsdp",)))
        train = loads(dtensor.describe(self.model, name="ray_trainer_fsdp2"), path="<fsdp2>")
        self.version = 1
        self.job = RayTrainerJob(train, INFER, name=self.job_name, rank=self.rank, world_size=TRAINER_RANKS,
                                 timeout=self.timeout, budget_bytes=BUDGET, connect_timeout=STARTUP)
        return {"rank": self.rank, "node_id": self.job.node_id, "pid": os.getpid()}

    def refit(self, version: int, expect: tuple) -> dict:
        """An optimizer step's stand-in: every local shard becomes `version`, then the refit."""
        from layoutlang.bridges import dtensor

        tensors = dtensor.tensors(self.model)
        with torch.no_grad():
            for local in tensors.values():
                local.mul_(factor(version) / factor(self.version))  # a power of two: exact
        self.version = version
        report = self.job.refit(tensors, version=version, expect=expect)
        return {"refit": report.refit, "version": report.version, "replicas": list(report.replicas),
                "missed": list(report.missed), "reasons": report.reasons, "transports": report.transports,
                "seconds": round(report.seconds, 3)}

    def nodes(self, replicas: tuple, ranks: int) -> dict:
        """The Ray node of every rank, as the job's store says it (what a transport choice reads)."""
        return {"trainer": [self.job.node_of(r) for r in range(TRAINER_RANKS)],
                **{rid: [self.job.node_of(t, rid) for t in range(ranks)] for rid in replicas}}

    def close(self) -> None:
        self.job.close()
        dist.destroy_process_group()


class PauseInBucket(RefitHooks):
    """Armed, this engine rank stops as bucket `bucket` of refit `refit` starts (bytes are
    moving: the ones of the buckets before have landed) and says so; it waits there, at most
    `hold` s, for the driver to kill it."""

    def __init__(self):
        self.at, self.reached, self.hold = None, threading.Event(), 0.0

    def before_bucket(self, refitter, step, bucket):
        if (step, bucket) == self.at:
            self.reached.set()
            time.sleep(self.hold)


@ray.remote(num_cpus=0, max_restarts=1, max_concurrency=2)  # 2: `paused` answers while `receive` runs
class Engine:
    """One rank of one rollout replica: infer.layout's shards, taken by a RayEngineJob."""

    def __init__(self, job: str, replica: str, rank: int, timeout: float):
        self.layout, self.replica, self.rank = load(INFER), replica, rank
        self.tensors = {t.name: empty_destination(t, rank=rank) for t in self.layout.tensors if t.holds(rank)}
        self.pause = PauseInBucket()
        self.eng = RayEngineJob(INFER, name=job, replica=replica, rank=rank, world_size=self.layout.ranks,
                                timeout=timeout, hooks=self.pause, connect_timeout=STARTUP)

    def pid(self) -> int:
        return os.getpid()

    def arm(self, refit: int, bucket: int, hold: float) -> None:
        self.pause.at, self.pause.hold = (refit, bucket), hold

    def paused(self, within: float) -> bool:
        return self.pause.reached.wait(within)

    def receive(self) -> dict:
        row = {"replica": self.replica, "rank": self.rank, "pid": os.getpid(), "node_id": self.eng.node_id}
        try:
            version = self.eng.receive(self.tensors)
        except RefitError as exc:
            return {**row, "error": str(exc).splitlines()[0], "version": self.eng.version,
                    "interrupted": self.eng.interrupted}
        problems, checked = [], 0
        for t in self.layout.tensors:  # every element, against the version reported
            if t.holds(self.rank):
                value = self.tensors[t.name]
                problem = check_destination(t, self.rank, value / factor(version))
                if problem:
                    problems.append(problem)
                checked += value.numel()
        return {**row, "version": version, "exact": not problems, "problems": problems[:3], "checked": checked}

    def close(self) -> None:
        self.eng.close()


def outcome(key: tuple, ref) -> dict:
    """A receive's row, or {"died": ...} when its actor was killed while it ran."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        return {"replica": key[0], "rank": key[1], "died": type(exc).__name__}


def back(actor, within: float) -> int:
    """The process id of `actor` once Ray has restarted it (calls fail while it restarts)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return ray.get(actor.pid.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run(job: str = "policy", steps: int = 3, kill_step: int = 2, timeout: float = 10.0) -> bool:
    """The deployment in the Ray this process runs in; True when every step went as described."""
    trainers = [Trainer.remote(job, r, timeout) for r in range(TRAINER_RANKS)]
    world = ray.get(trainers[0].world_address.remote())
    started = [t.start.remote(world) for t in trainers]
    engines = {(rid, t): Engine.remote(job, rid, t, timeout) for rid in REPLICAS for t in range(2)}
    say(trainer=ray.get(started), engines={f"{rid}/{t}": pid for (rid, t), pid in
                                           zip(engines, ray.get([e.pid.remote() for e in engines.values()]))})
    victim = engines[VICTIM]
    ok = True
    for n in range(1, steps + 1):
        if n == kill_step:
            ray.get(victim.arm.remote(n, 1, timeout))
        receives = {key: e.receive.remote() for key, e in engines.items()}
        refits = [t.refit.remote(n, REPLICAS) for t in trainers]
        killed = None
        if n == kill_step and ray.get(victim.paused.remote(timeout)):
            ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts=1)
            killed = VICTIM
        reports = ray.get(refits)
        rows = {key: outcome(key, ref) for key, ref in receives.items()}
        restarted = back(victim, STARTUP) if killed else None
        say(step=n, reports=reports, killed=killed and "/".join(map(str, killed)), restarted_pid=restarted,
            rows=[rows[k] for k in engines])
        hit = {killed[0]} if killed else set()
        ok &= all(r["version"] == n and sorted(r["replicas"]) == [x for x in REPLICAS if x not in hit]
                  and r["missed"] == sorted(hit) for r in reports)
        ok &= all(rows[k].get("exact") is True and rows[k]["version"] == n for k in engines if k[0] not in hit)
        ok &= killed is not None or n != kill_step
    say(nodes=ray.get(trainers[0].nodes.remote(REPLICAS, 2)))
    ray.get([e.close.remote() for e in engines.values()])
    ray.get([t.close.remote() for t in trainers])
    for actor in (*engines.values(), *trainers):
        ray.kill(actor)
    return bool(ok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default="policy", help="the trainer job's name in the Ray cluster")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds: a refit's bound (TrainerJob's timeout)")
    ap.add_argument("--temp-dir", default=None, help="Ray's session folder, when this starts Ray")
    a = ap.parse_args(argv)
    ours = not ray.is_initialized()
    if ours:  # 9 actors of 0 CPUs each (8 ranks and the job's name): any CPU count will do
        ray.init(num_cpus=2, _temp_dir=a.temp_dir, include_dashboard=False, log_to_driver=False)
    try:
        ok = run(a.job, a.steps, a.kill_step, a.timeout)
    finally:
        if ours:
            ray.shutdown()
    say(ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
