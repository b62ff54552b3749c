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

Strided pieces (docs/compiler.md): per dim, segments whose destination, source
and logical starts all form regular progressions (equal lengths, constant
steps, at one or two levels) become one *group*, a strided entry on each side
(layoutlang/compiler/strides.py), so Meta's interleaved rotary rows against HF's split
halves are one piece per part and source shard, not one per row. A group is
formed only where it replaces at least STRIDE_MIN_RUNS segments; fewer stay
plain pieces, as before.

Storage continuity (issue 29): a piece is a pair of storage slices, so what an op
needs is that BOTH storages continue, not the logical order. Segments that
continue in the destination's and the source's storage while their logical
starts jump (the hoisted order of section 3: HF's `(NH, (re: D/2 | im: D/2))` on
both sides puts every re half before every im half) are one *span*, whose logical
side is a chain (layoutlang/compiler/strides.py); a span is one piece, as the plain rows were.
After the shards are tiled, pieces of one shard that still continue in both
storages along one dim (equal elsewhere, the same alternatives, each continuing
too) are merged the same way (`merge`). Merging never changes which destination
element receives which source element, and the merged pieces tile the shard
exactly when the parts did (verify.check_tiling proves it on the result).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from layoutlang.modes import Run, RunLike

from . import strides
from .strides import Chain, Entry, Logical

Slice = tuple[Entry, ...]  # per dim: (start, stop), or a strided entry (layoutlang/compiler/strides.py)
LogicalSlice = tuple[Logical, ...]  # a piece's logical side: per dim an entry or a chain

# A dim's segments become one strided group only when it replaces at least this many of them:
# two or three parts of a concatenation stay plain pieces (a strided copy packs on both ends).
STRIDE_MIN_RUNS = 4


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
    """`logical` lists, per dim and in the destination slice's element order, the logical
    elements the piece carries (a chain where its storage continues across a logical jump)."""

    dst_slice: Slice
    logical: LogicalSlice
    sources: tuple[Source, ...]

    @property
    def elements(self) -> int:
        return strides.elements(self.dst_slice)


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


# ---- strided groups -----------------------------------------------------------------
# An item is a set of segments of one dim seen on each side (destination, source,
# logical) as (start, count, step, block): `count` blocks of `block` elements, `step`
# apart (count 1: step == block). A chain of items with the same shape whose starts
# step by S on every side is one item again, where each side stays representable.

def _repeats(side, step: int) -> bool:
    """Whether copies of `side` = (start, count, step, block), `step` apart, are one entry:
    a single block repeats at any step from its length on (step == block: contiguous); a
    strided set only where the copies continue its own step."""
    _, c, s, b = side
    return step >= b if c == 1 else step == c * s


def _chain(chain: list) -> tuple:
    """The item a chain of n same-shaped items makes (each side checked by `_extends`)."""
    n = len(chain)
    first, second = chain[0], chain[1]
    sides = []
    for x in range(3):
        start, c, s, b = first[0][x]
        step = second[0][x][0] - start
        if c == 1:
            sides.append((start, 1, n * b, n * b) if step == b else (start, n, step, b))
        else:
            sides.append((start, n * c, s, b))
    return (tuple(sides), tuple(m for it in chain for m in it[1]))


def _extends(chain: list, item) -> bool:
    first = chain[0]
    for x in range(3):
        (s0, c, s, b), (s1, c1, st1, b1) = first[0][x], item[0][x]
        if (c, s, b) != (c1, st1, b1):
            return False
        if len(chain) == 1:
            if not _repeats(first[0][x], s1 - s0):
                return False
        else:
            step = chain[1][0][x][0] - s0
            if s1 != s0 + len(chain) * step:
                return False
    return True


def _pass(items: list, order: int) -> list:
    """One greedy pass: items sorted by their start on side `order`, adjacent ones chained."""
    items = sorted(items, key=lambda it: it[0][order][0])
    out, chain = [], []
    for it in items:
        if chain and _extends(chain, it):
            chain.append(it)
            continue
        if chain:
            out.append(chain[0] if len(chain) == 1 else _chain(chain))
        chain = [it]
    if chain:
        out.append(chain[0] if len(chain) == 1 else _chain(chain))
    return out


