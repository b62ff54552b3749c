"""One rank's share of a save: the plan's ops this rank sends, written into the mapped files.

A save's plan has the files as its only destination rank (save.py), so an op's
sender is the rank that writes it. The source block is read as a refit's sender
reads it (layoutlang/runtime/bucket.py: strided slices, transposed keys, quantized sources
dequantized once); a plain key's block is copied into the file's view, a
quantized key's block is packed into data and scales (layoutlang/runtime/wire.py, whole
scale blocks only) and unpacked into the file's views. A format with one scale
per tensor (fp8_e4m3 / fp8_e5m2) agrees its amax over the group first, and the
sender of the tensor's first op writes the scale.
"""

from __future__ import annotations

import ctypes
import os

import torch

from ..diagnostics import UsageError
from ..ir import QUANTIZED
from ..runtime.bucket import BucketRun
from ..runtime.loopback import RankState
from ..runtime.quant import dequantize, has_tensor_scale
from ..runtime.refit import as_given, shape_problem
from ..runtime.views import shape as view_shape
from ..runtime.views import view
from ..runtime.wire import unpack_into, write_tensor_scale
from .describe import Checkpoint
from .files import TORCH, Mapped


class Writer(BucketRun):
    """A sender's half of the save's ops: source blocks as a refit reads them."""

    def source_view(self, op) -> torch.Tensor:
        name = op.src_name
        held = self.r.src_held[name]
        if held.dtype in QUANTIZED and name not in self.dequantized:
            self.dequantized[name] = dequantize(self.src[name], held.dtype)
        return super().source_view(op)


def _refused(plan, ops) -> str | None:
    dtypes = {t.name: t.dtype for t in plan.dst.tensors}
    for op in ops:
        if dtypes[op.dst_name] in QUANTIZED and not op.wire:
            return (f"key `{op.key}`: a piece of it ({op}) does not cover whole {dtypes[op.dst_name]} scale "
                    "blocks, so no rank can quantize it alone")
    return None


def write_pieces(plan, me: int, ckpt: Checkpoint, tensors: dict, group=None, skip=frozenset(),
                 alongside=None) -> int:
    """Write this rank's pieces (but those of the keys in `skip`: exchange.py writes them);
    returns the bytes written. Raises before writing anything when a tensor is missing or
    misshapen, or a quantized key cannot be written piece by piece.

    `alongside(step)`: what else this rank writes (the exchange), run once the checks passed;
    it calls `step(f)` while its messages fly, and this rank's own pieces are written up to
    the fraction f of their bytes then (the rest after it returns): the links and the page
    cache work at once. It returns the bytes it wrote."""
    rank = RankState(plan, me)
    every = plan.ops
    problem = _refused(plan, every)
    if problem:
        raise UsageError(problem, help="save in a plain dtype (dtype=\"bf16\") and convert, or save from a "
                                       "layout whose shards hold whole scale blocks")
    mine = _rotated([op for op in every if op.src_rank == me and op.dst_name not in skip], ckpt, me)
    given = as_given(tensors or {}, rank.src_held)
    problems = []
    # every tensor this rank sends from, the skipped keys' too (`alongside` sends them)
    for name in dict.fromkeys(op.src_name for op in every if op.src_rank == me):
        t = rank.src_held[name]
        if name not in given:
            problems.append(f"source tensor `{name}` is missing")
        elif (p := shape_problem(t, given[name], me)):
            problems.append(f"source tensor `{name}`: {p}")
    if problems:
        raise UsageError(f"rank {me}: local tensors do not match the layout, nothing was written: "
                         + "; ".join(problems[:8]))
    run = Writer(rank, mine, given, {}, torch.device("cpu"))
    agreed = _agree_amax(plan, run, mine, every, group)
    files = {e.file for op in mine for e in ckpt.by_name[op.dst_name].entries}
    m = Mapped({f.name: f.path for f in ckpt.files if f.name in files}, write=True)
    writer = _Pwriter(ckpt)
    targets: dict = {}
    first: dict = {}
    for op in every:
        first.setdefault(op.dst_name, op)
    total = sum(op.bytes for op in mine)
    done = [0, 0]  # ops written, bytes written

    def step(fraction: float) -> None:
        """Write this rank's ops in order until `fraction` of their bytes are written."""
        while done[0] < len(mine) and done[1] < fraction * total:
            op = mine[done[0]]
            stored = ckpt.by_name[op.dst_name]
            target = targets.get(op.dst_name)
            if target is None:
                target = targets[op.dst_name] = m.stored(stored)
            if op.wire:
                if op.dst_name in agreed:
                    run.agreed[op.dst_name] = agreed[op.dst_name]
                unpack_into(run.packed(op), target, op.wire, op.dst_slice, stored.shape)
                if has_tensor_scale(stored.dtype) and first[op.dst_name] is op:
                    write_tensor_scale(target, stored.dtype, agreed[op.dst_name])
                rank.meter.reset_bucket()
            else:
                block = run.source_view(op).reshape(view_shape(op.dst_slice))
                if not writer.write(stored.data, op.dst_slice, block):
                    view(target, op.dst_slice).copy_(block)
            done[0] += 1
            done[1] += op.bytes

    try:
        other = alongside(step) if alongside is not None else 0
        step(1.0)
    finally:
        m.close()  # (no msync: the pages are the page cache's; `save(durable=True)` syncs once, on rank 0)
        writer.close()
    return done[1] + other


