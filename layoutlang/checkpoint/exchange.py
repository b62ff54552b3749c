"""A save's exchange: keys whose pieces are short runs of their file are written by rows.

A column-parallel key (`[H, X over tp]`) is, in its row-major file, one short run per row
on each rank: 1-3 KiB runs, each into pages that the other ranks write too. Written in
place (write.py), that is one system call or one write fault per row per rank, 6x the
write floor on the issue's benchmark. Here such a key's rows are split over the writers
instead (`[H over writer ragged, X]`, torch.chunk's rule): one plan from the layout to
the writers says who sends which piece (replicas share the sending, as in a refit), the
pieces move over the save's group as single messages, and each writer assembles its
block of rows of a key in memory and writes it with one `pwrite`. Keys go in rounds, a
writer's rows of a round at most ROUND_BYTES, dealt over the files so that the writers
write different files at once; no rank holds more than its shards and twice that (the
receive and the rows arenas), plus the blocks it sends of one round (none when its
source slices are contiguous rows in the checkpoint's dtype).

On one host, with every rank able to read the others' memory (attach.py), no message
moves: each writer reads its peers' pieces straight out of their tensors into its rows
(one kernel copy a byte, where the links cost a send, a receive and an assembly copy),
when every source block is its caller's own memory as the file stores it; otherwise, or
across hosts, the links as above.

Which keys: plain ones (a quantized key is packed by its pieces' holders, whole scale
blocks) with some piece of more than one run shorter than RUN_BYTES, or no box at all.
The choice depends on the plan alone, so every rank makes the same one.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import time

import torch

from ..ir import QUANTIZED
from .describe import Checkpoint
from .files import TORCH
from ..runtime.views import shape as view_shape
from .write import runs

RUN_BYTES = 64 * 1024        # a piece's runs shorter than this (and more than one): its key is exchanged
MEMORY = True                # read peers' pieces out of their memory when every rank can (attach.py)
ROUND_BYTES = 32 * 1024 ** 2  # a writer's rows of one round's keys at most: what its receive arena holds
ALIGN = 64


def short_run_keys(plan, ckpt: Checkpoint) -> list[str]:
    """The plain keys of a save's plan (the files as its one destination rank) that some piece
    writes as many short runs, in the checkpoint's order."""
    out = set()
    for op in plan.ops:
        stored = ckpt.by_name[op.dst_name]
        if stored.dtype in QUANTIZED or op.dst_name in out:
            continue
        r = runs(op.dst_slice, stored.data.shape)
        if r is None or (r[3] > 1 and r[1] * TORCH[stored.data.dtype].itemsize < RUN_BYTES):
            out.add(op.dst_name)
    return [t.name for t in ckpt.tensors if t.name in out]


def writer_text(ckpt: Checkpoint, keys: list[str], writers: int) -> str:
    """The text of the writers' layout: each key's rows split over `writers` ranks as
    torch.chunk splits (`over writer ragged`, LANGUAGE.md 8.5)."""
    lines = ["layout writers", f"mesh checkpoint (writer={writers})"]
    for name in keys:
        t = ckpt.by_name[name]
        lines.append(f"tensor {name} [{t.shape[0]} over writer ragged{''.join(f', {d}' for d in t.shape[1:])}] "
                     f"{t.dtype}")
    return "\n".join(lines) + "\n"


def writer_layout(ckpt: Checkpoint, keys: list[str], writers: int, path: str):
    """The exchanged keys as a layout of `writers` ranks (`writer_text`), so each writer's
    block is one contiguous range of the file.

    The layout of that text, with one statement parsed per distinct shape and dtype (a
    save's 30 keys have 2): every key's tensor is its shape's, renamed, and the digest is the
    whole text's, as `loads` gives it (tests/test_checkpoint_rules.py compares the two)."""
    import dataclasses

    from ..diagnostics import Source
    from ..elaborate import loads
    from ..ir import Layout
    from .layouts import text_digest

    text = writer_text(ckpt, keys, writers)
    split = text.split("\n")
    head, lines = split[:2], split[2:-1]
    kinds: dict[str, int] = {}
    for line in lines:
        kinds.setdefault(line.split(" ", 2)[2], len(kinds))
    protos = loads("\n".join(head + [f"tensor t{i} {dims}" for dims, i in kinds.items()]) + "\n", path)
    tensors = []
    for name, line in zip(keys, lines):
        proto = protos.tensors[kinds[line.split(" ", 2)[2]]]
        tensors.append(dataclasses.replace(proto, key=name, name=name))
    return Layout(path, protos.name, protos.meshes, tuple(tensors), (), text_digest(text), (Source(path, text),))