@dataclass(frozen=True)
class Group:
    """Segments of one dim that form one strided entry on every side, or one span: contiguous in
    both storages, its logical side a chain (`spans`)."""

    dst: Entry
    src: Entry
    logical: Logical
    members: tuple[Segment, ...]


def spans(segs: list[Segment]) -> list[tuple[Segment, ...]]:
    """Segments (sorted by destination start) in maximal runs that continue in both storages.

    Preserves: each run's destination and source slices are contiguous and shifted alike
    (element k of one is element k of the other), so a run is one piece.
    >>> spans([Segment(0, 0, 0, 4), Segment(4, 4, 32, 4), Segment(8, 12, 4, 4)])
    [(Segment(dst=0, src=0, logical=0, length=4), Segment(dst=4, src=4, logical=32, length=4)), \
(Segment(dst=8, src=12, logical=4, length=4),)]
    """
    out: list[list[Segment]] = []
    for s in segs:
        last = out[-1][-1] if out else None
        if last is not None and last.dst + last.length == s.dst and last.src + last.length == s.src:
            out[-1].append(s)
        else:
            out.append([s])
    return [tuple(run) for run in out]


def _span_group(run: tuple[Segment, ...]) -> Group:
    """One group of a run of `spans`: contiguous on both storages, the logical side in turn."""
    first, n = run[0], sum(s.length for s in run)
    return Group((first.dst, first.dst + n), (first.src, first.src + n),
                 strides.chain((s.logical, s.logical + s.length) for s in run), run)


def groups(segs: list[Segment]) -> list[Group]:
    """A dim's segments as spans and strided groups (one group per segment where nothing is regular).

    Two ways, the one that leaves fewer groups wins (ties: strides alone, the
    plan as it was before spans): every segment grouped by strides, or runs of
    segments that continue in both storages (`spans`) one group each and the
    rest grouped by strides. Spans win where the hoisted order jumps alike on
    both sides (HF's rotary halves against vLLM's: one span, where strides
    leave two groups); strides win where a span would be a few rows that happen
    to meet (Meta's interleaved pairs against HF's halves, at head boundaries).
    Deterministic: a pure function of the segments.
    """
    runs = spans(segs)
    by_strides = _strided(segs)
    if all(len(run) == 1 for run in runs):
        return by_strides
    single = [run[0] for run in runs if len(run) == 1]
    by_spans = [_span_group(run) for run in runs if len(run) > 1] + _strided(single)
    if len(by_spans) >= len(by_strides):
        return by_strides
    by_spans.sort(key=lambda g: g.dst)
    return by_spans


def _strided(segs: list[Segment]) -> list[Group]:
    """Segments as strided groups: greedy passes, repeated while they shrink the list (a second
    pass chains the groups of the first: the two levels of a rotary pair), in the order of each
    side's starts; the order that leaves the fewest groups wins (ties: the destination's)."""
    def plain(s: Segment) -> Group:
        return Group((s.dst, s.dst + s.length), (s.src, s.src + s.length),
                     (s.logical, s.logical + s.length), (s,))

    if len(segs) < STRIDE_MIN_RUNS:
        return [plain(s) for s in segs]
    best = None
    for order in range(3):
        items = [(((s.dst, 1, s.length, s.length), (s.src, 1, s.length, s.length),
                   (s.logical, 1, s.length, s.length)), (s,)) for s in segs]
        while True:
            nxt = _pass(items, order)
            if len(nxt) == len(items):
                break
            items = nxt
        if best is None or len(items) < len(best):
            best = items
    if len(best) == len(segs):
        return [plain(s) for s in segs]
    out = []
    for sides, members in best:
        if len(members) < STRIDE_MIN_RUNS:
            out.extend(plain(m) for m in members)
        else:
            ent = [strides.entry(*side) for side in sides]
            out.append(Group(ent[0], ent[1], ent[2], members))
    out.sort(key=lambda g: g.dst)
    return out


