"""The groups of a refit between jobs, and the walk of one rank's steps through them.

A trainer job (N ranks, its own world) feeds K engine replicas (R ranks each,
their own worlds). Their plan (layoutlang/compiler/members.py) numbers trainer rank r as
plan rank r and replica i's local rank t as N + t*K + i. Bytes never cross
replicas (relays are off between jobs: docs/jobs.md), so the ranks that meet on
a wire are a trainer rank and a rank of ONE replica, and each replica gets a
process group of its own: the N trainer ranks (group ranks 0..N-1) and its R
ranks (group ranks N..N+R-1), built from the job's store under the group's
name, never through `init_process_group` and never the default group.

Why one group per replica: a replica that dies or stalls breaks the
connections of its own group only; the trainer drops it and keeps sending to
the others through theirs. Gloo groups are built lazily (TORCH_GLOO_LAZY_INIT:
a pair connects when it first exchanges bytes), so building one costs no
connection the plan does not use and never waits for a rank that is not there
yet; NCCL creates its point-to-point communicators per pair on first use too.
Both are the one code path of `build_group`.

`ReplicaTransport` is the transport (layoutlang/runtime/transport.py) of such groups, and `JobWalk`
a Refitter (layoutlang/runtime/refit.py) on it: the same steps, buckets, staging, quantizing and
verification, walked once per refit, with three differences the job's protocol
(layoutlang/runtime/jobs.py) relies on: no store meetings (the job meets), one deadline for the
whole walk, and on a trainer rank a failed transfer drops the replica at its other end
instead of failing the step (its later messages are not posted, the walk goes on for the
others).

Transports between jobs (`TrainerJob(..., transport=)`, docs/jobs.md "Transports"): beside its
group, a replica's pairs of ranks may be linked, met in the job's store under the group's
name: through shared memory (`MemoryLinks`, layoutlang/runtime/memlinks.py) or NIXL agents of
the group's own (`NixlLinks`, layoutlang/runtime/nixlagent.py: the "nixl" transport's protocol,
one agent per rank and group, so a restarted replica meets new agents). "auto" links every
pair whose two ranks share a host (CPU tensors) through shared memory, "memory" every pair,
"nixl" every pair through NIXL (a pair that cannot be linked drops its replica, naming the
pair), "group" none. A linked pair's messages go through its links, every other through the
group; a failure of either loses the replica alike, and `sever` closes both.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from layoutlang.compiler import Plan
from layoutlang.diagnostics import UsageError

from .errors import RefitError, first_line
from .memlinks import LinkError, MemoryLinks, Message as LinkMessage, Work as LinkWork, wait_all
from .nixlagent import NixlLinks, Work as NixlWork, nixl_module
from .refit import Refitter, StagingMeter, as_given, not_contiguous
from .transport import TRANSPORTS, Transport, transport_class

JOB_TRANSPORTS = ("auto", "group", "memory", "nixl")   # what moves bytes between jobs (docs/jobs.md "Transports")
STOPPED_GRACE = 0.5   # s a linked peer's process may be stopped (SIGSTOP) before its replica is dropped
ENV_MODE = "LAYOUTLANG_MEMORY_MODE"   # "ring": every channel a ring (as for transport_memory.py)


def job_transport(name) -> str:
    """A transport name a job takes: "auto", "group", "memory" or "nixl" (where NIXL's package is
    installed: else the UsageError saying how); an unknown name is the registry's UsageError, a
    known one not built between jobs a UsageError saying so."""
    if not isinstance(name, str) or name not in JOB_TRANSPORTS:
        if not isinstance(name, str) or name not in TRANSPORTS:
            transport_class(name if isinstance(name, str) else repr(name))  # (raises: names the known ones)
        raise UsageError(f"transport {name!r} is not built between jobs yet: a trainer job and its replicas "
                         "move bytes by \"auto\", \"group\", \"memory\" or \"nixl\"",
                         help="leave transport out (\"auto\": shared memory between the ranks of one host, "
                              "the replica's process group for the others)")
    if name == "nixl":
        nixl_module()  # (raises where the package is missing, saying how to install it)
    return name


_LAZY = threading.Lock()
_lazy_users = [0, None]  # groups being built now in this process, the value before the first


@contextmanager
def _lazy_gloo():
    """Gloo reads TORCH_GLOO_LAZY_INIT when a group is built; set it for ours alone.

    Threads of one process may build groups at once (in-process jobs): the first sets the
    variable and the last puts back what was there, so it never outlives the builds (a
    leaked `1` makes every later gloo group of the process, and of the processes it starts,
    connect on first use: a peer that holds its first message back then stalls the rest)."""
    with _LAZY:
        if _lazy_users[0] == 0:
            _lazy_users[1] = os.environ.get("TORCH_GLOO_LAZY_INIT")
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        _lazy_users[0] += 1
    try:
        yield
    finally:
        with _LAZY:
            _lazy_users[0] -= 1
            if _lazy_users[0] == 0:
                if _lazy_users[1] is None:
                    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
                else:
                    os.environ["TORCH_GLOO_LAZY_INIT"] = _lazy_users[1]


def build_group(store, name: str, rank: int, size: int, device: torch.device, timeout: timedelta):
    """A process group of `size` ranks named `name` in `store`: gloo for CPU tensors, NCCL for
    CUDA ones (the caller has set its CUDA device), nothing else differs. The group lives as
    long as the process (`_kept`)."""
    prefix = dist.PrefixStore(f"group/{name}/", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return _kept(dist.ProcessGroupNCCL(prefix, rank, size, options))
    with _lazy_gloo():
        return _kept(dist.ProcessGroupGloo(prefix, rank, size, timeout))


def _kept(pg):
    """Never destroy a job's group: a group whose peer died (or whose messages never completed)
    can block its destructor forever (gloo joins its transport loop, which waits on the broken
    pair; seen at interpreter exit, after every call had returned). A job cannot know which of
    its groups are sound, so it keeps one more reference to every group it builds, which nothing
    drops: the process's exit closes their sockets. Groups are per replica generation, so a
    long-lived trainer keeps one for each replica (re)start it served."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
    return pg


