"""Property tests: random layout PAIRS, planned and executed element by element.

Why: the plan compiler (layoutlang.compiler) intersects runs in logical
coordinates, batches identical tensors into templates and picks senders; an
off-by-one anywhere moves the wrong weights silently. Here random pairs of
small layouts that describe the SAME logical tensors in different storage are
planned, and tests/plan_simulator.py executes every op on materialized local
tensors whose element -> logical-index maps come from the independent
reference enumerator (tests/reference_enumerator.py), never from the front end.

How a pair is made: per logical tensor, one BASE mode per dim is drawn
(layout_strategies.modes: plain, products incl. replication s > N,
concatenations with and without names, pad), then each side gets its own
storage spelling of it by rewrites that keep the hoisted part tree
(LANGUAGE.md 3, "Logical order"):

    (N, (a: A | b: B))  <->  (a: (N, A) | b: (N, B))     distribute / factor
    (N, (M, X))         <->  (N*M, X);  (N, E) <-> N*E   merge / split products
    M pad K             <->  M                           padding is storage only
    a part's name       ->   left out on one side        names compare where both give them

Each side then splits each dim its own way on its own mesh (`over` an axis or
a tuple of axes, `chunk` with or without `align`, `ragged` on either like
torch.chunk (LANGUAGE.md 8.5, some ranks then hold nothing), or not at all;
unused axes are replicas), places the destination mesh on the same ranks (collocated) or
after the source (`at OFFSET`), sometimes declares a key twice (`at a=0` and
`at a=a-1`, like tied embeddings), puts tensors in loops (`over` an axis,
`sizes`, `{l.local}` names), gives the destination other names (`as KEY`),
reorders statements, and leaves some source keys unused.

Properties: (a) the simulator passes; (b) compiling again gives identical ops;
(c) ops_for_rank(r) == filtering plan.ops; (d) stats agree with the ops
(bytes, max send = busiest sender's network bytes, max recv, local bytes);
(e) round_robin and a node-aware balanced selector pass the simulator too;
a layout planned onto itself is all local copies.
Negative: a destination whose dim differs in extent or part tree raises
PlanError at the destination statement with a note in the source file.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import layoutlang
from layout_strategies import PART_NAMES, Style, interleaved, meshes, modes, render_layout
from layoutlang.compiler import PlanError, compile_plan
from plan_simulator import ReferenceView, check_plan_views, check_stats, simulate
from reference_enumerator import (
    Concat,
    Dim,
    LayoutSpec,
    LoopSpec,
    MeshSpec,
    Mode,
    Pad,
    Plain,
    Product,
    TensorSpec,
    dim_is_valid,
    dim_local,
    instances,
    layout_is_valid,
    stored_extent,
)

SRC_PATH, DST_PATH = "src.layout", "dst.layout"
DIM_BUDGET = {1: 40, 2: 20, 3: 10}   # stored extent per dim: keeps op counts small
DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
SETTINGS = settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 150)),  # more: PLAN_EXAMPLES=N
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# Rewrites that keep the hoisted part tree


@st.composite
def rewrite(draw, mode: Mode, depth: int = 0) -> Mode:
    """Another storage spelling of `mode` with the same logical tensor (same hoisted tree)."""
    if draw(st.integers(0, 99)) < 20:
        return mode
    match mode:
        case Plain(e):
            out: Mode = mode
            divisors = [a for a in range(2, e) if e % a == 0]
            if divisors and draw(st.integers(0, 99)) < 30:
                a = draw(st.sampled_from(divisors))
                out = Product(a, Plain(e // a))
        case Product(n, inner):
            inner = draw(rewrite(inner, depth + 1))
            choice = draw(st.sampled_from(["keep", "distribute", "merge", "split"]))
            divisors = [a for a in range(2, n) if n % a == 0]
            if choice == "distribute" and isinstance(inner, Concat):
                out = Concat(tuple((name, Product(n, m)) for name, m in inner.parts))
            elif choice == "merge" and isinstance(inner, Product):
                out = Product(n * inner.count, inner.inner)
            elif choice == "merge" and isinstance(inner, Plain):
                out = Plain(n * inner.extent)
            elif choice == "split" and divisors:
                a = draw(st.sampled_from(divisors))
                out = Product(a, Product(n // a, inner))
            else:
                out = Product(n, inner)
        case Concat(parts):
            parts = tuple((name, draw(rewrite(m, depth + 1))) for name, m in parts)
            out = Concat(parts)
            counts = {m.count if isinstance(m, Product) else None for _, m in parts}
            if len(counts) == 1 and None not in counts and draw(st.booleans()):
                (n,) = counts
                out = Product(n, Concat(tuple((name, m.inner) for name, m in parts)))
        case Pad(inner, k):
            inner = draw(rewrite(inner, depth + 1))
            choice = draw(st.sampled_from(["keep", "drop", "change"]))
            out = inner if choice == "drop" else Pad(inner, draw(st.sampled_from([2, 3, 4, 8]))) \
                if choice == "change" else Pad(inner, k)
        case _:
            raise AssertionError(mode)
    if not isinstance(out, Pad) and draw(st.integers(0, 99)) < 8:
        out = Pad(out, draw(st.sampled_from([2, 3, 4, 8])))
    return out


def drop_names(mode: Mode, keep) -> Mode:
    """The same mode with some part names left out (`keep(name) -> bool`)."""
    match mode:
        case Plain():
            return mode
        case Product(n, inner):
            return Product(n, drop_names(inner, keep))
        case Pad(inner, k):
            return Pad(drop_names(inner, keep), k)
        case Concat(parts):
            # `(x: M)` unnamed would be `(M)`: arithmetic parentheses, not a part
            return Concat(tuple((name if name is not None and (keep(name) or len(parts) == 1) else None,
                                 drop_names(m, keep)) for name, m in parts))
    raise AssertionError(mode)


def has(mode: Mode, pred) -> bool:
    if pred(mode):
        return True
    match mode:
        case Product(_, inner) | Pad(inner, _):
            return has(inner, pred)
        case Concat(parts):
            return any(has(m, pred) for _, m in parts)
    return False


# ---------------------------------------------------------------------------
# Mutations that change the logical tensor (negative tests)


def _nodes(mode: Mode, path=()):
    yield path, mode
    match mode:
        case Product(_, inner) | Pad(inner, _):
            yield from _nodes(inner, path + (0,))
        case Concat(parts):
            for i, (_, m) in enumerate(parts):
                yield from _nodes(m, path + (i,))


def _replace_at(mode: Mode, path, new: Mode) -> Mode:
    if not path:
        return new
    i, rest = path[0], path[1:]
    match mode:
        case Product(n, inner):
            return Product(n, _replace_at(inner, rest, new))
        case Pad(inner, k):
            return Pad(_replace_at(inner, rest, new), k)
        case Concat(parts):
            return Concat(tuple((name, _replace_at(m, rest, new) if j == i else m)
                                for j, (name, m) in enumerate(parts)))
    raise AssertionError(mode)


def _logical(mode: Mode) -> int:
    match mode:
        case Plain(e):
            return e
        case Product(n, inner):
            return n * _logical(inner)
        case Pad(inner, _):
            return _logical(inner)
        case Concat(parts):
            return sum(_logical(m) for _, m in parts)
    raise AssertionError(mode)


def mutations(mode: Mode) -> list[tuple[str, Mode]]:
    """(kind, mutated mode) for every way this module changes a dim's logical tensor."""
    out = []
    for path, node in _nodes(mode):
        match node:
            # (a leaf split into parts, or parts flattened, is no mutation any more: a plain side is
            # read as the other side's parts where that moves no stored row, layoutlang/compiler/refine.py,
            # tests/test_refine_parts.py)
            case Plain(e):
                out.append(("extent", _replace_at(mode, path, Plain(e + 1))))
            case Concat(parts):
                named = [i for i, (name, _) in enumerate(parts) if name is not None]
                if named:
                    i = named[0]
                    used = {name for name, _ in parts}
                    fresh = next(n for n in (*PART_NAMES, "renamed") if n not in used)
                    renamed = tuple((fresh if j == i else name, m) for j, (name, m) in enumerate(parts))
                    out.append(("rename a part", _replace_at(mode, path, Concat(renamed))))
                ext = [_logical(m) for _, m in parts]
                if len(parts) >= 2 and ext[0] >= 2:
                    moved = tuple((name, Plain(e - 1 if j == 0 else e + 1 if j == 1 else e))
                                  for j, ((name, _), e) in enumerate(zip(parts, ext)))
                    out.append(("move a part boundary", _replace_at(mode, path, Concat(moved))))
    return out


