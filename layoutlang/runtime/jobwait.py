"""Who waits for a refit between jobs, as the job's store says it: a replica's incarnations,
its doorbell, and the trainer's close (layoutlang/runtime/jobs.py runs the refit itself).

Keys, under `layoutlang/jobs/`::

    replica/R/epoch     +1 by every rank of replica R as it starts (EngineJob): R's incarnation
    replica/R/wait/t    "<nonce>/<call>/<c|s>/<epoch>": rank t waits in `receive` (call number
                        `call` of the process `nonce`), as of R's incarnation `epoch`
    replica/R/ring      +1 by whoever rings R's doorbell; ring c then sets replica/R/bell/c
    trainer/closed      "closed" once the trainer job closed
    replica/R/gone/t    set by rank t once it saw the close: its last request of the store

Incarnations. A wait counts only while it carries R's current epoch. A rank that starts
(a restart under the same id, of the whole replica or of one rank) adds 1 to the epoch and
rings; every rank of R waiting then writes its wait again with the new epoch, so the live
ranks' waits are current within one store round trip, and the wait a dead rank left behind
never is: a restarted replica is never planned with its predecessor's entries, however its
ranks' starts interleave with the trainer's refits.

Waiting quietly. An engine rank waiting for a refit blocks in one store `wait` on its
replica's next bell, with no timeout that runs out while it is healthy (c10d logs every
wait that times out, and TORCH_CPP_LOG_LEVEL is read only as a process starts). Trainer
rank 0 rings every replica's bell when it opens a refit and when it closes; a rank's start
rings its siblings. The close: rank 0 sets `trainer/closed`, rings, and waits (at most
CLOSE_WAIT) until every rank that was waiting has set its `gone` key, a set, which gets no
reply; after it a rank makes no store request, so the store's host may exit while engines
live on, and none of them has a request in flight to fail and print.
"""

from __future__ import annotations

import time

BELLS_KEPT = 64      # rings of a replica whose bell keys stay (a waiter reads the ring, then waits on the next)
CLOSE_WAIT = 2.0     # s trainer rank 0's close waits for the waiting ranks to say they saw it
FOREVER = 30 * 86400.0  # s one store wait of an engine told to wait for ever (it waits again after)


def wait_value(nonce: str, call: int, strided: bool, epoch: int) -> str:
    """What rank t of a replica writes under replica/R/wait/t while it waits in `receive`."""
    return f"{nonce}/{call}/{'s' if strided else 'c'}/{epoch}"


def epoch_of(value: str) -> int | None:
    """The incarnation a wait value carries (None: not a wait)."""
    tail = value.rsplit("/", 1)[-1] if value.count("/") >= 3 else ""
    return int(tail) if tail.isdigit() else None


def is_strided(value: str) -> bool:
    """Did the rank that wrote this wait say its tensors are not contiguous?"""
    return value.count("/") >= 3 and value.split("/")[2] == "s"


def ring(kv, rid: str) -> None:
    """Wake every rank of replica `rid` that waits on its doorbell."""
    c = kv.add(f"replica/{rid}/ring", 1)
    kv.set(f"replica/{rid}/bell/{c}", "")
    if c > BELLS_KEPT:
        kv.delete(f"replica/{rid}/bell/{c - BELLS_KEPT}")


def bell(kv, rid: str) -> str:
    """The key the next ring of `rid` sets (read before looking at what a ring announces)."""
    return f"replica/{rid}/bell/{kv.add(f'replica/{rid}/ring', 0) + 1}"


def born(kv, rid: str) -> int:
    """A rank of `rid` starts: R's new incarnation (its siblings that wait are rung to write theirs)."""
    epoch = kv.add(f"replica/{rid}/epoch", 1)
    ring(kv, rid)
    return epoch


def current_waits(kv, rid: str, ranks: int) -> list[str] | None:
    """The waits of replica `rid`'s ranks 0..ranks-1 when every one of them waits in `receive`
    in R's current incarnation; None otherwise (a rank not there, not waiting, or a wait that
    a rank of an earlier incarnation left)."""
    keys = [f"replica/{rid}/wait/{t}" for t in range(ranks)]
    epoch_key = f"replica/{rid}/epoch"
    if not kv.has(epoch_key, *keys):
        return None
    *waits, epoch = kv.many([*keys, epoch_key])
    if not epoch.isdigit():  # (a counter reads as its decimal text)
        return None
    if all(w and epoch_of(w) == int(epoch) for w in waits):
        return waits
    return None


def sleep_until_rung(kv, key: str, give_up: float | None) -> bool:
    """Block until the bell `key` rings; False at `give_up` (time.monotonic()), which is polled
    with checks (a wait that times out would log) so that only a caller's own bound ends it."""
    if give_up is None:
        while True:
            try:
                kv.wait([key], time.monotonic() + FOREVER)
                return True
            except TimeoutError:
                continue
    while not kv.has(key):
        left = give_up - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.05, left))
    return True
