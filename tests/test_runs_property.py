"""Property tests: the front end's runs agree with the element-by-element reference.

Why: `TensorIR.runs` is what every plan is built from; an off-by-one in the
split arithmetic moves the wrong weights silently. tests/reference_enumerator.py
recomputes, from LANGUAGE.md section 3 alone, which logical element each rank
stores at each local position; here random layouts (tests/layout_strategies.py)
are loaded with `layoutlang.loads` and compared on EVERY rank:

- runs expand to exactly the reference's per-element list (logical index or
  padding), and are maximal (no two neighbours could be merged);
- local_shape_at(rank), logical_shape, holds(rank), name, key, dtype,
  replica axes, mesh and world size match the reference; local_shape is the
  largest local extent of each dim (every rank's, unless a split is ragged);
- ragged splits (LANGUAGE.md 8.5): what each rank stores, empty ranks included;
- a layout with an indivisible split (or an equal `chunk` of a ragged `over`)
  raises LayoutError, and only then.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, event, example, given, note, settings

import layoutlang
from layout_strategies import MAX_STORED, Case, case_of, cases, modes
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
    SplitError,
    TensorSpec,
    dim_local,
    hoist,
    instances,
    layout_is_valid,
    local,
    logical_extent,
    storage,
)

# ---------------------------------------------------------------------------
# Helpers


def expand(runs) -> list[int | None]:
    """Runs of one dim as one entry per local element: logical index or None (padding)."""
    out: list[int | None] = []
    for run in runs:
        assert run.local_start == len(out), f"runs do not tile local storage: {runs}"
        assert run.length > 0, f"empty run in {runs}"
        match run:
            case layoutlang.Run(_, logical_start, length):
                out.extend(range(logical_start, logical_start + length))
            case layoutlang.PadRun(_, length):
                out.extend([None] * length)
            case _:
                raise AssertionError(f"not a Run or PadRun: {run!r}")
    return out


def assert_maximal(runs) -> None:
    """No two neighbouring runs could have been merged into one."""
    for left, right in itertools.pairwise(runs):
        both_pad = isinstance(left, layoutlang.PadRun) and isinstance(right, layoutlang.PadRun)
        mergeable = (
            isinstance(left, layoutlang.Run)
            and isinstance(right, layoutlang.Run)
            and left.logical_start + left.length == right.logical_start
        )
        assert not (both_pad or mergeable), f"runs {left} and {right} should be one run"


def _modes_in(mode: Mode, outer: tuple[type, ...] = ()):
    """(mode, enclosing mode types) for every node of a mode tree."""
    yield mode, outer
    match mode:
        case Product(_, inner) | Pad(inner, _):
            yield from _modes_in(inner, outer + (type(mode),))
        case Concat(parts):
            for _, m in parts:
                yield from _modes_in(m, outer + (Concat,))


def features(spec: LayoutSpec) -> set[str]:
    """Names of the interesting forms a case exercises (reported as hypothesis events)."""
    sizes, out = spec.mesh.sizes, set()
    for st in spec.statements:
        if isinstance(st, LoopSpec):
            out.add("loop over" if st.axis else "loop")
            out |= {"loop sizes"} if st.sizes else set()
        for t in st.body if isinstance(st, LoopSpec) else (st,):
            out |= {"at"} if t.at else set()
            for d in t.dims:
                s = math.prod(sizes[a] for a in d.over)
                out |= {"over tuple"} if len(d.over) > 1 else set()
                out |= {f"chunk align={d.align is not None}"} if d.chunk and not d.chunk_ragged else set()
                out |= _ragged_features(d, sizes)
                for m, outer in _modes_in(d.mode):
                    if isinstance(m, Product) and outer and set(outer) == {Concat} and s > m.count:
                        out.add("replicated product in a part")
                    if isinstance(m, Concat) and Product in outer:
                        out.add("concat in product")
                    if isinstance(m, Pad) and outer:
                        out.add(f"pad inside {outer[-1].__name__}")
                if isinstance(d.mode, Product) and s > d.mode.count:
                    out.add("replicated product")
    return out


def _ragged_features(d: Dim, sizes: dict[str, int]) -> set[str]:
    """What a ragged dim exercises: its form, and whether some coordinate holds nothing."""
    if not (d.ragged or d.chunk_ragged):
        return set()
    out = {f"over ragged ({type(d.mode).__name__})" if d.ragged else "chunk ragged after an equal split"}
    if d.ragged and d.chunk:
        out.add("chunk ragged after over ragged" if d.chunk_ragged else "equal chunk of over ragged")
    try:
        axes = d.axes()
        extents = [len(dim_local(d, sizes, dict(zip(axes, p))))
                   for p in itertools.product(*(range(sizes[a]) for a in axes))]
    except SplitError:
        return out
    out |= {"ragged: some rank holds nothing"} if 0 in extents else set()
    out |= {"ragged: extents differ"} if len(set(extents)) > 1 else set()
    return out


def check_layout(case: Case) -> None:
    """Load the case's text and compare everything observable with the reference."""
    note(case.text)
    spec = case.spec
    valid = layout_is_valid(spec)
    event("valid split" if valid else "indivisible split")
    for name in features(spec):
        event(name)
    if not valid:
        with pytest.raises(layoutlang.LayoutError):
            layoutlang.loads(case.text)
        return
    layout = layoutlang.loads(case.text)
    mesh = spec.mesh

    assert layout.ranks == mesh.offset + mesh.size
    (got_mesh,) = layout.meshes
    assert got_mesh.name == mesh.name
    assert [(ax.name, ax.size) for ax in got_mesh.axes] == list(mesh.axes)
    assert (got_mesh.offset, got_mesh.size) == (mesh.offset, mesh.size)

    expected = instances(spec)
    assert [t.key for t in layout.tensors] == [e.key for e in expected]
    for got, want in zip(layout.tensors, expected, strict=True):
        what = f"tensor {want.key}"
        assert got.name == want.name, what
        assert got.dtype == want.dtype, what
        assert got.mesh.name == mesh.name, what
        assert set(got.replica_axes) == want.replica_axes, what
        assert got.logical_shape == tuple(logical_extent(d.mode) for d in want.spec.dims), what
        holders = {r for r in range(layout.ranks) if got.holds(r)}
        assert holders == set(want.holders), what
        largest = [0] * len(want.spec.dims)
        for rank in sorted(want.holders):
            coords = mesh.coords(rank)
            assert coords is not None
            ref = [dim_local(d, mesh.sizes, coords) for d in want.spec.dims]
            assert got.local_shape_at(rank) == tuple(len(xs) for xs in ref), f"{what}, rank {rank}"
            largest = [max(n, len(xs)) for n, xs in zip(largest, ref)]
            runs = got.runs(rank)
            assert len(runs) == len(ref), f"{what}, rank {rank}"
            for i, (dim_runs, xs) in enumerate(zip(runs, ref)):
                where = f"{what}, rank {rank} {coords}, dim {i}"
                assert expand(dim_runs) == xs, where
                assert_maximal(dim_runs)
        assert got.local_shape == tuple(largest), f"{what}: local_shape is not the largest local extent"


