"""Keys of a flat dim (docs/language.md 14.9): a rank's range of a key's row-major flattening as
boxes of the key, and pieces computed over those boxes as slices of the 1-d flat storage.

A flat dim's runs (modes.py) map the rank's local storage to the dim's logical elements, where
key i holds `[L_i, L_i + numel_i)` in row-major order. Seen by one key, a run is a range
`[a, b)` of the key's (stored) flattening held at local `[p, p + b - a)`: `boxes` cuts it into at most
2N - 1 boxes of an N-dim key (a partial innermost row, partial blocks of each outer dim up to the
next boundary, the largest whole block, and back down), each contiguous in the flat storage.

Each box is a shard of its own (`FlatBox`) whose runs are over the KEY's dims, with local
positions the key's STORED indices (a view of the whole key as it is laid out, row-major), and
logical ones as its dims' modes say (a plain dim: the same; HF's rotary halves: permuted); `base`
places that view in the flat storage: the key's element at stored index `idx` sits at local
`base + sum(idx[d] * stride[d])`. The pieces machinery (pieces.py, verify.py) then runs unchanged over key dims;
`to_storage` turns each piece's box slices back into one entry of the 1-d storage (contiguous,
or strided where the other side cuts an inner dim), cutting a piece along its outer key dims
where one entry cannot hold it.

A destination rank holds its boxes together (`FlatShard`: one shard per rank, as every shard
is, whose `boxes` are proven one by one); a source's boxes are separate shards of the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from layoutlang.modes import KeyM, Run

from . import strides
from .pieces import Piece, Source
from .shards import Shard
from .strides import Chain, Entry


@dataclass(frozen=True)
class FlatBox(Shard):
    """One box of a key in a rank's flat storage: `runs` per key dim (local: the stored index),
    `base` the flat local position of the key's element 0 in this view, `shape` the key's shape."""

    base: int = 0
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class FlatShard(Shard):
    """A flat shard seen by one key: its ranks and the boxes they hold (`runs`: the box runs of the
    first box, so code that reads one shard's runs sees a key-dims shard)."""

    boxes: tuple[FlatBox, ...] = ()


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, int], ...]]:
    """Elements [a, b) of a key's row-major flattening as boxes (per dim [lo, hi)), in order.

    At most 2N - 1 boxes for an N-dim key; a 0-dim key is one box of no dims.
    >>> boxes((7, 3), 5, 21)
    [((1, 2), (2, 3)), ((2, 7), (0, 3))]
    >>> boxes((3, 5), 0, 8)
    [((0, 1), (0, 5)), ((1, 2), (0, 3))]
    >>> len(boxes((4, 4, 4), 1, 63))
    5
    """
    if not shape:
        return [()] if a < b else []
    out: list[tuple[tuple[int, int], ...]] = []
    _boxes(shape, row_major_strides(shape), a, b, (), out)
    return out


def _boxes(shape, strides_, a: int, b: int, prefix: tuple, out: list) -> None:
    """Boxes of [a, b) inside the block of the key that `prefix` (fixed outer indices) names;
    a, b are offsets within that block."""
    d = len(prefix)
    if a >= b:
        return
    if d == len(shape) - 1:
        out.append(prefix + ((a, b),))
        return
    s = strides_[d]
    i0, r0 = divmod(a, s)
    i1, r1 = divmod(b, s)
    rest = tuple((0, n) for n in shape[d + 1:])
    if i0 == i1:  # inside one index of this dim
        _boxes(shape, strides_, r0, r1, prefix + ((i0, i0 + 1),), out)
        return
    if r0:  # the partial block at the start
        _boxes(shape, strides_, r0, s, prefix + ((i0, i0 + 1),), out)
        i0 += 1
    if i0 < i1:  # whole blocks
        out.append(prefix + ((i0, i1),) + rest)
    if r1:  # the partial block at the end
        _boxes(shape, strides_, 0, r1, prefix + ((i1, i1 + 1),), out)


