"""One NIXL agent and the write protocol with its peers' agents: the "nixl" transport's bytes.

Two users, one protocol: a Refitter's world (`NixlTransport`, layoutlang/runtime/transport_nixl.py:
one agent per rank, peers named by plan rank) and the jobs' replica groups (`NixlLinks`, below:
one agent per rank and replica group, peers named by group rank, with `MemoryLinks`'s interface
so that `ReplicaTransport` (layoutlang/runtime/jobgroups.py) treats both kinds of links alike).

**Setup.** `NixlAgent(store, namespace, me)` creates one agent (UCX backend, no progress
thread: on a busy host it would take a core per rank) and sets its metadata in `store` under
`namespace`; `connect(peer, deadline)` loads a peer's (looked for, never waited on: a store
client serves one request at a time, and a rank may link several replica groups at once, a
thread each).

**A round, per pair: two notifications, one write.** The executor's message model is
two-sided: a sender's buffer and a receiver's buffer per message, matched per pair in the
order both post them. Each side numbers its messages per pair and direction (a sequence
that only grows, for the agent's life). As a round is posted:

1. the receiver registers each receive buffer's storage (cached by (data_ptr, nbytes): kept
   staging, destination tensors and steady steps reuse the same storages, so a steady step
   registers nothing) and sends the sender ONE notification for all of the round's messages
   from it: "ready: sequences s..s+n-1 land at these descriptors" (address, length, device
   as plain integers; the list once per distinct round, then its number: the remote
   descriptors travel once per membership, each later step carries only the "go"), with
   the NIXL metadata of any storage that sender has not seen registered yet;
2. the sender, once both its own buffers and that "ready" are there, WRITEs them in ONE
   transfer per consecutive run (one per pair and round in practice), whose notification
   carries the run's sequences: the receiver's work completes on it, the sender's when
   its transfer is done (its buffers may then change).

Why this and not the receivers READing: a receiver's buffer may be written only once the
receiver posted it (a staging arena's buffer is carved again by the next bucket; a
destination tensor serves inference until the refit starts), and a sender's only read while
its refit holds it; so each design needs one "go" per pair and round. WRITE with a
notification then costs one notification each way; READ needs the sender's "go", the read
itself (a round trip) and a "done" back before the sender may release its buffer. Sequences
make a late write of refit n (a failed step's) unmistakable for one of refit n + 1: they
only grow, and a receive completes only on its own sequence's notification.

**Faults.** `probe(peers)` notifies peers: where NIXL says a peer's agent is gone (its
process died: UCX saw its connection close), what that peer sent before is taken and every
message still owed by or to it fails, naming it. A transfer NIXL reports failed fails its
messages too. `sever()` ends this agent's part for good: every peer is told ("closed"), its
messages with this rank fail at once ("rank P closed the link"), this rank's transfers in
flight are cancelled and it posts none again. `close()` releases transfers, deregisters
memory and drops the agent. NIXL is optional: `pip install 'layoutlang[nixl]'` (NIXL's own
descriptor serialization pickles: nothing here uses it; descriptors travel as integers,
agent metadata as NIXL's bytes).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import struct
import time
import weakref

import torch

from layoutlang.diagnostics import UsageError

from .errors import first_line
from .memlinks import LinkError
from .peerprocs import PeerProcesses

MODULES = ("nixl", "nixl_cu12", "nixl_cu13")   # the meta package, then the CUDA variants' own
TABLES = 4096       # descriptor lists a receiver keeps numbered per peer (then it numbers them anew)
READY, DATA, PING, CLOSED = b"R", b"D", b"P", b"C"
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
    """One message of a round: this rank's `tensor`, to (`sending`) or from rank `peer`."""

    __slots__ = ("sending", "tensor", "peer")

    def __init__(self, sending: bool, tensor: torch.Tensor, peer: int):
        self.sending, self.tensor, self.peer = sending, tensor, peer


class Work:
    """A posted message with `peer`: `done` once it moved; `error`: why it failed."""

    __slots__ = ("done", "error", "peer")

    def __init__(self, peer: int = -1):
        self.done, self.error, self.peer = False, None, peer


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


