"""The HTML report of a plan: one self-contained page (`layoutc plan --format html`).

The page shows the plan against the floor (DESIGN.md, performance model), a
rank x rank traffic heatmap, per-rank send and receive bars, one picture per
group of tensors that are cut alike, and both `.layout` sources highlighted.
Everything is inline (CSS, JS, SVG; a Content-Security-Policy forbids any
fetch), rendered by jinja2 with autoescaping on (templates/report*.j2).

Like the other renderers it only reads the plan and decides nothing. It reads
the plan's public model: its grouped form (`Plan.templates`, `Plan.picks`) for
totals, so that a 300k-op plan is summarised without building its ops, and
`Plan.transfers` for the blocks it draws.

Grouping: keys whose names differ only in digits (`decoder.layers.{n}.mlp...`)
form a *pattern*; keys of one pattern whose destination instances share
templates form a *group*, drawn once: the same template means the same
blocks, holders and receivers. Bounds keep the page small for any world:
the heatmap aggregates ranks into at most MAX_CELLS blocks per axis, bars into
MAX_BARS, a picture draws at most MAX_BLOCKS blocks, and at most MAX_PICTURES
groups (MAX_REPORT_BLOCKS blocks in all) are drawn; a group cut like a drawn
one links to it.

Each block of a destination picture carries `data-logical` (per dim
`lo:hi` of the logical tensor), `data-dst-rank` (the ranks receiving it,
space-separated) and `data-src-rank` (the sender of each, in the same order):
exactly the plan's ops for the group's first key.

>>> compact_name(["layers.0.w1", "layers.1.w1", "layers.3.w1"])
'layers.{0..1, 3}.w1'
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import jinja2
from markupsafe import Markup

from layoutlang.ir import Layout
from layoutlang.modes import PadRun, part_leaves

from .graph import buckets
from .plan import Plan
from .render import TEMPLATES, covered_ranks, human_bytes, rank_ranges
from .shards import Placement, placement_of, shards

MAX_CELLS = 64        # heatmap blocks per axis; a larger world is aggregated into blocks of ranks
MAX_BARS = 256        # bars per chart; a larger world shows the busiest rank of each block
MAX_BLOCKS = 400      # rectangles per tensor picture ("N more" beyond)
MAX_PICTURES = 120    # groups drawn per report; the others link to a drawn group cut alike
MAX_REPORT_BLOCKS = 6000  # blocks over all pictures (each is drawn twice: source and destination)
MAX_LABELS = 32       # part labels per axis of a picture
MAX_PAD_STRIPS = 8    # padding strips per side and axis
PIC_W = 400           # picture width in px (the logical columns)
PIC_H_MAX = 300       # picture height bounds in px (rows keep their aspect between them)
PIC_H_MIN = 48
MARGIN_L, MARGIN_T = 58, 18  # room for row / column part labels
HEAT_PX = 640         # heatmap side in px (cells are square, 4..24 px)
BAR_W, BAR_H = 720, 130
DIGITS = re.compile(r"\d+")
# viridis, reversed: few bytes light, many bytes dark
HEAT_STOPS = ((0xfd, 0xe7, 0x25), (0x5e, 0xc9, 0x62), (0x21, 0x91, 0x8c), (0x3b, 0x52, 0x8b), (0x44, 0x01, 0x54))


# ---- records handed to the templates ---------------------------------------------

@dataclass(frozen=True)
class Tick:
    pos: float
    label: str


@dataclass(frozen=True)
class Cell:
    x: float
    y: float
    w: float
    h: float
    fill: str
    title: str
    local: bool


@dataclass(frozen=True)
class Heatmap:
    width: float
    height: float
    left: float
    top: float
    right: float         # the grid's far corner
    bottom: float
    cells: tuple[Cell, ...]
    row_ticks: tuple[Tick, ...]
    col_ticks: tuple[Tick, ...]
    rows: int            # source ranks
    cols: int            # destination ranks
    block_rows: int      # ranks per row block (1: one row per rank)
    block_cols: int
    low: str             # legend ends
    high: str


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    net_y: float
    net_h: float
    local_y: float
    local_h: float
    title: str


@dataclass(frozen=True)
class BarChart:
    title: str
    width: float
    height: float
    top: float
    bars: tuple[Bar, ...]
    floor_y: float | None
    floor_label: str
    ticks: tuple[Tick, ...]
    block: int           # ranks per bar
    peak: str


@dataclass(frozen=True)
class Block:
    """One rectangle of a tensor picture."""

    x: float
    y: float
    w: float
    h: float
    fill: str
    logical: str         # data-logical: `lo:hi` per dim, comma-separated
    dst_ranks: str       # data-dst-rank: receivers, space-separated
    src_ranks: str       # data-src-rank: the sender of each receiver, same order
    holders: str         # data-holders: every rank that holds it (any can send)
    label: str           # text drawn inside, or ""
    title: str


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float


@dataclass(frozen=True)
class Label:
    x: float
    y: float
    text: str
    anchor: str


@dataclass(frozen=True)
class PadStrip:
    x: float
    y: float
    w: float
    h: float
    dim: int
    title: str
    label: str


@dataclass(frozen=True)
class Picture:
    side: str            # "src" or "dst"
    key: str
    caption: str
    width: float
    height: float
    frame: tuple[float, float, float, float]
    blocks: tuple[Block, ...]
    more: int            # blocks not drawn (MAX_BLOCKS)
    lines: tuple[Line, ...]
    labels: tuple[Label, ...]
    pads: tuple[PadStrip, ...]


@dataclass(frozen=True)
class Group:
    index: int
    name: str            # compact: digits that vary shown as {ranges}
    keys: tuple[str, ...]
    shape: str
    dtypes: str
    ops: int             # all keys of the group
    bytes: int
    pictures: tuple[Picture, ...]   # () when not drawn
    like: int | None     # a drawn group cut alike, when this one is not drawn
    summary: str         # receivers and senders, one line


@dataclass(frozen=True)
class Pattern:
    name: str
    groups: tuple[Group, ...]
    keys: int


# ---- small helpers ------------------------------------------------------------------

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


def short_ranks(ranks, limit: int = 60) -> str:
    text = rank_ranges(ranks)
    if len(text) <= limit:
        return text
    return text[:limit - 1].rsplit(", ", 1)[0] + f", ... ({len(set(ranks))} ranks)"


def _color(i: int) -> str:
    """A distinct pastel per index (golden-angle hues)."""
    return f"hsl({(i * 137.508) % 360:.0f},60%,{68 if i % 2 else 58}%)"


def _heat(t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(HEAT_STOPS) - 1)
    i = min(int(t), len(HEAT_STOPS) - 2)
    f = t - i
    a, b = HEAT_STOPS[i], HEAT_STOPS[i + 1]
    return "#%02x%02x%02x" % tuple(round(x + (y - x) * f) for x, y in zip(a, b))


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _ranks_word(ranks) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {short_ranks(ranks)}"


def _layout_title(layout: Layout) -> str:
    return f"{layout.path} ({layout.name})" if layout.name else layout.path


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


def _blocks_of(ranks: list[int], limit: int) -> tuple[int, list[list[int]]]:
    size = max(1, math.ceil(len(ranks) / limit))
    return size, [ranks[i:i + size] for i in range(0, len(ranks), size)]


def heatmap(plan: Plan, pairs: dict[tuple[int, int], list[int]]) -> Heatmap:
    senders = sorted(set(covered_ranks(plan.src)) | {s for s, _ in pairs})
    receivers = sorted(set(covered_ranks(plan.dst)) | {d for _, d in pairs})
    br, row_blocks = _blocks_of(senders, MAX_CELLS)
    bc, col_blocks = _blocks_of(receivers, MAX_CELLS)
    row_of = {r: i // br for i, r in enumerate(senders)}
    col_of = {r: i // bc for i, r in enumerate(receivers)}
    agg: dict[tuple[int, int], list[int]] = {}
    for (s, d), (nbytes, ops) in pairs.items():
        e = agg.setdefault((row_of[s], col_of[d]), [0, 0, 0])
        e[0] += nbytes
        e[1] += ops
        if s == d:
            e[2] += nbytes
    cw = max(4, min(40, HEAT_PX // max(1, len(col_blocks))))
    ch = max(4, min(40, HEAT_PX // max(1, len(row_blocks))))
    left, top = 64.0, 64.0
    values = [e[0] for e in agg.values() if e[0]]
    lo, hi = (min(values), max(values)) if values else (1, 1)
    span = math.log(hi) - math.log(lo) if hi > lo else 0.0
    cells = []
    for (i, j), (nbytes, ops, local) in sorted(agg.items()):
        rows, cols = row_blocks[i], col_blocks[j]
        who = (f"rank {rows[0]} -> rank {cols[0]}" if br == bc == 1 else
               f"{_ranks_word(rows)} -> {_ranks_word(cols)}")
        title = f"{who}: {human_bytes(nbytes)} in {_counted(ops, 'op')}"
        if local:
            title += " (local copy)" if local == nbytes else f", {human_bytes(local)} of it local copies"
        t = (math.log(nbytes) - math.log(lo)) / span if span else 1.0
        cells.append(Cell(left + j * cw, top + i * ch, cw, ch, _heat(t), title, bool(local)))
    every_r = max(1, math.ceil(len(row_blocks) / 16))
    every_c = max(1, math.ceil(len(col_blocks) / 16))
    row_ticks = tuple(Tick(top + (i + 0.5) * ch, str(b[0]) if br == 1 else f"{b[0]}..{b[-1]}")
                      for i, b in enumerate(row_blocks) if i % every_r == 0)
    col_ticks = tuple(Tick(left + (j + 0.5) * cw, str(b[0]) if bc == 1 else f"{b[0]}..{b[-1]}")
                      for j, b in enumerate(col_blocks) if j % every_c == 0)
    return Heatmap(max(360.0, left + len(col_blocks) * cw + 8), top + len(row_blocks) * ch + 8, left, top,
                   left + len(col_blocks) * cw, top + len(row_blocks) * ch,
                   tuple(cells), row_ticks, col_ticks, len(senders), len(receivers), br, bc,
                   human_bytes(lo) if values else "0 B", human_bytes(hi) if values else "0 B")


def bar_chart(title: str, verb: str, ranks: list[int], network: dict[int, int], local: dict[int, int],
              floor: float, floor_label: str) -> BarChart:
    """One bar per rank (the busiest rank of each block when there are more than MAX_BARS)."""
    size, blocks = _blocks_of(ranks, MAX_BARS)
    left, top, height = 56.0, 18.0, float(BAR_H)
    peak = max([network.get(r, 0) + local.get(r, 0) for r in ranks] + [floor, 1])
    width = min(24.0, BAR_W / max(1, len(blocks)))
    bars = []
    for i, block in enumerate(blocks):
        r = max(block, key=lambda x: (network.get(x, 0), -x))
        net, loc = network.get(r, 0), local.get(r, 0)
        net_h, loc_h = height * net / peak, height * loc / peak
        who = f"rank {r}" if size == 1 else f"{_ranks_word(block)}, busiest rank {r}"
        text = f"{who}: {verb} {human_bytes(net)} over the network"
        if loc:
            text += f", {human_bytes(loc)} by local copy"
        if size > 1:
            text += f"; {human_bytes(sum(network.get(x, 0) for x in block))} over the network in all"
        bars.append(Bar(left + i * width, width, top + height - net_h, net_h,
                        top + height - net_h - loc_h, loc_h, text))
    ticks = tuple(Tick(left + (i + 0.5) * width, str(b[0]))
                  for i, b in enumerate(blocks) if i % max(1, math.ceil(len(blocks) / 16)) == 0)
    floor_y = top + height - height * floor / peak if floor else None
    span = max(300.0, width * len(blocks))
    return BarChart(title, left + span + 8, top + height + 20, top, tuple(bars), floor_y, floor_label, ticks,
                    size, human_bytes(peak))


# ---- tensor pictures ------------------------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    """Logical tensor -> picture: dim 0 down, the other dims flattened across (1-D: a strip)."""

    shape: tuple[int, ...]
    height: float

    @property
    def rows(self) -> int:
        return max(1, self.shape[0]) if len(self.shape) >= 2 else 1

    @property
    def cols(self) -> int:
        if not self.shape:
            return 1
        return max(1, math.prod(self.shape[1:]) if len(self.shape) >= 2 else self.shape[0])

    def rect(self, logical: tuple[tuple[int, int], ...]) -> tuple[float, float, float, float]:
        if not logical:
            r0, r1, c0, c1 = 0, 1, 0, 1
        elif len(logical) == 1:
            (c0, c1), r0, r1 = logical[0], 0, 1
        else:
            (r0, r1), rest = logical[0], logical[1:]
            strides = [math.prod(self.shape[d + 1:]) for d in range(1, len(self.shape))]
            c0 = sum(a * s for (a, _), s in zip(rest, strides))
            c1 = sum((b - 1) * s for (_, b), s in zip(rest, strides)) + 1  # bounding range when flattened
        sx, sy = PIC_W / self.cols, self.height / self.rows
        return (MARGIN_L + c0 * sx, MARGIN_T + r0 * sy, (c1 - c0) * sx, (r1 - r0) * sy)


def _geometry(shape: tuple[int, ...]) -> _Geometry:
    if len(shape) < 2:
        return _Geometry(shape, 28.0)
    rows, cols = max(1, shape[0]), max(1, math.prod(shape[1:]))
    return _Geometry(shape, float(min(PIC_H_MAX, max(PIC_H_MIN, round(PIC_W * rows / cols)))))


def _parts_overlay(dims, geo: _Geometry) -> tuple[list[Line], list[Label]]:
    """Part boundaries as lines and part names along the axes (rows left, columns on top)."""
    lines: list[Line] = []
    labels: list[Label] = []
    if not dims:
        return lines, labels
    top, left = MARGIN_T, MARGIN_L
    bottom, right = MARGIN_T + geo.height, MARGIN_L + PIC_W
    if len(dims) >= 2:
        leaves = part_leaves(dims[0].part_tree)
        if len(leaves) > 1:
            sy = geo.height / geo.rows
            for i, (name, a, b) in enumerate(leaves):
                if i:
                    lines.append(Line(left, top + a * sy, right, top + a * sy))
                if len(leaves) <= MAX_LABELS and (b - a) * sy >= 9:
                    labels.append(Label(left - 4, top + (a + b) / 2 * sy + 3, name, "end"))
        col_dim, stride = 1, math.prod(geo.shape[2:])
    else:
        col_dim, stride = 0, 1
    leaves = part_leaves(dims[col_dim].part_tree)
    if len(leaves) > 1:
        sx = PIC_W / geo.cols
        for i, (name, a, b) in enumerate(leaves):
            if i:
                lines.append(Line(left + a * stride * sx, top, left + a * stride * sx, bottom))
            if len(leaves) <= MAX_LABELS and (b - a) * stride * sx >= 6 * len(name) + 4:
                labels.append(Label(left + (a + b) / 2 * stride * sx, top - 5, name, "middle"))
    return lines, labels


def _padding(p: Placement, geo: _Geometry, dims_count: int) -> tuple[list[PadStrip], float, float]:
    """Hatched strips for stored padding: rows below the picture, other dims to its right.

    Padding has no logical coordinate, so it is drawn beside the logical
    tensor: one strip per distinct padded slice, sized by its share of the dim.
    Returns the strips and the room they take below and to the right.
    """
    below, right = MARGIN_T + geo.height + 4, MARGIN_L + PIC_W + 4
    strips: list[PadStrip] = []
    room_b = room_r = 0.0
    shard_list = shards(p)
    for d in range(dims_count):
        holders: dict[tuple, list[int]] = {}
        for s in shard_list:
            if any(isinstance(r, PadRun) for r in s.runs[d]):
                holders.setdefault(s.runs[d], []).extend(s.ranks)
        unit = "rows" if (d == 0 and dims_count >= 2) else f"elements of dim {d}"
        for n, (runs, ranks) in enumerate(holders.items()):
            if n >= MAX_PAD_STRIPS:
                break
            pads = [r for r in runs if isinstance(r, PadRun)]
            count = sum(r.length for r in pads)
            where = ", ".join(f"{r.local_start}:{r.local_start + r.length}" for r in pads[:4])
            more = f" and {len(holders) - MAX_PAD_STRIPS} more padded slices" if (
                n == MAX_PAD_STRIPS - 1 and len(holders) > MAX_PAD_STRIPS) else ""
            title = (f"padding, dim {d}: {count} {unit} at local {where} on {_ranks_word(ranks)}; "
                     f"stored, never sent, zero on arrival{more}")
            label = f"pad {count} ({_ranks_word(ranks)})"
            if d == 0 and dims_count >= 2:
                h = max(11.0, min(18.0, geo.height * count / geo.rows))
                strips.append(PadStrip(MARGIN_L, below + room_b, PIC_W, h, d, title, label))
                room_b += h + 2
            else:
                w = max(5.0, min(16.0, PIC_W * count / geo.shape[d]))
                strips.append(PadStrip(right + room_r, MARGIN_T, w, geo.height, d, title, ""))
                room_r += w + 2
    return strips, room_b, room_r


@dataclass
class _Drawn:
    """Blocks of one key, gathered from its templates before they are drawn."""

    logical: tuple[tuple[int, int], ...]
    holders: tuple[int, ...]
    dst: list[int]
    src: list[int]
    elements: int


def _key_blocks(plan: Plan, instances: list[int]) -> list[_Drawn]:
    """The plan's ops for one key, merged per logical rectangle (replicas receive the same one)."""
    out: dict[tuple, _Drawn] = {}
    for i in instances:
        for t in plan.transfers(instance=i):
            d = out.get(t.piece.logical)
            if d is None:
                d = out[t.piece.logical] = _Drawn(t.piece.logical, tuple(t.senders), [], [], t.piece.elements)
            d.dst.append(t.dst_rank)
            d.src.append(t.sender)
    return list(out.values())


