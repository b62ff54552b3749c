"""Same-host links between a set of ranks: messages through shared memory, one copy per byte.

`MemoryLinks(store, prefix, me, peers)` connects this rank to each peer rank through two
channels, one per direction, that meet in any c10d store under `prefix` (the memory
transport's are a Refitter's: layoutlang/runtime/transport_memory.py). A channel is a small
file in /dev/shm that its receiver creates and both ends map: a header and a FIFO of
`SLOTS` slots of `SLOT_BYTES`. Messages between a pair match in the order they are posted
(every rank posts in canonical op order, as with gloo); sequence numbers check it.

How a message's bytes move, per channel (its receiver chooses it at `connect`, by reading
back a random mark its sender published, `cma.probe`):

- "cma": the sender's post publishes the address and size of its (contiguous) buffer in a
  slot; the receiver, in any wait, reads the bytes straight into its own buffer with one
  `process_vm_readv` (layoutlang/runtime/cma.py), then acknowledges the slot. The sender's
  message completes on that acknowledgement (its buffer stays untouched until then): one
  copy per byte, by the kernel.
- "ring": where the receiver cannot read the sender (a ptrace policy, another pid
  namespace, or forced), the channel has a data ring of `ring_bytes`: the sender copies
  its message in, in chunks, and the receiver copies them out: two copies. A sender's
  message completes once its last chunk is in the ring.
- CUDA tensors (either channel): the sender publishes its storage's CUDA IPC handle
  (`_share_cuda_`), the receiver opens it once (cached per sender and handle), copies device
  to device, synchronizes and acknowledges (`_CudaIpc`; the copy the GPU makes).

Progress never deadlocks: a post never blocks (what does not fit in the FIFO or the ring
waits in the channel's queue), and every wait moves every channel's pending messages, not
only those it waits for. A wait spins briefly, then sleeps at most `NAP` at a time, and
watches each peer's process (`os.pidfd_open`): a peer that exits fails the wait at once;
otherwise the deadline names the first message not done. `sever` closes every channel of a
rank (a header word each end writes, `W_SCLOSED` / `W_RCLOSED`): the rank at the other end
fails its pending and later messages with it at once ("rank P closed the link"), as a
closed socket fails gloo's. `wait_all` waits on works of several `MemoryLinks` (a rank
linked to several replicas' ranks), moving every one of them meanwhile. The files are unlinked as soon as
both ends have mapped them (`connect`); a process killed before that leaves files named by
its pid namespace and pid, which the next `connect` on the host removes.

The header's words are written with single aligned 8-byte stores through a memoryview: a
slot is written before the head that publishes it, an acknowledgement after the copy, in
that order for the other process (`_fence`: nothing to do on x86-64, a barrier on aarch64).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from . import cma
from .peerprocs import PeerProcesses

SLOTS = 256            # messages (ring: chunks) in flight per channel before a post queues
SLOT_BYTES = 512       # a slot: 8 words, then a CUDA IPC handle's bytes
HEADER = 192           # three cache lines: the receiver's constants, the sender's words, the receiver's
RING_BYTES = 16 << 20  # a "ring" channel's data ring
CHUNK = 1 << 20        # a ring chunk, at most
SPIN = 2e-4            # s a wait polls without sleeping
NAP = 1e-3             # s a wait sleeps at most between polls
MAGIC = 0x31304D454D4C4C   # "LLMEM01"
PREFIX = "layoutlang-mem-"
CUDA_CACHE = 64        # opened CUDA IPC storages a receiver keeps

# header words (int64 index): the receiver's constants, the sender's line, the receiver's line
W_MAGIC, W_MODE, W_SLOTS, W_RING = 0, 1, 2, 3
W_HEAD, W_MAPPED, W_SCLOSED = 8, 9, 10   # sender: slots published; it mapped the file; it closed (`sever`)
W_TAIL, W_FREED, W_RCLOSED = 16, 17, 18  # receiver: slots consumed (acknowledged); ring bytes copied out; closed
# slot words: message sequence, kind, then per kind
S_SEQ, S_KIND, S_A, S_B, S_C, S_D = range(6)
CMA, RING, CUDA = 1, 2, 3
MODES = {CMA: "cma", RING: "ring"}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_as_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_as_memory.restype = ctypes.py_object
_as_memory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
PROT_RW, MAP_SHARED, PYBUF_WRITE = 0x1 | 0x2, 0x01, 0x200


def _memory_fence():
    """A full memory barrier between this thread's accesses to a channel, where the
    processor needs one: x86-64 keeps stores in order and loads before later accesses (no
    call); elsewhere (aarch64) a mutex of the thread's own unlocked and locked again, whose
    release and acquire (in that order) order every access before them before every access
    after them."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return lambda: None
    try:
        lock, unlock = _libc.pthread_mutex_lock, _libc.pthread_mutex_unlock
    except AttributeError:  # (a libc without them: sched_yield, a system call, at least)
        return os.sched_yield
    mine = threading.local()

    def fence() -> None:
        mutex = getattr(mine, "mutex", None)
        if mutex is None:
            mutex = mine.mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: zeros
            lock(mutex)
        unlock(mutex)
        lock(mutex)

    return fence


