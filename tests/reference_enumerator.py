"""A slow, obviously-correct model of LANGUAGE.md section 3, element by element.

The front end computes runs (compressed intervals) with clever arithmetic. This
module recomputes the same facts the dumbest possible way: it builds Python
lists with one entry per stored element and slices them, so that each line can
be checked against one sentence of the spec. The property tests
(tests/test_runs_property.py) compare the two on random layouts.

Nothing here imports layoutlang: the model is written from the spec alone.

Notation
--------
    M                a mode: Plain(E) | Product(N, M) | Concat(parts) | Pad(M, K) | Flat(shapes, A)
    Label(path, d)   the identity of one logical element, independent of order:
                     `path` picks a part at every concatenation level of the
                     HOISTED part tree, `d` are the row-major digits inside that
                     leaf (one digit per enclosing product, outer first, then
                     the plain extent's digit).
    labels(M)        one entry per STORED element of M in written (storage)
                     order: its Label, or None for padding.
    logical(M)       every Label of M in canonical logical order: concatenations
                     hoisted out of every product, leaves row-major.
    storage(M)       labels(M) with each Label replaced by its position in
                     logical(M): the logical index, or None for padding.
    over(M, s, c)    the labels that coordinate c of an axis of size s stores.
    chunk(xs, g, k)  the g-way contiguous cut of a rank's local storage.
    ragged           `over ... ragged` / `chunk ... ragged` (LANGUAGE.md 8.5):
                     the same cuts made like torch.chunk: blocks of
                     cdiv(n, s), coordinate c takes [c*b, min((c+1)*b, n)),
                     possibly nothing; never padded, never replicated.

Example: `(2, (x: 1 | y: 2))` stores copy 0 (x0, y0, y1) then copy 1
(x0, y0, y1); logically it is `(x: (2, 1) | y: (2, 2))`, so

>>> storage(Product(2, Concat((("x", Plain(1)), ("y", Plain(2))))))
[0, 2, 3, 1, 4, 5]

Ragged: 5 over 2 stores [0, 1, 2] | [3, 4]; `(3, 4)` over 4 cuts the 3 copies,
so the 4th coordinate holds nothing:

>>> [local(Product(3, Plain(4)), 4, c, ragged=True) for c in range(4)]
[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], []]

An indivisible split raises SplitError (the front end must raise LayoutError
for the same layout); nothing returns a sentinel.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TypeVar, assert_never

# ---------------------------------------------------------------------------
# Modes (one dimension's structure, without `over` / `chunk`)


@dataclass(frozen=True)
class Plain:
    """`E`: a plain extent of E elements."""

    extent: int


@dataclass(frozen=True)
class Product:
    """`(N, M)`: N consecutive copies of M, outer first."""

    count: int
    inner: Mode


@dataclass(frozen=True)
class Concat:
    """`(a: M1 | b: M2 | ...)`: parts in order; a name is None when unnamed."""

    parts: tuple[tuple[str | None, Mode], ...]


@dataclass(frozen=True)
class Pad:
    """`M pad K`: M's storage followed by padding up to a multiple of K."""

    inner: Mode
    multiple: int


@dataclass(frozen=True)
class Flat:
    """`flat(SHAPE as KEY | ...) [align A]` (docs/language.md 14.9): whole keys, each stored
    row-major in the storage order of its dims, one after another in written order. Key 0
    starts at stored element 0; key i+1 starts at the first multiple of `align` at or after the
    end of key i (the elements skipped are padding); nothing follows the last key. Logically:
    key 0's elements in row-major order of its dims' LOGICAL indices, then key 1's, ... (the
    padding is not logical). `over` cuts its stored elements like a padded extent's.

    A key's dim is an int (a plain extent) or a mode without padding (`(2, (x: 1 | y: 2))`)."""

    shapes: tuple[tuple[int | Mode, ...], ...]
    align: int = 1

    def key_dims(self, i: int) -> tuple[Mode, ...]:
        return tuple(Plain(d) if isinstance(d, int) else d for d in self.shapes[i])

    def key_shape(self, i: int) -> tuple[int, ...]:
        return tuple(logical_extent(m) for m in self.key_dims(i))


Mode = Plain | Product | Concat | Pad | Flat
T = TypeVar("T")