def _part_names(dims, logical) -> str:
    """Names of the parts a block touches, e.g. `gate` or `q, k`."""
    names = []
    for dim, (a, b) in zip(dims, logical):
        hit = [n for n, lo, hi in part_leaves(dim.part_tree) if n and lo < b and a < hi]
        if hit:
            names.append(", ".join(hit[:4]) + (", ..." if len(hit) > 4 else ""))
    return "; ".join(names)


def _pictures(key: str, drawn: list[_Drawn], dst_tensor, src_tensor) -> tuple[Picture, ...]:
    """Source and destination pictures of one key: the same blocks, coloured by holders / receivers."""
    dims = dst_tensor.dims
    geo = _geometry(dst_tensor.logical_shape)
    lines, labels = _parts_overlay(dims, geo)
    shown, more = drawn[:MAX_BLOCKS], max(0, len(drawn) - MAX_BLOCKS)
    holder_color: dict[tuple, int] = {}
    dst_color: dict[tuple, int] = {}
    out = []
    for side, tensor in (("src", src_tensor), ("dst", dst_tensor)):
        blocks = []
        for d in shown:
            x, y, w, h = geo.rect(d.logical)
            logical = ",".join(f"{a}:{b}" for a, b in d.logical)
            where = ", ".join(f"{a}:{b}" for a, b in d.logical)
            parts = _part_names(dims, d.logical)
            parts = f" ({parts})" if parts else ""
            dst_ranks = " ".join(map(str, d.dst))
            src_ranks = " ".join(map(str, d.src))
            if side == "src":
                fill = _color(holder_color.setdefault(d.holders, len(holder_color)))
                text = short_ranks(d.holders, 24)
                title = (f"[{where}]{parts}: held by {_ranks_word(d.holders)}; sent "
                         + "; ".join(f"{s} -> {r}" for s, r in list(zip(d.src, d.dst))[:8])
                         + (" ..." if len(d.dst) > 8 else ""))
            else:
                fill = _color(dst_color.setdefault(tuple(d.dst), len(dst_color)))
                text = short_ranks(d.dst, 24)
                title = (f"[{where}]{parts}: received by {_ranks_word(d.dst)}, "
                         f"{_counted(len(d.dst), 'op')} from {_ranks_word(sorted(set(d.src)))}")
            label = text if (w >= 5.6 * len(text) + 4 and h >= 11) else ""
            blocks.append(Block(x, y, w, h, fill, logical, dst_ranks, src_ranks,
                                " ".join(map(str, d.holders)), label, title))
        pads, room_b, room_r = _padding(placement_of(tensor), geo, len(tensor.dims))
        what = ("source: colour = the ranks that hold each block (any can send it)" if side == "src"
                else "destination: colour = the ranks that receive each block")
        caption = f"{tensor.name} {list(tensor.local_shape)} local, {tensor.dtype} — {what}"
        frame = (MARGIN_L, MARGIN_T, PIC_W, geo.height)
        out.append(Picture(side, key, caption, MARGIN_L + PIC_W + 8 + room_r,
                           MARGIN_T + geo.height + 8 + room_b, frame, tuple(blocks), more,
                           tuple(lines), tuple(labels), tuple(pads)))
    return tuple(out)