def _meets(a: Slice, b: Slice) -> bool:
    """Whether two destination slices share an element (strided entries block by block)."""
    for ea, eb in zip(a, b):
        (a0, a1), (b0, b1) = strides.hull(ea), strides.hull(eb)
        if a1 <= b0 or b1 <= a0:
            return False
        if len(ea) > 2 or len(eb) > 2:
            x, y = strides.blocks(ea), strides.blocks(eb)
            i = j = 0
            while i < len(x) and j < len(y):
                if x[i][1] <= y[j][0]:
                    i += 1
                elif y[j][1] <= x[i][0]:
                    j += 1
                else:
                    break
            else:
                return False
    return True


def _plain_boxes(sl: Slice) -> list[Slice]:
    """A slice as plain boxes: one per combination of its blocks."""
    return [tuple(box) for box in itertools.product(*(strides.blocks(e) for e in sl))]


class _Index:
    """A shard's data runs per dim, sorted by logical start, for containment queries."""

    def __init__(self, shard):
        self.dims = []
        for runs in shard.runs:
            data = sorted(data_runs(runs), key=lambda r: r.logical_start)
            self.dims.append(([r.logical_start for r in data], data))

    def locate(self, logical: LogicalSlice) -> Slice | None:
        """Local slice holding the logical box, if one run per dim holds all of it (a strided
        logical entry: its hull; the local entry is then the logical one, shifted) or, per dim,
        the elements' local positions, in the piece's order, form one entry (a strided holder;
        a chain always takes this way: its local positions are not the chain shifted)."""
        out = []
        for (starts, data), e in zip(self.dims, logical):
            lo, hi = strides.hull(e)
            k = bisect.bisect_right(starts, lo) - 1
            if not isinstance(e, Chain) and k >= 0 and data[k].logical_start + data[k].length >= hi:
                out.append(strides.shift(e, data[k].local_start - data[k].logical_start))
                continue
            found = _local_entry(starts, data, e)
            if found is None:
                return None
            out.append(found)
        return tuple(out)


def _local_entry(starts: list[int], data: list[Run], e: Logical, limit: int = 4096) -> Entry | None:
    """The local entry whose elements are those of logical entry `e`, in the same order, or None
    (an element no run holds, more than `limit` local segments, or positions no entry writes)."""
    segs: list[tuple[int, int]] = []
    for lo, hi in strides.blocks(e):
        while lo < hi:
            k = bisect.bisect_right(starts, lo) - 1
            if k < 0 or data[k].logical_start + data[k].length <= lo:
                return None
            r = data[k]
            end = min(hi, r.logical_start + r.length)
            a = r.local_start + lo - r.logical_start
            if segs and segs[-1][1] == a:
                segs[-1] = (segs[-1][0], a + end - lo)
            elif len(segs) < limit:
                segs.append((a, a + end - lo))
            else:
                return None
            lo = end
    if len(segs) == 1:
        return segs[0]
    length, step = segs[0][1] - segs[0][0], segs[1][0] - segs[0][0]
    if step < length or any(b - a != length or a != segs[0][0] + i * step for i, (a, b) in enumerate(segs)):
        return None
    return strides.entry(segs[0][0], len(segs), step, length)


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
        for rect in itertools.product(*(groups(segs) for segs in per_dim)):
            dst = tuple(g.dst for g in rect)
            fresh = [(dst, tuple(g.logical for g in rect), tuple(g.src for g in rect))]
            hits = [covered for (covered, _, _), _ in tiles if _meets(dst, covered)]
            if hits:  # shards overlap here (a replicated part): subtract segment by segment
                fresh = [(tuple((s.dst, s.dst + s.length) for s in segs),
                          tuple((s.logical, s.logical + s.length) for s in segs),
                          tuple((s.src, s.src + s.length) for s in segs))
                         for segs in itertools.product(*(g.members for g in rect))]
                for covered in hits:
                    for box in _plain_boxes(covered):
                        fresh = [part for f in fresh for part in _subtract(f, box)]
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
    out = merge(out)
    out.sort(key=lambda p: p.dst_slice)
    return tuple(out)