# ---------------------------------------------------------------------------
# Hand-written cases from the spec (also seeds for the random search)

M2 = MeshSpec("m", (("tp", 2),))


def one_tensor(mesh: MeshSpec, *dims: Dim) -> Case:
    return case_of(LayoutSpec(mesh, (TensorSpec("w", dims),)))


# Megatron's grouped QKV with KV=2 groups, Q/KV=2 query heads, head dim 2,
# split over tp=2 and chunked over gtp=2 with align 4 (section 7, scaled down).
QKV = Product(2, Concat((("q", Plain(4)), ("k", Plain(2)), ("v", Plain(2)))))
LLAMA_QKV = one_tensor(
    MeshSpec("m", (("gtp", 2), ("tp", 2))), Dim(QKV, ("tp",), "gtp", 4), Dim(Plain(3))
)
# GQA: tp=4 exceeds KV=2 key/value heads, each head stored by 2 coordinates.
GQA = one_tensor(
    MeshSpec("m", (("tp", 4),)),
    Dim(Concat((("q", Product(4, Plain(2))), ("k", Product(2, Plain(2))), ("v", Product(2, Plain(2))))), ("tp",)),
)
STRIDED = one_tensor(M2, Dim(Concat((("gate", Plain(4)), ("up", Plain(4)))), ("tp",)), Dim(Plain(2)))
PADDED_VOCAB = one_tensor(M2, Dim(Pad(Plain(5), 4), ("tp",)))
TUPLE_OVER = one_tensor(
    MeshSpec("m", (("a", 2), ("b", 3), ("c", 2))),
    Dim(Product(6, Concat((("x", Plain(2)), ("y", Plain(3))))), ("a", "b"), "c", 4),
    Dim(Plain(6)),
)
INDIVISIBLE = one_tensor(MeshSpec("m", (("tp", 4),)), Dim(Product(6, Plain(2)), ("tp",)))
# Ragged (LANGUAGE.md 8.5): FSDP2 over a TP shard; copies and parts cut raggedly; empty ranks.
DP_TP = MeshSpec("m", (("dp", 2), ("tp", 3)))
RAGGED_FSDP2_ON_TP = one_tensor(DP_TP, Dim(Plain(7), ("tp",), "dp", ragged=True, chunk_ragged=True), Dim(Plain(2)))
RAGGED_PARTS = one_tensor(
    MeshSpec("m", (("dp", 2), ("tp", 3), ("cp", 4))),
    Dim(Concat((("a", Plain(3)), ("b", Product(2, Plain(2))))), ("dp", "tp"), ragged=True),
    Dim(Product(3, Pad(Plain(3), 2)), chunk="cp", chunk_ragged=True),
)
RAGGED_EQUAL_CHUNK = one_tensor(DP_TP, Dim(Plain(6), ("tp",), "dp", ragged=True))  # an error
PIPELINE = case_of(
    LayoutSpec(
        MeshSpec("m", (("pp", 2), ("tp", 2)), 4),
        (
            TensorSpec("emb", (Dim(Pad(Plain(5), 4), ("tp",)), Dim(Plain(2))), at=(("pp", 0),)),
            LoopSpec(1, 4, (TensorSpec("layer", (Dim(Plain(4), ("tp",)),), var_in_name="local"),), "pp", (1, 2)),
            TensorSpec("out", (Dim(Plain(4), ("tp",)),), at=(("pp", 1),), key_stem="emb2"),
        ),
        "fp16",
    )
)


