"""The algebra of one dimension: logical order, `over`, `chunk`, and runs.

Notation (LANGUAGE.md section 3)::

    mode    := PlainM(E) | ProductM(N, mode) | ConcatM(parts) | PadM(mode, K) | FlatM(key shapes, A)
    logical := ext(mode)         elements of the logical tensor along the dim
    stored  := stored(mode)      elements in storage, padding included
    leaves  := hoisted part tree, flattened: every concatenation hoisted out of
               every enclosing product, `(N, (a|b))` == `(a: (N, A) | b: (N, B))`

A stored element of a mode maps to (leaf, offset in leaf); its logical index
is start(leaf) + offset. `select` gives the stored intervals that one `over`
coordinate holds; `chunk_intervals` cuts that local storage into chunks;
`walk` turns stored intervals into runs of (local, logical, length).

All values here are plain ints: the elaborator has already evaluated
expressions and reported user errors with positions; functions here raise
`SplitError`, which the elaborator turns into a positioned diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Iterator

class cached_property:  # noqa: N801 - a drop-in for functools.cached_property
    """functools.cached_property without its per-access lock (Python < 3.12 takes
    one), which costs more than the values it caches here: computed once per
    object, then served from the instance dict. IR objects are immutable."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value
        return value


MAX_RUNS = 1 << 20  # per dim and rank: more is a fragmented layout, not a real one


class SplitError(Exception):
    """A split that the spec forbids; `node` is the mode at fault."""

    def __init__(self, message: str, node: "ModeIR", help: str | None = None):
        super().__init__(message)
        self.message, self.node, self.help = message, node, help


@dataclass(frozen=True)
class Run:
    """Local storage [local_start, +length) holds logical [logical_start, +length)."""

    local_start: int
    logical_start: int
    length: int


@dataclass(frozen=True)
class PadRun:
    """Local storage [local_start, +length) is padding: never sent, zero on arrival."""

    local_start: int
    length: int


RunLike = Run | PadRun


@dataclass(frozen=True)
class Leaf:
    """A block of the hoisted part tree: `extent` consecutive logical elements."""

    extent: int


@dataclass(frozen=True)
class PartNode:
    """A concatenation level of the hoisted part tree."""

    parts: tuple[tuple[str | None, "PartTree"], ...]


PartTree = Leaf | PartNode


# ---- the mode IR -----------------------------------------------------------

@lru_cache(maxsize=32)  # one entry per mode class
def _compared_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.compare)


