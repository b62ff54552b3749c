"""The exactly-once proof at its boundaries: a one-element slip is never proven.

layoutlang/compiler/verify.py proves that a destination shard's pieces tile its data exactly
once. A mistake of one element at the edge of a dim (an overlap of the first or the
last element, a hole there, a seam that overlaps or leaves out one element) is the
kind an off-by-one in the proof lets through: each case here is built by hand, at
both ends and at a seam of EVERY dim of a 2-D and a 3-D shard (with padding and a
data run that does not start at local 0 too), and the expected fault is written out
by hand: the faulty region is the whole box except that the dim in question is the
one element that is covered twice, or by nobody.

The same slips are then handed to the compiler as a destination's pieces (the
pieces stage replaced by hand-built pieces) and the plan must refuse them with a
diagnostic at the destination declaration that names the region, local and logical.
"""

from __future__ import annotations

import pytest

from layoutlang import loads
from layoutlang.compiler import PlanError, compile_plan
from layoutlang.compiler import plan as plan_module
from layoutlang.compiler.verify import check_split, check_tiling
from layoutlang.modes import PadRun, Run


def _full(shape):
    return tuple((0, n) for n in shape)


def _with(box, d, interval):
    return box[:d] + (interval,) + box[d + 1:]


def _cases(shape):
    """(name, dim, pieces, expected fault) for every dim of a box of `shape` starting at 0.

    Along dim d (n elements): a seam at k with pieces [0, k+1) and [k, n) overlaps in
    element k; pieces [0, k) and [k+1, n) leave out element k. k = 0 (the first
    element: the first piece is one element, or absent), k = n - 1 (the last), and
    an inner seam. Every other dim is whole."""
    box = _full(shape)
    out = []
    for d, n in enumerate(shape):
        for k, where in ((0, "first"), (n - 1, "last"), (n // 2, "seam")):
            over = [_with(box, d, (0, k + 1)), _with(box, d, (k, n))]
            hole = [p for p in (_with(box, d, (0, k)), _with(box, d, (k + 1, n))) if p[d][0] < p[d][1]]
            out.append((f"overlap-dim{d}-{where}", over, ("overlap", _with(box, d, (k, k + 1)))))
            out.append((f"hole-dim{d}-{where}", hole, ("gap", _with(box, d, (k, k + 1)))))
    return out


def _runs(shape):
    return tuple((Run(0, 0, n),) for n in shape)


SHAPES = [(4, 6), (3, 4, 5)]
CASES = [(shape, *c) for shape in SHAPES for c in _cases(shape)]


@pytest.mark.parametrize("shape,name,rects,fault", CASES,
                         ids=[f"{'x'.join(map(str, s))}-{n}" for s, n, _, _ in CASES])
def test_one_element_overlap_or_hole_at_either_end_of_every_dim_is_found(shape, name, rects, fault):
    got = check_tiling(rects, _runs(shape))
    assert got is not None, f"{name}: proven exactly once"
    assert (got.kind, got.local) == fault
    # the order the pieces come in changes nothing
    got = check_tiling(rects[::-1], _runs(shape))
    assert got is not None and (got.kind, got.local) == fault


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
def test_the_exact_tilings_beside_them_are_proven(shape):
    """Control: the seams with neither overlap nor hole ([0, k) and [k, n)) pass."""
    box = _full(shape)
    for d, n in enumerate(shape):
        for k in (1, n - 1, n // 2):
            assert check_tiling([_with(box, d, (0, k)), _with(box, d, (k, n))], _runs(shape)) is None, (d, k)


def test_the_last_dim_one_element_overlap_is_an_overlap_not_a_pass():
    """The cursor walk of the last dim by hand: [0, 3) then [2, 5) meet at 2 < 3."""
    runs = ((Run(0, 0, 5),),)
    assert check_tiling([((0, 3),), ((3, 5),)], runs) is None
    got = check_tiling([((0, 3),), ((2, 5),)], runs)
    assert (got.kind, got.local) == ("overlap", ((2, 3),))
    got = check_tiling([((0, 1),), ((0, 5),)], runs)          # the first element twice
    assert (got.kind, got.local) == ("overlap", ((0, 1),))
    got = check_tiling([((0, 5),), ((4, 5),)], runs)          # the last element twice
    assert (got.kind, got.local) == ("overlap", ((4, 5),))
    got = check_tiling([((0, 3),), ((2, 3),), ((3, 5),)], runs)  # a one-element piece inside another
    assert (got.kind, got.local) == ("overlap", ((2, 3),))


def test_padded_and_offset_data_runs_have_their_own_first_and_last_element():
    """Dim 0 holds data in local [0, 4) then padding [4, 6); dim 1 holds padding [0, 1) then
    data [1, 4): the first and last DATA elements are where a slip is looked for."""
    runs = ((Run(0, 0, 4), PadRun(4, 2)), (PadRun(0, 1), Run(1, 0, 3)))
    assert check_tiling([((0, 2), (1, 4)), ((2, 4), (1, 4))], runs) is None
    cases = [
        ([((0, 4), (1, 4)), ((3, 4), (1, 4))], ("overlap", ((3, 4), (1, 4)))),   # last data row twice
        ([((0, 3), (1, 4))], ("gap", ((3, 4), (1, 4)))),                          # last data row missing
        ([((0, 4), (1, 4)), ((0, 1), (1, 4))], ("overlap", ((0, 1), (1, 4)))),   # first data row twice
        ([((1, 4), (1, 4))], ("gap", ((0, 1), (1, 4)))),                          # first data row missing
        ([((0, 4), (1, 2)), ((0, 4), (1, 4))], ("overlap", ((0, 4), (1, 2)))),   # first data column twice
        ([((0, 4), (1, 4)), ((0, 4), (3, 4))], ("overlap", ((0, 4), (3, 4)))),   # last data column twice
        ([((0, 4), (2, 4))], ("gap", ((0, 4), (1, 2)))),                          # first data column missing
        ([((0, 4), (1, 3))], ("gap", ((0, 4), (3, 4)))),                          # last data column missing
        ([((0, 5), (1, 4))], ("padding", ((4, 5), (1, 4)))),                      # one row into the padding
        ([((0, 4), (0, 4))], ("padding", ((0, 4), (0, 1)))),                      # one column into the padding
    ]
    for rects, fault in cases:
        got = check_tiling(rects, runs)
        assert got is not None and (got.kind, got.local) == fault, (rects, got)


def test_one_element_into_the_padding_after_the_last_dims_data_is_refused():
    """The last dim holds data [0, 3) then padding [3, 5): a piece one element longer writes padding."""
    runs = ((Run(0, 0, 2),), (Run(0, 0, 3), PadRun(3, 2)))
    assert check_tiling([((0, 2), (0, 3))], runs) is None
    got = check_tiling([((0, 2), (0, 4))], runs)
    assert (got.kind, got.local) == ("padding", ((0, 2), (3, 4)))
    got = check_tiling([((0, 2), (0, 2)), ((0, 2), (2, 4))], runs)
    assert (got.kind, got.local) == ("padding", ((0, 2), (3, 4)))


def test_a_split_piece_with_a_one_element_slip_is_refused():
    """check_split (a piece cut to balance senders): its parts must tile the piece exactly."""
    parent = ((2, 6), (0, 3))
    assert check_split(parent, [((2, 4), (0, 3)), ((4, 6), (0, 3))]) is None
    slips = [
        ([((2, 5), (0, 3)), ((4, 6), (0, 3))], ("overlap", ((4, 5), (0, 3)))),
        ([((2, 3), (0, 3)), ((2, 6), (0, 3))], ("overlap", ((2, 3), (0, 3)))),
        ([((2, 6), (0, 3)), ((5, 6), (0, 3))], ("overlap", ((5, 6), (0, 3)))),
        ([((3, 6), (0, 3))], ("gap", ((2, 3), (0, 3)))),
        ([((2, 5), (0, 3))], ("gap", ((5, 6), (0, 3)))),
        ([((2, 6), (0, 2)), ((2, 6), (1, 3))], ("overlap", ((2, 6), (1, 2)))),
        ([((2, 6), (0, 1)), ((2, 6), (2, 3))], ("gap", ((2, 6), (1, 2)))),
    ]
    for parts, fault in slips:
        got = check_split(parent, parts)
        assert got is not None and (got.kind, got.local) == fault, (parts, got)


# ---- the same slips as a plan's pieces -------------------------------------------------------

SRC = "mesh s (r=1)\ntensor w [8, 3, 5]\n"
DST = "mesh d (tp=2) at 1\ntensor w [8 over tp, 3, 5]\n"
# destination rank 2 (tp=1) holds logical rows 4..8 as its local rows 0..4
PLAN_SHAPE = (4, 3, 5)
PLAN_CASES = [c for c in _cases(PLAN_SHAPE) if not c[0].endswith("seam")]


@pytest.mark.parametrize("name,rects,fault", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_the_plan_refuses_hand_built_pieces_with_a_one_element_slip(monkeypatch, name, rects, fault):
    real = plan_module.pieces

    def hand_built(dst_runs, src_shards):
        found = real(dst_runs, src_shards)
        if dst_runs[0][0].logical_start != 4:  # rank 1's shard keeps its own pieces
            return found
        (whole,) = found  # one source holds the whole tensor: one piece
        assert whole.dst_slice == _full(PLAN_SHAPE)
        return tuple(type(whole)(r, whole.logical, whole.sources) for r in rects)

    monkeypatch.setattr(plan_module, "pieces", hand_built)
    with pytest.raises(PlanError) as info:
        compile_plan(loads(SRC, "src.layout"), loads(DST, "dst.layout"))
    err = info.value
    kind, local = fault
    what = {"overlap": "two sources cover", "gap": "no source covers"}[kind]
    region = ", ".join(f"{a}:{b}" for a, b in local)
    (r0, r1), rest = local[0], local[1:]
    logical = ", ".join([f"{r0 + 4}:{r1 + 4}"] + [f"{a}:{b}" for a, b in rest])
    assert err.message == f"`w` on destination rank 2: {what} local [{region}] (logical [{logical}])"
    assert (err.file, err.line, err.col) == ("dst.layout", 2, 1)
    rendered = err.render().splitlines()
    assert rendered[0] == f"dst.layout:2:1: error: {err.message}"
    assert rendered[1:3] == ["    2 | tensor w [8 over tp, 3, 5]", "      | " + "^" * len("tensor w [8 over tp, 3, 5]")]


def test_the_plan_with_exact_hand_built_pieces_compiles(monkeypatch):
    """Control for the test above: the same hand-built route, an exact tiling, compiles."""
    real = plan_module.pieces

    def split_rows(dst_runs, src_shards):
        (whole,) = real(dst_runs, src_shards)
        box = whole.dst_slice
        return (type(whole)(_with(box, 0, (0, 1)), whole.logical, whole.sources),
                type(whole)(_with(box, 0, (1, box[0][1])), whole.logical, whole.sources))

    monkeypatch.setattr(plan_module, "pieces", split_rows)
    plan = compile_plan(loads(SRC, "src.layout"), loads(DST, "dst.layout"), split=False, relay=False)
    got = sorted((op.dst_rank, op.dst_slice) for op in plan.ops)
    assert got == [(1, ((0, 1), (0, 3), (0, 5))), (1, ((1, 4), (0, 3), (0, 5))),
                   (2, ((0, 1), (0, 3), (0, 5))), (2, ((1, 4), (0, 3), (0, 5)))]
