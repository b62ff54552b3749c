"""One rank of the gloo refit benchmark (benchmarks/refit_gloo.py starts it; see there).

Usage: python benchmarks/refit_gloo_worker.py JOB OUT   (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

The job is JSON written by the launcher: the cases (source and destination
`.layout` paths, and DTensor placements where DTensor can express the case),
the numbers of timed steps. Per case this rank compiles the plan (a pure
function of the two files, the same on every rank), fills its source shards
with `layoutlang.runtime.fill.source_tensor`, and times four ways of producing
the same destination tensors (one set, which every method writes into):

  layoutlang  `Refitter(plan, steady=True).refit(src, dst)` (no store meeting after step 1),
              and as `layoutlang_meet` the default `Refitter(plan)` (an agreement and a
              fence every step)
  naive       per tensor: `dist.all_gather` over the source group (the ranks that
              hold one full copy), rebuild the full tensor (`torch.cat`, or
              placing each shard by its runs where the layout is strided/chunked),
              `dist.broadcast` it to destination ranks outside every source
              group, slice this rank's destination part (its runs) and copy it in
  dtensor     `DTensor.redistribute` on one DeviceMesh spanning every rank, then
              copy the result into the destination (only where DTensor can say it)
  hand_p2p    the plan's ops for this rank as plain `dist.isend`/`dist.irecv` with
              buffers allocated before timing: the least work for the same bytes
  hand_again  a second, identical hand exchange, timed in the
              same rotation: hand_again / hand_p2p is this run's noise on equal work

Each step: barrier, start clock, the method, barrier, stop clock. The methods
take turns step by step after one untimed warm-up round, in a balanced order
(`refit_gloo.round_order`: each in every position and after every other equally
often). Then, untimed: a cProfile of one layoutlang step, three layoutlang steps with
the Refitter's phases timed, and the checks: per method, one more step into NaN-filled
destinations, checked against the layout. Results (per-step seconds on this rank, bytes,
checks, profile) go to OUT as JSON, rewritten after every case so a later
failure keeps the earlier cases.
"""

from __future__ import annotations

import cProfile
import itertools
import json
import os
import pstats
import sys
import time
import traceback
import warnings
from datetime import timedelta
from math import prod

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from layoutlang.compiler import compile_plan  # noqa: E402
from layoutlang.compiler.staging import contiguous  # noqa: E402
from layoutlang.modes import Run  # noqa: E402
from layoutlang.runtime import Refitter  # noqa: E402
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor  # noqa: E402
from refit_gloo import round_order  # noqa: E402 - the launcher, beside this file (sys.path[0])

METHODS = ("layoutlang", "layoutlang_meet", "naive", "dtensor", "hand_p2p", "hand_again")
SLOW = ("naive", "dtensor")  # timed over fewer steps (`slow_steps`): each takes about a second


# ---- helpers ------------------------------------------------------------------------

def _slices(sl) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