# ---------------------------------------------------------------------------
# Pairs


@dataclass(frozen=True)
class Pair:
    src: LayoutSpec
    dst: LayoutSpec
    src_text: str
    dst_text: str
    unused: frozenset[str]           # source keys the destination lacks
    mutated_stems: tuple[str, ...]   # negative pairs: destination statements of the changed key
    mutation: str | None = None
    features: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"Pair(\n--- {SRC_PATH}\n{self.src_text}--- {DST_PATH}\n{self.dst_text})"


def over_options(free: list[str]) -> list[tuple[str, ...]]:
    """`over` nothing, one axis, or a tuple of axes (first one major), plainest first."""
    return [()] + [p for k in (1, 2, 3) for p in itertools.permutations(free, k)]


@st.composite
def split_dim(draw, mode: Mode, mesh: MeshSpec, free: list[str], prefer=None) -> Dim:
    """A valid `over [ragged]` / `chunk [align K | ragged]` for `mode` on `mesh`, using only
    `free` axes. A ragged `over` (LANGUAGE.md 8.5) cuts any extent, so it takes any axes, and
    its `chunk` is ragged too."""
    sizes = mesh.sizes
    ragged = bool(free) and draw(st.integers(0, 99)) >= 80
    if ragged:
        over = draw(st.sampled_from(over_options(free)[1:]))
    else:
        options = [o for o in over_options(free) if dim_is_valid(Dim(mode, o), sizes)]
        if prefer in options and draw(st.integers(0, 99)) < 70:
            over = prefer
        else:
            over = draw(st.sampled_from(options))
    rest = [a for a in free if a not in over]
    if rest and draw(st.integers(0, 99)) < 35:
        axis = draw(st.sampled_from(rest))
        if ragged or draw(st.integers(0, 99)) >= 80:
            return Dim(mode, over, axis, None, ragged, chunk_ragged=True)
        aligns = [k for k in (None, 1, 2, 4, 3) if dim_is_valid(Dim(mode, over, axis, k), sizes)]
        return Dim(mode, over, axis, draw(st.sampled_from(aligns)))
    return Dim(mode, over, ragged=ragged)