_fence = _memory_fence()


class LinkError(Exception):
    """A link failed: `peer` (a rank), `reason`; `index`: the first message of the wait not
    done; `timed_out` (the deadline passed) or `pid` (the peer's process exited)."""

    def __init__(self, peer: int, reason: str, *, index: int | None = None, timed_out: bool = False,
                 pid: int | None = None, closed: bool = False):
        super().__init__(reason)
        self.peer, self.reason, self.index, self.timed_out, self.pid = peer, reason, index, timed_out, pid
        self.closed = closed   # the peer closed the link (`sever`)
        self.links = None      # the MemoryLinks it failed on (`wait_all`)


class Message:
    """One message of a round: `tensor` to (`sending`) or from `peer`; posted any number of
    times (a steady step's replay posts the same messages again)."""

    __slots__ = ("sending", "tensor", "peer")

    def __init__(self, sending: bool, tensor: torch.Tensor, peer: int):
        if not tensor.is_contiguous():
            raise ValueError("a memory-transport message's buffer must be contiguous (the steps stage the others)")
        self.sending, self.tensor, self.peer = sending, tensor, peer


class Work:
    """A posted message: done once its bytes left (sender) or arrived (receiver)."""

    __slots__ = ("peer", "sending", "tensor", "addr", "nbytes", "seq", "kind", "moved", "end", "done")

    def __init__(self, m: Message, seq: int):
        t = m.tensor
        self.peer, self.sending, self.tensor, self.seq = m.peer, m.sending, t, seq
        self.addr, self.nbytes = t.data_ptr(), t.numel() * t.element_size()
        self.kind = CUDA if t.is_cuda else 0
        self.moved = 0       # ring: bytes copied in (sender) or out (receiver)
        self.end = 0         # sender, cma / CUDA: the slot count that acknowledges it
        self.done = False


class _Segment:
    """A mapped channel file: its address, its header and slots as int64 words."""

    def __init__(self, fd: int, size: int):
        addr = _mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            code = ctypes.get_errno()
            raise OSError(code, f"mmap of a channel failed: {os.strerror(code)}")
        self.addr, self.size = addr, size
        self.words = _as_memory(addr, HEADER + SLOTS * SLOT_BYTES, PYBUF_WRITE).cast("q")

    def slot(self, i: int) -> int:
        return (HEADER + (i % SLOTS) * SLOT_BYTES) // 8

    def blob(self, i: int) -> int:
        return self.addr + HEADER + (i % SLOTS) * SLOT_BYTES + 64

    def close(self) -> None:
        if self.addr:
            self.words.release()
            _munmap(self.addr, self.size)
            self.addr = 0


