"""Hypothesis strategies for small random layouts, and their `.layout` text.

Why: the front end's split arithmetic has many interacting cases (products
inside concatenations, padding inside products, replication when an axis
outgrows a product, tuple axes, `chunk ... align`, ragged splits that leave
some ranks empty). Random small layouts reach
the corners hand-written fixtures miss; tests/reference_enumerator.py says what
each rank must store.

A generated case is a `Case(spec, text)`: the plain-data model
(reference_enumerator.LayoutSpec) and one rendering of it, e.g.

    mesh m (a=2, b=3, c=2)
    tensor t0 [(4, (x: 2 | y: 3)) over (a, b) chunk c align 4, 6]

Most splits are valid by construction (extents are chosen as multiples of the
axis sizes); about one dim in seven is generated for a different axis size, so
it may be indivisible, and the test then expects `LayoutError`. About one
`over` in five is uneven (`ragged`, LANGUAGE.md 8.5; `balanced` or `cyclic`, docs/language.md 14.8) on a mode drawn for any size, so
its extents rarely divide and are often smaller than the axis (coordinates that
hold nothing); its `chunk` is mostly `ragged` too (an equal one is the error
case), and about one `chunk` of an equal split in five is `ragged`. The rendering
itself also varies (flattened `(A, B, C)` products, arithmetic extents, axis
names as sizes (`2*a`), optional parentheses around `pad`, `at a=a-1`);
shrinking moves every such choice to its plainest form.

Sizes stay small (stored extent <= MAX_STORED per dim, world <= MAX_WORLD) so
the element-by-element reference is instant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, assert_never

from hypothesis import strategies as st

from reference_enumerator import (
    Concat,
    Dim,
    Flat,
    LayoutSpec,
    LoopSpec,
    MeshSpec,
    Mode,
    Pad,
    Plain,
    Product,
    SplitError,
    TensorSpec,
    dim_is_valid,
    dim_local,
    flat_key_ranges,
    stored_extent,
)

AXES = ("a", "b", "c")
PART_NAMES = ("x", "y", "z", "u", "w")  # never an axis name, never a keyword
DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
MAX_STORED = 48
MAX_WORLD = 16
MAX_DEPTH = 3
RAGGED_PERCENT = 20  # how often an `over`, or the `chunk` of an equal split, is `ragged`

T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """A generated layout: the model the reference reads and the text the front end reads."""

    spec: LayoutSpec
    text: str

    def __repr__(self) -> str:
        return f"Case(text=\n{self.text})"


# ---------------------------------------------------------------------------
# Style choices: drawn when generating, plainest option when rendering by hand


class Style:
    """Picks among equivalent spellings; the first option is the plainest.

    With a hypothesis `draw` the choice is random (and shrinks to the first);
    without one, rendering is deterministic (used for hand-written examples).
    """

    def __init__(
        self,
        draw: Callable[[st.SearchStrategy[Any]], Any] | None = None,
        axes: Sequence[tuple[str, int]] = (),
    ):
        self._draw = draw
        self.axes = tuple(axes)  # axis names usable in arithmetic (they mean their size)

    def for_mesh(self, mesh: MeshSpec) -> Style:
        return Style(self._draw, mesh.axes)

    def pick(self, options: Sequence[T]) -> T:
        return options[0] if self._draw is None else self._draw(st.sampled_from(options))

    def maybe(self, percent: int) -> bool:
        """True with about `percent` % probability (False when deterministic; shrinks to False)."""
        return self._draw is not None and self._draw(st.integers(0, 99)) >= 100 - percent


def render_int(style: Style, n: int) -> str:
    """An integer, sometimes as arithmetic (`2*3`, `5+1`, `2*tp`): extents are expressions."""
    spellings = [str(n)]
    if style.maybe(15):
        spellings += [f"{p}*{n // p}" for p in range(2, n) if n % p == 0][:2]
        if n > 1:
            spellings.append(f"{n - 1}+1")
        spellings += [a if n == k else f"{n // k}*{a}" for a, k in style.axes if n % k == 0]
    return style.pick(spellings)


def render_mode(style: Style, mode: Mode) -> str:
    """A mode in the grammar's `mode` position (a `group`, optionally `pad K`)."""
    match mode:
        case Plain(e):
            return render_int(style, e)
        case Product(n, inner):
            items = [render_int(style, n)]
            # `(A, B, C)` nests to the right: it is `(A, (B, C))`.
            while isinstance(inner, Product) and style.maybe(50):
                items.append(render_int(style, inner.count))
                inner = inner.inner
            items.append(_render_element(style, inner))
            return "(" + ", ".join(items) + ")"
        case Concat(parts):
            body = [
                _render_element(style, m) if name is None else f"{name}: {_render_element(style, m)}"
                for name, m in parts
            ]
            return "(" + " | ".join(body) + ")"
        case Pad(inner, k):
            group = render_mode(style, inner)
            if isinstance(inner, Pad):  # `M pad K` is not a group; parenthesize it
                group = f"({group})"
            return f"{group} pad {render_int(style, k)}"
        case _:
            assert_never(mode)


