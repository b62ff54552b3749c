"""Load a checkpoint into any layout: each rank reads the bytes of its own pieces, nothing else.

    >>> from layoutlang.checkpoint import load          # doctest: +SKIP
    >>> load("ckpt/", "infer.layout", my_tensors, rank=r)  # doctest: +SKIP

The checkpoint is a plan's source like any other. Every rank can read every
file, so its layout here has one reader per destination rank, each holding every
key whole (`mesh checkpoint (reader=N)`, no `over`: the reader axis is a replica
axis, LANGUAGE.md 3). The balanced selector serves a request from the receiving
rank itself when it holds the piece (layoutlang/compiler/select.py), so every op of the
plan is local: rank r copies its pieces out of mapped views of the files
(files.py) into its tensors, through the same steps as a refit's local copies
(fused, stacked, padded, transposed and quantized destinations alike; a
quantized one assembled in bf16 and quantized once). No rank sends, and no rank
waits for another: a group is needed only to fail together.

`exchange=True` reads each byte once in the whole job instead: each key is read
by one rank (`at reader=k`, keys dealt out by size), and a Refitter on `group`
moves the pieces to the ranks that need them. Column-parallel slices touch
whole pages around each row; this mode trades those reads for link bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..diagnostics import UsageError
from ..ir import QUANTIZED, Layout
from .describe import MESH, Checkpoint, Stored, describe
from .files import mapped
from .headers import CheckpointFiles, FileHeader, key_entries
from .meet import rank_of
from .ranked import ranked_source


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load did: the plan, bytes read out of the files (its pieces; with
    `exchange`, the keys it reads for the whole job), bytes received from other ranks."""

    plan: object
    rank: int
    read_bytes: int
    received_bytes: int = 0


def reader_text(ckpt: Checkpoint, readers: int, *, exchange: bool = False) -> str:
    """The checkpoint's layout with `readers` ranks: every key on each (or, `exchange`, on one)."""
    if readers < 1:
        raise UsageError(f"readers {readers}: expected at least 1")
    lines = ckpt.text.splitlines()
    mesh = lines.index(f"mesh {MESH}")
    lines[mesh] = f"mesh checkpoint (reader={readers})"
    if exchange:
        owner = _deal(ckpt, readers)
        lines = [f"{line} at reader={owner[line.split()[1]]}" if line.startswith("tensor ") else line
                 for line in lines]
    return "\n".join(lines) + "\n"


def _deal(ckpt: Checkpoint, readers: int) -> dict[str, int]:
    """Each key to one reader: largest first, to the reader with the fewest bytes (ties: lowest)."""
    load = [0] * readers
    owner = {}
    for t in sorted(ckpt.tensors, key=lambda t: (-sum(e.nbytes for e in t.entries), t.name)):
        k = min(range(readers), key=lambda r: (load[r], r))
        owner[t.name] = k
        load[k] += sum(e.nbytes for e in t.entries)
    return owner


def reader_layout(ckpt: Checkpoint, readers: int, *, exchange: bool = False):
    """`loads(reader_text(...))`, built without parsing (layouts.py)."""
    from .layouts import plain_layout

    return plain_layout(reader_text(ckpt, readers, exchange=exchange), f"<checkpoint {ckpt.path}>",
                        ("checkpoint", (("reader", readers),)), ckpt.shapes,
                        _deal(ckpt, readers) if exchange else None, rows=ckpt.rows)


def plan_load(path, layout, *, args: dict[str, int] | None = None, exchange: bool = False):
    """The plan of a load (what `layoutc plan DIR LAYOUT` shows): checkpoint -> `layout`."""
    from ..compiler.plan import as_layout, compile_plan

    dst = as_layout(layout, args or {})
    ckpt = path if isinstance(path, Checkpoint) else describe(path, like=dst)
    if ckpt.per_rank:  # per-rank shard files (ranked.py): every op a copy out of its source rank's file
        return ckpt, compile_plan(ckpt.layout, dst, wire="bf16", relay=False)
    return ckpt, compile_plan(reader_layout(ckpt, dst.ranks, exchange=exchange), dst)


def load(path: str | os.PathLike | Checkpoint, layout, tensors: dict, *, rank: int | None = None, group=None,
         args: dict[str, int] | None = None, budget_bytes: int | None = None, exchange: bool = False,
         device=None, timeout: timedelta | float = timedelta(seconds=60)) -> LoadReport:
    """Fill this rank's `tensors` (as a Refitter's destinations: {NAME: tensor}, quantized ones
    as their format's class or a tuple) from the checkpoint at `path`, in place.

    `layout`: a path or a loaded Layout (`args` for a path). The plan is compiled and proven
    exactly-once before any byte is read. `rank`: this rank of the layout (from `group`, or
    the default group, when not given). `budget_bytes` bounds the staging of quantized
    destinations (their bf16 assemblies), as in a refit. `group`: with `exchange=False`, a
    failed rank fails every rank (one all-reduce after the copies); `exchange=True` needs it.
    """
    from ..runtime.loopback import run_rank

    if not isinstance(path, Checkpoint):
        from ..compiler.plan import as_layout

        path = describe(path, like=as_layout(layout, args or {}))
    ckpt = path
    if ckpt.per_rank:
        return _load_ranked(ckpt, layout, tensors, rank, group, args, device, timeout)
    ckpt, plan = plan_load(ckpt, layout, args=args, exchange=exchange)
    me = rank_of(rank, group, plan.dst.ranks)
    ops = plan.ops_for_rank(me)
    if not exchange:
        names = {op.src_name for op in ops}
        ok = False
        try:
            with mapped(ckpt, names) as views:
                run_rank(plan, me, views, tensors, device=device, budget_bytes=budget_bytes)
            ok = True
        finally:
            if group is not None:
                _together(ok, group, me, timeout)
        return LoadReport(plan, me, sum(op.bytes for op in ops))
    if group is None:
        raise UsageError("exchange=True moves pieces between ranks: pass a group")
    from ..runtime.refit import Refitter

    names = {t.name for t in plan.src.tensors if t.holds(me)}
    with mapped(ckpt, names) as views:
        r = Refitter(plan, group=group, budget_bytes=budget_bytes, device=device, timeout=timeout,
                     keep_staging=False)  # one step: its staging is not kept for a next
        r.refit(views, tensors)
    # the keys this rank reads, each once in the whole job (its ops may send one key to several ranks)
    read = {op.src_name for op in plan.ops if op.src_rank == me}
    return LoadReport(plan, me, sum(e.nbytes for name in read for e in ckpt.by_name[name].entries), r.received_bytes)