class _Channel:
    """One direction between this rank and a peer: its segment, mode, and what is in flight."""

    def __init__(self, peer: int, seg: _Segment, sending: bool):
        self.peer, self.seg, self.sending = peer, seg, sending
        w = seg.words
        self.mode = MODES[w[W_MODE]]
        self.ring = seg.addr + HEADER + SLOTS * SLOT_BYTES if w[W_RING] else 0
        self.ring_bytes = w[W_RING]
        self.chunk = min(CHUNK, max(self.ring_bytes // 2, 1))
        self.seq = 0              # messages posted
        self.slots = 0            # sender: slots published (the head); receiver: consumed (the tail)
        self.ring_at = 0          # sender: ring bytes written; receiver: copied out
        self.queue: deque = deque()     # sender: works not (fully) in slots yet; receiver: posted receives
        self.unacked: deque = deque()   # sender: works in slots, waiting for their acknowledgement


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return socket.gethostname()


def _pid_namespace() -> str:
    try:
        st = os.stat("/proc/self/ns/pid")
        return f"{st.st_dev:x}.{st.st_ino:x}"
    except OSError:
        return "0"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(namespace: str) -> int:
    """Remove channel files of this pid namespace whose creating process is gone (it was
    killed between creating one and its peer mapping it); how many."""
    removed, head = 0, f"{PREFIX}{namespace}-"
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return 0
    for name in names:
        if not name.startswith(head):
            continue
        try:
            pid = int(name[len(head):].split("-", 1)[0])
        except ValueError:
            continue
        if not _alive(pid):
            try:
                os.unlink(os.path.join(shm_dir(), name))
                removed += 1
            except OSError:
                pass
    return removed


class MemoryLinks:
    """This rank's channels to and from each of `peers`, met under `prefix` in `store`.

    `connect(deadline)` once (every peer connects too), then `post` messages and `wait` for
    them by a deadline; `close` unmaps. `mode`: None (each channel the best its receiver can
    read: "cma", else "ring") or "ring" (every channel a ring, as a test forces).
    `watch_stopped` (seconds, or None): a wait fails on a peer whose process has been stopped
    (SIGSTOP, a debugger: state T in /proc/PID/stat) that long, as on one that died (the jobs
    use it: a stopped replica rank is dropped instead of holding the trainer to the deadline)."""

    def __init__(self, store, prefix: str, me: int, peers, *, mode: str | None = None,
                 ring_bytes: int = RING_BYTES, local_only: bool = False, watch_stopped: float | None = None):
        if mode not in (None, "cma", "ring"):
            raise ValueError(f"mode {mode!r}: None, 'cma' or 'ring'")
        self.store, self.prefix, self.me = store, prefix, me
        self.peers = sorted(set(peers) - {me})
        # local_only ("auto"): a peer on another host or in another pid namespace is no error but
        # not linked: `elsewhere` says why (both ends of a pair decide alike, from what both published)
        self.local_only = local_only
        self.elsewhere: dict[int, str] = {}
        self.force, self.ring_bytes = mode, ring_bytes
        self.out: dict[int, _Channel] = {}
        self.inn: dict[int, _Channel] = {}
        self.procs = PeerProcesses(watch_stopped)   # the peers' processes on this host (peerprocs.py)
        self.pids = self.procs.pids              # peer -> its pid, where watched
        self.created: list[str] = []     # files this rank created and has not unlinked yet
        self._mark: torch.Tensor | None = None
        self._cuda = None
        self.namespace = _pid_namespace()
        self.severed = False                 # this rank closed every channel (`sever`)
        # what `close` releases, also when the links are dropped without it (the containers are
        # kept, only emptied: the finalizer holds them, not the links)
        self._release = weakref.finalize(self, _release, self.out, self.inn, self.procs, self.created)

    # ---- connecting -------------------------------------------------------------------
    def _get(self, key: str, deadline: float, peer: int, what: str) -> str:
        """`key`'s value once a peer set it, by `deadline`. Looked for (`check`), never waited on:
        a store client serves one request at a time, so a blocking wait would hold up every other
        thread of this process that uses it (a trainer rank links its replicas in a thread each,
        and one replica's wait would keep another's keys from being set: a deadlock until the
        deadline)."""
        left = deadline - time.monotonic()
        nap = 1e-3
        try:
            while not self.store.check([key]):
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError("timed out")
                time.sleep(min(nap, deadline - now))
                nap = min(nap * 2, 0.02)
            return self.store.get(key).decode()
        except Exception as exc:  # noqa: BLE001 - a timeout or a store gone: named as the peer's
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "timeout" in text.lower() or "timed out" in text.lower():
                text = f"rank {peer} did not {what} within {max(left, 0):.3g} s"
            raise LinkError(peer, text, timed_out=True) from None

    def connect(self, deadline: float) -> None:
        """Meet every peer: publish who this rank is, probe each peer's memory, create the
        channel each peer sends this rank, map the one this rank sends it, unlink once both
        ends hold each file. Raises LinkError naming the peer; `close` undoes a half connect."""
        try:
            self._connect(deadline)
        except BaseException:
            self.close()
            raise

    def _connect(self, deadline: float) -> None:
        if not self.peers:
            return
        clean_stale(self.namespace)
        readable = self.force != "ring" and cma.available() and cma.allow_readers()
        nonce = int.from_bytes(os.urandom(7), "little")
        self._mark = torch.tensor([nonce, os.getpid()], dtype=torch.int64)   # read back by the peers' probes
        boot, host = _boot_id(), socket.gethostname()
        mine = f"{os.getpid()} {self._mark.data_ptr()} {nonce} {boot} {self.namespace} {host}"
        self.store.set(f"{self.prefix}/who/{self.me}", mine)
        who = {peer: self._get(f"{self.prefix}/who/{peer}", deadline, peer, "connect").split(" ")
               for peer in self.peers}
        if self.local_only:
            for peer, (_, _, _, their_boot, their_ns, their_host) in who.items():
                if their_boot != boot:
                    self.elsewhere[peer] = f"on another host ({their_host})"
                elif their_ns != self.namespace:
                    self.elsewhere[peer] = "in another pid namespace (another container)"
            self.peers = [p for p in self.peers if p not in self.elsewhere]
        for peer in self.peers:  # the channel peer -> me: this rank receives, so it reads the peer
            pid, addr, mark, their_boot, their_ns, their_host = who[peer]
            pid = int(pid)
            if their_boot != boot:
                raise LinkError(peer, f"rank {peer} runs on another host ({their_host}, this rank on {host}): the "
                                      "memory transport moves bytes between processes of one host")
            same_ns = their_ns == self.namespace
            if same_ns:
                self.procs.add(peer, pid)  # (no pidfd: the deadline alone)
            cma_ok = readable and same_ns and cma.probe(pid, int(addr), (int(mark), pid))
            if self.force == "cma" and not cma_ok:
                raise LinkError(peer, f"this rank cannot read process {pid} of rank {peer} with process_vm_readv "
                                      f"(ptrace policy {cma.ptrace_scope()}, or another pid namespace)")
            try:
                path = self._create(CMA if cma_ok else RING)
            except OSError as exc:
                raise LinkError(peer, f"cannot create the channel from rank {peer} in {shm_dir()}: {exc.strerror} "
                                      "(a /dev/shm too small? transport=\"group\" needs none)") from None
            self.inn[peer] = _Channel(peer, self._map(path), False)
            self.store.set(f"{self.prefix}/ch/{peer}/{self.me}", path)
        for peer in self.peers:  # the channel me -> peer: its receiver made it
            path = self._get(f"{self.prefix}/ch/{self.me}/{peer}", deadline, peer, "connect")
            try:
                seg = self._map(path)
            except OSError as exc:
                raise LinkError(peer, f"cannot open rank {peer}'s channel {path}: {exc.strerror} (another host, or "
                                      "another /dev/shm)") from None
            if seg.words[W_MAGIC] != MAGIC:
                raise LinkError(peer, f"rank {peer}'s channel {path} is not one of this version's")
            seg.words[W_MAPPED] = 1
            self.out[peer] = _Channel(peer, seg, True)
        for peer in self.peers:  # both ends hold the peer -> me file: it needs no name any more
            ch = self.inn[peer]
            while not ch.seg.words[W_MAPPED]:
                if time.monotonic() > deadline:
                    raise LinkError(peer, f"rank {peer} did not map its channel in time", timed_out=True)
                self._died(peer)
                time.sleep(NAP)
        for path in self.created:
            _unlink(path)
        self.created.clear()
        # (a peer elsewhere may not have read this rank's `who` yet: it stays, one key per connect)
        mine = [] if self.elsewhere else [f"{self.prefix}/who/{self.me}"]
        for key in mine + [f"{self.prefix}/ch/{p}/{self.me}" for p in self.peers]:
            try:  # every peer read them (it mapped this rank's channels after reading both)
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - a key left in the store costs nothing more
                pass

    def _create(self, kind: int) -> str:
        ring = self.ring_bytes if kind == RING else 0
        size = HEADER + SLOTS * SLOT_BYTES + ring
        path = os.path.join(shm_dir(), f"{PREFIX}{self.namespace}-{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.created.append(path)
        try:
            os.ftruncate(fd, size)
            # the pages now: a /dev/shm too small (a container's 64 MiB) fails here, not as a
            # SIGBUS at a later write into the mapping
            os.posix_fallocate(fd, 0, size)
            seg = _Segment(fd, size)
        finally:
            os.close(fd)
        w = seg.words
        w[W_MODE], w[W_SLOTS], w[W_RING] = kind, SLOTS, ring
        w[W_MAGIC] = MAGIC
        seg.close()
        return path

    def _map(self, path: str) -> _Segment:
        fd = os.open(path, os.O_RDWR)
        try:
            return _Segment(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    @property
    def modes(self) -> dict[tuple[int, int], str]:
        """(sender, receiver) -> "cma" or "ring", for every channel of this rank."""
        out = {(self.me, p): ch.mode for p, ch in self.out.items()}
        out.update({(p, self.me): ch.mode for p, ch in self.inn.items()})
        return out

    # ---- messages -----------------------------------------------------------------------
    def post(self, messages: list[Message]) -> list[Work]:
        """Post messages, in order (never blocks): sends go into their FIFOs (or queue)."""
        works = []
        synced = set()
        for m in messages:
            if self.severed:
                raise LinkError(m.peer, f"this rank closed its link with rank {m.peer}", closed=True)
            ch = (self.out if m.sending else self.inn).get(m.peer)
            if ch is None:
                raise LinkError(m.peer, f"rank {m.peer} is not a peer this rank connected to")
            w = Work(m, ch.seq)
            ch.seq += 1
            ch.queue.append(w)
            works.append(w)
            if m.sending:
                if w.kind == CUDA and m.tensor.device not in synced:  # its bytes are written before a peer reads
                    torch.cuda.current_stream(m.tensor.device).synchronize()
                    synced.add(m.tensor.device)
                self._push(ch)
        return works

    def _push(self, ch: _Channel) -> None:
        """Publish what fits of a sender's queue: one slot per message, or ring chunks."""
        w = ch.seg.words
        while ch.queue:
            work = ch.queue[0]
            if ch.slots - w[W_TAIL] >= SLOTS:
                return
            s = ch.seg.slot(ch.slots)
            if work.kind == CUDA or ch.mode == "cma":
                if work.kind == CUDA:
                    self._cuda_ipc().publish(work, ch.seg.blob(ch.slots))
                w[s + S_SEQ], w[s + S_KIND], w[s + S_A], w[s + S_B] = work.seq, work.kind or CMA, work.addr, work.nbytes
                ch.slots += 1
                _fence()  # (the slot before the head that publishes it)
                w[W_HEAD] = ch.slots
                work.end = ch.slots
                ch.queue.popleft()
                ch.unacked.append(work)
                continue
            left = work.nbytes - work.moved
            want = min(left, ch.chunk)
            if ch.ring_bytes - (ch.ring_at - w[W_FREED]) < want:
                return
            _fence()  # (the receiver's copy out of this space before this copy in)
            at = ch.ring_at % ch.ring_bytes
            n = min(want, ch.ring_bytes - at)
            if n:
                ctypes.memmove(ch.ring + at, work.addr + work.moved, n)
            w[s + S_SEQ], w[s + S_KIND], w[s + S_A], w[s + S_B], w[s + S_C], w[s + S_D] = (
                work.seq, RING, at, n, work.nbytes, work.moved)
            ch.slots += 1
            _fence()
            w[W_HEAD] = ch.slots
            ch.ring_at += n
            work.moved += n
            if work.moved == work.nbytes:
                work.done, work.tensor = True, None
                ch.queue.popleft()

    def _acked(self, ch: _Channel) -> None:
        tail = ch.seg.words[W_TAIL]
        _fence()  # (the receiver's read of a buffer before its owner writes it again)
        while ch.unacked and ch.unacked[0].end <= tail:
            work = ch.unacked.popleft()
            work.done, work.tensor = True, None

    def _take(self, ch: _Channel) -> None:
        """Consume what arrived for a receiver's posted messages, in order; acknowledge each slot."""
        w = ch.seg.words
        head = w[W_HEAD]
        _fence()  # (the slots the head publishes after it)
        while ch.slots < head and ch.queue:
            work = ch.queue[0]
            s = ch.seg.slot(ch.slots)
            seq, kind = w[s + S_SEQ], w[s + S_KIND]
            if seq != work.seq:
                raise LinkError(ch.peer, f"message {seq} from rank {ch.peer} arrived where this rank expects "
                                         f"message {work.seq} (the ranks posted different messages)")
            total = w[s + S_C] if kind == RING else w[s + S_B]
            if total != work.nbytes:
                raise LinkError(ch.peer, f"rank {ch.peer} sent {total} bytes where this rank expects {work.nbytes} "
                                         f"(message {seq}; the ranks posted different messages)")
            if kind == CMA:
                if work.kind == CUDA:
                    raise LinkError(ch.peer, f"rank {ch.peer} sent host memory into a CUDA buffer")
                try:
                    cma.pull_run(self.pids[ch.peer], work.addr, w[s + S_A], work.nbytes)
                except cma.AttachError as exc:
                    self._died(ch.peer)
                    raise LinkError(ch.peer, f"reading rank {ch.peer}'s message failed: {exc.strerror}") from None
                work.done, work.tensor = True, None
                ch.queue.popleft()
            elif kind == CUDA:
                self._cuda_ipc().take(work, ch.seg.blob(ch.slots), self.pids.get(ch.peer, ch.peer))
                work.done, work.tensor = True, None
                ch.queue.popleft()
            else:
                if work.kind == CUDA:
                    raise LinkError(ch.peer, f"rank {ch.peer} sent host memory into a CUDA buffer")
                at, n, offset = w[s + S_A], w[s + S_B], w[s + S_D]
                if offset != work.moved:
                    raise LinkError(ch.peer, f"rank {ch.peer}'s ring chunk at {offset} where {work.moved} was due")
                if n:
                    ctypes.memmove(work.addr + offset, ch.ring + at, n)
                work.moved += n
                ch.ring_at += n
                _fence()  # (the copy out before the space is given back)
                w[W_FREED] = ch.ring_at
                if work.moved == work.nbytes:
                    work.done, work.tensor = True, None
                    ch.queue.popleft()
            ch.slots += 1
            _fence()
            w[W_TAIL] = ch.slots

    def progress(self) -> None:
        """One pass over every channel: sends pushed, acknowledgements read, arrivals taken; a
        LinkError where a peer with messages pending closed its end (`sever`). Nothing once
        this rank closed its own."""
        if self.severed:
            return
        for ch in self.out.values():
            if ch.queue or ch.unacked:
                if ch.seg.words[W_RCLOSED]:
                    raise self._closed_by(ch.peer)
                if ch.queue:
                    self._push(ch)
                if ch.unacked:
                    self._acked(ch)
        for ch in self.inn.values():
            if ch.queue:
                if ch.seg.words[W_SCLOSED]:
                    raise self._closed_by(ch.peer)
                self._take(ch)

    def _closed_by(self, peer: int) -> LinkError:
        return LinkError(peer, f"rank {peer} closed the link", closed=True)

    def pending(self) -> bool:
        """Has this rank messages posted and not done on any channel?"""
        return not self.severed and (any(ch.queue or ch.unacked for ch in self.out.values())
                                     or any(ch.queue for ch in self.inn.values()))

    def sever(self) -> None:
        """Close every channel of this rank, at once and for good: each peer's pending and later
        messages with this rank fail at its next look ("rank P closed the link"), as a closed
        socket fails gloo's (layoutlang/runtime/jobgroups.py `sever`). This rank's own pending
        messages are dropped (their buffers are the caller's again) and it posts none again;
        `close` still unmaps."""
        if self.severed:
            return
        self.severed = True
        for ch in self.out.values():
            ch.seg.words[W_SCLOSED] = 1
            ch.queue.clear()
            ch.unacked.clear()
        for ch in self.inn.values():
            ch.seg.words[W_RCLOSED] = 1
            ch.queue.clear()

    def _died(self, peer: int) -> None:
        """Raise if `peer`'s process has exited (where this rank watches it)."""
        why = self.procs.died(peer)
        if why is not None:
            raise LinkError(peer, why, pid=self.pids[peer])

    def watch(self, peers, now: float) -> None:
        """Raise for the first of `peers` whose process exited (or, watched, has stopped)."""
        for peer, why in self.procs.look(peers, now):
            raise LinkError(peer, why, pid=self.pids[peer])

    def wait(self, works: list[Work], deadline: float) -> None:
        """Until every work is done, moving every channel meanwhile; LinkError (its `index`: the
        first work not done with the failing peer) when a peer dies or the deadline passes."""
        wait_all([(self, w) for w in works], deadline)

    def progress_quietly(self) -> None:
        try:
            self.progress()
        except LinkError:
            pass

    def _cuda_ipc(self):
        if self._cuda is None:
            self._cuda = _CudaIpc()
        return self._cuda

    def close(self) -> None:
        """Unmap every channel, unlink any file not yet unlinked, stop watching the peers."""
        _release(self.out, self.inn, self.procs, self.created)
        self._cuda = None


def wait_all(works: list, deadline: float, also=()) -> None:
    """Until every (links, work) of `works` is done, moving every channel of those links and of
    `also` (other MemoryLinks of this rank whose peers need it: a trainer rank waiting on one
    replica while another's channels still carry its messages) meanwhile. A LinkError names
    the first failing peer of the links it failed on (`index`: the first work not done with that
    peer; `links`: the MemoryLinks), when a peer dies, closes its end, stops (watched) or the
    deadline passes. What fails on a link of `also` alone is left for its own wait."""
    mine = list(dict.fromkeys(links for links, _ in works))
    others = [links for links in dict.fromkeys(also) if links not in mine]
    started = time.monotonic()
    nap = 2e-5

    def failed(links, exc: LinkError) -> LinkError:
        exc.index = next((i for i, (k, w) in enumerate(works) if k is links and not w.done and w.peer == exc.peer),
                         None)
        exc.links = links
        return exc

    while True:
        for links in mine:
            try:
                links.progress()
            except LinkError as exc:
                raise failed(links, exc) from None
        for links in others:
            links.progress_quietly()
        pending = next((i for i, (_, w) in enumerate(works) if not w.done), None)
        if pending is None:
            return
        now = time.monotonic()
        if now - started < SPIN:
            continue
        for links in mine:
            waiting = {w.peer for k, w in works if k is links and not w.done}
            try:
                links.watch(waiting, now)
            except LinkError as exc:
                links.progress_quietly()  # (what it left in a ring still arrives)
                exc = failed(links, exc)
                if exc.index is not None:
                    raise exc from None
        if now >= deadline:
            links, first = works[pending]
            exc = LinkError(first.peer, "deadline", index=pending, timed_out=True)
            exc.links = links
            raise exc
        time.sleep(min(nap, max(deadline - now, 0.0)))
        nap = min(nap * 2, NAP)


def _release(out: dict, inn: dict, procs: PeerProcesses, created: list) -> None:
    for path in created:
        _unlink(path)
    created.clear()
    for ch in list(out.values()) + list(inn.values()):
        ch.queue.clear()
        ch.unacked.clear()
        ch.seg.close()
    out.clear()
    inn.clear()
    procs.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise


@dataclass(frozen=True)
class IpcHandle:
    """What a receiver needs to open a sender's CUDA storage (`UntypedStorage._share_cuda_`'s
    fields), and where the message starts in it (`start`, bytes)."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref: bytes
    ref_offset: int
    event: bytes | None
    sync: bool
    start: int

    def encode(self) -> bytes:
        """The handle as a slot's blob carries it, and back (`decode`).

        >>> h = IpcHandle(1, b"h" * 64, 4096, 512, b"/torch_1_2", 8, None, False, 128)
        >>> IpcHandle.decode(h.encode() + bytes(100)) == h
        True
        """
        parts = [self.handle, self.ref, self.event or b""]
        ints = [self.device, self.size, self.offset, self.ref_offset, int(self.sync), self.start,
                int(self.event is not None)]
        return b"".join(len(p).to_bytes(2, "little") + p for p in parts) + b"".join(
            i.to_bytes(8, "little", signed=True) for i in ints)

    @classmethod
    def decode(cls, raw: bytes) -> "IpcHandle":
        parts, at = [], 0
        for _ in range(3):
            n = int.from_bytes(raw[at:at + 2], "little")
            parts.append(bytes(raw[at + 2:at + 2 + n]))
            at += 2 + n
        device, size, offset, ref_offset, sync, start, has_event = (
            int.from_bytes(raw[at + 8 * i:at + 8 * i + 8], "little", signed=True) for i in range(7))
        handle, ref, event = parts
        return cls(device, handle, size, offset, ref, ref_offset, event if has_event else None, bool(sync), start)


class _CudaIpc:
    """CUDA tensors between processes of one host: the sender publishes its storage's IPC
    handle (`UntypedStorage._share_cuda_`) in the slot's blob, the receiver opens it
    (`_new_shared_cuda`, as torch.multiprocessing's `rebuild_cuda_tensor` does; kept for the
    next messages from that sender and handle, `CUDA_CACHE` at most), copies device to device
    into its buffer and synchronizes before it acknowledges. Correct by design; no GPU here."""

    def __init__(self):
        self.opened: OrderedDict = OrderedDict()  # (pid, handle, offset, size) -> storage

    @staticmethod
    def publish(work: Work, blob: int) -> None:
        t = work.tensor
        device, handle, size, offset, ref, ref_offset, event, sync = t.untyped_storage()._share_cuda_()
        raw = IpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(ref or b""), int(ref_offset),
                        None if event is None else bytes(event), bool(sync),
                        t.storage_offset() * t.element_size()).encode()
        if len(raw) > SLOT_BYTES - 64:
            raise ValueError(f"a CUDA IPC handle of {len(raw)} bytes does not fit a slot")
        ctypes.memmove(blob, raw, len(raw))

    def take(self, work: Work, blob: int, pid: int) -> None:
        h = IpcHandle.decode(ctypes.string_at(blob, SLOT_BYTES - 64))
        key = (pid, h.handle, h.offset, h.size)
        storage = self.opened.get(key)
        if storage is None:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(h.device, h.handle, h.size, h.offset, h.ref,
                                                             h.ref_offset, h.event, h.sync)
            self.opened[key] = storage
            while len(self.opened) > CUDA_CACHE:
                self.opened.popitem(last=False)
        else:  # (already counted: the producer's new counter goes back, as torch does)
            self.opened.move_to_end(key)
            torch.UntypedStorage._release_ipc_counter(h.ref, h.ref_offset, device=h.device)
        source = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device))
        source.set_(storage, h.start, (work.nbytes,))
        target = work.tensor.reshape(-1).view(torch.uint8)
        target.copy_(source)
        torch.cuda.current_stream(target.device).synchronize()
