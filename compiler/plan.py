"""Two layouts in, a proven, balanced transfer plan out.

Pipeline (each stage a pure function of the previous one)::

    match      dst instance -> source instances of its key     (match.py)
    template   instances that cut and place alike share one template
    pieces     per destination shard: rectangles and who can feed them (pieces.py)
    prove      pieces tile every destination shard exactly once       (verify.py)
    select     a sender per request, batched over a template's members (select.py)
    emit       ops in canonical order: dst instance, dst rank, piece

Identical layers and experts share a template, so planning costs grow with
distinct shapes, not tensors x ranks; one rank's ops are emitted without
building anyone else's. Op ids are positions in the canonical order, the same
on every rank and every run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from layoutlang.diagnostics import Note
from layoutlang.elaborate import load
from layoutlang.gcpause import gc_paused
from layoutlang.ir import ELEMENT_BYTES, QUANTIZED, Layout, TensorIR
from layoutlang.modes import cached_property

from .match import Match, PlanError, match
from .pieces import Piece, Slice, pieces
from .select import SELECTORS
from .shards import Placement, Shard, placement_of, shard_of_rank, shards
from .verify import check_tiling

FORMAT = "layoutlang.plan/1"


@dataclass(frozen=True)
class Op:
    """Copy src_slice of src_name on src_rank into dst_slice of dst_name on dst_rank."""

    id: int
    key: str
    src_rank: int
    dst_rank: int
    src_name: str
    dst_name: str
    src_slice: Slice
    dst_slice: Slice
    bytes: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        sl = lambda s: "[" + ", ".join(f"{a}:{b}" for a, b in s) + "]"
        return (f"op {self.id} {self.key}: rank {self.src_rank} {self.src_name}{sl(self.src_slice)} -> "
                f"rank {self.dst_rank} {self.dst_name}{sl(self.dst_slice)} ({self.bytes} B)")


@dataclass(frozen=True)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    src_dtype: str
    dst_dtype: str


def wire_dtype(dst_dtype: str) -> str:
    """The destination's dtype, unless it is quantized: then bf16 (LANGUAGE.md 4)."""
    return "bf16" if dst_dtype in QUANTIZED else dst_dtype


@dataclass
class Template:
    """Everything shared by destination instances that cut and place alike."""

    dst: Placement
    src: tuple[Placement, ...]
    wire_bytes: int
    members: list[int] = field(default_factory=list)          # indexes into Plan.matches
    requests: list[tuple[int, int]] = field(default_factory=list)  # (dst rank, piece index)
    piece_list: list[Piece] = field(default_factory=list)
    senders: list[tuple[int, ...]] = field(default_factory=list)   # per request: candidate ranks
    picks: list[list[int]] = field(default_factory=list)           # per request: sender per member

    def build(self, first: Match) -> None:
        """Pieces per destination shard, proven to tile it; requests in canonical order."""
        src_shards = [shards(p) for p in self.src]
        dst_shards = shards(self.dst)
        per_shard: list[tuple[int, ...]] = []
        src_geometry = tuple(tuple(tuple(id(r) for r in s.runs) for s in group) for group in src_shards)
        for s in dst_shards:
            found = _proven_pieces(first, s, src_shards, src_geometry)
            base = len(self.piece_list)
            self.piece_list.extend(found)
            per_shard.append(tuple(range(base, base + len(found))))
        shard_index = shard_of_rank(self.dst)
        for rank in sorted(shard_index):
            for k in per_shard[shard_index[rank]]:
                self.requests.append((rank, k))
        for _, k in self.requests:
            p = self.piece_list[k]
            ranks = sorted({r for src in p.sources for r in src_shards[src.instance][src.shard].ranks})
            self.senders.append(tuple(ranks))
        self._src_shards = src_shards

    def source_for(self, k: int, rank: int):
        """The alternative of piece k that `rank` holds (first one wins)."""
        for src in self.piece_list[k].sources:
            if rank in self._src_shards[src.instance][src.shard].ranks:
                return src
        raise AssertionError((k, rank))


_GEOMETRY: dict[tuple, tuple] = {}


def _proven_pieces(first: Match, s: Shard, src_shards, src_geometry) -> tuple[Piece, ...]:
    """Pieces of one destination shard, proven to tile it; memoized by geometry.

    Experts and layers placed on different ranks share their runs (the same
    cached run tuples), so the pieces and their proof are computed once; the
    memo keeps those tuples alive, so their ids cannot be reused.
    """
    key = (tuple(id(r) for r in s.runs), src_geometry)
    hit = _GEOMETRY.get(key)
    if hit is not None:
        return hit[0]
    found = pieces(s.runs, src_shards)
    fault = check_tiling([p.dst_slice for p in found], s.runs)
    if fault is not None:
        raise _coverage_error(first, s, fault)
    _GEOMETRY[key] = (found, s.runs, [sh.runs for group in src_shards for sh in group])
    return found


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
        f"`{m.dst.key}` on destination rank {rank}: {what} local [{region}", m.dst.span,
        notes=[Note("the source declaration", m.src[0].span)],
        help="the destination must receive every logical element exactly once")