def _load_ranked(ckpt: Checkpoint, layout, tensors, rank, group, args, device, timeout) -> LoadReport:
    from ..compiler.plan import as_layout

    dst = as_layout(layout, args or {})
    me = rank_of(rank, group, dst.ranks)
    ok = False
    try:
        plan, read = load_ranked(CheckpointFiles(ckpt.path, ckpt.files, None), dst, me, tensors, device)
        ok = True
    finally:
        if group is not None:
            _together(ok, group, me, timeout)
    return LoadReport(plan, me, read)


def _ranked_stored(layout: Layout, rank: int, f: FileHeader) -> dict:
    """{tensor NAME: Stored} of rank `rank`'s file (its entries as `key_entries` names them)."""
    by_key = {e.key: e for e in f.entries}
    out = {}
    for t in layout.tensors:
        if t.holds(rank):
            local = tuple(t.local_shape_at(rank))
            entries = [by_key[name] for name, _, _ in key_entries(t.name, t.dtype, local)]
            out[t.name] = Stored(t.name, t.dtype, local, entries[0], tuple(entries[1:]))
    return out


def load_ranked(files: CheckpointFiles, dst: Layout, me: int, tensors: dict, device=None):
    """This rank's destinations from per-rank shard files: the plan from the saved layout, the
    ops this rank receives, each block read out of its source rank's file (returns the plan
    and the bytes read)."""
    from ..compiler.plan import compile_plan
    from ..runtime.bucket import padding
    from ..runtime.loopback import RankState
    from ..runtime.quant import quantize_into
    from ..runtime.refit import as_given, shape_problem
    from ..runtime.views import shape as view_shape
    from ..runtime.views import view
    from .files import Mapped
    from .write import Writer

    saved, by_rank = ranked_source(files)
    plan = compile_plan(saved, dst, wire="bf16", relay=False)
    ops = [op for op in plan.ops_for_rank(me) if op.dst_rank == me]
    held = {t.name: t for t in dst.tensors if me < dst.ranks and t.holds(me)}
    given = as_given(tensors, held)
    problems = [f"`{n}` is missing" if n not in given else f"`{n}`: {p}" for n, t in held.items()
                if n not in given or (p := shape_problem(t, given[n], me))]
    if problems:
        from ..runtime.errors import RefitError

        raise RefitError.at(me, 0, "setup", "local tensors do not match the layouts, nothing was written: "
                            + "; ".join(problems[:8]), reusable=True)
    device = torch.device(device) if device is not None else torch.device("cpu")
    sources = sorted({op.src_rank for op in ops})
    maps = {s: Mapped({by_rank[s].name: by_rank[s].path}) for s in sources}
    try:
        readers = {}
        for s in sources:
            stored = _ranked_stored(saved, s, by_rank[s])
            views = {n: maps[s].stored(st) for n, st in stored.items()}
            readers[s] = Writer(RankState(plan, s), (), views, {}, device)
        assembly = {}
        for name, t in held.items():  # padding is zero: a quantized tensor is assembled from zeros
            if t.dtype in QUANTIZED:
                assembly[name] = torch.zeros(tuple(t.local_shape_at(me)), dtype=torch.bfloat16, device=device)
            else:
                for pad in padding(given[name], t, me):
                    pad.zero_()
        for op in ops:
            block = readers[op.src_rank].source_view(op)
            target = assembly.get(op.dst_name, given.get(op.dst_name))
            view(target, op.dst_slice).copy_(block.reshape(view_shape(op.dst_slice)))
        for name, a in assembly.items():
            quantize_into(a, given[name], held[name].dtype)
    finally:
        for m in maps.values():
            m.close()
    return plan, sum(op.bytes for op in ops)


def _together(ok: bool, group, rank: int, timeout) -> None:
    """Every rank of the group learns whether every rank succeeded (a failed rank raises its own)."""
    from ..runtime.errors import RefitError
    from .meet import as_timedelta, failures

    failed = failures(ok, group, rank, "load", as_timedelta(timeout))
    if ok and failed:
        raise RefitError.at(rank, 0, "load", f"{failed} rank(s) of the group failed to load", reusable=False)


__all__ = ["load", "plan_load", "reader_layout", "reader_text", "LoadReport"]