HELLO = 1 << 20   # the tag of a pair's first message (`hello`), apart from the plan's (tag 0)
SEVER = 1 << 21   # a tag no message ever carries: a receive posted on it only to close the group


@dataclass(eq=False)
class ReplicaGroup:
    """One replica's process group, and the group ranks this rank has exchanged a first message
    with (`hello`): connected pairs, which a walk's messages never wait to connect."""

    name: str
    pg: object
    connected: set = field(default_factory=set)
    severed: bool = False     # its connections are closed (`sever`): it is never used again
    store: object = None      # the job's store, where its links meet (`link`)
    links: dict = field(default_factory=dict)   # (plan, slot) -> this rank's MemoryLinks / NixlLinks in it


def link(group: ReplicaGroup, key: str, me: int, peers, transport: str, device: torch.device,
         deadline: float, who) -> tuple["MemoryLinks | NixlLinks | None", str | None]:
    """This rank's links to `peers` (ranks in the group) for the walks of plan and slot `key`,
    connected by `deadline`: (the links, None), (None, None) where the transport links nothing,
    or (None, why) where a pair cannot be linked ("memory", "nixl"). Shared memory
    (`MemoryLinks`) for "memory", and for "auto" the pairs on this host (CPU tensors); a NIXL
    agent of this group's (`NixlLinks`) for "nixl"; the rest keep the group. Met in the job's
    store under the group's name, so a new group (a restarted replica) gets new links (new
    agents); kept for the group's next refits of the same plan."""
    if transport == "group" or (transport == "auto" and device.type != "cpu") or not peers:
        return None, None
    links = group.links.get(key)
    if links is not None:
        return links, None
    if transport == "nixl":
        links = NixlLinks(group.store, f"nixl/{group.name}/{key}", me, peers, watch_stopped=STOPPED_GRACE)
    else:
        links = MemoryLinks(group.store, f"links/{group.name}/{key}", me, peers,
                            mode=os.environ.get(ENV_MODE) or None, local_only=transport == "auto",
                            watch_stopped=STOPPED_GRACE)
    kind = "nixl" if transport == "nixl" else "memory"
    try:
        links.connect(deadline)
    except LinkError as exc:
        return None, f"the {kind} transport cannot link {who(me)} and {who(exc.peer)}: {_named(exc, who)}"
    except UsageError as exc:  # (NIXL's package missing on this rank)
        return None, f"the {kind} transport cannot link {who(me)} to its peers: {exc.message}"
    except (Exception if kind == "nixl" else OSError) as exc:  # noqa: BLE001 - NIXL's own; a channel file this
        # rank could not create (/dev/shm full, say)
        return None, f"the {kind} transport cannot link {who(me)} to its peers: {first_line(exc)}"
    if group.severed:  # (given up meanwhile: a trainer rank's connect thread that ran late)
        links.sever()
    group.links[key] = links
    return links, None


