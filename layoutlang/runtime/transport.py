"""How a rank's messages move: the one seam between the executor and the bytes' way.

The executor (`Refitter`, layoutlang/runtime/refit.py; the jobs' walk, layoutlang/runtime/jobgroups.py; the
loopback, layoutlang/runtime/loopback.py) walks the steps the compiler made and hands each round of
point-to-point messages to its `Transport`. A transport decides nothing about what moves:
it connects this rank to the peers the plan's ops name, posts a round, waits for it by one
deadline and names the peer that failed, and tears down. One module per transport:

- "auto" (layoutlang/runtime/transport_auto.py, `Refitter`'s default): "memory" for the pairs
  of ranks on one host (CPU tensors), "group" for every other pair.
- "group" (layoutlang/runtime/transport_group.py): a torch.distributed process group, gloo or NCCL,
  one code path.
- the per-replica groups of jobs (`ReplicaTransport`, layoutlang/runtime/jobgroups.py): one process
  group per engine replica; a failure drops that replica, not the refit.
- the loopback (`LoopbackTransport`, layoutlang/runtime/loopback.py): every rank in one process, a
  message is a copy between two of its buffers.

- "memory" (layoutlang/runtime/transport_memory.py): ranks of one host, each message read by
  its receiver straight out of its sender's memory (`process_vm_readv`; a shared-memory ring
  where the kernel does not permit it; CUDA IPC for CUDA tensors); the process group stays
  for the meetings.

- "nixl" (layoutlang/runtime/transport_nixl.py): one-sided NIXL writes (UCX, DRAM or VRAM,
  across hosts): each receiver tells its sender where a round lands, the sender writes it
  with a notification; the process group stays for the meetings. Optional: `pip install
  'layoutlang[nixl]'`.

A transport that reads or writes its peers' memory registers the buffers it needs once
per membership; the two-sided ones above register nothing.

A new transport is one module with one `Transport` subclass and a line in `TRANSPORTS`
(or `register(name, "module:Class")` from outside the package); `Refitter(plan,
transport=name)` builds it as `Class(group)`. The registry holds import paths, not classes:
a transport's module (and whatever it needs: NIXL, CUDA) is imported only when it is chosen.
"""

from __future__ import annotations

import importlib
import weakref
from abc import ABC, abstractmethod

import torch

from layoutlang.diagnostics import UsageError

# name -> "module:Class"; the class is built as Class(group) by `Refitter(plan, transport=name)`
TRANSPORTS: dict[str, str] = {
    "group": "layoutlang.runtime.transport_group:GroupTransport",
    "auto": "layoutlang.runtime.transport_auto:AutoTransport",
    "memory": "layoutlang.runtime.transport_memory:MemoryTransport",
    "nixl": "layoutlang.runtime.transport_nixl:NixlTransport",
}
ALIASES: dict[str, str] = {}   # another name for a registered one


class Transport(ABC):
    """What a rank needs to move the rounds of one plan's steps.

    Lifecycle: `bind(host)` once (the executor it serves: its `rank`, `timeout` and
    `failure(...)`, which turns a transport fault into the step's `RefitError`, naming the
    cause a peer that failed first left where there is one); `connect` to the peers of a
    plan; `register` the buffers a one-sided transport reads or writes; per round
    `message` each buffer, `post` them at once, `wait` for them by a deadline; `close`.

    A round's messages are posted by every rank in the same canonical op order, so two
    messages between one pair match in the order they were posted (gloo, NCCL and the
    loopback all rely on it)."""

    name = "transport"
    host = None

    def bind(self, host) -> None:
        """The executor this transport serves (read for `rank`, `timeout`, `failure`). Held
        weakly: the executor holds its transport, and a cycle would keep both (and the staging
        and tensors they reach) alive past their last use, until a garbage collection."""
        self.host = weakref.proxy(host)

    @abstractmethod
    def place(self) -> tuple[int, int]:
        """(this rank, the number of ranks the plan may run on)."""

    def meeting(self):
        """(store, global ranks) where a Refitter's ranks meet before and after a step; None
        where its caller meets (the jobs' walk: layoutlang/runtime/jobs.py)."""
        return None

    def device(self) -> torch.device:
        """Staging's device when no tensor says one."""
        return torch.device("cpu")

    def connect(self, ops, device: torch.device, deadline: float) -> None:
        """Connect this rank to the other ends of its `ops` by `deadline` (time.monotonic()).
        Default: nothing (a process group connects on its own)."""

    def carrier(self, peer: int) -> str:
        """What moves this rank's messages with plan rank `peer` (the Refitter's `transports`
        and the jobs' `JobReport` show it): e.g. "group (gloo)", "memory (cma)"."""
        return self.name

    def register(self, buffers) -> None:
        """The tensors a one-sided transport reads or writes in this rank's memory. Default:
        nothing (a two-sided transport is handed each buffer as its message is posted)."""

    @abstractmethod
    def message(self, sending: bool, buf: torch.Tensor, rank: int):
        """One message to (`sending`) or from plan rank `rank`, as `post` takes it."""

    @abstractmethod
    def post(self, messages: list, what: str, calls: list | None = None) -> list:
        """Start a round's messages; one work each (a transport that groups a round may return
        one work for all). `calls`: what `resolved` returned for them (a steady replay)."""

    @abstractmethod
    def wait(self, works: list, ops: list, what: str, deadline: float | None = None) -> None:
        """Wait for `works` (op i's message is works[i]) by `deadline` (time.monotonic();
        None: the timeout from now); a failure raises, naming the peer."""

    def resolved(self, messages: list) -> list | None:
        """A round's messages resolved once for a steady step's replay; None: post them anew."""
        return None

    def close(self) -> None:
        """Tear down what `connect` and `register` set up. Default: nothing."""


def register(name: str, target: str | type) -> None:
    """Make `Refitter(plan, transport=name)` build `target` (a class, or "module:Class")."""
    TRANSPORTS[name] = target


def transport_class(name: str) -> type:
    """The class registered under `name` (imported now); a UsageError names the known ones."""
    target = TRANSPORTS.get(ALIASES.get(name, name))
    if target is None:
        known = ", ".join(f'"{n}"' for n in sorted([*TRANSPORTS, *ALIASES]))
        raise UsageError(f"unknown transport {name!r}: known are {known}",
                         help="register a transport of your own with "
                              "layoutlang.runtime.transport.register(name, cls)")
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
    return target


def make_transport(transport, group=None) -> Transport:
    """A transport for a Refitter on `group`: an instance as given, else the class registered
    under the name built as Class(group)."""
    if isinstance(transport, Transport):
        return transport
    return transport_class(transport)(group)