def test_reference_on_spec_examples():
    """The reference itself reproduces the spec's sentences on tiny instances."""
    # Megatron grouped QKV stores group by group; logically all q, then k, then v.
    megatron = Product(2, Concat((("q", Product(2, Plain(1))), ("k", Plain(1)), ("v", Plain(1)))))
    assert storage(megatron) == [0, 1, 4, 6, 2, 3, 5, 7]
    # vLLM's spelling of the same tensor is stored in logical order.
    vllm = Concat((("q", Product(4, Plain(1))), ("k", Product(2, Plain(1))), ("v", Product(2, Plain(1)))))
    assert storage(vllm) == list(range(8))
    # (N, (a: A | b: B)) has the logical order of (a: (N, A) | b: (N, B)).
    assert hoist(Product(3, Concat((("a", Plain(2)), ("b", Plain(1)))))) == hoist(
        Concat((("a", Product(3, Plain(2))), ("b", Product(3, Plain(1)))))
    )
    # Strided TP: each rank holds its piece of gate, then of up.
    assert local(Concat((("gate", Plain(4)), ("up", Plain(4)))), 2, 1) == [2, 3, 6, 7]
    # Padding lands on the tail coordinates.
    assert local(Pad(Plain(5), 4), 2, 1) == [4, None, None, None]
    # A plain extent is never replicated; a product is.
    with pytest.raises(SplitError):
        local(Plain(2), 4, 0)
    assert local(Product(2, Plain(3)), 4, 1) == [0, 1, 2]
    # chunk align: 3 local elements, g=2, align 2 -> padded to 4.
    assert [local(Plain(6), 2, 1, 2, gc, 2) for gc in (0, 1)] == [[3, 4], [5, None]]