@dataclass(frozen=True)
class Dim:
    """`MODE [over AXES [ragged]] [chunk AXIS [align K | ragged]]` with the axes named."""

    mode: Mode
    over: tuple[str, ...] = ()
    chunk: str | None = None
    align: int | None = None
    ragged: bool = False        # `over AXES ragged` (or, with `placement`, `balanced` / `cyclic`)
    chunk_ragged: bool = False  # `chunk AXIS ragged`
    placement: str = "ragged"   # the word of an uneven `over` (LANGUAGE.md 8.5, docs/language.md 14.8), when `ragged`

    def __post_init__(self) -> None:
        # The grammar: `ragged` follows an `over AXES` or a `chunk AXIS`, never with `align`.
        assert self.over or not self.ragged, "`ragged` needs `over AXES`"
        assert self.chunk is not None or not self.chunk_ragged, "`chunk ... ragged` needs `chunk`"
        assert self.align is None or not self.chunk_ragged, "`ragged` and `align` exclude each other"

    def axes(self) -> tuple[str, ...]:
        return self.over + ((self.chunk,) if self.chunk is not None else ())


class SplitError(ValueError):
    """The spec calls this split an error (an indivisible `over` or `chunk`)."""


# ---------------------------------------------------------------------------
# Logical order: labels in storage order, and the hoisted part tree


@dataclass(frozen=True)
class Label:
    """One logical element: part path in the hoisted tree + row-major digits."""

    path: tuple[int, ...]
    digits: tuple[int, ...]


Stored = Label | None  # None is a padding element


def _in_part(p: int, xs: list[Stored]) -> list[Stored]:
    """Labels of part p seen from the enclosing concatenation."""
    return [None if x is None else Label((p,) + x.path, x.digits) for x in xs]


def _in_copy(i: int, xs: list[Stored]) -> list[Stored]:
    """Labels of copy i seen from the enclosing product (outer digit first)."""
    return [None if x is None else Label(x.path, (i,) + x.digits) for x in xs]


def labels(mode: Mode) -> list[Stored]:
    """Every stored element of `mode` in written order (the storage order)."""
    match mode:
        case Plain(e):
            return [Label((), (j,)) for j in range(e)]
        case Product(n, inner):
            return [x for i in range(n) for x in _in_copy(i, labels(inner))]
        case Concat(parts):
            return [x for p, (_, m) in enumerate(parts) for x in _in_part(p, labels(m))]
        case Pad(inner, k):
            body = labels(inner)
            return body + [None] * (-len(body) % k)
        case Flat(shapes, align):
            out: list[Stored] = []
            for i in range(len(shapes)):
                while out and len(out) % align:  # key i starts at a multiple of `align`
                    out.append(None)
                # storage order: row-major over each dim's stored elements; the label: the
                # LOGICAL index of each (its position in logical(hoist(dim)))
                per_dim = [storage(m) for m in mode.key_dims(i)]
                out += [Label((i,), digits) for digits in itertools.product(*per_dim)]
            return out
        case _:
            assert_never(mode)


def flat_key_ranges(mode: Flat) -> list[tuple[int, int]]:
    """Each key's [start, stop) in the flat dim's logical order: its elements in row-major order.

    >>> flat_key_ranges(Flat(((3, 5), (3,), (7, 3), (7,)), 4))
    [(0, 15), (15, 18), (18, 39), (39, 46)]
    """
    out, at = [], 0
    for i in range(len(mode.shapes)):
        n = math.prod(mode.key_shape(i))
        out.append((at, at + n))
        at += n
    return out


@dataclass(frozen=True)
class HLeaf:
    """A leaf of the hoisted tree: a row-major block of shape `dims`."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class HConcat:
    """A concatenation of the hoisted tree (no product encloses it any more)."""

    parts: tuple[tuple[str | None, HNode], ...]


HNode = HLeaf | HConcat


def hoist(mode: Mode) -> HNode:
    """The part tree after hoisting every concatenation out of every product.

    `(N, (a: A | b: B))` becomes `(a: (N, A) | b: (N, B))`; `pad` is storage
    only and vanishes.
    """
    match mode:
        case Plain(e):
            return HLeaf((e,))
        case Pad(inner, _):
            return hoist(inner)
        case Flat(shapes, _):  # key i is part i; inside it, row-major over its dims' logical indices
            return HConcat(tuple((None, HLeaf(mode.key_shape(i))) for i in range(len(shapes))))
        case Concat(parts):
            return HConcat(tuple((name, hoist(m)) for name, m in parts))
        case Product(n, inner):
            return _push_product(n, hoist(inner))
        case _:
            assert_never(mode)


def _push_product(n: int, node: HNode) -> HNode:
    """Distribute an outer product of n copies over every part, down to the leaves."""
    match node:
        case HLeaf(dims):
            return HLeaf((n,) + dims)
        case HConcat(parts):
            return HConcat(tuple((name, _push_product(n, h)) for name, h in parts))
        case _:
            assert_never(node)


def logical(node: HNode) -> list[Label]:
    """Every label of the hoisted tree in logical order (parts in order, leaves row-major)."""
    match node:
        case HLeaf(dims):
            return [Label((), d) for d in itertools.product(*(range(n) for n in dims))]
        case HConcat(parts):
            return [
                Label((p,) + x.path, x.digits)
                for p, (_, h) in enumerate(parts)
                for x in logical(h)
            ]
        case _:
            assert_never(node)


def logical_index(mode: Mode) -> dict[Label, int]:
    """Label -> logical index for the whole dimension `mode`."""
    return {x: i for i, x in enumerate(logical(hoist(mode)))}


def to_indices(mode: Mode, xs: list[Stored]) -> list[int | None]:
    """Replace labels (of the whole dim `mode`) by logical indices."""
    index = logical_index(mode)
    return [None if x is None else index[x] for x in xs]


def logical_extent(mode: Mode) -> int:
    """Number of logical (non-padding) elements."""
    return len(logical(hoist(mode)))


def stored_extent(mode: Mode) -> int:
    """Number of stored elements, padding included."""
    return len(labels(mode))


def storage(mode: Mode) -> list[int | None]:
    """The full dim's stored elements in storage order: logical index or None (padding)."""
    return to_indices(mode, labels(mode))


