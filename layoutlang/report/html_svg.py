"""Where things are drawn in the HTML report: heatmap cells, bars, tensor pictures.

Turns what html_analysis.py found into frozen records of SVG geometry
(rectangles, ticks, part lines and labels, padding strips) that
templates/report_svg.j2 writes out; it computes no traffic of its own.

A tensor picture puts a stored tensor's logical tensor in a PIC_W-wide
frame: dim 0 down and dim 1 across; with more dims every dim but the last is
flattened down (stacked experts `[E, 2I, H]`: each expert's rows under the
previous one's), unless a block would then not be one rectangle (Geometry);
a 1-D tensor is a strip. Each block is one logical rectangle of the plan's
ops, drawn where it lies in the tensor of its side (source or destination:
for a v2 key inside a fused, stacked or transposed tensor they differ).
Lines and labels mark parts and the indices of outer dims; padding, which has
no logical coordinate, is drawn as hatched strips beside the frame.

>>> geometry((8, 4)).rect(((0, 4), (0, 4)))
(58.0, 18.0, 400.0, 150.0)
>>> g = geometry((4, 64, 32))                 # 4 experts of [64, 32]: 256 rows of 32
>>> g.split, g.rows, g.cols
(2, 256, 32)
>>> g.rect(((1, 2), (0, 64), (16, 32)))[1:]   # expert 1, right half: rows 64..128
(93.0, 200.0, 75.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from layoutlang.compiler.shards import Placement, placement_of, shards
from layoutlang.modes import PadRun, part_leaves

from .html_analysis import MAX_BARS, BlockTraffic, KeyBlock, TensorGroup, rank_blocks
from .units import counted, human_bytes, rank_ranges, ranks_word

MAX_LABELS = 32       # part labels per axis of a picture
MAX_LINES = 64        # part and index lines per axis of a picture
MAX_PAD_STRIPS = 8    # padding strips per side and axis
PIC_W = 400           # picture width in px (the logical columns)
PIC_H_MAX = 300       # picture height bounds in px (rows keep their aspect between them)
PIC_H_MIN = 48
MARGIN_L, MARGIN_T = 58, 18  # room for row / column part labels
HEAT_PX = 640         # heatmap side in px (cells are square, 4..24 px)
BAR_W, BAR_H = 720, 130
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


# ---- colours ----------------------------------------------------------------------------

def _color(i: int) -> str:
    """A distinct pastel per index (golden-angle hues)."""
    return f"hsl({(i * 137.508) % 360:.0f},60%,{68 if i % 2 else 58}%)"


def _heat(t: float) -> str:
    t = min(1.0, max(0.0, t)) * (len(HEAT_STOPS) - 1)
    i = min(int(t), len(HEAT_STOPS) - 2)
    f = t - i
    a, b = HEAT_STOPS[i], HEAT_STOPS[i + 1]
    return "#%02x%02x%02x" % tuple(round(x + (y - x) * f) for x, y in zip(a, b))


def heat_stops() -> list[str]:
    """The heat scale's colours, low to high (the legend's gradient)."""
    return ["#%02x%02x%02x" % c for c in HEAT_STOPS]


# ---- traffic -----------------------------------------------------------------------------

def heatmap(bt: BlockTraffic) -> Heatmap:
    """One square cell per (sender block, receiver block) with traffic, log-scaled colour."""
    br, bc, row_blocks, col_blocks = bt.block_rows, bt.block_cols, bt.row_blocks, bt.col_blocks
    cw = max(4, min(40, HEAT_PX // max(1, len(col_blocks))))
    ch = max(4, min(40, HEAT_PX // max(1, len(row_blocks))))
    left, top = 64.0, 64.0
    values = [e[0] for e in bt.cells.values() if e[0]]
    lo, hi = (min(values), max(values)) if values else (1, 1)
    span = math.log(hi) - math.log(lo) if hi > lo else 0.0
    cells = []
    for (i, j), (nbytes, ops, local) in sorted(bt.cells.items()):
        rows, cols = row_blocks[i], col_blocks[j]
        who = (f"rank {rows[0]} -> rank {cols[0]}" if br == bc == 1 else
               f"{ranks_word(rows)} -> {ranks_word(cols)}")
        title = f"{who}: {human_bytes(nbytes)} in {counted(ops, 'op')}"
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
                   tuple(cells), row_ticks, col_ticks, len(bt.senders), len(bt.receivers), br, bc,
                   human_bytes(lo) if values else "0 B", human_bytes(hi) if values else "0 B")


def bar_chart(title: str, verb: str, ranks, network: dict[int, int], local: dict[int, int],
              floor: float, floor_label: str) -> BarChart:
    """One bar per rank (the busiest rank of each block when there are more than MAX_BARS)."""
    ranks = list(ranks)
    size, blocks = rank_blocks(ranks, MAX_BARS)
    left, top, height = 56.0, 18.0, float(BAR_H)
    peak = max([network.get(r, 0) + local.get(r, 0) for r in ranks] + [floor, 1])
    width = min(24.0, BAR_W / max(1, len(blocks)))
    bars = []
    for i, block in enumerate(blocks):
        r = max(block, key=lambda x: (network.get(x, 0), -x))
        net, loc = network.get(r, 0), local.get(r, 0)
        net_h, loc_h = height * net / peak, height * loc / peak
        who = f"rank {r}" if size == 1 else f"{ranks_word(block)}, busiest rank {r}"
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

def _flat(box, shape) -> tuple[int, int]:
    """The flattened (row-major) range a box spans in `shape`: exact when `_contiguous`, else its bounds."""
    if not box:
        return 0, 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return (sum(a * s for (a, _), s in zip(box, strides)),
            sum((b - 1) * s for (_, b), s in zip(box, strides)) + 1)


def _contiguous(box, shape) -> bool:
    """Whether a box, flattened row-major, is one range: every dim after its first longer than 1 is whole."""
    wide = False
    for (a, b), n in zip(box, shape):
        if wide and (a, b) != (0, n):
            return False
        wide = wide or b - a > 1
    return True


@dataclass(frozen=True)
class Geometry:
    """Logical tensor -> picture: the first `split` dims flattened down, the others across.

    2-D: dim 0 down, dim 1 across; 1-D (`split` 0): a strip. With more dims,
    every dim but the last goes down, so a stacked weight's rows stack per
    index, unless a block of the picture would then not be one rectangle
    (geometry() then moves the split left; a box that no split keeps whole is
    drawn as its bounding rectangle).
    """

    shape: tuple[int, ...]
    height: float
    split: int = 1

    @property
    def rows(self) -> int:
        return max(1, math.prod(self.shape[:self.split]))

    @property
    def cols(self) -> int:
        return max(1, math.prod(self.shape[self.split:]))

    def rect(self, logical: tuple[tuple[int, int], ...]) -> tuple[float, float, float, float]:
        """(x, y, width, height) of a logical rectangle (its bounding range when flattened)."""
        if logical:
            r0, r1 = _flat(logical[:self.split], self.shape[:self.split])
            c0, c1 = _flat(logical[self.split:], self.shape[self.split:])
        else:
            r0, r1, c0, c1 = 0, 1, 0, 1
        sx, sy = PIC_W / self.cols, self.height / self.rows
        return (MARGIN_L + c0 * sx, MARGIN_T + r0 * sy, (c1 - c0) * sx, (r1 - r0) * sy)


def geometry(shape: tuple[int, ...], boxes=()) -> Geometry:
    """The picture of a logical shape: PIC_W wide, rows keeping their aspect within the height bounds.

    For 3 dims or more, the split is the rightmost one that draws every box in
    `boxes` as one rectangle (the last dim across when it can).
    """
    if len(shape) < 2:
        return Geometry(shape, 28.0, 0)
    split = next((k for k in range(len(shape) - 1, 0, -1)
                  if all(_contiguous(b[:k], shape[:k]) and _contiguous(b[k:], shape[k:]) for b in boxes)),
                 len(shape) - 1)
    rows, cols = max(1, math.prod(shape[:split])), max(1, math.prod(shape[split:]))
    return Geometry(shape, float(min(PIC_H_MAX, max(PIC_H_MIN, round(PIC_W * rows / cols)))), split)


def _segments(dims, shape, px: float) -> list[tuple[int, int, str]]:
    """A group of dims flattened row-major, cut where a part or an outer dim's index changes.

    Each dim refines the segments of the dims before it: by its parts' leaves,
    or, for a dim before the group's last one, by its indices (one per stacked
    expert). `px` is the picture length of one flattened element; a refinement
    into more than MAX_LINES segments, or into segments thinner than 2 px, is
    not made (nor any after it). Returns (start, stop, label) in flattened
    elements; labels join an index and a part name (`3 gate`).

    >>> from layoutlang import loads
    >>> w13 = loads("mesh m (r=1)\\ntensor w [4, (gate: 8 | up: 8), 16]").tensors[0]
    >>> _segments(w13.dims[:2], (4, 16), 1.0)[:3]
    [(0, 8, '0 gate'), (8, 16, '0 up'), (16, 24, '1 gate')]
    """
    segs = [(0, max(1, math.prod(shape)), "")]
    for d, dim in enumerate(dims):
        unit = math.prod(shape[d + 1:])
        leaves = part_leaves(dim.part_tree)
        if len(leaves) > 1:
            cuts = [(a, b, name) for name, a, b in leaves]
        elif d < len(dims) - 1 and unit > 1 and shape[d] > 1:
            cuts = [(i, i + 1, str(i)) for i in range(shape[d])]
        else:
            continue
        refined = [(s0 + a * unit, s0 + b * unit, f"{text} {name}".strip())
                   for s0, _, text in segs for a, b, name in cuts]
        if len(refined) > MAX_LINES or min(b - a for a, b, _ in refined) * px < 2:
            break
        segs = refined
    return segs


def parts_overlay(dims, geo: Geometry) -> tuple[list[Line], list[Label]]:
    """Part and index boundaries as lines, their names along the axes (rows left, columns on top)."""
    lines: list[Line] = []
    labels: list[Label] = []
    if not dims:
        return lines, labels
    top, left = MARGIN_T, MARGIN_L
    bottom, right = MARGIN_T + geo.height, MARGIN_L + PIC_W
    sy, sx = geo.height / geo.rows, PIC_W / geo.cols
    if geo.split:
        rows = _segments(dims[:geo.split], geo.shape[:geo.split], sy)
        for i, (a, b, name) in enumerate(rows):
            if i:
                lines.append(Line(left, top + a * sy, right, top + a * sy))
            if len(rows) > 1 and len(rows) <= MAX_LABELS and (b - a) * sy >= 9:
                labels.append(Label(left - 4, top + (a + b) / 2 * sy + 3, name, "end"))
    cols = _segments(dims[geo.split:], geo.shape[geo.split:], sx)
    for i, (a, b, name) in enumerate(cols):
        if i:
            lines.append(Line(left + a * sx, top, left + a * sx, bottom))
        if len(cols) > 1 and len(cols) <= MAX_LABELS and (b - a) * sx >= 6 * len(name) + 4:
            labels.append(Label(left + (a + b) / 2 * sx, top - 5, name, "middle"))
    return lines, labels


def padding(p: Placement, geo: Geometry, dims_count: int) -> tuple[list[PadStrip], float, float]:
    """Hatched strips for stored padding: dims drawn down below the picture, the others to its right.

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
            title = (f"padding, dim {d}: {count} {unit} at local {where} on {ranks_word(ranks)}; "
                     f"stored, never sent, zero on arrival{more}")
            label = f"pad {count} ({ranks_word(ranks)})"
            if d < geo.split:
                h = max(11.0, min(18.0, geo.height * count / geo.shape[d]))
                strips.append(PadStrip(MARGIN_L, below + room_b, PIC_W, h, d, title, label))
                room_b += h + 2
            else:
                w = max(5.0, min(16.0, PIC_W * count / geo.shape[d]))
                strips.append(PadStrip(right + room_r, MARGIN_T, w, geo.height, d, title, ""))
                room_r += w + 2
    return strips, room_b, room_r