def tensor_groups(plan: Plan) -> tuple[Pattern, ...]:
    """Keys grouped by name pattern, then by shared templates; pictures for up to MAX_PICTURES."""
    instances: dict[str, list[int]] = {}
    for i, m in enumerate(plan.matches):
        instances.setdefault(m.dst.key, []).append(i)
    entries = {e.key: e for e in plan.tensors}
    by_group: dict[tuple, list[str]] = {}
    for key, found in instances.items():
        sig = (DIGITS.sub("{n}", key), tuple(plan.template_of(i)[0] for i in found))
        by_group.setdefault(sig, []).append(key)
    # Which groups get a picture: patterns take turns, each drawing a cut (set of blocks) it has not drawn yet.
    shape_of: dict[tuple, tuple] = {}
    blocks_of: dict[tuple, list[_Drawn]] = {}
    for sig, keys in by_group.items():
        blocks_of[sig] = _key_blocks(plan, instances[keys[0]])
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
    patterns: dict[str, list[Group]] = {}
    for sig, keys in by_group.items():
        first = instances[keys[0]]
        m = plan.matches[first[0]]
        entry = entries[keys[0]]
        drawn = blocks_of[sig]
        requests = [req for i in first for req in plan.templates[plan.template_of(i)[0]].geometry.requests]
        ops, nbytes = len(requests), sum(req.bytes for req in requests)
        pictures = _pictures(keys[0], drawn, m.dst, m.src[0]) if sig in chosen else ()
        like = drawn_shape.get(shape_of[sig])
        receivers = sorted({r for d in drawn for r in d.dst})
        senders = sorted({plan.picks(ti, j)[member] for key in keys for ti, member in map(plan.template_of, instances[key])
                          for j in range(len(plan.templates[ti].geometry.requests))})
        summary = f"to {_ranks_word(receivers)} from {_ranks_word(senders)}" if receivers else "no ops"
        patterns.setdefault(sig[0], []).append(Group(
            number[sig], compact_name(keys), tuple(keys), "[" + ", ".join(map(str, entry.shape)) + "]",
            f"{entry.src_dtype} -> {entry.dst_dtype}", ops * len(keys), nbytes * len(keys), pictures,
            None if (sig in chosen or like is None) else number[like], summary))
    return tuple(Pattern(name, tuple(groups), sum(len(g.keys) for g in groups))
                 for name, groups in patterns.items())


