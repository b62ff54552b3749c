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


def locate(runs: tuple[RunLike, ...], lo: int, hi: int) -> int | None:
    """Local start of logical [lo, hi) if one run holds all of it, else None."""
    data = sorted(data_runs(runs), key=lambda r: r.logical_start)
    starts = [r.logical_start for r in data]
    k = bisect.bisect_right(starts, lo) - 1
    if k < 0:
        return None
    r = data[k]
    if r.logical_start + r.length >= hi:
        return r.local_start + lo - r.logical_start
    return None


def pieces(dst_runs: tuple[tuple[RunLike, ...], ...],
           src_shards: list[tuple]) -> tuple[Piece, ...]:
    """Pieces that fill one destination shard.

    `src_shards[i]` is the shard tuple of source instance i. The first source
    instance tiles the destination (every instance covers its whole logical
    tensor); the other instances are offered as alternatives where one of
    their shards holds a whole piece.
    """
    out: list[Piece] = []
    for shard_index, shard in enumerate(src_shards[0]):
        per_dim = [overlap(d, s) for d, s in zip(dst_runs, shard.runs)]
        if any(not segs for segs in per_dim):
            continue
        for rect in itertools.product(*per_dim):
            dst_slice = tuple((s.dst, s.dst + s.length) for s in rect)
            logical = tuple((s.logical, s.logical + s.length) for s in rect)
            sources = [Source(0, shard_index, tuple((s.src, s.src + s.length) for s in rect))]
            for inst in range(1, len(src_shards)):
                for k, other in enumerate(src_shards[inst]):
                    starts = [locate(runs, lo, hi) for runs, (lo, hi) in zip(other.runs, logical)]
                    if all(x is not None for x in starts):
                        sources.append(Source(inst, k, tuple(
                            (x, x + hi - lo) for x, (lo, hi) in zip(starts, logical))))
            out.append(Piece(dst_slice, logical, tuple(sources)))
    out.sort(key=lambda p: p.dst_slice)
    return tuple(out)
