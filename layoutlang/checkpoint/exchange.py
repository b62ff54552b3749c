"""A save's exchange: keys whose pieces are short runs of their file are written by rows.

A column-parallel key (`[H, X over tp]`) is, in its row-major file, one short run per row
on each rank: 1-3 KiB runs, each into pages that the other ranks write too. Written in
place (write.py), that is one system call or one write fault per row per rank, 6x the
write floor on the issue's benchmark. Here such a key's rows are split over the writers
instead (`[H over writer ragged, X]`, torch.chunk's rule), and a Refitter on the save's
group moves the pieces: each writer assembles its block of rows in memory and writes it
with one `pwrite` (a write fault per page of a shared map costs more than the links: 0.3
GB/s against pwrite's 2). Keys go in rounds, a writer's rows of a round at most
ROUND_BYTES, and the Refitter stages under the same budget, so no rank holds more than its
shards and twice that.

Which keys: plain ones (a quantized key is packed by its pieces' holders, whole scale
blocks) with some piece of more than one run shorter than RUN_BYTES, or no box at all.
The choice depends on the plan alone, so every rank makes the same one.
"""

from __future__ import annotations

import torch

from ..ir import QUANTIZED
from .describe import Checkpoint
from .files import TORCH
from .write import runs

RUN_BYTES = 64 * 1024        # a piece's runs shorter than this (and more than one): its key is exchanged
ROUND_BYTES = 32 * 1024 ** 2  # what a writer assembles at once (its rows of one round's keys), and stages
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


def writer_layout(ckpt: Checkpoint, keys: list[str], writers: int, path: str):
    """The exchanged keys as a layout of `writers` ranks: each key's rows split over them as
    torch.chunk splits (`over writer ragged`, LANGUAGE.md 8.5), so each writer's block is one
    contiguous range of the file."""
    from ..elaborate import loads

    lines = ["layout writers", f"mesh checkpoint (writer={writers})"]
    for name in keys:
        t = ckpt.by_name[name]
        rest = "".join(f", {d}" for d in t.shape[1:])
        lines.append(f"tensor {name} [{t.shape[0]} over writer ragged{rest}] {t.dtype}")
    return loads("\n".join(lines) + "\n", path)


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


def exchange_keys(src, ckpt: Checkpoint, keys: list[str], me: int, tensors: dict, group, timeout,
                  path: str, cap: int | None = None) -> int:
    """Move the exchanged keys' pieces to their writers, round by round: each writer assembles
    its rows of the round's keys in one buffer (reused: its pages fault once) and writes each
    key's block with one `pwrite`. Returns the bytes this rank wrote."""
    from ..compiler.plan import compile_plan
    from ..runtime.refit import Refitter
    from .write import _Pwriter

    cap = cap or ROUND_BYTES
    writers = src.ranks
    writer = _Pwriter(ckpt)
    block = torch.empty(0, dtype=torch.uint8)
    written = 0
    try:
        for names in rounds(ckpt, keys, writers, cap):
            plan = compile_plan(src, writer_layout(ckpt, names, writers, path))
            mine = []
            for name in names:
                t = ckpt.by_name[name]
                b, e = rows_of(t, me, writers)
                if e > b:
                    mine.append((t, b, e, (e - b) * (t.data.nbytes // t.shape[0])))
            need = sum(-(-n // ALIGN) * ALIGN for *_, n in mine)
            if need > block.numel():
                block = torch.empty(0, dtype=torch.uint8)
                block = torch.empty(need, dtype=torch.uint8)
            bufs, at = {}, 0
            for t, b, e, n in mine:
                bufs[t.name] = block[at:at + n].view(TORCH[t.data.dtype]).view(e - b, *t.shape[1:])
                at += -(-n // ALIGN) * ALIGN
            # one step: no staging kept for a next one (keeping it faults its pages in up front)
            Refitter(plan, group=group, timeout=timeout, budget_bytes=cap, keep_staging=False).refit(tensors, bufs)
            for t, b, e, n in mine:
                box = ((b, e),) + tuple((0, d) for d in t.shape[1:])
                writer.write(t.data, box, bufs[t.name], min_bytes=0)
                written += n
    finally:
        writer.close()
    return written


__all__ = ["RUN_BYTES", "ROUND_BYTES", "short_run_keys", "writer_layout", "rows_of", "rounds", "exchange_keys"]