def store_value(store, key: str, deadline: float) -> bytes | None:
    """`key`'s value once set, by `deadline`; None past it. Looked for (`check`), never waited on
    (a blocking wait would hold the store client every other thread of this process shares)."""
    nap = 1e-3
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            return None
        time.sleep(min(nap, deadline - now))
        nap = min(nap * 2, 0.02)
    return store.get(key)


class NixlAgent:
    """This rank's NIXL agent (`me`), published in `store` under `namespace`, and the protocol's
    state with each peer it connected (peers are ranks of the caller's numbering)."""

    def __init__(self, store, namespace: str, me: int):
        nixl = nixl_module()
        self.store, self.namespace, self.me = store, namespace, me
        tag = hashlib.sha256(namespace.encode()).hexdigest()[:12]
        config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl.nixl_agent(f"layoutlang-{tag}-{me}", config)
        self.mode = ",".join(self.agent.backends)  # the NIXL backends the bytes move through ("UCX")
        self.store.set(self.agent_key(me), self.agent.get_agent_metadata())
        self.names: dict[int, str] = {}          # peer -> its agent's name
        self.peer_of: dict[str, int] = {}        # agent name -> peer
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
        self.closed_by: set[int] = set()         # peers that closed their end (`sever`)
        self.severed = False                     # this rank closed its own (`sever`)

    def agent_key(self, rank: int) -> str:
        return f"{self.namespace}/agent/{rank}"

    @property
    def closed(self) -> bool:
        return self.agent is None

    def connect(self, peer: int, deadline: float) -> None:
        """Load `peer`'s agent metadata from the store, set there as its agent was created; a
        LinkError naming it where it is not there by `deadline` (timed out) or cannot be reached
        (its process is gone: UCX's connection is refused at once)."""
        left = deadline - time.monotonic()
        blob = store_value(self.store, self.agent_key(peer), deadline)
        if blob is None:
            raise LinkError(peer, f"rank {peer} did not publish its NIXL agent within {max(left, 0):.3g} s",
                            timed_out=True)
        try:
            name = self.agent.add_remote_agent(blob)
        except Exception as exc:  # noqa: BLE001 - NIXL_ERR_BACKEND: its agent's process is gone
            raise LinkError(peer, f"rank {peer}'s NIXL agent cannot be reached ({first_line(exc)})") from exc
        name = name.decode() if isinstance(name, bytes) else name
        self.names[peer], self.peer_of[name] = name, peer

    # ---- posting and progress ---------------------------------------------------------------
    def post(self, messages: list) -> list[Work]:
        """Number a round's messages per pair (every peer connected), tell each sender where its
        messages land, start every write whose "ready" is in. A peer that closed its end fails
        its messages at once; NIXL's own errors propagate (the caller names them)."""
        works, ready = [], {}
        for m in messages:
            peer = m.peer
            reg, desc = self._register(m.tensor)
            work = Work(peer)
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
        for sender, items in ready.items():
            try:
                self._ready(sender, items)
            except Exception as exc:  # noqa: BLE001 - that sender is gone: its receives' waits name it
                self.fail([work for _, _, _, work in items], f"NIXL: {first_line(exc)}")
        self.progress()
        for peer in self.closed_by & {m.peer for m in messages}:
            self._closed(peer)
        return works

    def progress(self) -> None:
        """Take new notifications, start every write whose both ends are known, reap transfers."""
        if self.severed:
            return
        for name, msgs in self.agent.get_new_notifs().items():
            peer = self.peer_of.get(name.decode() if isinstance(name, bytes) else name)
            if peer is None:
                continue
            for msg in msgs:
                if msg[:1] == READY:
                    self._on_ready(peer, msg)
                elif msg[:1] == DATA:
                    self._on_data(peer, msg)
                elif msg[:1] == CLOSED:
                    self.closed_by.add(peer)
                    self._closed(peer)
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

    def pending(self) -> bool:
        """Has this rank messages posted and not done?"""
        return not self.severed and bool(self.inflight or any(self.outbox.values()) or any(self.inbox.values()))

    def fail(self, works, text: str) -> None:
        """Mark `works` failed (those not done or failed yet), with `text`."""
        for w in works:
            if not w.done and not w.error:
                w.error = text
                self.failures += 1

    def owed(self, peer: int) -> list[Work]:
        """The works still owed by or to `peer`."""
        owed = list(self.inbox.get(peer, {}).values()) + [w for w, _ in self.outbox.get(peer, {}).values()]
        return owed + [w for _, key, ws in self.inflight if key[0] == peer for w in ws]

    def probe(self, peers) -> None:
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
        self.progress()
        for peer, text in gone.items():
            self.fail(self.owed(peer), f"peer rank {peer}'s NIXL agent is gone ({text})")

    def _closed(self, peer: int) -> None:
        self.fail(self.owed(peer), f"rank {peer} closed the link")

    def sever(self) -> None:
        """End this rank's part for good: tell every peer ("closed": its messages with this rank
        fail at its next look), cancel this rank's transfers in flight (none lands later), fail
        its own pending messages and post none again; `close` still tears down."""
        if self.severed or self.agent is None:
            return
        self.severed = True
        for name in self.names.values():
            _quietly(self.agent.send_notif, name, CLOSED)
        for handle, _, works in self.inflight:
            _quietly(handle.release)  # (NIXL cancels a transfer still in flight)
            self.fail(works, "this rank closed the link")
        self.inflight = []
        for peer in list(self.names):
            self.fail(self.owed(peer), "this rank closed the link")
        self.outbox, self.inbox, self.remote, self.dirty = {}, {}, {}, set()

    def close(self, unpublish: bool = True) -> None:
        """Release transfers, deregister every storage, forget the peers, drop the agent; its
        metadata leaves the store (`unpublish`: not where the store may be gone already)."""
        agent, self.agent = self.agent, None
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
        if unpublish:
            _quietly(self.store.delete_key, self.agent_key(self.me))

    # ---- the protocol -------------------------------------------------------------------------
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
                    self.fail([work], f"message of {mine[1]} B where the receiver posted {theirs[1]} B")
                elif mine[1]:
                    local.append(mine[:3])
                    target.append(theirs[:3])
            if any(w.error for w in works):
                self.fail(works, "another message of its transfer failed")
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
                self.fail(works, f"NIXL: {first_line(exc)}")
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
            self.fail(works, "NIXL reported the transfer failed")
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