def _blocks(runs_per_dim):
    """Every data rectangle of a local tensor: (local slices, logical slices); padding skipped."""
    per_dim = [[r for r in runs if isinstance(r, Run)] for runs in runs_per_dim]
    for combo in itertools.product(*per_dim):
        local = tuple(slice(r.local_start, r.local_start + r.length) for r in combo)
        logical = tuple(slice(r.logical_start, r.logical_start + r.length) for r in combo)
        yield local, logical


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _one_step(step) -> float:
    """Seconds of one step between two barriers (every rank starts together; the slowest ends it)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _profile(step, top: int = 12) -> list[list]:
    """cProfile one (untimed) step; the top entries by own time."""
    prof = cProfile.Profile()
    dist.barrier()
    prof.enable()
    step()
    prof.disable()
    dist.barrier()
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = []
    for (file, line, func), (_, nc, tt, ct, _) in rows:
        where = func if file == "~" else f"{os.path.basename(file)}:{line}({func})"
        out.append([where, nc, round(tt, 6), round(ct, 6)])
    return out


def _breakdown(refitter, step, steps: int) -> dict[str, float]:
    """Median seconds per step in the Refitter's own phases, timed by wrapping them on this instance.

    `agree`: the pre-flight meeting in the store that checks plans and local shapes;
    `bucket`: posting and completing the transfers and local copies;
    `fence`: the store meetings after each bucket (`_meet` outside `_agree`).
    """
    acc = {"agree": 0.0, "bucket": 0.0, "fence": 0.0}
    method = {"agree": "_agree", "bucket": "_bucket", "fence": "_meet"}
    inside_agree = [False]
    for name in acc:
        original = getattr(refitter, method[name])

        def timed(*a, _original=original, _name=name, **kw):
            if _name == "agree":
                inside_agree[0] = True
            start = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                if _name == "agree":
                    inside_agree[0] = False
                if not (_name == "fence" and inside_agree[0]):
                    acc[_name] += time.perf_counter() - start
        setattr(refitter, method[name], timed)
    samples: dict[str, list[float]] = {k: [] for k in (*acc, "total")}
    try:
        for _ in range(steps):
            for k in acc:
                acc[k] = 0.0
            dist.barrier()
            start = time.perf_counter()
            step()
            samples["total"].append(time.perf_counter() - start)
            dist.barrier()
            for k, v in acc.items():
                samples[k].append(v)
    finally:
        for name in acc:
            delattr(refitter, method[name])
    return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}


# ---- (b) naive: all-gather the full tensor everywhere, slice -----------------------------

class Naive:
    """What RL frameworks do: rebuild every full tensor on every rank, then slice it."""

    def __init__(self, plan, rank: int, groups: dict):
        self.rank = rank
        self.items = []          # per key, in plan order
        self.received = 0        # bytes this rank receives per step
        for entry in plan.tensors:
            s = plan.src.by_key[entry.key][0]   # one source instance per key in these cases
            d = next((t for t in plan.dst.by_key[entry.key] if t.holds(rank)), None)
            src_groups = source_groups(s)
            mine = next((g for g in src_groups if rank in g), None)
            dst_ranks = sorted({r for t in plan.dst.by_key[entry.key] for r in t.ranks()})
            outsiders = [r for r in dst_ranks if not any(r in g for g in src_groups)]
            bcast = tuple([src_groups[0][0]] + outsiders) if outsiders else None
            shard_shape = s.local_shape
            full_shape = s.logical_shape
            need_full = d is not None or (bcast is not None and rank == bcast[0])
            item = {
                "src": s, "dst": d, "group": mine, "pg": groups.get(mine) if mine else None,
                "bcast": bcast, "bcast_pg": groups.get(bcast) if bcast and rank in bcast else None,
                "need_full": need_full, "cat_dim": _cat_dim(s, mine) if mine else None,
                "src_runs": {r: s.runs(r) for r in mine} if mine else {},
                "dst_blocks": list(_blocks(d.runs(rank))) if d is not None else [],
                "full_shape": full_shape, "shard_shape": shard_shape,
            }
            elem = torch.empty((), dtype=_torch_dtype(s.dtype)).element_size()
            if mine and len(mine) > 1:
                self.received += (len(mine) - 1) * prod(shard_shape) * elem
            if bcast and rank in bcast[1:]:
                self.received += prod(full_shape) * elem
            self.items.append(item)

    def step(self, src: dict, dst: dict) -> None:
        for it in self.items:
            s, d = it["src"], it["dst"]
            full = None
            if it["group"] is not None:
                local = src[s.name]
                if len(it["group"]) == 1:
                    full = local
                else:
                    gathered = [torch.empty_like(local) for _ in it["group"]]
                    dist.all_gather(gathered, local, group=it["pg"])
                    if it["need_full"]:
                        full = self._assemble(it, gathered, local.dtype)
            if it["bcast"] is not None and self.rank in it["bcast"]:
                if full is None:
                    full = torch.empty(it["full_shape"], dtype=_torch_dtype(s.dtype))
                dist.broadcast(full, src=it["bcast"][0], group=it["bcast_pg"])
            if d is not None:
                target = dst[d.name]
                for local_sl, logical_sl in it["dst_blocks"]:
                    target[local_sl].copy_(full[logical_sl])

    @staticmethod
    def _assemble(it, gathered, dtype) -> torch.Tensor:
        if it["cat_dim"] is not None:
            return torch.cat(gathered, dim=it["cat_dim"])
        full = torch.empty(it["full_shape"], dtype=dtype)
        for r, shard in zip(it["group"], gathered):
            for local_sl, logical_sl in _blocks(it["src_runs"][r]):
                full[logical_sl].copy_(shard[local_sl])
        return full


def source_groups(s) -> list[tuple[int, ...]]:
    """The ranks holding one full copy of a source tensor, one group per replica coordinate."""
    replica = [i for i in range(len(s.mesh.axes)) if i not in s.used_axes]
    out: dict[tuple, list[int]] = {}
    for r in s.ranks():
        coords = s.mesh.coords(r)
        out.setdefault(tuple(coords[i] for i in replica), []).append(r)
    return [tuple(v) for _, v in sorted(out.items())]


def _cat_dim(s, group) -> int | None:
    """The dim along which the group's shards, in group order, concatenate to the logical tensor."""
    for d in range(len(s.logical_shape)):
        pos, ok = 0, True
        for r in group:
            runs = s.runs(r)
            for e, dim_runs in enumerate(runs):
                if len(dim_runs) != 1 or not isinstance(dim_runs[0], Run):
                    ok = False
                elif e == d:
                    ok = ok and dim_runs[0].logical_start == pos and dim_runs[0].local_start == 0
                    pos += dim_runs[0].length
                else:
                    ok = ok and dim_runs[0].logical_start == 0 and dim_runs[0].length == s.logical_shape[e]
        if ok and pos == s.logical_shape[d]:
            return d
    return None