def cached_hash(self) -> int:
    """Hash of a frozen dataclass's compared fields, computed once per object."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, n) for n in _compared_fields(type(self))))
        object.__setattr__(self, "_hash", h)
    return h


@dataclass(frozen=True)
class PlainM:
    __hash__ = cached_hash  # structural, computed once: modes key templates
    extent: int
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def logical(self) -> int:
        return self.extent

    @cached_property
    def stored(self) -> int:
        return self.extent

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return (self.extent,)

    @cached_property
    def identity(self) -> bool:
        return True

    @cached_property
    def part_tree(self) -> PartTree:
        return Leaf(self.extent)


@dataclass(frozen=True)
class ProductM:
    __hash__ = cached_hash  # structural, computed once: modes key templates
    count: int
    inner: "ModeIR"
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def logical(self) -> int:
        return self.count * self.inner.logical

    @cached_property
    def stored(self) -> int:
        return self.count * self.inner.stored

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return tuple(self.count * e for e in self.inner.leaf_extents)

    @cached_property
    def identity(self) -> bool:
        return self.inner.identity

    @cached_property
    def part_tree(self) -> PartTree:
        return _scale(self.inner.part_tree, self.count)


@dataclass(frozen=True)
class PartM:
    name: str | None
    mode: "ModeIR"


@dataclass(frozen=True)
class ConcatM:
    __hash__ = cached_hash  # structural, computed once: modes key templates
    parts: tuple[PartM, ...]
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def logical(self) -> int:
        return sum(p.mode.logical for p in self.parts)

    @cached_property
    def stored(self) -> int:
        return sum(p.mode.stored for p in self.parts)

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return tuple(e for p in self.parts for e in p.mode.leaf_extents)

    @cached_property
    def identity(self) -> bool:
        return False

    @cached_property
    def part_tree(self) -> PartTree:
        return PartNode(tuple((p.name, p.mode.part_tree) for p in self.parts))


@dataclass(frozen=True)
class PadM:
    __hash__ = cached_hash  # structural, computed once: modes key templates
    inner: "ModeIR"
    multiple: int
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def logical(self) -> int:
        return self.inner.logical

    @cached_property
    def stored(self) -> int:
        return -(-self.inner.stored // self.multiple) * self.multiple

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return self.inner.leaf_extents

    @cached_property
    def identity(self) -> bool:
        return self.inner.identity and self.stored == self.inner.stored

    @cached_property
    def part_tree(self) -> PartTree:
        return self.inner.part_tree


@dataclass(frozen=True)
class KeyM:
    """One whole key inside a flat dim (docs/language.md 14.9): its dims' modes (no padding),
    stored row-major in STORAGE order of each dim; logically its elements in row-major order of
    each dim's LOGICAL index (the dims' hoisted orders, section 3). Plain dims: both the same."""

    __hash__ = cached_hash  # structural, computed once: modes key templates
    dims: tuple["ModeIR", ...]
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def logical(self) -> int:
        n = 1
        for m in self.dims:
            n *= m.logical
        return n

    @cached_property
    def stored(self) -> int:
        return self.logical

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return (self.logical,)

    @cached_property
    def identity(self) -> bool:
        return all(m.identity for m in self.dims)

    @cached_property
    def part_tree(self) -> PartTree:
        return Leaf(self.logical)

    @cached_property
    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for m in reversed(self.dims):
            out.append(acc)
            acc *= m.logical
        return tuple(reversed(out))

    @cached_property
    def dim_runs(self) -> tuple[tuple["Run", ...], ...]:
        """Per dim: its storage index -> logical index, as runs."""
        return tuple(runs(m, [(0, m.stored)], 0) for m in self.dims)


@dataclass(frozen=True)
class FlatM:
    """`flat(SHAPE as KEY | ...) [align A]` (docs/language.md 14.9): whole keys (`KeyM`) flattened
    row-major, one after another in written order, each starting at a multiple of `align` (the
    elements skipped are padding; none after the last key). Logically the keys' elements in order.

    It stores what the concatenation `(k0 pad A | k1 pad A | ... | k_last)` stores, but `over`
    cuts its STORED extent contiguously, as it cuts `M pad K`.

    >>> f = FlatM(tuple(KeyM(tuple(PlainM(n) for n in s)) for s in ((3, 5), (3,), (7, 3), (7,))), 4)
    >>> f.logical, f.stored, f.starts, f.shapes[2]
    (46, 51, (0, 16, 20, 44), (7, 3))
    """

    __hash__ = cached_hash  # structural, computed once: modes key templates
    keys: tuple[KeyM, ...]
    align: int
    origin: object = field(default=None, compare=False, repr=False)

    @cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each key's logical shape."""
        return tuple(tuple(m.logical for m in k.dims) for k in self.keys)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(k.logical for k in self.keys)

    @cached_property
    def concat(self) -> "ConcatM":
        """The same storage as a concatenation of one part per key, each but the last padded to `align`."""
        last = len(self.keys) - 1
        return ConcatM(tuple(PartM(None, PadM(k, self.align) if i < last and self.align > 1 else k)
                             for i, k in enumerate(self.keys)))

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Each key's first stored element."""
        out, pos = [], 0
        for p in self.concat.parts:
            out.append(pos)
            pos += p.mode.stored
        return tuple(out)

    @cached_property
    def logical(self) -> int:
        return sum(self.numels)

    @cached_property
    def stored(self) -> int:
        return self.concat.stored

    @cached_property
    def leaf_extents(self) -> tuple[int, ...]:
        return self.numels

    @cached_property
    def identity(self) -> bool:
        return self.stored == self.logical and all(k.identity for k in self.keys)

    @cached_property
    def part_tree(self) -> PartTree:
        return self.concat.part_tree