def _named(exc: LinkError, who) -> str:
    """A LinkError's reason with its group ranks named as the job names them."""
    return re.sub(r"\b(peer )?rank (\d+)\b", lambda m: who(int(m.group(2))), exc.reason)


def close_links(group: "ReplicaGroup | None") -> None:
    """Unmap this rank's links in a group that is not used again (its files are long unlinked)."""
    if group is not None:
        for links in group.links.values():
            links.close()
        group.links.clear()


def hello(group: ReplicaGroup, peers, sending: bool, device: torch.device, deadline: float) -> str | None:
    """Connect this rank to `peers` (ranks in the group) before any byte of the plan moves: one
    one-element message each, sent by the trainer side, by `deadline`. None, or why not.

    Why: a lazily built group connects a pair when the pair first exchanges a message, and a
    connect to a rank that died can block for longer than any deadline; done here, in a
    thread per replica, a dead replica costs only its own thread. Once connected, a peer's
    death fails a transfer at once ("Connection closed by peer")."""
    todo = sorted(p for p in peers if p not in group.connected)
    if not todo:
        return None
    bufs = [torch.zeros(1, device=device) for _ in todo]
    try:
        works = [(group.pg.send if sending else group.pg.recv)([b], p, HELLO) for b, p in zip(bufs, todo)]
        for work in works:
            left = deadline - time.monotonic()
            if work.wait(left if left > 0.001 else 0.001) is False:
                return "its ranks did not connect in time"
    except Exception as exc:  # noqa: BLE001 - a transport error: this replica cannot take part
        return f"connecting failed: {first_line(exc)}"
    group.connected.update(todo)
    return None


def sever(group: "ReplicaGroup | None") -> None:
    """Close every connection of this rank in `group`, at once: the replica's walk is over for
    this rank, and every rank at the other end of a pair must learn it now, not at the deadline.

    Why: a rank that gives up on a replica (an engine rank whose transfer failed, a trainer rank
    that dropped the replica) but keeps its connections open leaves its peers' messages to it
    pending: a trainer rank waiting on one holds up every replica behind it. Closed, the pair
    fails the peer's pending and later messages at once ("Connection closed by peer"), so a
    failure anywhere in a replica's group spreads through that group alone, in milliseconds,
    and the walk of every other replica goes on. Gloo has no call that closes a group (its
    `abort` and `shutdown` leave the pairs open): a wait that runs out closes every pair of the
    group's context ("Application timeout caused pair closure"), so one receive on a tag no
    message carries, from a peer already connected, waited on for a millisecond, does it. NCCL:
    `abort`. The group is never used again (its replica's next refit gets a new one). Its
    shared-memory links close too (`MemoryLinks.sever`: the other ends fail at once)."""
    if group is None or group.severed:
        return
    group.severed = True
    for links in list(group.links.values()):
        links.sever()
    pg = group.pg
    try:
        if isinstance(pg, dist.ProcessGroupGloo):
            peers = sorted(group.connected)
            if peers:  # (a pair never connected has nothing to close: a lazy group would connect it)
                pg.recv([torch.zeros(1)], peers[0], SEVER).wait(timedelta(milliseconds=1))
        elif hasattr(pg, "abort"):
            pg.abort()
    except Exception:  # noqa: BLE001 - the closing itself is the expected error
        pass


