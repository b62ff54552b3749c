"""Two layouts in, a proven, balanced transfer plan out.

Pipeline (each stage a pure function of the previous one)::

    match      dst instance -> source instances of its key     (match.py; a plain side
               read as the other side's parts of the key first: refine.py)
    template   instances that cut and place alike share one template
    pieces     per destination shard: rectangles and who can feed them (pieces.py)
    prove      pieces tile every destination shard exactly once       (verify.py)
    select     a sender per request, batched over a template's members (select.py)
    split      when whole pieces leave the busiest sender far above the floor, cut
               the requests that overload it along their outer dim and select again
    relay      when destination replicas outnumber the senders, replicas that received
               a piece forward it to the others (relay.py), if that lowers the busiest link
    emit       ops in canonical order: dst instance, dst rank, piece

Identical layers and experts share a template, so planning costs grow with
distinct shapes, not tensors x ranks; one rank's ops are emitted without
building anyone else's. Op ids are positions in the canonical order, the same
on every rank and every run.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from layoutlang.diagnostics import Note
from layoutlang.elaborate import load
from layoutlang.gcpause import gc_paused
from layoutlang.ir import ELEMENT_BYTES, QUANTIZED, Layout, TensorIR
from layoutlang.modes import Run, cached_property
from layoutlang.version import __version__

from .match import Match, PlanError
from .pieces import Piece, Slice, Source, pieces
from .ranks import RankSet
from .flat import FlatShard, clip_flat, is_flat, source_shards, to_storage
from .records import RELAYED, Box, Geometry, Op, Template, TensorEntry, Transfer, op_offsets, region_box
from .refine import pair
from .relay import needed_recv, relay_stage
from . import strides
from .select import SELECTORS, select_senders
from .shards import Placement, Shard, placement_of, shards
from .split import split_stage
from .verify import check_tiling
from .wire import WIRE_MODES, wire_dtype

FORMAT = "layoutlang.plan/1"


class PlanCache:
    """Memos of one plan's compilation, dropped with the plan (never process-wide).

    Shards per placement and proven pieces per geometry: identical layers and
    experts share run tuples, so pieces and their proof are computed once per
    distinct geometry. Keys use ids of run tuples the memo itself keeps alive.
    """

    def __init__(self):
        self._shards: dict[Placement, tuple[Shard, ...]] = {}
        self._shard_of_rank: dict[tuple, dict[int, int]] = {}
        self._views: dict[tuple, tuple[Shard, ...]] = {}
        # Equal clipped run tuples are one object: keys of different experts or parts that
        # the same shards cut alike then share `proven_pieces` (memoized by run ids).
        self._runs: dict[tuple, tuple] = {}
        self._narrow: dict[tuple, tuple] = {}  # (placement, dim) -> shards sorted by their extent there
        self._pieces: dict[tuple, tuple] = {}
        self._holders: dict[tuple[int, ...], RankSet] = {}
        # (dst slice, local shape, dtype, wire mode) -> op_wire's (format, bytes): experts of every
        # layer (and an EPLB map's slots) ask for the same few
        self.wires: dict[tuple, tuple[str | None, int]] = {}

    def shards(self, p: Placement) -> tuple[Shard, ...]:
        hit = self._shards.get(p)
        if hit is None:
            hit = self._shards[p] = shards(p)
        return hit

    def view(self, p: Placement, box: Box) -> tuple[Shard, ...]:
        """The shards of one key of a stored tensor: runs clipped to the key's box, in the key's
        logical coordinates; shards holding nothing of it are left out. `box` None: the shards."""
        if box is None:
            return self.shards(p)
        hit = self._views.get((p, box))
        if hit is None:
            if is_flat(box):  # a flat dim's key: each shard's range of it as boxes of the key
                hit = clip_flat(self._near(p, box[0]), box[0], box[3], intern=self._runs)
            else:
                hit = clip_shards(self._near(p, box[0]), *box, intern=self._runs)
            self._views[(p, box)] = hit
        return hit

    def _near(self, p: Placement, box: tuple[tuple[int, int], ...]) -> tuple[Shard, ...]:
        """The shards that may overlap `box`, in shard order: those whose extent along the box's
        narrowest dim meets it (a stacked key's index: one shard of hundreds)."""
        shards_ = self.shards(p)
        if len(shards_) < 16 or not box:
            return shards_
        d = min(range(len(box)), key=lambda i: box[i][1] - box[i][0])
        index = self._narrow.get((p, d))
        if index is None:
            spans = []
            for i, sh in enumerate(shards_):
                starts = [r.logical_start for r in sh.runs[d] if isinstance(r, Run)]
                ends = [r.logical_start + r.length for r in sh.runs[d] if isinstance(r, Run)]
                if starts:
                    spans.append((min(starts), max(ends), i))
            spans.sort()
            index = self._narrow[(p, d)] = (tuple(a for a, _, _ in spans), tuple(spans))
        starts, spans = index
        lo, hi = box[d]
        stop = bisect.bisect_left(starts, hi)
        # spans sorted by start: every candidate starts before hi; keep those ending after lo
        keep = sorted(i for a, b, i in spans[:stop] if b > lo)
        return tuple(shards_[i] for i in keep)

    def shard_of_rank(self, p: Placement, box: Box = None) -> dict[int, int]:
        hit = self._shard_of_rank.get((p, box))
        if hit is None:
            hit = self._shard_of_rank[(p, box)] = {r: i for i, s in enumerate(self.view(p, box)) for r in s.ranks}
        return hit

    def holders(self, ranks: tuple[int, ...]) -> RankSet:
        """One RankSet per distinct holder tuple (shards' rank tuples are shared objects)."""
        hit = self._holders.get(ranks)
        if hit is None:
            hit = self._holders[ranks] = RankSet(ranks)
        return hit

    def proven_pieces(self, first: Match, s: Shard, src_shards, src_geometry) -> tuple[Piece, ...]:
        """Pieces of one destination shard, proven to tile it; memoized by geometry."""
        key = (tuple(id(r) for r in s.runs), src_geometry)
        hit = self._pieces.get(key)
        if hit is not None:
            return hit[0]
        found = pieces(s.runs, src_shards)
        fault = check_tiling([p.dst_slice for p in found], s.runs)
        if fault is not None:
            raise _coverage_error(first, s, fault)
        self._pieces[key] = (found, s.runs, [sh.runs for group in src_shards for sh in group])
        return found


@dataclass(frozen=True)
class KeyShard(Shard):
    """A shard seen by one key: runs over the key's dims; `at`: (stored dim, local index) of each
    stacked dim (LANGUAGE.md 8.2) — where this key sits in the shard's storage along it."""

    at: tuple[tuple[int, int], ...] = ()
    transposed: bool = False  # the key's dims are the stored (non-stacked) dims in reverse order


def clip_shards(shards_: tuple[Shard, ...], box: tuple[tuple[int, int], ...],
                stacked: tuple[int, ...] = (), transposed: bool = False,
                intern: dict | None = None) -> tuple[KeyShard, ...]:
    """Shards restricted to a key's logical box, re-based to its corner, stacked dims taken out.

    Preserves: local storage positions (ops stay slices of the STORED tensor);
    padding is dropped (it belongs to no key); a shard with nothing inside the
    box is left out; a stacked dim (box extent 1) leaves the key's dims and is
    remembered as the local index that holds it; a transposed key (LANGUAGE.md
    8.3) sees the stored dims in reverse order.
    """
    out = []
    for sh in shards_:
        dims, at = [], []
        for d, (runs, (lo, hi)) in enumerate(zip(sh.runs, box)):
            clipped = []
            for r in runs:
                if isinstance(r, Run):
                    a, b = max(lo, r.logical_start), min(hi, r.logical_start + r.length)
                    if a < b:
                        clipped.append(Run(r.local_start + a - r.logical_start, a - lo, b - a))
            if not clipped:
                break
            if d in stacked:
                at.append((d, clipped[0].local_start))
            else:
                runs_ = tuple(clipped)
                dims.append(runs_ if intern is None else intern.setdefault(runs_, runs_))
        else:
            out.append(KeyShard(tuple(dims[::-1] if transposed else dims), sh.ranks, tuple(at), transposed))
    return tuple(out)


def _unstack(sl: Slice, at: tuple[tuple[int, int], ...], transposed: bool = False) -> Slice:
    """A key-dims slice as a slice of the stored tensor: dims back in storage order, stacked
    dims put back at their index."""
    out = list(sl[::-1] if transposed else sl)
    for d, local in at:
        out.insert(d, (local, local + 1))
    return tuple(out)


def _back(sl: Slice, shard: Shard) -> Slice:
    """A key-dims slice of a (non-flat) shard in its stored tensor's dims."""
    return _unstack(sl, getattr(shard, "at", ()), getattr(shard, "transposed", False))


def _in_storage(p: Piece, dst: Shard, src_shards) -> Piece:
    """A piece computed over a key's dims, with its slices in the stored tensors' dims."""
    def back(sl: Slice, shard: Shard) -> Slice:
        return _unstack(sl, getattr(shard, "at", ()), getattr(shard, "transposed", False))

    sources = tuple(Source(a.instance, a.shard, back(a.src_slice, src_shards[a.instance][a.shard])) for a in p.sources)
    return Piece(back(p.dst_slice, dst), p.logical, sources)


def build_geometry(first: Match, dst: Placement, src: tuple[Placement, ...], wire_bytes: int,
                   cache: PlanCache, dst_box: Box = None, src_boxes: tuple[Box, ...] = (),
                   wire_mode: str = "auto") -> Geometry:
    """Pieces per destination shard, proven to tile it; requests in canonical order.

    With boxes (v2 part keys) every shard is first cut to the key's region, so
    pieces, proof and candidate senders are per key.
    """
    # a flat source's boxes are shards of their own (flat.py)
    src_shards = [source_shards(cache.view(p, src_boxes[i] if src_boxes else None)) for i, p in enumerate(src)]
    dst_shards = cache.view(dst, dst_box)
    stacked = any(b is not None and (b[1] or b[2]) for b in (dst_box, *src_boxes))  # stacked or transposed
    flat = any(is_flat(b) for b in (dst_box, *src_boxes))
    per_shard: list[range] = []
    piece_list: list[Piece] = []
    src_geometry = tuple(tuple(tuple(id(r) for r in s.runs) for s in group) for group in src_shards)
    for s in dst_shards:
        if flat:  # pieces over the key's dims, box by box of a flat destination, then into storage
            found = tuple(q for bx in (s.boxes if isinstance(s, FlatShard) else (s,))
                          for p in cache.proven_pieces(first, bx, src_shards, src_geometry)
                          for q in to_storage(p, bx, src_shards, _back))
        else:
            found = cache.proven_pieces(first, s, src_shards, src_geometry)
        if stacked and not flat:
            found = tuple(_in_storage(p, s, src_shards) for p in found)
        per_shard.append(range(len(piece_list), len(piece_list) + len(found)))
        piece_list.extend(found)
    alternatives = tuple(tuple((a, cache.holders(src_shards[a.instance][a.shard].ranks)) for a in p.sources)
                         for p in piece_list)
    senders = tuple(alts[0][1] if len(alts) == 1 else RankSet(r for _, h in alts for r in h)
                    for alts in alternatives)
    shard_index = cache.shard_of_rank(dst, dst_box)
    quantized = first.dst.dtype in QUANTIZED
    local = tuple((rank, tuple(first.dst.local_shape_at(rank))) for rank in sorted(shard_index)) if quantized else ()
    g = Geometry(dst, src, wire_bytes, tuple(piece_list), (), alternatives, dst_box, tuple(src_boxes),
                 dst_dtype=first.dst.dtype, wire_mode=wire_mode, dst_local=local)
    requests = tuple(g.request(rank, k, piece_list[k], senders[k], cache.wires)
                     for rank in sorted(shard_index) for k in per_shard[shard_index[rank]])
    return dataclasses.replace(g, requests=requests)


def _logical(runs, a: int, b: int) -> str:
    """Logical range of local [a, b) of one dim, where one run holds its start."""
    for r in runs:
        if r.local_start <= a < r.local_start + r.length:
            if hasattr(r, "logical_start"):
                lo = r.logical_start + a - r.local_start
                return f"{lo}:{lo + min(b, r.local_start + r.length) - a}"
            return "padding"
    return "?"


def _coverage_error(m: Match, shard: Shard, fault) -> PlanError:
    rank = shard.ranks[0]
    region = ", ".join(f"{a}:{b}" for a, b in fault.local)
    logical = ", ".join(_logical(runs, a, b) for runs, (a, b) in zip(shard.runs, fault.local))
    region += f"] (logical [{logical}])"
    what = {"gap": "no source covers", "overlap": "two sources cover",
            "padding": "a source would write padding at"}[fault.kind]
    return PlanError(
        f"`{m.key}` on destination rank {rank}: {what} local [{region}", m.dst.span,
        notes=[Note("the source declaration", m.src[0].span)],
        help="the destination must receive every logical element exactly once")


class Plan:
    """The compiled plan: a frozen model read through one public door.

    `transfers()` yields every op as a `Transfer` (instance, destination rank,
    piece, sender, the source alternative it holds, bytes, candidate senders);
    `ops`, `ops_for_rank`, statistics, the step graph, the renderers and the
    runtime all read it (or `templates` and `picks`, its grouped form).
    Compilation runs the stages of `PIPELINE` in order (or `pipeline`: a planner's own
    versions of them that make the same plan, layoutlang/compiler/members.py).
    """

    def __init__(self, src: Layout, dst: Layout, *, ranks_per_node: int | None = None,
                 selector: str = "balanced", split: bool = True, wire: str = "auto", relay: bool = True,
                 progress=None, pipeline=None):
        self.src, self.dst = src, dst
        self.ranks_per_node = ranks_per_node
        self.selector_name = selector
        self.split = split
        self.wire = wire  # "auto": quantized wire where blocks are whole (layoutlang/compiler/wire.py); "bf16": never
        self.relay = relay
        # per template: None, or per request None or per member the request it is relayed after (-1: none)
        self._after: tuple | None = None
        # copy relays (relay.py): op id -> (the op it waits for, that op's destination slice)
        self._copied: dict[int, tuple[int, Slice]] = {}
        self.relays = 0  # ops that are relays (`relay_stage`)
        self.splits = 0  # whole requests (instances x template requests) cut into parts by `split_stage`
        self.world = max(src.ranks, dst.ranks)
        self.progress = progress or (lambda stage, done, total: None)
        self._cache = PlanCache()
        # `pipeline`: the stages to run, PIPELINE unless a planner that knows more runs its own
        # versions of them (layoutlang/compiler/members.py: the same plan, what the replica count does not
        # change computed once)
        for _, stage in PIPELINE if pipeline is None else pipeline:
            stage(self)
        # the memos and the selector served compilation; the plan keeps only what it needs
        self._cache = self._selector = None

    # ---- what the stages record (PIPELINE's, or a planner's own versions of them) ------------
    def record_stored(self, stored: Sequence[TensorIR]) -> None:
        """The stored destination tensor of every instance (a planner that matched keys itself)."""
        self._stored = stored

    def record_templates(self, templates: Sequence[Template], instance: Sequence[tuple[int, int]] | None = None,
                         offsets: Sequence[int] | None = None) -> None:
        """The templates (a sequence: a planner's may be made when read, layoutlang/compiler/tables.py), each
        instance's (template, member) (None: as recorded before, a stage that re-cut the templates),
        and the first op id of every instance (None: `op_offsets` of these; a planner that knows
        them passes its own)."""
        if instance is not None:
            self._instance = instance
        self.templates = templates
        self._offsets = op_offsets(self._instance, templates) if offsets is None else offsets

    def record_picks(self, picks: list, load: list[int], selector=None) -> None:
        """The chosen senders (per template request, per member) and every rank's send load; with
        `selector`, the one that chose them (a later stage selects again from its state)."""
        self._picks, self.send_load = picks, load
        if selector is not None:
            self._selector = selector

    def record_relays(self, after: tuple, copied: dict[int, tuple[int, Slice]], relays: int) -> None:
        """Relays (relay.py): per template None or per request the request each member waits for;
        copy relays, op id -> (the op it waits for, that op's destination slice); their count."""
        self._after = after if any(w is not None for w in after) else None
        self._copied, self.relays = copied, relays

    @property
    def selection(self) -> tuple[list, object]:
        """(picks per template request, the selector that made them): what a stage that selects
        again starts from, during compilation only (the selector is dropped after it)."""
        return self._picks, self._selector

    def instance_of(self, op_id: int) -> int:
        """The destination instance whose ops hold `op_id` (`op_range` read backwards)."""
        return bisect.bisect_right(self._offsets, op_id) - 1

    # ---- the grouped model ------------------------------------------------------
    def picks(self, template: int, request: int) -> tuple[int, ...]:
        """The chosen sender of one template request, per member (in member order)."""
        return self._picks[template][request]

    def template_of(self, instance: int) -> tuple[int, int]:
        """(index into `templates`, member ordinal) of destination instance `instance`."""
        return self._instance[instance]

    def op_range(self, instance: int) -> range:
        """The op ids of one destination instance (ops are grouped by instance)."""
        return range(self._offsets[instance], self._offsets[instance + 1])

    # ---- destination instances: what the plan and its consumers read, never `matches` itself --
    @cached_property
    def key_matches(self) -> Sequence[Match]:
        """Per instance its match for what does not depend on the destination's ranks: key, shape,
        source instances and regions, the destination's name and dtype. `matches`, or in a
        membership plan one replica's (layoutlang/compiler/members.py sets them and `_stored`; `matches` is
        then built if read), whose `dst` is that replica's tensor: ranks go through `stored(i)`."""
        return self.matches

    @cached_property
    def _stored(self) -> Sequence[TensorIR]:
        return [m.dst for m in self.matches]

    def stored(self, instance: int) -> TensorIR:
        """The destination tensor (one of `dst.tensors`) that `instance` writes: `matches[instance].dst`."""
        return self._stored[instance]

    @cached_property
    def matches(self) -> list[Match]:
        """Every destination key per stored instance, with its key's source instances (match.py)."""
        return [Match(t, m.src, m.region, m.src_regions) for t, m in zip(self._stored, self.key_matches)]

    @cached_property
    def tensors(self) -> tuple[TensorEntry, ...]:
        """One entry per destination key, in destination order."""
        seen: dict[str, TensorEntry] = {}
        for m in self.key_matches:
            if m.key not in seen:
                seen[m.key] = TensorEntry(m.key, m.shape, m.src[0].dtype, m.dst.dtype)
        return tuple(seen.values())

    # ---- the public door ----------------------------------------------------------
    def transfers(self, *, rank: int | None = None, instance: int | None = None):
        """Every op as a Transfer, in canonical order; only `rank`'s (sent or received), or one instance's."""
        for op_id, i, g, req, sender, after in self._rows(rank, instance):
            piece = g.pieces[req.piece]
            if after is None:
                yield Transfer(op_id, i, req.rank, piece, sender, g.source_for(req.piece, sender),
                               req.bytes, req.senders, req.wire)
            else:
                copy = self._copied.get(op_id)
                read = piece.dst_slice if copy is None else copy[1]
                yield Transfer(op_id, i, req.rank, piece, sender, Source(RELAYED, RELAYED, read),
                               req.bytes, req.senders, req.wire, (after,))

    def _rows(self, rank: int | None, instance: int | None):
        """(op id, instance, geometry, request, sender, op id it is relayed after or None) in canonical
        order: what ops and transfers share."""
        instances = range(len(self._instance)) if instance is None else (instance,)
        offsets, templates, picks_of, where = self._offsets, self.templates, self._picks, self._instance
        after_of = self._after or ()
        copied = self._copied
        for i in instances:
            ti, member = where[i]
            g = templates[ti].geometry
            picks = picks_of[ti]
            base = offsets[i]
            waits = after_of[ti] if ti < len(after_of) else None
            if rank is None:
                for j, req in enumerate(g.requests):
                    k = waits[j][member] if waits is not None and waits[j] is not None else -1
                    after = None if k < 0 else base + k
                    if copied and base + j in copied:
                        after = copied[base + j][0]
                    yield base + j, i, g, req, picks[j][member], after
                continue
            for j, dst_rank in enumerate(g.request_ranks):
                sender = picks[j][member]
                if dst_rank == rank or sender == rank:
                    k = waits[j][member] if waits is not None and waits[j] is not None else -1
                    after = None if k < 0 else base + k
                    if copied and base + j in copied:
                        after = copied[base + j][0]
                    yield base + j, i, g, g.requests[j], sender, after

    def _ops(self, rank: int | None) -> tuple[Op, ...]:
        matches = self.key_matches  # names, keys and regions: the same in every replica
        out = []
        for op_id, i, g, req, sender, after in self._rows(rank, None):
            m = matches[i]
            dst_slice = g.pieces[req.piece].dst_slice
            if after is not None:  # the sender forwards its own copy: same tensor, same local slice
                copy = self._copied.get(op_id)  # (a copy relay: another slot of that tensor)
                read = dst_slice if copy is None else copy[1]
                out.append(Op(op_id, m.key, sender, req.rank, m.dst.name, m.dst.name, read, dst_slice,
                              req.bytes, None, req.wire, (after,)))
                continue
            src = g.source_for(req.piece, sender)
            out.append(Op(op_id, m.key, sender, req.rank, m.src[src.instance].name, m.dst.name,
                          src.src_slice, dst_slice, req.bytes,
                          _transpose(m, src, dst_slice) if g.dst_box or g.src_boxes else None, req.wire))
        return tuple(out)

    def op(self, t: Transfer) -> Op:
        """The op a transfer becomes (named by the layouts' tensors)."""
        m = self.key_matches[t.instance]
        if t.after:
            return Op(t.op_id, m.key, t.sender, t.dst_rank, m.dst.name, m.dst.name, t.source.src_slice,
                      t.piece.dst_slice, t.bytes, None, t.wire, t.after)
        return Op(t.op_id, m.key, t.sender, t.dst_rank, m.src[t.source.instance].name, m.dst.name,
                  t.source.src_slice, t.piece.dst_slice, t.bytes, _transpose(m, t.source, t.piece.dst_slice), t.wire)

    @cached_property
    def relay_depths(self) -> dict[int, int]:
        """Op id -> relay depth, for relays only (an op not listed has depth 0): 1 + the depth of
        the op it waits for. Every rank computes the same depths, so the runtime's rounds pair up."""
        out: dict[int, int] = {}
        if self._copied:  # a copy relay: 1 + the depth of the op it waits for (chains end at a source)
            def depth(op: int) -> int:
                return 0 if op not in self._copied else 1 + depth(self._copied[op][0])
            out.update({op: depth(op) for op in self._copied})
        if not self._after:
            return out
        for i, (ti, member) in enumerate(self._instance):
            waits = self._after[ti]
            if waits is None:
                continue
            base = self._offsets[i]
            for j in range(len(waits)):
                depth, k = 0, j
                while waits[k] is not None and waits[k][member] >= 0:
                    k = waits[k][member]
                    depth += 1
                if depth:
                    out[base + j] = depth
        return out

    @property
    def op_count(self) -> int:
        return self._offsets[-1]

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every op, in canonical order (op.id == position)."""
        with gc_paused():
            return self._ops(None)

    def ops_for_rank(self, rank: int) -> tuple[Op, ...]:
        """The ops `rank` sends or receives, in canonical order, without building the others."""
        with gc_paused():
            return self._ops(rank)

    # ---- statistics ---------------------------------------------------------------
    @cached_property
    def stats(self) -> dict:
        recv = [0] * self.world  # network bytes received
        local = intra = inter = 0
        rpn = self.ranks_per_node
        sender_sets: dict[int, RankSet] = {}
        receivers: set[int] = set()
        for ti, t in enumerate(self.templates):
            for j, req in enumerate(t.geometry.requests):
                rank, nbytes = req.rank, req.bytes
                sender_sets.setdefault(id(req.senders), req.senders)
                receivers.add(rank)
                for s in self._picks[ti][j]:
                    if s == rank:
                        local += nbytes
                        continue
                    recv[rank] += nbytes
                    if rpn and s // rpn == rank // rpn:
                        intra += nbytes
                    else:
                        inter += nbytes
        total = local + intra + inter
        usable = len({r for rs in sender_sets.values() for r in rs})
        # The floor (DESIGN.md): every byte spread evenly over every rank that can
        # send. The busiest sender counts network bytes: a local copy uses no link.
        floor = total / usable if usable else 0.0
        busiest = max(range(self.world), key=lambda r: (self.send_load[r], -r)) if self.world else 0
        receiver = max(range(self.world), key=lambda r: (recv[r], -r)) if self.world else 0
        dst_floor = total / max(1, len(receivers))  # like the send floor: all bytes, evenly
        link = max(range(self.world), key=lambda r: (max(self.send_load[r], recv[r]), -r)) if self.world else 0
        must = needed_recv(self.templates, self.world)
        return {
            "ops": self.op_count, "bytes": total,
            "max_send_bytes": self.send_load[busiest] if self.world else 0,
            "max_recv_bytes": recv[receiver] if self.world else 0,
            "busiest_sender": busiest, "busiest_receiver": receiver,
            "usable_senders": usable, "send_floor_bytes": floor,
            "send_balance": (self.send_load[busiest] / floor) if floor else 0.0,
            "recv_balance": (recv[receiver] / dst_floor) if dst_floor else 0.0,
            "local_bytes": local, "intra_node_bytes": intra if rpn else None,
            "inter_node_bytes": inter if rpn else None, "network_bytes": intra + inter,
            "templates": len(self.templates), "tensors": len(self._instance),
            # the busiest link (LANGUAGE.md 5, relays): per rank the larger of network bytes sent
            # and received; its floor: the most network bytes one rank must receive, whatever sends
            "busiest_link_bytes": max(self.send_load[link], recv[link]) if self.world else 0,
            "busiest_link_rank": link, "link_floor_bytes": max(must, default=0), "relays": self.relays,
        }

    @cached_property
    def recv_load(self) -> list[int]:
        """Bytes each rank receives, local copies included."""
        recv = [0] * self.world
        for t in self.templates:
            for req in t.geometry.requests:
                recv[req.rank] += req.bytes * len(t.members)
        return recv

    @cached_property
    def digest(self) -> str:
        """Identifies the plan: it is a pure function of these inputs (DESIGN.md)."""
        import hashlib

        inputs = (FORMAT, __version__, self.src.digest, self.dst.digest, self.ranks_per_node,
                  self.selector_name)
        if not self.split:  # named only when off: the default plan keeps the inputs it always had
            inputs += (("split", False),)
        if self.wire != "auto":
            inputs += (("wire", self.wire),)
        if not self.relay:
            inputs += (("relay", False),)
        return hashlib.sha256(repr(inputs).encode("utf-8")).hexdigest()

    def one_line(self) -> str:
        s = self.stats
        return (f"plan {self.src.path} -> {self.dst.path}: {s['tensors']} tensors, {s['ops']} ops, "
                f"{s['bytes']} B, busiest sender {s['send_balance']:.2f}x floor")


def _transpose(m: Match, src: Source, dst_slice: Slice) -> tuple[int, int] | None:
    """(p, q) of the source block when exactly one side stores the key transposed, else None."""
    r, s = m.region, m.src_region(src.instance)
    if (r is not None and r.transposed) == (s is not None and s.transposed):
        return None
    if s is not None and s.shape is not None:  # a flat source (one entry): the block in the key's order
        q, p = (strides.extent(e) for d, e in enumerate(dst_slice) if d not in r.stacked)
        return p, q
    stacked = s.stacked if s is not None else ()
    p, q = (strides.extent(e) for d, e in enumerate(src.src_slice) if d not in stacked)
    return p, q


# ---- the stages, in order ---------------------------------------------------------
def match_stage(plan: Plan) -> None:
    """Every destination instance with the source instances of its key (match.py). A key one side
    stores plainly and the other as parts of it is refined first (refine.py): the plan's layouts
    are then the refined ones (the same names, local shapes and storage)."""
    plan.src, plan.dst, plan.matches, plan.unused_keys = pair(plan.src, plan.dst)


def template_stage(plan: Plan) -> None:
    """Instances that cut and place alike share one geometry: pieces, proof, requests, senders."""
    plan.record_templates(*group_templates(plan.matches, plan._cache, plan.wire, plan.progress))


def group_templates(matches: list[Match], cache: PlanCache, wire_mode: str = "auto",
                    progress=None) -> tuple[tuple[Template, ...], list[tuple[int, int]]]:
    """(templates, per match its (template, member ordinal)): matches that cut and place alike
    share one geometry, built for the first of them."""
    by_sig: dict[tuple, int] = {}
    geometries: list[Geometry] = []
    members: list[list[int]] = []
    instance: list[tuple[int, int]] = []
    total = len(matches)
    for i, m in enumerate(matches):
        if progress and i % 512 == 0:
            progress("templates", i, total)
        wire = ELEMENT_BYTES[wire_dtype(m.dst.dtype)]
        # Identity of the (shared, immutable) mesh and dims objects plus the
        # placement coordinates: equal keys mean equal placements, and hashing
        # a few ints is what keeps grouping cheap at 100k tensors. (Both
        # layouts outlive the plan, so the ids stay valid.)
        dst_box = region_box(m.region, m.dst)
        src_boxes = tuple(region_box(r, s) for r, s in zip(m.src_regions, m.src))
        # a quantized destination's format decides which ops carry quantized bytes (wire.py)
        sig = (id(m.dst.mesh), id(m.dst.dims), m.dst.fixed, dst_box,
               tuple((id(s.mesh), id(s.dims), s.fixed) for s in m.src), src_boxes, wire,
               m.dst.dtype if m.dst.dtype in QUANTIZED else None)
        ti = by_sig.get(sig)
        if ti is None:
            ti = by_sig[sig] = len(geometries)
            geometries.append(build_geometry(m, placement_of(m.dst), tuple(placement_of(s) for s in m.src),
                                             wire, cache, dst_box, src_boxes, wire_mode))
            members.append([])
        instance.append((ti, len(members[ti])))
        members[ti].append(i)
    if progress:
        progress("templates", total, total)
    return tuple(Template(g, tuple(ms)) for g, ms in zip(geometries, members)), instance


def select_stage(plan: Plan) -> None:
    """Choose senders, largest requests first (LPT: small ones then fill the gaps).

    The order is a pure function of the plan (bytes, then template and
    request order), so every rank makes the same choices.
    """
    picks, selector = select_senders(plan, plan.templates)
    plan.record_picks(picks, selector.load, selector)


PIPELINE = (("match", match_stage), ("templates", template_stage), ("senders", select_stage),
            ("split", split_stage), ("relay", relay_stage))


def as_layout(x, args) -> Layout:
    if isinstance(x, Layout):
        return x
    return load(os.fspath(x), args, unknown_args="ignore")


def compile_plan(src, dst, *, args: dict[str, int] | None = None,
                 src_args: dict[str, int] | None = None, dst_args: dict[str, int] | None = None,
                 ranks_per_node: int | None = None, selector: str = "balanced", split: bool = True,
                 wire: str = "auto", relay: bool = True, progress=None) -> Plan:
    """Compile the plan that moves every destination tensor's data from the source.

    `src`/`dst` are paths or loaded layouts. `args` sets args in both layouts
    (each takes the ones it declares; one that neither declares is an error);
    `src_args`/`dst_args` set one side only. `split=False` keeps every piece
    whole (`split_stage`: pieces are cut only when that balances the senders);
    `relay=False` has every op leave a source rank (`relay_stage`: replicas forward
    pieces only when that lowers the busiest link).
    `wire="bf16"` sends every quantized destination bf16 (the v1 rule); "auto"
    sends quantized data and scales where an op covers whole scale blocks
    (layoutlang/compiler/wire.py, LANGUAGE.md 4.1).
    """
    check_options(selector=selector, wire=wire, ranks_per_node=ranks_per_node)
    src_layout, dst_layout = load_pair(src, dst, args=args, src_args=src_args, dst_args=dst_args,
                                       progress=progress)
    with gc_paused():
        return Plan(src_layout, dst_layout, ranks_per_node=ranks_per_node, selector=selector, split=split,
                    wire=wire, relay=relay, progress=progress)


def check_options(*, selector: str = "balanced", wire: str = "auto", ranks_per_node: int | None = None) -> None:
    """compile_plan's options, checked before anything is loaded (a UsageError naming the allowed values)."""
    from layoutlang.diagnostics import UsageError

    if selector not in SELECTORS:
        raise UsageError(f"selector {selector!r}: expected one of {', '.join(sorted(SELECTORS))}")
    if wire not in WIRE_MODES:
        raise UsageError(f"wire {wire!r}: expected one of {', '.join(WIRE_MODES)}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"ranks_per_node {ranks_per_node}: expected a positive integer")


def load_pair(src, dst, *, args: dict[str, int] | None = None, src_args: dict[str, int] | None = None,
              dst_args: dict[str, int] | None = None, progress=None) -> tuple[Layout, Layout]:
    """The two layouts of compile_plan (paths are loaded with their args; loaded layouts pass
    through), each arg checked against the layouts that declare it."""
    from layoutlang.diagnostics import UsageError

    common = dict(args or {})
    s_args = {**common, **(src_args or {})}
    d_args = {**common, **(dst_args or {})}
    if progress:
        progress("layouts", 0, 2)
    src_layout = as_layout(src, s_args)
    if progress:
        progress("layouts", 1, 2)
    dst_layout = as_layout(dst, d_args)
    declared = {n for n, _ in src_layout.args} | {n for n, _ in dst_layout.args}
    for name in common:
        if not isinstance(src, Layout) and not isinstance(dst, Layout) and name not in declared:
            raise UsageError(f"--set {name}: neither layout has an arg `{name}`")
    for flag, side, given, layout in (("--set-src", src, src_args, src_layout), ("--set-dst", dst, dst_args, dst_layout)):
        for name in given or {}:
            if not isinstance(side, Layout) and name not in dict(layout.args):
                raise UsageError(f"{flag} {name}: {layout.path} has no arg `{name}`",
                                 help=f"its args: {', '.join(n for n, _ in layout.args) or 'none'}")
    if progress:
        progress("layouts", 2, 2)
    return src_layout, dst_layout
