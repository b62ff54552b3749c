"""One process of the jobs benchmark (benchmarks/jobs_gloo.py starts ten of them; see there).

Usage: python benchmarks/jobs_gloo_worker.py JOB OUT   (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

JOB is JSON written by the launcher: the two layout texts, the replica count, the
staging budget, the rounds, the jobs store's address. World ranks 0..N-1 are the
trainer's ranks; world rank N + t*K + i is rank t of replica i (the plan's numbering,
layoutlang/compiler/members.py `engine_rank`), so the one-world Refitter and the jobs share the
plan's rank of every process. Each step of every method sits between two barriers of
the world's default group; rank 0's clock between them is the step's time.

Methods, all writing into the same destination tensors of every engine rank:

  one_world  `Refitter(plan)` over the default group (steady=False: an agreement and a
             fence in the world's store every step, as jobs meet every step)
  staged     `Refitter` on the schedule a job's walk takes (every transfer staged), reported only
  steady     `Refitter(plan, steady=True)` (no meeting after step 1, then replays), reported only
  jobs       `TrainerJob.refit` on the trainer ranks, `EngineJob.receive` (in a thread started
             before the first barrier) on the engine ranks
  native     per trainer tensor: gather the shards of the ranks holding one full copy on rank 0,
             assemble the whole tensor, broadcast it to every engine rank (one group: rank 0 and
             the engine ranks), each of which copies its slices into its destination

Correctness is checked after every step on every engine rank: each destination equals
`expected_destination` of the engine's layout (layoutlang/runtime/fill.py: from the layout alone, no
plan) times the step's version factor (examples/jobs/weights.py), element by element
(`torch.equal`); the last step of every method is also checked with weights.py `problems`.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import statistics
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "jobs"))
from weights import engine_tensors, factor, problems, trainer_tensors  # noqa: E402

from layoutlang.compiler import compile_plan  # noqa: E402
from layoutlang.compiler.members import MemberPlanner, replicate  # noqa: E402
from layoutlang.compiler.steps import schedule  # noqa: E402
from layoutlang.elaborate import loads  # noqa: E402
from layoutlang.modes import Run  # noqa: E402
from layoutlang.runtime import EngineJob, Refitter, TrainerJob  # noqa: E402
from layoutlang.runtime.fill import expected_destination, regions  # noqa: E402
from layoutlang.runtime.jobs import NAMESPACE  # noqa: E402
from refit_gloo import round_order  # noqa: E402 - beside this file (sys.path[0])

PHASE_STEPS = 3  # untimed steps per method with the phases timed, after the rounds


# ---- the vLLM-native baseline -----------------------------------------------------------

def _blocks(runs_per_dim):
    """Every data rectangle of a local tensor: (local slices, logical slices); padding skipped."""
    per_dim = [[r for r in runs if isinstance(r, Run)] for runs in runs_per_dim]
    for combo in itertools.product(*per_dim):
        yield (tuple(slice(r.local_start, r.local_start + r.length) for r in combo),
               tuple(slice(r.logical_start, r.logical_start + r.length) for r in combo))


def _boxes(t) -> dict:
    return {r.key: (r.box, r.stacked, r.transposed) for r in regions(t)}


def full_copy_group(s, rank: int) -> tuple[int, ...]:
    """The ranks that hold one full copy of source tensor `s` together with `rank` (its replica
    coordinates, the mesh axes `s` is not split over, are `rank`'s)."""
    replica = [i for i in range(len(s.mesh.axes)) if i not in s.used_axes]
    mine = [s.mesh.coords(rank)[i] for i in replica]
    return tuple(r for r in s.ranks() if [s.mesh.coords(r)[i] for i in replica] == mine)


class Native:
    """vLLM's own weight-update path as RL frameworks drive it: every trainer tensor whole on
    trainer rank 0 (gathered from the ranks that hold one copy of it), broadcast whole to every
    engine worker of every replica, each of which keeps its slices (what `load_weights` does).

    The two layouts must give a tensor and the engine tensor holding the same keys one logical
    space (same shape, same key boxes): then a slice of the whole tensor is the engine's slice,
    exactly, and the destinations are checked like the other methods'. Every buffer is allocated
    before timing (kinder to the baseline than a fresh tensor per broadcast)."""

    def __init__(self, src, one, rank: int, trainer: int, copies: int):
        engines = list(range(trainer, trainer + copies * one.ranks))
        by_keys = {frozenset(_boxes(t)): t for t in one.tensors}
        self.rank, self.items = rank, []
        local = (rank - trainer) // copies if rank >= trainer else None
        groups = {}
        for s in src.tensors:
            d = by_keys.get(frozenset(_boxes(s)))
            if d is None or d.logical_shape != s.logical_shape or _boxes(d) != _boxes(s):
                raise SystemExit(f"native baseline: trainer tensor `{s.name}` and the engine tensor holding its keys "
                                 f"({d.name if d else 'none'}) differ in logical shape or key boxes")
            group = full_copy_group(s, 0)
            groups.setdefault(group, None)
            self.items.append({"s": s, "d": d, "group": group})
        # every rank creates every group, in one order
        self.gather_pg = {g: dist.new_group(list(g)) for g in sorted(groups) if len(g) > 1}
        self.bcast_ranks = (0, *engines)
        self.bcast_pg = dist.new_group(list(self.bcast_ranks))
        self.bytes_received = {}  # rank -> bytes per step
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        for it in self.items:
            s, d, group = it["s"], it["d"], it["group"]
            elem = torch.empty((), dtype=dtype[s.dtype]).element_size()
            full_bytes = elem * torch.Size(s.logical_shape).numel()
            for r in group[1:]:
                self.bytes_received[0] = self.bytes_received.get(0, 0) + elem * torch.Size(s.local_shape_at(r)).numel()
            for r in engines:
                self.bytes_received[r] = self.bytes_received.get(r, 0) + full_bytes
            if rank == 0 or local is not None:
                it["full"] = torch.empty(s.logical_shape, dtype=dtype[s.dtype])
            if rank == 0:
                it["gathered"] = [torch.empty(s.local_shape_at(r), dtype=dtype[s.dtype]) for r in group]
                it["src_blocks"] = [list(_blocks(s.runs(r))) for r in group]
            if local is not None:
                it["dst_blocks"] = list(_blocks(d.runs(local)))

    def step(self, src: dict | None, dst: dict | None) -> None:
        rank = self.rank
        for it in self.items:
            s, group = it["s"], it["group"]
            if rank in group:
                if len(group) > 1:
                    dist.gather(src[s.name], it["gathered"] if rank == 0 else None, dst=0,
                                group=self.gather_pg[group])
                else:
                    it["gathered"][0] = src[s.name]
                if rank == 0:
                    for shard, blocks in zip(it["gathered"], it["src_blocks"]):
                        for local_sl, logical_sl in blocks:
                            it["full"][logical_sl].copy_(shard[local_sl])
            if rank in self.bcast_ranks:
                dist.broadcast(it["full"], src=0, group=self.bcast_pg)
            if dst is not None:
                target = dst[it["d"].name]
                for local_sl, logical_sl in it["dst_blocks"]:
                    target[local_sl].copy_(it["full"][logical_sl])


class StagedRefitter(Refitter):
    """The one-world Refitter on the schedule a job's walk takes (layoutlang/runtime/jobgroups.py JobWalk.walk:
    every transfer staged, as if some rank's tensors were strided): what that choice costs, apart
    from the jobs' groups and meetings."""

    def schedule(self, strided: bool):
        return super().schedule(True)


# ---- phases (untimed steps after the rounds) ------------------------------------------------

class Phases:
    """Seconds spent in named methods of some objects during one step, by wrapping them on the
    instances (a diagnostic of this benchmark: the runtime keeps no such counters)."""

    def __init__(self):
        self.now: dict[str, float] = {}
        self.samples: dict[str, list[float]] = {}
        self._undo = []
        self._depth: dict[str, int] = {}

    def wrap(self, obj, method: str, name: str, skip_inside: str | None = None) -> None:
        original = getattr(obj, method)

        def timed(*a, **kw):
            self._depth[name] = self._depth.get(name, 0) + 1
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self._depth[name] -= 1
                if not (skip_inside and self._depth.get(skip_inside)):
                    self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - start
        setattr(obj, method, timed)
        self._undo.append((obj, method))

    def begin(self) -> None:
        self.now = {}

    def end(self, total: float) -> None:
        self.now["total"] = total
        for k, v in self.now.items():
            self.samples.setdefault(k, []).append(v)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items()}

    def unwrap(self) -> None:
        for obj, method in self._undo:
            delattr(obj, method)
        self._undo = []


