"""Refit between separately launched jobs: a trainer job feeding engine replicas that come and go.

    job = TrainerJob("train.layout", "infer.layout", address="host:port", rank=r, world_size=N)
    report = job.refit(trainer_tensors, version=step)     # every trainer rank, every RL step
    eng = EngineJob("infer.layout", address="host:port", replica="rollout-3", rank=t, world_size=R)
    version = eng.receive(engine_tensors)                  # every rank of one replica

Each side keeps its own world (torchrun, vLLM's workers): nothing here touches it.
Trainer rank 0 hosts a TCPStore at `address` (or the caller passes a store); every
decision of a refit is a short UTF-8 or JSON value there (no pickle), and bytes move
through one process group per replica (layoutlang/runtime/jobgroups.py).

One refit n, as the keys say it (all under `layoutlang/jobs/`)::

    engine rank t     replica/R/wait/t = "<nonce>/<call>/<c|s>/<epoch>"    it waits in `receive`
                      (in R's incarnation `epoch`; it sleeps on R's doorbell: layoutlang/runtime/jobwait.py)
    trainer rank 0    refit/n = {members, their waits and groups, refused, absent, plan digest},
                      then rings every replica's doorbell
    trainer ranks     meet "start" (each one's tensors checked), then rank 0: refit/n/go
                      ("go", or "go strided" when a trainer rank's tensors are not contiguous)
    every rank        walks its steps of plan(K) until the one deadline (go + timeout)
    engine rank t     refit/n/done/R/t = "ok" or "fail\\n<why>"
    trainer ranks     meet "end" (each one's dropped replicas as its note)
    trainer rank 0    refit/n/verdict = {refit: [...], missed: {R: why}} (or {abort: why})
    everyone else     reads the verdict, then adds 1 to refit/n/read

A replica is a member of refit n when every one of its ranks waits (has called
`receive`) when rank 0 opens it; later ones join refit n+1. A replica whose transfers
fail, time out or do not finish by the deadline is missed: it is dropped whole, its group
severed on the rank that found it (layoutlang/runtime/jobgroups.py: every rank of it, and through them
every trainer rank, stops its messages with it at once), the trainer and the other
replicas finish the step, its ranks raise `RefitError`, its tensors are marked
`interrupted` and keep their previous version. Its wait values are cleared and its
group is not used again: a restarted (or retrying) replica gets a new group and the
whole of its weights at the next refit. Every rank cuts its buckets as staged transfers
when any rank of the membership holds a non-contiguous tensor (`c|s` of the waits, the
start meeting's mark): the cut must be the same on every rank. Rank 0 reads `refit/n/read` before it lets its
store go (`close`), so the store's host may exit right after `close` returns.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from layoutlang.diagnostics import LayoutError, UsageError
from layoutlang.elaborate import load, loads
from layoutlang.ir import Layout

from .errors import RefitError
from .jobplans import KEPT, ReplicaPlans, arg_value, args_json, keep, layout_difference, published, text_digest
from .jobgroups import (JobWalk, Membership, ReplicaGroup, ReplicaLost, build_group, close_links, failure_text,
                        job_transport, sever)
from .jobwait import CLOSE_WAIT, bell, born, current_waits, epoch_of, is_strided, ring, sleep_until_rung, wait_value
from .refit import not_contiguous, shape_problem
from .rendezvous import Abandoned, Rendezvous, StoreUnreachable

NAMESPACE = "layoutlang/jobs/"
MEET_GRACE = 0.4     # s the trainer's "end" meeting waits past the walks' deadline
GRACE = 1.0          # s a reader waits for a verdict past its own deadline (the writer's is no later)
GO, GO_STRIDED = "go", "go strided"   # refit/n/go: the walk may start (buckets cut as staged)
POLL = 0.05          # s between looks while trainer rank 0 waits for the replicas a refit expects
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class JobReport:
    """What one `TrainerJob.refit` did: which replicas hold `version` now, which were dropped and why."""

    refit: int
    version: object
    replicas: tuple[str, ...]            # refit exactly this step
    missed: tuple[str, ...]              # members dropped this step, and replicas refused
    reasons: dict[str, str] = field(default_factory=dict)  # missed id -> why
    seconds: float = 0.0
    # replica id -> what moved the bytes of this trainer rank's pairs with it: "memory (cma)",
    # "memory (ring)", "group (gloo)", ... ("memory (cma), group (gloo)" where its pairs went both ways)
    transports: dict[str, str] = field(default_factory=dict)


class _Store:
    """The job's store calls, each failure one of two: TimeoutError, or StoreUnreachable
    (its host, trainer rank 0, is gone)."""

    def __init__(self, store, where: str):
        self.store, self.where = store, where

    def call(self, fn, *args):
        try:
            return fn(*args)
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise TimeoutError(str(exc).splitlines()[0]) from None
            raise StoreUnreachable(self._gone(exc)) from None
        except (dist.DistError, RuntimeError, OSError) as exc:
            raise StoreUnreachable(self._gone(exc)) from None

    def _gone(self, exc) -> str:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"the trainer job's store{self.where} is unreachable (trainer rank 0 hosts it; it ended or died): {first}"

    def set(self, key: str, value: str) -> None:
        self.call(self.store.set, key, value)

    def get(self, key: str) -> str:
        return self.call(self.store.get, key).decode("utf-8", errors="replace")

    def has(self, *keys: str) -> bool:
        return bool(self.call(self.store.check, list(keys)))

    def add(self, key: str, amount: int) -> int:
        return int(self.call(self.store.add, key, amount))

    def wait(self, keys: list[str], deadline: float) -> None:
        """Until every key exists, or TimeoutError at `deadline` (time.monotonic())."""
        self.call(self.store.wait, keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    def many(self, keys: list[str]) -> list[str]:
        return [v.decode("utf-8", errors="replace") for v in self.call(self.store.multi_get, keys)] if keys else []

    def clear(self, key: str, expected: str) -> None:
        """Empty `key` if it still holds `expected` (a newer value is somebody's current one)."""
        self.call(self.store.compare_set, key, expected, "")

    def delete(self, key: str) -> None:
        try:
            self.call(self.store.delete_key, key)
        except (StoreUnreachable, TimeoutError):
            pass


def _connect(address: str | None, store, rank0: bool, timeout: timedelta) -> tuple[_Store, object]:
    """The job's store: the caller's, or a TCPStore at `address` that trainer rank 0 hosts."""
    if store is None:
        if not address or ":" not in address:
            raise UsageError(f"address {address!r}: expected HOST:PORT (trainer rank 0 hosts the store there)")
        host, port = address.rsplit(":", 1)
        try:
            store = dist.TCPStore(host, int(port), None, rank0, timeout, wait_for_workers=False)
        except (dist.DistError, RuntimeError, OSError) as exc:
            raise RefitError(f"cannot {'host' if rank0 else 'reach'} the trainer job's store at {address}: "
                             f"{(str(exc).strip().splitlines() or [''])[0]}", phase="setup",
                             help="check the address and that trainer rank 0 runs (it hosts the store)") from None
        where = f" at {address}"
    else:
        where = ""
    owner = store
    return _Store(dist.PrefixStore(NAMESPACE, store), where), owner


def _as_timeout(t) -> timedelta:
    return t if isinstance(t, timedelta) else timedelta(seconds=t)


def _as_layout(x, args) -> Layout:
    return x if isinstance(x, Layout) else load(os.fspath(x), args, unknown_args="ignore")


def tensor_problems(layout: Layout, rank: int, tensors, side: str) -> list[str]:
    """What is wrong with a rank's tensors against its layout: missing, shape, dtype."""
    held = [t for t in layout.tensors if t.holds(rank)]
    if held and tensors is None:
        return [f"{side} tensors are None but this rank holds {len(held)} {side} tensors"]
    problems = []
    for t in held:
        if t.name not in tensors:
            problems.append(f"{side} tensor `{t.name}` is missing")
        else:
            problem = shape_problem(t, tensors[t.name], rank)
            if problem:
                problems.append(f"{side} tensor `{t.name}`: {problem}")
        if len(problems) > 8:
            break
    return problems


def _error(who: str, n: int, phase: str, detail: str, *, reusable: bool, help: str, replica: str | None = None,
           rank: int | None = None, peers=()) -> RefitError:
    err = RefitError(f"{who}: refit {n}, {phase}: {detail}" if n else f"{who}: {phase}: {detail}", rank=rank,
                     step=n, phase=phase, peers=tuple(peers), reusable=reusable, detail=detail, help=help)
    err.replica = replica
    return err


TRAINER_AGAIN = "nothing was moved: call refit again on every trainer rank"
TRAINER_BROKEN = ("a trainer rank failed while bytes moved: the replicas keep their previous version "
                  "(marked interrupted); restart the trainer job")
ENGINE_AGAIN = ("call receive again on every rank of this replica: the next refit it takes part in "
                "rewrites every element")


class TrainerJob:
    """Every trainer rank: refit the member engine replicas from this rank's tensors.

    `train` / `infer`: the trainer's layout and ONE replica's (paths or loaded layouts; args
    through `src_args` / `dst_args`). `address`: HOST:PORT of the job's store, hosted by rank
    0 (or pass `store=`). `timeout` bounds one refit: the start (every trainer rank present),
    then everything from go to the verdict, so set it above one refit's transfer time.
    `budget_bytes`, `overlap`, `verify`, `keep_staging`, `device` as for Refitter; the engines
    take the first three from the trainer. `expect_wait`: how long rank 0 waits for the replicas
    a refit `expect`s (half the timeout by default), before the refit's own timeout starts.
    `transport`: what moves the bytes between this job and its replicas (docs/jobs.md
    "Transports"): "auto" (shared memory for the pairs of ranks on one host, each replica's
    process group for the others), "memory" (every pair through shared memory: a replica with
    a pair that cannot is dropped, naming it), "nixl" (every pair through NIXL one-sided writes,
    an agent per rank and replica group; needs NIXL's package) or "group"; the engines follow
    this choice.
    """

    def __init__(self, train, infer, *, address: str | None = None, rank: int, world_size: int, store=None,
                 timeout: timedelta | float = timedelta(seconds=60), budget_bytes: int | None = None,
                 verify: bool = False, overlap: bool = False, keep_staging: bool | None = None, device=None,
                 src_args: dict | None = None, dst_args: dict | None = None, hooks=None,
                 connect_timeout: timedelta | float | None = None, expect_wait: timedelta | float | None = None,
                 transport: str = "auto"):
        self.transport = job_transport(transport)
        self.src, self.one = _as_layout(train, src_args), _as_layout(infer, dst_args)
        self.rank, self.world = rank, world_size
        self.who = f"trainer rank {rank}"
        if self.src.ranks != world_size:
            raise UsageError(f"{self.src.path} spans {self.src.ranks} ranks but the trainer job has {world_size}")
        if len(self.src.sources) > 1:
            raise UsageError(f"{self.src.path} includes other files: a trainer layout travels to the engines as "
                             "one text, so write it without `include` for a refit between jobs")
        self.timeout = _as_timeout(timeout)
        # how long rank 0 waits for the replicas a refit expects, before the refit's own timeout
        self.expect_wait = (self.timeout / 2 if expect_wait is None else _as_timeout(expect_wait)).total_seconds()
        self.options = dict(budget_bytes=budget_bytes, verify=verify, overlap=overlap)
        self.keep_staging, self.device, self.hooks = keep_staging, device, hooks
        self.kv, self._owner = _connect(address, store, rank == 0, _as_timeout(connect_timeout or timeout))
        self._rv = Rendezvous(self.kv.store, rank, world_size, "trainer")
        self.plans = ReplicaPlans(self.src, self.one)
        self._walks: dict[tuple, JobWalk] = {}
        self._groups: dict[str, object] = {}
        self._n = 0
        self._broken: str | None = None
        self._mine: dict[int, list[str]] = {}   # refit -> keys this rank set (deleted two refits later)
        self._last_read: tuple[int, int] | None = None  # (refit, readers) rank 0 lets go of at close
        # rank 0's view of the replicas: registration order, layouts checked, group generations
        self._known: list[str] = []
        self._seen = 0
        self._layout_verdict: dict[str, tuple[str, str | None, dict | None]] = {}  # text, why, args
        self._generation: dict[str, tuple[tuple[str, ...], int]] = {}
        self._next_generation: dict[str, int] = {}
        if rank == 0:
            text = {"text": self.src.source_text, "args": dict(self.src.args), "path": self.src.path,
                    "digest": self.src.digest, "ranks": self.src.ranks, "transport": self.transport, **self.options}
            self.kv.set("trainer/layout", json.dumps(text))
            self.kv.set("trainer/closed", "")

    # ---- one refit ------------------------------------------------------------------
    def refit(self, tensors, version, *, expect=()) -> JobReport:
        """Move this rank's tensors into every member replica; return who got `version`.

        `expect` (rank 0 reads it): replica ids to wait for, up to `expect_wait` (half the
        timeout by default), before the membership is fixed (a caller that just told those
        engines to receive, as vLLM's update flow does); others join when they are waiting, as
        always. An expected replica whose ranks do not all wait by then is left out of this
        refit and named in `report.missed` ("did not wait in receive within ..."); the refit
        of the others then has its whole timeout.

        Raises RefitError when the trainer itself cannot refit (a rank late, missing, with
        wrong tensors, or failing while bytes move); a replica that fails is not an error
        here, it is in `report.missed`."""
        if self._broken is not None:
            raise _error(self.who, self._n + 1, "setup", f"this trainer job cannot refit again: {self._broken}",
                         reusable=False, help=TRAINER_BROKEN, rank=self.rank)
        json.dumps(version)  # a version travels as JSON
        self._n += 1
        n, began = self._n, time.monotonic()
        self._forget(n - 2)
        try:
            report = self._refit(n, tensors, version, began, tuple(expect))
        except StoreUnreachable as exc:
            self._broken = str(exc)
            raise _error(self.who, n, "setup", str(exc), reusable=False, help=TRAINER_BROKEN, rank=self.rank) from None
        except RefitError as exc:
            if not exc.reusable:
                self._broken = f"refit {n} failed in {exc.phase}: {exc.detail}"
            raise
        return report

    def _refit(self, n: int, tensors, version, began: float, expect: tuple = ()) -> JobReport:
        absent = {}
        if self.rank == 0:
            if expect:
                absent = self._await_replicas(expect, began + self.expect_wait)
            ann = self._announce(n, version, absent)
        else:  # (rank 0 may first wait `expect_wait` for the replicas its caller expects)
            ann = self._announcement(n, began + self.expect_wait + self.timeout.total_seconds())
        opened = time.monotonic()  # the refit's own timeout starts here, after any wait for expected replicas
        problems = tensor_problems(self.src, self.rank, tensors, "source")
        walks = []  # one per layout the members hold (replicas with their own args: ReplicaPlans)
        for entry, group in layout_groups(ann):
            walk = self._walk(len(group), entry["args"])
            walk.membership = self._membership(group, tensors)
            walk.connect(_device_of(tensors, self.device), opened + self.timeout.total_seconds())
            walks.append(walk)
        # from here one deadline bounds the refit: the start meeting, every walk, the end meeting
        # (its grace past it). Announcing and connecting had their own (a replica that does not
        # connect by then is dropped, and costs the others none of their time)
        deadline = time.monotonic() + self.timeout.total_seconds()
        strided = self._start(n, problems, ann, deadline, any(w.strided(tensors, None) for w in walks))
        dropped: dict[str, str] = {}
        carriers: dict[str, str] = {}
        for walk in walks:  # one after the other, all by the one deadline
            membership = walk.membership
            try:
                walk.walk(n, tensors, None, deadline, cut_strided=strided or members_strided(ann))
                carriers.update(walk.transport.carriers())
            except Exception as exc:  # noqa: BLE001 - a trainer rank that fails fails the refit everywhere
                reason = f"trainer rank {self.rank} failed in {walk._phase}: {failure_text(exc)}"
                self._rv.give_up(self._rv.key(n, "end"), reason, (self.rank,))
                self._abort(n, reason)
                raise _error(self.who, n, walk._phase, failure_text(exc), reusable=False, help=TRAINER_BROKEN,
                             rank=self.rank) from exc
            dropped.update({membership.replicas[s]: why for s, why in walk.dropped.items()})
        marked = self._end(n, dropped, deadline)
        verdict = self._verdict(n, ann, dropped, marked, deadline) if self.rank == 0 else self._read_verdict(n, deadline)
        if "abort" in verdict:
            raise _error(self.who, n, "verdict", verdict["abort"], reusable=False, help=TRAINER_BROKEN, rank=self.rank)
        missed = dict(verdict["missed"])
        for rid in missed:
            self._retire(rid, ann)
        return JobReport(n, version, tuple(verdict["refit"]), tuple(missed), missed, time.monotonic() - began,
                         carriers)

    # ---- rank 0 decides who takes part ---------------------------------------------
    def _announce(self, n: int, version, absent: dict | None = None) -> dict:
        self._register()
        members, refused = [], {}
        ranks = self.one.ranks
        for rid in self._known:
            base = f"replica/{rid}"
            if not self.kv.has(f"{base}/layout"):
                continue  # it has not connected yet
            why = self._refusal(rid)
            if why:  # every rank of it that waits now hears why (its rank count may not be ours)
                theirs = _ranks_of(self.kv.get(f"{base}/layout"))
                waiting = [k for k in (f"{base}/wait/{t}" for t in range(max(ranks, theirs))) if self.kv.has(k)]
                held = [(k, w) for k, w in zip(waiting, self.kv.many(waiting) if waiting else []) if w]
                if held:
                    refused[rid] = {"reason": why, "waits": [w for _, w in held]}
                    for key, value in held:
                        self.kv.clear(key, value)
                continue
            waits = current_waits(self.kv, rid, ranks)
            if waits is None:
                continue  # some rank is not there, not waiting in `receive`, or of an earlier incarnation
            nonces = tuple(w.split("/", 1)[0] for w in waits)
            known = self._generation.get(rid)
            if known is None or known[0] != nonces:
                generation = self._next_generation.get(rid, 0)
                self._next_generation[rid] = generation + 1
                known = self._generation[rid] = (nonces, generation)
            members.append({"id": rid, "waits": waits, "group": f"{rid}.{known[1]}",
                            "args": self._layout_verdict[rid][2]})
        layouts: list[dict] = []
        for m in members:  # the members that hold one layout form one group, in member order
            args = m.pop("args")
            index = next((i for i, e in enumerate(layouts) if e["args"] == args), None)
            if index is None:
                index = len(layouts)
                layouts.append({"args": args, "copies": 0})
            m["layout"] = index
            layouts[index]["copies"] += 1
        for entry in layouts:
            plan = self.plans.plan(entry["copies"], entry["args"])
            entry.update(digest=self.plans.layout(entry["args"]).digest, plan=plan.digest)
        listed = {m["id"] for m in members} | set(refused)
        absent = {rid: why for rid, why in (absent or {}).items() if rid not in listed}
        ann = {"refit": n, "version": version, "trainer": self.world, "members": members, "layouts": layouts,
               "refused": refused, "absent": absent}
        self.kv.set(f"refit/{n}", json.dumps(ann))
        self.kv.set("refit/latest", str(n))
        for rid in self._known:  # wake the replicas' waiting ranks (layoutlang/runtime/jobwait.py)
            ring(self.kv, rid)
        return ann

    def _await_replicas(self, rids: tuple, deadline: float) -> dict[str, str]:
        """Until every replica named has connected and all its ranks wait in `receive`, or the
        deadline (`expect_wait`); the ones that did not, with why."""
        ranks = self.one.ranks
        while True:
            late = [rid for rid in rids if not (self.kv.has(f"replica/{rid}/layout")
                                                 and current_waits(self.kv, rid, ranks) is not None)]
            if not late or time.monotonic() >= deadline:
                break
            time.sleep(POLL)
        self._register()
        return {rid: f"replica {rid} did not wait in receive within {self.expect_wait:g} s (this refit expected it)"
                for rid in late}

    def _register(self) -> None:
        """Replicas that connected since the last look, in the order they did."""
        count = self.kv.add("replicas/count", 0)
        while self._seen < count:
            key = f"replicas/{self._seen}"
            if not self.kv.has(key):
                break  # its id is set right after its number: next time
            rid = self.kv.get(key)
            if rid not in self._known:
                self._known.append(rid)
            self._seen += 1

    def _refusal(self, rid: str) -> str | None:
        """Why replica `rid`'s published layout cannot be planned for (None: it can, with the
        args kept beside the verdict: None for `one` itself, else the replica's own)."""
        text = self.kv.get(f"replica/{rid}/layout")
        cached = self._layout_verdict.get(rid)
        if cached is None or cached[0] != text:
            args = None
            try:
                theirs = json.loads(text)
                expected = self.one
                if theirs.get("digest") != self.one.digest and theirs.get("text") == text_digest(self.one) \
                        and isinstance(theirs.get("args"), dict):
                    args = theirs["args"]  # the same text, its own args (an EPLB map): planned for them
                    expected = self.plans.layout(args)
                why = layout_difference(expected, theirs)
                asked = theirs.get("transport", "auto")
                if why is None and asked not in ("auto", self.transport):
                    why = (f"it asked for transport {asked!r} but the trainer job moves bytes by {self.transport!r} "
                           "(the trainer's choice counts: give the replica transport=\"auto\" or the trainer's)")
            except (ValueError, TypeError, AttributeError) as exc:
                why = f"its layout description cannot be read: {exc}"
            except LayoutError as exc:
                why = f"its layout args do not load with {self.one.path}: {str(exc).splitlines()[0]}"
            cached = self._layout_verdict[rid] = (text, why, args)
        return cached[1]

    # ---- every trainer rank -----------------------------------------------------------
    def _announcement(self, n: int, deadline: float) -> dict:
        try:
            self.kv.wait([f"refit/{n}"], deadline)
        except TimeoutError:
            raise _error(self.who, n, "agreement", f"trainer rank 0 did not open refit {n} within "
                         f"{self.expect_wait + self.timeout.total_seconds():g} s (stalled or dead)", reusable=True, help=TRAINER_AGAIN,
                         rank=self.rank, peers=(0,)) from None
        return json.loads(self.kv.get(f"refit/{n}"))

    def _walk(self, copies: int, args: dict | None) -> JobWalk:
        key = (copies, json.dumps(args, sort_keys=True))
        if key not in self._walks:
            plan = self.plans.plan(copies, args)
            keep(self._walks, key, JobWalk(plan, rank=self.rank, membership=Membership(
                self.world, self.one.ranks, ("",) * copies, (None,) * copies), device=self.device,
                keep_staging=self.keep_staging, hooks=self.hooks, timeout=self.timeout, **self.options), KEPT)
        return self._walks[key]

    def _membership(self, members: list[dict], tensors) -> Membership:
        device = _device_of(tensors, self.device)
        groups = []
        for m in members:
            name = m["group"]
            if name not in self._groups:
                self._groups[name] = ReplicaGroup(name, build_group(self.kv.store, name, self.rank,
                                                  self.world + self.one.ranks, device, self.timeout),
                                                  store=self.kv.store)
            groups.append(self._groups[name])
        return Membership(self.world, self.one.ranks, tuple(m["id"] for m in members), tuple(groups),
                          self.transport)

    def _retire(self, rid: str, ann: dict) -> None:
        """A dropped replica's group is never used again (its pairs may be broken)."""
        for m in ann["members"]:
            if m["id"] == rid and m["group"] in self._groups:
                close_links(self._groups.pop(m["group"]))  # never destroyed (jobgroups._kept): only never used again
        if self.rank == 0:
            self._generation.pop(rid, None)

    def _start(self, n: int, problems: list[str], ann: dict, deadline: float, strided: bool) -> bool:
        """Every trainer rank present with the right tensors; then rank 0 tells the engines to go.
        Whether some trainer rank's tensors are not contiguous (`strided`: the buckets' cut)."""
        prefix = self._rv.key(n, "start")
        self._note_keys(n, prefix)
        try:
            troubled, anywhere = self._rv.meet(prefix, _until(deadline), what=f"start refit {n}",
                                               note="; ".join(problems)[:4000], marks=(bool(problems), strided))
        except Abandoned as exc:
            self._abort(n, f"the trainer did not start: {exc.reason}")
            raise _error(self.who, n, "agreement", exc.reason, reusable=True, help=TRAINER_AGAIN, rank=self.rank,
                         peers=exc.peers) from None
        if troubled:
            notes = self._rv.notes(prefix)
            bad = "; ".join(f"trainer rank {r}: {note}" for r, note in enumerate(notes) if note)
            self._rv.meet(self._rv.key(n, "start-read"), self.timeout, what="read the others' notes")
            self._abort(n, f"the trainer's tensors do not match its layout, nothing was moved: {bad}")
            raise _error(self.who, n, "agreement", f"local tensors do not match the layouts, nothing was moved: {bad}",
                         reusable=True, help=TRAINER_AGAIN, rank=self.rank)
        if self.rank == 0:
            self.kv.set(f"refit/{n}/go", GO_STRIDED if anywhere else GO)
        return bool(anywhere)

    def _abort(self, n: int, reason: str) -> None:
        """Rank 0 tells the member replicas that refit n will not complete."""
        if self.rank != 0:
            return
        try:
            if not self.kv.has(f"refit/{n}/go"):
                self.kv.set(f"refit/{n}/go", "abort\n" + reason)
            self.kv.set(f"refit/{n}/verdict", json.dumps({"abort": reason}))
        except (StoreUnreachable, TimeoutError):
            pass

    def _end(self, n: int, dropped: dict[str, str], deadline: float) -> int:
        """Every trainer rank finished its walk; how many of them dropped some replica."""
        prefix = self._rv.key(n, "end")
        self._note_keys(n, prefix)
        # the walks end by `deadline` (a wait that runs out drops its replica); the ranks that
        # walked meet just after it, so the one that did not arrive is the one named
        left = _until(deadline + MEET_GRACE)
        try:
            (marked,) = self._rv.meet(prefix, left, what=f"finish refit {n}",
                                      note=json.dumps(dropped) if dropped else "", marks=(bool(dropped),))
            return marked
        except Abandoned as exc:
            self._abort(n, exc.reason)
            raise _error(self.who, n, "finish", exc.reason, reusable=False, help=TRAINER_BROKEN, rank=self.rank,
                         peers=exc.peers) from None

    def _verdict(self, n: int, ann: dict, dropped: dict[str, str], marked: int, deadline: float) -> dict:
        """Rank 0: a replica is refit when no trainer rank dropped it and each of its ranks said ok."""
        if marked:
            for note in self._rv.notes(self._rv.key(n, "end")):
                if note:
                    for rid, why in json.loads(note).items():
                        dropped.setdefault(rid, why)
        ranks = self.one.ranks
        pending = [m for m in ann["members"] if m["id"] not in dropped]
        keys = [f"refit/{n}/done/{m['id']}/{t}" for m in pending for t in range(ranks)]
        try:
            self.kv.wait(keys, deadline + MEET_GRACE)
            present = keys
        except TimeoutError:
            present = [k for k in keys if self.kv.has(k)]
        said = dict(zip(present, self.kv.many(present)))
        self._mine.setdefault(n, []).extend(keys)
        missed = {rid: f"replica {rid}: {why}" for rid, why in dropped.items()}
        refit = []
        for m in pending:
            rid = m["id"]
            for t in range(ranks):
                value = said.get(f"refit/{n}/done/{rid}/{t}")
                if value is None:
                    missed.setdefault(rid, f"replica {rid} rank {t} did not finish refit {n} within "
                                           f"{self.timeout.total_seconds():g} s (stalled or dead)")
                elif value != "ok":
                    missed.setdefault(rid, f"replica {rid} rank {t}: {value.split(chr(10), 1)[-1]}")
            if rid not in missed:
                refit.append(rid)
        for rid, entry in ann["refused"].items():
            missed[rid] = f"replica {rid} refused: {entry['reason']}"
        missed.update(ann.get("absent", {}))
        for m in ann["members"]:
            if m["id"] in missed:  # its ranks wait no more (a dead one would be listed again)
                for t, value in enumerate(m["waits"]):
                    self.kv.clear(f"replica/{m['id']}/wait/{t}", value)
        verdict = {"refit": refit, "missed": missed}
        self.kv.set(f"refit/{n}/verdict", json.dumps(verdict))
        # who reads this verdict: the other trainer ranks, and every engine rank that said ok (one that
        # failed raised at once); `close` waits for them before the store may go
        self._last_read = (n, self.world - 1 + sum(1 for v in said.values() if v == "ok"))
        return verdict

    def _read_verdict(self, n: int, deadline: float) -> dict:
        try:
            self.kv.wait([f"refit/{n}/verdict"], deadline + GRACE)
        except TimeoutError:
            raise _error(self.who, n, "verdict", f"trainer rank 0 gave no verdict on refit {n} within "
                         f"{self.timeout.total_seconds():g} s", reusable=False, help=TRAINER_BROKEN,
                         rank=self.rank, peers=(0,)) from None
        verdict = json.loads(self.kv.get(f"refit/{n}/verdict"))
        self.kv.add(f"refit/{n}/read", 1)
        return verdict

    # ---- keys and the end -------------------------------------------------------------
    def _note_keys(self, n: int, prefix: str) -> None:
        keys = self._mine.setdefault(n, [f"{prefix}/here/{self.rank}"])
        if f"{prefix}/here/{self.rank}" not in keys:
            keys.append(f"{prefix}/here/{self.rank}")
        if self.rank == 0:
            keys += [f"{prefix}/count", f"{prefix}/gate"]

    def _forget(self, n: int) -> None:
        """Keys of refit n (two refits ago) that nobody reads any more."""
        keys = self._mine.pop(n, [])
        if self.rank == 0 and n > 0:
            keys += [f"refit/{n}", f"refit/{n}/go", f"refit/{n}/verdict", f"refit/{n}/read"]
            keys += [f"{self._rv.key(n, 'start-read')}/{k}" for k in ("count", "gate")]
        for key in keys:
            self.kv.delete(key)

    def close(self) -> None:
        """Rank 0 waits (at most `timeout`) until every rank that took part in the last refit
        has read its verdict, so that its store can go; then tells waiting engines the job is over."""
        if self.rank == 0 and self._owner is not None:
            if self._last_read is not None:
                n, readers = self._last_read
                deadline = time.monotonic() + self.timeout.total_seconds()
                try:
                    while self.kv.add(f"refit/{n}/read", 0) < readers and time.monotonic() < deadline:
                        time.sleep(0.002)
                except (StoreUnreachable, TimeoutError):
                    pass
            try:
                self._close_replicas()
            except (StoreUnreachable, TimeoutError):
                pass
        for group in self._groups.values():
            close_links(group)
        self._groups.clear()
        self._walks.clear()


    def _close_replicas(self) -> None:
        """Tell the waiting engine ranks that the job closed, and wait (at most CLOSE_WAIT) until
        each has said it saw it: its last store request (layoutlang/runtime/jobwait.py), so that none has
        one in flight when this process, the store's host, exits."""
        self._register()
        ranks = self.one.ranks
        waiting = []
        for rid in self._known:
            keys = [f"replica/{rid}/wait/{t}" for t in range(ranks)]
            present = [k for k in keys if self.kv.has(k)]
            epoch = self.kv.add(f"replica/{rid}/epoch", 0)
            waiting += [f"replica/{rid}/gone/{k.rsplit('/', 1)[1]}"   # (a dead rank's old wait: not waited for)
                        for k, v in zip(present, self.kv.many(present)) if v and epoch_of(v) == epoch]
        self.kv.set("trainer/closed", "closed")
        for rid in self._known:
            ring(self.kv, rid)
        give_up = time.monotonic() + CLOSE_WAIT
        while waiting and not self.kv.has(*waiting) and time.monotonic() < give_up:
            time.sleep(0.002)  # (checks: a store wait that runs out would log)


def layout_groups(ann: dict) -> list[tuple[dict, list[dict]]]:
    """Refit n's members by the layout they hold: (its `layouts` entry, its members in order)."""
    return [(entry, [m for m in ann["members"] if m["layout"] == i]) for i, entry in enumerate(ann["layouts"])]


def members_strided(ann: dict) -> bool:
    """Some rank of a member replica said its tensors are not contiguous (its wait's `s`)."""
    return any(is_strided(w) for m in ann["members"] for w in m["waits"])


def _ranks_of(text: str) -> int:
    """The rank count a replica's layout record says (0 if it says none)."""
    try:
        return int(json.loads(text).get("ranks", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


def _until(deadline: float) -> timedelta:
    """The time left until `deadline` (time.monotonic()), at least a millisecond."""
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _device_of(tensors, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for value in (tensors or {}).values():
        data = value if isinstance(value, torch.Tensor) else getattr(value, "data", None)
        if isinstance(data, torch.Tensor):
            return data.device
    return torch.device("cpu")


class EngineJob:
    """Every rank of one engine replica: take the trainer's weights into this rank's tensors.

    `infer`: the replica's layout (its ranks 0..world_size-1); `replica`: its id (letters,
    digits, `.`, `_`, `-`), the same on every rank of the replica and unique among live
    replicas; a restarted replica may reuse it. `version` is the version every element of
    this rank's tensors holds (None before the first refit); `interrupted` is True while they
    are partly written by a refit that did not complete. `transport`: "auto" (the default)
    takes the trainer job's choice; "group", "memory" or "nixl" asks for that one, and a trainer job
    that chose otherwise refuses the replica (the trainer's choice counts: docs/jobs.md).
    """

    def __init__(self, infer, *, address: str | None = None, replica: str, rank: int, world_size: int,
                 store=None, timeout: timedelta | float = timedelta(seconds=60), device=None,
                 keep_staging: bool | None = None, args: dict | None = None, hooks=None,
                 connect_timeout: timedelta | float | None = None, transport: str = "auto"):
        if not isinstance(replica, str) or not REPLICA_ID.fullmatch(replica):
            raise UsageError(f"replica id {replica!r}: expected letters, digits, `.`, `_` or `-` (at most 128)")
        self.transport = job_transport(transport)
        self._theirs = "group"   # the trainer job's transport, as it published it
        self.one = self._base = _as_layout(infer, args)
        self.replica, self.rank, self.world = replica, rank, world_size
        self.who = f"replica {replica} rank {rank}"
        if self.one.ranks != world_size:
            raise UsageError(f"{self.one.path} spans {self.one.ranks} ranks but replica {replica} has {world_size}")
        self.timeout = _as_timeout(timeout)
        self.device, self.keep_staging, self.hooks = device, keep_staging, hooks
        self.kv, self._owner = _connect(address, store, False, _as_timeout(connect_timeout or timeout))
        self.version = None
        self.interrupted = False
        self.nonce = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        self._calls = 0
        self._trainer: tuple[str, Layout, ReplicaPlans, dict] | None = None  # (its digest, layout, plans, options)
        self._walks: dict[tuple, JobWalk] = {}
        self._group: tuple[str, object] | None = None
        self._closed = False  # the trainer job closed: this rank makes no store request any more
        base = f"replica/{replica}"
        self.kv.set(f"{base}/wait/{rank}", "")
        self.epoch = born(self.kv, replica)  # a new incarnation: waits of earlier ones no longer count
        if rank == 0:
            self.kv.set(f"{base}/layout", json.dumps(self._published()))
            number = self.kv.add("replicas/count", 1) - 1
            self.kv.set(f"replicas/{number}", replica)
        self._prepare()

    def set_args(self, args: dict) -> None:
        """From the next refit on, this replica holds its layout with `args` over the ones it was
        started with: an EPLB rebalance moved its experts (a new map in the layout's table arg).
        Every rank of the replica calls it with the same args, between two `receive`s; rank 0
        publishes the layout again, so the trainer plans the next refit for it (one table arg
        changed: TablePlanner's re-plan). A refit the trainer planned for the old args fails on
        this replica without writing (the digests differ), and the next one is planned anew."""
        if len(self._base.sources) != 1:
            raise UsageError(f"{self._base.path} includes other files: a replica whose args change "
                             "publishes its layout as one text, so write it without `include`")
        merged = {**dict(self._base.args), **{k: arg_value(v) for k, v in args.items()}}
        layout = loads(self._base.source_text, self._base.path, merged, unknown_args="ignore")
        if layout.ranks != self.world:
            raise UsageError(f"{self._base.path} with those args spans {layout.ranks} ranks but replica "
                             f"{self.replica} has {self.world}")
        self.one = self._base if layout.digest == self._base.digest else layout
        if self.rank == 0:
            self.kv.set(f"replica/{self.replica}/layout", json.dumps(self._published()))

    def _published(self) -> dict:
        """What rank 0 says of this replica: its layout (`published`) and the transport it asks for."""
        return {**published(self.one), "transport": self.transport}

    def receive(self, tensors, *, wait: timedelta | float | None = None):
        """Block until the next refit this replica takes part in, write it into `tensors` in place,
        and return its version. Raises RefitError if this replica could not complete it (then
        `interrupted` says whether the tensors were touched) or if the trainer job is gone.
        `wait`: how long to wait for the trainer to open a refit (default: for ever)."""
        try:
            return self._receive(tensors, None if wait is None else _as_timeout(wait).total_seconds())
        except StoreUnreachable as exc:
            raise _error(self.who, 0, "waiting", str(exc), reusable=False, replica=self.replica,
                         rank=self.rank, help="the trainer job is gone: start a new one, then this replica") from None

    def _receive(self, tensors, wait: float | None):
        problems = tensor_problems(self.one, self.rank, tensors, "destination")
        if problems:
            raise _error(self.who, 0, "check", "local tensors do not match the layout, nothing was moved: "
                         + "; ".join(problems), reusable=True, help=ENGINE_AGAIN, replica=self.replica, rank=self.rank)
        if self._closed:
            raise self._gone()
        give_up = None if wait is None else time.monotonic() + wait
        strided = any(not_contiguous(v) for v in (tensors or {}).values())
        while True:
            n, ann, member = self._wait_for_refit(give_up, strided)
            if self.kv.has(f"refit/{n}/verdict"):
                continue  # we were listed but came too late (stalled): that refit is over, wait again
            return self._take_part(n, ann, member, tensors)

    def _wait_for_refit(self, give_up: float | None, strided: bool) -> tuple[int, dict, int]:
        """Announce that this rank waits (and whether its tensors are `strided`), then the first
        refit that lists this wait (n, its announcement, this replica's slot). Between looks it
        sleeps on the replica's doorbell (layoutlang/runtime/jobwait.py): rung when a refit opens, when a
        rank of this replica starts (the wait is written again, in the new incarnation) and when
        the trainer job closes; nothing times out while it waits, so nothing is logged."""
        self._calls += 1
        mine = f"replica/{self.replica}/wait/{self.rank}"
        written: list[str] = []  # this call's wait values (one per incarnation it saw)
        n = None
        while True:
            rung = bell(self.kv, self.replica)  # read before looking: a ring after the look wakes us
            if self.kv.has("trainer/closed") and self.kv.get("trainer/closed") == "closed":
                raise self._gone()
            epoch = self.kv.add(f"replica/{self.replica}/epoch", 0)
            value = wait_value(self.nonce, self._calls, strided, epoch)
            if not written or written[-1] != value:
                self.kv.set(mine, value)
                written.append(value)
            latest = int(self.kv.get("refit/latest")) if self.kv.has("refit/latest") else 0
            n = max(latest, 1) if n is None else n
            while n < latest and not self.kv.has(f"refit/{n}"):
                n += 1  # (forgotten two refits later: one that listed this wait would have been read)
            while self.kv.has(f"refit/{n}"):
                ann = json.loads(self.kv.get(f"refit/{n}"))
                refused = ann["refused"].get(self.replica)
                if refused is not None and any(w in refused["waits"] for w in written):
                    raise _error(self.who, n, "membership", f"the trainer refused this replica: {refused['reason']}",
                                 reusable=False, replica=self.replica, rank=self.rank,
                                 help="give this replica the layout the trainer job was started with")
                for slot, m in enumerate(ann["members"]):
                    if m["id"] == self.replica and m["waits"][self.rank] in written:
                        self.kv.clear(mine, written[-1])
                        return n, ann, slot
                n += 1
            if not sleep_until_rung(self.kv, rung, give_up):
                self.kv.clear(mine, written[-1])
                raise _error(self.who, 0, "waiting", "no refit started within the wait given",
                             reusable=True, replica=self.replica, rank=self.rank, help=ENGINE_AGAIN)

    def _gone(self) -> RefitError:
        """The trainer job closed: say so to its rank 0 (this rank's last store request: a set,
        which gets no reply), and never use the store again."""
        if not self._closed:
            self._closed = True
            try:
                self.kv.set(f"replica/{self.replica}/gone/{self.rank}", self.nonce)
            except (StoreUnreachable, TimeoutError):
                pass
        return _error(self.who, 0, "waiting", "the trainer job closed", reusable=False, replica=self.replica,
                      rank=self.rank, help="no refit will come from that trainer job: close this EngineJob")

    def _take_part(self, n: int, ann: dict, slot: int, tensors):
        member = ann["members"][slot]
        entry, together = layout_groups(ann)[member["layout"]]  # the members planned with this one
        copies, slot = len(together), together.index(member)
        walk, fail, group = None, None, None
        try:
            walk = self._walk(ann, entry, copies, slot)
            if self.transport not in ("auto", self._theirs):
                raise _error(self.who, n, "setup", f"this replica asked for transport {self.transport!r} but the "
                             f"trainer job moves bytes by {self._theirs!r}", reusable=False, replica=self.replica,
                             rank=self.rank, help="give the replica transport=\"auto\" or the trainer's")
            group = self._group_for(member["group"], ann["trainer"], tensors)
            walk.membership = Membership(ann["trainer"], self.one.ranks, tuple(m["id"] for m in together),
                                         tuple(group if i == slot else None for i in range(copies)), self._theirs)
            walk.connect(_device_of(tensors, self.device), time.monotonic() + self.timeout.total_seconds())
        except (RefitError, ReplicaLost) as exc:
            fail = failure_text(exc)
        opened = time.monotonic()
        try:
            self.kv.wait([f"refit/{n}/go"], opened + self.timeout.total_seconds() + GRACE)
        except TimeoutError:
            raise self._fail(n, "start", f"the trainer did not start refit {n} within "
                             f"{self.timeout.total_seconds():g} s", touched=False) from None
        go = self.kv.get(f"refit/{n}/go")
        if go not in (GO, GO_STRIDED):
            raise self._fail(n, "start", go.split("\n", 1)[-1], touched=False)
        deadline = time.monotonic() + self.timeout.total_seconds()
        self.interrupted = True   # from here on, bytes may land
        if fail is None:
            try:
                mismatches = walk.walk(n, None, tensors, deadline,
                                       cut_strided=go == GO_STRIDED or members_strided(ann))
                if mismatches:
                    fail = "verification failed: destination contents differ from the source: " + "; ".join(mismatches)
            except Exception as exc:  # noqa: BLE001 - any failure loses this replica's step
                fail = failure_text(exc)
            except BaseException:  # (SystemExit, KeyboardInterrupt: the engine shuts down, maybe slowly)
                sever(group)  # its trainer ranks must not wait for it while it does
                raise
        if fail is not None:  # this rank leaves the walk: every trainer rank must learn it now (jobgroups.sever)
            sever(group)
        self.kv.set(f"refit/{n}/done/{self.replica}/{self.rank}", "ok" if fail is None else "fail\n" + fail[:2000])
        if fail is not None:
            raise self._fail(n, walk._phase if walk is not None else "setup", fail, touched=True)
        try:
            self.kv.wait([f"refit/{n}/verdict"], deadline + GRACE)
        except TimeoutError:
            raise self._fail(n, "verdict", f"trainer rank 0 gave no verdict on refit {n} in time",
                             touched=True) from None
        verdict = json.loads(self.kv.get(f"refit/{n}/verdict"))
        self.kv.add(f"refit/{n}/read", 1)
        if "abort" in verdict:
            raise self._fail(n, "verdict", verdict["abort"], touched=True)
        if self.replica not in verdict["refit"]:
            raise self._fail(n, "verdict", verdict["missed"].get(self.replica, "the trainer dropped this replica"),
                             touched=True)
        self.version, self.interrupted = ann["version"], False
        return self.version

    def _fail(self, n: int, phase: str, detail: str, *, touched: bool) -> RefitError:
        """This replica did not complete refit n: its group goes (its pairs may be broken)."""
        if self._group is not None:
            close_links(self._group[1])
        self._group = None  # never destroyed (jobgroups._kept): only never used again
        help = ENGINE_AGAIN + ("" if touched else " (nothing was written: the tensors hold version "
                                                  f"{self.version})")
        return _error(self.who, n, phase, detail, reusable=True, help=help, replica=self.replica, rank=self.rank)

    def _walk(self, ann: dict, entry: dict, copies: int, slot: int) -> JobWalk:
        if entry["digest"] != self.one.digest:
            raise _error(self.who, ann["refit"], "setup", f"the trainer planned refit {ann['refit']} for layout "
                         f"{entry['digest'][:12]} but this replica holds {self.one.digest[:12]} (its args changed "
                         "since: set_args)", reusable=True, help=ENGINE_AGAIN, replica=self.replica, rank=self.rank)
        walk = self._walk_for(ann["trainer"], copies, slot)
        if walk.plan.digest != entry["plan"]:
            raise _error(self.who, ann["refit"], "setup", f"this replica's plan for {copies} replicas "
                         f"({walk.plan.digest[:12]}) differs from the trainer's ({entry['plan'][:12]}): different "
                         "layouts or layoutlang versions", reusable=True, help=ENGINE_AGAIN,
                         replica=self.replica, rank=self.rank)
        return walk

    def _walk_for(self, trainer: int, copies: int, slot: int) -> JobWalk:
        """This rank's walk of the plan into `copies` replicas holding this one's layout, this
        replica in `slot` (kept: the next refit of the same membership reuses it)."""
        _, src, plans, options = self._trainer_layout()
        args = None if self.one is self._base else args_json(self.one)
        key = (copies, slot, self.one.digest)
        if key not in self._walks:
            plan = plans.plan(copies, args)
            rank = trainer + self.rank * copies + slot
            keep(self._walks, key, JobWalk(plan, rank=rank, membership=Membership(
                trainer, self.one.ranks, ("",) * copies, (None,) * copies), device=self.device,
                keep_staging=self.keep_staging, hooks=self.hooks, timeout=self.timeout, **options), KEPT)
        return self._walks[key]

    def _prepare(self) -> None:
        """Before the first refit (a started or restarted replica): load the trainer's layout and
        plan the membership this replica most likely joins, the latest refit's with this replica
        in it (in its slot there, or after the others), so that its first refit costs what any
        other does. Best effort: a guess that misses is planned when the refit comes."""
        try:
            if not (self.kv.has("trainer/layout") and self.kv.has("refit/latest")):
                return
            key = f"refit/{self.kv.get('refit/latest')}"
            if not self.kv.has(key):
                return
            ann = json.loads(self.kv.get(key))
            mine = [m for m in ann["members"] if m["id"] == self.replica]
            if mine:
                together = layout_groups(ann)[mine[0]["layout"]][1]
                copies, slot = len(together), together.index(mine[0])
            else:
                copies = slot = sum(1 for m in ann["members"] if m["layout"] == 0)
                copies += 1
            walk = self._walk_for(ann["trainer"], copies, slot)
            for strided in (False, True):
                walk.schedule(strided, cut=True)
        except Exception:  # noqa: BLE001 - a warm-up: the refit itself reports what is wrong
            return

    def _trainer_layout(self):
        """The trainer's layout, as its rank 0 left it in the store (text and args: data)."""
        text = json.loads(self.kv.get("trainer/layout"))
        self._theirs = text.get("transport", "group")  # (a trainer of an earlier version: its groups)
        if self._trainer is None or self._trainer[0] != text["digest"]:
            src = loads(text["text"], text["path"], {k: arg_value(v) for k, v in text["args"].items()},
                        unknown_args="ignore")
            options = {k: text[k] for k in ("budget_bytes", "verify", "overlap")}
            self._trainer = (text["digest"], src, ReplicaPlans(src, self._base), options)
            self._walks.clear()
        return self._trainer

    def _group_for(self, name: str, trainer: int, tensors):
        if self._group is None or self._group[0] != name:
            if self._group is not None:
                close_links(self._group[1])
            pg = build_group(self.kv.store, name, trainer + self.rank, trainer + self.one.ranks,
                             _device_of(tensors, self.device), self.timeout)
            self._group = (name, ReplicaGroup(name, pg, store=self.kv.store))
        return self._group[1]

    def close(self) -> None:
        """Stop waiting for refits (this rank leaves the next memberships)."""
        if not self._closed:  # (once the trainer job closed, its store may be gone: not touched)
            self._closed = True
            try:
                self.kv.set(f"replica/{self.replica}/wait/{self.rank}", "")
            except (StoreUnreachable, TimeoutError):
                pass
        if self._group is not None:
            close_links(self._group[1])
        self._group = None
        self._walks.clear()
