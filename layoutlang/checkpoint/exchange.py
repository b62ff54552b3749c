"""A save's exchange: keys whose pieces are short runs of their file are written whole, by one rank.

A column-parallel key (`[H, X over tp]`) is, in its row-major file, one short run per row
on each rank: 1-3 KiB runs, each into pages that the other ranks write too. Written in
place (write.py), that is one system call or one write fault per row per rank, 6x the
write floor on the issue's benchmark. Here such a key is dealt to one writer instead
(`at writer=k`, the bytes each rank already writes counted, largest key first), and a
Refitter on the save's group moves the other ranks' pieces to it: the writer assembles the
key in memory and writes it with one `pwrite` (a write fault per page of a shared map
costs more than the links: 0.3 GB/s against pwrite's 2), in rounds of at most ROUND_BYTES
per writer, so no rank holds more than its shards and that.

Which keys: plain ones (a quantized key is packed by its pieces' holders, whole scale
blocks) with some piece of more than one run shorter than RUN_BYTES, or no box at all.
The choice depends on the plan alone, so every rank makes the same one.
"""

from __future__ import annotations

import torch

from ..ir import QUANTIZED
from .describe import MESH, Checkpoint
from .files import TORCH
from .write import runs

RUN_BYTES = 64 * 1024        # a piece's runs shorter than this (and more than one): its key is exchanged
ROUND_BYTES = 64 * 1024 ** 2  # what a writer assembles at once (keys of one round)
ALIGN = 64


def short_run_keys(plan, ckpt: Checkpoint) -> set[str]:
    """The plain keys of a save's plan (the files as its one destination rank) that some piece
    writes as many short runs."""
    out = set()
    for op in plan.ops:
        stored = ckpt.by_name[op.dst_name]
        if stored.dtype in QUANTIZED or op.dst_name in out:
            continue
        r = runs(op.dst_slice, stored.data.shape)
        if r is None or (r[3] > 1 and r[1] * TORCH[stored.data.dtype].itemsize < RUN_BYTES):
            out.add(op.dst_name)
    return out


def deal(plan, ckpt: Checkpoint, keys: set[str], writers: int) -> dict[str, int]:
    """Each key to one writer: largest first, to the rank writing the fewest bytes so far (the
    pieces it writes in place counted; ties: lowest rank)."""
    load = [0] * writers
    for op in plan.ops:
        if op.dst_name not in keys:
            load[op.src_rank] += op.bytes
    owner = {}
    for name in sorted(keys, key=lambda n: (-sum(e.nbytes for e in ckpt.by_name[n].entries), n)):
        k = min(range(writers), key=lambda r: (load[r], r))
        owner[name] = k
        load[k] += sum(e.nbytes for e in ckpt.by_name[name].entries)
    return owner


def writer_layout(ckpt: Checkpoint, owner: dict[str, int], writers: int, path: str):
    """The exchanged keys as a layout of `writers` ranks: each key whole `at writer=k`."""
    from .layouts import plain_layout

    lines = []
    for line in ckpt.text.splitlines():
        if line == f"mesh {MESH}":
            line = f"mesh checkpoint (writer={writers})"
        elif line.startswith("tensor "):
            name = line.split()[1]
            if name not in owner:
                continue
            line = f"{line} at writer={owner[name]}"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    shapes = {name: ckpt.shapes[name] for name in owner}
    return plain_layout(text, path, ("checkpoint", (("writer", writers),)), shapes, owner)


def rounds(ckpt: Checkpoint, owner: dict[str, int], cap: int) -> list[dict[str, int]]:
    """The exchanged keys in rounds, each writer's keys of a round at most `cap` bytes (a larger
    key alone): what bounds the memory a writer assembles keys in."""
    used: dict[int, int] = {}
    at: dict[int, int] = {}
    out: list[dict[str, int]] = []
    for name, k in owner.items():
        n = ckpt.by_name[name].data.nbytes
        if used.get(k, 0) and used[k] + n > cap:
            at[k], used[k] = at.get(k, 0) + 1, 0
        used[k] = used.get(k, 0) + n
        while len(out) <= at.get(k, 0):
            out.append({})
        out[at.get(k, 0)][name] = k
    return out


def exchange_keys(src, ckpt: Checkpoint, owner: dict[str, int], me: int, tensors: dict, group, timeout,
                  path: str, cap: int | None = None) -> int:
    """Move the exchanged keys' pieces to their writers, round by round; each writer assembles
    its keys of a round in one buffer (reused: its pages fault once) and writes each with one
    `pwrite`. Returns the bytes this rank wrote (its keys')."""
    from ..compiler.plan import compile_plan
    from ..runtime.refit import Refitter
    from .write import _Pwriter

    writer = _Pwriter(ckpt)
    block = torch.empty(0, dtype=torch.uint8)
    written = 0
    try:
        for keys in rounds(ckpt, owner, cap or ROUND_BYTES):
            plan = compile_plan(src, writer_layout(ckpt, keys, src.ranks, path))
            mine = [ckpt.by_name[name] for name, k in keys.items() if k == me]
            need = sum(-(-t.data.nbytes // ALIGN) * ALIGN for t in mine)
            if need > block.numel():
                block = torch.empty(0, dtype=torch.uint8)
                block = torch.empty(need, dtype=torch.uint8)
            bufs, at = {}, 0
            for t in mine:
                bufs[t.name] = block[at:at + t.data.nbytes].view(TORCH[t.data.dtype]).view(t.data.shape)
                at += -(-t.data.nbytes // ALIGN) * ALIGN
            # one step: no staging kept for a next one (keeping it faults its pages in up front)
            Refitter(plan, group=group, timeout=timeout, keep_staging=False).refit(tensors, bufs)
            for t in mine:
                writer.write(t.data, tuple((0, n) for n in t.data.shape), bufs[t.name], min_bytes=0)
                written += t.data.nbytes
    finally:
        writer.close()
    return written


__all__ = ["RUN_BYTES", "ROUND_BYTES", "short_run_keys", "deal", "writer_layout", "rounds", "exchange_keys"]
