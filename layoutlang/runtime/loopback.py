"""Every rank's steps in one process: a refit whose ranks share one device (or the CPU).

The same steps the Refitter walks (layoutlang/compiler/steps.py), with the same handlers
(`BucketRun`), except that a message is a copy between two buffers of this
process instead of a point-to-point transfer: a colocated trainer and engine on
one accelerator, a one-device measurement of the data path (benchmarks/gpu_refit.py),
and a check of the steps without a process group (tests/test_loopback.py).

Ranks advance bucket by bucket; within a bucket, each rank runs its steps up to
the first that reads a round's messages (a `land` or the `wait`), and goes on
once every message of that round it receives has been posted by its sender
(rounds increase on every rank, so some rank always can)."""

from __future__ import annotations

from datetime import timedelta

import torch

from layoutlang.compiler import Plan
from layoutlang.compiler.steps import schedule

from .bucket import BucketRun
from .errors import RefitError
from .refit import RefitHooks, StagingMeter, as_given, shape_problem
from .transport import Transport


class Mail:
    """The messages of one process's ranks: a send is kept under (sender, receiver, n), its
    pair's n-th, and the pair's n-th receive copies it out. Every rank posts a round's
    messages in canonical op order, so a pair's n-th send and n-th receive are one message
    (what gloo's and NCCL's pairs rely on too)."""

    def __init__(self):
        self.sent: dict[tuple[int, int, int], torch.Tensor] = {}
        self.count: dict[tuple[int, int, bool], int] = {}   # (from, to, sending) -> messages posted

    def number(self, src: int, dst: int, sending: bool) -> int:
        key = (src, dst, sending)
        n = self.count.get(key, 0)
        self.count[key] = n + 1
        return n


class _Letter:
    """The work of one loopback message: a send is done when posted; a receive once its send
    is in the mail (`ready`), when waiting copies it."""

    def __init__(self, mail: Mail, key, buf: torch.Tensor | None):
        self.mail, self.key, self.buf = mail, key, buf

    def ready(self) -> bool:
        return self.buf is None or self.key in self.mail.sent

    def wait(self, timeout=None) -> bool:
        if self.buf is not None:
            self.buf.copy_(self.mail.sent.pop(self.key).reshape(self.buf.shape))
            self.buf = None
        return True


class LoopbackTransport(Transport):
    """Every rank in one process: a message is a copy between two of its buffers (`Mail`).
    A receive is waited for only once its sender posted it (the driver, `LoopbackRefitter`,
    runs a rank on only then: `ready`); a plan of local ops only posts nothing."""

    name = "loopback"

    def __init__(self, rank: int, world: int, mail: Mail | None = None):
        self.rank, self.world, self.mail = rank, world, mail if mail is not None else Mail()

    def place(self) -> tuple[int, int]:
        return self.rank, self.world

    def message(self, sending: bool, buf: torch.Tensor, rank: int):
        return (sending, buf, rank)

    def post(self, messages: list, what: str, calls=None) -> list:
        works = []
        for sending, buf, peer in messages:
            src, dst = (self.rank, peer) if sending else (peer, self.rank)
            key = (src, dst, self.mail.number(src, dst, sending))
            if sending:
                self.mail.sent[key] = buf
            works.append(_Letter(self.mail, key, None if sending else buf))
        return works

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        for work in works:
            if not work.ready():  # (the driver lets a rank wait only on posted messages)
                raise AssertionError(f"rank {self.rank}: {what} waited for before its sender posted it")
            work.wait()


class RankState:
    """What a rank's `BucketRun` reads of its Refitter, without a process group."""

    def __init__(self, plan: Plan, rank: int, mail: Mail | None = None):
        self.plan, self.rank, self.group = plan, rank, None
        self.src_held = {t.name: t for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
        self.dst_held = {t.name: t for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)}
        self.entry = {e.key: e for e in plan.tensors}
        self.hooks = RefitHooks()
        self.recording = None  # (a steady Refitter's record; none here)
        self.meter = StagingMeter()
        self.sent_bytes = self.received_bytes = self.local_bytes = 0
        self.timeout = timedelta(seconds=60)  # (a round's deadline: never reached, nothing waits here)
        self.transport = LoopbackTransport(rank, plan.world, mail)
        self.transport.bind(self)


def _ready(run: BucketRun, round_: int) -> bool:
    """Has every message this rank receives in the round been posted by its sender?"""
    return all(w.ready() for w in run.works.get(round_, ()))