def _render_element(style: Style, mode: Mode) -> str:
    """A mode inside `( , )` or `( | )`; redundant parentheses around `pad` are legal."""
    text = render_mode(style, mode)
    if isinstance(mode, Pad) and style.maybe(30):
        text = f"({text})"
    return text


def render_dim(style: Style, dim: Dim) -> str:
    text = render_mode(style, dim.mode)
    if len(dim.over) == 1:
        text += f" over {dim.over[0]}"
    elif dim.over:
        text += f" over ({', '.join(dim.over)})"
    if dim.ragged:
        text += f" {dim.placement}"
    if dim.chunk is not None:
        text += f" chunk {dim.chunk}"
        if dim.align is not None:
            text += f" align {render_int(style, dim.align)}"
        if dim.chunk_ragged:
            text += " ragged"
    return text


def render_tensor(style: Style, t: TensorSpec, mesh: MeshSpec, indent: str = "") -> str:
    name = t.stem
    if t.var_in_name == "local":
        name += ".{l.local}"
    elif t.var_in_name == "global":
        name += ".{l}"
    text = f"{indent}tensor {name}"
    if t.key_stem is not None:
        text += f" as {t.key_stem}" + (".{l}" if t.var_in_name is not None else "")
    text += " [" + ", ".join(render_dim(style, d) for d in t.dims) + "]"
    if t.dtype is not None:
        text += f" {t.dtype}"
    if style.maybe(20):
        text += f" on {mesh.name}"
    if t.at:
        sizes = mesh.sizes
        places = [
            f"{a}={style.pick([str(k), f'{a}-1'] if k == sizes[a] - 1 else [str(k)])}"
            for a, k in t.at
        ]
        text += " at " + ", ".join(places)
    return text


def render_layout(spec: LayoutSpec, style: Style | None = None) -> str:
    """The `.layout` text of a spec (deterministic and plainest without a style)."""
    mesh = spec.mesh
    style = (style or Style()).for_mesh(mesh)
    lines = []
    if style.maybe(10):
        lines.append("layout generated  # a header and a comment")
    head = f"mesh {mesh.name} (" + ", ".join(f"{a}={n}" for a, n in mesh.axes) + ")"
    if mesh.offset or style.maybe(10):
        head += f" at {mesh.offset}"
    lines.append(head)
    if spec.default_dtype is not None:
        lines.append(f"default dtype {spec.default_dtype}")
    for stmt in spec.statements:
        match stmt:
            case TensorSpec():
                lines.append(render_tensor(style, stmt, mesh))
            case LoopSpec():
                head = f"for l in {stmt.start}..{stmt.stop}"
                if stmt.axis is not None:
                    head += f" over {stmt.axis}"
                if stmt.sizes is not None:
                    head += " sizes [" + ", ".join(map(str, stmt.sizes)) + "]"
                lines.append(head + " {")
                lines.extend(render_tensor(style, t, mesh, "  ") for t in stmt.body)
                lines.append("}")
            case _:
                assert_never(stmt)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Modes