@dataclass(frozen=True)
class Membership:
    """Who takes part in one refit: N trainer ranks, then the member replicas in slot order.

    >>> m = Membership(4, 2, ("a", "b", "c"), (None, None, None))
    >>> m.slot_of(4), m.slot_of(9), m.group_rank(9), m.slot_of(3)
    (0, 2, 5, None)
    """

    trainer: int                    # N
    replica_ranks: int              # R, every replica's size
    replicas: tuple[str, ...]       # replica ids, slot i = index
    groups: tuple                   # per slot, its ReplicaGroup (None where not built on this rank)
    transport: str = "group"        # "auto", "group" or "memory": the trainer job's (`link`)

    @property
    def copies(self) -> int:
        return len(self.replicas)

    def slot_of(self, plan_rank: int) -> int | None:
        """The replica slot of an engine's plan rank; None for a trainer rank."""
        return None if plan_rank < self.trainer else (plan_rank - self.trainer) % self.copies

    def plan_ranks(self, slot: int) -> range:
        """The plan ranks of the replica in `slot` (its local ranks 0..R-1)."""
        return range(self.trainer + slot, self.trainer + self.copies * self.replica_ranks, self.copies)

    def local_of(self, plan_rank: int) -> int:
        return (plan_rank - self.trainer) // self.copies

    def group_rank(self, plan_rank: int) -> int:
        """The rank in its replica's group: a trainer rank is itself, an engine rank N + local."""
        return plan_rank if plan_rank < self.trainer else self.trainer + self.local_of(plan_rank)


@dataclass
class _Message:
    """One message of a round, as JobWalk posts it (a `dist.P2POp` needs a registered group)."""

    sending: bool
    tensor: torch.Tensor
    slot: int
    group: object
    peer: int       # the other end's rank in `group`
    rank: int       # the other end's plan rank
    tag: int = 0
    links: object = None   # the pair's MemoryLinks where it is linked (the message goes there)


class _Done:
    """The work of a message not posted (its replica was dropped): waiting on it is a no-op."""

    def wait(self, timeout=None) -> bool:
        return True


DONE = _Done()


class ReplicaLost(Exception):
    """Raised inside an engine's walk: this replica cannot complete the refit."""