@dataclass
class Item:
    """One logical tensor (or a loop of them): its base modes and how each side stores it."""

    index: int
    bases: list[Mode]
    prefer: list[tuple[str, tuple[str, ...]] | None]  # (side, over axes) the base was drawn for
    loop: tuple[int, int] | None                       # (start, length)
    mx: bool                                           # last dim is a plain 32 (mxfp8 allowed)


def _local_extents(dim: Dim, mesh: MeshSpec) -> set[int]:
    """Every local extent the dim has on some rank (one, unless it is ragged)."""
    names = [a for a, _ in mesh.axes]
    return {len(dim_local(dim, mesh.sizes, dict(zip(names, p))))
            for p in itertools.product(*(range(n) for _, n in mesh.axes))}


@st.composite
def statements(draw, item: Item, side: str, mesh: MeshSpec, bases: list[Mode], features: set[str]):
    """The side's statements for one item: a tensor, two sharing its key, or a loop."""
    i, sizes = item.index, mesh.sizes
    out = []
    shared = item.loop is None and draw(st.integers(0, 99)) < 20
    count = 2 if shared else 1
    at_axis = None
    if shared:
        features.add(f"shared key ({side})")
        at_axis = draw(st.sampled_from([None, *sizes]))
    loop_axis, block_sizes = None, None
    if item.loop is not None:
        start, length = item.loop
        axes = [a for a, n in mesh.axes if length % n == 0 or n <= length]
        loop_axis = draw(st.sampled_from([None, *axes]))
        if loop_axis is not None and (length % sizes[loop_axis] or draw(st.integers(0, 99)) < 30):
            n = sizes[loop_axis]
            cuts = sorted(draw(st.permutations(range(1, length)))[: n - 1])
            block_sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, length]))
            features.add("loop sizes")
        features.add(f"loop over ({side})" if loop_axis else f"loop ({side})")
    for j in range(count):
        free = [a for a, _ in mesh.axes if a != loop_axis]
        at: list[tuple[str, int]] = []
        if shared and at_axis is not None and at_axis in free:
            at.append((at_axis, 0 if j == 0 else sizes[at_axis] - 1))
            free.remove(at_axis)
        elif not shared and draw(st.integers(0, 99)) < 20 and free:
            a = draw(st.sampled_from(free))
            at.append((a, draw(st.integers(0, sizes[a] - 1))))
            free.remove(a)
        dims = []
        for d, base in enumerate(bases):
            mode = draw(rewrite(base))
            if stored_extent(mode) > 2 * stored_extent(base) + 8:
                mode = base  # too much padding: keep the sizes small
            wanted = item.prefer[d] if d < len(item.prefer) else None
            prefer = wanted[1] if wanted and wanted[0] == side else None
            if item.mx and d == len(bases) - 1:
                dim = Dim(mode)
            else:
                dim = draw(split_dim(mode, mesh, free, prefer))
            free = [a for a in free if a not in dim.axes()]
            dims.append(dim)
        mx_ok = bool(dims) and all(n % 32 == 0 for n in _local_extents(dims[-1], mesh))  # mxfp8 blocks of 32
        dtype = draw(st.sampled_from([None, None, *DTYPES, *(["mxfp8"] if mx_ok else [])]))
        if item.mx and mx_ok and draw(st.booleans()):
            dtype = "mxfp8"
        if side == "src" and j == 0:
            stem, key_stem = f"t{i}", None
        elif side == "src":
            stem, key_stem = f"t{i}_{j}", f"t{i}"
        elif j == 0 and draw(st.booleans()):
            stem, key_stem = f"t{i}", None
        else:
            stem, key_stem = f"v{i}_{j}", f"t{i}"
        var = None
        if item.loop is not None:
            var = "global" if loop_axis is None else draw(st.sampled_from(["local", "global"]))
        out.append(TensorSpec(stem, tuple(dims), dtype, tuple(at), var, key_stem))
    if item.loop is not None:
        start, length = item.loop
        return [LoopSpec(start, start + length, tuple(out), loop_axis, block_sizes)]
    return out


