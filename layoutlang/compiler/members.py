"""Engine replicas as one destination layout: one replica's layout, repeated.

A refit between jobs (layoutlang/runtime/jobs.py) feeds K engine replicas that each run
the same `.layout` (its ranks 0..R-1). The plan needs them as one destination
side whose ranks follow the trainer's N ranks. `replicate` builds that side
from the one-replica IR without re-elaborating anything: every mesh gets one
more axis, `replica`, appended LAST, and is moved to start at rank N.

Why last: a tensor's `over`, `chunk` and `at` name mesh axes by index, so an
axis appended after the others leaves every dim (`DimIR`) and every `fixed`
coordinate valid as it is; the dims stay the very objects of the replica's
layout, which is what lets identical placements share one template. Nothing
splits over `replica`, so every replica holds every tensor in full, as its
own ranks hold it.

Notation: replica i (0..K-1, in membership order), its local rank t (0..R-1)::

    engine_rank(i, t) = N + t * K + i        (row-major, `replica` fastest)

Preserves: each replica's local tensors, names, keys, shapes and dtypes are the
one-replica layout's; rank t of every replica holds what rank t of the
one-replica layout holds.

>>> from layoutlang import loads
>>> one = loads("mesh e (tp=2)\\ntensor w [8 over tp, 4]")
>>> both = replicate(one, 3, 4)
>>> [both.tensors[0].holds(r) for r in range(4, 10)], both.ranks
([True, True, True, True, True, True], 10)
>>> engine_rank(4, 3, 2, 1), [both.tensors[0].runs(r)[0][0].logical_start for r in (4, 7)]
(9, [0, 4])

`MemberPlanner` plans the trainer into K replicas for any K, the same plan as
`compile_plan(src, replicate(one, K, N), relay=False)`, computing once what K
does not change (see its docstring): a new membership costs its layout, its rank sets and
its sender picks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass

from layoutlang.gcpause import gc_paused
from layoutlang.ir import Axis, Layout, Mesh

from .refine import pair
from .plan import Plan, PlanCache, check_options, group_templates, load_pair, select_stage
from .ranks import RankSet
from .records import Geometry, Request, Template
from .relay import relay_stage
from .select import SELECTORS, Balanced
from .split import split_stage
from .shards import Placement

REPLICA_AXIS = "replica"


def engine_rank(first: int, copies: int, replica: int, local: int) -> int:
    """The plan rank of `replica`'s local rank `local` (K = `copies` replicas after `first` ranks)."""
    return first + local * copies + replica


def replicate(one: Layout, copies: int, first: int) -> Layout:
    """`copies` replicas of `one` as one layout whose ranks start at `first`."""
    return _replicas(one, _tensor_fields(one), copies, first)


def digest_suffix(copies: int, first: int) -> str:
    """What `replicate` adds to a layout's digest before hashing it again (rekey.py's `placed`
    writes the same digest for a re-keyed replica)."""
    return f"/replicas={copies}/first={first}"


def _replicated_mesh(m: Mesh, copies: int, first: int) -> Mesh:
    if m.axis_index(REPLICA_AXIS) is not None:
        raise ValueError(f"mesh `{m.name}` already has an axis `{REPLICA_AXIS}`: rename it in the engine's layout")
    return Mesh(m.name, m.axes + (Axis(REPLICA_AXIS, copies),), first + m.offset * copies, m.span)


# Frozen records made without __init__: an instance of the dataclass `cls` holding `fields` (every
# field: another instance's values, some changed) is `o = _new(cls); _set(o, "__dict__", fields)`.
# `dataclasses.replace` costs ~4 us an object, this ~0.4 us, and a membership plan makes ~45,000
# (DeepSeek-V3 at 9 replicas of an EP8 engine: 30k tensors, 14k distinct requests): replace
# alone would take longer than the whole re-plan may. Written out in the loops below (a call per
# object would cost as much again); only for classes without __post_init__ or __slots__. The
# `fields` copied are `_shared_keys` tables: a copy then holds values only.
_new, _set = object.__new__, object.__setattr__


