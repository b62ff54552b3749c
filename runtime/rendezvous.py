"""Meeting points of a refit, kept in the process group's store: every wait has a deadline.

Why the store and not a collective: a collective waits under the process
group's own timeout (30 minutes by default), cannot say which rank is missing,
and on NCCL may never return. Through the store a rank that waits too long
names the ranks that never arrived, and tells every other rank at once.

A meeting is three kinds of keys under its prefix::

    here/R   set by rank R when it arrives (value: a short note for the others)
    count    arrivals, +1 each; giving up adds ABORT, so no later total is `world`
    gate     "go" (the last arrival) or "abort\\n<reason>" (the first to give up)

The count turns a race into one decision: the gate opens only for the rank
whose increment made the count exactly `world`; a rank that gives up first
adds ABORT, after which no increment can land on `world`, and a late arrival
reads the reason instead of waiting. So either every rank passes a meeting or
every rank fails it, with the same reason.

>>> ABORT > 1 << 30   # more ranks than any group has
True
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

ABORT = 1 << 40
GO = b"go"


class Abandoned(Exception):
    """This meeting did not happen; `reason` says why, `peers` who is to blame."""

    def __init__(self, reason: str, peers: tuple[int, ...] = ()):
        super().__init__(reason)
        self.reason = reason
        self.peers = peers


class StoreUnreachable(Exception):
    """The store itself failed (its host died or the connection broke)."""


class Rendezvous:
    """Named meetings of `world` ranks in `store`, each under a deadline.

    ``namespace`` separates Refitters and steps; every key lives under it.
    """

    def __init__(self, store, rank: int, world: int, namespace: str):
        self.store = store
        self.rank = rank
        self.world = world
        self.namespace = namespace

    # ---- store calls: a broken store is one error, a timeout another ----------
    def _call(self, fn, *args):
        try:
            return fn(*args)
        except dist.DistStoreError as exc:
            if "timeout" in str(exc).lower():
                raise TimeoutError(str(exc).splitlines()[0]) from None
            raise StoreUnreachable(self._unreachable(exc)) from None
        except (dist.DistError, RuntimeError, OSError) as exc:
            raise StoreUnreachable(self._unreachable(exc)) from None

    def _unreachable(self, exc) -> str:
        store = self.store
        while hasattr(store, "underlying_store"):  # PrefixStores around the TCPStore
            store = store.underlying_store
        where = f" at {store.host}:{store.port}" if hasattr(store, "host") else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (f"the process group's store{where} is unreachable (rank 0 hosts it under env:// "
                f"init; under torchrun the launcher does): {first}")

    def key(self, *parts) -> str:
        return "/".join((self.namespace, *map(str, parts)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.store.add, key, amount))

    def delete(self, key: str) -> None:
        try:
            self._call(self.store.delete_key, key)
        except (StoreUnreachable, TimeoutError):
            pass  # cleanup is best effort; the next meeting reports a dead store

    # ---- meetings ---------------------------------------------------------------
    def meet(self, prefix: str, timeout: timedelta, *, what: str, note: str = "") -> None:
        """Wait until every rank arrived at `prefix`, at most `timeout`.

        Raises Abandoned naming the ranks that did not `what` ("start step 3")
        in time, or the reason another rank gave up first.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        self._call(self.store.set, f"{prefix}/here/{self.rank}", note or "1")
        n = self.add(f"{prefix}/count", 1)
        if n == self.world:
            self._call(self.store.set, f"{prefix}/gate", GO)
            return
        if n > self.world:
            raise Abandoned(*self._reason(prefix, deadline))
        try:
            self._call(self.store.wait, [f"{prefix}/gate"], _left(deadline))
        except TimeoutError:
            self._give_up_late(prefix, timeout, what)
            return
        gate = self._call(self.store.get, f"{prefix}/gate")
        if gate != GO:
            raise Abandoned(*_parse(gate))

    def _give_up_late(self, prefix: str, timeout: timedelta, what: str) -> None:
        """Our wait ran out: abort the meeting, unless the last rank arrived just now."""
        m = self.add(f"{prefix}/count", ABORT)
        if m == ABORT + self.world:  # everyone arrived before our abort: the gate is opening
            self._call(self.store.wait, [f"{prefix}/gate"], timedelta(seconds=5))
            return
        missing = tuple(r for r in range(self.world) if not self._call(self.store.check, [f"{prefix}/here/{r}"]))
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        reason = f"{who} did not {what} within {timeout.total_seconds():g} s (stalled or dead)"
        self._open_gate(prefix, reason, missing)
        gate = self._call(self.store.get, f"{prefix}/gate")
        raise Abandoned(*_parse(gate))

    def give_up(self, prefix: str, reason: str, peers: tuple[int, ...] = ()) -> None:
        """This rank will not arrive at `prefix`: release everyone waiting there, with `reason`."""
        try:
            self.add(f"{prefix}/count", ABORT)
            self._open_gate(prefix, reason, peers)
        except (StoreUnreachable, TimeoutError):
            pass  # the others will find the dead store themselves

    def _open_gate(self, prefix: str, reason: str, peers: tuple[int, ...]) -> None:
        """The first reason wins: later ones would usually be consequences of it."""
        value = "abort\n" + ",".join(map(str, peers)) + "\n" + reason[:2000]
        self._call(self.store.compare_set, f"{prefix}/gate", "", value)

    def _reason(self, prefix: str, deadline: float) -> tuple[str, tuple[int, ...]]:
        """A late arrival's view: the reason left at the gate (it is set right after the abort)."""
        try:
            self._call(self.store.wait, [f"{prefix}/gate"], _left(deadline, floor=1.0))
        except TimeoutError:
            return "the other ranks gave up on this meeting before this rank arrived", ()
        return _parse(self._call(self.store.get, f"{prefix}/gate"))

    def notes(self, prefix: str) -> list[str]:
        """Every rank's note at a meeting that every rank passed (so every note exists)."""
        keys = [f"{prefix}/here/{r}" for r in range(self.world)]
        return [v.decode("utf-8", errors="replace") for v in self._call(self.store.multi_get, keys)]


def _left(deadline: float, floor: float = 0.001) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), floor))


def parse_gate(gate: bytes) -> tuple[str, tuple[int, ...]]:
    """(reason, peers) left at an aborted gate; ("", ()) at an open one."""
    return ("", ()) if gate == GO else _parse(gate)


def _parse(gate: bytes) -> tuple[str, tuple[int, ...]]:
    text = gate.decode("utf-8", errors="replace")
    _, peers, reason = (text.split("\n", 2) + ["", ""])[:3]
    return reason, tuple(int(p) for p in peers.split(",") if p)