# ---- sources ------------------------------------------------------------------------------

def _source(layout: Layout) -> Markup | None:
    """The layout's text, highlighted by pygments (escaped by it), or None if unreadable."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter

    from layoutlang.lexer import LayoutLexer

    try:
        text = Path(layout.path).read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return Markup(highlight(text, LayoutLexer(), HtmlFormatter(noclasses=False, cssclass="src",
                                                                  linenos="table")))


def _pygments_css() -> Markup:
    from pygments.formatters import HtmlFormatter

    return Markup(HtmlFormatter(noclasses=False, cssclass="src").get_style_defs(".src"))


# ---- the page -------------------------------------------------------------------------------

def _px(v: float) -> str:
    """An SVG coordinate: one decimal, no trailing zero."""
    text = f"{v:.1f}"
    return text[:-2] if text.endswith(".0") else text


@functools.cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["human"] = human_bytes
    env.filters["px"] = _px
    env.filters["ranks"] = short_ranks
    env.filters["counted"] = _counted
    return env


def render_html(plan: Plan) -> str:
    """The report as one self-contained HTML page (no network: inline CSS, JS and SVG)."""
    stats = plan.stats
    pairs = traffic(plan)
    send_net: dict[int, int] = {}
    recv_net: dict[int, int] = {}
    local: dict[int, int] = {}
    for (s, d), (nbytes, _) in pairs.items():
        if s == d:
            local[s] = local.get(s, 0) + nbytes
        else:
            send_net[s] = send_net.get(s, 0) + nbytes
            recv_net[d] = recv_net.get(d, 0) + nbytes
    senders = sorted(set(covered_ranks(plan.src)) | {s for s, _ in pairs})
    receivers = sorted(set(covered_ranks(plan.dst)) | {d for _, d in pairs})
    receiving = sum(1 for r in receivers if recv_net.get(r) or local.get(r))
    recv_share = stats["bytes"] / max(1, receiving)
    patterns = tensor_groups(plan)
    groups = [g for p in patterns for g in p.groups]
    context = {
        "title": f"plan {plan.src.name or plan.src.path} -> {plan.dst.name or plan.dst.path}",
        "src": _layout_title(plan.src), "dst": _layout_title(plan.dst),
        "src_ranks": rank_ranges(covered_ranks(plan.src)), "dst_ranks": rank_ranges(covered_ranks(plan.dst)),
        "selector": plan.selector_name, "ranks_per_node": plan.ranks_per_node,
        "digest": plan.digest[:12], "stats": stats, "keys": len(plan.tensors),
        "buckets": len(buckets(plan, None)), "recv_share": recv_share,
        "unused": list(plan.unused_keys),
        "heatmap": heatmap(plan, pairs),
        "send_bars": bar_chart("network bytes sent per source rank (light: local copies)", "sends",
                               senders, send_net, local, stats["send_floor_bytes"],
                               f"floor {human_bytes(stats['send_floor_bytes'])}"),
        "recv_bars": bar_chart("network bytes received per destination rank (light: local copies)", "receives",
                               receivers, recv_net, local, recv_share, f"even share {human_bytes(recv_share)}"),
        "patterns": patterns, "group_count": len(groups),
        "pictured": sum(1 for g in groups if g.pictures), "max_pictures": MAX_PICTURES,
        "max_blocks": MAX_REPORT_BLOCKS,
        "sources": [(_layout_title(plan.src), _source(plan.src)), (_layout_title(plan.dst), _source(plan.dst))],
        "pygments_css": _pygments_css(),
        "heat_stops": ["#%02x%02x%02x" % c for c in HEAT_STOPS],
    }
    return _env().get_template("report.html.j2").render(context)


__all__ = ["render_html", "tensor_groups", "traffic", "heatmap", "compact_name"]
