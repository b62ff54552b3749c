"""Pieces that continue in both storages are one piece (issue 29, layoutlang/compiler/pieces.py).

Why: after hoisting (LANGUAGE.md 3) HF's `(NH, (re: D/2 | im: D/2))` rows put every re
half before every im half, so a head's rows jump in logical order while they stay
contiguous in storage on both sides. A piece is a pair of storage slices, so those
segments are one piece (its logical side a `strides.Chain`), as the plain `[NH*D, H]`
rows were. What must hold, against cases written out by hand (never the code under test):

- HF halves against HF halves: one piece per source shard, the logical side the chain of
  halves in storage order;
- Meta's interleaved pairs against HF's halves keep their strided pieces (a span of two
  rows at a head boundary never breaks them up);
- `merge` joins pieces that continue in the destination and in every alternative, and
  nothing else;
- a chain is cut anywhere (`strides.sub`, `split_piece`), each part naming its own rows;
- every element of every piece maps to the element the runs say (an element-wise check).
"""

from __future__ import annotations

import itertools

from layoutlang.compiler import strides
from layoutlang.compiler.pieces import Piece, Segment, Source, groups, merge, pieces, spans, split_piece
from layoutlang.compiler.shards import Shard
from layoutlang.compiler.verify import check_tiling
from layoutlang.modes import Run

NH, D = 2, 4  # two heads of four rows: halves of two rows