def _rotated(ops, ckpt: Checkpoint, me: int) -> list:
    """This rank's ops, starting at its own file (rank r at file r mod the file count), each
    file's in plan order. A buffered write holds its file's inode lock: ranks that wrote the
    files in the same order would queue behind each other at every file."""
    at = {f.name: i for i, f in enumerate(ckpt.files)}
    n = max(1, len(at))
    return sorted(ops, key=lambda op: (at[ckpt.by_name[op.dst_name].data.file] - me) % n)


# Shorter runs go through the map. A pwrite costs a system call per run (about 2 us); the map
# costs a write fault per page each rank touches (every rank's column block touches every page
# of a row-major key), far more once runs are a few hundred bytes.
MIN_RUN_BYTES = 512


def runs(sl, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """A plain box of a C-order tensor as evenly spaced contiguous runs of elements:
    (first element, run length, elements from one run's start to the next, count); None when
    the box is strided (layoutlang/compiler/strides.py) or its runs are spaced along more than one dim.

    >>> runs(((2, 4), (0, 8)), (6, 8))    # rows 2-3 of [6, 8]: one run of 16 elements from 16
    (16, 16, 16, 1)
    >>> runs(((0, 6), (4, 8)), (6, 8))    # a column block: 6 runs of 4, 8 apart
    (4, 4, 8, 6)
    """
    if any(len(e) != 2 for e in sl):
        return None
    ndim = len(shape)
    if ndim == 0:
        return 0, 1, 1, 1
    k = ndim - 1  # the innermost dim that is not whole; inner dims after it are whole
    while k > 0 and sl[k] == (0, shape[k]):
        k -= 1
    inner = 1
    for d in range(k + 1, ndim):
        inner *= shape[d]
    length = (sl[k][1] - sl[k][0]) * inner
    outer = [d for d in range(k) if sl[d][1] - sl[d][0] > 1]
    if len(outer) > 1:
        return None
    stride, strides = 1, []
    for d in range(ndim - 1, -1, -1):
        strides.append(stride)
        stride *= shape[d]
    strides.reverse()
    start = sum(sl[d][0] * strides[d] for d in range(ndim))
    if not outer:
        return start, length, length, 1
    d = outer[0]
    return start, length, strides[d], sl[d][1] - sl[d][0]


class _Pwriter:
    """Plain blocks whose runs in the file are long, written with `pwrite` from a contiguous
    buffer (the source itself when it is one): no page faults on the mapped file, the copy the
    kernel makes into the page cache is the only one."""

    def __init__(self, ckpt: Checkpoint):
        self.paths = {f.name: f.path for f in ckpt.files}
        self.fds: dict[str, int] = {}

    def write(self, entry, sl, block: torch.Tensor, min_bytes: int = MIN_RUN_BYTES) -> bool:
        r = runs(sl, entry.shape)
        itemsize = TORCH[entry.dtype].itemsize
        if r is None or r[1] * itemsize < min_bytes:
            return False
        start, length, step, count = r
        buf = block.to(TORCH[entry.dtype]).contiguous()
        fd = self.fds.get(entry.file)
        if fd is None:
            fd = self.fds[entry.file] = os.open(self.paths[entry.file], os.O_WRONLY)
        nbytes = length * itemsize
        mem = memoryview((ctypes.c_char * (nbytes * count)).from_address(buf.data_ptr())).cast("B")
        first, gap = entry.begin + start * itemsize, step * itemsize
        for i in range(count):
            at, run = first + i * gap, mem[i * nbytes:(i + 1) * nbytes]
            done = os.pwrite(fd, run, at)
            while done < nbytes:  # pwrite may write less than asked
                done += os.pwrite(fd, run[done:], at + done)
        return True

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _agree_amax(plan, run: Writer, mine, every, group) -> dict[str, torch.Tensor]:
    """The amax of each key with one scale per tensor, over every rank's pieces of it."""
    dtypes = {t.name: t.dtype for t in plan.dst.tensors}
    names = sorted({op.dst_name for op in every if has_tensor_scale(dtypes[op.dst_name])})
    if not names:
        return {}
    at = {n: i for i, n in enumerate(names)}
    amax = torch.zeros(len(names), dtype=torch.float32)
    for op in mine:
        if op.dst_name in at:
            i = at[op.dst_name]
            amax[i] = torch.maximum(amax[i], run.block_of(op).to(torch.float32).abs().amax())
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return {n: amax[i].reshape(()) for n, i in at.items()}


__all__ = ["write_pieces"]
