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
until the save's meeting after the writes (the peer is inside `save` until then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import torch

IOV_MAX = 1024  # iovecs a process_vm_readv call takes on Linux (UIO_MAXIOV)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = lib.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _libc()


class AttachError(OSError):
    """A read from a peer's memory failed (the peer died, or its memory is gone)."""


def available() -> bool:
    """Whether this process can call process_vm_readv at all (Linux, a libc that has it)."""
    return _READV is not None


def pull(pid: int, local: torch.Tensor, remote: int, nbytes: int) -> None:
    """Copy `nbytes` contiguous bytes at address `remote` of process `pid` into the places
    `local` lists: an int64 tensor [n, 2] of (address, length) rows, C-contiguous, the
    lengths summing to `nbytes` (the layout of a `struct iovec` array on 64-bit Linux).

    >>> import ctypes
    >>> src = ctypes.create_string_buffer(b"abcdef", 6)
    >>> dst = ctypes.create_string_buffer(6)
    >>> at = ctypes.addressof(dst)
    >>> pull(os.getpid(), torch.tensor([[at + 3, 3], [at, 3]]), ctypes.addressof(src), 6)
    >>> dst.raw
    b'defabc'
    """
    if _READV is None:
        raise AttachError(errno.ENOSYS, "process_vm_readv is not available")
    assert local.dtype == torch.int64 and local.is_contiguous() and local.dim() == 2 and local.shape[1] == 2
    lengths = local[:, 1]
    done = 0
    for first in range(0, local.shape[0], IOV_MAX):
        last = min(local.shape[0], first + IOV_MAX)
        want = int(lengths[first:last].sum())
        rv = _Iovec(remote + done, want)
        got = _READV(pid, local.data_ptr() + 16 * first, last - first, ctypes.byref(rv), 1, 0)
        if got != want:  # partial only on an error at some iovec (the kernel's contract)
            code = (ctypes.get_errno() or errno.EIO) if got < 0 else errno.EFAULT
            raise AttachError(code, f"{os.strerror(code)} reading {want} bytes of process {pid} "
                                    f"({got} read)")
        done += want
    if done != nbytes:
        raise AttachError(errno.EINVAL, f"the places hold {done} bytes, the piece {nbytes}")


def runs_of_box(box, shape: tuple[int, ...], itemsize: int, base: int) -> torch.Tensor | None:
    """The places of a box of a C-order tensor at address `base`: (address, length) of each
    contiguous run, in the box's C order (so that a contiguous copy of the box fills them in
    turn), as `pull` takes them; None when the box is not a plain box ((begin, end) per dim).

    >>> runs_of_box(((1, 3), (2, 4)), (4, 5), 2, 1000).tolist()   # rows 1-2, columns 2-3 of [4, 5]
    [[1014, 4], [1024, 4]]
    >>> runs_of_box(((0, 2), (0, 5)), (4, 5), 2, 0).tolist()      # whole rows: one run
    [[0, 20]]
    """
    if len(box) != len(shape) or any(len(e) != 2 for e in box):
        return None
    ndim = len(shape)
    k = ndim - 1  # the innermost dim that is not whole: the runs are along it and the dims after it
    while k > 0 and tuple(box[k]) == (0, shape[k]):
        k -= 1
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    length = (box[k][1] - box[k][0]) * strides[k] if ndim else 1
    starts = torch.tensor([base + sum(box[d][0] * strides[d] for d in range(ndim)) * itemsize], dtype=torch.int64)
    for d in range(k - 1, -1, -1):  # every combination of the outer dims' indices, the outermost slowest
        n = box[d][1] - box[d][0]
        starts = (torch.arange(n, dtype=torch.int64) * (strides[d] * itemsize)).view(n, 1) + starts.view(1, -1)
        starts = starts.reshape(-1)
    out = torch.empty((starts.numel(), 2), dtype=torch.int64)
    out[:, 0] = starts
    out[:, 1] = length * itemsize
    return out


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
    seen = torch.zeros(2, dtype=torch.int64)
    for peer in sorted(pulls_from):
        try:  # the peer's mark read back through its pid: the right process, and readable
            pull(pids[peer], torch.tensor([[seen.data_ptr(), 16]]), int(table[n + 2 * world + peer]), 16)
            failed |= seen.tolist() != [int(table[n + world + peer]), pids[peer]]
        except AttachError:
            failed = 1
    if int(summed(torch.tensor([failed], dtype=torch.int32), group, me, phase, timeout)[0]):
        return None
    del mark  # (alive until every rank has read it: the meeting above)
    return pids, table[:n].tolist()


__all__ = ["AttachError", "IOV_MAX", "agree", "available", "pull", "runs_of_box"]
