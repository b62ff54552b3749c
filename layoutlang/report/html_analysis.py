"""What the plan says, for the HTML report: traffic, ranks in blocks, tensor groups.

This module answers questions about the plan and draws nothing (html_svg.py
places things, html_page.py writes the page). It reads the plan's public
model only: its grouped form (`Plan.templates`, `Plan.picks`,
`Plan.template_of`) for totals, so that a 300k-op plan is summarised without
building its ops, and `Plan.transfers` for the blocks a picture draws.

Grouping: keys whose names differ only in digits (`decoder.layers.{n}.mlp...`)
form a *pattern*; keys of one pattern whose destination instances share
templates form a *group*, drawn once: the same template means the same
blocks, holders and receivers. The bounds that keep the page small for any
world live here, because they decide what is shown: the heatmap aggregates
ranks into at most MAX_CELLS blocks per axis, bars into MAX_BARS, a picture
draws at most MAX_BLOCKS blocks, and at most MAX_PICTURES groups
(MAX_REPORT_BLOCKS blocks in all) are drawn; a group cut like a drawn one
links to it.

>>> compact_name(["layers.0.w1", "layers.1.w1", "layers.3.w1"])
'layers.{0..1, 3}.w1'
>>> rank_blocks([0, 1, 2, 3, 4], 2)
(3, [[0, 1, 2], [3, 4]])
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, deque
from dataclasses import dataclass

from layoutlang.compiler.plan import Plan, TensorEntry
from layoutlang.compiler.strides import blocks
from layoutlang.ir import TensorIR

from .render import covered_ranks
from .units import rank_ranges

MAX_CELLS = 64        # heatmap blocks per axis; a larger world is aggregated into blocks of ranks
MAX_BARS = 256        # bars per chart; a larger world shows the busiest rank of each block
MAX_BLOCKS = 400      # rectangles per tensor picture ("N more" beyond)
MAX_PICTURES = 120    # groups drawn per report; the others link to a drawn group cut alike
MAX_REPORT_BLOCKS = 6000  # blocks over all pictures (each is drawn twice: source and destination)
DIGITS = re.compile(r"\d+")


def compact_name(keys: list[str]) -> str:
    """Keys that differ only in digits, written once: each varying number as `{ranges}`."""
    first = keys[0]
    numbers = [[int(m) for m in DIGITS.findall(k)] for k in keys]
    parts = DIGITS.split(first)
    out = [parts[0]]
    for i, tail in enumerate(parts[1:]):
        values = sorted({n[i] for n in numbers})
        out.append(str(values[0]) if len(values) == 1 else "{" + rank_ranges(values) + "}")
        out.append(tail)
    return "".join(out)


# ---- traffic: who sends how much to whom, from the templates --------------------

def traffic(plan: Plan) -> dict[tuple[int, int], list[int]]:
    """(sender, receiver) -> [bytes, ops], local copies included (sender == receiver)."""
    pairs: dict[tuple[int, int], list[int]] = {}
    for ti, t in enumerate(plan.templates):
        for j, req in enumerate(t.geometry.requests):
            for sender, n in Counter(plan.picks(ti, j)).items():
                e = pairs.setdefault((sender, req.rank), [0, 0])
                e[0] += n * req.bytes
                e[1] += n
    return pairs


@dataclass(frozen=True)
class RankLoads:
    """Bytes per rank: sent and received over the network, copied locally; who sends and receives."""

    senders: tuple[int, ...]       # source ranks and every rank that sends, sorted
    receivers: tuple[int, ...]     # destination ranks and every rank that receives, sorted
    send_net: dict[int, int]
    recv_net: dict[int, int]
    local: dict[int, int]

    @property
    def receiving(self) -> int:
        """Destination ranks that get any byte (network or local copy)."""
        return sum(1 for r in self.receivers if self.recv_net.get(r) or self.local.get(r))


def rank_loads(plan: Plan, pairs: dict[tuple[int, int], list[int]]) -> RankLoads:
    send_net: dict[int, int] = {}
    recv_net: dict[int, int] = {}
    local: dict[int, int] = {}
    for (s, d), (nbytes, _) in pairs.items():
        if s == d:
            local[s] = local.get(s, 0) + nbytes
        else:
            send_net[s] = send_net.get(s, 0) + nbytes
            recv_net[d] = recv_net.get(d, 0) + nbytes
    return RankLoads(_senders(plan, pairs), _receivers(plan, pairs), send_net, recv_net, local)


def _senders(plan: Plan, pairs) -> tuple[int, ...]:
    return tuple(sorted(set(covered_ranks(plan.src)) | {s for s, _ in pairs}))


def _receivers(plan: Plan, pairs) -> tuple[int, ...]:
    return tuple(sorted(set(covered_ranks(plan.dst)) | {d for _, d in pairs}))


def rank_blocks(ranks, limit: int) -> tuple[int, list[list[int]]]:
    """Consecutive blocks of at most ceil(len / limit) ranks, so that there are at most `limit`."""
    ranks = list(ranks)
    size = max(1, math.ceil(len(ranks) / limit))
    return size, [ranks[i:i + size] for i in range(0, len(ranks), size)]


@dataclass(frozen=True)
class BlockTraffic:
    """The rank x rank traffic aggregated into at most MAX_CELLS x MAX_CELLS blocks of ranks."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    block_rows: int                        # senders per row block
    block_cols: int
    row_blocks: list[list[int]]
    col_blocks: list[list[int]]
    cells: dict[tuple[int, int], list[int]]  # (row block, col block) -> [bytes, ops, local bytes]


