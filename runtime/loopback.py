"""Every rank's steps in one process: a refit whose ranks share one device (or the CPU).

The same steps the Refitter walks (compiler/steps.py), with the same handlers
(`BucketRun`), except that a message is a copy between two buffers of this
process instead of a point-to-point transfer: a colocated trainer and engine on
one accelerator, a one-device measurement of the data path (benchmarks/gpu_refit.py),
and a check of the steps without a process group (tests/test_loopback.py).

Ranks advance bucket by bucket; within a bucket, each rank runs its steps up to
the first that reads a round's messages (a `land` or the `wait`), and goes on
once every message of that round it receives has been posted by its sender
(rounds increase on every rank, so some rank always can)."""

from __future__ import annotations

import torch

from layoutlang.compiler import Plan
from layoutlang.compiler.steps import MESSAGES, schedule

from .bucket import BucketRun
from .errors import RefitError
from .refit import RefitHooks, StagingMeter, _as_given, _shape_problem


class _Rank:
    """What a rank's `BucketRun` reads of its Refitter, without a process group."""

    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank, self.group = plan, rank, None
        self.src_held = {t.name: t for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
        self.dst_held = {t.name: t for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)}
        self.entry = {e.key: e for e in plan.tensors}
        self.hooks = RefitHooks()
        self.recording = None  # (a steady Refitter's record; none here)
        self.meter = StagingMeter()
        self.sent_bytes = self.received_bytes = self.local_bytes = 0

    def _peer(self, rank: int) -> int:
        return rank


class _LoopbackRun(BucketRun):
    """A rank's bucket whose messages go through the shared `mail` (keyed by op and message)."""

    def __init__(self, rank: _Rank, ops, src, dst, device, mail: dict):
        super().__init__(rank, ops, src, dst, device)
        self.mail = mail
        self.inbox: dict[int, list] = {}  # round -> [(key, buffer)] this rank receives
        self.delivered: set[int] = set()  # rounds whose messages are in

    def _message(self, step, buf: torch.Tensor, sending: bool) -> None:
        what = MESSAGES[step.kind][0]  # send/recv are one message ("send"); amax, reply
        key = (step.op.id, "send" if what == "recv" else what, step.round)
        if sending:
            self.mail[key] = buf
        else:
            self.inbox.setdefault(step.round, []).append((key, buf))

    def ready(self, round_: int) -> bool:
        return all(key in self.mail for key, _ in self.inbox.get(round_, ()))

    def _post(self, step) -> None:
        pass

    def _await(self, round_: int, which) -> None:
        """The round's messages, all at once (the driver let this rank go: every one is posted)."""
        for key, buf in self.inbox.pop(round_, ()):
            buf.copy_(self.mail.pop(key).reshape(buf.shape))
        self.delivered.add(round_)

    def _wait(self, step) -> None:
        self._await(step.round, ())


def _walk(run: _LoopbackRun, steps):
    """Run the steps, pausing before the first that reads a round's messages (a land or the
    wait; yielding the round) until the driver says go."""
    for step in steps:
        if step.kind in ("wait", "land") and step.round not in run.delivered:
            yield step.round
        run.do(step)


class LoopbackRefitter:
    """`Refitter` for every rank at once, in this process: schedules made once, `refit` per step."""

    def __init__(self, plan: Plan, *, device=None, budget_bytes: int | None = None):
        self.plan = plan
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ranks = {r: _Rank(plan, r) for r in range(plan.world)}
        self.schedules = {r: schedule(plan, r, budget_bytes) for r in self.ranks}

    def refit(self, src: dict[int, dict], dst: dict[int, dict]) -> dict[int, _Rank]:
        """`src[rank]` / `dst[rank]`: the tensors each rank holds (as the Refitter takes them);
        destinations are written in place. Returns each rank's counters (`sent_bytes`,
        `received_bytes`, `local_bytes`, `meter`), accumulated over calls."""
        ranks, plans = self.ranks, self.schedules
        srcs = {r: _as_given(src.get(r), ranks[r].src_held) for r in ranks}
        dsts = {r: _as_given(dst.get(r), ranks[r].dst_held) for r in ranks}
        for b in range(len(plans[0].buckets) if ranks else 0):
            mail: dict = {}
            runs = {r: _LoopbackRun(ranks[r], plans[r].ops[b], srcs[r], dsts[r], self.device, mail) for r in ranks}
            walks = {r: _walk(runs[r], plans[r].steps[b]) for r in ranks}
            at = {r: next(walks[r], None) for r in ranks}  # the round each rank waits for, None: done
            while any(x is not None for x in at.values()):
                go = [r for r, x in at.items() if x is not None and runs[r].ready(x)]
                if not go:
                    raise AssertionError(f"bucket {b}: no rank can finish its round: {at}")
                for r in go:
                    at[r] = next(walks[r], None)
            if mail:
                raise AssertionError(f"bucket {b}: messages never received: {sorted(mail)[:4]}")
            for r in ranks:
                ranks[r].meter.reset_bucket()
        return ranks


def refit(plan: Plan, src: dict[int, dict], dst: dict[int, dict], *, device=None,
          budget_bytes: int | None = None) -> dict[int, _Rank]:
    """One refit of every rank of `plan` in this process (`LoopbackRefitter(...).refit`)."""
    return LoopbackRefitter(plan, device=device, budget_bytes=budget_bytes).refit(src, dst)


class _LocalRun(BucketRun):
    """A bucket of local copies only: its rounds carry no message, so posting and waiting do nothing."""

    def _post(self, step) -> None:
        pass

    def _wait(self, step) -> None:
        pass


def run_rank(plan: Plan, rank: int, src: dict, dst: dict, *, device=None,
             budget_bytes: int | None = None) -> _Rank:
    """One rank's steps alone, when every op of it is local: a load from files that every rank
    reads (layoutlang/checkpoint/load.py). The rank's tensors are checked against the layouts
    first (as a Refitter's agreement does), nothing is written when one is wrong."""
    me = _Rank(plan, rank)
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
            elif (problem := _shape_problem(t, _as_given({name: given[name]}, held)[name], rank)):
                problems.append(f"{side} tensor `{name}`: {problem}")
    if problems:
        raise RefitError.at(rank, 0, "setup", "local tensors do not match the layouts, nothing was written: "
                            + "; ".join(problems[:8]), reusable=True)
    device = torch.device(device) if device is not None else torch.device("cpu")
    sched = schedule(plan, rank, budget_bytes)
    srcs, dsts = _as_given(src, me.src_held), _as_given(dst, me.dst_held)
    for b in range(len(sched.buckets)):
        run = _LocalRun(me, sched.ops[b], srcs, dsts, device)
        for step in sched.steps[b]:
            run.do(step)
        me.meter.reset_bucket()
    return me


__all__ = ["LoopbackRefitter", "refit", "run_rank"]