def _part_names(dims, logical) -> str:
    """Names of the parts a block touches, e.g. `gate` or `q, k`."""
    names = []
    for dim, (a, b) in zip(dims, logical):
        hit = [n for n, lo, hi in part_leaves(dim.part_tree) if n and lo < b and a < hi]
        if hit:
            names.append(", ".join(hit[:4]) + (", ..." if len(hit) > 4 else ""))
    return "; ".join(names)


def _block(side: str, d: KeyBlock, geo: Geometry, dims, fill: str) -> Block:
    logical = d.src_logical if side == "src" else d.logical
    x, y, w, h = geo.rect(logical)
    where = ", ".join(f"{a}:{b}" for a, b in logical)
    parts = _part_names(dims, logical)
    parts = f" ({parts})" if parts else ""
    # the source side draws what leaves source ranks; relays (a replica forwarding) only the other side
    src, dst = zip(*d.sent()) if side == "src" and d.relayed else (d.src, d.dst)
    if side == "src":
        text = rank_ranges(d.holders, 24)
        title = (f"[{where}]{parts}: held by {ranks_word(d.holders)}; sent "
                 + "; ".join(f"{s} -> {r}" for s, r in list(zip(src, dst))[:8])
                 + (" ..." if len(dst) > 8 else ""))
    else:
        relays = sum(d.relayed)
        text = rank_ranges(d.dst, 24)
        title = (f"[{where}]{parts}: received by {ranks_word(d.dst)}, "
                 f"{counted(len(d.dst), 'op')} from {ranks_word(sorted(set(d.src)))}"
                 + (f" ({counted(relays, 'relay')} from replicas)" if relays else ""))
    label = text if (w >= 5.6 * len(text) + 4 and h >= 11) else ""
    return Block(x, y, w, h, fill, ",".join(f"{a}:{b}" for a, b in logical), " ".join(map(str, dst)),
                 " ".join(map(str, src)), " ".join(map(str, d.holders)), label, title)