class ReplicaTransport(Transport):
    """Messages through the replicas' groups (`Membership.groups`), for one rank of a membership.

    On a trainer rank, `dropped` (slot -> reason) collects the replicas whose transfers
    failed in this walk; on an engine rank any failure raises (its replica is lost).

    Where the walk stands once a rank is gone is the same on every rank: a replica is dropped
    whole. The first failed message with any of its ranks (a dead peer's closed connection,
    a post on a closed pair, the deadline) ends every message to and from all of its ranks
    for the rest of the walk, and `sever` closes this rank's connections in its group, which
    fails the pending and later messages of every rank at their other ends at once: its live
    ranks stop (and sever theirs), so every other trainer rank drops it at its next message
    with it instead of waiting on a rank that will never read. Nothing is owed to or by a
    dropped replica; everything else is owed as planned, so no message of another replica
    ever waits on it.
    """

    name = "replicas"

    def __init__(self, rank: int, world: int, membership: Membership):
        self.rank, self.world = rank, world
        self.membership = membership
        self.dropped: dict[int, str] = {}
        self.skip: set[int] = set()      # plan ranks this rank no longer posts to (gone, unreachable)
        self.deadline = math.inf         # the walk's one deadline (time.monotonic())
        self.links: dict[int, MemoryLinks] = {}   # slot -> this walk's links with that replica (`connect`)
        self.peers: dict[int, set[int]] = {}      # slot -> the group ranks this rank's ops meet there
        self.on = torch.device("cpu")             # the device the walk's messages are on
        self.unreached: set[int] = set()

    @property
    def trainer_side(self) -> bool:
        return self.rank < self.membership.trainer

    def place(self) -> tuple[int, int]:
        return self.rank, self.world

    def meeting(self):
        return None  # the job meets (layoutlang/runtime/jobs.py); a walk has no store meeting

    def device(self) -> torch.device:
        return torch.device("cpu")  # no tensor said one: a walk's groups are built for the tensors' device

    def _other_end(self, op) -> int:
        return op.dst_rank if op.src_rank == self.rank else op.src_rank

    def connect(self, ops, device: torch.device, deadline: float) -> None:
        """Connect every pair these ops use, before the refit's go: its shared-memory links where
        the transport links it (`link`), else its group's connection (`hello`). A trainer rank
        drops the replicas it cannot reach (one thread each: a dead one costs only its own);
        an engine rank raises ReplicaLost."""
        m = self.membership
        peers: dict[int, set[int]] = {}
        for op in ops:
            if op.src_rank != op.dst_rank:
                other = self._other_end(op)
                peers.setdefault(m.slot_of(other if self.trainer_side else self.rank), set()).add(m.group_rank(other))
        self.dropped, self.skip, self.links, self.peers, self.on = {}, set(), {}, peers, device
        self.unreached: set[int] = set()   # slots this rank could not connect to (nothing moved there)
        if not self.trainer_side:
            for slot, ranks in peers.items():
                why = self._join(slot, ranks, device, deadline)
                if why:
                    raise ReplicaLost(f"the trainer's ranks could not reach it: {why}")
            return
        found: dict[int, str | None] = {}

        def one(slot: int, ranks: set[int]) -> None:
            found[slot] = self._join(slot, ranks, device, deadline)

        threads = {slot: threading.Thread(target=one, args=(slot, ranks), daemon=True) for slot, ranks in peers.items()}
        for t in threads.values():
            t.start()
        for slot, t in threads.items():
            t.join(max(deadline - time.monotonic(), 0.0))
            why = found.get(slot, f"its ranks did not connect within {self.host.timeout.total_seconds():g} s")
            if why:
                self.unreached.add(slot)
                self.dropped[slot] = f"replica {m.replicas[slot]}: {why}"
                self.skip.update(m.plan_ranks(slot))
                sever(m.groups[slot])

    def _join(self, slot: int, ranks: set[int], device: torch.device, deadline: float) -> str | None:
        """Connect this rank's pairs with one replica: links first (which pairs they take is
        decided alike at both ends), then the group for the rest. None, or why not."""
        m = self.membership
        group = m.groups[slot]
        key = f"{self.host.plan.digest[:16]}.{slot}"
        links, why = link(group, key, m.group_rank(self.rank), ranks, m.transport, device, deadline,
                          lambda g: self._who_in_group(slot, g))
        if why:
            return why
        if links is not None:
            self.links[slot] = links
            ranks = {r for r in ranks if r not in links.peers}
        return hello(group, ranks, self.trainer_side, device, deadline)

    def _who_in_group(self, slot: int, group_rank: int) -> str:
        m = self.membership
        if group_rank < m.trainer:
            return f"trainer rank {group_rank}"
        return f"replica {m.replicas[slot]} rank {group_rank - m.trainer}"

    def carrier(self, peer: int) -> str:
        """What moves this rank's messages with plan rank `peer`: "memory (cma)", "memory (ring)",
        "memory (cuda-ipc)", "nixl (UCX)" through the pair's links, else "group (gloo)" / "group (nccl)"."""
        m = self.membership
        slot = m.slot_of(peer if self.trainer_side else self.rank)
        links, g = self.links.get(slot), m.group_rank(peer)
        if isinstance(links, NixlLinks) and g in links.peers:
            return links.carrier
        if links is not None and g in links.peers:
            if self.on.type == "cuda":
                return "memory (cuda-ipc)"
            me = m.group_rank(self.rank)
            modes = sorted({mode for pair, mode in links.modes.items() if pair in ((me, g), (g, me))})
            return f"memory ({', '.join(modes)})" if modes else "memory"
        pg = m.groups[slot].pg if m.groups[slot] is not None else None
        if isinstance(pg, dist.ProcessGroupGloo):
            return "group (gloo)"
        return "group (nccl)" if pg is not None else "group"

    def carriers(self) -> dict[str, str]:
        """Replica id -> what moved this rank's pairs with it in the last walk ("memory (cma)",
        "group (gloo)", or both, comma-separated, where its pairs went both ways)."""
        m = self.membership
        out = {}
        for slot in sorted(set(self.peers) - self.unreached):
            plan_ranks = ([self._plan_rank(slot, g) for g in self.peers[slot]] if self.trainer_side
                          else list(self.peers[slot]))
            out[m.replicas[slot]] = ", ".join(sorted({self.carrier(r) for r in plan_ranks}))
        return out

    def _plan_rank(self, slot: int, group_rank: int) -> int:
        m = self.membership
        return group_rank if group_rank < m.trainer else m.trainer + (group_rank - m.trainer) * m.copies + slot

    def message(self, sending: bool, buf: torch.Tensor, rank: int) -> _Message:
        m = self.membership
        slot = m.slot_of(rank if self.trainer_side else self.rank)
        g = m.group_rank(rank)
        links = self.links.get(slot)
        if links is not None and g not in links.peers:
            links = None
        return _Message(sending, buf, slot, m.groups[slot].pg, g, rank, links=links)

    def resolved(self, messages: list):
        return None  # a walk is never recorded (no steady steps between jobs)

    def post(self, messages: list, what: str, calls=None) -> list:
        """Each message through its pair's links or in its replica's group; none to or from a rank
        in `skip` (a dropped replica's ranks: its group is severed, so none of them waits for a
        message from this rank, and none holds up this rank's walk). A backend that groups
        messages (NCCL) gets each group's messages of the round as one group."""
        p2p = messages
        works: list = [DONE] * len(p2p)
        by_group: dict[int, list[int]] = {}
        by_links: dict[int, list[int]] = {}
        for i, m in enumerate(p2p):
            if m.rank not in self.skip:
                (by_links if m.links is not None else by_group).setdefault(m.slot, []).append(i)
        for slot, idx in by_links.items():
            links = p2p[idx[0]].links
            try:
                for i, work in zip(idx, links.post([LinkMessage(p2p[i].sending, p2p[i].tensor, p2p[i].peer)
                                                    for i in idx])):
                    works[i] = work
            except LinkError as exc:
                self._lost(slot, f"posting {len(idx)} {what} failed: {_named(exc, lambda g: self._who_in_group(slot, g))}",
                           self._plan_rank(slot, exc.peer) if self.trainer_side else exc.peer)
        for slot, idx in by_group.items():
            group = p2p[idx[0]].group
            coalesce = bool(getattr(group, "supports_coalescing", False)) and p2p[idx[0]].tensor.is_cuda
            try:
                if coalesce:
                    group._start_coalescing(p2p[idx[0]].tensor.device)
                    for i in idx:
                        (group.send if p2p[i].sending else group.recv)([p2p[i].tensor], p2p[i].peer, p2p[i].tag)
                    work = group._end_coalescing(p2p[idx[0]].tensor.device)
                    for i in idx:
                        works[i] = work
                    continue
            except Exception as exc:  # noqa: BLE001 - the replica's group is broken
                self._lost(slot, f"posting {len(idx)} {what} failed: {first_line(exc)}", None)
                continue
            for i in idx:
                m = p2p[i]
                if m.rank in self.skip:  # its replica was dropped while this round was posted
                    continue
                try:
                    works[i] = (group.send if m.sending else group.recv)([m.tensor], m.peer, m.tag)
                except Exception as exc:  # noqa: BLE001 - the pair is broken: its rank is gone
                    self._lost(slot, f"posting {what} with {self._who(m.rank)} failed: {first_line(exc)}", m.rank)
        return works

    def _live_links(self) -> list:
        return [links for slot, links in self.links.items() if slot not in self.dropped and not links.severed]

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        """Wait for these transfers by the walk's one deadline; a failure loses the replica at the
        other end (trainer: dropped, the walk goes on; engine: raised). The group's messages are
        waited for in order, then the links' all at once (`wait_all`); every live link moves
        meanwhile, so no replica's channels wait on this rank while it waits on another's."""
        deadline = min(deadline if deadline is not None else math.inf, self.deadline)
        m = self.membership
        linked: list[int] = []
        for i, (work, op) in enumerate(zip(works, ops)):
            if work is DONE:
                continue
            peer = self._other_end(op)
            if peer in self.skip:
                continue
            if isinstance(work, (LinkWork, NixlWork)):
                linked.append(i)
                continue
            slot = m.slot_of(peer if self.trainer_side else self.rank)
            left = deadline - time.monotonic()
            try:
                ok = self._group_wait(work, left, deadline)
            except Exception as exc:  # noqa: BLE001 - every transport error loses the replica
                text = first_line(exc)
                if "timed out" in text.lower() or "timeout" in text.lower():
                    ok = False
                else:
                    self._lost(slot, f"{what} of op {op.id} (`{op.key}`) with {self._who(peer)} failed: {text}", peer)
                    continue
            if ok is False:
                self._lost(slot, f"{self._who(peer)} did not complete {what} of op {op.id} (`{op.key}`) "
                                 f"within the refit's {self.host.timeout.total_seconds():g} s (stalled or dead)", peer)
        while linked:
            linked = [i for i in linked if self._other_end(ops[i]) not in self.skip and not works[i].done]
            if not linked:
                return
            items = [(self.links[m.slot_of(self._other_end(ops[i]) if self.trainer_side else self.rank)], works[i])
                     for i in linked]
            try:
                wait_all(items, deadline, also=self._live_links())
                return
            except LinkError as exc:
                at = linked[exc.index if exc.index is not None else 0]
                op, peer = ops[at], self._other_end(ops[at])
                slot = m.slot_of(peer if self.trainer_side else self.rank)
                if exc.timed_out:
                    self._lost(slot, f"{self._who(peer)} did not complete {what} of op {op.id} (`{op.key}`) "
                                     f"within the refit's {self.host.timeout.total_seconds():g} s (stalled or dead)",
                               peer)
                else:
                    text = _named(exc, lambda g: self._who_in_group(slot, g))
                    self._lost(slot, f"{what} of op {op.id} (`{op.key}`) with {self._who(peer)} failed: {text}", peer)

    def _group_wait(self, work, left: float, deadline: float):
        """A group message's wait; while some live link has messages pending (a replica linked
        through shared memory needs this rank to move its channels), by polling the work."""
        live = self._live_links()
        if not any(links.pending() for links in live):
            return work.wait(left if left > 0.001 else 0.001)
        while not work.is_completed():
            for links in live:
                links.progress_quietly()
            if time.monotonic() >= deadline:
                return work.wait(0.001)
            time.sleep(1e-4)
        return work.wait(max(deadline - time.monotonic(), 0.001))

    def _who(self, plan_rank: int) -> str:
        m = self.membership
        if plan_rank < m.trainer:
            return f"trainer rank {plan_rank}"
        return f"replica {m.replicas[m.slot_of(plan_rank)]} rank {m.local_of(plan_rank)}"

    def _lost(self, slot: int, reason: str, peer: int | None = None) -> None:
        """A trainer rank drops the replica (the first reason stands): no message of the rest of
        the walk goes to or comes from any of its ranks, and this rank's connections in its
        group close (`sever`), so that each of its ranks, and through them every other trainer
        rank, learns it at once. An engine rank's replica is lost (its job severs)."""
        if not self.trainer_side:
            raise ReplicaLost(reason)
        self.dropped.setdefault(slot, reason)
        self.skip.update(self.membership.plan_ranks(slot))
        sever(self.membership.groups[slot])