def rows_of(stored, writer: int, writers: int) -> tuple[int, int]:
    """The rows `[begin, end)` of a key that `writer` writes (torch.chunk's rule)."""
    n = stored.shape[0]
    block = -(-n // writers)
    return min(writer * block, n), min((writer + 1) * block, n)


def rounds(ckpt: Checkpoint, keys: list[str], writers: int, cap: int) -> list[list[str]]:
    """The exchanged keys in rounds, a writer's rows of a round's keys at most `cap` bytes (a key
    whose block alone is larger: a round of its own): what bounds the memory a writer
    assembles in, besides the Refitter's staging (budgeted alike)."""
    out: list[list[str]] = []
    used = 0
    for name in keys:
        t = ckpt.by_name[name]
        b, e = rows_of(t, 0, writers)
        n = (e - b) * (t.data.nbytes // max(1, t.shape[0]))
        if not out or (used and used + n > cap):
            out.append([])
            used = 0
        out[-1].append(name)
        used += n
    return out


def across_files(ckpt: Checkpoint, keys: list[str]) -> list[str]:
    """The keys dealt round-robin over their files (the first of each file, then the second...):
    a round of consecutive keys then holds some of every file, and the writers, each starting
    at another file, write into different files at once (a buffered write holds its file's
    inode lock: four ranks writing one file take turns).

    >>> from types import SimpleNamespace as N
    >>> ck = N(files=(N(name="a"), N(name="b")), by_name={k: N(data=N(file=k[0])) for k in ("a1", "a2", "b1")})
    >>> across_files(ck, ["a1", "a2", "b1"])
    ['a1', 'b1', 'a2']
    """
    per_file: dict[str, list[str]] = {f.name: [] for f in ckpt.files}
    for name in keys:
        per_file[ckpt.by_name[name].data.file].append(name)
    lists = [v for v in per_file.values() if v]
    return [name for row in itertools.zip_longest(*lists) for name in row if name is not None]


def exchange_keys(src, ckpt: Checkpoint, keys: list[str], me: int, tensors: dict, group, timeout,
                  path: str, cap: int | None = None, meanwhile=None) -> tuple[int, str]:
    """Move the exchanged keys' pieces to their writers and write them; returns the bytes this
    rank wrote and the transport: "memory" when every rank can read its peers' pieces out of
    their memory (`_pull_rows`, attach.py; off with MEMORY = False), else "links".

    Over the links, round by round: each writer receives
    its rows' pieces into one arena, assembles its rows of each key in a second one (both
    reused: their pages fault once) and writes them with one `pwrite` a key. One plan for
    every round (the writers' layout of all the keys), its ops posted straight to the group:
    a round costs its messages, not a Refitter's schedule and meetings. `meanwhile(f)` (write.py
    `write_pieces`' step: this rank's own pieces up to the fraction f of their bytes) runs
    while each round's messages fly.

    The source tensors were checked by `write_pieces` (every op this rank sends, these keys'
    too) before anything was written."""
    from ..compiler.plan import compile_plan
    from ..runtime.loopback import RankState
    from .layouts import cached_plan, text_digest
    from ..runtime.refit import as_given
    from .write import Writer

    cap = cap or ROUND_BYTES
    writers = src.ranks
    plan = cached_plan("writers", src, text_digest(writer_text(ckpt, keys, writers)),
                       lambda: compile_plan(src, writer_layout(ckpt, keys, writers, path)))
    rank = RankState(plan, me)
    run = Writer(rank, [], as_given(tensors or {}, rank.src_held), {}, torch.device("cpu"))
    files = {f.name: i for i, f in enumerate(ckpt.files)}
    dealt = rounds(ckpt, across_files(ckpt, keys), writers, cap)
    attached = _attached(plan, me, ckpt, run, group, timeout) if MEMORY and group is not None else None
    if attached is not None:
        return _pull_rows(plan, me, ckpt, run, dealt, files, attached, meanwhile), "memory"
    by_key: dict[str, list] = {}
    for op in plan.ops_for_rank(me):
        by_key.setdefault(op.dst_name, []).append(op)
    deadline = time.monotonic() + timeout.total_seconds()
    arena = rows = torch.empty(0, dtype=torch.uint8)
    fds: dict[str, int] = {}
    written = 0
    try:
        for k, names in enumerate(dealt):
            ops = [op for name in names for op in by_key.get(name, ())]
            need = sum(_aligned(_nbytes(op, ckpt)) for op in ops if op.dst_rank == me and op.src_rank != me)
            if need > arena.numel():
                arena = torch.empty(0, dtype=torch.uint8)
                arena = torch.empty(need, dtype=torch.uint8)
            widest = max((_row_bytes(ckpt.by_name[n], me, writers) for n in names), default=0)
            if widest > rows.numel():
                rows = torch.empty(0, dtype=torch.uint8)
                rows = torch.empty(widest, dtype=torch.uint8)
            share = None if meanwhile is None else (lambda f=(k + 1) / len(dealt): meanwhile(f))
            pieces = _move(ops, me, ckpt, run, arena, group, deadline, timeout, share)
            for name in _from_own_file(names, ckpt, files, me):
                stored = ckpt.by_name[name]
                b, e = rows_of(stored, me, writers)
                if e > b:
                    written += _write_rows(_fd(fds, ckpt, stored), stored, b, e, pieces.get(name, []), rows)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written, "links"


def _from_own_file(names: list[str], ckpt: Checkpoint, files: dict[str, int], me: int) -> list[str]:
    """A round's keys, starting at this writer's own file: writes into one file take its
    inode lock in turn."""
    return sorted(names, key=lambda n: (files[ckpt.by_name[n].data.file] - me) % len(files))


def _fd(fds: dict[str, int], ckpt: Checkpoint, stored) -> int:
    fd = fds.get(stored.data.file)
    if fd is None:
        fd = fds[stored.data.file] = os.open(_path_of(ckpt, stored.data.file), os.O_WRONLY)
    return fd


def _attached(plan, me: int, ckpt: Checkpoint, run, group, timeout) -> tuple[list[int], list[int]] | None:
    """(every rank's pid, the address of every op's source block) when every rank of the
    group can read its pieces out of its peers' memory (attach.py `agree`); None: the links.
    A rank takes part when each block it sends is its caller's own memory as the file stores
    it (a view of the given tensor, contiguous, on the CPU, in the file's dtype: nothing is
    staged, so no rank holds more than its shards) and each piece it writes is a plain box."""
    from . import attach

    published: dict[int, int] = {}
    able, pulls_from = True, set()
    for i, op in enumerate(plan.ops):
        if op.src_rank == me and op.dst_rank != me:
            given = run.src.get(op.src_name)
            if not isinstance(given, torch.Tensor):  # a quantized source: dequantized blocks are staged
                able = False
                continue
            block = run.source_view(op)
            able = able and block.device.type == "cpu" and block.is_contiguous() \
                and block.dtype == TORCH[ckpt.by_name[op.dst_name].data.dtype] \
                and block.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
            published[i] = block.data_ptr()
        elif op.dst_rank == me and op.src_rank != me:
            able = able and all(len(e) == 2 for e in op.dst_slice)
            pulls_from.add(op.src_rank)
    return attach.agree(me, plan.dst.ranks, len(plan.ops), published, able, pulls_from, group, "save", timeout)


def _pull_rows(plan, me: int, ckpt: Checkpoint, run, dealt: list[list[str]], files: dict[str, int],
               attached: tuple[list[int], list[int]], meanwhile=None) -> int:
    """The memory transport: each of this writer's blocks of rows assembled in one reused
    buffer, its own pieces copied in, every peer's read straight into their places
    (attach.pull: the kernel scatters each row), then written with one `pwrite`; this rank's
    in-place pieces written after each round (`meanwhile`). No meeting: the peers' blocks
    are their callers' tensors, alive until the save's meeting after the writes."""
    from ..runtime.errors import RefitError
    from ..runtime.views import view
    from .attach import AttachError, pull, runs_of_box

    pids, addresses = attached
    writers = plan.dst.ranks
    mine: dict[str, list] = {}
    for i, op in enumerate(plan.ops):
        if op.dst_rank == me:
            mine.setdefault(op.dst_name, []).append((i, op))
    widest = max((_row_bytes(ckpt.by_name[n], me, writers) for names in dealt for n in names), default=0)
    rows = torch.empty(widest, dtype=torch.uint8)
    fds: dict[str, int] = {}
    written = 0
    try:
        for k, names in enumerate(dealt):
            for name in _from_own_file(names, ckpt, files, me):
                stored = ckpt.by_name[name]
                b, e = rows_of(stored, me, writers)
                if e <= b:
                    continue
                block, at = _rows_view(stored, b, e, rows)
                for i, op in mine.get(name, ()):
                    if op.src_rank == me:
                        view(block, op.dst_slice).copy_(run.source_view(op).reshape(view_shape(op.dst_slice)))
                        continue
                    places = runs_of_box(op.dst_slice, tuple(block.shape), block.element_size(), block.data_ptr())
                    try:
                        pull(pids[op.src_rank], places, addresses[i], _nbytes(op, ckpt))
                    except AttachError as exc:
                        raise RefitError.at(me, 0, "save", f"reading op {op.id} (`{op.key}`) out of rank "
                                            f"{op.src_rank}'s memory failed: {exc.strerror}",
                                            peers=(op.src_rank,), reusable=False) from exc
                written += _pwrite_all(_fd(fds, ckpt, stored), block, at)
            if meanwhile is not None:
                meanwhile((k + 1) / len(dealt))
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(op, ckpt: Checkpoint) -> int:
    return math.prod(b - a for a, b in op.dst_slice) * TORCH[ckpt.by_name[op.dst_name].data.dtype].itemsize


def _row_bytes(stored, writer: int, writers: int) -> int:
    b, e = rows_of(stored, writer, writers)
    return (e - b) * (stored.data.nbytes // max(1, stored.shape[0]))


def _path_of(ckpt: Checkpoint, file: str) -> str:
    return next(f.path for f in ckpt.files if f.name == file)


class _SaveHost:
    """What a transport reads of the executor it serves (runtime/transport.py `bind`), for a
    save: its rank, its timeout, and a fault as the save's RefitError."""

    def __init__(self, rank: int, timeout):
        self.rank, self.timeout = rank, timeout

    def failure(self, detail: str, peers=(), grace: float = 0.0):
        from ..runtime.errors import RefitError

        return RefitError.at(self.rank, 0, "save", detail, peers=tuple(peers), reusable=False)


def _move(ops, me: int, ckpt: Checkpoint, run, arena: torch.Tensor, group, deadline: float, timeout,
          meanwhile=None) -> dict:
    """One round's messages through the save group's transport ("group": runtime/transport_group.py),
    every receive posted (into the arena), then every send; then `meanwhile()` (other writing,
    while they fly), then all waited for under the save's one deadline. Messages between a pair
    match in op order on both ends. Returns, per key this rank writes rows of, its pieces as
    (slice of the writer's rows, contiguous tensor in the file's dtype)."""
    from ..runtime.transport_group import GroupTransport

    host = _SaveHost(me, timeout)
    transport = GroupTransport(group)
    transport.bind(host)
    pieces: dict[str, list] = {}
    messages: list = []
    moved: list = []
    at = 0
    for op in ops:
        if op.dst_rank != me or op.src_rank == me:
            continue
        dtype = TORCH[ckpt.by_name[op.dst_name].data.dtype]
        n = _nbytes(op, ckpt)
        buf = arena[at:at + n].view(dtype).view([b - a for a, b in op.dst_slice])
        at += _aligned(n)
        pieces.setdefault(op.dst_name, []).append((op.dst_slice, buf))
        messages.append(transport.message(False, buf, op.src_rank))
        moved.append(op)
    for op in ops:
        if op.src_rank != me:
            continue
        dtype = TORCH[ckpt.by_name[op.dst_name].data.dtype]
        block = run.source_view(op).reshape([b - a for a, b in op.dst_slice]).to(dtype).contiguous()
        if op.dst_rank == me:
            pieces.setdefault(op.dst_name, []).append((op.dst_slice, block))
        else:
            messages.append(transport.message(True, block, op.dst_rank))
            moved.append(op)
    works = transport.post(messages, "save messages")
    if meanwhile is not None:
        meanwhile()
    transport.wait(works, moved, "the exchange", deadline)
    return pieces


def _write_rows(fd: int, stored, begin: int, end: int, pieces: list, rows: torch.Tensor) -> int:
    """Rows [begin, end) of a key, assembled in `rows` (bytes, reused) from pieces that tile them
    (the plan's proof) and written with one `pwrite`: one long run per key. (Writing the pieces'
    runs straight from the receive buffers with `pwritev`, an iovec per row per piece, measured
    slower in back-to-back runs: 836 against 526 ms a save, benchmarks/README.md.)"""
    from ..runtime.views import view

    block, at = _rows_view(stored, begin, end, rows)
    for sl, buf in pieces:
        view(block, sl).copy_(buf.reshape(view_shape(sl)))
    return _pwrite_all(fd, block, at)


def _rows_view(stored, begin: int, end: int, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rows [begin, end) of a key as a tensor at the start of `rows` (bytes, reused), and
    their offset in the key's file."""
    dtype = TORCH[stored.data.dtype]
    shape = (end - begin, *stored.shape[1:])
    nbytes = math.prod(shape) * dtype.itemsize
    return rows[:nbytes].view(dtype).view(shape), stored.data.begin + begin * (nbytes // max(1, end - begin))


def _pwrite_all(fd: int, block: torch.Tensor, at: int) -> int:
    """A contiguous tensor's bytes written at `at` (pwrite may write less than asked)."""
    nbytes = block.numel() * block.element_size()
    mem = memoryview((ctypes.c_char * nbytes).from_address(block.data_ptr())).cast("B") if nbytes else b""
    while len(mem):
        k = os.pwrite(fd, mem, at)
        mem, at = mem[k:], at + k
    return nbytes


__all__ = ["MEMORY", "RUN_BYTES", "ROUND_BYTES", "short_run_keys", "writer_text", "writer_layout", "rows_of", "rounds",
           "exchange_keys"]