def _keys(item: Item) -> set[str]:
    if item.loop is None:
        return {f"t{item.index}"}
    start, length = item.loop
    return {f"t{item.index}.{l}" for l in range(start, start + length)}


@st.composite
def mesh_pairs(draw) -> tuple[MeshSpec, MeshSpec, str]:
    src = draw(meshes())
    if draw(st.integers(0, 99)) < 25:
        dst_axes = src.axes  # same mesh shape, split differently
    else:
        dst_axes = draw(meshes()).axes
    placement = draw(st.sampled_from(["collocated", "disjoint"]))
    if placement == "disjoint":
        offset = src.offset + src.size + draw(st.sampled_from([0, 0, 3]))
    else:
        offset = draw(st.sampled_from(sorted({0, src.offset, src.offset + src.size - 1})))
    return src, MeshSpec("m", dst_axes, offset), placement


@st.composite
def pairs(draw, negative: bool = False) -> Pair:
    src_mesh, dst_mesh, placement = draw(mesh_pairs())
    features = {placement}
    items = []
    for i in range(draw(st.integers(1, 3))):
        ndims = draw(st.sampled_from([1, 2, 2, 3, 0]))
        mx = ndims >= 1 and draw(st.integers(0, 99)) < 10
        bases, prefer = [], []
        for d in range(ndims):
            if mx and d == ndims - 1:
                bases.append(Plain(32))
                prefer.append(None)
                continue
            side = draw(st.sampled_from(["src", "dst"]))
            mesh = src_mesh if side == "src" else dst_mesh
            axes = draw(st.permutations([a for a, _ in mesh.axes]))
            k = draw(st.sampled_from([1, 0, 2]))
            s = math.prod(mesh.sizes[a] for a in axes[:k])
            budget = DIM_BUDGET[ndims] if not mx else 8
            if draw(st.integers(0, 99)) < 15:  # interleaved parts: strided pieces against a respelling
                bases.append(draw(interleaved(s, budget)))
            else:
                bases.append(draw(modes(s, budget)))
            prefer.append((side, tuple(axes[:k])))
        loop = None
        if draw(st.integers(0, 99)) < 20:
            loop = (draw(st.sampled_from([0, 1, 2])), draw(st.integers(1, 4)))
        items.append(Item(i, bases, prefer, loop, mx))

    mutated_item, mutation, mut_dim, mut_mode = None, None, None, None
    if negative:
        candidates = [(it.index, d, kind, m) for it in items for d, base in enumerate(it.bases)
                      for kind, m in mutations(base)]
        candidates += [(it.index, None, "one more dim", None) for it in items if not it.mx]
        mutated_item, mut_dim, mutation, mut_mode = draw(st.sampled_from(candidates))
        features.add(mutation)

    src_statements: list = []
    dst_statements: list = []
    unused: set[str] = set()
    mutated_stems: list[str] = []
    for it in items:
        spelled: dict[str, tuple[Mode, ...]] = {}
        naming = {side: draw(st.sampled_from(["all", "none", "some"])) if not negative else "all"
                  for side in ("src", "dst")}
        for side in ("src", "dst"):
            policy = naming[side]
            chosen = {n for n in PART_NAMES if policy == "all" or (policy == "some" and draw(st.booleans()))}
            bases = [drop_names(b, chosen.__contains__) for b in it.bases]
            if side == "dst" and it.index == mutated_item:
                if mut_dim is None:
                    bases = bases + [Plain(2)]
                else:
                    bases[mut_dim] = mut_mode
            if side == "dst" and not negative and draw(st.integers(0, 99)) < 7:
                unused |= _keys(it)  # the destination lacks this tensor
                features.add("unused keys")
                continue
            mesh = src_mesh if side == "src" else dst_mesh
            made = draw(statements(it, side, mesh, bases, features))
            (src_statements if side == "src" else dst_statements).extend(made)
            first = made[0].body[0] if isinstance(made[0], LoopSpec) else made[0]
            spelled[side] = tuple(drop_names(dim.mode, lambda _: False) for dim in first.dims)
            if len(spelled) == 2 and spelled["src"] != spelled["dst"]:
                features.add("respelled (other storage order)")
            if side == "dst" and it.index == mutated_item:
                for stmt in made:
                    body = stmt.body if isinstance(stmt, LoopSpec) else (stmt,)
                    mutated_stems.extend(t.stem for t in body)
    dst_statements = draw(st.permutations(dst_statements))
    src = LayoutSpec(src_mesh, tuple(src_statements), draw(st.sampled_from([None, None, "fp16", "fp32"])))
    dst = LayoutSpec(dst_mesh, tuple(dst_statements), draw(st.sampled_from([None, None, "fp16", "fp32"])))
    for spec, side in ((src, "src"), (dst, "dst")):
        for inst in instances(spec):
            if inst.replica_axes:
                features.add(f"replicas ({side})")
            for dim in inst.spec.dims:
                split = math.prod(spec.mesh.sizes[a] for a in dim.over)
                if isinstance(dim.mode, Concat) and not dim.ragged and _replicated_in_part(dim.mode, split):
                    features.add(f"replicated product in a part ({side})")
                if len(dim.over) > 1:
                    features.add("over tuple")
                if dim.chunk:
                    features.add("chunk ragged" if dim.chunk_ragged else f"chunk align={dim.align is not None}")
                if dim.ragged:
                    features.add(f"over ragged ({side})")
                if (dim.ragged or dim.chunk_ragged) and 0 in _local_extents(dim, spec.mesh):
                    features.add("ragged: a rank holds nothing")
                if has(dim.mode, lambda m: isinstance(m, Product) and isinstance(m.inner, Concat)):
                    features.add("concat in product")
                if has(dim.mode, lambda m: isinstance(m, Pad)):
                    features.add("pad")
                if isinstance(dim.mode, Product) and dim.over and not dim.ragged and \
                        math.prod(spec.mesh.sizes[a] for a in dim.over) > dim.mode.count:
                    features.add("replicated product")
            if inst.dtype == "mxfp8":
                features.add("mxfp8")
    return Pair(src, dst, render_layout(src, Style(draw)), render_layout(dst, Style(draw)),
                frozenset(unused), tuple(mutated_stems), mutation, frozenset(features))