ModeIR = PlainM | ProductM | ConcatM | PadM | FlatM | KeyM


def fragments(mode: ModeIR) -> int:
    """An upper bound on the runs of the whole stored dim (strided layouts are many)."""
    if mode.identity:
        return 1
    match mode:
        case PadM(inner=inner):
            return fragments(inner) + 1
        case ConcatM(parts=parts):
            return sum(fragments(p.mode) for p in parts)
        case ProductM(count=n, inner=inner):
            return n * fragments(inner)
        case FlatM():
            return fragments(mode.concat)
        case KeyM(dims=dims):
            n = 1
            for m in dims:
                n *= fragments(m) if not m.identity else 1
            return n
    return 1


def _scale(tree: PartTree, n: int) -> PartTree:
    """Hoisting: N copies of a concatenation are a concatenation of N-copy parts."""
    if isinstance(tree, Leaf):
        return Leaf(tree.extent * n)
    return PartNode(tuple((name, _scale(sub, n)) for name, sub in tree.parts))


def part_leaves(tree: PartTree, start: int = 0, prefix: str = "") -> list[tuple[str, int, int]]:
    """(label, logical start, stop) of every leaf of a hoisted part tree, in logical order.

    >>> part_leaves(PartNode((("gate", Leaf(4)), ("up", PartNode(((None, Leaf(2)), ("b", Leaf(2))))))))
    [('gate', 0, 4), ('up.0', 4, 6), ('up.b', 6, 8)]
    """
    if isinstance(tree, Leaf):
        return [(prefix, start, start + tree.extent)]
    out, pos = [], start
    for i, (name, sub) in enumerate(tree.parts):
        label = f"{prefix}.{name or i}" if prefix else (name or str(i))
        found = part_leaves(sub, pos, label)
        out.extend(found)
        pos = found[-1][2] if found else pos
    return out


def tree_extent(tree: PartTree) -> int:
    """Logical elements of a hoisted part tree (the sum of its leaves)."""
    if isinstance(tree, Leaf):
        return tree.extent
    return sum(tree_extent(sub) for _, sub in tree.parts)


def part_range(tree: PartTree, path: tuple[int, ...]) -> tuple[int, int]:
    """Logical [start, stop) of the part reached by `path` (one part index per
    concatenation level, products and `pad` being transparent in the hoisted tree).

    Preserves hoisting: a part of `(N, (q | k))` is all N copies of it, one
    contiguous logical range (LANGUAGE.md 3, 8.1).

    >>> part_range(PartNode((("q", Leaf(8)), ("kv", PartNode(((None, Leaf(2)), (None, Leaf(2))))))), (1, 1))
    (10, 12)
    """
    start = 0
    for i in path:
        assert isinstance(tree, PartNode), "a path goes through concatenations only"
        start += sum(tree_extent(sub) for _, sub in tree.parts[:i])
        tree = tree.parts[i][1]
    return start, start + tree_extent(tree)


def subtree_at(tree: PartTree, start: int, stop: int) -> PartTree | None:
    """The part (sub)tree covering exactly logical [start, stop), or None: a key's
    part tree inside a stored tensor with part keys (LANGUAGE.md 8.1).

    >>> subtree_at(PartNode((("q", Leaf(8)), ("k", Leaf(2)))), 8, 10)
    Leaf(extent=2)
    """
    pos = 0
    while True:
        if pos == start and tree_extent(tree) == stop - start:
            return tree
        if isinstance(tree, Leaf):
            return None
        for _, sub in tree.parts:
            n = tree_extent(sub)
            if pos <= start and stop <= pos + n:
                tree = sub
                break
            pos += n
        else:
            return None