# ---- the run ---------------------------------------------------------------------------------

def main() -> int:
    job_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads(job_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out: dict = {"rank": rank, "ok": False, "problems": []}

    def write() -> None:
        out_path.write_text(json.dumps(out))

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks before it kills
    try:
        torch.set_num_threads(1)
        run(cfg, rank, world, out)
        out["ok"] = not out["problems"]
    except Exception:  # noqa: BLE001 - reported to the launcher, which fails the run
        out["error"] = traceback.format_exc()[-3000:]
        write()
        raise
    write()
    return 0


def run(cfg: dict, rank: int, world: int, out: dict) -> None:
    timeout = timedelta(seconds=cfg["timeout"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    src = loads(cfg["train"], "train.layout")
    one = loads(cfg["infer"], "infer.layout")
    n_trainer, copies = src.ranks, cfg["replicas"]
    if world != n_trainer + copies * one.ranks:
        raise SystemExit(f"world {world} != {n_trainer} trainer ranks + {copies} x {one.ranks} engine ranks")
    trainer = rank < n_trainer
    slot, local = ((rank - n_trainer) % copies, (rank - n_trainer) // copies) if not trainer else (None, None)
    budget = cfg["budget_bytes"]
    plan = compile_plan(src, replicate(one, copies, n_trainer), relay=False)
    if rank == 0:
        jobs_plan = MemberPlanner(src, one).plan(copies)
        stats = plan.stats
        out["plan"] = {"digest": plan.digest, "jobs_digest": jobs_plan.digest, "ops": stats["ops"],
                       "network_bytes": stats["network_bytes"], "local_bytes": stats["local_bytes"],
                       "max_send_bytes": stats["max_send_bytes"], "max_recv_bytes": stats["max_recv_bytes"],
                       "buckets_one_world": len(schedule(plan, 0, budget, False).buckets)}

    # tensors: the trainer's keep their memory (each step rewrites them with its version)
    if trainer:
        base = trainer_tensors(src, rank, 0)
        src_t = {k: v.clone() for k, v in base.items()}
        dst_t = None
    else:
        base = src_t = None
        dst_t = engine_tensors(one, local)
        ref = {t.name: expected_destination(t, local).values for t in one.tensors if t.holds(local)}

    # methods
    native = Native(src, one, rank, n_trainer, copies)
    if rank == 0:
        out["native_bytes"] = sum(native.bytes_received.values())
    one_world = Refitter(plan, budget_bytes=budget, timeout=timeout)
    steady = Refitter(plan, budget_bytes=budget, timeout=timeout, steady=True)
    staged = StagedRefitter(plan, budget_bytes=budget, timeout=timeout)
    address = cfg["address"]
    if rank == 0:
        job = TrainerJob(src, one, address=address, rank=0, world_size=n_trainer, timeout=timeout,
                         budget_bytes=budget)
    dist.barrier()  # the jobs store is up (trainer rank 0 hosts it)
    if trainer and rank != 0:
        job = TrainerJob(src, one, address=address, rank=rank, world_size=n_trainer, timeout=timeout,
                         budget_bytes=budget)
    # replicas register in slot order (rank 0 of r0 first), so a job's membership lists r{i} in slot i
    # and every process has the same plan rank in the jobs' plan as in the world's
    for i in range(copies):
        if slot == i and local == 0:
            job = EngineJob(one, address=address, replica=f"r{i}", rank=0, world_size=one.ranks, timeout=timeout)
        dist.barrier()
    if not trainer and local != 0:
        job = EngineJob(one, address=address, replica=f"r{slot}", rank=local, world_size=one.ranks, timeout=timeout)
    watch = None
    if rank == 0:
        host, port = address.rsplit(":", 1)
        watch = dist.PrefixStore(NAMESPACE, dist.TCPStore(host, int(port), None, False, timeout))
        wait_keys = [f"replica/r{i}/wait/{t}" for i in range(copies) for t in range(one.ranks)]
    dist.barrier()

    def all_waiting() -> None:
        deadline = time.monotonic() + cfg["timeout"]
        while not (watch.check(wait_keys) and all(watch.multi_get(wait_keys))):
            if time.monotonic() > deadline:
                raise RuntimeError("the engine replicas did not all wait in `receive`")
            time.sleep(0.0005)

    def step(method: str, version: int) -> float:
        """One step of `method` between two world barriers; rank 0's seconds."""
        if trainer:
            f = factor(version)
            for k, v in src_t.items():
                torch.mul(base[k], f, out=v)
        box: dict = {}
        thread = None
        if method == "jobs":
            if not trainer:
                def receive() -> None:
                    try:
                        box["version"] = job.receive(dst_t)
                    except Exception as exc:  # noqa: BLE001 - reported as a problem
                        box["error"] = f"{type(exc).__name__}: {exc}"
                thread = threading.Thread(target=receive, daemon=True)
                thread.start()
            elif rank == 0:
                all_waiting()
        dist.barrier()
        t0 = time.perf_counter()
        if method == "jobs":
            if trainer:
                box["report"] = job.refit(src_t, version=version)
            else:
                thread.join(cfg["timeout"] * 2)
                if thread.is_alive():
                    box["error"] = "receive did not return"
        elif method == "one_world":
            one_world.refit(src_t, dst_t)
        elif method == "steady":
            steady.refit(src_t, dst_t)
        elif method == "staged":
            staged.refit(src_t, dst_t)
        elif method == "native":
            native.step(src_t, dst_t)
        dist.barrier()
        seconds = time.perf_counter() - t0
        check(method, version, box)
        return seconds

    def check(method: str, version: int, box: dict) -> None:
        where = f"{method} step (version {version})"
        if method == "jobs":
            if trainer:
                report = box["report"]
                if report.missed or sorted(report.replicas) != [f"r{i}" for i in range(copies)]:
                    out["problems"].append(f"trainer rank {rank}, {where}: replicas {report.replicas}, "
                                           f"missed {report.missed} {report.reasons}")
            elif box.get("error") or box.get("version") != version:
                out["problems"].append(f"replica r{slot} rank {local}, {where}: "
                                       f"{box.get('error') or 'received version ' + repr(box.get('version'))}")
        if dst_t is not None:
            f = factor(version)
            bad = [k for k, v in dst_t.items() if not torch.equal(v, ref[k] * f)]
            if bad:
                out["problems"].append(f"replica r{slot} rank {local}, {where}: {len(bad)} destination tensors "
                                       f"differ from the expected values, e.g. `{bad[0]}`")

    methods = cfg["methods"]
    times: dict[str, list[float]] = {m: [] for m in methods}
    version, before = 0, None
    warmup, rounds = cfg["warmup"], cfg["rounds"]
    for i in range(warmup + rounds):
        order = round_order(methods, i, before)
        before = order[-1]
        for m in order:
            version += 1
            seconds = step(m, version)
            if i >= warmup:
                times[m].append(seconds)
        if len(out["problems"]) > 20:
            break
    last = version
    if dst_t is not None:  # the last step, checked again by the examples' own check
        for bad in problems(one, local, dst_t, last)[:3]:
            out["problems"].append(f"replica r{slot} rank {local}, last step (version {last}): {bad}")

    # where the time goes: a few more steps with the phases timed (not part of the rounds)
    phases: dict[str, dict[str, float]] = {}
    for method in ("jobs", "one_world"):
        ph = Phases()
        if method == "one_world":
            ph.wrap(one_world, "_agree", "agree")
            ph.wrap(one_world, "_bucket", "buckets")
            ph.wrap(one_world, "_meet", "fence", skip_inside="agree")
        elif trainer:
            for attr, name in (("_announce", "announce"), ("_announcement", "announce"), ("_start", "start meeting"),
                               ("_end", "end meeting"), ("_verdict", "verdict"), ("_read_verdict", "verdict"),
                               ("_membership", "membership")):
                ph.wrap(job, attr, name)
            walk = next(w for k, w in job._walks.items() if k[0] == copies)  # (copies, args)
            ph.wrap(walk, "connect", "connect")
            ph.wrap(walk, "walk", "walk")
            ph.wrap(walk, "_bucket", "buckets")
        else:
            # (copies, slot, layout digest); slot i is replica r{i} (registration order)
            walk = next(w for k, w in job._walks.items() if k[:2] == (copies, slot))
            ph.wrap(job, "_wait_for_refit", "announce")
            ph.wrap(walk, "connect", "connect")
            ph.wrap(walk, "walk", "walk")
        for _ in range(PHASE_STEPS):
            version += 1
            ph.begin()
            ph.end(step(method, version))
        ph.unwrap()
        phases[method] = ph.medians()
    out["phases"] = phases
    if rank == 0:
        out["times"] = times
        # the buckets a job's walk cut (JobWalk.walk: staged only when some rank's tensors are strided)
        out["plan"]["buckets_jobs"] = sorted({len(s.buckets) for w in job._walks.values()
                                             for s in w._schedules.values()})

    # the end: engines leave first, then the trainer job lets its store go
    if not trainer:
        job.close()
    dist.barrier()
    if trainer:
        job.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