# ---- between jobs: a replica group's links ------------------------------------------------------

def _host_mark() -> str:
    """This process's host and pid namespace (a peer with the same can watch its pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        space = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}:{space}"


class NixlLinks:
    """This rank's NIXL links to `peers` (ranks of one replica group), met under `prefix` in
    `store`: the interface of `MemoryLinks` (layoutlang/runtime/memlinks.py) that
    `ReplicaTransport` and `memlinks.wait_all` use (`connect`, `post`, `progress`, `pending`,
    `watch`, `sever`, `close`), one `NixlAgent` underneath. Its agent is this group's alone: a
    restarted replica (a new group) meets new agents, numbering from 0 again, and no write of
    the old group's can complete (or be posted to) one of the new.

    `watch` notifies the peers waited for every `PROBE` s (a dead peer's agent is gone: named
    then) and, for a peer on this host and pid namespace, watches its process: exited, named at
    once; stopped `watch_stopped` s (SIGSTOP, a debugger), named as dead. A peer on another host
    that stalls is named at the deadline."""

    def __init__(self, store, prefix: str, me: int, peers, *, watch_stopped: float | None = None):
        self.store, self.prefix, self.me = store, prefix, me
        self.peers = sorted(set(peers) - {me})
        self.nixl: NixlAgent | None = None
        self.works: list[Work] = []          # posted, not yet seen done
        self.procs = PeerProcesses(watch_stopped)   # the peers' processes on this host (peerprocs.py)
        self.pids = self.procs.pids                 # peer -> its pid, where on this host and pid namespace
        self._probed = 0.0
        self._seen = 0                       # the agent's failures when last looked
        self.failed: Work | None = None      # the first message that failed (raised at every look)

    @property
    def severed(self) -> bool:
        return self.nixl is not None and self.nixl.severed

    @property
    def carrier(self) -> str:
        """What moves these links' bytes: "nixl (UCX)"."""
        return f"nixl ({self.nixl.mode})" if self.nixl is not None else "nixl"

    def connect(self, deadline: float) -> None:
        """Create this rank's agent, publish it with this process's host mark and pid, load every
        peer's by `deadline`. Raises LinkError naming the peer; `close` undoes a half connect."""
        try:
            self.nixl = NixlAgent(self.store, self.prefix, self.me)
            mark = _host_mark()
            self.store.set(f"{self.prefix}/host/{self.me}", f"{mark} {os.getpid()}")
            for peer in self.peers:
                self.nixl.connect(peer, deadline)
                theirs = store_value(self.store, f"{self.prefix}/host/{peer}", deadline)
                if theirs is None:
                    raise LinkError(peer, f"rank {peer} did not publish its host within the deadline", timed_out=True)
                where, pid = theirs.decode().rsplit(" ", 1)
                if mark and where == mark and int(pid) != os.getpid():
                    self.procs.add(peer, int(pid))  # (no pidfd, already gone: its agent's disconnect names it)
        except BaseException:
            self.close()
            raise

    def post(self, messages: list) -> list[Work]:
        """The round's messages (anything with `sending`, `tensor`, `peer`); LinkError where a
        peer closed its end or NIXL failed the post."""
        if self.severed:
            raise LinkError(messages[0].peer if messages else self.me, "this rank closed the link", closed=True)
        try:
            works = self.nixl.post(messages)
        except Exception as exc:  # noqa: BLE001 - NIXL's own error, as the first message's peer's
            raise LinkError(messages[0].peer, f"NIXL: {first_line(exc)}") from exc
        self.works += [w for w in works if not w.done]
        self._raise_failed()
        return works

    def progress(self) -> None:
        """Move every pending message; a LinkError for the first message that failed."""
        if self.severed or self.nixl is None:
            return
        try:
            self.nixl.progress()
        except Exception as exc:  # noqa: BLE001 - NIXL's own error: the first pending message's peer's
            raise LinkError(self.works[0].peer if self.works else self.me, f"NIXL: {first_line(exc)}") from exc
        self._raise_failed()

    def _raise_failed(self) -> None:
        """Raise for the first failed message, at every look from then on (as a closed channel
        does: a look that swallowed it, `progress_quietly`, leaves it for the next)."""
        if self.failed is None and self._seen != self.nixl.failures:
            self._seen = self.nixl.failures
            self.failed = next((w for w in self.works if w.error), None)
        if self.failed is not None:
            raise LinkError(self.failed.peer, self.failed.error, closed="closed the link" in self.failed.error)
        if len(self.works) > 64:
            self.works = [w for w in self.works if not w.done]

    def pending(self) -> bool:
        return self.nixl is not None and self.nixl.pending()

    def progress_quietly(self) -> None:
        try:
            self.progress()
        except LinkError:
            pass

    def watch(self, peers, now: float) -> None:
        """Raise for the first of `peers` whose agent is gone (a notification every `PROBE` s), or,
        on this host, whose process exited or has been stopped `watch_stopped` s."""
        if self.severed or self.nixl is None:
            return
        for peer, why in self.procs.look(peers, now):
            self.nixl.fail(self.nixl.owed(peer), why)
        if now - self._probed >= PROBE:
            self._probed = now
            self.nixl.probe(set(peers))
        self._raise_failed()

    def sever(self) -> None:
        """Close these links for good (`NixlAgent.sever`): every peer learns it at its next look."""
        if self.nixl is not None:
            self.nixl.sever()

    def close(self) -> None:
        """Drop the agent (`NixlAgent.close`), stop watching the peers. Its keys stay in the job's
        store (which may be gone: the trainer job closed), as a group's links' do."""
        if self.nixl is not None:
            self.nixl.close(unpublish=False)
        self.procs.close()
