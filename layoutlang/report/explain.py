"""`layoutc explain`: one tensor as a terminal picture.

For a key: its logical shape and parts, and for each layout the shards (which
ranks hold which block, as runs of local -> logical) with a bar per split dim
showing who holds which logical range; with a destination, the ops that move
it. By a stored tensor's NAME: that tensor whole, and, where only one of the
two layouts has the NAME, the other side key by key. Rendered with rich;
`explain_text` gives the same as plain text. Rank lists and slices are written
by units.py, as in every other report.
"""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from layoutlang.compiler.match import flat_key, key_items
from layoutlang.compiler.flat import clip_flat, row_major_strides, source_shards
from layoutlang.compiler.plan import clip_shards
from layoutlang.compiler.shards import placement_of, shards
from layoutlang.diagnostics import UsageError
from layoutlang.ir import KeyRegion, Layout, TensorIR
from layoutlang.modes import Run, part_leaves

from .units import rank_ranges, slice_text

BAR = 64
COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta",
          "bright_green", "bright_yellow", "bright_blue", "bright_red")
GLYPHS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
RANKS_WIDTH = 48  # a shard's rank list is cut beyond this many characters
MAX_KEYS = 8  # a NAME found in one layout only: the other side shows this many of its keys


def _lookup(layout: Layout, key: str) -> tuple[tuple[TensorIR, KeyRegion | None], ...] | None:
    """The stored instances that hold `key` (with the key's region inside them, v2), or, when
    `key` is a stored tensor's NAME, that tensor whole; None when it is neither."""
    found = key_items(layout).get(key)
    if found is None:
        found = tuple((t, None) for t in layout.tensors if t.name == key) or None
    return found


def _instances(layout: Layout, key: str) -> tuple[tuple[TensorIR, KeyRegion | None], ...]:
    """`_lookup`, or a usage error that suggests the closest keys and names (each once)."""
    found = _lookup(layout, key)
    if found is None:
        import difflib
        candidates = dict.fromkeys([*key_items(layout), *(t.name for t in layout.tensors)])
        close = difflib.get_close_matches(key, list(candidates), n=3, cutoff=0.6)
        raise UsageError(f"key `{key}` is not in {layout.path} (nor is a stored tensor of that name)",
                         help=("did you mean: " + ", ".join(f"`{c}`" for c in close)) if close
                         else "`layoutc plan --format json` lists every key")
    return found


def _keys_of(items) -> list[str]:
    """The keys a stored tensor's instances hold, in file order, each once."""
    keys: dict[str, None] = {}
    for t, _ in items:
        keys.update(dict.fromkeys([r.key for r in t.regions] if t.regions is not None else [t.key]))
    return list(keys)


def _per_key(layout: Layout, keys: list[str], title: str, rank: int | None) -> list:
    """Where each key of a stored tensor that only the other layout has lies in `layout`."""
    out: list = []
    for k in keys[:MAX_KEYS]:
        if _lookup(layout, k) is None:
            out.append(Text(f"key {k}: not in {layout.path}"))
            continue
        out.append(Text.assemble(("key ", "bold"), (k, "bold"), (f" in the {title}:", "bold")))
        out.extend(_side(layout, k, title, rank))
    if len(keys) > MAX_KEYS:
        out.append(Text(f"... {len(keys) - MAX_KEYS} more keys (explain one by its key)"))
    return out


def _side(layout: Layout, key: str, title: str, rank: int | None) -> list:
    out: list = []
    for t, region in _instances(layout, key):
        p = placement_of(t)
        shard_list = shards(p)
        flat = region is not None and region.shape is not None  # a flat dim's key (docs/language.md 14.9)
        if flat:  # each rank's range of the key as boxes of the key, one row each
            shard_list = source_shards(clip_flat(shard_list, region.box, flat_key(t, region)))
        elif region is not None:  # the key inside its stored tensor: shards seen by the key
            shard_list = clip_shards(shard_list, region.box, region.stacked, region.transposed)
        axes = ", ".join(f"{a.name}={a.size}" for a in t.mesh.axes)
        out.append(Text.assemble((f"{title} ", "bold"), f"{layout.path}: ", (t.name, "bold"),
                                 f"  {t.dtype} on mesh {t.mesh.name} ({axes})  local {list(t.local_shape)}",
                                 f"  replicas over {', '.join(t.replica_axes) or 'none'}"))
        if region is not None:
            box = ", ".join(f"{a}:{b}" for a, b in region.box)
            how = "".join((f", stacked dims {list(region.stacked)}" if region.stacked else "",
                           ", stored transposed" if region.transposed else ""))
            if flat:
                out.append(Text(f"  holds this key at [{box}] of its flat dim, row-major; below, each rank's "
                                "boxes of the key and where they lie in its flat storage"))
            else:
                out.append(Text(f"  holds this key at [{box}] of its logical tensor{how}; below, in the key's dims"))
        elif t.regions is not None:
            out.append(Text(f"  holds {len(t.regions)} keys: " + ", ".join(
                f"{r.key} [{', '.join(f'{a}:{b}' for a, b in r.box)}]" for r in t.regions[:8])
                + (" ..." if len(t.regions) > 8 else "")))
        extents = region.key_shape if region is not None else t.logical_shape
        dims = len(extents)
        for d in range(dims):
            if len({s.runs[d] for s in shard_list}) > 1:
                out.append(_bar(extents[d], d, shard_list))
        table = Table(show_edge=False, box=None, pad_edge=False)
        table.add_column("shard", justify="right")
        table.add_column("ranks")
        if flat:
            table.add_column("local (flat)")
        for d in range(dims):
            table.add_column(f"dim {d}: logical" if flat else f"dim {d}: local -> logical")
        if rank is not None and not t.holds(rank):
            out.append(Text(f"  rank {rank} holds no part of it"))
            continue
        for i, s in enumerate(shard_list):
            if rank is not None and rank not in s.ranks:
                continue
            cells = [_runs_text(runs) for runs in s.runs]
            if flat:  # a box: the flat local range that holds it, and per key dim its rows
                first = s.base + sum(r[0].local_start * st for r, st in zip(s.runs, row_major_strides(s.shape)))
                n = 1
                for r in s.runs:
                    n *= sum(x.length for x in r)
                cells = [f"{first}:{first + n}"] + [" ".join(f"{x.logical_start}:{x.logical_start + x.length}"
                                                             for x in r[:6]) for r in s.runs]
            table.add_row(Text(GLYPHS[i % len(GLYPHS)], style=COLORS[i % len(COLORS)]),
                          rank_ranges(s.ranks, RANKS_WIDTH), *cells)
        # a rank may hold the stored tensor but no element of a key inside it
        out.append(table if table.row_count else Text(f"  rank {rank} holds no part of it"))
    return out