def leaf_starts(mode: ModeIR) -> tuple[int, ...]:
    """Logical start of each hoisted leaf (prefix sums in part order)."""
    starts, acc = [], 0
    for e in mode.leaf_extents:
        starts.append(acc)
        acc += e
    return tuple(starts)


# ---- over: which stored intervals a coordinate holds -----------------------

def check_split(mode: ModeIR, s: int, axis: str) -> None:
    """Raise SplitError unless `mode over axis` (size s) is a legal split."""
    match mode:
        case PlainM(extent=e):
            if e % s:
                raise SplitError(
                    f"split {e} over {axis}={s} leaves remainder {e % s}", mode,
                    help=f"use `pad {s}` or change {axis}")
        case ProductM(count=n):
            if n % s and s % n:
                raise SplitError(
                    f"split ({n}, ...) over {axis}={s}: {n} copies are neither a multiple "
                    f"nor a divisor of {s}", mode,
                    help=f"use `chunk {axis}` to cut its storage contiguously, or change {axis}")
        case ConcatM(parts=parts):
            for part in parts:
                check_split(part.mode, s, axis)
        case FlatM():
            if mode.stored % s:
                raise SplitError(
                    f"flat dim of stored extent {mode.stored} does not split over {axis}={s} "
                    f"(remainder {mode.stored % s})", mode,
                    help=f"pad its tail to a multiple of {s}: `flat(...) pad {axis} over {axis}`")
        case PadM():
            if mode.stored % s:
                raise SplitError(
                    f"padded extent {mode.stored} does not split over {axis}={s} "
                    f"(remainder {mode.stored % s})", mode,
                    help=f"pad to a multiple of {s}, e.g. `pad {mode.multiple * s}`")


