"""The split stage: requests that overload the busiest senders, cut into parts and selected again.

After selection, whole pieces can leave the busiest sender far above the floor (all
bytes / usable senders) when usable senders outnumber the pieces. `split_stage` cuts
the requests that overload it along their outer destination dim, per template (every
member alike), and runs the selector again (layoutlang/compiler/select.py holds the policy:
`Balanced.parts`, SPLIT_*). Each part is proven to tile its piece (verify.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from layoutlang.vocabulary import DTYPE

from . import strides
from .flat import is_flat
from .pieces import Piece, split_piece
from .ranks import RankSet
from .records import Box, Geometry, Template
from .select import SPLIT_GAIN, SPLIT_GRAIN, SPLIT_ROUNDS, SPLIT_TRIGGER, select_senders
from .verify import check_split


def split_stage(plan, *, floor: float | None = None, cuttable=None, select=None) -> None:
    """Cut the requests that overload the busiest senders into parts along their outer dim.

    When usable senders outnumber the pieces, each piece goes whole to one
    sender and the busiest one sits far above the floor (all bytes / usable
    senders: Llama-3-8B from 4096 trainer ranks to a TP2 x DP8 engine, 4.2x).
    After selection, every network request picked from a sender above
    SPLIT_TRIGGER x the floor is cut, per template (every member alike), into
    the parts `Balanced.parts` says (about floor / SPLIT_GRAIN bytes each, at
    most its candidates, none below SPLIT_MIN_BYTES, none when no candidate
    has room) along its first destination dim of extent > 1, so each part is
    one slice on the receiver as the piece was, cuts on the destination
    dtype's scale blocks; then senders are selected again. Rounds repeat while
    new requests qualify (SPLIT_ROUNDS at most); the lowest busiest sender
    wins, a split plan only if it beats the whole one by 1 % (SPLIT_GAIN), so
    plans that splitting cannot improve (balanced already, too few replicas)
    stay exactly as they were. Every choice is a function of the two layouts:
    the same on every rank. Only the balanced selector splits (round_robin is
    kept as Megatron-LM's rule).

    A caller that knows them may pass `floor` (what `_send_floor` gives) and
    `cuttable` (per template, the indices of the requests that could be cut at
    all, in any order: two or more candidate senders and at least two
    SPLIT_MIN_BYTES; `Balanced.parts` keeps every other one whole), so that the
    first round looks at those only (layoutlang/compiler/members.py); the plan is the same.
    `select(plan, templates)` -> (picks, selector): a selector of the same picks as select.py's
    `select_senders` (layoutlang/compiler/tables.py's), used for the rounds.
    """
    if not plan.split or plan.selector_name != "balanced" or not plan.templates:
        return
    base = plan.templates
    floor = _send_floor(base) if floor is None else floor
    line = SPLIT_TRIGGER * floor
    if not floor or max(plan.send_load) <= line:
        return
    grain = floor / SPLIT_GRAIN
    known: dict[int, tuple[int, ...]] = {}

    def quanta(i: int) -> tuple[int, ...]:  # computed for the templates a cut is tried on only
        q = known.get(i)
        if q is None:
            q = known[i] = _split_quanta(plan, base[i])
        return q

    marks: list[dict[int, int]] = [{} for _ in range(len(base))]  # per template: request index -> parts
    # per template, the request of `base` each current request is (None: a part of a split one;
    # a range while the template is whole)
    origin: Sequence[range | tuple[int | None, ...]] = _Whole(base)
    templates, (picks, selector) = base, plan.selection
    best = (max(selector.load), templates, picks, selector.load, origin)
    for _ in range(SPLIT_ROUNDS):
        fresh = _mark(base, picks, selector, origin, marks, quanta, line, grain,
                      cuttable if templates is base else None)
        if not fresh:
            break
        # (every round cuts from `base`: the previous rounds' cuts, and the new ones)
        cut, cut_origin = ({}, {}) if templates is base else (dict(templates.cut), dict(origin.cut))
        for i in fresh:
            g, cut_origin[i] = split_geometry(base[i].geometry, marks[i], quanta(i))
            cut[i] = Template(g, base[i].members)
        templates, origin = Cut(base, cut), Cut(_Whole(base), cut_origin)
        picks, selector = (select or select_senders)(plan, templates)
        busiest = max(selector.load)
        if busiest < best[0] * SPLIT_GAIN:
            best = (busiest, templates, picks, selector.load, origin)
        if busiest <= line:
            break
    if best[1] is base:
        return
    _, templates, picks, load, origin = best
    plan.record_picks(picks, load)
    # (every consumer indexes them: a tuple, not a Cut over the base; each instance keeps its template)
    plan.record_templates(tuple(templates))
    plan.splits = sum(len(t.members) * (len(t.geometry.requests) - sum(k is not None for k in origin[i]))
                      for i, t in enumerate(base))


class Cut(Sequence):
    """`base` with the entries `cut` names replaced: a round's templates (and their origins)
    without reading, or copying, the templates it left whole (a planner's templates may be
    made when read: layoutlang/compiler/tables.py)."""

    __slots__ = ("base", "cut")

    def __init__(self, base: Sequence, cut: dict[int, object]):
        self.base, self.cut = base, cut

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self.base)
        hit = self.cut.get(i)
        return self.base[i] if hit is None else hit


class _Whole(Sequence):
    """`origin` while every template is whole: request j is request j (made per template read;
    a list of them is built only once a round cuts something)."""

    def __init__(self, base):
        self._base = base

    def __len__(self) -> int:
        return len(self._base)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return range(len(self._base[i].geometry.request_ranks))


def _send_floor(templates: tuple[Template, ...]) -> float:
    """All bytes over every rank that could send (Plan.stats' floor), before any choice."""
    total = 0
    sets: dict[int, RankSet] = {}
    for t in templates:
        n = len(t.members)
        for req in t.geometry.requests:
            total += req.bytes * n
            sets.setdefault(id(req.senders), req.senders)
    usable = len({r for rs in sets.values() for r in rs})
    return total / usable if usable else 0.0


def _mark(base, picks, selector, origin, marks, quanta, line: float, grain: float, rows=None) -> list[int]:
    """Add to `marks` every whole request of `base` picked (for any member) from a sender above
    `line` that `selector.parts` cuts and that its outer dim can cut; the templates marked anew.
    `quanta(i)`: template i's cut quanta; `rows`: per template the request indices to look at
    (None: every one)."""
    over = {r for r, sent in enumerate(selector.load) if sent > line}
    fresh = []
    for i in range(len(base)) if rows is None else [i for i, r in enumerate(rows) if r]:
        t = base[i]
        g, new = t.geometry, False
        row = picks[i]
        for j in range(len(row)) if rows is None else rows[i]:
            got = row[j]
            if over.isdisjoint(got):
                continue
            k = origin[i][j]
            if k is None or k in marks[i]:
                continue
            req = g.requests[k]
            parts = selector.parts(req.rank, req.senders, req.bytes, line, grain)
            if parts > 1 and _cuts(g, g.pieces[req.piece], parts, quanta(i)):
                marks[i][k] = parts
                new = True
        if new:
            fresh.append(i)
    return fresh


def _split_quanta(plan, t: Template) -> tuple[int, ...]:
    """Per destination storage dim, the multiple a cut must sit on: the scale block along that
    dim of every member's destination dtype (LANGUAGE.md 4.1; 1 for plain dtypes), so that a
    part never shares a scale block with another."""
    ndim = len(t.geometry.pieces[0].dst_slice) if t.geometry.pieces else 0
    out = [1] * ndim
    for dtype in {plan.key_matches[i].dst.dtype for i in t.members}:
        for grid in DTYPE[dtype].scales:
            for back, b in enumerate(reversed(grid.block), 1):
                if back <= ndim:
                    out[ndim - back] = math.lcm(out[ndim - back], b)
    return tuple(out)


def _outer(g: Geometry, p: Piece) -> int | None:
    """The piece's first destination dim of extent > 1 (its outer dim in the receiver's storage)
    that is contiguous on every side (destination, logical, every source): a strided dim
    (layoutlang/compiler/strides.py) is never cut, the next dim is; a logical chain is (strides.cuttable)."""
    if is_flat(g.dst_box) or any(is_flat(b) for b in g.src_boxes):
        return None  # a flat side's slice is one entry of its 1-d storage, not the key's dims: kept whole
    kd = _key_dims(g.dst_box, len(p.dst_slice))
    for d, e in enumerate(p.dst_slice):
        if len(e) > 2 or e[1] - e[0] <= 1:
            continue
        q = kd.index(d)
        if not strides.cuttable(p.logical[q]) or any(
                len(s.src_slice[_key_dims(g.src_boxes[s.instance] if g.src_boxes else None,
                                          len(s.src_slice))[q]]) > 2 for s in p.sources):
            continue
        return d
    return None


def _cuts(g: Geometry, p: Piece, parts: int, quanta: tuple[int, ...]) -> tuple[int, ...]:
    """Where to cut p along its outer dim into about `parts` even parts: local destination
    positions strictly inside it, each a multiple of the dim's quantum."""
    d = _outer(g, p)
    if d is None or parts < 2:
        return ()
    a, b = p.dst_slice[d]
    q = quanta[d]
    cuts = sorted({c - c % q for c in (a + (b - a) * i // parts for i in range(1, parts))})
    return tuple(c for c in cuts if a < c < b)


def _key_dims(box: Box, ndim: int) -> list[int]:
    """Storage dims in the key's dim order: stacked dims left out, reversed when transposed."""
    if box is None:
        return list(range(ndim))
    stacked, transposed = box[1], box[2]
    dims = [d for d in range(ndim) if d not in stacked]
    return dims[::-1] if transposed else dims


def split_geometry(g: Geometry, marks: dict[int, int],
                   quanta: tuple[int, ...]) -> tuple[Geometry, tuple[int | None, ...]]:
    """g with request k (for k in marks) cut into about marks[k] parts along its outer dim.

    Parts are appended to the pieces (one set per split piece and count, shared by
    every request that splits it alike), each proven to tile its piece; a split
    request becomes one request per part, in place. Returns the geometry and, per
    new request, the index of the request it was in g (None for a part).
    """
    pieces_, alternatives = list(g.pieces), list(g.alternatives)
    made: dict[tuple[int, int], range] = {}
    requests, origin = [], []
    for k, req in enumerate(g.requests):
        if k not in marks:
            requests.append(req)
            origin.append(k)
            continue
        key = (req.piece, marks[k])
        if key not in made:
            piece = g.pieces[req.piece]
            d = _outer(g, piece)
            q = _key_dims(g.dst_box, len(piece.dst_slice)).index(d)
            src_dims = tuple(_key_dims(g.src_boxes[i] if g.src_boxes else None, len(src.dims))[q]
                             for i, src in enumerate(g.src))
            parts = split_piece(piece, _cuts(g, piece, marks[k], quanta), d, q, src_dims)
            fault = check_split(piece.dst_slice, [p.dst_slice for p in parts])
            if fault is not None:
                raise AssertionError(f"split of {piece.dst_slice}: {fault}")
            made[key] = range(len(pieces_), len(pieces_) + len(parts))
            pieces_.extend(parts)
            holders = [h for _, h in g.alternatives[req.piece]]  # in the order of piece.sources
            alternatives.extend(tuple(zip(p.sources, holders)) for p in parts)
        for n in made[key]:
            requests.append(g.request(req.rank, n, pieces_[n], req.senders))
            origin.append(None)
    return (dataclasses.replace(g, pieces=tuple(pieces_), requests=tuple(requests), alternatives=tuple(alternatives),
                                tiling=len(g.pieces)), tuple(origin))
