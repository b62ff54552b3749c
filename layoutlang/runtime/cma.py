"""Cross-memory attach (CMA): copying bytes straight out of another process's memory.

`process_vm_readv(2)` copies from a peer process's address space into this one's: one kernel
copy per byte, scattered into place by the kernel (an iovec per run), no socket, no staging,
what Open MPI and UCX call CMA. The kernel allows it where this process may ptrace the peer
(the same user, and a ptrace policy that permits it: Yama's `ptrace_scope` 0, or 1 with the
peer's consent, `allow_readers`). Two users here: the memory transport
(layoutlang/runtime/transport_memory.py: a receiver reads each message out of its sender's
tensor) and the checkpoint save's exchange (layoutlang/checkpoint/attach.py: a writer reads
its peers' pieces).

A read never trusts a pid alone: a caller first reads back a random mark the peer
published with its pid and address (`probe`); a pid of another host or another pid
namespace, a ptrace policy, a seccomp filter: the read fails or returns other bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import torch

IOV_MAX = 1024  # iovecs a process_vm_readv call takes on Linux (UIO_MAXIOV)
MAX_READ = 1 << 30  # bytes per call (the kernel caps one call at MAX_RW_COUNT, about 2 GiB)
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


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


def _fail(pid: int, want: int, got: int) -> AttachError:
    code = (ctypes.get_errno() or errno.EIO) if got < 0 else errno.EFAULT
    return AttachError(code, f"{os.strerror(code)} reading {want} bytes of process {pid} ({max(got, 0)} read)")


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
            raise _fail(pid, want, got)
        done += want
    if done != nbytes:
        raise AttachError(errno.EINVAL, f"the places hold {done} bytes, the piece {nbytes}")


def pull_run(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy `nbytes` bytes at address `remote` of process `pid` to address `local` of this
    process: one call per GiB (the kernel's cap on one call).

    >>> import ctypes
    >>> src, dst = ctypes.create_string_buffer(b"layout", 6), ctypes.create_string_buffer(6)
    >>> pull_run(os.getpid(), ctypes.addressof(dst), ctypes.addressof(src), 6)
    >>> dst.raw
    b'layout'
    """
    if _READV is None:
        raise AttachError(errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    while done < nbytes:
        want = min(MAX_READ, nbytes - done)
        lv, rv = _Iovec(local + done, want), _Iovec(remote + done, want)
        got = _READV(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got != want:
            raise _fail(pid, want, got)
        done += want


def probe(pid: int, address: int, mark: tuple[int, int]) -> bool:
    """Can this process read process `pid`'s memory, and is `pid` the process that published
    `mark` (two int64, the second its own pid) at `address`? False on any failure.

    >>> me = torch.tensor([12345, os.getpid()], dtype=torch.int64)
    >>> probe(os.getpid(), me.data_ptr(), (12345, os.getpid())), probe(os.getpid(), me.data_ptr(), (1, os.getpid()))
    (True, False)
    """
    seen = torch.zeros(2, dtype=torch.int64)
    try:
        pull_run(pid, seen.data_ptr(), address, 16)
    except AttachError:
        return False
    return seen.tolist() == list(mark)


def ptrace_scope() -> int | None:
    """Yama's ptrace policy (0: any process of the user may read this one; 1: only its
    ancestors, or those it allows; 2, 3: only privileged ones); None without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return None


def allow_readers() -> bool:
    """Under Yama's `ptrace_scope` 1, let this user's processes read this one
    (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`, as Open MPI's shared-memory transport does
    for its CMA): the peers of a same-host transport are siblings, not ancestors, and may not
    otherwise. Nothing to do (True) under policy 0 or without Yama; False where it cannot."""
    scope = ptrace_scope()
    if scope is None or scope == 0:
        return True
    if scope != 1:
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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


__all__ = ["AttachError", "IOV_MAX", "allow_readers", "available", "probe", "ptrace_scope", "pull", "pull_run",
           "runs_of_box"]
