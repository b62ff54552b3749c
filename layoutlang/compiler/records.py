"""The records compiler stages hand each other and the Plan keeps: ops, requests, geometries, templates.

A `Geometry` is what destination instances that cut and place alike share (pieces,
requests, the alternatives of each piece); a `Template` is a geometry and its members;
`op_offsets` numbers their ops. layoutlang/compiler/plan.py holds them in the Plan, the stages
(split.py, relay.py, members.py, tables.py) make and read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from layoutlang.modes import cached_property

from . import strides
from .pieces import Piece, Slice, Source
from .ranks import RankSet
from .shards import Placement
from .wire import op_wire


@dataclass(frozen=True)
class Op:
    """Copy src_slice of src_name on src_rank into dst_slice of dst_name on dst_rank."""

    id: int
    key: str
    src_rank: int
    dst_rank: int
    src_name: str
    dst_name: str
    src_slice: Slice  # per dim (start, stop), or strided: (start, stop, step[, block]) (strides.py)
    dst_slice: Slice
    bytes: int
    # a key stored transposed on one side only (LANGUAGE.md 8.3): the source block is (p, q) in
    # its storage order (stacked dims left out) and the destination stores its transpose (q, p)
    transpose: tuple[int, int] | None = None
    # the destination's quantized format when the op carries data and scales (layoutlang/compiler/wire.py);
    # None: the bf16-path wire dtype (`wire_dtype`)
    wire: str | None = None
    # a relay (LANGUAGE.md 5): src_rank forwards what these ops delivered to it, reading its own
    # destination tensor (src_name is then a destination tensor, src_slice its local slice)
    after: tuple[int, ...] = ()

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        sl = strides.slice_text  # a strided dim reads start:stop:step[:block]
        wire = f" {self.wire}" if self.wire else ""
        waits = f" after {', '.join(map(str, self.after))}" if self.after else ""
        return (f"op {self.id} {self.key}: rank {self.src_rank} {self.src_name}{sl(self.src_slice)} -> "
                f"rank {self.dst_rank} {self.dst_name}{sl(self.dst_slice)} ({self.bytes} B{wire}){waits}")


@dataclass(frozen=True)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    src_dtype: str
    dst_dtype: str


# A key's view of its stored tensor: (logical box, stacked dims, transposed), and for a key of a flat
# dim (docs/language.md 14.9) its KeyM (modes.py: the key's dims) fourth; None: the whole tensor.
Box = tuple | None


def region_box(r, t) -> Box:
    """The Box of KeyRegion `r` of stored tensor `t` (None: None)."""
    if r is None:
        return None
    if r.shape is not None:
        from .match import flat_key
        return (r.box, r.stacked, r.transposed, flat_key(t, r))
    return (r.box, r.stacked, r.transposed)


@dataclass(frozen=True)
class Request:
    """One destination rank's need for one piece, and every rank that can feed it."""

    rank: int            # the destination rank
    piece: int           # index into Geometry.pieces
    bytes: int           # on the wire, per instance
    senders: RankSet     # shared by every request for this piece
    wire: str | None = None  # quantized wire format (layoutlang/compiler/wire.py), None: the bf16 path


@dataclass(frozen=True)
class Geometry:
    """What every destination instance that cuts and places alike shares: computed once, frozen.

    `requests` are in canonical order (destination rank, then piece);
    `alternatives[k]` are piece k's sources, each with the ranks that hold it.
    A split geometry (split.py `split_geometry`) appends the parts of its split pieces
    after the pieces that tile the shards; a split request becomes requests for
    its parts, in place.
    """

    dst: Placement
    src: tuple[Placement, ...]
    wire_bytes: int
    pieces: tuple[Piece, ...]
    requests: tuple[Request, ...]
    alternatives: tuple[tuple[tuple[Source, RankSet], ...], ...]
    dst_box: Box = None                 # the key's region in the stored tensor (v2 part keys), or None
    src_boxes: tuple[Box, ...] = ()
    tiling: int | None = None           # pieces[tiling:] are parts of split pieces (None: nothing split)
    dst_dtype: str = "bf16"
    wire_mode: str = "auto"
    dst_local: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (rank, local shape) of every destination rank

    @cached_property
    def _local_of(self) -> dict[int, tuple[int, ...]]:
        return dict(self.dst_local)

    @cached_property
    def request_ranks(self) -> tuple[int, ...]:
        """Each request's destination rank: what one rank's ops test (layoutlang/compiler/tables.py's moved
        geometries answer it without making their requests)."""
        return tuple(q.rank for q in self.requests)

    def request(self, rank: int, k: int, piece: Piece, senders: RankSet, wires: dict | None = None) -> Request:
        """The request of `rank` for piece k, with its wire format and bytes (layoutlang/compiler/wire.py);
        `wires` memoizes `op_wire` (a pure function of its arguments) for one compilation."""
        local = self._local_of.get(rank)  # None: a plain destination (a 0-dim one's shape is ())
        if local is None:
            return Request(rank, k, piece.elements * self.wire_bytes, senders, None)
        key = (piece.dst_slice, local, self.dst_dtype, self.wire_mode)
        found = wires.get(key) if wires is not None else None
        if found is None:
            found = op_wire(*key)
            if wires is not None:
                wires[key] = found
        wire, nbytes = found
        return Request(rank, k, nbytes, senders, wire)

    def is_part(self, request: Request) -> bool:
        """Whether the request is for a part of a split piece."""
        return self.tiling is not None and request.piece >= self.tiling

    def source_for(self, k: int, rank: int) -> Source:
        """The alternative of piece k that `rank` holds (the first one wins)."""
        for src, holders in self.alternatives[k]:
            if rank in holders.members:
                return src
        raise AssertionError((k, rank))


@dataclass(frozen=True)
class Template:
    """A geometry and the destination instances (indexes into Plan.matches) that share it."""

    geometry: Geometry
    members: tuple[int, ...]


@dataclass(frozen=True)
class Transfer:
    """One op before it is named: what `Plan.transfers` yields and every consumer reads."""

    op_id: int
    instance: int        # index into Plan.matches
    dst_rank: int
    piece: Piece
    sender: int
    source: Source       # the alternative the sender holds
    bytes: int
    senders: RankSet     # every rank that could have sent it
    wire: str | None = None  # the op's quantized wire format, None: the bf16 path
    after: tuple[int, ...] = ()  # a relay: the op that delivered the piece to `sender` (source: RELAYED)


# A relay's source (Transfer.source): the sender's own destination tensor, at the piece's dst_slice.
RELAYED = -1


def op_offsets(instances: list[tuple[int, int]], templates: tuple[Template, ...]) -> list[int]:
    """The first op id of every destination instance, and the op count last."""
    offsets, acc = [], 0
    for ti, _ in instances:
        offsets.append(acc)
        acc += len(templates[ti].geometry.requests)
    offsets.append(acc)
    return offsets
