"""Plans of one pair for any value of a table arg of the destination: an EPLB map re-planned.

vLLM's EPLB keeps `E + R` physical experts placed by a physical -> logical map
that it rebalances every `step_interval` steps; the engine's layout reads the
map as a table arg (docs/language.md 14.8). Every new map needs a new plan,
and a fresh `compile_plan` costs what the first one did: each physical slot
pairs with an arbitrary expert, so nearly every slot is its own template
(DeepSeek-V3 into 288 slots x 58 layers: 47.5k templates of 51k instances,
each built, proven and selected from scratch).

`TablePlanner(src, dst, table).plan(value)` is exactly `compile_plan(src,
load(dst, {table: value}))` (the same ops, ids, digest, templates, picks and
statistics), computed from what the planner keeps between maps:

- the layout is re-keyed, not elaborated (layoutlang/elaborate/rekey.py);
- matches: per key its source instances and regions, found once; the stored
  tensors the map does not touch keep their matches;
- templates: the signature of `group_templates`, assembled from interned parts
  (per destination region, per source key), so a slot costs a few lookups. A new
  signature's geometry is the geometry of the same destination region fed by
  another expert, its source ranks translated: experts on one mesh whose shards
  cut alike and whose ranks differ by one offset (checked per source placement,
  once) have equal pieces, proofs and local slices; only their holders and
  candidate senders move. Anything else is built by `build_geometry`;
- senders: `select_stage`'s greedy in its order, except that a request with one
  candidate (an expert shard no replica holds: every routed expert of a trainer
  without expert DP) only adds its load at its place in that order (Balanced.pick
  returns it whatever the loads, as layoutlang/compiler/members.py's batches do);
- split: `split_stage` with the floor and the cuttable requests computed here.

A value whose lengths differ from the first one's, a key rule it breaks, or a
layout that reads the table outside key interpolations is planned by a fresh
load and compile_plan (its diagnostics are compile_plan's).

>>> from layoutlang import loads
>>> src = loads("mesh t (ep=2)\\nfor e in 0..2 over ep {\\n  tensor x.{e} [4]\\n}")
>>> text = "arg M = [[0, 1]]\\nmesh v (ep=2)\\ntensor s as x.{M[0][p]} [p in 0..2 over ep, 4]"
>>> planner = TablePlanner(src, text, "M", dst_path="v.layout")
>>> [(op.key, op.src_rank, op.dst_rank) for op in planner.plan([[1, 0]]).ops]
[('x.1', 1, 0), ('x.0', 0, 1)]
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

from layoutlang.elaborate.rekey import watch
from layoutlang.elaborate.sources import Source, read_source
from layoutlang.elaborate import loads
from layoutlang.gcpause import gc_paused
from layoutlang.ir import ELEMENT_BYTES, QUANTIZED
from layoutlang.modes import cached_property

from .members import digest_suffix, replicate
from .match import Match, check_same_key, missing_key_error, region_signature
from .plan import Plan, PlanCache, as_layout, build_geometry, check_options, compile_plan
from .ranks import RankSet
from .records import Geometry, Request, Template, region_box
from .relay import relay_stage
from .select import Balanced, select_senders
from .shards import placement_of
from .split import Cut, split_stage
from .wire import wire_dtype

_new, _set = object.__new__, object.__setattr__
# a planner keeps the geometries it built for this many signatures at most (then starts afresh):
# a map pairs slots with experts anew, so old signatures come back only by chance
KEEP_GEOMETRIES = 200_000


class _SrcKey:
    """What one source key gives every destination instance of it: its source instances and
    regions (match.py), its part of the template signature (`sig`), the part without the
    sources' placement coordinates (`cls`: instances whose `cls` are equal differ only in where
    the sources sit) and the sources' rank offset against the first placement of their kind
    (None: not a translation of it)."""

    __slots__ = ("sources", "regions", "placements", "sig", "cls", "sig_n", "cls_n", "offset", "check")


class TablePlanner:
    """Plans of `src` into `dst` for any value of the table arg `table` (see the module docstring).

    `dst`: a `.layout` path, or layout text with `dst_path` naming it. `compile_kwargs` as
    compile_plan takes them (args, src_args, dst_args, ranks_per_node, selector, split, wire,
    relay, progress); the table's first value is the layout's own or the one in `args` /
    `dst_args`. `rekeyable` says whether new values take the fast path (`reason`: why not).
    `replica_at=N`: `dst` is one engine replica of a job (layoutlang/runtime/jobs.py) whose ranks follow
    the trainer's N: `plan(value)` is then `MemberPlanner(src, load(dst, {table: value}),
    first=N).plan(1)`, i.e. compile_plan into `replicate(..., 1, N)` (relay off).
    """

    def __init__(self, src, dst, table: str, *, dst_path: str | None = None, replica_at: int | None = None,
                 **compile_kwargs):
        from layoutlang.diagnostics import UsageError

        args = compile_kwargs.pop("args", None) or {}
        src_args = {**args, **(compile_kwargs.pop("src_args", None) or {})}
        dst_args = {**args, **(compile_kwargs.pop("dst_args", None) or {})}
        self._options = dict(ranks_per_node=None, selector="balanced", split=True, wire="auto", relay=True,
                             progress=None)
        unknown = set(compile_kwargs) - set(self._options)
        if unknown:
            raise UsageError(f"TablePlanner: unknown option(s) {', '.join(sorted(unknown))}",
                             help=f"compile_plan's options: {', '.join(sorted(self._options))}, args, src_args, dst_args")
        self._options.update(compile_kwargs)
        opts = self._options
        check_options(selector=opts["selector"], wire=opts["wire"], ranks_per_node=opts["ranks_per_node"])
        self.src = as_layout(src, src_args)
        source = Source(dst_path, dst) if dst_path is not None else read_source(os.fspath(dst))
        self._source, self._dst_args, self.table = source, dst_args, table
        self.first, self._keys = watch(source, dst_args, table, unknown_args="ignore")
        self.replica_at = replica_at
        if replica_at is not None:  # one engine replica of a job, its ranks after the trainer's
            if opts["relay"]:
                raise UsageError("TablePlanner: replica_at with relay=True: an engine replica is a separate job, "
                                 "its plans never relay", help="pass relay=False")
            self.first = replicate(self.first, 1, replica_at)
            self._keys = self._keys.placed(self.first, digest_suffix(1, replica_at))
        self.reason = self._keys.reason
        self._cache = PlanCache()
        self._compared: set = set()
        self._checked: set = set()         # (dst kind, src kind) ids check_same_key passed
        self._src_keys: dict[str, _SrcKey] = {}
        self._interned: dict = {}          # signature parts, one object per value
        self._numbers: dict = {}           # id of an interned part -> its number (`_number`)
        self._parts_by_number: list = []
        self._dst_parts: dict = {}         # (id of a stored tensor's dims, its fixed, region box...) -> part
        self._geometries: dict = {}        # signature ids -> Geometry
        self._bases: dict = {}             # class number -> (Geometry, its sources' offset, its request
        #                                    ranks, its request count, its select rows)
        self._reference: dict = {}         # (id mesh, id dims) -> (the shards of the first placement seen, it)
        self._offsets: dict = {}           # a source placement -> its rank offset (None: not a translation)
        self._shifted: dict = {}           # (id of a RankSet, offset) -> the translated RankSet
        self._kept: dict = {}              # id of a stored tensor -> (it, its matches, their signature parts)
        self._parts: tuple = ((), ())      # per instance of the plan being made: its signature parts
        self._rows_of: dict = {}           # id of a base -> its select rows (`_rows`)
        self._prefixes: dict = {}          # (is_part, -bytes) -> one object per value
        self._floor: tuple = (0.0, [])
        self._shapes: tuple = ((), [], [])  # (the templates made last, per template its rows and offset,
        #                                     its members)

    @property
    def rekeyable(self) -> bool:
        return self.reason is None

    # ---- one value -------------------------------------------------------------------------
    def plan(self, value=None) -> Plan:
        """The plan for `table = value` (None: the first value), compile_plan's."""
        opts = self._options
        with gc_paused():
            dst = self.first if value is None else self._keys.rekey(value)
            if dst is None:  # not re-keyable for this value: a fresh load (and its diagnostics)
                fresh = loads(self._source.text, self._source.path, {**self._dst_args, self.table: value},
                              unknown_args="ignore")
                if self.replica_at is not None:
                    fresh = replicate(fresh, 1, self.replica_at)
                return compile_plan(self.src, fresh, **opts)
            stages = (("match", self._match_stage), ("templates", self._template_stage),
                      ("senders", self._select_stage), ("split", self._split_stage), ("relay", relay_stage))
            return Plan(self.src, dst, pipeline=stages, **opts)

    # ---- match --------------------------------------------------------------------------------
    def _src_key(self, key: str, t, region) -> _SrcKey:
        hit = self._src_keys.get(key)
        if hit is not None:
            return hit
        items = self.src.key_index.get(key)
        if items is None:
            raise missing_key_error(key, t, region, self.src, self.src.key_index)
        sources, regions = zip(*items)
        if regions[0] is None and regions.count(None) == len(regions):  # v1 sources
            regions = ()
        hit = _SrcKey()
        hit.sources, hit.regions = sources, regions
        hit.placements = tuple(placement_of(s) for s in sources)
        boxes = tuple(region_box(r, s) for r, s in zip(regions, sources))
        intern = self._interned
        sig = (tuple((id(s.mesh), id(s.dims), s.fixed) for s in sources), boxes)
        cls = (tuple((id(s.mesh), id(s.dims)) for s in sources), boxes)
        hit.sig = intern.setdefault(sig, sig)
        hit.cls = intern.setdefault(cls, cls)
        hit.sig_n, hit.cls_n = self._number(hit.sig), self._number(hit.cls)
        hit.check = self._number(self._intern((id(sources[0].dims), region_signature(regions[0] if regions else None))))
        offsets = {self._offset(placement_of(s)) for s in sources}
        hit.offset = offsets.pop() if len(offsets) == 1 else None
        self._src_keys[key] = hit
        return hit

    def _match_stage(self, plan: Plan) -> None:
        """match.py's matches, made when read (`_Matches`): per key its sources found once, per
        instance its source key noted; a stored tensor the value does not touch keeps what it
        had (it is the very object of the earlier layouts). Per instance it also notes the two
        parts of its template signature (`_parts`) for the template stage."""
        dparts: list = []
        sparts: list[_SrcKey] = []
        starts: list[int] = []
        used: set[str] = set()
        kept = {}
        tensors = plan.dst.tensors
        for pos, t in enumerate(tensors):
            hit = self._kept.get(id(t))
            if hit is None or hit[0] is not t:
                hit = self._matched(pos, t, used)
            kept[id(t)] = hit
            starts.append(len(sparts))
            dparts += hit[1]
            sparts += hit[2]
        for hit in kept.values():
            used.update(hit[3])
        self._kept, self._parts = kept, (dparts, sparts)
        plan.matches = _Matches(tensors, starts, sparts)
        plan.record_stored(plan.matches.stored)
        plan.unused_keys = [k for k in self.src.key_index if k not in used]

    def _matched(self, pos: int, t, used: set[str]) -> tuple:
        """(t, per instance its destination and source signature parts, its keys); match.py's
        checks of each new pair of key kinds."""
        dps = self._dst_parts.get(pos)
        if dps is None or dps[0] is not t.dims:  # per region of the tensor at `pos`: its parts
            regions = t.regions or (None,)
            parts = [self._dst_part(t, r) for r in regions]
            dps = self._dst_parts[pos] = (t.dims, [self._number(dp) << 32 for dp in parts],
                                          [self._number(self._intern((id(t.dims), region_signature(r)))) << 32
                                           for r in regions])
        src_keys, checked = self._src_keys, self._checked
        regions = (None,) if t.regions is None else t.regions
        keys = [t.key] if t.regions is None else [r.key for r in regions]
        sks = []
        for region, key, check in zip(regions, keys, dps[2]):
            sk = src_keys.get(key) or self._src_key(key, t, region)
            sks.append(sk)
            pair = check | sk.check  # what check_same_key compares: once per pair of kinds
            if pair not in checked:
                check_same_key(Match(t, sk.sources, region, sk.regions), self._compared)
                checked.add(pair)
        return t, dps[1], sks, keys

    def _intern(self, value):
        return self._interned.setdefault(value, value)

    def _number(self, part) -> int:
        """A small number per interned signature part (interned parts live as long as the planner):
        a template signature is then `dst number << 32 | src number`, an int."""
        n = self._numbers.get(id(part))
        if n is None:
            n = self._numbers[id(part)] = len(self._parts_by_number)
            self._parts_by_number.append(part)
        return n

    # ---- templates ----------------------------------------------------------------------------
    def _dst_part(self, t, r):
        box = (r.box, r.stacked, r.transposed) if r is not None else None
        wire = ELEMENT_BYTES[wire_dtype(t.dtype)]
        part = (id(t.mesh), id(t.dims), t.fixed, box, wire, t.dtype if t.dtype in QUANTIZED else None)
        return self._interned.setdefault(part, part)

    def _template_stage(self, plan: Plan) -> None:
        """group_templates' templates: signatures from interned parts, new geometries moved."""
        by_sig: dict[int, int] = {}
        counts: list[int] = []
        members: list[tuple[int, ...]] = []
        specs: list = []  # per template its geometry, or (base, delta, src placements, request ranks): moved
        instance: list[tuple[int, int]] = []
        known, bases = self._geometries, self._bases
        if len(known) > KEEP_GEOMETRIES:
            known.clear()
            self._rows_of.clear()
        matches = plan.matches
        rows_of = self._rows
        shapes: list[tuple] = []  # per template (its select rows, the rank offset of its sources)
        offsets, acc = [], 0
        for i, (dn, sk) in enumerate(zip(*self._parts)):
            offsets.append(acc)
            sig = dn | sk.sig_n
            ti = by_sig.get(sig)
            if ti is not None:  # (another member: rare, so a tuple grown by one)
                ms = members[ti]
                instance.append((ti, len(ms)))
                members[ti] = ms + (i,)
                acc += counts[ti]
                continue
            ti = by_sig[sig] = len(specs)
            base = bases.get(dn | sk.cls_n)
            if base is not None and sk.offset is not None and base[1] is not None:
                # the base's geometry, its sources `delta` ranks on (a `_Moved`, made when read)
                delta = sk.offset - base[1]
                specs.append((base[0], delta, sk.placements, base[2]))
                counts.append(base[3])
                shapes.append((base[4], delta))
            else:
                g = known.get(sig)
                if g is None:
                    g = known[sig] = self._geometry(matches[i], dn, sk)
                specs.append(g)
                counts.append(len(g.requests))
                shapes.append((rows_of(g), 0))
            acc += counts[ti]
            members.append((i,))
            instance.append((ti, 0))
        offsets.append(acc)
        plan.record_templates(_Templates(specs, members, self), instance, offsets)
        self._shapes = (plan.templates, shapes, members)

    def _geometry(self, m: Match, dn: int, sk: _SrcKey) -> Geometry:
        """A geometry built (build_geometry); the first of its class is the base others move."""
        dp = self._parts_by_number[dn >> 32]
        g = build_geometry(m, placement_of(m.dst), sk.placements, dp[4], self._cache, dp[3],
                           tuple((r.box, r.stacked, r.transposed) if r is not None else None for r in m.src_regions),
                           self._options["wire"])
        cls = dn | sk.cls_n
        if cls not in self._bases:
            # (its destination ranks, which a move keeps, are what every op lookup reads)
            self._bases[cls] = (g, sk.offset, g.request_ranks, len(g.requests), self._rows(g))
        return g

    def _offset(self, p) -> int | None:
        """p's shards as the first placement of its mesh and dims has them, every rank moved by one
        offset: that offset (None when they differ otherwise)."""
        kind = (id(p.mesh), id(p.dims))  # (the ids `_SrcKey.cls` compares: equal values may differ)
        hit = self._offsets.get(kind + (p.fixed,), False)
        if hit is not False:
            return hit
        mine = self._cache.shards(p)
        ref = self._reference.setdefault(kind, (mine, p))[0]
        offset = None
        if len(ref) == len(mine) and all(a.runs == b.runs and len(a.ranks) == len(b.ranks) for a, b in zip(ref, mine)):
            deltas = {y - x for a, b in zip(ref, mine) for x, y in zip(a.ranks, b.ranks)}
            if len(deltas) == 1:
                offset = deltas.pop()
        self._offsets[kind + (p.fixed,)] = offset
        return offset

    def _shift(self, rs: RankSet, delta: int) -> RankSet:
        key = (id(rs), delta)
        hit = self._shifted.get(key)
        if hit is None:
            ranks = rs.ranks
            if isinstance(ranks, range):
                hit = RankSet(range(ranks.start + delta, ranks.stop + delta, ranks.step))
            else:
                hit = self._cache.holders(tuple(r + delta for r in ranks))
            self._shifted[key] = hit
        return hit

    def _shape(self, g: Geometry) -> tuple:
        """(select's rows, the rank offset of the sources) of a template's geometry."""
        if g.__class__ is _Moved and "requests" not in g.__dict__:
            return self._rows(g._base), g._delta
        return self._rows(g), 0

    def _rows(self, g: Geometry) -> _Rows:
        """What select needs of a geometry, whatever it is moved by (`_Rows`), kept per base."""
        hit = self._rows_of.get(id(g))
        if hit is None:
            hit = self._rows_of[id(g)] = _Rows(g, self._prefixes)
        return hit

    # ---- senders and split -------------------------------------------------------------------------
    def _select_stage(self, plan: Plan) -> None:
        """select_stage's picks: one-candidate requests add their load at their place in its order
        (what Balanced.pick does with them whatever the loads); the others are picked in it."""
        if plan.selector_name != "balanced":
            picks, selector = select_senders(plan, plan.templates)
            plan.record_picks(picks, selector.load, selector)
            return
        picks, selector, self._floor = self._pick(plan, plan.templates)
        plan.record_picks(picks, selector.load, selector)

    def _pick(self, plan: Plan, templates) -> tuple:
        """(picks, the selector, (the send floor, per template its cuttable requests)).

        select_stage takes requests in (is_part, -bytes, template, request) order. A request
        with one candidate adds its load whatever the loads are, so only where it falls among
        the others matters: all of them are placed first (their load added at their place),
        then the others are picked in that order, each seeing exactly the load select_stage's
        greedy would have given it."""
        selector = Balanced(plan.world, plan.ranks_per_node)
        load = selector.load
        if self._shapes[0] is templates:  # the template stage's (rows, offset) per template
            shapes, members = self._shapes[1], self._shapes[2]
        elif templates.__class__ is Cut and templates.base is self._shapes[0]:  # a split round
            shapes, members = list(self._shapes[1]), self._shapes[2]
            for i, t in templates.cut.items():
                shapes[i] = self._shape(t.geometry)
        else:
            members = [t.members for t in templates]
            shapes = [self._shape(t.geometry) for t in templates]
        free: list[tuple] = []
        for i, (rows, _) in enumerate(shapes):
            if rows.free:
                free += [(rows.prefixes[j][0], rows.prefixes[j][1], i, j) for j in rows.free]
        free.sort()
        shared = {(p, b) for p, b, _, _ in free}
        new = _new
        # the one-candidate requests' load, per place among the free ones (a rank vector each):
        # a size no free request has goes where its prefix sorts; a size one has, by its full key
        world = plan.world
        vectors: dict[int, list[int]] = {}
        at_prefix: dict[tuple, list[int] | None] = {}
        ready: dict[int, tuple] = {}  # id of a rows -> per forced request (sender, receiver, bytes, vector or key)
        usable: set[int] = set()
        picks: list[list] = []
        total, cuttable = 0, []
        for i, ((rows, delta), ms) in enumerate(zip(shapes, members)):
            n = len(ms)
            total += rows.bytes * n
            cuttable.append(rows.cut)
            if rows.free:
                picks.append([None if s is None else (s + delta,) * n for s in rows.senders])
            else:  # every request has its one sender: the row made when read
                row = new(_Forced)
                row.senders, row.delta, row.n = rows.senders, delta, n
                picks.append(row)
            todo = ready.get(id(rows))
            if todo is None:
                todo = []
                for j, (s, rank, nbytes, prefix) in enumerate(zip(rows.senders, rows.ranks, rows.amounts, rows.prefixes)):
                    if s is None:
                        continue
                    if prefix in shared:
                        todo.append((s, rank, nbytes, (prefix, j)))
                        continue
                    vec = at_prefix.get(prefix)
                    if vec is None:
                        pos = bisect.bisect_left(free, prefix)
                        vec = at_prefix[prefix] = vectors.get(pos) or vectors.setdefault(pos, [0] * world)
                    todo.append((s, rank, nbytes, vec))
                todo = ready[id(rows)] = tuple(todo)
            for s, rank, nbytes, vec in todo:
                s += delta
                usable.add(s)
                if s != rank:  # (a local copy adds no load)
                    if vec.__class__ is tuple:  # a size some free request has: its place by (template, request)
                        prefix, j = vec
                        pos = bisect.bisect_left(free, (prefix[0], prefix[1], i, j))
                        vec = vectors.get(pos) or vectors.setdefault(pos, [0] * world)
                    vec[s] += n * nbytes
        sets = {}
        for pos, (_, neg, i, j) in enumerate(free):
            vec = vectors.get(pos)
            if vec is not None:
                for s, amount in enumerate(vec):
                    if amount:
                        load[s] += amount
            t = templates[i]
            q = t.geometry.requests[j]
            sets[id(q.senders)] = q.senders
            picks[i][j] = tuple(selector.pick(q.rank, q.senders, len(t.members), -neg, j))
        vec = vectors.get(len(free))
        if vec is not None:
            for s, amount in enumerate(vec):
                if amount:
                    load[s] += amount
        for rs in sets.values():
            usable.update(rs.ranks)
        return picks, selector, ((total / len(usable) if usable else 0.0), cuttable)

    def _split_stage(self, plan: Plan) -> None:
        """split_stage with the floor and cuttable requests the select stage counted."""
        floor, cuttable = self._floor
        split_stage(plan, floor=floor, cuttable=cuttable, select=lambda p, ts: self._pick(p, ts)[:2])


class _Matches(Sequence):
    """A plan's matches (match.py's), each made when first read: per instance its stored tensor
    (the one whose regions hold it, found by its first instance), its region and its source key.
    A one-rank plan reads the few it sends or receives."""

    def __init__(self, tensors, starts: list[int], sources: list):
        self._tensors, self._starts, self._sources = tensors, starts, sources
        self._made: dict[int, Match] = {}
        self.stored = _Stored(self)

    def __len__(self) -> int:
        return len(self._sources)

    def where(self, i: int) -> tuple:
        """(the stored tensor of instance i, its region or None)."""
        k = bisect.bisect_right(self._starts, i) - 1
        t = self._tensors[k]
        return t, (None if t.regions is None else t.regions[i - self._starts[k]])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        m = self._made.get(i)
        if m is None:
            if not 0 <= i < len(self._sources):
                raise IndexError(i)
            t, region = self.where(i)
            sk = self._sources[i]
            m = self._made[i] = Match(t, sk.sources, region, sk.regions)
        return m

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class _Stored(Sequence):
    """Per instance its stored tensor (Plan.stored), without making its match."""

    def __init__(self, matches: _Matches):
        self._matches = matches

    def __len__(self) -> int:
        return len(self._matches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._matches.where(i if i >= 0 else i + len(self))[0]


class _Forced(Sequence):
    """The picks of a template whose every request has one candidate: request j's sender is its
    base's plus the template's offset, for each of its n members (made when read)."""

    __slots__ = ("senders", "delta", "n")

    def __len__(self) -> int:
        return len(self.senders)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        return (self.senders[j] + self.delta,) * self.n

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None


class _Rows:
    """A geometry's requests as select reads them: per request its one candidate sender (None:
    several), receiver, bytes and (is_part, -bytes) order prefix (one object per value); the
    requests with several candidates (`free`); the bytes of all; those split_stage could cut."""

    __slots__ = ("senders", "ranks", "amounts", "prefixes", "free", "bytes", "cut", "geometry")

    def __init__(self, g: Geometry, prefixes: dict):
        senders, free, cut, pres = [], [], [], []
        for j, q in enumerate(g.requests):
            rs = q.senders
            one = len(rs) == 1
            senders.append(rs.ranks[0] if one else None)
            if not one:
                free.append(j)
            prefix = (g.is_part(q), -q.bytes)
            pres.append(prefixes.setdefault(prefix, prefix))
            if Balanced.cuttable(rs, q.bytes):
                cut.append(j)
        self.senders, self.free, self.cut, self.prefixes = tuple(senders), tuple(free), tuple(cut), tuple(pres)
        self.ranks = tuple(q.rank for q in g.requests)
        self.amounts = tuple(q.bytes for q in g.requests)
        self.bytes = sum(self.amounts)
        self.geometry = g  # keeps the id that keys it alive


class _Templates(Sequence):
    """A plan's templates (`Plan.templates`), each made when first read: a template the
    planner moved from a base is four fields until then, so a re-plan whose consumers read
    few of its templates (one rank's ops; the select stage's free requests) makes few of
    its ~47k Template and `_Moved` objects. Reads as the tuple group_templates gives."""

    __slots__ = ("_specs", "_members", "_planner", "_made")

    def __init__(self, specs: list, members: list[tuple[int, ...]], planner: TablePlanner):
        self._specs, self._members, self._planner = specs, members, planner
        self._made: list[Template | None] = [None] * len(specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        t = self._made[i]
        if t is None:
            spec = self._specs[i]
            if spec.__class__ is tuple:
                base, delta, src, request_ranks = spec
                g = _new(_Moved)
                _set(g, "__dict__", {"src": src, "_delta": delta, "_base": base, "_planner": self._planner,
                                     "request_ranks": request_ranks})
            else:
                g = spec
            t = _new(Template)
            _set(t, "__dict__", {"geometry": g, "members": self._members[i]})
            self._made[i] = t
        return t

    def __iter__(self):
        get = self.__getitem__
        return (get(i) for i in range(len(self._specs)))


class _FromBase:
    """A field of a moved geometry read from its base, unless set on it (a non-data descriptor:
    `dataclasses.replace` of a moved geometry sets every field, which then wins)."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return getattr(obj.__dict__["_base"], self.name)


class _Moved(Geometry):
    """A base geometry (`_base`) with its sources' ranks moved by `_delta`: the same pieces,
    proofs and destination, read from the base (`_FromBase`); its own `src`; `requests` and
    `alternatives` (holders and candidate senders moved) made when first read, so a plan whose
    consumers read few of its templates' requests (one rank's ops, the select stage's rows)
    never makes the others. Equal to the Geometry `build_geometry` makes for its match, field
    by field (made in TablePlanner._template_stage, never by __init__)."""

    dst, wire_bytes, pieces, dst_box, src_boxes = _FromBase(), _FromBase(), _FromBase(), _FromBase(), _FromBase()
    tiling, dst_dtype, wire_mode, dst_local = _FromBase(), _FromBase(), _FromBase(), _FromBase()

    @cached_property
    def requests(self) -> tuple[Request, ...]:
        shift, delta = self._planner._shift, self._delta
        out = []
        for q in self._base.requests:
            d = q.__dict__.copy()
            d["senders"] = shift(q.senders, delta)
            r = _new(Request)
            _set(r, "__dict__", d)
            out.append(r)
        return tuple(out)

    @cached_property
    def alternatives(self):
        shift, delta = self._planner._shift, self._delta
        return tuple(tuple((a, shift(h, delta)) for a, h in alts) for alts in self._base.alternatives)


