"""Intersection in logical coordinates: which rectangles move from where.

Notation: a *segment* of one dim is (dst_start, src_start, logical_start,
length) — local storage of the destination, local storage of the source, and
the logical coordinate they share. A *piece* is a product of one segment per
dim: a rectangle of the destination, the source slice that feeds it, and the
alternative sources (replicas, other statements of the same key) that could
feed it instead.

Preserves: per dim, segments are maximal (adjacent ones are merged when both
the destination and the source continue), so a replicated tensor copied whole
is one piece and a TP4 -> TP2 shard is two.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from layoutlang.modes import Run, RunLike

Slice = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Segment:
    dst: int
    src: int
    logical: int
    length: int


@dataclass(frozen=True)
class Source:
    """One way to feed a piece: a source instance's shard and its local slice."""

    instance: int  # index among the source instances of the key
    shard: int
    src_slice: Slice


@dataclass(frozen=True)
class Piece:
    dst_slice: Slice
    logical: Slice
    sources: tuple[Source, ...]

    @property
    def elements(self) -> int:
        n = 1
        for a, b in self.dst_slice:
            n *= b - a
        return n


def data_runs(runs: tuple[RunLike, ...]) -> list[Run]:
    return [r for r in runs if isinstance(r, Run)]


def overlap(dst: tuple[RunLike, ...], src: tuple[RunLike, ...]) -> list[Segment]:
    """Segments where a destination dim and a source dim hold the same logical elements."""
    a = sorted(data_runs(dst), key=lambda r: r.logical_start)
    b = sorted(data_runs(src), key=lambda r: r.logical_start)
    out: list[Segment] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ra, rb = a[i], b[j]
        lo = max(ra.logical_start, rb.logical_start)
        hi = min(ra.logical_start + ra.length, rb.logical_start + rb.length)
        if lo < hi:
            out.append(Segment(ra.local_start + lo - ra.logical_start,
                               rb.local_start + lo - rb.logical_start, lo, hi - lo))
        if ra.logical_start + ra.length <= rb.logical_start + rb.length:
            i += 1
        else:
            j += 1
    out.sort(key=lambda s: s.dst)
    merged: list[Segment] = []
    for s in out:
        if merged:
            m = merged[-1]
            if m.dst + m.length == s.dst and m.src + m.length == s.src and m.logical + m.length == s.logical:
                merged[-1] = Segment(m.dst, m.src, m.logical, m.length + s.length)
                continue
        merged.append(s)
    return merged


class _Index:
    """A shard's data runs per dim, sorted by logical start, for containment queries."""

    def __init__(self, shard):
        self.dims = []
        for runs in shard.runs:
            data = sorted(data_runs(runs), key=lambda r: r.logical_start)
            self.dims.append(([r.logical_start for r in data], data))

    def locate(self, logical: Slice) -> Slice | None:
        """Local slice holding the logical box, if one run per dim holds all of it."""
        out = []
        for (starts, data), (lo, hi) in zip(self.dims, logical):
            k = bisect.bisect_right(starts, lo) - 1
            if k < 0 or data[k].logical_start + data[k].length < hi:
                return None
            a = data[k].local_start + lo - data[k].logical_start
            out.append((a, a + hi - lo))
        return tuple(out)


def _subtract(rect: tuple, cut: Slice) -> list[tuple]:
    """rect minus cut, as disjoint rects (rect = (dst, logical, src) slices, shifted together)."""
    dst, logical, src = rect
    if any(b <= c0 or c1 <= a for (a, b), (c0, c1) in zip(dst, cut)):
        return [rect]
    out = []
    dst, logical, src = list(dst), list(logical), list(src)
    for d, (c0, c1) in enumerate(cut):
        a, b = dst[d]
        for lo, hi in ((a, max(a, c0)), (min(b, c1), b)):
            if lo < hi:
                shift = lo - a
                piece_dst, piece_log, piece_src = list(dst), list(logical), list(src)
                piece_dst[d] = (lo, hi)
                piece_log[d] = (logical[d][0] + shift, logical[d][0] + shift + hi - lo)
                piece_src[d] = (src[d][0] + shift, src[d][0] + shift + hi - lo)
                out.append((tuple(piece_dst), tuple(piece_log), tuple(piece_src)))
        lo, hi = max(a, c0), min(b, c1)  # keep only the overlapping band in this dim
        shift = lo - a
        dst[d] = (lo, hi)
        logical[d] = (logical[d][0] + shift, logical[d][0] + shift + hi - lo)
        src[d] = (src[d][0] + shift, src[d][0] + shift + hi - lo)
    return out


def pieces(dst_runs: tuple[tuple[RunLike, ...], ...],
           src_shards: list[tuple]) -> tuple[Piece, ...]:
    """Pieces that fill one destination shard, each with every source that holds it.

    The first source instance tiles the destination (every instance covers its
    whole logical tensor): its shards in order, each contributing what earlier
    shards did not already cover (shards overlap where a concatenation part is
    replicated, e.g. key/value heads when TP exceeds their count). Then every
    shard of every instance that holds a whole piece is offered as a source.
    """
    tiles: list[tuple[tuple, int]] = []  # ((dst, logical, src), shard index)
    for shard_index, shard in enumerate(src_shards[0]):
        per_dim = [overlap(d, s) for d, s in zip(dst_runs, shard.runs)]
        if any(not segs for segs in per_dim):
            continue
        for rect in itertools.product(*per_dim):
            fresh = [(tuple((s.dst, s.dst + s.length) for s in rect),
                      tuple((s.logical, s.logical + s.length) for s in rect),
                      tuple((s.src, s.src + s.length) for s in rect))]
            for (covered, _, _), _ in tiles:
                fresh = [part for f in fresh for part in _subtract(f, covered)]
                if not fresh:
                    break
            tiles.extend((f, shard_index) for f in fresh)
    indexes = [[_Index(s) for s in shard_list] for shard_list in src_shards]
    out: list[Piece] = []
    for (dst_slice, logical, src_slice), shard_index in tiles:
        sources = [Source(0, shard_index, src_slice)]
        for inst, shard_list in enumerate(indexes):
            for k, index in enumerate(shard_list):
                if inst == 0 and k == shard_index:
                    continue
                found = index.locate(logical)
                if found is not None:
                    sources.append(Source(inst, k, found))
        out.append(Piece(dst_slice, logical, tuple(sources)))
    out.sort(key=lambda p: p.dst_slice)
    return tuple(out)


def split_piece(p: Piece, cuts: tuple[int, ...], dst_dim: int, key_dim: int,
                src_dims: tuple[int, ...]) -> tuple[Piece, ...]:
    """Piece p cut along one destination dim at the local positions `cuts` (strictly inside it).

    `dst_dim` is the dim cut in the destination's storage order, `key_dim` the
    same dim in `p.logical`, `src_dims[i]` the same dim in the storage of source
    instance i: each part's logical range and every source slice shift alike,
    so each alternative still holds every part whole. The parts, in order,
    tile p (verify.check_split proves it).
    """
    lo, hi = p.dst_slice[dst_dim]
    bounds = (lo, *cuts, hi)

    def cut(sl: Slice, d: int, a: int, b: int) -> Slice:
        start = sl[d][0] + a - lo
        return sl[:d] + ((start, start + b - a),) + sl[d + 1:]

    return tuple(Piece(cut(p.dst_slice, dst_dim, a, b), cut(p.logical, key_dim, a, b),
                       tuple(Source(s.instance, s.shard, cut(s.src_slice, src_dims[s.instance], a, b))
                             for s in p.sources))
                 for a, b in itertools.pairwise(bounds))