def _torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# ---- (d) hand-written point-to-point --------------------------------------------------

class HandP2P:
    """The plan's ops for this rank as isend/irecv, every buffer allocated up front."""

    def __init__(self, plan, rank: int, src: dict, dst: dict):
        self.local, self.posts, self.pack, self.unpack = [], [], [], []
        shapes = {t.name: t.local_shape for t in plan.dst.tensors if t.holds(rank)}
        src_shapes = {t.name: t.local_shape for t in plan.src.tensors if t.holds(rank)}
        for op in plan.ops_for_rank(rank):
            if op.local:
                self.local.append((dst[op.dst_name][_slices(op.dst_slice)], src[op.src_name][_slices(op.src_slice)]))
            elif op.src_rank == rank:
                view = src[op.src_name][_slices(op.src_slice)]
                if contiguous(op.src_slice, src_shapes[op.src_name]):
                    buf = view
                else:
                    buf = torch.empty(view.shape, dtype=view.dtype)
                    self.pack.append((buf, view))
                self.posts.append((dist.isend, buf, op.dst_rank))
            else:
                view = dst[op.dst_name][_slices(op.dst_slice)]
                if contiguous(op.dst_slice, shapes[op.dst_name]):
                    buf = view
                else:
                    buf = torch.empty(view.shape, dtype=view.dtype)
                    self.unpack.append((view, buf))
                self.posts.append((dist.irecv, buf, op.src_rank))

    def step(self) -> None:
        for buf, view in self.pack:
            buf.copy_(view)
        works = [fn(buf, peer) for fn, buf, peer in self.posts]
        for target, source in self.local:
            target.copy_(source)
        for w in works:
            w.wait()
        for view, buf in self.unpack:
            view.copy_(buf)


# ---- (c) DTensor --------------------------------------------------------------------

def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard
    return tuple(Replicate() if p == "R" else Shard(int(p[1:])) for p in spec)