def _replicated_in_part(mode: Mode, s: int) -> bool:
    """A product with fewer copies than the split, reached through concatenation parts."""
    if isinstance(mode, Concat):
        return any(_replicated_in_part(m, s) for _, m in mode.parts)
    return isinstance(mode, Product) and mode.count < s


# ---------------------------------------------------------------------------
# Checks


def load_pair(pair: Pair):
    note(repr(pair))
    for f in sorted(pair.features):
        event(f)
    assert layout_is_valid(pair.src) and layout_is_valid(pair.dst), "generator made an invalid split"
    src = layoutlang.loads(pair.src_text, SRC_PATH)
    dst = layoutlang.loads(pair.dst_text, DST_PATH)
    return src, dst, ReferenceView(src, pair.src), ReferenceView(dst, pair.dst)


def check_metadata(plan, src, dst, unused: frozenset[str]) -> None:
    """plan.tensors lists every destination key once with its shape and dtypes; unused keys."""
    first_src = {}
    for t in src.tensors:
        first_src.setdefault(t.key, t)
    first_dst = {}
    for t in dst.tensors:
        first_dst.setdefault(t.key, t)
    assert [e.key for e in plan.tensors] == list(first_dst)
    for e in plan.tensors:
        assert e.shape == first_dst[e.key].logical_shape
        assert (e.src_dtype, e.dst_dtype) == (first_src[e.key].dtype, first_dst[e.key].dtype)
    assert set(plan.unused_keys) == unused
    assert len(plan.unused_keys) == len(set(plan.unused_keys))