def test_reference_on_ragged_examples():
    """LANGUAGE.md 8.5 and docs/language.md 14.6, by hand: torch.chunk's blocks, possibly empty."""
    def every(mode, s, **kw):
        return [local(mode, s, c, ragged=True, **kw) for c in range(s)]

    assert every(Plain(5), 2) == [[0, 1, 2], [3, 4]]                 # dim 0 of 5 over 2: 3 and 2
    assert every(Plain(1), 2) == [[0], []]                           # of 1 over 2: 1 and 0
    assert [len(xs) for xs in every(Plain(16), 3)] == [6, 6, 4]      # k_proj's 16 rows over dp=3
    assert [len(xs) for xs in every(Plain(128), 3)] == [43, 43, 42]
    assert every(Plain(5), 4) == [[0, 1], [2, 3], [4], []]
    # a product cuts its copies, never replicates: (3, 4) over 4
    assert every(Product(3, Plain(4)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], []]
    assert every(Product(2, Plain(3)), 4) == [[0, 1, 2], [3, 4, 5], [], []]
    # each part its own ragged split: (a: 3 | b: 5) over 2
    assert every(Concat((("a", Plain(3)), ("b", Plain(5)))), 2) == [[0, 1, 3, 4, 5], [2, 6, 7]]
    # (2, (x: 1 | y: 2)) over 2: copy 0 | copy 1, each in storage order (x, y, y)
    assert every(Product(2, Concat((("x", Plain(1)), ("y", Plain(2))))), 2) == [[0, 2, 3], [1, 4, 5]]
    # chunk ragged cuts the local storage: 7 over tp=3 ragged -> [0 1 2] [3 4 5] [6]; chunk dp=2
    tp_dp = [[local(Plain(7), 3, c, 2, g, ragged=True, chunk_ragged=True) for g in (0, 1)] for c in range(3)]
    assert tp_dp == [[[0, 1], [2]], [[3, 4], [5]], [[6], []]]
    # chunk ragged after an equal split cuts padding like data: [0 1 2 P] over 1, chunk 3 -> [0 1] [2 P]
    assert [local(Pad(Plain(3), 4), 1, 0, 3, g, chunk_ragged=True) for g in range(3)] == [[0, 1], [2, None], []]
    # an equal chunk of a ragged split is an error, even where the extents happen to agree
    with pytest.raises(SplitError):
        dim_local(Dim(Plain(4), ("a",), "b", ragged=True), {"a": 2, "b": 2}, {"a": 0, "b": 0})


@settings(max_examples=200, deadline=None)
@given(modes(1, MAX_STORED))
def test_reference_storage_is_a_permutation(mode):
    """Every logical index is stored exactly once; only padding is extra."""
    xs = storage(mode)
    assert sorted(x for x in xs if x is not None) == list(range(logical_extent(mode)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(LLAMA_QKV)
@example(GQA)
@example(STRIDED)
@example(PADDED_VOCAB)
@example(TUPLE_OVER)
@example(INDIVISIBLE)
@example(RAGGED_FSDP2_ON_TP)
@example(RAGGED_PARTS)
@example(RAGGED_EQUAL_CHUNK)
@given(cases(with_loops=False, max_statements=1))
def test_runs_match_reference(case: Case):
    """One tensor, every dim form, every rank: runs == reference, element by element."""
    check_layout(case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(with_loops=False, max_statements=1, ragged_percent=85))
def test_ragged_runs_match_reference(case: Case):
    """Ragged splits weighted up (LANGUAGE.md 8.5): plain, product, concatenation, tuple axes,
    `chunk ... ragged` after an equal or a ragged `over`, ranks that hold nothing."""
    check_layout(case)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(PIPELINE)
@given(cases(with_loops=True, max_statements=3))
def test_layout_matches_reference(case: Case):
    """Loops (`over`, `sizes`), `at` placement, `as`, dtypes: holds, names, keys, shapes, runs."""
    check_layout(case)
