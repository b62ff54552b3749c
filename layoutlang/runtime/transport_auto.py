"""The "auto" transport (`Refitter`'s default): "memory" for the pairs of ranks on one host, "group" for the rest.

At `connect` (once, at the first step every rank agreed to) each rank publishes who it is
(runtime/memlinks.py: its host's boot id, its pid namespace); a pair whose two ranks share
both is linked through shared memory (`MemoryTransport`'s channels: cma, else a ring), any
other pair keeps the process group. Both ends of a pair decide from what both published, so
they always agree. Each message then goes the way of its pair, a round posted on both at
once; a wait waits on each by the round's one deadline, naming the peer as either would.

CUDA tensors keep the process group (NCCL) for every pair: the CUDA IPC path of the memory
transport is built but has not run on a GPU yet (benchmarks/gpu_transports.py is the check),
so "auto" does not pick it until it has; `transport="memory"` uses it where asked.
"""

from __future__ import annotations

import time

import torch

from .memlinks import Message, Work
from .transport_group import GroupTransport
from .transport_memory import MemoryTransport


class AutoTransport(MemoryTransport):
    """Per pair: memory on one host (CPU tensors), the process group otherwise."""

    name = "auto"
    local_only = True

    def connect(self, ops, device: torch.device, deadline: float) -> None:
        if device.type != "cpu":
            self.staging_device = device
            return  # every pair through the group (see the module's docstring)
        super().connect(ops, device, deadline)

    def _linked(self, rank: int) -> bool:
        return self.links is not None and rank in self.links.peers

    def carrier(self, peer: int) -> str:
        return MemoryTransport.carrier(self, peer) if self._linked(peer) else GroupTransport.carrier(self, peer)

    def message(self, sending: bool, buf: torch.Tensor, rank: int):
        if self._linked(rank):
            return Message(sending, buf, rank)
        return GroupTransport.message(self, sending, buf, rank)

    def resolved(self, messages: list) -> list | None:
        if any(isinstance(m, Message) for m in messages):
            return None  # (a replay posts them again)
        return GroupTransport.resolved(self, messages)

    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        if not messages:
            return []
        memory = [i for i, m in enumerate(messages) if isinstance(m, Message)]
        if not memory:
            return GroupTransport.post(self, messages, what, calls)
        group = [i for i, m in enumerate(messages) if not isinstance(m, Message)]
        works: list = [None] * len(messages)
        if group:
            posted = GroupTransport.post(self, [messages[i] for i in group], what)
            if len(posted) != len(group):  # one grouped work (NCCL): every group message's
                posted = posted[:1] * len(group)
            for i, w in zip(group, posted):
                works[i] = w
        for i, w in zip(memory, MemoryTransport.post(self, [messages[i] for i in memory], what)):
            works[i] = w
        return works

    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        if deadline is None:
            deadline = time.monotonic() + self.host.timeout.total_seconds()
        memory = [i for i, w in enumerate(works) if isinstance(w, Work)]
        if len(memory) < len(works):
            seen: set[int] = set()
            group = [i for i, w in enumerate(works) if not isinstance(w, Work)
                     and not (id(w) in seen or seen.add(id(w)))]
            GroupTransport.wait(self, [works[i] for i in group], [ops[i] for i in group], what, deadline)
        if memory:
            MemoryTransport.wait(self, [works[i] for i in memory], [ops[i] for i in memory], what, deadline)