def _divisors_below(s: int) -> list[int]:
    """Copy counts N < s with s % N == 0: the replicated-product case."""
    return [n for n in range(1, s) if s % n == 0]


@st.composite
def modes(draw, s: int, budget: int, depth: int = MAX_DEPTH) -> Mode:
    """A mode with stored extent <= budget whose split `over` an axis of size s is valid.

    s = 1 gives an arbitrary mode (every mode splits over 1): that is what a
    product's copy or a pad's body may be, since neither is split further.
    """
    kinds = ["plain", "product", "concat", "pad"] if depth > 0 else ["plain"]
    kind = draw(st.sampled_from(kinds))
    if kind == "product":
        multiples = [s * k for k in range(1, 9) if s * k <= budget]
        replicated = [n for n in _divisors_below(s) if n <= budget]
        if replicated and (not multiples or draw(st.integers(0, 99)) < 40):
            multiples = replicated  # s > N: each copy stored whole by s/N coordinates
        if multiples:
            n = draw(st.sampled_from(multiples))
            return Product(n, draw(modes(1, budget // n, depth - 1)))
    if kind == "concat" and budget >= 2:
        nparts = draw(st.sampled_from([2, 2, 3, 1]))
        share = max(1, budget // nparts)
        parts = [draw(modes(s, share, depth - 1)) for _ in range(nparts)]
        naming = draw(st.sampled_from(["all", "none", "some"])) if nparts > 1 else "all"
        names = draw(st.permutations(PART_NAMES))[:nparts]
        keep = [naming == "all" or (naming == "some" and draw(st.booleans())) for _ in parts]
        return Concat(tuple((nm if k else None, m) for nm, k, m in zip(names, keep, parts)))
    if kind == "pad" and budget >= 2:
        inner = draw(modes(1, max(1, budget * 2 // 3), depth - 1))
        n = stored_extent(inner)
        ks = [k for k in range(1, 17) if (kk := math.ceil(n / k) * k) <= budget and kk % s == 0]
        if ks:
            return Pad(inner, draw(st.sampled_from(ks)))
    if s <= budget:
        return Plain(s * draw(st.integers(1, min(8, budget // s))))
    # No room for a multiple of s: one copy, replicated over all s coordinates.
    return Product(1, Plain(draw(st.integers(1, budget))))


@st.composite
def interleaved(draw, s: int, budget: int) -> Mode:
    """`(N, (M, (x: B | y: B)))`: two parts interleaved inside products, like Meta's
    rotary rows (N heads, M pairs, one row of each half), splitting over s; its
    distributed spelling `(N, (x: (M, B) | y: (M, B)))` (HF's split halves) names the
    same logical tensor, and a pair of the two moves regular progressions of runs:
    strided pieces (docs/compiler.md). Falls back to `modes` when it does not fit."""
    b = draw(st.sampled_from([1, 1, 2]))
    m = draw(st.sampled_from([2, 3, 4]))
    ks = [k for k in (1, 2) if s * k * m * 2 * b <= budget]
    if not ks:
        return draw(modes(s, budget))
    n = s * draw(st.sampled_from(ks))
    x, y = draw(st.permutations(PART_NAMES))[:2]
    return Product(n, Product(m, Concat(((x, Plain(b)), (y, Plain(b))))))


# ---------------------------------------------------------------------------
# Dims, tensors, layouts


@st.composite
def meshes(draw, max_world: int = MAX_WORLD) -> MeshSpec:
    naxes = draw(st.integers(1, len(AXES)))
    axes, world = [], 1
    for name in AXES[:naxes]:
        n = draw(st.sampled_from([k for k in (2, 1, 3, 4) if world * k <= max_world]))
        axes.append((name, n))
        world *= n
    offset = draw(st.sampled_from([0, 0, 0, 1, 4]))
    return MeshSpec("m", tuple(axes), offset)


@st.composite
def dims(draw, mesh: MeshSpec, free: Sequence[str], ragged_percent: int = RAGGED_PERCENT) -> Dim:
    """One dim using only `free` axes (an axis may be used once per tensor);
    `ragged_percent` % of its `over`s (and equal splits' `chunk`s) are `ragged`."""
    sizes = mesh.sizes
    order = draw(st.permutations(list(free)))
    nover = draw(st.sampled_from([n for n in (1, 0, 2, 3) if n <= len(order)]))
    over, rest = tuple(order[:nover]), order[nover:]
    s = math.prod(sizes[a] for a in over)
    # `over ... ragged` (shrinks to the equal split).
    ragged = bool(over) and draw(st.integers(0, 99)) >= 100 - ragged_percent
    # which uneven rule (LANGUAGE.md 8.5, docs/language.md 14.8): torch.chunk's blocks, array_split's, round-robin
    placement = draw(st.sampled_from(["ragged", "balanced", "cyclic"])) if ragged else "ragged"
    if ragged:
        # Any mode splits raggedly: one drawn for size 1 or 3 rarely divides s, and its
        # extents and copy counts (1..8) are often below s, leaving coordinates empty.
        target = draw(st.sampled_from([1, 3, s]))
    else:
        # Mostly a mode made for s; sometimes one made for another size (maybe indivisible).
        target = s if draw(st.integers(0, 99)) >= 15 else draw(st.integers(1, 6))
    mode = draw(modes(target, MAX_STORED))
    chunk_axis = rest[0] if rest and draw(st.integers(0, 99)) < 40 else None
    if chunk_axis is None:
        return Dim(mode, over, ragged=ragged, placement=placement)
    if ragged:  # an equal chunk of a ragged split is an error: keep that rare
        chunk_ragged = draw(st.integers(0, 99)) < 90
    else:
        chunk_ragged = draw(st.integers(0, 99)) >= 100 - ragged_percent
    if chunk_ragged:
        return Dim(mode, over, chunk_axis, None, ragged, True, placement)
    g = sizes[chunk_axis]
    try:
        n = len(dim_local(Dim(mode, over, ragged=ragged, placement=placement), sizes, {a: 0 for a in over}))
    except SplitError:
        n = stored_extent(mode)
    if n % g == 0:
        align = draw(st.sampled_from([None, 1, 2, 4, 3]))
    else:  # without `align` this chunk is indivisible: keep that rare
        align = draw(st.sampled_from([1, 2, 4, 3, None]))
    return Dim(mode, over, chunk_axis, align, ragged, placement=placement)


@st.composite
def tensors(
    draw,
    mesh: MeshSpec,
    stem: str,
    reserved: Sequence[str] = (),
    var_in_name: str | None = None,
    key_stem: str | None = None,
    ragged_percent: int = RAGGED_PERCENT,
) -> TensorSpec:
    """A tensor with 0-3 dims and optional `at` placement, avoiding `reserved` axes."""
    sizes = mesh.sizes
    free = [a for a, _ in mesh.axes if a not in reserved]
    at: list[tuple[str, int]] = []
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        if free:
            a = draw(st.sampled_from(free))
            free.remove(a)
            at.append((a, draw(st.integers(0, sizes[a] - 1))))
    ndims = draw(st.sampled_from([1, 2, 2, 3, 0]))
    dim_list = []
    for _ in range(ndims):
        d = draw(dims(mesh, free, ragged_percent))
        free = [a for a in free if a not in d.axes()]
        dim_list.append(d)
    dtype = draw(st.sampled_from([None, None, *DTYPES]))
    return TensorSpec(stem, tuple(dim_list), dtype, tuple(at), var_in_name, key_stem)


@st.composite
def loops(draw, mesh: MeshSpec, index: int, ragged_percent: int = RAGGED_PERCENT) -> LoopSpec:
    """`for l in A..B [over AXIS [sizes [...]]]` with 1-2 tensors in its body."""
    sizes = mesh.sizes
    start = draw(st.sampled_from([0, 1, 2]))
    axis = draw(st.sampled_from([None, *sizes]))
    block_sizes = None
    if axis is None:
        length = draw(st.integers(1, 3))
    elif draw(st.booleans()):
        length = sizes[axis] * draw(st.integers(1, 2))
    else:
        block_sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=sizes[axis], max_size=sizes[axis])))
        length = sum(block_sizes)
    body = []
    for j in range(draw(st.integers(1, 2))):
        var = "global" if axis is None else draw(st.sampled_from(["local", "global"]))
        key_stem = f"k{index}_{j}" if draw(st.integers(0, 4)) == 0 else None
        reserved = (axis,) if axis else ()
        body.append(draw(tensors(mesh, f"t{index}_{j}", reserved, var, key_stem, ragged_percent)))
    return LoopSpec(start, start + length, tuple(body), axis, block_sizes)


@st.composite
def layout_specs(
    draw, with_loops: bool = True, max_statements: int = 3, ragged_percent: int = RAGGED_PERCENT
) -> LayoutSpec:
    mesh = draw(meshes())
    statements: list[TensorSpec | LoopSpec] = []
    for i in range(draw(st.integers(1, max_statements))):
        if with_loops and draw(st.booleans()):
            statements.append(draw(loops(mesh, i, ragged_percent)))
        else:
            key_stem = f"k{i}" if draw(st.integers(0, 4)) == 0 else None
            statements.append(draw(tensors(mesh, f"t{i}", key_stem=key_stem, ragged_percent=ragged_percent)))
    default = draw(st.sampled_from([None, None, "fp16", "fp32"]))
    return LayoutSpec(mesh, tuple(statements), default)


@st.composite
def cases(
    draw, with_loops: bool = True, max_statements: int = 3, ragged_percent: int = RAGGED_PERCENT
) -> Case:
    """A random layout and one random spelling of it (`ragged_percent`: see `dims`)."""
    spec = draw(layout_specs(with_loops, max_statements, ragged_percent))
    return Case(spec, render_layout(spec, Style(draw)))


def case_of(spec: LayoutSpec) -> Case:
    """A hand-written spec with its plainest rendering (for `@example`s)."""
    return Case(spec, render_layout(spec))


# ---------------------------------------------------------------------------
# Flat dims (docs/language.md 14.9): whole keys flattened into one 1-d dim (ZeRO-3, FSDP1)
#
# A side is a `ModelSide`: its text and, per stored tensor, what the test's model says it holds
# (written from the rule, reference_enumerator.Flat): the reference `Dim`, the ranks that hold
# it, and its keys as (key, [start, stop) of the flat dim's logical elements, key shape), or
# None for a v1 tensor of one key. Keys are k0..kn-1 with shapes drawn by `flat_key_shapes`
# (0-d to 3-d, extents 1..5). A flat side groups the keys, in a drawn order, into units (one
# key per unit: ZeRO-3; several: FSDP1), each `flat(...) [align A] [pad P] over dp [ragged]` on
# `mesh m (dp=W[, r=R])` with W in 1..8 (R a replica axis); small keys over many ranks leave
# ranks holding only padding, and keys straddle ranks. A plain side stores each key as its
# own v1 tensor, one dim split over `tp` (padded, even, ragged or cyclic: a rank's rows every
# tp-th, strided entries on the flat side) or none, another maybe over
# `dp` (two inner dims of a 3-d key cut: the flat side's block needs more than one strided level).


@dataclass(frozen=True)
class ModelTensor:
    name: str
    key: str                 # a v1 tensor's key (a flat tensor's: its name)
    dim_specs: tuple[Dim, ...]
    holders: tuple[int, ...]
    regions: tuple[tuple[str, tuple[int, int], tuple[int, ...]], ...] | None


@dataclass(frozen=True)
class ModelSide:
    text: str
    mesh: MeshSpec
    tensors: tuple[ModelTensor, ...]
    valid: bool              # every split legal per reference_enumerator
    kind: str

    def __repr__(self) -> str:
        return f"ModelSide(valid={self.valid}, text=\n{self.text})"


@st.composite
def key_dims(draw) -> int | Mode:
    """One dim of a key: a plain extent, or now and then rotary-like structure: `(N, (x: a | y: b))`."""
    if draw(st.integers(0, 5)):
        return draw(st.integers(1, 5) if draw(st.integers(0, 4)) else st.integers(8, 12))  # long: 4+ cyclic rows
    inner = Concat((("x", Plain(draw(st.integers(1, 2)))), ("y", Plain(draw(st.integers(1, 2))))))
    return Product(draw(st.integers(1, 3)), inner)


@st.composite
def flat_key_shapes(draw, max_keys: int = 4) -> tuple[tuple[int | Mode, ...], ...]:
    n = draw(st.integers(1, max_keys))
    return tuple(tuple(draw(key_dims()) for _ in range(nd))
                 for nd in (draw(st.sampled_from([1, 2, 2, 3, 1, 0])) for _ in range(n)))


def _dim_text(d: int | Mode) -> str:
    return str(d) if isinstance(d, int) else render_mode(Style(), d)


def _shape_text(shape: tuple[int | Mode, ...]) -> str:
    return "[" + ", ".join(map(_dim_text, shape)) + "]"


def _logical_shape(shape: tuple[int | Mode, ...]) -> tuple[int, ...]:
    return Flat((shape,)).key_shape(0)


@st.composite
def flat_sides(draw, shapes: tuple[tuple[int, ...], ...], offset_max: int = 8) -> ModelSide:
    w = draw(st.sampled_from([1, 2, 1, 2, 3, 4, 5, 6, 7, 8]))  # W = 1, 2 often: whole keys in one box
    r = draw(st.sampled_from([1, 1, 2])) if w <= 4 else 1
    axes = (("dp", w),) + ((("r", r),) if r > 1 else ())
    mesh = MeshSpec("m", axes, draw(st.integers(0, offset_max)))
    order = draw(st.permutations(range(len(shapes))))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(order) - 1)), max_size=len(order) - 1)))) \
        if len(order) > 1 else []
    units = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)]) if a < b]
    holders = tuple(range(mesh.offset, mesh.offset + mesh.size))
    lines, tensors, valid = [], [], True
    kinds = set()
    sloppy = draw(st.integers(0, 4)) == 0  # about one side in five may leave a split indivisible
    for j, unit in enumerate(units):
        unit_shapes = tuple(shapes[i] for i in unit)
        align = draw(st.sampled_from([None, None, 1, 2, 4, 8]))
        pad = draw(st.sampled_from(["dp", None, 3, 8])) if sloppy else "dp"
        ragged = draw(st.integers(0, 9)) == 0
        chunk = r > 1 and draw(st.integers(0, 4)) == 0  # `chunk r`: the replica axis cuts each rank's storage
        chunk_align = draw(st.sampled_from([None, 1, 2])) if chunk and not ragged else None
        mode = Flat(unit_shapes, align or 1)
        if pad is not None:
            mode = Pad(mode, w if pad == "dp" else pad)
        dim = Dim(mode, ("dp",), "r" if chunk else None, chunk_align, ragged=ragged, chunk_ragged=chunk and ragged)
        valid = valid and dim_is_valid(dim, mesh.sizes)
        keys = " | ".join(f"{_shape_text(shapes[i])} as k{i}" for i in unit)
        text = f"flat({keys})" + (f" align {align}" if align is not None else "") \
            + (f" pad {pad}" if pad is not None else "") + " over dp" + (" ragged" if ragged else "") \
            + (" chunk r" + (" ragged" if ragged else f" align {chunk_align}" if chunk_align else "") if chunk else "")
        lines.append(f"tensor u{j} [{text}]")
        ranges = flat_key_ranges(mode.inner if isinstance(mode, Pad) else mode)
        tensors.append(ModelTensor(f"u{j}", f"u{j}", (dim,), holders,
                                   tuple((f"k{i}", rng, _logical_shape(shapes[i])) for i, rng in zip(unit, ranges))))
        kinds.add("zero3" if len(unit) == 1 else "fsdp1")
    text = f"mesh m ({', '.join(f'{a}={n}' for a, n in axes)}) at {mesh.offset}\ndefault dtype fp32\n" \
        + "\n".join(lines) + "\n"
    return ModelSide(text, mesh, tuple(tensors), valid, "flat " + "+".join(sorted(kinds)) + f" W={w}")