class JobWalk(Refitter):
    """One rank's steps of one membership plan, walked through the replicas' groups
    (`ReplicaTransport`: what a failure costs, and who learns it)."""

    def __init__(self, plan: Plan, *, rank: int, membership: Membership, device=None,
                 budget_bytes: int | None = None, verify: bool = False, overlap: bool = False,
                 keep_staging: bool | None = None, hooks=None, timeout: timedelta = timedelta(seconds=60)):
        super().__init__(plan, device=device, budget_bytes=budget_bytes, timeout=timeout, verify=verify,
                         hooks=hooks, overlap=overlap, keep_staging=keep_staging,
                         transport=ReplicaTransport(rank, plan.world, membership))

    # the membership of the next walk (the job sets it), and what the last walk dropped
    membership = property(lambda self: self.transport.membership,
                          lambda self, m: setattr(self.transport, "membership", m))
    dropped = property(lambda self: self.transport.dropped)
    trainer_side = property(lambda self: self.transport.trainer_side)

    # ---- the walk ----------------------------------------------------------------
    def connect(self, device: torch.device, deadline: float) -> None:
        """Connect every pair this rank's ops use, before the refit's go (`ReplicaTransport.connect`)."""
        self.transport.connect(self.ops, device, deadline)

    def walk(self, refit: int, src_tensors, dst_tensors, deadline: float, *, cut_strided: bool = True) -> list[str]:
        """Every bucket's steps, each wait bounded by `deadline` (time.monotonic()); returns
        this rank's verification mismatches (engine ranks; `verify`). Replicas `connect` dropped
        stay dropped. `cut_strided`: some rank of the membership holds a non-contiguous tensor
        (the job's meeting says), so every rank cuts its buckets as if every transfer were staged."""
        self._step, self.transport.deadline = refit, deadline
        src, dst = as_given(src_tensors, self.src_held), as_given(dst_tensors, self.dst_held)
        device = self._device(list(src.values()) + list(dst.values()))
        # Buckets must be cut alike on every rank of every job: the cut follows what the job's
        # meeting said of every rank's tensors, the steps stage only what this rank's own need.
        schedule = self.schedule(self.strided(src_tensors, dst_tensors), cut=cut_strided)
        self.meter = StagingMeter()
        self._pending = self._ahead = None
        mismatches: list[str] = []
        last = schedule.buckets[-1].index if schedule.buckets else 0
        with torch.no_grad():
            for b in schedule.buckets:
                self._phase = f"bucket {b.index}"
                self.hooks.before_bucket(self, refit, b.index)
                mismatches += self._bucket(schedule, b.index, src, dst, device)
                if b.index == last:
                    mismatches += self._finish_pending()
        return mismatches

    def strided(self, src_tensors, dst_tensors) -> bool:
        return any(not_contiguous(v) for v in list((src_tensors or {}).values()) + list((dst_tensors or {}).values()))


def failure_text(exc: BaseException) -> str:
    """What a walk's unexpected error says (a RefitError's detail, else its first line)."""
    if isinstance(exc, RefitError):
        return exc.detail
    if isinstance(exc, ReplicaLost):
        return str(exc)
    return f"{type(exc).__name__}: {first_line(exc)}"