# A failing property shrinks for up to five minutes (hypothesis' limit): let it
# finish and print the minimal pair instead of being killed by the 300 s default.
SHRINK_TIMEOUT = pytest.mark.timeout(900)


@SHRINK_TIMEOUT
@SETTINGS
@given(pairs())
def test_plan_is_exactly_once_and_consistent(pair: Pair):
    """(a) simulator, (b) determinism, (c) ops_for_rank, (d) stats, plan.tensors, unused keys."""
    src, dst, src_view, dst_view = load_pair(pair)
    plan = compile_plan(src, dst)
    if any(len(e) > 2 for op in plan.ops for e in op.src_slice + op.dst_slice):
        event("strided ops")
    report = simulate(src_view, dst_view, plan)
    assert report.dst_data_elements == report.elements, "every data element is received once"
    # (b) the same inputs give the same ops, also from freshly parsed layouts
    again = compile_plan(src, dst)
    assert again.ops == plan.ops
    fresh = compile_plan(layoutlang.loads(pair.src_text, SRC_PATH), layoutlang.loads(pair.dst_text, DST_PATH))
    assert fresh.ops == plan.ops
    # (c), (d)
    check_plan_views(plan, range(max(src.ranks, dst.ranks)))
    check_stats(plan, report)
    check_metadata(plan, src, dst, pair.unused)
    # planned onto itself, a layout moves nothing over the network
    identity = compile_plan(src, src)
    simulate(src_view, src_view, identity)
    assert all(op.src_rank == op.dst_rank for op in identity.ops)


@SHRINK_TIMEOUT
@SETTINGS
@given(pairs(), st.sampled_from([("round_robin", None), ("balanced", 1), ("balanced", 2),
                                 ("balanced", 4), ("round_robin", 4)]))
def test_other_selectors_are_exactly_once(pair: Pair, selector):
    """(e) every selector moves the same elements exactly once; stats still agree with ops."""
    name, rpn = selector
    src, dst, src_view, dst_view = load_pair(pair)
    plan = compile_plan(src, dst, selector=name, ranks_per_node=rpn)
    report = simulate(src_view, dst_view, plan)
    check_plan_views(plan, range(max(src.ranks, dst.ranks)))
    check_stats(plan, report)
    balanced = compile_plan(src, dst)
    # the selector picks senders only: the same receivers, slices and bytes
    strip = lambda ops: [(o.key, o.dst_rank, o.dst_name, o.dst_slice, o.bytes) for o in ops]
    assert strip(plan.ops) == strip(balanced.ops)


def _statement_line(text: str, stems: tuple[str, ...]) -> int:
    lines = [n for n, line in enumerate(text.split("\n"), 1)
             if any(re.match(rf"\s*tensor {re.escape(s)}[\s.\[]", line) for s in stems)]
    assert lines, (stems, text)
    return min(lines)