def _continues(a: Entry, b: Entry) -> bool:
    """Whether contiguous entry b starts where contiguous entry a stops."""
    return len(a) == 2 and len(b) == 2 and a[1] == b[0]


def _joined(p: Piece, q: Piece, d: int) -> Piece | None:
    """p and q as one piece along dim d, if q continues p there in the destination's storage and in
    every alternative's (the same alternatives, in order) and both are equal along every other
    dim; else None. The logical side of d is p's elements, then q's (a chain where they jump)."""
    if len(p.sources) != len(q.sources) or not _continues(p.dst_slice[d], q.dst_slice[d]):
        return None
    rest = lambda sl: sl[:d] + sl[d + 1:]  # noqa: E731
    if rest(p.dst_slice) != rest(q.dst_slice) or rest(p.logical) != rest(q.logical):
        return None
    sources = []
    for a, b in zip(p.sources, q.sources):
        if (a.instance, a.shard) != (b.instance, b.shard) or rest(a.src_slice) != rest(b.src_slice) \
                or not _continues(a.src_slice[d], b.src_slice[d]):
            return None
        sources.append(Source(a.instance, a.shard, _with(a.src_slice, d, (a.src_slice[d][0], b.src_slice[d][1]))))
    dst = _with(p.dst_slice, d, (p.dst_slice[d][0], q.dst_slice[d][1]))
    return Piece(dst, _with(p.logical, d, strides.then(p.logical[d], q.logical[d])), tuple(sources))


def _with(sl: tuple, d: int, e) -> tuple:
    return sl[:d] + (e,) + sl[d + 1:]


def merge(found: list[Piece]) -> list[Piece]:
    """Pieces of one destination shard, those that continue in both storages merged (`_joined`).

    Per dim in turn, pieces equal elsewhere are taken in destination order and each is joined
    to the one before it where it can be; repeated until nothing joins. Preserves: the union of
    the destination slices (so the tiling), and for every destination element the source
    element (and every alternative's) that feeds it.
    >>> a = Piece(((0, 4), (0, 8)), ((0, 4), (0, 8)), (Source(0, 0, ((0, 4), (0, 8))),))
    >>> b = Piece(((4, 8), (0, 8)), ((32, 36), (0, 8)), (Source(0, 0, ((4, 8), (0, 8))),))
    >>> merge([a, b])
    [Piece(dst_slice=((0, 8), (0, 8)), logical=(Chain(blocks=((0, 4), (32, 36))), (0, 8)), \
sources=(Source(instance=0, shard=0, src_slice=((0, 8), (0, 8))),))]
    """
    if len(found) < 2:
        return found
    ndim = len(found[0].dst_slice)
    changed = True
    while changed:
        changed = False
        for d in range(ndim):
            out: list[Piece] = []
            for p in sorted(found, key=lambda p: (p.dst_slice[:d] + p.dst_slice[d + 1:], strides.hull(p.dst_slice[d]))):
                joined = _joined(out[-1], p, d) if out else None
                if joined is None:
                    out.append(p)
                else:
                    out[-1] = joined
                    changed = True
            found = out
    return found


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

    def cut(sl: tuple, d: int, a: int, b: int) -> tuple:
        return sl[:d] + (strides.sub(sl[d], a - lo, b - lo),) + sl[d + 1:]  # a chain cuts anywhere

    return tuple(Piece(cut(p.dst_slice, dst_dim, a, b), cut(p.logical, key_dim, a, b),
                       tuple(Source(s.instance, s.shard, cut(s.src_slice, src_dims[s.instance], a, b))
                             for s in p.sources))
                 for a, b in itertools.pairwise(bounds))
