"""The "nixl" transport: a refit's messages as one-sided NIXL writes (UCX: DRAM or VRAM, any host).

`Refitter(plan, transport="nixl")`. The process group stays for what it does beside the
bytes: this rank's place, the store the Refitter's ranks meet in, the default device
(`GroupTransport`); every message of a round moves through a NIXL agent instead.

**Setup, once per Refitter.** Each rank creates one agent, named for its Refitter and rank,
and sets its metadata (connection info, bytes) in the process group's store, under a
namespace of the group's members and this transport's generation on the rank: the n-th
"nixl" Refitter on a rank meets the n-th on the others, as Refitters do. A rank adds a
peer's agent the first time a message names that peer (after step 1's agreement, so every
peer has published; waited for under the round's deadline all the same).

**A round, per pair: two notifications, one write.** The executor's message model is
two-sided: a sender's buffer and a receiver's buffer per message, matched per pair in the
order both post them. Each side numbers its messages per pair and direction (a sequence
that only grows, across refits). As a round is posted:

1. the receiver registers each receive buffer's storage (cached by (data_ptr, nbytes): kept
   staging, destination tensors and steady steps reuse the same storages, so a steady step
   registers nothing) and sends the sender ONE notification for all of the round's messages
   from it: "ready: sequences s..s+n-1 land at these descriptors" (address, length, device
   as plain integers; the list once per distinct round, then its number: the remote
   descriptors travel once per membership, each later step carries only the "go"), with
   the NIXL metadata of any storage that sender has not seen registered yet;
2. the sender, once both its own buffers and that "ready" are there, WRITEs them in ONE
   transfer per consecutive run (one per pair and round in practice), whose notification
   carries the run's sequences: the receiver's wait completes on it, the sender's when
   its transfer is done (its buffers may then change).

Why this and not the receivers READing: a receiver's buffer may be written only once the
receiver posted it (a staging arena's buffer is carved again by the next bucket; a
destination tensor serves inference until the refit starts), and a sender's only read while
its refit holds it; so each design needs one "go" per pair and round. WRITE with a
notification then costs one notification each way; READ needs the sender's "go", the read
itself (a round trip) and a "done" back before the sender may release its buffer. Sequences
make a late write of refit n (a failed step's) unmistakable for one of refit n + 1: they
only grow, and a wait completes only on its own sequence's notification.

**Waits** poll the agent (no progress thread: on a busy host it would take a core per
rank) under the round's one deadline; a message not complete by then names its peer, as
the process group's wait does (`GroupTransport.wait`'s words). Every `PROBE` s a waiting
rank notifies the peers it still waits for: where NIXL says a peer's agent is gone (its
process died: UCX saw its connection close), what that peer sent before is taken and
every message still owed by or to it fails at once, naming it. A transfer NIXL reports
failed names its peer at once too; a stalled peer is named at the deadline.

`close()` releases transfers, deregisters memory and drops the agent. NIXL is optional:
`pip install 'layoutlang[nixl]'` (NIXL's own descriptor serialization pickles: nothing
here uses it; descriptors travel as integers, agent metadata as NIXL's bytes).
"""

from __future__ import annotations

import hashlib
import importlib
import struct
import time
import weakref
from datetime import timedelta

import torch

from layoutlang.diagnostics import UsageError

from .errors import RefitError, first_line
from .transport_group import CAUSE_GRACE, GroupTransport

MODULES = ("nixl", "nixl_cu12", "nixl_cu13")   # the meta package, then the CUDA variants' own
TABLES = 4096       # descriptor lists a receiver keeps numbered per peer (then it numbers them anew)
READY, DATA, PING = b"R", b"D", b"P"
PROBE = 0.1         # s between a waiting rank's notifications to the peers it waits for
HEADER = struct.Struct("<cBQII")   # kind, flags (1: descriptors follow), first sequence, count, list number
DESC = struct.Struct("<QQII")      # address, bytes, device, segment (0 DRAM, 1 VRAM)
RUN = struct.Struct("<cQI")        # DATA, first sequence, count
SEGMENTS = ("DRAM", "VRAM")


