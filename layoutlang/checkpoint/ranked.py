"""Per-rank shard files: each rank's local tensors as they are stored, for a fast restart.

    >>> save("ckpt/", "train.layout", my_tensors, group=g, per_rank=True)   # doctest: +SKIP

Rank r of an N-rank layout writes `rank-0000r-of-0000N.safetensors` alone: its tensors by
NAME, in their local shapes (padding and all), quantized ones as data and scales entries as
a save writes a key (headers.py `key_entries`). Every file's `__metadata__` carries the layout:
`layoutlang.layout` (its text), `layoutlang.args` (JSON), `layoutlang.rank`,
`layoutlang.ranks` and `layoutlang.digest` (the layout's digest: text and args). The files
appear together (temporary directory, rename by rank 0 once every rank has written, as a save).

Such a directory is a checkpoint whose layout is the saved one and whose rank r is file r
(`ranked_source`), so it is a source for ANY layout: a load (load.py `load_ranked`) compiles the plan from the saved
layout to the destination (bf16 wire, no relays: every op is a copy out of some file) and
each rank runs the ops it receives, reading the source rank's file. The same layout again
(same digest, same rank) is the fast restart: every op is a whole local tensor out of this
rank's own file.
"""

from __future__ import annotations

import json
import os

import torch

from ..diagnostics import UsageError
from ..ir import QUANTIZED, Layout
from .headers import CheckpointError, CheckpointFiles, FileHeader, key_entries, write_header

META = "layoutlang.layout"
FILE = "rank-{rank:05d}-of-{ranks:05d}.safetensors"


def is_ranked(files: CheckpointFiles) -> bool:
    """Do these files hold per-rank shards (every file says the layout it is a rank of)?"""
    return bool(files.files) and all(META in f.metadata for f in files.files)


def rank_metadata(layout: Layout, rank: int) -> dict[str, str]:
    if len(layout.sources) != 1:
        raise UsageError(f"{layout.path}: per-rank shard files carry the layout's text, and this layout "
                         f"includes {len(layout.sources) - 1} other file(s)",
                         help="save per rank from a layout without `include`, or save HF files (per_rank=False)")
    return {"format": "pt", META: layout.source_text, "layoutlang.args": json.dumps(dict(layout.args)),
            "layoutlang.rank": str(rank), "layoutlang.ranks": str(layout.ranks), "layoutlang.digest": layout.digest}


def ranked_source(files: CheckpointFiles) -> tuple[Layout, dict[int, FileHeader]]:
    """The saved layout and each rank's file, checked: one layout, every rank once, and each
    file holding exactly its rank's tensors (names, local shapes, dtypes)."""
    from ..elaborate import loads
    first = files.files[0]
    try:
        args = json.loads(first.metadata.get("layoutlang.args", "{}"))
        ranks = int(first.metadata["layoutlang.ranks"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{first.name}: per-rank metadata is unreadable ({exc})") from None
    by_rank: dict[int, FileHeader] = {}
    for f in files.files:
        for field in (META, "layoutlang.args", "layoutlang.ranks", "layoutlang.digest"):
            if f.metadata.get(field) != first.metadata.get(field):
                raise CheckpointError(f"{f.name}: `{field}` differs from {first.name}'s: the files are ranks of "
                                      "different layouts")
        rank = f.metadata.get("layoutlang.rank", "")
        if not rank.isdigit() or int(rank) >= ranks or int(rank) in by_rank:
            raise CheckpointError(f"{f.name}: rank {rank!r} is not one of 0..{ranks - 1} once")
        by_rank[int(rank)] = f
    missing = [r for r in range(ranks) if r not in by_rank]
    if missing:
        raise CheckpointError(f"{files.path}: the shard file of rank {missing[0]} (of {ranks}) is missing",
                              help=f"expected {FILE.format(rank=missing[0], ranks=ranks)}")
    layout = loads(first.metadata[META], f"<{first.name} metadata>", args)
    if layout.ranks != ranks:
        raise CheckpointError(f"{first.name}: the layout has {layout.ranks} ranks, the metadata says {ranks}")
    for r, f in by_rank.items():
        want = {name: (st, list(shape)) for t in layout.tensors if t.holds(r)
                for name, st, shape in key_entries(t.name, t.dtype, tuple(t.local_shape_at(r)))}
        have = {e.key: (e.dtype, list(e.shape)) for e in f.entries}
        if want != have:
            diff = next(k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k))
            raise CheckpointError(f"{f.name}: key `{diff}`: rank {r} of the layout holds "
                                  f"{_says(want.get(diff))}, the file {_says(have.get(diff))}")
    return layout, by_rank


def _says(entry) -> str:
    return "nothing" if entry is None else f"{entry[0]} {entry[1]}"


def header(layout: Layout, rank: int) -> tuple[bytes, int, list]:
    """Rank `rank`'s file: its header, its size and [(tensor name, entry key, offset)] in data order."""
    entries = [(t.name, name, st, shape) for t in layout.tensors if t.holds(rank)
               for name, st, shape in key_entries(t.name, t.dtype, tuple(t.local_shape_at(rank)))]
    text, size, offsets = write_header([e[1:] for e in entries], rank_metadata(layout, rank))
    placed = sorted(((t, k, offsets[k]) for t, k, _, _ in entries), key=lambda p: p[2])
    return text, len(text) + size, [(t, k, len(text) + off) for t, k, off in placed]


def _parts(value, dtype: str) -> dict[str, torch.Tensor]:
    """{entry key suffix: tensor} of a local tensor as `key_entries` names them."""
    from ..runtime.quant import as_quantized

    if dtype not in QUANTIZED:
        return {"": value}
    q = as_quantized(value, dtype)
    if dtype == "mxfp4":
        return {"_blocks": q.data, "_scales": q.scales}
    if dtype == "fp8_b128":
        return {"": q.data, "_scale_inv": q.scales}
    if dtype == "mxfp8":
        return {"": q.data, "_scale": q.scales}
    return {"": q.data, "_scale": q.scale}


def write_rank(path: str, layout: Layout, rank: int, tensors: dict) -> int:
    """Write rank `rank`'s file at `path` whole (header, then each tensor's bytes); returns the bytes."""
    from ..runtime.refit import shape_problem

    head, size, placed = header(layout, rank)
    held = {t.name: t for t in layout.tensors if t.holds(rank)}
    problems = [f"`{n}` is missing" if n not in tensors else f"`{n}`: {p}"
                for n, t in held.items()
                if n not in tensors or (p := shape_problem(t, tensors[n], rank))]
    if problems:
        raise UsageError(f"rank {rank}: local tensors do not match the layout, nothing was written: "
                         + "; ".join(problems[:8]))
    parts = {}
    for name, t in held.items():
        for suffix, tensor in _parts(tensors[name], t.dtype).items():
            parts[name + suffix] = tensor
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.ftruncate(fd, size)
        for _, key, offset in placed:
            t = parts[key].detach().cpu().contiguous()
            if t.dtype == torch.float8_e8m0fnu:
                t = t.view(torch.uint8)
            _pwrite_all(fd, t, offset)
    finally:
        os.close(fd)
    return size - len(head)


def _pwrite_all(fd: int, t: torch.Tensor, offset: int) -> None:
    import ctypes

    n = t.numel() * t.element_size()
    if n == 0:
        return
    mem = memoryview((ctypes.c_char * n).from_address(t.data_ptr()))
    done = 0
    while done < n:
        done += os.pwrite(fd, mem[done:], offset + done)


__all__ = ["is_ranked", "ranked_source", "write_rank", "header", "FILE", "META"]
