"""Meeting points of a refit, kept in the process group's store: every wait has a deadline.

Why the store and not a collective: a collective waits under the process
group's own timeout (30 minutes by default), cannot say which rank is missing,
and on NCCL may never return. Through the store a rank that waits too long
names the ranks that never arrived, and tells every other rank at once.

A meeting is three kinds of keys::

    seat/R   set by rank R when it arrives: the meeting's prefix, then a short note
             for the others. A seat is reused by every meeting of one kind (a
             Refitter's step agreement, its fence), so a step leaves no per-rank
             keys behind; by default a meeting's seats are its own, under its prefix.
    count    arrivals, +1 each, plus each rank's marks in fields above the
             arrivals; giving up adds ABORT, so no later total counts `world` arrivals
    gate     "go" (the last arrival) or "abort\\n<reason>" (the first to give up)

The count turns a race into one decision: the gate opens only for the rank
whose increment made the arrivals exactly `world`; a rank that gives up first
adds ABORT, after which no increment can land on `world`, and a late arrival
reads the reason instead of waiting. So either every rank passes a meeting or
every rank fails it, with the same reason. Marks (at most two yes/no facts
per rank, such as "my tensors are wrong") ride on the same increment: once
the gate opens, the count says how many ranks marked each. A meeting costs a
rank four requests (set its seat, which gets no reply; add; wait for the
gate; read the count), the last arrival three, all on the store's one server
thread (benchmarks/store_scale.py).

Leaving. The store lives in one rank's process (rank 0 under env:// init), and a
rank that passed a meeting may still be reading it (the gate, the count) when
the host passes too, returns and exits; the reader then meets a dead store. In
a meeting the ranks leave from (`leave=True`: a step's last), every rank but
the last to arrive makes its read of the count an add of LEFT (a field no such
meeting marks), so the read also says "I am done here"; the rank whose add
shows every reader done (all ranks but the last arrival, whose gate the readers
waited for) sets `left`, unless it is the host; and the host passes only once
`left` exists, or its own add was the last, waiting at most the timeout (a
reader that died must not hang it). `left` is set, not added: a set gets no
reply, and the reply to an add leaves the server after the waiting host is
woken, so a host that exits at once could cut it off. That is one request more
for the host (a wait) and one for the last reader, only in such a meeting.

>>> ABORT > ARRIVALS * (1 + (1 << FIELD) + (1 << 2 * FIELD))   # every rank arriving with both marks
True
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

FIELD = 16                    # bits per count field: arrivals, then one per mark
ARRIVALS = (1 << FIELD) - 1   # so a group has fewer than 65,536 ranks
MARKS = 2
ABORT = 1 << (FIELD * (MARKS + 1))  # above every field; 2**15 aborts still fit in 63 bits
LEFT = 1 << (FIELD * MARKS)        # the last mark's field: a rank done reading a meeting it leaves from
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

    ``namespace`` separates Refitters and steps; every key lives under it. ``host``: the
    rank whose process hosts the store, if one of these does (it waits in meetings the
    ranks leave from until every other rank has read them).
    """

    def __init__(self, store, rank: int, world: int, namespace: str, host: int | None = None):
        if world > ARRIVALS:
            raise ValueError(f"a meeting counts at most {ARRIVALS:,} ranks in one store field; this group has {world:,}")
        self.store = store
        self.rank = rank
        self.world = world
        self.namespace = namespace
        self.host = host

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
    def meet(self, prefix: str, timeout: timedelta, *, what: str, note: str = "", marks: tuple[bool, ...] = (),
             seat: str | None = None, leave: bool = False) -> tuple[int, ...]:
        """Wait until every rank arrived at `prefix`, at most `timeout`; per mark, how many ranks set it.

        `seat`: where ranks sit (`seat/R`), reused by meetings of one kind (default: under
        `prefix`). `leave`: the ranks may exit once they pass (see Leaving, above: the host
        passes after every other rank's last request of it). Raises Abandoned naming the
        ranks that did not `what` ("start step 3") in time, or the reason another rank gave
        up first.
        """
        if len(marks) > MARKS - leave:  # (LEFT counts in the last mark's field)
            raise ValueError(f"a meeting {'the ranks leave from ' if leave else ''}carries at most "
                             f"{MARKS - leave} marks")
        leaving = leave and self.host is not None and self.world > 1
        deadline = time.monotonic() + timeout.total_seconds()
        self._call(self.store.set, self._seat(prefix, seat, self.rank), f"{prefix}\n{note}")
        n = self.add(f"{prefix}/count", 1 + sum(1 << (FIELD * (i + 1)) for i, m in enumerate(marks) if m))
        if n >= ABORT:
            raise Abandoned(*self._reason(prefix, deadline))
        if n & ARRIVALS == self.world:
            self._call(self.store.set, f"{prefix}/gate", GO)
            if leaving and self.rank == self.host:  # every other rank is a reader
                self._wait_left(prefix, timeout)
            return _marks(n, len(marks))
        try:
            self._call(self.store.wait, [f"{prefix}/gate"], _left(deadline))
        except TimeoutError:
            n = self._give_up_late(prefix, seat, timeout, what, LEFT if leaving else 0)
        else:
            # The gate exists. Read the count, not the gate (a get is two requests: wait, then get):
            # below ABORT it is the final count and the gate says go; at or above it, some rank
            # aborted, before the gate opened (then the gate says why) or after (too late to matter).
            n = self.add(f"{prefix}/count", LEFT if leaving else 0)
            if n >= ABORT:
                gate = self._call(self.store.get, f"{prefix}/gate")
                if gate != GO:
                    raise Abandoned(*_parse(gate))
        n %= ABORT
        if leaving:
            self._leave(prefix, n, timeout)
        return _marks(n, len(marks))

    def _leave(self, prefix: str, n: int, timeout: timedelta) -> None:
        """After this rank's read (`n`: the count it returned): the last reader tells the host,
        the host waits to be told, unless its own read was the last."""
        last = (n // LEFT) & ARRIVALS == self.world - 1  # every rank but the last arrival reads
        if last and self.rank != self.host:
            # a set, not an add: it gets no reply, so there is none the host's exit could cut off
            # (an add's reply leaves the server after it wakes the host)
            self._call(self.store.set, f"{prefix}/left", GO)
        elif not last and self.rank == self.host:
            self._wait_left(prefix, timeout)

    def _wait_left(self, prefix: str, timeout: timedelta) -> None:
        """The host: until every other rank has made its last request of this meeting, at most
        `timeout` (a rank that passed and died reads nothing more: then there is no one to wait for)."""
        try:
            self._call(self.store.wait, [f"{prefix}/left"], timeout)
        except TimeoutError:
            pass

    def _seat(self, prefix: str, seat: str | None, rank: int) -> str:
        return f"{seat}/{rank}" if seat is not None else f"{prefix}/here/{rank}"

    def _give_up_late(self, prefix: str, seat: str | None, timeout: timedelta, what: str, read: int = 0) -> int:
        """Our wait ran out: abort the meeting, unless the last rank arrived just now (then: the
        final count, read by adding `read` once the gate is open)."""
        m = self.add(f"{prefix}/count", ABORT)
        if m < 2 * ABORT and (m - ABORT) & ARRIVALS == self.world:  # everyone arrived before our abort
            self._call(self.store.wait, [f"{prefix}/gate"], timedelta(seconds=5))
            return self.add(f"{prefix}/count", read) if read else m
        missing = tuple(r for r in range(self.world) if not self._seated(prefix, seat, r))
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        reason = f"{who} did not {what} within {timeout.total_seconds():g} s (stalled or dead)"
        self._open_gate(prefix, reason, missing)
        gate = self._call(self.store.get, f"{prefix}/gate")
        raise Abandoned(*_parse(gate))

    def _seated(self, prefix: str, seat: str | None, rank: int) -> bool:
        """Did `rank` arrive at this meeting? (Its seat holds this meeting's prefix.)"""
        key = self._seat(prefix, seat, rank)
        if not self._call(self.store.check, [key]):
            return False
        return self._call(self.store.get, key).split(b"\n", 1)[0] == prefix.encode()

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

    def notes(self, prefix: str, seat: str | None = None) -> list[str]:
        """Every rank's note at a meeting that every rank passed and none has left for another
        meeting of its kind (so every seat holds this meeting's note)."""
        keys = [self._seat(prefix, seat, r) for r in range(self.world)]
        values = [v.decode("utf-8", errors="replace") for v in self._call(self.store.multi_get, keys)]
        return [v.split("\n", 1)[1] if "\n" in v else "" for v in values]


def _left(deadline: float, floor: float = 0.001) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), floor))


def parse_gate(gate: bytes) -> tuple[str, tuple[int, ...]]:
    """(reason, peers) left at an aborted gate; ("", ()) at an open one."""
    return ("", ()) if gate == GO else _parse(gate)


def _marks(count: int, n: int) -> tuple[int, ...]:
    """How many ranks set each of the first `n` marks, from a count below ABORT."""
    return tuple((count >> (FIELD * (i + 1))) & ARRIVALS for i in range(n))


def _parse(gate: bytes) -> tuple[str, tuple[int, ...]]:
    text = gate.decode("utf-8", errors="replace")
    _, peers, reason = (text.split("\n", 2) + ["", ""])[:3]
    return reason, tuple(int(p) for p in peers.split(",") if p)