def _shared_keys(cls: type, fields: dict) -> dict:
    """`fields` as the dict of a `cls` instance whose attributes were set one by one, as __init__
    sets them: in CPython a table that shares its keys with the class's instances, so that its
    copies (`dict.copy`) are half the bytes of a plain dict's and quicker to make (and to scan
    for the garbage collector). Elsewhere, or for a class whose instances set other keys, a
    plain dict with the same items."""
    obj = _new(cls)
    for name, value in fields.items():
        _set(obj, name, value)
    return obj.__dict__


def _fields(obj, names: dict[type, tuple[str, ...]]) -> dict:
    """obj's dataclass fields (not what its cached properties added) as a dict."""
    ns = names.get(type(obj))
    if ns is None:
        ns = names[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    d = obj.__dict__
    return {n: d[n] for n in ns}


def _tensor_fields(one: Layout) -> tuple[tuple[type, dict, str], ...]:
    """Per tensor of `one`, its class, fields and mesh name: what every replicated layout copies."""
    names: dict[type, tuple[str, ...]] = {}
    return tuple((type(t), _shared_keys(type(t), _fields(t, names)), t.mesh.name) for t in one.tensors)


def _replicas(one: Layout, tensor_fields, copies: int, first: int) -> Layout:
    """`replicate(one, copies, first)` from `one`'s tensor fields (`_tensor_fields`)."""
    if copies < 1:
        raise ValueError(f"replicate: {copies} copies; a destination needs at least one replica")
    meshes = {m.name: _replicated_mesh(m, copies, first) for m in one.meshes}
    new, setd = _new, _set
    tensors = []
    for cls, proto, mesh in tensor_fields:  # TensorIR has no __post_init__: `dataclasses.replace(t, mesh=...)`
        fields = proto.copy()
        fields["mesh"] = meshes[mesh]
        t = new(cls)
        setd(t, "__dict__", fields)
        tensors.append(t)
    digest = hashlib.sha256(f"{one.digest}{digest_suffix(copies, first)}".encode()).hexdigest()
    return Layout(one.path, one.name, tuple(meshes.values()), tuple(tensors), one.args, digest, one.sources)


# ---- planning any membership ---------------------------------------------------------
#
# Notation: a one-replica template's requests are in canonical order, by destination rank:
# block b is rank ranks[b]'s requests starts[b] .. starts[b+1] (length L). With K replicas each
# block repeats K times in place, once per replica (a rank's replicas are consecutive ranks), so
# one-replica request a + o of block b is, for replica r, request a*K + r*L + o.

Parts = tuple[tuple[int, int, tuple[int, ...]], ...]  # (a, L, offsets in the block) per block


@dataclass(frozen=True)
class _Shape:
    """One template as K does not change it: the geometry's other fields, its blocks (as an
    index into the planner's distinct block sequences) and its destination ranks' local shapes
    (one replica)."""

    geometry: dict                 # the Geometry's fields (`_shared_keys`); K replaces dst, requests, dst_local
    dst: int                       # index into the planner's distinct destination placements
    sequence: int                  # its blocks: an index into the planner's distinct block sequences
    starts: tuple[int, ...]        # block b's first one-replica request; the count last
    dst_local: int                 # index into the planner's distinct local shapes

    def parts(self, js) -> Parts:
        """(a, L, offsets in the block) of the blocks that hold these one-replica requests."""
        out = []
        for b, a in enumerate(self.starts[:-1]):
            stop = self.starts[b + 1]
            offs = tuple(j - a for j in js if a <= j < stop)
            if offs:
                out.append((a, stop - a, offs))
        return tuple(out)


@dataclass(frozen=True)
class _Shared:
    """What the templates' K-replica forms share, one replica's worth (equal values are one
    object in a plan, as immutable records may be): distinct destination placements (mesh
    name, dims, fixed), distinct requests (their one-replica rank and fields), distinct blocks
    (a rank's requests, as indices into `requests`), distinct sequences of blocks (a template's
    requests: templates with equal ones share one tuple) and distinct destination local shapes."""

    placements: tuple[tuple[str, tuple, tuple[tuple[int, int], ...]], ...]
    requests: tuple[tuple[int, dict], ...]
    blocks: tuple[tuple[int, ...], ...]
    sequences: tuple[tuple[int, ...], ...]
    dst_local: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]