def _walk(run: BucketRun, steps):
    """Run the steps, pausing before the first that reads a round's messages (a land or the
    wait; yielding the round) until the driver says go."""
    for step in steps:
        if step.kind in ("wait", "land") and not _ready(run, step.round):
            yield step.round
        run.do(step)


class LoopbackRefitter:
    """`Refitter` for every rank at once, in this process: schedules made once, `refit` per step."""

    def __init__(self, plan: Plan, *, device=None, budget_bytes: int | None = None):
        self.plan = plan
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.mail = Mail()
        self.ranks = {r: RankState(plan, r, self.mail) for r in range(plan.world)}
        self.schedules = {r: schedule(plan, r, budget_bytes) for r in self.ranks}

    def refit(self, src: dict[int, dict], dst: dict[int, dict]) -> dict[int, RankState]:
        """`src[rank]` / `dst[rank]`: the tensors each rank holds (as the Refitter takes them);
        destinations are written in place. Returns each rank's counters (`sent_bytes`,
        `received_bytes`, `local_bytes`, `meter`), accumulated over calls."""
        ranks, plans = self.ranks, self.schedules
        srcs = {r: as_given(src.get(r), ranks[r].src_held) for r in ranks}
        dsts = {r: as_given(dst.get(r), ranks[r].dst_held) for r in ranks}
        for b in range(len(plans[0].buckets) if ranks else 0):
            runs = {r: BucketRun(ranks[r], plans[r].ops[b], srcs[r], dsts[r], self.device) for r in ranks}
            walks = {r: _walk(runs[r], plans[r].steps[b]) for r in ranks}
            at = {r: next(walks[r], None) for r in ranks}  # the round each rank waits for, None: done
            while any(x is not None for x in at.values()):
                go = [r for r, x in at.items() if x is not None and _ready(runs[r], x)]
                if not go:
                    raise AssertionError(f"bucket {b}: no rank can finish its round: {at}")
                for r in go:
                    at[r] = next(walks[r], None)
            if self.mail.sent:
                raise AssertionError(f"bucket {b}: messages never received: {sorted(self.mail.sent)[:4]}")
            for r in ranks:
                ranks[r].meter.reset_bucket()
        return ranks


def refit(plan: Plan, src: dict[int, dict], dst: dict[int, dict], *, device=None,
          budget_bytes: int | None = None) -> dict[int, RankState]:
    """One refit of every rank of `plan` in this process (`LoopbackRefitter(...).refit`)."""
    return LoopbackRefitter(plan, device=device, budget_bytes=budget_bytes).refit(src, dst)


def run_rank(plan: Plan, rank: int, src: dict, dst: dict, *, device=None,
             budget_bytes: int | None = None) -> RankState:
    """One rank's steps alone, when every op of it is local: a load from files that every rank
    reads (layoutlang/checkpoint/load.py). The rank's tensors are checked against the layouts
    first (as a Refitter's agreement does), nothing is written when one is wrong."""
    me = RankState(plan, rank)
    remote = [op for op in plan.ops_for_rank(rank) if not op.local]
    if remote:
        raise RefitError.at(rank, 0, "setup", f"{len(remote)} op(s) of this rank are not local "
                            f"(first: {remote[0]}): this plan needs a Refitter on a group", reusable=True)
    problems = []
    for side, held, given in (("source", me.src_held, src), ("destination", me.dst_held, dst)):
        needed = held if side == "destination" else {op.src_name: held[op.src_name] for op in plan.ops_for_rank(rank)}
        for name, t in needed.items():
            if name not in (given or {}):
                problems.append(f"{side} tensor `{name}` is missing")
            elif (problem := shape_problem(t, as_given({name: given[name]}, held)[name], rank)):
                problems.append(f"{side} tensor `{name}`: {problem}")
    if problems:
        raise RefitError.at(rank, 0, "setup", "local tensors do not match the layouts, nothing was written: "
                            + "; ".join(problems[:8]), reusable=True)
    device = torch.device(device) if device is not None else torch.device("cpu")
    sched = schedule(plan, rank, budget_bytes)
    srcs, dsts = as_given(src, me.src_held), as_given(dst, me.dst_held)
    for b in range(len(sched.buckets)):
        run = BucketRun(me, sched.ops[b], srcs, dsts, device)  # (its rounds carry no message)
        for step in sched.steps[b]:
            run.do(step)
        me.meter.reset_bucket()
    return me


__all__ = ["LoopbackRefitter", "LoopbackTransport", "refit", "run_rank"]