def pictures(group: TensorGroup) -> tuple[Picture, ...]:
    """Source and destination pictures of a group's first key: the same blocks, each drawn in its side's
    stored tensor, coloured by holders / receivers."""
    holder_color: dict[tuple, int] = {}
    dst_color: dict[tuple, int] = {}
    out = []
    for side, tensor in (("src", group.src), ("dst", group.dst)):
        dims = tensor.dims
        geo = geometry(tensor.logical_shape, [d.src_logical if side == "src" else d.logical for d in group.blocks])
        lines, labels = parts_overlay(dims, geo)
        if side == "src":
            blocks = [_block(side, d, geo, dims, _color(holder_color.setdefault(d.holders, len(holder_color))))
                      for d in group.blocks]
        else:
            blocks = [_block(side, d, geo, dims, _color(dst_color.setdefault(d.dst, len(dst_color))))
                      for d in group.blocks]
        pads, room_b, room_r = padding(placement_of(tensor), geo, len(dims))
        what = ("source: colour = the ranks that hold each block (any can send it)" if side == "src"
                else "destination: colour = the ranks that receive each block")
        caption = f"{tensor.name} {list(tensor.local_shape)} local, {tensor.dtype} — {what}"
        frame = (MARGIN_L, MARGIN_T, PIC_W, geo.height)
        out.append(Picture(side, group.keys[0], caption, MARGIN_L + PIC_W + 8 + room_r,
                           MARGIN_T + geo.height + 8 + room_b, frame, tuple(blocks), group.more,
                           tuple(lines), tuple(labels), tuple(pads)))
    return tuple(out)


__all__ = ["heatmap", "bar_chart", "pictures", "geometry", "parts_overlay", "padding", "heat_stops",
           "Heatmap", "BarChart", "Picture", "Block", "Geometry"]