@st.composite
def plain_sides(draw, shapes: tuple[tuple[int, ...], ...], offset_max: int = 8) -> ModelSide:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.sampled_from([1, 2]))
    mesh = MeshSpec("m", (("dp", dp), ("tp", tp)), draw(st.integers(0, offset_max)))
    holders = tuple(range(mesh.offset, mesh.offset + mesh.size))
    lines, tensors, valid = [], [], True
    sloppy = draw(st.integers(0, 4)) == 0  # about one side in five may leave a split indivisible
    for i, shape in enumerate(shapes):
        split = draw(st.integers(-1, len(shape) - 1)) if shape else -1
        how = draw(st.sampled_from(["pad", "even", "ragged", "cyclic"] if sloppy else ["pad", "ragged", "cyclic"]))
        second = draw(st.integers(-1, len(shape) - 1)) if shape else -1  # a second dim over dp
        texts, specs = [], []
        for d, n in enumerate(shape):
            if not isinstance(n, int):  # a structured dim: written as the flat side writes it, whole
                texts.append(_dim_text(n))
                specs.append(Dim(n))
            elif d == second and d != split:
                texts.append(f"{n} pad dp over dp")
                specs.append(Dim(Pad(Plain(n), dp), ("dp",)))
            elif d != split:
                texts.append(str(n))
                specs.append(Dim(Plain(n)))
            elif how == "pad":
                texts.append(f"{n} pad tp over tp")
                specs.append(Dim(Pad(Plain(n), tp), ("tp",)))
            else:
                texts.append(f"{n} over tp" + (f" {how}" if how in ("ragged", "cyclic") else ""))
                specs.append(Dim(Plain(n), ("tp",), ragged=how in ("ragged", "cyclic"), placement=how))
        valid = valid and all(dim_is_valid(x, mesh.sizes) for x in specs)
        lines.append(f"tensor t{i} as k{i} [{', '.join(texts)}]")
        tensors.append(ModelTensor(f"t{i}", f"k{i}", tuple(specs), holders, None))
    text = f"mesh m (dp={dp}, tp={tp}) at {mesh.offset}\ndefault dtype fp32\n" + "\n".join(lines) + "\n"
    return ModelSide(text, mesh, tuple(tensors), valid, f"plain tp={tp}")


@st.composite
def flat_pairs(draw) -> tuple[ModelSide, ModelSide]:
    """(source, destination): flat -> plain, plain -> flat, or flat -> flat (other units, order,
    alignment, world size), on the same keys."""
    shapes = draw(flat_key_shapes())
    kind = draw(st.sampled_from(["flat->plain", "plain->flat", "flat->flat"]))
    src = draw(plain_sides(shapes) if kind == "plain->flat" else flat_sides(shapes))
    dst = draw(plain_sides(shapes) if kind == "flat->plain" else flat_sides(shapes))
    return src, dst