def clip_flat(shards_, box: tuple[tuple[int, int], ...], key: KeyM,
              intern: dict | None = None) -> tuple[FlatShard, ...]:
    """Flat shards seen by the key whose logical range of the flat dim is `box[0]`: each shard's
    elements of the key as ranges of the key's STORAGE flattening (row-major over each dim's
    stored index), each range cut into boxes of the key in storage coordinates; per box and
    dim, the dim's runs (stored index -> logical index, modes.py) restricted to it. Padding and
    other keys are left out; a shard with nothing of the key is left out."""
    lo, hi = box[0]
    shape = tuple(m.logical for m in key.dims)
    st = row_major_strides(shape)
    # per dim, logical index -> stored index (the inverse of the dim's runs)
    inverse = []
    for d, m in enumerate(key.dims):
        back = [0] * m.logical
        for r in key.dim_runs[d]:
            for k in range(r.length):
                back[r.logical_start + k] = r.local_start + k
        inverse.append(back)

    def stored_of(j: int) -> int:  # a logical row-major offset of the key -> its stored offset
        return sum(inverse[d][(j // st[d]) % shape[d]] * st[d] for d in range(len(shape)))

    out = []
    for sh in shards_:
        ranges: list[list[int]] = []  # [local start, stored start, length], merged where both continue
        for r in sh.runs[0]:
            if not isinstance(r, Run):
                continue
            a, b = max(lo, r.logical_start), min(hi, r.logical_start + r.length)
            if a >= b:
                continue
            # a run continues in the flat storage and logically: in the key's storage too (modes._key_walk)
            p, s0 = r.local_start + a - r.logical_start, stored_of(a - lo)
            if ranges and ranges[-1][0] + ranges[-1][2] == p and ranges[-1][1] + ranges[-1][2] == s0:
                ranges[-1][2] += b - a
            else:
                ranges.append([p, s0, b - a])
        found = []
        for p, s0, n in ranges:
            for bx in boxes(shape, s0, s0 + n):
                runs_ = tuple(_clip_runs(key.dim_runs[d], x, y) for d, (x, y) in enumerate(bx))
                if intern is not None:
                    runs_ = intern.setdefault(runs_, runs_)
                found.append(FlatBox(runs_, sh.ranks, p - s0, shape))
        if found:
            out.append(FlatShard(found[0].runs, sh.ranks, tuple(found)))
    return tuple(out)


def _clip_runs(runs_, x: int, y: int) -> tuple[Run, ...]:
    """A dim's runs (stored index -> logical index) restricted to stored [x, y), local = stored index."""
    out = []
    for r in runs_:
        a, b = max(x, r.local_start), min(y, r.local_start + r.length)
        if a < b:
            out.append(Run(a, r.logical_start + a - r.local_start, b - a))
    return tuple(out)


def source_shards(view: tuple) -> tuple:
    """A source side's shards for pieces.py: each flat shard's boxes as shards of their own."""
    if not view or not isinstance(view[0], FlatShard):
        return view
    return tuple(bx for sh in view for bx in sh.boxes)


def _entry(sl, base: int, shape: tuple[int, ...]) -> Entry | None:
    """A key-dims slice of a FlatBox view as one entry of the flat storage, or None where the
    elements need more than one strided level."""
    st = row_major_strides(shape)
    offset, levels = base, []
    for e, s in zip(sl, st):
        start, count, step, block = strides.parts(e)
        offset += start * s
        if len(e) == 2:
            levels.append((e[1] - e[0], s))
        else:
            levels += [(count, step * s), (block, s)]
    merged: list[tuple[int, int]] = []
    for n, s in levels:
        if n == 1:
            continue
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if not merged:
        return (offset, offset + 1)
    if len(merged) == 1:
        n, s = merged[0]
        return (offset, offset + n) if s == 1 else strides.entry(offset, n, s, 1)
    if len(merged) == 2 and merged[1][1] == 1:
        (c, s), (blk, _) = merged
        return strides.entry(offset, c, s, blk)
    return None


def _element(e, k: int):
    """Element k of an entry or chain (in its element order) as a one-element entry."""
    if isinstance(e, Chain) or len(e) == 2:
        return strides.sub(e, k, k + 1)
    start, _, step, block = strides.parts(e)
    pos = start + (k // block) * step + k % block
    return (pos, pos + 1)


def to_storage(p: Piece, dst, src_shards, back) -> list[Piece]:
    """Piece p (over key dims) with its destination and source slices in the stored tensors' dims:
    a FlatBox side as one entry of its 1-d storage, any other side by `back(slice, shard)`. Where a
    flat side needs more than one strided level, p is cut along its first key dim of extent > 1
    into single indices and each part converted again (the parts tile p)."""
    def convert(sl, shard):
        if isinstance(shard, FlatBox):
            e = _entry(sl, shard.base, shard.shape)
            return None if e is None else (e,)
        return back(sl, shard)

    dst_sl = convert(p.dst_slice, dst)
    srcs = [convert(a.src_slice, src_shards[a.instance][a.shard]) for a in p.sources]
    if dst_sl is not None and all(s is not None for s in srcs):
        return [Piece(dst_sl, p.logical, tuple(Source(a.instance, a.shard, s) for a, s in zip(p.sources, srcs)))]
    d = next(i for i, e in enumerate(p.dst_slice) if strides.extent(e) > 1)
    out: list[Piece] = []
    for k in range(strides.extent(p.dst_slice[d])):
        def cut(sl, k=k):
            return sl[:d] + (_element(sl[d], k),) + sl[d + 1:]
        part = Piece(cut(p.dst_slice), cut(p.logical),
                     tuple(Source(a.instance, a.shard, cut(a.src_slice)) for a in p.sources))
        out.extend(to_storage(part, dst, src_shards, back))
    return out


def is_flat(box) -> bool:
    """Whether a geometry's box (plan.Box) is a flat dim's key."""
    return box is not None and len(box) > 3


__all__ = ["FlatBox", "FlatShard", "boxes", "clip_flat", "source_shards", "to_storage", "is_flat",
           "row_major_strides"]