def block_traffic(plan: Plan, pairs: dict[tuple[int, int], list[int]]) -> BlockTraffic:
    senders, receivers = _senders(plan, pairs), _receivers(plan, pairs)
    br, row_blocks = rank_blocks(senders, MAX_CELLS)
    bc, col_blocks = rank_blocks(receivers, MAX_CELLS)
    row_of = {r: i // br for i, r in enumerate(senders)}
    col_of = {r: i // bc for i, r in enumerate(receivers)}
    agg: dict[tuple[int, int], list[int]] = {}
    for (s, d), (nbytes, ops) in pairs.items():
        e = agg.setdefault((row_of[s], col_of[d]), [0, 0, 0])
        e[0] += nbytes
        e[1] += ops
        if s == d:
            e[2] += nbytes
    return BlockTraffic(senders, receivers, br, bc, row_blocks, col_blocks, agg)


# ---- tensor groups --------------------------------------------------------------------

@dataclass(frozen=True)
class KeyBlock:
    """One logical rectangle of a key: who holds it, who receives it and from whom (the plan's ops).

    `logical` is the rectangle in the destination STORED tensor's logical
    coordinates, `src_logical` the same elements in the (first) source stored
    tensor's: they differ when a key sits inside a fused, stacked or transposed
    tensor on either side (v2), and are equal for a v1 key.
    """

    logical: tuple[tuple[int, int], ...]
    holders: tuple[int, ...]   # every rank that holds it (any can send)
    dst: tuple[int, ...]       # receivers
    src: tuple[int, ...]       # the sender of each receiver, same order
    elements: int
    src_logical: tuple[tuple[int, int], ...]
    relayed: tuple[bool, ...] = ()  # per receiver: its sender is a replica forwarding it (an op with `after`)

    def sent(self) -> tuple[tuple[int, int], ...]:
        """(sender, receiver) of the sends that leave a source rank (relays left out)."""
        flags = self.relayed or (False,) * len(self.dst)
        return tuple((s, r) for s, r, relay in zip(self.src, self.dst, flags) if not relay)


def _in_stored(logical, region) -> tuple[tuple[int, int], ...]:
    """A rectangle of a key, in its stored tensor's logical coordinates: the key's dims back in
    storage order (reversed when `transposed`, LANGUAGE.md 8.3), shifted to the key's corner, and
    the stacked dims put back at the key's index.

    >>> from layoutlang.ir import KeyRegion
    >>> gate = KeyRegion("e1.gate", ((1, 2), (0, 64), (0, 32)), (0,), True)  # [E, H, 2I] transposed
    >>> _in_stored(((8, 9), (0, 64)), gate)  # key row 8 = stored column 8
    ((1, 2), (0, 64), (8, 9))
    """
    if region is None:
        return tuple(logical)
    if region.shape is not None:  # a flat dim's key: its row-major range (`_flat_rows` made it contiguous)
        at, stride = 0, 1
        for (a, _), n in zip(reversed(logical), reversed(region.shape)):
            at, stride = at + a * stride, stride * n
        count = math.prod(b - a for a, b in logical)
        return ((region.box[0][0] + at, region.box[0][0] + at + count),)
    it = iter(logical[::-1] if region.transposed else logical)
    out = []
    for d, box in enumerate(region.box):
        if d in region.stacked:
            out.append(box)
        else:
            a, b = next(it)
            out.append((a + box[0], b + box[0]))
    return tuple(out)


def _flat_rows(box, regions) -> list[tuple[tuple[int, int], ...]]:
    """A key's box as boxes each contiguous in the key's row-major order, where a side stores the
    key in a flat dim (docs/language.md 14.9: drawn as its ranges there); else the box itself."""
    if not any(r is not None and r.shape is not None for r in regions):
        return [box]
    shape = next(r.shape for r in regions if r is not None and r.shape is not None)
    out, todo = [], [tuple(box)]
    while todo:
        b = todo.pop()
        # contiguous: every dim after the first one of extent > 1 is whole
        first = next((d for d, (x, y) in enumerate(b) if y - x > 1), len(b))
        if all(b[d] == (0, shape[d]) for d in range(first + 1, len(b))):
            out.append(b)
            continue
        x, y = b[first]
        todo.extend(b[:first] + ((k, k + 1),) + b[first + 1:] for k in reversed(range(x, y)))
    return sorted(out)


def _plain_boxes(logical) -> list[tuple[tuple[int, int], ...]]:
    """A logical slice as boxes: itself when every dim is `(start, stop)`, else one box per
    combination of its strided dims' blocks (layoutlang/compiler/strides.py)."""
    if all(isinstance(e, tuple) and len(e) == 2 for e in logical):  # else strided, or a chain
        return [tuple(logical)]
    return [tuple(box) for box in itertools.product(*(blocks(e) for e in logical))]


def key_blocks(plan: Plan, instances: list[int]) -> tuple[KeyBlock, ...]:
    """The plan's ops for one key, merged per logical rectangle (replicas receive the same one).

    Rectangles are in the STORED tensors' logical coordinates: a key inside a
    fused, stacked or transposed tensor (v2) is drawn where it lies in that
    tensor, on each side.
    """
    found: dict[tuple, tuple] = {}
    for i in instances:
        m = plan.matches[i]
        for t in plan.transfers(instance=i):
            # a strided piece (docs/compiler.md) whose logical set is not one box: one block per box
            for box in (row for b in _plain_boxes(t.piece.logical)
                        for row in _flat_rows(b, (m.region, m.src_region(0)))):
                logical = _in_stored(box, m.region)
                hit = found.get(logical)
                if hit is None:
                    hit = found[logical] = (tuple(t.senders), [], [], math.prod(b - a for a, b in box),
                                            _in_stored(box, m.src_region(0)), [])
                hit[1].append(t.dst_rank)
                hit[2].append(t.sender)
                hit[5].append(bool(t.after))
    return tuple(KeyBlock(logical, holders, tuple(dst), tuple(src), elements, src_logical,
                          tuple(relayed) if any(relayed) else ())
                 for logical, (holders, dst, src, elements, src_logical, relayed) in found.items())


@dataclass(frozen=True)
class TensorGroup:
    """Keys of one pattern that share templates: what the plan moves for them, and whether it is drawn."""

    index: int
    pattern: str                   # the name with every number as `{n}`
    keys: tuple[str, ...]
    entry: TensorEntry             # the first key's shape and dtypes
    dst: TensorIR                  # the first key's destination and (first) source tensor
    src: TensorIR
    ops: int                       # all keys of the group
    bytes: int
    receivers: tuple[int, ...]     # of the first key
    senders: tuple[int, ...]       # of every key
    blocks: tuple[KeyBlock, ...]   # the first key's blocks, at most MAX_BLOCKS of them
    more: int                      # the first key's blocks beyond MAX_BLOCKS
    drawn: bool                    # one of the (at most MAX_PICTURES) groups the report draws
    like: int | None               # a drawn group cut alike, when this one is not drawn


def tensor_groups(plan: Plan) -> tuple[TensorGroup, ...]:
    """Keys grouped by name pattern, then by shared templates; which of them are drawn (MAX_PICTURES).

    Patterns come in the order of their first key, groups in destination order within them.
    """
    instances: dict[str, list[int]] = {}
    for i, m in enumerate(plan.matches):
        instances.setdefault(m.key, []).append(i)
    entries = {e.key: e for e in plan.tensors}
    by_group: dict[tuple, list[str]] = {}
    for key, found in instances.items():
        sig = (DIGITS.sub("{n}", key), tuple(plan.template_of(i)[0] for i in found))
        by_group.setdefault(sig, []).append(key)
    # Which groups get a picture: patterns take turns, each drawing a cut (set of blocks) it has not drawn yet.
    shape_of: dict[tuple, tuple] = {}
    blocks_of: dict[tuple, tuple[KeyBlock, ...]] = {}
    for sig, keys in by_group.items():
        blocks_of[sig] = key_blocks(plan, instances[keys[0]])
        shape_of[sig] = (sig[0], tuple(sorted(d.logical for d in blocks_of[sig])))
    queues: dict[str, deque[tuple]] = {}
    for sig in by_group:
        queues.setdefault(sig[0], deque()).append(sig)
    chosen: set[tuple] = set()
    drawn_shape: dict[tuple, tuple] = {}
    budget = MAX_REPORT_BLOCKS
    while len(chosen) < MAX_PICTURES:
        progress = False
        for queue in queues.values():
            while queue and (shape_of[queue[0]] in drawn_shape
                             or min(MAX_BLOCKS, len(blocks_of[queue[0]])) > budget):
                queue.popleft()
            if queue and len(chosen) < MAX_PICTURES:
                sig = queue.popleft()
                chosen.add(sig)
                drawn_shape[shape_of[sig]] = sig
                budget -= min(MAX_BLOCKS, len(blocks_of[sig]))
                progress = True
        if not progress:
            break
    number = {sig: n for n, sig in enumerate(by_group)}
    out = []
    for sig, keys in by_group.items():
        first = instances[keys[0]]
        m = plan.matches[first[0]]
        blocks = blocks_of[sig]
        requests = [req for i in first for req in plan.templates[plan.template_of(i)[0]].geometry.requests]
        like = drawn_shape.get(shape_of[sig])
        senders = {plan.picks(ti, j)[member] for key in keys for ti, member in map(plan.template_of, instances[key])
                   for j in range(len(plan.templates[ti].geometry.requests))}
        drawn = sig in chosen
        out.append(TensorGroup(
            number[sig], sig[0], tuple(keys), entries[keys[0]], m.dst, m.src[0],
            len(requests) * len(keys), sum(req.bytes for req in requests) * len(keys),
            tuple(sorted({r for d in blocks for r in d.dst})), tuple(sorted(senders)),
            blocks[:MAX_BLOCKS], max(0, len(blocks) - MAX_BLOCKS), drawn,
            None if (drawn or like is None) else number[like]))
    return tuple(out)


__all__ = ["traffic", "rank_loads", "rank_blocks", "block_traffic", "key_blocks", "tensor_groups",
           "compact_name", "RankLoads", "BlockTraffic", "KeyBlock", "TensorGroup"]