@SHRINK_TIMEOUT
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pairs(negative=True))
def test_different_logical_tensor_is_a_plan_error(pair: Pair):
    """A destination dim with another extent or part tree: PlanError at the destination, note at the source."""
    src, dst, _, _ = load_pair(pair)
    with pytest.raises(PlanError) as info:
        compile_plan(src, dst)
    err = info.value
    assert isinstance(err, layoutlang.LayoutError)
    note(f"{pair.mutation}: {err}")
    assert err.span is not None and err.span.source.path == DST_PATH
    assert err.span.line == _statement_line(pair.dst_text, pair.mutated_stems), \
        f"error at line {err.span.line}, not at the changed statement"
    assert err.notes and err.notes[0].span is not None
    assert err.notes[0].span.source.path == SRC_PATH


# ---------------------------------------------------------------------------
# Hand-written pairs from the spec


def _plan_texts(src_text: str, dst_text: str, **kw):
    src = layoutlang.loads(src_text, SRC_PATH)
    dst = layoutlang.loads(dst_text, DST_PATH)
    return src, dst, compile_plan(src, dst, **kw)


@pytest.mark.parametrize("src_dim, dst_dim", [
    # Megatron grouped QKV vs vLLM packed QKV: the same logical tensor
    ("(2, (q: (2, 2) | k: 2 | v: 2)) over tp", "(q: (4, 2) | k: (2, 2) | v: (2, 2)) over tp"),
    ("(2, (q: (2, 2) | k: 2 | v: 2)) over tp", "(q: (4, 2) | k: (2, 2) | v: (2, 2))"),
    ("(4, (q: 2 | k: 2)) chunk tp align 4", "(q: (4, 2) | k: (4, 2)) over tp"),
    # strided gate/up on both sides, names left out on one side
    ("(gate: 8 | up: 8) over tp", "(8 | 8) over tp"),
    ("(gate: 8 | up: 8) over tp", "(gate: 8 | up: 8)"),
    # GQA: tp > kv heads, each head stored by two coordinates
    ("(q: (4, 2) | k: (2, 2) | v: (2, 2)) over tp", "(q: (4, 2) | k: (2, 2) | v: (2, 2))"),
    # padding on both sides, different multiples
    ("10 pad 4 over tp", "10 pad 8"),
    ("(4, 5 pad 8) over tp", "20 over tp"),
])
def test_same_logical_tensor_spelled_twice(src_dim, dst_dim):
    from plan_simulator import RunsView

    src_text = f"mesh m (dp=2, tp=4)\ntensor w [{src_dim}, 3]\n"
    for offset in (0, 8):
        dst_text = f"mesh m (tp=2) at {offset}\ntensor w [{dst_dim}, 3] fp8_e4m3\n"
        src, dst, plan = _plan_texts(src_text, dst_text)
        simulate(RunsView(src), RunsView(dst), plan)
        check_stats(plan)


@pytest.mark.parametrize("src_dim, dst_dim, complaint", [
    ("(gate: 8 | up: 8) over tp", "16 over tp", "one side only"),
    ("(gate: 8 | up: 8) over tp", "(gate: 8 | down: 8)", "named"),
    ("(q: 4 | k: 4) over tp", "(q: 6 | k: 2)", "extent"),
    ("12 over tp", "16", "logical shape"),
])
def test_spec_mismatches(src_dim, dst_dim, complaint):
    src_text = f"mesh m (tp=4)\n\ntensor w [{src_dim}, 3]\n"
    dst_text = f"mesh m (tp=2)\n# a comment\ntensor w [{dst_dim}, 3]\n"
    with pytest.raises(PlanError, match=complaint) as info:
        _plan_texts(src_text, dst_text)
    err = info.value
    assert (err.span.source.path, err.span.line) == (DST_PATH, 3)
    assert (err.notes[0].span.source.path, err.notes[0].span.line) == (SRC_PATH, 3)


def test_missing_key_is_a_plan_error():
    with pytest.raises(PlanError, match="not in the source") as info:
        _plan_texts("mesh m (tp=2)\ntensor w [4 over tp]\n", "mesh m (tp=2)\ntensor x [4 over tp]\n")
    assert (info.value.span.source.path, info.value.span.line) == (DST_PATH, 2)