def ragged_block(n: int, s: int, c: int) -> tuple[int, int]:
    """[lo, hi) of coordinate c when n things split over s like torch.chunk (LANGUAGE.md 8.5).

    Blocks of cdiv(n, s); the last coordinates may hold fewer, or nothing.

    >>> [ragged_block(5, 2, c) for c in range(2)], [ragged_block(1, 2, c) for c in range(2)]
    ([(0, 3), (3, 5)], [(0, 1), (1, 1)])
    >>> [ragged_block(5, 4, c) for c in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    b = -(-n // s)
    return min(c * b, n), min((c + 1) * b, n)


def balanced_block(n: int, s: int, c: int) -> tuple[int, int]:
    """[lo, hi) of coordinate c when n things split over s as evenly as they can, the first
    n mod s coordinates one longer (`over AXIS balanced`: numpy.array_split, vLLM's expert map).

    >>> [balanced_block(5, 2, c) for c in range(2)], [balanced_block(10, 4, c) for c in range(4)]
    ([(0, 3), (3, 5)], [(0, 3), (3, 6), (6, 8), (8, 10)])
    """
    q, r = divmod(n, s)
    lo = c * q + min(c, r)
    return lo, lo + q + (c < r)


def unit_intervals(placement: str, n: int, s: int, c: int) -> list[tuple[int, int]]:
    """The units [lo, hi) coordinate c of s holds when n units split by an uneven placement
    (LANGUAGE.md 8.5, docs/language.md 14.8), in storage order; empty intervals left out.

    `cyclic`: c, c+s, c+2s, ... (round-robin; vLLM's `round_robin` expert placement).

    >>> unit_intervals("ragged", 5, 4, 3), unit_intervals("balanced", 5, 4, 0), unit_intervals("cyclic", 5, 2, 1)
    ([], [(0, 2)], [(1, 2), (3, 4)])
    """
    if placement == "cyclic":
        return [(i, i + 1) for i in range(c, n, s)]
    lo, hi = (ragged_block if placement == "ragged" else balanced_block)(n, s, c)
    return [(lo, hi)] if lo < hi else []


UNEVEN = ("ragged", "balanced", "cyclic")  # placements whose coordinates may hold different extents


def select_uneven(mode: ModeIR, s: int, c: int, placement: str, base: int = 0) -> list[tuple[int, int]]:
    """`select` for `over AXIS ragged | balanced | cyclic`: a plain (or padded) extent cuts
    elements, a product cuts its copies, a concatenation gives each part its own split.

    Empty intervals are left out: a coordinate may hold nothing.
    Preserves: the pieces of all coordinates partition storage (never replicated).
    """
    match mode:
        case ProductM(count=n, inner=inner):
            step = inner.stored
            return [(base + lo * step, base + hi * step) for lo, hi in unit_intervals(placement, n, s, c)]
        case ConcatM(parts=parts):
            out, offset = [], base
            for part in parts:
                out.extend(select_uneven(part.mode, s, c, placement, offset))
                offset += part.mode.stored
            return out
    return [(base + lo, base + hi) for lo, hi in unit_intervals(placement, mode.stored, s, c)]


def select(mode: ModeIR, s: int, c: int, base: int = 0) -> list[tuple[int, int]]:
    """Stored intervals [a, b) that coordinate c of s holds, in storage order.

    Preserves: the pieces of all coordinates partition storage, except where a
    product is replicated (s > N), where s/N coordinates hold the same copy.
    """
    match mode:
        case PlainM(extent=e):
            step = e // s
            return [(base + c * step, base + (c + 1) * step)]
        case ProductM(count=n, inner=inner):
            if n % s == 0:
                step = (n // s) * inner.stored
                return [(base + c * step, base + (c + 1) * step)]
            copy = c * n // s
            return [(base + copy * inner.stored, base + (copy + 1) * inner.stored)]
        case ConcatM(parts=parts):
            out, offset = [], base
            for part in parts:
                out.extend(select(part.mode, s, c, offset))
                offset += part.mode.stored
            return out
        case PadM() | FlatM():
            step = mode.stored // s
            return [(base + c * step, base + (c + 1) * step)]
    raise AssertionError(mode)


RAGGED = -1  # `align` value of `chunk AXIS ragged`: torch.chunk's cut, no padding


def chunk_intervals(intervals: list[tuple[int, int]], n_chunks: int, index: int,
                    align: int | None) -> tuple[list[tuple[int, int]], int]:
    """Cut local storage (the concatenated intervals) into equal chunks
    (`align` RAGGED: torch.chunk's blocks, the last ones shorter or empty).

    Returns chunk `index`'s stored intervals and the count of alignment padding
    elements at its tail. Preserves order: chunk c is local [c*m, (c+1)*m).
    """
    n = sum(b - a for a, b in intervals)
    if align == RAGGED:
        lo, hi = ragged_block(n, n_chunks, index)
    else:
        total = n if align is None else -(-n // (align * n_chunks)) * (align * n_chunks)
        m = total // n_chunks
        lo, hi = index * m, (index + 1) * m
    out, pos = [], 0
    for a, b in intervals:
        length = b - a
        s, e = max(lo, pos), min(hi, pos + length)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += length
    tail = max(0, hi - max(lo, n))
    return out, tail


# ---- walk: stored interval -> runs ----------------------------------------

def _walk(mode: ModeIR, a: int, b: int) -> Iterator[tuple[int, int, int, int] | tuple[int, int]]:
    """Yield (stored_pos, leaf, offset, length) data pieces or (stored_pos, length) pads."""
    if a >= b:
        return
    if mode.identity:
        yield (a, 0, a, b - a)
        return
    match mode:
        case PadM(inner=inner):
            cut = min(b, inner.stored)
            if a < cut:
                yield from _walk(inner, a, cut)
            if b > inner.stored:
                start = max(a, inner.stored)
                yield (start, b - start)
        case ConcatM(parts=parts):
            offset, leaf_base = 0, 0
            for part in parts:
                sub = part.mode
                s, e = max(a, offset), min(b, offset + sub.stored)
                if s < e:
                    for piece in _walk(sub, s - offset, e - offset):
                        if len(piece) == 4:
                            pos, leaf, off, length = piece
                            yield (pos + offset, leaf + leaf_base, off, length)
                        else:
                            yield (piece[0] + offset, piece[1])
                offset += sub.stored
                leaf_base += len(sub.leaf_extents)
                if offset >= b:
                    break
        case FlatM():
            yield from _walk(mode.concat, a, b)
        case KeyM():
            yield from _key_walk(mode, 0, a, b, 0, 0)
        case ProductM(inner=inner):
            size, ext = inner.stored, inner.leaf_extents
            first, last = a // size, (b - 1) // size
            for n in range(first, last + 1):
                base = n * size
                for piece in _walk(inner, max(a, base) - base, min(b, base + size) - base):
                    if len(piece) == 4:
                        pos, leaf, off, length = piece
                        yield (pos + base, leaf, n * ext[leaf] + off, length)
                    else:
                        yield (piece[0] + base, piece[1])
        case _:
            raise AssertionError(mode)


def _key_walk(key: KeyM, d: int, a: int, b: int, sbase: int, lbase: int):
    """Data pieces of stored [a, b) of the block of `key` at dim d (at stored offset sbase of
    the key, logical offset lbase): dim d's runs map its storage index k to logical index
    k + (logical_start - local_start); where every dim after d is plain, a run's whole rows
    continue in storage and logically alike, else each index is walked on."""
    s = key.strides[d]
    inner = all(m.identity for m in key.dims[d + 1:])
    for run in key.dim_runs[d]:
        x, y = max(a, run.local_start * s), min(b, (run.local_start + run.length) * s)
        if x >= y:
            continue
        delta = (run.logical_start - run.local_start) * s
        if inner:
            yield (sbase + x, 0, lbase + x + delta, y - x)
            continue
        for k in range(x // s, (y - 1) // s + 1):
            lo, hi = max(x, k * s), min(y, (k + 1) * s)
            yield from _key_walk(key, d + 1, lo - k * s, hi - k * s, sbase + k * s, lbase + k * s + delta)


def runs(mode: ModeIR, intervals: list[tuple[int, int]], tail_pad: int) -> tuple[RunLike, ...]:
    """Runs of local storage: the stored intervals in order, then `tail_pad` padding.

    Adjacent runs are merged when both local and logical positions continue,
    so a plain split is one run and a strided split one run per stride.
    """
    starts = leaf_starts(mode)
    out: list[RunLike] = []
    local = 0

    def emit(run: RunLike) -> None:
        if out:
            prev = out[-1]
            if isinstance(run, PadRun) and isinstance(prev, PadRun):
                out[-1] = PadRun(prev.local_start, prev.length + run.length)
                return
            if (isinstance(run, Run) and isinstance(prev, Run)
                    and prev.logical_start + prev.length == run.logical_start):
                out[-1] = Run(prev.local_start, prev.logical_start, prev.length + run.length)
                return
        if len(out) >= MAX_RUNS:
            raise SplitError(f"this dimension splits into more than {MAX_RUNS} runs on one rank",
                             mode, help="a real layout is far less fragmented; check the counts")
        out.append(run)

    for a, b in intervals:
        for piece in _walk(mode, a, b):
            if len(piece) == 4:
                pos, leaf, off, length = piece
                emit(Run(local + pos - a, starts[leaf] + off, length))
            else:
                emit(PadRun(local + piece[0] - a, piece[1]))
        local += b - a
    if tail_pad:
        emit(PadRun(local, tail_pad))
    return tuple(out)
