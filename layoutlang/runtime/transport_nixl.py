"""The "nixl" transport: a refit's messages as one-sided NIXL writes (UCX: DRAM or VRAM, any host).

`Refitter(plan, transport="nixl")`. The process group stays for what it does beside the
bytes: this rank's place, the store the Refitter's ranks meet in, the default device
(`GroupTransport`); every message of a round moves through a NIXL agent instead.

**Setup, once per Refitter.** Each rank creates one agent (`NixlAgent`,
layoutlang/runtime/nixlagent.py: the protocol, shared with the jobs' replica groups), named for
its Refitter and rank, and sets its metadata in the process group's store, under a namespace
of the group's members and this transport's generation on the rank: the n-th "nixl" Refitter
on a rank meets the n-th on the others, as Refitters do. A rank adds a peer's agent the first
time a message names that peer (after step 1's agreement, so every peer has published; waited
for under the round's deadline all the same).

**A round, per pair: two notifications, one write** (nixlagent.py says how and why): the
receiver tells its sender where the round's sequences land, the sender WRITEs them with a
notification carrying the sequences; a receive completes only on its own sequence's.

**Waits** poll the agent (no progress thread: on a busy host it would take a core per
rank) under the round's one deadline; a message not complete by then names its peer, as
the process group's wait does (`GroupTransport.wait`'s words). Every `PROBE` s a waiting
rank notifies the peers it still waits for: where NIXL says a peer's agent is gone (its
process died: UCX saw its connection close), what that peer sent before is taken and
every message still owed by or to it fails at once, naming it. A transfer NIXL reports
failed names its peer at once too; a stalled peer is named at the deadline.

`close()` releases transfers, deregisters memory and drops the agent. NIXL is optional:
`pip install 'layoutlang[nixl]'`.
"""

from __future__ import annotations

import hashlib
import time

import torch

from .errors import RefitError, first_line
from .memlinks import LinkError
from .nixlagent import PROBE, Message, NixlAgent, nixl_module
from .transport_group import CAUSE_GRACE, GroupTransport


class NixlTransport(GroupTransport):
    """A Refitter's messages as NIXL writes; `group` places the ranks and hosts their meetings."""

    name = "nixl"

    def __init__(self, group=None):
        super().__init__(group)
        nixl_module()  # (a missing package says so first)
        self.rank = self.place()[0]
        self.store, ranks = self.meeting()
        if self.store is None:
            raise RefitError.at(self.rank, 0, "setup", "the \"nixl\" transport publishes its agent in the process "
                                "group's store, and there is none (initialize the process group with "
                                "torch.distributed.init_process_group)", reusable=False)
        members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:8]
        base = f"layoutlang-nixl/{members}"
        generation = self.store.add(f"{base}/generation/{self.rank}", 1)
        self.agent = NixlAgent(self.store, f"{base}/{generation}", self.rank)
        self.mode = self.agent.mode  # the NIXL backends the bytes move through ("UCX")

    # ---- the executor's calls ----------------------------------------------------------------
    def connect(self, ops, device: torch.device, deadline: float) -> None:
        """Add the agent of every peer `ops` name (a peer a later message names is added then)."""
        me = self.host.rank
        for peer in sorted({op.dst_rank if op.src_rank == me else op.src_rank for op in ops} - {me}):
            if peer not in self.agent.names:
                self._connect(peer, deadline)

    def carrier(self, peer: int) -> str:
        return f"nixl ({self.agent.mode})"

    def message(self, sending: bool, buf: torch.Tensor, rank: int) -> Message:
        return Message(sending, buf, rank)

    def resolved(self, messages: list) -> list | None:
        return None  # (a replay posts the same messages: their storages are registered already)

    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        """Number the round's messages per pair, tell each sender where its messages land, and
        start every write whose "ready" is in (`NixlAgent.post`)."""
        if not messages:
            return []
        deadline = time.monotonic() + self.host.timeout.total_seconds()
        peer = None
        try:
            for m in messages:
                peer = m.peer
                if peer not in self.agent.names:
                    self._connect(peer, deadline)
            peer = None
            return self.agent.post(messages)
        except Exception as exc:  # noqa: BLE001 - named as the process group's post names it
            if isinstance(exc, RefitError):  # (the store never saw that peer's agent)
                raise
            at = "" if peer is None else f" at the one with peer rank {peer}"
            raise self.host.failure(f"posting {len(messages)} {what} failed{at}: {first_line(exc)}",
                                    peers=() if peer is None else (peer,), grace=CAUSE_GRACE) from exc

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        """Poll until every work is done, under ONE deadline; the first one late or failed names
        its peer (the process group's words). Every `PROBE` s the peers still owed something are
        sent a notification: one whose agent is gone (its process died) is named at once."""
        timeout = self.host.timeout.total_seconds()
        if deadline is None:
            deadline = time.monotonic() + timeout
        probe = time.monotonic() + PROBE
        i, polls, seen = 0, 0, -1
        while True:
            while i < len(works) and works[i].done:
                i += 1
            if i == len(works):
                return
            if seen != self.agent.failures:  # a work failed since the last look: one of these?
                seen = self.agent.failures
                for w, o in zip(works[i:], ops[i:]):
                    if w.error:
                        raise self._failed(o, what, w.error, CAUSE_GRACE)
            now = time.monotonic()
            if now >= deadline:
                peer = self._other(ops[i])
                raise self._failed(ops[i], what, f"peer rank {peer} did not complete it within {timeout:g} s", 0.0)
            if now >= probe:
                probe = now + PROBE
                self.agent.probe({self._other(o) for w, o in zip(works[i:], ops[i:]) if not w.done})
                continue
            try:
                self.agent.progress()
            except Exception as exc:  # noqa: BLE001 - NIXL's own failure, as the peer's message's
                raise self._failed(ops[i], what, f"NIXL: {first_line(exc)}", CAUSE_GRACE) from exc
            polls += 1
            if not works[i].done and polls > 20:
                time.sleep(min(1e-3, 1e-5 * (polls - 20)))  # a few polls at once, then yield the core

    def _other(self, op) -> int:
        """The plan rank at `op`'s other end."""
        return op.dst_rank if op.src_rank == self.host.rank else op.src_rank

    def _failed(self, op, what: str, text: str, grace: float):
        peer = self._other(op)
        return self.host.failure(f"{what} of op {op.id} (`{op.key}`) with peer rank {peer} failed: {text}",
                                 peers=(peer,), grace=grace)

    def close(self) -> None:
        """Release transfers, deregister every storage, forget the peers, drop the agent."""
        agent = getattr(self, "agent", None)
        if agent is not None:
            agent.close()

    # ---- setup ------------------------------------------------------------------------------
    def _connect(self, peer: int, deadline: float) -> None:
        """Load `peer`'s agent metadata from the store (published as its Refitter was built)."""
        try:
            self.agent.connect(peer, deadline)
        except LinkError as exc:  # a timeout (that peer never built its transport), or its agent is gone
            text = (f"rank {peer} did not publish its NIXL agent within {self.host.timeout.total_seconds():g} s"
                    if exc.timed_out else exc.reason)
            raise self.host.failure(text, peers=(peer,)) from exc