def _positions(parts: Parts, copies: int) -> list[int]:
    """The K-replica request indices of `_Shape.parts`, in canonical order (rank, replica, piece)."""
    return [a * copies + r * n + o for a, n, offs in parts for r in range(copies) for o in offs]


@dataclass(frozen=True)
class _Batch:
    """A template's requests of one size whose candidates are one set, disjoint from the other
    sets of that template and size: picked in one call (`receiver`: a one-replica rank of theirs)."""

    template: int
    bytes: int
    senders: RankSet
    parts: Parts
    receiver: int


@dataclass(frozen=True)
class _OneByOne:
    """A template's requests of one size whose candidate sets overlap: picked one at a time."""

    template: int
    bytes: int
    parts: Parts


@dataclass(frozen=True)
class _Step:
    """One step of the selection order: first the load (per replica, rank -> bytes) that the
    one-candidate requests since the previous step add, whatever the loads; then `pick`."""

    before: tuple[tuple[int, int], ...]
    pick: _Batch | _OneByOne | None


class MemberPlanner:
    """Plans of a trainer into K replicas of one engine layout, for any K, sharing their geometry.

    `plan(K)` is exactly `compile_plan(src, replicate(one, K, first), relay=False, **kwargs)`:
    the same ops in the same order with the same ids, the same digest, the same model
    (templates, picks, statistics). What K changes is only who receives: replica r's rank t is
    `engine_rank(first, K, r, t)` and holds what rank t of `one` holds. So the planner keeps, for
    its lifetime, what does not depend on K, computed once against ONE replica: the matches
    (and their diagnostics), the templates with their pieces, proofs, alternatives and candidate
    senders, and the order in which senders are chosen. Each `plan(K)` then builds the K-replica
    layout, widens every template's requests to the K replicas' ranks and picks the senders:
    the greedy of `select_stage` in the same order, except that the same-size requests of one
    template whose candidate sets are pairwise equal or disjoint are picked in one batch per
    set (the same senders: picks on disjoint sets do not touch each other's loads, and the
    greedy picks n + m requests as it picks n then m), and one-candidate requests only add
    their load. Then `split_stage`, as compile_plan runs it.

    The matches themselves are not rebuilt: a match differs between K only in its `dst`, the
    K-replica tensor. The plan reads them as one replica's (`Plan.key_matches`: keys, sources,
    regions, names, dtypes) with each instance's tensor in the K-replica layout (`Plan.stored`),
    and so does everything the runtime reads of it (ops, steps, buckets, statistics); the
    K-replica `plan.matches`, compile_plan's, is built from the two the first time it is read.

    The batches need every receiver's candidates to be a piece's whole sender set: the
    balanced selector, no engine rank among the trainer's (no local copy) and, with
    `ranks_per_node`, none on a node that holds a trainer rank. Otherwise `plan(K)` picks
    with `select_stage` itself (the geometry is still shared).

    `first`: the first engine rank (default `src.ranks`: after the trainer). `compile_kwargs`
    as compile_plan takes them (args, src_args, dst_args, ranks_per_node, selector, split,
    wire, progress); relays are off (the replicas are separate jobs).

    >>> from layoutlang import loads
    >>> src = loads("mesh t (tp=2)\\ntensor w [8 over tp, 4]")
    >>> one = loads("mesh e (tp=1)\\ntensor w [8, 4]")
    >>> planner = MemberPlanner(src, one)
    >>> [(op.src_rank, op.dst_rank, op.dst_slice) for op in planner.plan(2).ops]
    [(0, 2, ((0, 4), (0, 4))), (1, 2, ((4, 8), (0, 4))), (0, 3, ((0, 4), (0, 4))), (1, 3, ((4, 8), (0, 4)))]
    """

    def __init__(self, src, one, *, first: int | None = None, **compile_kwargs):
        from layoutlang.diagnostics import UsageError

        if compile_kwargs.pop("relay", False):
            raise UsageError("MemberPlanner: relay=True: engine replicas are separate jobs, their plans never relay",
                             help="leave `relay` out (it is always off here)")
        loads = {k: compile_kwargs.pop(k) for k in ("args", "src_args", "dst_args") if k in compile_kwargs}
        self._options = dict(ranks_per_node=None, selector="balanced", split=True, wire="auto", progress=None)
        unknown = set(compile_kwargs) - set(self._options)
        if unknown:
            raise UsageError(f"MemberPlanner: unknown option(s) {', '.join(sorted(unknown))}",
                             help=f"compile_plan's options: {', '.join(sorted(self._options))}, args, src_args, dst_args")
        self._options.update(compile_kwargs)
        opts = self._options
        check_options(selector=opts["selector"], wire=opts["wire"], ranks_per_node=opts["ranks_per_node"])
        self.src, self.one = load_pair(src, one, progress=opts["progress"], **loads)
        self.first = self.src.ranks if first is None else first
        with gc_paused():
            self._build()

    def _build(self) -> None:
        """Everything K does not change, against one replica (`replicate(one, 1, first)`)."""
        self._tensors = _tensor_fields(self.one)
        base = _replicas(self.one, self._tensors, 1, self.first)
        self.src, base, matches, self._unused = pair(self.src, base)  # refined where one side is plain
        templates, instance = group_templates(matches, PlanCache(), self._options["wire"], self._options["progress"])
        self._templates, self._instance = templates, tuple(instance)
        # the matches as K does not change them (what the plan's consumers read, `Plan.key_matches`),
        # and per match the position of its stored tensor in the layout
        self._matches = tuple(matches)
        position = {id(t): k for k, t in enumerate(base.tensors)}
        self._positions = tuple(position[id(m.dst)] for m in matches)
        self._shapes, self._shared = _shapes(templates)
        offsets, acc = [], 0
        for ti, _ in instance:
            offsets.append(acc)
            acc += len(templates[ti].geometry.requests)
        self._offsets = tuple(offsets) + (acc,)
        # the send floor's parts (split.py `_send_floor`): all bytes of one replica, every rank that can send
        self._bytes = sum(q.bytes * len(t.members) for t in templates for q in t.geometry.requests)
        self._usable = len({r for rs in {id(q.senders): q.senders for t in templates
                                         for q in t.geometry.requests}.values() for r in rs})
        self._cuttable = tuple(sh.parts([j for j, q in enumerate(t.geometry.requests)
                                         if Balanced.cuttable(q.senders, q.bytes)])
                               for t, sh in zip(templates, self._shapes))
        self._steps = self._fill = None
        if self._batched():
            self._steps, self._fill = self._pick_order()

    def _batched(self) -> bool:
        """Whether every receiver's candidates are a piece's whole sender set, whatever K (the
        class docstring)."""
        rpn = self._options["ranks_per_node"]
        return (SELECTORS[self._options["selector"]] is Balanced and self.first >= self.src.ranks
                and (rpn is None or self.first // rpn * rpn >= self.src.ranks))

    def _pick_order(self):
        """(select_stage's order as `_Step`s, per template and block the one-replica picks of its
        one-candidate requests (None: picked in a step)). select_stage takes requests largest
        first, then by template, then by request; a template's requests of one size are
        consecutive there, and are batched by candidate set when the sets are disjoint."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(self._templates):
            for j, q in enumerate(t.geometry.requests):
                groups.setdefault((-q.bytes, i), []).append(j)
        fill = [[None] * len(t.geometry.requests) for t in self._templates]
        steps, before = [], {}
        for (neg, i), js in sorted(groups.items()):
            nbytes, n = -neg, len(self._templates[i].members)
            reqs, shape = self._templates[i].geometry.requests, self._shapes[i]
            sets: dict[RankSet, list[int]] = {}
            for j in js:
                sets.setdefault(reqs[j].senders, []).append(j)
            if sum(map(len, sets)) != len(set().union(*(s.ranks for s in sets))):  # sets that overlap
                steps.append(_Step(tuple(before.items()), _OneByOne(i, nbytes, shape.parts(js))))
                before = {}
                continue
            for s, group in sets.items():
                if len(s) == 1:  # Balanced.pick's one candidate: its pick whatever the loads
                    before[s[0]] = before.get(s[0], 0) + n * len(group) * nbytes
                    for j in group:
                        fill[i][j] = (s[0],) * n
                else:
                    steps.append(_Step(tuple(before.items()),
                                       _Batch(i, nbytes, s, shape.parts(group), reqs[group[0]].rank)))
                    before = {}
        steps.append(_Step(tuple(before.items()), None))
        by_block = tuple(tuple(tuple(row[a:b]) for a, b in zip(sh.starts, sh.starts[1:]))
                         for row, sh in zip(fill, self._shapes))
        return tuple(steps), by_block

    # ---- one membership ---------------------------------------------------------------
    def plan(self, copies: int) -> Plan:
        """The plan into `copies` replicas (compile_plan's, computed from what this planner keeps)."""
        opts = self._options
        with gc_paused():
            dst = _replicas(self.one, self._tensors, copies, self.first)
            stages = (("match", self._match_stage),
                      ("templates", lambda p: self._template_stage(p, copies)),
                      ("senders", lambda p: self._select_stage(p, copies)),
                      ("split", lambda p: self._split_stage(p, copies)),
                      ("relay", relay_stage))
            return Plan(self.src, dst, ranks_per_node=opts["ranks_per_node"], selector=opts["selector"],
                        split=opts["split"], wire=opts["wire"], relay=False, progress=opts["progress"],
                        pipeline=stages)

    def _match_stage(self, plan: Plan) -> None:
        """One replica's matches (their keys, sources and regions are every K's) and where each
        instance's stored tensor is: `plan.matches` itself is built only if someone reads it."""
        plan.key_matches, plan.unused_keys = self._matches, list(self._unused)
        plan.record_stored(list(map(plan.dst.tensors.__getitem__, self._positions)))

    def _template_stage(self, plan: Plan, copies: int) -> None:
        first, new, setd, cls = self.first, _new, _set, Request
        shared = self._shared
        made = []  # per distinct request, its K replicas' requests
        for rank, proto in shared.requests:
            at = first + (rank - first) * copies
            row = []
            for r in range(at, at + copies):
                fields = proto.copy()
                fields["rank"] = r
                q = new(cls)
                setd(q, "__dict__", fields)
                row.append(q)
            made.append(row)
        # per distinct block, its requests for every replica in turn (replica r's ranks are consecutive):
        # replica r's are the r-th of each of its requests' rows
        chain = itertools.chain.from_iterable
        blocks = [tuple(made[block[0]]) if len(block) == 1 else tuple(chain(zip(*[made[k] for k in block])))
                  for block in shared.blocks]
        sequences = [blocks[seq[0]] if len(seq) == 1 else tuple(chain([blocks[b] for b in seq]))
                     for seq in shared.sequences]
        dst_local = [tuple((first + (rank - first) * copies + r, local) for rank, local in proto for r in range(copies))
                     for proto in shared.dst_local]
        meshes = {m.name: m for m in plan.dst.meshes}
        placements = [Placement(meshes[mesh], dims, fixed) for mesh, dims, fixed in shared.placements]
        out = []
        for t, shape in zip(self._templates, self._shapes):
            fields = shape.geometry.copy()
            fields["dst"] = placements[shape.dst]
            fields["requests"] = sequences[shape.sequence]
            fields["dst_local"] = dst_local[shape.dst_local]
            g = new(Geometry)
            setd(g, "__dict__", fields)
            template = new(Template)
            setd(template, "__dict__", {"geometry": g, "members": t.members})
            out.append(template)
        plan.record_templates(tuple(out), self._instance, list(map(copies.__mul__, self._offsets)))

    def _select_stage(self, plan: Plan, copies: int) -> None:
        if self._steps is None:
            select_stage(plan)
            return
        selector = SELECTORS[plan.selector_name](plan.world, plan.ranks_per_node)
        templates, first, load = plan.templates, self.first, selector.load
        picks = []
        for blocks in self._fill:
            row: list = []
            for values in blocks:
                row += values * copies
            picks.append(row)
        for step in self._steps:
            for r, nbytes in step.before:
                load[r] += nbytes * copies
            pick = step.pick
            if pick is None:
                continue
            n, row = len(templates[pick.template].members), picks[pick.template]
            at = _positions(pick.parts, copies)
            if isinstance(pick, _OneByOne):
                reqs = templates[pick.template].geometry.requests
                for j in at:
                    row[j] = tuple(selector.pick(reqs[j].rank, reqs[j].senders, n, pick.bytes, j))
                continue
            receiver = first + (pick.receiver - first) * copies
            got = tuple(selector.pick(receiver, pick.senders, n * len(at), pick.bytes, at[0]))
            for k, j in enumerate(at):
                row[j] = got[k * n:(k + 1) * n]
        plan.record_picks(picks, selector.load, selector)

    def _split_stage(self, plan: Plan, copies: int) -> None:
        total = self._bytes * copies  # ints: the very floor `_send_floor` sums
        floor = total / self._usable if self._usable else 0.0
        split_stage(plan, floor=floor, cuttable=[_positions(parts, copies) for parts in self._cuttable])


def _shapes(templates: tuple[Template, ...]) -> tuple[tuple[_Shape, ...], _Shared]:
    """Every template's `_Shape`, and what they share (`_Shared`)."""
    names: dict[type, tuple[str, ...]] = {}
    requests: dict[tuple, int] = {}
    request_fields: list[tuple[int, dict]] = []
    blocks: dict[tuple[int, ...], int] = {}
    sequences: dict[tuple[int, ...], int] = {}
    locals_: dict[tuple, int] = {}
    placements: dict[tuple, int] = {}
    out = []
    for t in templates:
        g = t.geometry
        fields = _shared_keys(Geometry, _fields(g, names))
        rows: list[list[int]] = []
        starts = []
        for j, q in enumerate(g.requests):
            if not rows or q.rank != g.requests[j - 1].rank:
                rows.append([])
                starts.append(j)
            key = (q.rank, q.piece, q.bytes, id(q.senders), q.wire)  # the senders: one shared set per piece
            k = requests.get(key)
            if k is None:
                k = requests[key] = len(request_fields)
                request_fields.append((q.rank, _shared_keys(Request, _fields(q, names))))
            rows[-1].append(k)
        starts.append(len(g.requests))
        ids = tuple(blocks.setdefault(tuple(row), len(blocks)) for row in rows)
        local = locals_.setdefault(g.dst_local, len(locals_))
        dst = placements.setdefault((g.dst.mesh.name, g.dst.dims, g.dst.fixed), len(placements))
        out.append(_Shape(fields, dst, sequences.setdefault(ids, len(sequences)), tuple(starts), local))
    return tuple(out), _Shared(tuple(placements), tuple(request_fields), tuple(blocks), tuple(sequences),
                               tuple(locals_))