class Plan:
    """The compiled plan: ops (lazily), statistics, and per-rank views."""

    def __init__(self, src: Layout, dst: Layout, *, ranks_per_node: int | None = None,
                 selector: str = "balanced", progress=None):
        self.src, self.dst = src, dst
        self._progress = progress or (lambda stage, done, total: None)
        self.ranks_per_node = ranks_per_node
        self.selector_name = selector
        self.matches, self.unused_keys = match(src, dst)
        self.world = max(src.ranks, dst.ranks)
        self.templates: list[Template] = []
        self._template_of: list[tuple[Template, int]] = []  # per match: (template, member ordinal)
        self._group()
        self._select()

    # ---- building ---------------------------------------------------------
    @cached_property
    def tensors(self) -> tuple[TensorEntry, ...]:
        """One entry per destination key, in destination order."""
        seen: dict[str, TensorEntry] = {}
        for m in self.matches:
            if m.dst.key not in seen:
                seen[m.dst.key] = TensorEntry(m.dst.key, m.dst.logical_shape, m.src[0].dtype, m.dst.dtype)
        return tuple(seen.values())

    def _group(self) -> None:
        by_sig: dict[tuple, Template] = {}
        total = len(self.matches)
        for i, m in enumerate(self.matches):
            if i % 512 == 0:
                self._progress("templates", i, total)
            wire = ELEMENT_BYTES[wire_dtype(m.dst.dtype)]
            # Identity of the (shared, immutable) mesh and dims objects plus the
            # placement coordinates: equal keys mean equal placements, and hashing
            # a few ints is what keeps grouping cheap at 100k tensors. (Both
            # layouts outlive the plan, so the ids stay valid.)
            sig = (id(m.dst.mesh), id(m.dst.dims), m.dst.fixed,
                   tuple((id(s.mesh), id(s.dims), s.fixed) for s in m.src), wire)
            t = by_sig.get(sig)
            if t is None:
                t = Template(placement_of(m.dst), tuple(placement_of(s) for s in m.src), wire)
                t.build(m)
                by_sig[sig] = t
                self.templates.append(t)
            self._template_of.append((t, len(t.members)))
            t.members.append(i)

    def _select(self) -> None:
        """Choose senders, largest requests first (LPT: small ones then fill the gaps).

        The order is a pure function of the plan (bytes, then template and
        request order), so every rank makes the same choices.
        """
        selector = SELECTORS[self.selector_name](self.world, self.ranks_per_node)
        self._progress("templates", len(self.matches), len(self.matches))
        order = sorted(((t.piece_list[k].elements * t.wire_bytes, i, j)
                        for i, t in enumerate(self.templates) for j, (_, k) in enumerate(t.requests)),
                       key=lambda x: (-x[0], x[1], x[2]))
        for t in self.templates:
            t.picks = [None] * len(t.requests)
        for step, (_, i, j) in enumerate(order):
            if step % 4096 == 0:
                self._progress("senders", step, len(order))
            t = self.templates[i]
            rank, k = t.requests[j]
            nbytes = t.piece_list[k].elements * t.wire_bytes
            t.picks[j] = selector.pick(rank, t.senders[j], len(t.members), nbytes, j)
        self.send_load = selector.load
        self._progress("senders", len(order), len(order))

    # ---- ops ------------------------------------------------------------------
    @cached_property
    def _offsets(self) -> list[int]:
        out, acc = [], 0
        for t, _ in self._template_of:
            out.append(acc)
            acc += len(t.requests)
        out.append(acc)
        return out

    @property
    def op_count(self) -> int:
        return self._offsets[-1]

    def _op(self, i: int, j: int) -> Op:
        t, member = self._template_of[i]
        m = self.matches[i]
        rank, k = t.requests[j]
        sender = t.picks[j][member]
        src = t.source_for(k, sender)
        piece = t.piece_list[k]
        return Op(self._offsets[i] + j, m.dst.key, sender, rank, m.src[src.instance].name,
                  m.dst.name, src.src_slice, piece.dst_slice, piece.elements * t.wire_bytes)

    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every op, in canonical order (op.id == position)."""
        with gc_paused():
            return tuple(self._op(i, j) for i, (t, _) in enumerate(self._template_of)
                         for j in range(len(t.requests)))

    def ops_for_rank(self, rank: int) -> tuple[Op, ...]:
        """The ops `rank` sends or receives, in canonical order, without building the others."""
        with gc_paused():
            return self._ops_for_rank(rank)

    def _ops_for_rank(self, rank: int) -> tuple[Op, ...]:
        out = []
        for i, (t, member) in enumerate(self._template_of):
            for j, (dst_rank, _) in enumerate(t.requests):
                if dst_rank == rank or t.picks[j][member] == rank:
                    out.append(self._op(i, j))
        return tuple(out)

    # ---- statistics -------------------------------------------------------------
    @cached_property
    def stats(self) -> dict:
        recv = [0] * self.world  # network bytes received
        local = intra = inter = 0
        rpn = self.ranks_per_node
        senders_possible: set[int] = set()
        receivers: set[int] = set()
        for t in self.templates:
            for j, (rank, k) in enumerate(t.requests):
                nbytes = t.piece_list[k].elements * t.wire_bytes
                senders_possible.update(t.senders[j])
                for s in t.picks[j]:
                    receivers.add(rank)
                    if s == rank:
                        local += nbytes
                        continue
                    recv[rank] += nbytes
                    if rpn and s // rpn == rank // rpn:
                        intra += nbytes
                    else:
                        inter += nbytes
        total = local + intra + inter
        usable = len(senders_possible)
        # The floor (DESIGN.md): every byte spread evenly over every rank that can
        # send. The busiest sender counts network bytes: a local copy uses no link.
        floor = total / usable if usable else 0.0
        busiest = max(range(self.world), key=lambda r: (self.send_load[r], -r)) if self.world else 0
        receiver = max(range(self.world), key=lambda r: (recv[r], -r)) if self.world else 0
        dst_floor = total / max(1, len(receivers))  # like the send floor: all bytes, evenly
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
            "templates": len(self.templates), "tensors": len(self.matches),
        }

    @cached_property
    def recv_load(self) -> list[int]:
        recv = [0] * self.world
        for t in self.templates:
            for j, (rank, k) in enumerate(t.requests):
                recv[rank] += t.piece_list[k].elements * t.wire_bytes * len(t.members)
        return recv

    @cached_property
    def digest(self) -> str:
        """Identifies the plan: it is a pure function of these inputs (DESIGN.md)."""
        import hashlib

        from layoutlang import __version__

        inputs = (FORMAT, __version__, self.src.digest, self.dst.digest, self.ranks_per_node,
                  self.selector_name)
        return hashlib.sha256(repr(inputs).encode("utf-8")).hexdigest()

    def one_line(self) -> str:
        s = self.stats
        return (f"plan {self.src.path} -> {self.dst.path}: {s['tensors']} tensors, {s['ops']} ops, "
                f"{s['bytes']} B, busiest sender {s['send_balance']:.2f}x floor")


def _as_layout(x, args) -> Layout:
    if isinstance(x, Layout):
        return x
    return load(os.fspath(x), args, unknown_args="ignore")


def compile_plan(src, dst, *, args: dict[str, int] | None = None,
                 src_args: dict[str, int] | None = None, dst_args: dict[str, int] | None = None,
                 ranks_per_node: int | None = None, selector: str = "balanced", progress=None) -> Plan:
    """Compile the plan that moves every destination tensor's data from the source.

    `src`/`dst` are paths or loaded layouts. `args` sets args in both layouts
    (each takes the ones it declares; one that neither declares is an error);
    `src_args`/`dst_args` set one side only.
    """
    from layoutlang.diagnostics import UsageError

    if selector not in SELECTORS:
        raise UsageError(f"selector {selector!r}: expected one of {', '.join(sorted(SELECTORS))}")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"ranks_per_node {ranks_per_node}: expected a positive integer")
    common = dict(args or {})
    s_args = {**common, **(src_args or {})}
    d_args = {**common, **(dst_args or {})}
    if progress:
        progress("layouts", 0, 2)
    src_layout = _as_layout(src, s_args)
    if progress:
        progress("layouts", 1, 2)
    dst_layout = _as_layout(dst, d_args)
    declared = {n for n, _ in src_layout.args} | {n for n, _ in dst_layout.args}
    for name in common:
        if not isinstance(src, Layout) and not isinstance(dst, Layout) and name not in declared:
            raise UsageError(f"--set {name}: neither layout has an arg `{name}`")
    if progress:
        progress("layouts", 2, 2)
    with gc_paused():
        return Plan(src_layout, dst_layout, ranks_per_node=ranks_per_node, selector=selector, progress=progress)