class DTensorMethod:
    def __init__(self, case: dict, plan, rank: int, src: dict, dst: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        spec = case["dtensor"]
        self.mesh = init_device_mesh("cpu", tuple(spec["mesh"]), mesh_dim_names=tuple(spec["names"]))
        src_pl, self.dst_pl = _placements(spec["src"]), _placements(spec["dst"])
        self.pairs = []
        for entry in plan.tensors:
            s = next(t for t in plan.src.by_key[entry.key] if t.holds(rank))
            d = next(t for t in plan.dst.by_key[entry.key] if t.holds(rank))
            dt = DTensor.from_local(src[s.name], self.mesh, src_pl, run_check=False,
                                    shape=torch.Size(entry.shape), stride=_contiguous_stride(entry.shape))
            self.pairs.append((dt, dst[d.name]))

    def step(self) -> None:
        for dt, target in self.pairs:
            out = dt.redistribute(self.mesh, self.dst_pl)
            target.copy_(out.to_local())


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


# ---- one case -------------------------------------------------------------------------

_GROUPS: dict[tuple, object] = {}


def _make_groups(plan) -> dict:
    """Every process group the naive method needs, created in the same order on every rank."""
    wanted = []
    for entry in plan.tensors:
        s = plan.src.by_key[entry.key][0]
        groups = source_groups(s)
        wanted += [g for g in groups if len(g) > 1]
        dst_ranks = sorted({r for t in plan.dst.by_key[entry.key] for r in t.ranks()})
        outsiders = [r for r in dst_ranks if not any(r in g for g in groups)]
        if outsiders:
            wanted.append(tuple([groups[0][0]] + outsiders))
    for g in wanted:
        if g not in _GROUPS:
            _GROUPS[g] = dist.new_group(list(g))
    return _GROUPS


def run_case(case: dict, rank: int, steps: int, slow_steps: int, timeout: timedelta) -> dict:
    out: dict = {"name": case["name"], "methods": {}, "phases": {}}
    phases = out["phases"]
    t0 = time.perf_counter()
    plan = compile_plan(case["src"], case["dst"])
    refitter = Refitter(plan, timeout=timeout, steady=True)
    meeting = Refitter(plan, timeout=timeout)  # the default: an agreement and a fence every step
    out["plan_seconds"] = time.perf_counter() - t0
    stats = plan.stats
    out["plan_stats"] = {k: stats[k] for k in ("ops", "bytes", "network_bytes", "local_bytes", "max_send_bytes",
                                               "max_recv_bytes", "busiest_receiver", "busiest_link_bytes")}
    src = {t.name: source_tensor(t, rank) for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
    dst_ts = [t for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)]
    phases["setup"] = time.perf_counter() - t0
    mark = [time.perf_counter()]

    def phase(name):
        now = time.perf_counter()
        phases[name] = now - mark[0]
        mark[0] = now

    def fresh():
        return {t.name: empty_destination(t) for t in dst_ts}

    def check(dst) -> list[str]:
        return [e for t in dst_ts for e in [check_destination(t, rank, dst[t.name], plan)] if e]

    # Every method writes into the same destination tensors, as an engine holds one set of
    # weights: where the allocator would place a method's own tensors (their caches, their
    # alignment against the sources) is no difference between the methods. The methods take
    # turns step by step (one warm-up round, then timed rounds: `steps` for layoutlang and
    # hand p2p, the first `slow_steps` of them for naive and DTensor), in a balanced
    # order (refit_gloo.round_order), so a change in the machine's load during the case
    # hits all of them alike and none always follows the same method.
    shared = fresh()
    dsts = dict.fromkeys(("layoutlang", "layoutlang_meet", "naive", "hand_p2p", "hand_again", "dtensor"), shared)
    naive = Naive(plan, rank, _make_groups(plan))
    hand = HandP2P(plan, rank, src, dsts["hand_p2p"])
    run = {"layoutlang": lambda: refitter.refit(src or None, dsts["layoutlang"] or None),
           "layoutlang_meet": lambda: meeting.refit(src or None, dsts["layoutlang_meet"] or None),
           "naive": lambda: naive.step(src, dsts["naive"]),
           "hand_p2p": hand.step,
           "hand_again": HandP2P(plan, rank, src, dsts["hand_again"]).step}
    if case.get("dtensor"):
        run["dtensor"] = DTensorMethod(case, plan, rank, src, dsts["dtensor"]).step
    order = [m for m in METHODS if m in run]
    phase("prepare")
    times = {m: [] for m in order}
    last = None
    for i in range(1 + max(steps, slow_steps)):
        active = [m for m in order if i <= (slow_steps if m in SLOW else steps)]
        for m in round_order(active, i, last):
            t = _one_step(run[m])
            if i:  # round 0 warms every method up
                times[m].append(t)
            last = m
    phase("steps")
    profile = _profile(run["layoutlang"])
    parts = _breakdown(meeting, run["layoutlang_meet"], 3)  # where the meetings' time goes
    phase("profile")

    def checked(m: str) -> list[str]:
        """One more, untimed step of `m` into NaN-filled destinations, checked against the layout
        (every rank runs the methods in the same order: their messages meet)."""
        for t in dst_ts:
            shared[t.name].copy_(empty_destination(t))
        run[m]()
        return check(shared)[:3]

    for m in order:
        out["methods"][m] = {"seconds": times[m], "errors": checked(m)}
    phase("checks")
    out["methods"]["layoutlang"]["profile"] = profile
    out["methods"]["layoutlang"]["parts"] = parts
    out["methods"]["naive"]["recv_bytes"] = naive.received
    return out


LINK_BYTES = 64 * 2**20


def link_rate(rank: int, reps: int = 3) -> float | None:
    """One link's one-way rate: rank 0 sends 64 MiB to rank 1 while the others wait (best of
    `reps`, on rank 1; None elsewhere). The floor of a plan is its busiest link's bytes at it."""
    buf = torch.empty(LINK_BYTES, dtype=torch.uint8)
    best = None
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            t = time.perf_counter() - start
            best = t if best is None else min(best, t)
    dist.barrier()
    return LINK_BYTES / best if best else None


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as fh:
        job = json.load(fh)
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result: dict = {"rank": rank, "ok": False, "cases": []}

    def write():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, out_path)

    try:
        timeout = timedelta(seconds=job["collective_timeout"])
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        result["link_bytes_per_s"] = link_rate(rank)
        for case in job["cases"]:
            result["cases"].append(run_case(case, rank, job["steps"], job["slow_steps"], timeout))
            write()
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the launcher as data
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    write()
    if dist.is_initialized() and result["ok"]:
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