# ---------------------------------------------------------------------------
# over and chunk


def combine(sizes: tuple[int, ...], coords: tuple[int, ...]) -> tuple[int, int]:
    """A tuple of axes as one combined axis, first one major: (size, coordinate)."""
    s, c = 1, 0
    for size, coord in zip(sizes, coords, strict=True):
        s, c = s * size, c * size + coord
    return s, c


def _contiguous(xs: list[Stored], s: int, c: int, what: str) -> list[Stored]:
    """Piece c of xs cut into s equal contiguous pieces (indivisible: SplitError)."""
    if len(xs) % s:
        raise SplitError(f"{what}: {len(xs)} elements do not split over {s}")
    w = len(xs) // s
    return xs[c * w : (c + 1) * w]


def torch_chunk(xs: list[T], s: int, c: int) -> list[T]:
    """Piece c of torch.chunk(xs, s): blocks of cdiv(len(xs), s), the last shorter, then none.

    >>> [torch_chunk([0, 1, 2, 3, 4], 4, c) for c in range(4)]
    [[0, 1], [2, 3], [4], []]
    """
    b = -(-len(xs) // s)
    return xs[c * b : (c + 1) * b]  # a slice past the end is empty


def array_split(xs: list, s: int, c: int) -> list:
    """Block c of s as numpy.array_split cuts: sizes differ by at most one, the longer first
    (`over ... balanced`, docs/language.md 14.8; vLLM's expert map for E mod EP != 0).

    >>> [array_split([0, 1, 2, 3, 4], 3, c) for c in range(3)]
    [[0, 1], [2, 3], [4]]
    """
    sizes = [len(xs) // s + (1 if i < len(xs) % s else 0) for i in range(s)]
    start = sum(sizes[:c])
    return xs[start : start + sizes[c]]


def round_robin(xs: list, s: int, c: int) -> list:
    """Every s-th item from item c (`over ... cyclic`, docs/language.md 14.8; vLLM's `round_robin`).

    >>> [round_robin([0, 1, 2, 3, 4], 2, c) for c in range(2)]
    [[0, 2, 4], [1, 3]]
    """
    return xs[c::s]


UNEVEN_CUTS = {"ragged": torch_chunk, "balanced": array_split, "cyclic": round_robin}


def over_ragged_labels(mode: Mode, s: int, c: int, placement: str = "ragged") -> list[Stored]:
    """What coordinate c of s stores of `mode` under `over ... ragged` (LANGUAGE.md 8.5), or
    `balanced` / `cyclic` (docs/language.md 14.8): the same cuts with another rule for which units c takes.

    A plain extent cuts its elements, a product `(N, M)` its N copies, a
    concatenation gives each part its own ragged split. A padded extent cuts its
    stored elements, as the equal split does (the spec is silent on `pad`).
    """
    assert 0 <= c < s
    cut = UNEVEN_CUTS[placement]
    match mode:
        case Plain(_) | Pad(_, _) | Flat(_, _):
            return cut(labels(mode), s, c)
        case Product(n, inner):
            copies = [_in_copy(i, labels(inner)) for i in range(n)]
            return [x for copy in cut(copies, s, c) for x in copy]
        case Concat(parts):
            return [x for p, (_, m) in enumerate(parts) for x in _in_part(p, over_ragged_labels(m, s, c, placement))]
        case _:
            assert_never(mode)


def over_labels(mode: Mode, s: int, c: int) -> list[Stored]:
    """What coordinate c of an axis of size s stores of `mode`, in local storage order.

    `over` splits the OUTERMOST mode and descends only into concatenation parts.
    """
    assert 0 <= c < s
    match mode:
        case Plain(e):
            return _contiguous(labels(mode), s, c, f"plain {e}")
        case Product(n, inner):
            if n % s == 0:
                copies = range(c * n // s, (c + 1) * n // s)
            elif s > n and s % n == 0:
                copies = range(c * n // s, c * n // s + 1)  # whole copy, replicated
            else:
                raise SplitError(f"product of {n} copies does not split over {s}")
            per = stored_extent(inner)
            every = labels(mode)
            return [x for i in copies for x in every[i * per : (i + 1) * per]]
        case Concat(parts):
            return [x for p, (_, m) in enumerate(parts) for x in _in_part(p, over_labels(m, s, c))]
        case Pad(_, k):
            return _contiguous(labels(mode), s, c, f"pad {k} (stored extent)")
        case Flat(_, _):  # its stored elements, contiguously (docs/language.md 14.9)
            return _contiguous(labels(mode), s, c, "flat (stored extent)")
        case _:
            assert_never(mode)


def chunk(
    xs: list[int | None], g: int, gc: int, align: int | None, ragged: bool = False
) -> list[int | None]:
    """Chunk gc of g of a rank's local storage; `align K` first pads the tail to K*g;
    `ragged` cuts it like torch.chunk instead (no padding)."""
    assert 0 <= gc < g
    if ragged:
        assert align is None
        return torch_chunk(xs, g, gc)
    if align is not None:
        xs = xs + [None] * (-len(xs) % (align * g))
    if len(xs) % g:
        raise SplitError(f"chunk: {len(xs)} local elements do not split into {g}")
    w = len(xs) // g
    return xs[gc * w : (gc + 1) * w]


def local(
    mode: Mode,
    s: int,
    c: int,
    g: int = 1,
    gc: int = 0,
    align: int | None = None,
    *,
    ragged: bool = False,
    chunk_ragged: bool = False,
    placement: str = "ragged",
) -> list[int | None]:
    """A rank's stored elements of one dim: logical index or None (padding), in local order.

    (s, c, ragged) is the combined `over` axis (1, 0 without `over`); (g, gc,
    align, chunk_ragged) the `chunk` axis (1, 0, None without `chunk`). Raises
    SplitError where the spec says the split is an error.

    >>> local(Plain(8), 2, 1)
    [4, 5, 6, 7]
    >>> local(Product(2, Plain(3)), 4, 3)             # s > N: copy 1, replicated
    [3, 4, 5]
    >>> local(Pad(Plain(5), 4), 2, 1, 2, 1, align=2)  # [4 P P P] -> pad to 4 -> [P P]
    [None, None]
    >>> local(Plain(6), 2, 1, 4, 3, ragged=True, chunk_ragged=True)  # [3 4 5] -> [3] [4] [5] []
    []
    """
    stored = over_ragged_labels(mode, s, c, placement) if ragged else over_labels(mode, s, c)
    return chunk(to_indices(mode, stored), g, gc, align, chunk_ragged)


def dim_local(dim: Dim, sizes: dict[str, int], coords: dict[str, int]) -> list[int | None]:
    """`local` for a Dim on the rank with the given mesh coordinates."""
    s, c = combine(tuple(sizes[a] for a in dim.over), tuple(coords[a] for a in dim.over))
    if dim.chunk is None:
        return local(dim.mode, s, c, ragged=dim.ragged, placement=dim.placement)
    if dim.ragged and not dim.chunk_ragged:
        raise SplitError("an equal `chunk` of a ragged `over`: the local extents differ")
    return local(
        dim.mode, s, c, sizes[dim.chunk], coords[dim.chunk], dim.align,
        ragged=dim.ragged, chunk_ragged=dim.chunk_ragged, placement=dim.placement,
    )


def dim_is_valid(dim: Dim, sizes: dict[str, int]) -> bool:
    """Whether every coordinate's split is legal (the spec's rules are coordinate-free)."""
    names = dim.axes()
    try:
        for point in itertools.product(*(range(sizes[a]) for a in names)):
            dim_local(dim, sizes, dict(zip(names, point)))
    except SplitError:
        return False
    return True


# ---------------------------------------------------------------------------
# A whole (small) layout: one mesh, tensors, optional loops and placement


@dataclass(frozen=True)
class MeshSpec:
    """`mesh NAME (a=Sa, ...) at OFFSET`; coordinates row-major, last axis fastest."""

    name: str
    axes: tuple[tuple[str, int], ...]
    offset: int = 0

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.axes)

    def coords(self, rank: int) -> dict[str, int] | None:
        """The rank's coordinates, or None when the mesh does not cover it."""
        if not self.offset <= rank < self.offset + self.size:
            return None
        r, out = rank - self.offset, {}
        for name, n in reversed(self.axes):
            r, out[name] = divmod(r, n)
        return out


@dataclass(frozen=True)
class TensorSpec:
    """`tensor STEM[.{l.local}|.{l}] [as KEYSTEM.{l}] [DIMS] [DTYPE] [at AXIS=K, ...]`.

    `var_in_name` is how the loop variable appears in the name: "global" for
    `{l}`, "local" for `{l.local}`, None outside a loop. `key_stem` is the
    `as` override (always followed by `.{l}` inside a loop).
    """

    stem: str
    dims: tuple[Dim, ...]
    dtype: str | None = None
    at: tuple[tuple[str, int], ...] = ()
    var_in_name: str | None = None
    key_stem: str | None = None

    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d.axes()) + tuple(a for a, _ in self.at)


@dataclass(frozen=True)
class LoopSpec:
    """`for l in START..STOP [over AXIS [sizes [...]]] { tensors }`."""

    start: int
    stop: int
    body: tuple[TensorSpec, ...]
    axis: str | None = None
    sizes: tuple[int, ...] | None = None

    def blocks(self, axis_size: int) -> list[range]:
        """The contiguous block of loop values each coordinate owns."""
        widths = self.sizes or ((self.stop - self.start) // axis_size,) * axis_size
        firsts = itertools.accumulate(widths, initial=self.start)
        return [range(f, f + w) for f, w in zip(firsts, widths)]


@dataclass(frozen=True)
class LayoutSpec:
    """One mesh, an optional `default dtype`, then tensor and loop statements."""

    mesh: MeshSpec
    statements: tuple[TensorSpec | LoopSpec, ...]
    default_dtype: str | None = None


@dataclass(frozen=True)
class Instance:
    """What the front end should report for one tensor instance (loop iteration)."""

    spec: TensorSpec
    name: str
    key: str
    dtype: str
    holders: frozenset[int]
    replica_axes: frozenset[str]


def instances(layout: LayoutSpec) -> list[Instance]:
    """Every tensor instance in declaration order (loops unrolled iteration by iteration)."""
    mesh, out = layout.mesh, []
    dtype = layout.default_dtype or "bf16"
    all_ranks = range(mesh.offset + mesh.size)

    def instance(t: TensorSpec, loop: LoopSpec | None, l: int | None) -> Instance:
        owner: dict[str, int] = dict(t.at)
        name = key = t.stem
        if loop is not None:
            assert l is not None
            if loop.axis is not None:
                blocks = loop.blocks(mesh.sizes[loop.axis])
                owner[loop.axis] = next(k for k, b in enumerate(blocks) if l in b)
                shown = l - blocks[owner[loop.axis]].start if t.var_in_name == "local" else l
            else:
                shown = l
            name, key = f"{t.stem}.{shown}", f"{t.stem}.{l}"
        if t.key_stem is not None:
            key = t.key_stem if loop is None else f"{t.key_stem}.{l}"
        holders = frozenset(
            r
            for r in all_ranks
            if (co := mesh.coords(r)) is not None and all(co[a] == k for a, k in owner.items())
        )
        used = set(t.used_axes()) | ({loop.axis} if loop is not None and loop.axis else set())
        replicas = frozenset(a for a, _ in mesh.axes if a not in used)
        return Instance(t, name, key, t.dtype or dtype, holders, replicas)

    for st in layout.statements:
        match st:
            case TensorSpec():
                out.append(instance(st, None, None))
            case LoopSpec():
                for l in range(st.start, st.stop):
                    out.extend(instance(t, st, l) for t in st.body)
            case _:
                assert_never(st)
    return out


def tensor_is_valid(t: TensorSpec, mesh: MeshSpec) -> bool:
    """Whether every dim of the tensor splits legally on this mesh."""
    return all(dim_is_valid(d, mesh.sizes) for d in t.dims)


def layout_is_valid(layout: LayoutSpec) -> bool:
    """Whether the layout has no indivisible split (the only errors the strategies make)."""
    tensors = [
        t
        for st in layout.statements
        for t in (st.body if isinstance(st, LoopSpec) else (st,))
    ]
    return all(tensor_is_valid(t, layout.mesh) for t in tensors)