def nixl_module():
    """NIXL's Python API (`nixl_agent`, `nixl_agent_config`); a UsageError says how to install it."""
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise UsageError("the \"nixl\" transport needs NIXL's Python package, which is not installed",
                     help="pip install 'layoutlang[nixl]' (nixl-cu12: its UCX backend moves DRAM between processes "
                          "without CUDA), or choose transport=\"group\"")


class Message:
    """One message of a round: this rank's `tensor`, to (`sending`) or from plan rank `peer`."""

    __slots__ = ("sending", "tensor", "peer")

    def __init__(self, sending: bool, tensor: torch.Tensor, peer: int):
        self.sending, self.tensor, self.peer = sending, tensor, peer


class Work:
    """A posted message: `done` once it moved; `error`: why NIXL failed it."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done, self.error = False, None


class Registration:
    """One registered storage: held weakly (its memory freed, the entry is stale), and the peers
    that loaded its metadata."""

    __slots__ = ("storage", "descs", "told", "where")

    def __init__(self, storage, descs, where: tuple[int, int, int, int]):
        self.storage, self.descs, self.where, self.told = weakref.ref(storage), descs, where, set()


def describe(buf: torch.Tensor) -> tuple[int, int, int, int]:
    """(address, bytes, device, segment) of a contiguous buffer."""
    if not buf.is_contiguous():
        raise ValueError("a NIXL message needs a contiguous buffer")
    cuda = buf.device.type == "cuda"
    return buf.data_ptr(), buf.numel() * buf.element_size(), (buf.device.index or 0) if cuda else 0, int(cuda)


class NixlTransport(GroupTransport):
    """A Refitter's messages as NIXL writes; `group` places the ranks and hosts their meetings."""

    name = "nixl"

    def __init__(self, group=None):
        super().__init__(group)
        nixl = nixl_module()
        self.rank = self.place()[0]
        self.store, ranks = self.meeting()
        if self.store is None:
            raise RefitError.at(self.rank, 0, "setup", "the \"nixl\" transport publishes its agent in the process "
                                "group's store, and there is none (initialize the process group with "
                                "torch.distributed.init_process_group)", reusable=False)
        members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:8]
        base = f"layoutlang-nixl/{members}"
        generation = self.store.add(f"{base}/generation/{self.rank}", 1)
        self.namespace = f"{base}/{generation}"
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl.nixl_agent(f"layoutlang-{members}-{generation}-{self.rank}", config)
        self.mode = ",".join(self.agent.backends)  # the NIXL backends the bytes move through ("UCX")
        self.store.set(self._agent_key(self.rank), self.agent.get_agent_metadata())
        self.names: dict[int, str] = {}          # plan rank -> its agent's name
        self.peer_of: dict[str, int] = {}        # agent name -> plan rank
        self.regs: dict[tuple[int, int], Registration] = {}
        self.next_out: dict[int, int] = {}       # peer -> the sequence of the next message to it
        self.next_in: dict[int, int] = {}        # peer -> ... from it
        self.outbox: dict[int, dict[int, tuple[Work, tuple]]] = {}   # peer -> seq -> (work, local desc)
        self.remote: dict[int, dict[int, tuple]] = {}                # peer -> seq -> its receive desc
        self.inbox: dict[int, dict[int, Work]] = {}                  # peer -> seq -> a receive's work
        self.tables_out: dict[int, dict[tuple, int]] = {}  # peer -> descriptor list -> its number (receiver)
        self.tables_in: dict[int, dict[int, tuple]] = {}   # peer -> number -> descriptor list (sender)
        self.inflight: list[tuple[object, tuple, list[Work]]] = []  # (transfer, its key, its works)
        self.xfers: dict[tuple, object] = {}     # (peer, local descs, remote descs, ...) -> a transfer to post again
        self.epoch = 0                           # local storages deregistered so far
        self.peer_epoch: dict[int, int] = {}     # peer -> metadata loads from it (a storage it registered)
        self.dirty: set[int] = set()             # peers with new sends or a new "ready" to match
        self.failures = 0                        # works failed so far (a wait looks for its own then)
        self.registrations = 0                   # storages registered so far (steady steps add none)

    def _agent_key(self, rank: int) -> str:
        return f"{self.namespace}/agent/{rank}"

    # ---- the executor's calls ----------------------------------------------------------------
    def connect(self, ops, device: torch.device, deadline: float) -> None:
        """Add the agent of every peer `ops` name (a peer a later message names is added then)."""
        me = self.host.rank
        for peer in sorted({op.dst_rank if op.src_rank == me else op.src_rank for op in ops} - {me}):
            if peer not in self.names:
                self._connect(peer, deadline)

    def carrier(self, peer: int) -> str:
        return f"nixl ({self.mode})"

    def message(self, sending: bool, buf: torch.Tensor, rank: int) -> Message:
        return Message(sending, buf, rank)

    def resolved(self, messages: list) -> list | None:
        return None  # (a replay posts the same messages: their storages are registered already)

    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        """Number the round's messages per pair, tell each sender where its messages land, and
        start every write whose "ready" is in."""
        if not messages:
            return []
        deadline = time.monotonic() + self.host.timeout.total_seconds()
        works, ready = [], {}
        peer = None
        try:
            for m in messages:
                peer = m.peer
                if peer not in self.names:
                    self._connect(peer, deadline)
                reg, desc = self._register(m.tensor)
                work = Work()
                works.append(work)
                if m.sending:
                    seq = self.next_out.get(peer, 0)
                    self.next_out[peer] = seq + 1
                    self.outbox.setdefault(peer, {})[seq] = (work, desc)
                    self.dirty.add(peer)
                else:
                    seq = self.next_in.get(peer, 0)
                    self.next_in[peer] = seq + 1
                    if desc[1]:
                        self.inbox.setdefault(peer, {})[seq] = work
                    else:
                        work.done = True  # (nothing to write; the sender skips it too)
                    ready.setdefault(peer, []).append((seq, desc, reg, work))
            peer = None
            for sender, items in ready.items():
                try:
                    self._ready(sender, items)
                except Exception as exc:  # noqa: BLE001 - that sender is gone: its receives' waits name it
                    self._fail([work for _, _, _, work in items], f"NIXL: {first_line(exc)}")
            self._progress()
        except Exception as exc:  # noqa: BLE001 - named as the process group's post names it
            if isinstance(exc, RefitError):  # (the store never saw that peer's agent)
                raise
            at = "" if peer is None else f" at the one with peer rank {peer}"
            raise self.host.failure(f"posting {len(messages)} {what} failed{at}: {first_line(exc)}",
                                    peers=() if peer is None else (peer,), grace=CAUSE_GRACE) from exc
        return works

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
            if seen != self.failures:  # a work failed since the last look: one of these?
                seen = self.failures
                for w, o in zip(works[i:], ops[i:]):
                    if w.error:
                        raise self._failed(o, what, w.error, CAUSE_GRACE)
            now = time.monotonic()
            if now >= deadline:
                peer = self._other(ops[i])
                raise self._failed(ops[i], what, f"peer rank {peer} did not complete it within {timeout:g} s", 0.0)
            if now >= probe:
                probe = now + PROBE
                self._probe({self._other(o) for w, o in zip(works[i:], ops[i:]) if not w.done})
                continue
            try:
                self._progress()
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

    def _fail(self, works, text: str) -> None:
        for w in works:
            if not w.done and not w.error:
                w.error = text
                self.failures += 1

    def _probe(self, peers) -> None:
        """Notify each of `peers`; where NIXL says its agent is gone, take what it sent before it
        went, then fail every message still owed by or to it."""
        gone = {}
        for peer in sorted(peers):
            try:
                self.agent.send_notif(self.names[peer], PING)
            except Exception as exc:  # noqa: BLE001 - NIXL_ERR_REMOTE_DISCONNECT: its process is gone
                gone[peer] = first_line(exc)
        if not gone:
            return
        self._progress()
        for peer, text in gone.items():
            owed = list(self.inbox.get(peer, {}).values()) + [w for w, _ in self.outbox.get(peer, {}).values()]
            owed += [w for _, key, ws in self.inflight if key[0] == peer for w in ws]
            self._fail(owed, f"peer rank {peer}'s NIXL agent is gone ({text})")

    def close(self) -> None:
        """Release transfers, deregister every storage, forget the peers, drop the agent."""
        agent, self.agent = getattr(self, "agent", None), None
        if agent is None:
            return
        for handle in [h for h, _, _ in self.inflight] + list(self.xfers.values()):
            _quietly(handle.release)
        self.inflight, self.xfers = [], {}
        for reg in self.regs.values():
            _quietly(agent.deregister_memory, reg.descs)
        self.regs = {}
        for name in self.names.values():
            _quietly(agent.remove_remote_agent, name)
        self.names, self.peer_of = {}, {}
        _quietly(self.store.delete_key, self._agent_key(self.rank))

    # ---- setup ------------------------------------------------------------------------------
    def _connect(self, peer: int, deadline: float) -> None:
        """Load `peer`'s agent metadata from the store (published as its Refitter was built)."""
        key = self._agent_key(peer)
        try:
            self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:  # noqa: BLE001 - a timeout: that peer never built its transport
            raise self.host.failure(f"rank {peer} did not publish its NIXL agent within "
                                    f"{self.host.timeout.total_seconds():g} s ({first_line(exc)})",
                                    peers=(peer,)) from exc
        name = self.agent.add_remote_agent(self.store.get(key))
        name = name.decode() if isinstance(name, bytes) else name
        self.names[peer], self.peer_of[name] = name, peer

    def _register(self, buf: torch.Tensor) -> tuple[Registration | None, tuple]:
        """The registration of `buf`'s storage (made now if new or stale) and `buf`'s descriptor."""
        desc = describe(buf)
        if not desc[1]:
            return None, desc
        storage = buf.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        reg = self.regs.get(key)
        if reg is not None and reg.storage() is storage:
            return reg, desc
        # new, or its memory was freed and taken again: drop every registration whose storage is gone
        for k in [k for k, r in self.regs.items() if r.storage() is None or k == key]:
            self.epoch += 1
            self._forget_xfers()  # (a kept transfer may name it)
            _quietly(self.agent.deregister_memory, self.regs.pop(k).descs)
        where = (key[0], key[1], desc[2], desc[3])
        descs = self.agent.register_memory([(*where[:3], "")], SEGMENTS[desc[3]])
        self.registrations += 1
        reg = self.regs[key] = Registration(storage, descs, where)
        return reg, desc

    # ---- the protocol -------------------------------------------------------------------------
    def _ready(self, peer: int, items: list) -> None:
        """Tell `peer` that the sequences of `items` (consecutive) land at their descriptors: the
        list's number (and the list, the first time), the metadata of storages it has not seen."""
        descs = tuple(d for _, d, _, _ in items)
        table = self.tables_out.setdefault(peer, {})
        number, body = table.get(descs), b""
        if number is None:
            if len(table) >= TABLES:
                table.clear()
            number, body = len(table), b"".join(DESC.pack(*d) for d in descs)
        new = list({id(r): r for _, _, r, _ in items if r is not None and peer not in r.told}.values())
        blobs = []
        for segment in sorted({r.where[3] for r in new}):
            listed = self.agent.get_reg_descs([(*r.where[:3], "") for r in new if r.where[3] == segment],
                                              SEGMENTS[segment])
            blobs.append(self.agent.get_partial_agent_metadata(listed, False))
        meta = b"".join(struct.pack("<I", len(b)) + b for b in blobs)
        header = HEADER.pack(READY, 1 if body else 0, items[0][0], len(items), number)
        self.agent.send_notif(self.names[peer], header + body + meta)
        table[descs] = number  # (only once sent: a list the peer never got is sent again)
        for r in new:
            r.told.add(peer)

    def _on_ready(self, peer: int, msg: bytes) -> None:
        _, flags, first, count, number = HEADER.unpack_from(msg)
        at = HEADER.size
        if flags & 1:
            descs = tuple(DESC.unpack_from(msg, at + i * DESC.size) for i in range(count))
            self.tables_in.setdefault(peer, {})[number] = descs
            at += count * DESC.size
        else:
            descs = self.tables_in[peer][number]
        if at < len(msg):  # metadata of storages registered since (a kept transfer may name one it replaced)
            self.peer_epoch[peer] = self.peer_epoch.get(peer, 0) + 1
            self._forget_xfers(peer)
        while at < len(msg):
            (size,) = struct.unpack_from("<I", msg, at)
            self.agent.add_remote_agent(msg[at + 4:at + 4 + size])
            at += 4 + size
        remote = self.remote.setdefault(peer, {})
        for i, d in enumerate(descs):
            remote[first + i] = d
        self.dirty.add(peer)

    def _on_data(self, peer: int, msg: bytes) -> None:
        _, first, count = RUN.unpack(msg)
        inbox = self.inbox.get(peer, {})
        for seq in range(first, first + count):
            work = inbox.pop(seq, None)
            if work is not None:
                work.done = True

    def _progress(self) -> None:
        """Take new notifications, start every write whose both ends are known, reap transfers."""
        for name, msgs in self.agent.get_new_notifs().items():
            peer = self.peer_of.get(name.decode() if isinstance(name, bytes) else name)
            if peer is None:
                continue
            for msg in msgs:
                if msg[:1] == READY:
                    self._on_ready(peer, msg)
                elif msg[:1] == DATA:
                    self._on_data(peer, msg)
        while self.dirty:
            self._write(self.dirty.pop())
        if self.inflight:
            still = []
            for handle, key, works in self.inflight:
                state = self.agent.check_xfer_state(handle)
                if state == "PROC":
                    still.append((handle, key, works))
                    continue
                self._finish(handle, key, works, state)
            self.inflight = still

    def _write(self, peer: int) -> None:
        """One WRITE per run of consecutive sequences whose receive descriptors arrived."""
        outbox, remote = self.outbox.get(peer), self.remote.get(peer)
        if not outbox or not remote:
            return
        seqs = sorted(s for s in outbox if s in remote)
        runs: list[list[int]] = []
        for s in seqs:
            if runs and s == runs[-1][-1] + 1 and _segments(outbox, remote, s) == _segments(outbox, remote, runs[-1][0]):
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            segment, theirs_segment = _segments(outbox, remote, run[0])
            works, local, target = [], [], []
            for s in run:
                work, mine = outbox.pop(s)
                theirs = remote.pop(s)
                works.append(work)
                if mine[1] != theirs[1]:
                    self._fail([work], f"message of {mine[1]} B where the receiver posted {theirs[1]} B")
                elif mine[1]:
                    local.append(mine[:3])
                    target.append(theirs[:3])
            if any(w.error for w in works):
                self._fail(works, "another message of its transfer failed")
                continue
            if not local:
                for w in works:
                    w.done = True
                continue
            key = (peer, tuple(local), tuple(target), segment, theirs_segment, self.epoch,
                   self.peer_epoch.get(peer, 0))
            try:
                handle = self.xfers.pop(key, None)  # (out of the cache while it flies)
                if handle is None:
                    handle = self.agent.initialize_xfer(
                        "WRITE", self.agent.get_xfer_descs(local, SEGMENTS[segment]),
                        self.agent.get_xfer_descs(target, SEGMENTS[theirs_segment]), self.names[peer])
                state = self.agent.transfer(handle, RUN.pack(DATA, run[0], len(run)))
            except Exception as exc:  # noqa: BLE001 - the works carry it to their wait
                self._fail(works, f"NIXL: {first_line(exc)}")
                continue
            if state == "PROC":
                self.inflight.append((handle, key, works))
            else:
                self._finish(handle, key, works, state)

    def _finish(self, handle, key: tuple, works: list[Work], state: str) -> None:
        """A transfer ended: its works done (or failed); a done one is kept to post again
        (a steady step writes the same runs: its descriptors are checked and prepared once)."""
        if state == "DONE":
            for w in works:
                w.done = True
        else:
            self._fail(works, "NIXL reported the transfer failed")
        current = key[-2:] == (self.epoch, self.peer_epoch.get(key[0], 0))
        if state != "DONE" or not current or key in self.xfers or len(self.xfers) >= TABLES:
            _quietly(handle.release)
        else:
            self.xfers[key] = handle

    def _forget_xfers(self, peer: int | None = None) -> None:
        """Release the kept transfers (to `peer`, or all): a storage they name was registered anew."""
        for key in [k for k in self.xfers if peer is None or k[0] == peer]:
            _quietly(self.xfers.pop(key).release)


def _segments(outbox, remote, seq: int) -> tuple[int, int]:
    """(local, remote) segment of message `seq` (DRAM 0, VRAM 1): a transfer holds one of each."""
    return outbox[seq][1][3], remote[seq][3]


def _quietly(call, *args) -> None:
    try:
        call(*args)
    except Exception:  # noqa: BLE001 - tearing down: nothing left to tell
        pass