def _runs_text(runs) -> str:
    parts = []
    for r in runs[:6]:
        if isinstance(r, Run):
            parts.append(f"{r.local_start}:{r.local_start + r.length}->{r.logical_start}:{r.logical_start + r.length}")
        else:
            parts.append(f"{r.local_start}:{r.local_start + r.length} pad")
    if len(runs) > 6:
        parts.append(f"... {len(runs)} runs")
    return " ".join(parts)


def _bar(extent: int, d: int, shard_list) -> Text:
    """Who holds each logical range of dim d: one glyph per cell, coloured per shard."""
    cells = min(BAR, extent)
    owner = [None] * cells
    for i, s in enumerate(shard_list):
        for r in s.runs[d]:
            if isinstance(r, Run):
                a = r.logical_start * cells // extent
                b = max(a + 1, (r.logical_start + r.length) * cells // extent)
                for c in range(a, min(b, cells)):
                    if owner[c] is None:
                        owner[c] = i
    text = Text(f"  dim {d} [0, {extent}) ")
    for o in owner:
        text.append(GLYPHS[o % len(GLYPHS)] if o is not None else "?", style=COLORS[o % len(COLORS)] if o is not None else "")
    return text


def explain(src: Layout, key: str, dst: Layout | None = None, plan=None, rank: int | None = None,
            max_ops: int = 40) -> Group:
    """`key` is a key or a stored tensor's NAME. A NAME that only one of the two layouts has is
    shown whole on its side; the other side shows where each of its keys lies there."""
    src_items = _lookup(src, key)
    dst_items = _lookup(dst, key) if dst is not None else None
    if src_items is None and (dst_items is None or key in key_items(dst)):
        _instances(src, key)  # not in the source, and not a stored tensor's NAME in the destination
    if dst is not None and dst_items is None and key in key_items(src):
        _instances(dst, key)  # a source key the destination lacks
    t, region = (src_items or dst_items)[0]
    parts = []
    head = Text.assemble((key, "bold"), f"  logical {list(region.key_shape if region else t.logical_shape)}")
    parts.append(head)
    for d, dim in enumerate(t.dims if region is None else ()):
        leaves = part_leaves(dim.part_tree)
        if len(leaves) > 1:
            desc = "  ".join(f"{label} [{a}, {b})" for label, a, b in leaves[:8])
            parts.append(Text(f"  dim {d} parts: {desc}" + (" ..." if len(leaves) > 8 else "")))
    parts.extend(_side(src, key, "source", rank) if src_items is not None
                 else _per_key(src, _keys_of(dst_items), "source", rank))
    if dst is not None:
        parts.extend(_side(dst, key, "destination", rank) if dst_items is not None
                     else _per_key(dst, _keys_of(src_items), "destination", rank))
    if plan is not None:
        by_name = key not in key_items(src) and key not in key_items(dst)  # a NAME: ops of its keys
        ops = [op for op in (plan.ops_for_rank(rank) if rank is not None else plan.ops)
               if (key in (op.src_name, op.dst_name) if by_name else op.key == key)]
        table = Table(title=f"{len(ops)} ops", show_edge=False, box=None, title_justify="left")
        for col in ("op", "from", "to", "source slice", "destination slice", "bytes"):
            table.add_column(col, justify="right" if col in ("op", "bytes") else "left")
        for op in ops[:max_ops]:
            table.add_row(str(op.id), f"rank {op.src_rank}", f"rank {op.dst_rank}" + (" (local)" if op.local else ""),
                          slice_text(op.src_slice), slice_text(op.dst_slice), str(op.bytes))
        parts.append(table)
        if len(ops) > max_ops:
            parts.append(Text(f"... {len(ops) - max_ops} more ops"))
    return Group(*parts)


def explain_text(src: Layout, key: str, dst: Layout | None = None, plan=None, rank: int | None = None,
                 width: int = 120) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(explain(src, key, dst, plan, rank))
    return console.export_text()
