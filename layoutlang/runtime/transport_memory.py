"""The "memory" transport: ranks of one host move each message through shared memory.

The process group stays for what it does besides messages (this rank's place, the store the
Refitter's ranks meet in, the staging device: `GroupTransport`'s); the messages go through
`MemoryLinks` (layoutlang/runtime/memlinks.py): per pair of ranks a channel each way in
/dev/shm, and per message either one `process_vm_readv` by the receiver straight out of the
sender's tensor ("cma": one copy per byte), or, where the receiver may not read the sender,
a shared-memory ring ("ring": two copies), or for CUDA tensors the storage's CUDA IPC
handle and a device-to-device copy ("cuda-ipc"). `mode` says which.

`connect` (the Refitter calls it once, at the first step every rank agreed to) meets this
rank's peers in the group's store under a namespace of its own (the n-th memory transport
a rank connects meets the n-th of the others). A peer on another host, or one whose channel
cannot be opened, fails the step naming the pair. Waits name the peer as "group"'s do: a
peer that did not complete a message by the deadline, or at once a peer whose process
exited.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch

from layoutlang.diagnostics import UsageError

from .memlinks import LinkError, MemoryLinks, Message
from .transport_group import CAUSE_GRACE, GroupTransport

ENV_MODE = "LAYOUTLANG_MEMORY_MODE"   # "ring": every channel a ring (tests), "cma": refuse rings


class MemoryTransport(GroupTransport):
    """A Refitter's messages through shared memory between the processes of `group` (None:
    the default group), all on one host. `mode`: None (the best each pair can: "cma", else
    "ring"; the environment's LAYOUTLANG_MEMORY_MODE if set), "ring" (every pair through a
    ring) or "cma" (an error where a pair cannot read); `ring_bytes`: a ring's size."""

    name = "memory"
    local_only = False   # "auto" (runtime/transport_auto.py): pairs on other hosts keep the group

    def __init__(self, group=None, *, mode: str | None = None, ring_bytes: int | None = None):
        super().__init__(group)
        self.force = mode or os.environ.get(ENV_MODE) or None
        if self.force not in (None, "cma", "ring"):
            raise UsageError(f"memory transport mode {self.force!r}: known are \"cma\" and \"ring\"",
                             help="leave it out (and LAYOUTLANG_MEMORY_MODE unset) for the best each pair of ranks can")
        self.ring_bytes = ring_bytes
        self.links: MemoryLinks | None = None
        self.staging_device = torch.device("cpu")

    @property
    def mode(self) -> str | None:
        """How this rank's messages move: "cuda-ipc" (CUDA tensors), "cma" (every channel one
        copy), "ring" (some channel through a ring); None before `connect`."""
        if self.links is None:
            return None
        if self.staging_device.type == "cuda":
            return "cuda-ipc"
        modes = set(self.links.modes.values())
        return "ring" if "ring" in modes or (not modes and self.force == "ring") else "cma"

    @property
    def modes(self) -> dict[tuple[int, int], str]:
        """(sending rank, receiving rank) -> "cma" or "ring", for this rank's channels."""
        return {} if self.links is None else self.links.modes

    def connect(self, ops, device: torch.device, deadline: float) -> None:
        me = self.host.rank
        peers = {op.dst_rank if op.src_rank == me else op.src_rank for op in ops if op.src_rank != op.dst_rank}
        store, ranks = self.meeting()
        if store is None:
            raise self.host.failure("the memory transport has no store to meet in (initialize the process group)")
        members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:8]
        base = f"layoutlang/{members}/memory"
        generation = store.add(f"{base}/generation/{me}", 1)
        kwargs = {} if self.ring_bytes is None else {"ring_bytes": self.ring_bytes}
        self.staging_device = device
        self.links = MemoryLinks(store, f"{base}/{generation}", me, peers, mode=self.force,
                                 local_only=self.local_only, **kwargs)
        try:
            self.links.connect(deadline)
        except LinkError as exc:
            self.links = None
            raise self.host.failure(f"the memory transport cannot connect ranks {me} and {exc.peer}: {exc.reason}",
                                    peers=(exc.peer,), grace=0.0 if exc.timed_out else CAUSE_GRACE) from None

    def carrier(self, peer: int) -> str:
        if self.staging_device.type == "cuda":
            return "memory (cuda-ipc)"
        modes = self.modes
        mode = modes.get((peer, self.host.rank)) or modes.get((self.host.rank, peer))
        return f"memory ({mode})" if mode else "memory"

    def message(self, sending: bool, buf: torch.Tensor, rank: int) -> Message:
        return Message(sending, buf, rank)

    def resolved(self, messages: list) -> list | None:
        return None  # (a replay posts the same messages again: nothing to resolve)

    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        if not messages:
            return []
        if self.links is None:
            raise self.host.failure(f"posting {len(messages)} {what} failed: the memory transport is not connected",
                                    peers=())
        try:
            return self.links.post(messages)
        except LinkError as exc:
            raise self.host.failure(f"posting {len(messages)} {what} failed at the one with peer rank {exc.peer}: "
                                    f"{exc.reason}", peers=(exc.peer,), grace=CAUSE_GRACE) from None

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        """Wait under ONE deadline (from now, or the one the round got when it was posted);
        the error names the peer and the op as "group"'s does."""
        host = self.host
        timeout = host.timeout.total_seconds()
        if deadline is None:
            deadline = time.monotonic() + timeout
        try:
            self.links.wait(works, deadline)
        except LinkError as exc:
            peer = exc.peer
            op = ops[exc.index] if exc.index is not None and exc.index < len(ops) else None
            text = f"peer rank {peer} did not complete it within {timeout:g} s" if exc.timed_out else exc.reason
            where = f"{what} of op {op.id} (`{op.key}`)" if op is not None else what
            raise host.failure(f"{where} with peer rank {peer} failed: {text}", peers=(peer,),
                               grace=0.0 if exc.timed_out else CAUSE_GRACE) from None

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
            self.links = None

