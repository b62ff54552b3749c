"""Cross-memory attach: a writer of a save's exchange reads its peers' pieces out of their memory.

When every rank of a save's group runs on one host as the same user (the common case:
one node's ranks, a trainer saving from its local processes), a writer can copy a peer's
piece straight from that peer's tensor into its own rows with `process_vm_readv(2)`, the
transport Open MPI and UCX call CMA: one kernel copy per byte, scattered into place by the
kernel (an iovec per row), no messages, no receive buffer, no assembly copy, and no meeting
per round. Over the links (gloo's loopback TCP) the same byte costs a send copy, a receive
copy and an assembly copy before its `pwrite` (benchmarks/README.md, checkpoint_io).

Every rank must be able to read every peer it pulls from, or none uses it: `agree` publishes
each rank's pid and a random nonce (one all-reduce), every rank reads each peer's nonce back
through `process_vm_readv` and compares it (a pid of another host or another pid namespace,
a ptrace policy, a seccomp filter: the read fails or returns other bytes), and a second
all-reduce counts the ranks that could not. Any failure anywhere and every rank takes the
links instead. Reads only, of memory a peer published for this save, that stays alive
until the save's meeting after the writes (the peer is inside `save` until then). The
reads themselves (`pull`, `runs_of_box`, the mark's `probe`) are layoutlang/runtime/cma.py's,
shared with the same-host memory transport.
"""

from __future__ import annotations

import os

import torch

from layoutlang.runtime.cma import IOV_MAX, AttachError, available, probe, pull, runs_of_box


def agree(me: int, world: int, count: int, published: dict[int, int], able: bool, pulls_from: set[int], group,
          phase: str, timeout) -> tuple[list[int], list[int]] | None:
    """Whether every rank of `group` can pull its pieces from its peers' memory, and if so
    (every rank gets the same answer) the pids of the ranks and the address each of the
    plan's `count` ops' source block is at: `published` {op index: address} are this rank's
    blocks, `able` whether this rank can take part (its blocks are its caller's memory, its
    places plain boxes), and `pulls_from` the ranks it reads. Two meetings (`meet.summed`), under `timeout`."""
    from .meet import summed

    n = count  # the table: every op's address, then per rank its pid, mark, mark's address, opt-out
    table = torch.zeros(n + 4 * world, dtype=torch.int64)
    for i, address in published.items():
        table[i] = address
    mark = torch.tensor([int.from_bytes(os.urandom(7), "little"), os.getpid()], dtype=torch.int64)
    table[n + me] = os.getpid()
    table[n + world + me] = mark[0]
    table[n + 2 * world + me] = mark.data_ptr()
    table[n + 3 * world + me] = 0 if able and available() else 1
    table = summed(table, group, me, phase, timeout)
    if int(table[n + 3 * world:].sum()):
        return None
    pids = table[n:n + world].tolist()
    failed = 0
    for peer in sorted(pulls_from):  # the peer's mark read back through its pid: the right process, and readable
        failed |= not probe(pids[peer], int(table[n + 2 * world + peer]), (int(table[n + world + peer]), pids[peer]))
    if int(summed(torch.tensor([failed], dtype=torch.int32), group, me, phase, timeout)[0]):
        return None
    del mark  # (alive until every rank has read it: the meeting above)
    return pids, table[:n].tolist()


__all__ = ["AttachError", "IOV_MAX", "agree", "available", "pull", "runs_of_box"]