def hf_rows(heads: int = NH, first: int = 0) -> tuple[Run, ...]:
    """HF's rows of heads [first, first + heads): local h*D + j*D/2 + i holds logical
    j*NH*D/2 + h*D/2 + i (all re halves, then all im halves), written out by hand."""
    return tuple(Run((h - first) * D + j * (D // 2), j * NH * D // 2 + h * D // 2, D // 2)
                 for h in range(first, first + heads) for j in range(2))


def meta_rows() -> tuple[Run, ...]:
    """Meta's interleaved rows: local h*D + 2i + j holds logical j*NH*D/2 + h*D/2 + i."""
    return tuple(Run(h * D + 2 * i + j, j * NH * D // 2 + h * D // 2 + i, 1)
                 for h in range(NH) for i in range(D // 2) for j in range(2))


COLS = (Run(0, 0, 3),)


def check_elements(found, dst_runs, src_shards) -> None:
    """Every element of every piece: destination, logical and each source position agree with
    the runs (local -> logical maps built here from the runs, element by element)."""
    def logical_of(runs):
        return {r.local_start + k: r.logical_start + k for r in runs for k in range(r.length)}

    dst_maps = [logical_of(r) for r in dst_runs]
    for p in found:
        dst = [[x for lo, hi in strides.blocks(e) for x in range(lo, hi)] for e in p.dst_slice]
        log = [[x for lo, hi in strides.blocks(e) for x in range(lo, hi)] for e in p.logical]
        assert [len(a) for a in dst] == [len(b) for b in log]
        for d, (a, b) in enumerate(zip(dst, log)):
            assert [dst_maps[d][x] for x in a] == b, (p, d)
        for s in p.sources:
            src_maps = [logical_of(r) for r in src_shards[s.instance][s.shard].runs]
            src = [[x for lo, hi in strides.blocks(e) for x in range(lo, hi)] for e in s.src_slice]
            for d, (a, b) in enumerate(zip(src, log)):
                assert [src_maps[d][x] for x in a] == b, (p, s, d)


def test_chains_by_hand():
    c = strides.chain([(0, 2), (4, 6), (2, 4), (6, 8)])
    assert c == strides.Chain(((0, 2), (4, 6), (2, 4), (6, 8)))
    assert strides.chain([(0, 2), (2, 4)]) == (0, 4)  # blocks that continue are one entry
    assert strides.extent(c) == 8 and strides.hull(c) == (0, 8)
    assert strides.blocks(c) == [(0, 2), (4, 6), (2, 4), (6, 8)]
    assert strides.sub(c, 1, 5) == strides.Chain(((1, 2), (4, 6), (2, 3)))
    assert strides.sub(c, 2, 4) == (4, 6)
    assert strides.shift(c, 10) == strides.Chain(((10, 12), (14, 16), (12, 14), (16, 18)))
    assert strides.then((0, 2), (2, 4)) == (0, 4) and strides.then((0, 2), (4, 6)) == strides.Chain(((0, 2), (4, 6)))
    assert strides.cuttable(c) and strides.cuttable((0, 4)) and not strides.cuttable((0, 7, 2))
    assert strides.text(c) == "0:2+4:6+2:4+6:8"


def test_spans_follow_both_storages():
    segs = [Segment(0, 0, 0, 2), Segment(2, 2, 4, 2), Segment(4, 6, 2, 2), Segment(6, 8, 6, 2)]
    assert spans(segs) == [tuple(segs[:2]), tuple(segs[2:])]  # the source jumps at 4 -> 6


def test_hf_halves_against_hf_halves_are_one_piece():
    """Whole q rows on both sides: one piece [0:8, 0:3], rows in storage order on both ends."""
    dst = (hf_rows(), COLS)
    src = [[Shard((hf_rows(), COLS), (0,))]]
    found = pieces(dst, src)
    assert [p.dst_slice for p in found] == [((0, 8), (0, 3))]
    assert found[0].sources == (Source(0, 0, ((0, 8), (0, 3))),)
    assert found[0].logical == (strides.Chain(((0, 2), (4, 6), (2, 4), (6, 8))), (0, 3))
    check_elements(found, dst, src)
    assert check_tiling([p.dst_slice for p in found], dst) is None


def test_hf_halves_from_two_shards_one_piece_each():
    """The destination whole, the source a head per shard (TP2): one piece per shard."""
    dst = (hf_rows(), COLS)
    src = [[Shard((hf_rows(1, 0), COLS), (0,)), Shard((hf_rows(1, 1), COLS), (1,))]]
    found = pieces(dst, src)
    assert [(p.dst_slice, p.sources[0].shard, p.sources[0].src_slice) for p in found] == [
        (((0, 4), (0, 3)), 0, ((0, 4), (0, 3))), (((4, 8), (0, 3)), 1, ((0, 4), (0, 3)))]
    assert [p.logical[0] for p in found] == [strides.Chain(((0, 2), (4, 6))), strides.Chain(((2, 4), (6, 8)))]
    check_elements(found, dst, src)


def test_meta_pairs_against_hf_halves_stay_strided():
    """Meta row 4h + 2i + j is HF row 4h + 2j + i: re rows {0, 1, 4, 5} come from Meta rows
    {0, 2, 4, 6}, im rows {2, 3, 6, 7} from {1, 3, 5, 7}: two strided pieces. HF row 3 / Meta row 3
    and HF row 4 / Meta row 4 meet in both storages, a span of two rows that must not win."""
    dst = (hf_rows(), COLS)
    src = [[Shard((meta_rows(), COLS), (0,))]]
    found = pieces(dst, src)
    # (canonical entries: stop is the last block's start + 1)
    assert [(p.dst_slice[0], p.sources[0].src_slice[0]) for p in found] == [((0, 5, 4, 2), (0, 7, 2)),
                                                                          ((2, 7, 4, 2), (1, 8, 2))]
    check_elements(found, dst, src)
    # and the other way round
    back = pieces((meta_rows(), COLS), [[Shard((hf_rows(), COLS), (0,))]])
    assert [(p.dst_slice[0], p.sources[0].src_slice[0]) for p in back] == [((0, 7, 2), (0, 5, 4, 2)),
                                                                         ((1, 8, 2), (2, 7, 4, 2))]


def test_groups_pick_the_fewest():
    """Four segments continuing in both storages: one span, where strides find two groups."""
    segs = [Segment(r.local_start, r.local_start, r.logical_start, r.length) for r in hf_rows()]
    (g,) = groups(segs)
    assert (g.dst, g.src, g.logical) == ((0, 8), (0, 8), strides.Chain(((0, 2), (4, 6), (2, 4), (6, 8))))
    assert g.members == tuple(segs)


def _piece(dst, logical, *sources):
    return Piece(dst, logical, tuple(Source(i, k, sl) for i, k, sl in sources))


def test_merge_joins_what_continues_on_every_side_only():
    a = _piece(((0, 2), (0, 3)), ((0, 2), (0, 3)), (0, 0, ((0, 2), (0, 3))), (1, 0, ((4, 6), (0, 3))))
    b = _piece(((2, 4), (0, 3)), ((8, 10), (0, 3)), (0, 0, ((2, 4), (0, 3))), (1, 0, ((6, 8), (0, 3))))
    (m,) = merge([b, a])
    assert m == _piece(((0, 4), (0, 3)), (strides.Chain(((0, 2), (8, 10))), (0, 3)),
                       (0, 0, ((0, 4), (0, 3))), (1, 0, ((4, 8), (0, 3))))
    # the alternative does not continue: both stay
    c = _piece(((2, 4), (0, 3)), ((8, 10), (0, 3)), (0, 0, ((2, 4), (0, 3))), (1, 0, ((10, 12), (0, 3))))
    assert sorted(merge([a, c]), key=lambda p: p.dst_slice) == [a, c]
    # another alternative set: both stay
    d = _piece(((2, 4), (0, 3)), ((8, 10), (0, 3)), (0, 0, ((2, 4), (0, 3))))
    assert len(merge([a, d])) == 2
    # unequal along the other dim: both stay
    e = _piece(((2, 4), (0, 2)), ((8, 10), (0, 2)), (0, 0, ((2, 4), (0, 2))), (1, 0, ((6, 8), (0, 2))))
    assert len(merge([a, e])) == 2
    # a strided destination never joins
    f = _piece(((2, 7, 4, 1), (0, 3)), ((8, 10), (0, 3)), (0, 0, ((2, 4), (0, 3))), (1, 0, ((6, 8), (0, 3))))
    assert len(merge([a, f])) == 2


def test_merge_in_two_dims():
    """Four quarters of a 4 x 4 block, each from the same shard at the same offsets: one piece."""
    quarters = [_piece(((r, r + 2), (c, c + 2)), ((r, r + 2), (c, c + 2)), (0, 0, ((r + 1, r + 3), (c, c + 2))))
                for r, c in itertools.product((0, 2), (0, 2))]
    assert merge(quarters[::-1]) == [_piece(((0, 4), (0, 4)), ((0, 4), (0, 4)), (0, 0, ((1, 5), (0, 4))))]


def test_a_chain_piece_is_cut_anywhere():
    p = _piece(((0, 8), (0, 3)), (strides.Chain(((0, 2), (4, 6), (2, 4), (6, 8))), (0, 3)),
               (0, 0, ((8, 16), (0, 3))))
    parts = split_piece(p, (3, 6), 0, 0, (0,))
    assert [(q.dst_slice[0], q.logical[0], q.sources[0].src_slice[0]) for q in parts] == [
        ((0, 3), strides.Chain(((0, 2), (4, 5))), (8, 11)),
        ((3, 6), strides.Chain(((5, 6), (2, 4))), (11, 14)),
        ((6, 8), (6, 8), (14, 16))]


def test_replicated_kv_heads_merge_after_the_overlap_is_cut():
    """Two source shards both hold head 0 (KV heads replicated when TP exceeds them), one holds
    head 1: the first shard's piece is whole and the head the second adds is one piece."""
    dst = (hf_rows(), COLS)
    src = [[Shard((hf_rows(1, 0), COLS), (0,)), Shard((hf_rows(), COLS), (1,))]]
    found = pieces(dst, src)
    assert [(p.dst_slice, p.sources[0].shard) for p in found] == [(((0, 4), (0, 3)), 0), (((4, 8), (0, 3)), 1)]
    assert found[0].sources[1] == Source(0, 1, ((0, 4), (0, 3)))  # the other shard holds it too
    check_elements(found, dst, src)
    assert check_tiling([p.dst_slice for p in found], dst) is None
