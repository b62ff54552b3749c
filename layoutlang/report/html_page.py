"""The HTML report of a plan: one self-contained page (`layoutc plan --format html`).

The page shows the plan against the floor (DESIGN.md, performance model), a
rank x rank traffic heatmap, per-rank send and receive bars, one picture per
group of tensors that are cut alike, and both `.layout` sources highlighted:
the text that was compiled, not whatever the files hold now. Everything is
inline (CSS, JS, SVG; a Content-Security-Policy forbids any fetch), rendered
by jinja2 with autoescaping on (templates/report*.j2).

Like the other renderers it only reads the plan and decides nothing. The work
is split by the question each part answers: html_analysis.py says what the
plan does (traffic, ranks in blocks, tensor groups, what is drawn),
html_svg.py where each thing is drawn, and this module writes the page.
:func:`render_html` is the entry point.

Each block of a destination picture carries `data-logical` (per dim
`lo:hi` of the logical tensor), `data-dst-rank` (the ranks receiving it,
space-separated) and `data-src-rank` (the sender of each, in the same order):
exactly the plan's ops for the group's first key.

>>> px(12.0), px(12.25), px(3)
('12', '12.2', '3')
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jinja2
from markupsafe import Markup

from layoutlang.compiler.graph import buckets
from layoutlang.compiler.plan import Plan
from layoutlang.ir import Layout

from . import html_analysis as analysis
from .html_analysis import compact_name
from .html_svg import Picture, bar_chart, heat_stops, heatmap, pictures
from .render import TEMPLATES, covered_ranks, layout_title
from .units import counted, human_bytes, rank_ranges, ranks_word


# ---- records handed to the templates ---------------------------------------------

@dataclass(frozen=True)
class Group:
    """A group of tensors as the page shows it (html_analysis.TensorGroup, in words and pictures)."""

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


def tensor_groups(plan: Plan) -> tuple[Pattern, ...]:
    """Keys grouped by name pattern, then by shared templates; pictures for up to MAX_PICTURES."""
    patterns: dict[str, list[Group]] = {}
    for g in analysis.tensor_groups(plan):
        summary = (f"to {ranks_word(g.receivers)} from {ranks_word(g.senders)}" if g.receivers else "no ops")
        patterns.setdefault(g.pattern, []).append(Group(
            g.index, compact_name(list(g.keys)), g.keys, "[" + ", ".join(map(str, g.entry.shape)) + "]",
            f"{g.entry.src_dtype} -> {g.entry.dst_dtype}", g.ops, g.bytes,
            pictures(g) if g.drawn else (), g.like, summary))
    return tuple(Pattern(name, tuple(groups), sum(len(g.keys) for g in groups))
                 for name, groups in patterns.items())


# ---- sources ------------------------------------------------------------------------------

def source_text(layout: Layout) -> str | None:
    """The text the layout was compiled from; for a Layout that does not carry it, its file's text now.

    None when neither is available (a layout from `loads` without its text, an unreadable file).
    """
    text = getattr(layout, "source_text", None)
    if text is not None:
        return text
    try:
        return Path(layout.path).read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _source(layout: Layout) -> Markup | None:
    """The layout's text, highlighted by pygments (escaped by it), or None if there is none."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter

    from layoutlang.lexer import LayoutLexer

    text = source_text(layout)
    if text is None:
        return None
    return Markup(highlight(text, LayoutLexer(), HtmlFormatter(noclasses=False, cssclass="src",
                                                                  linenos="table")))


def _pygments_css() -> Markup:
    from pygments.formatters import HtmlFormatter

    return Markup(HtmlFormatter(noclasses=False, cssclass="src").get_style_defs(".src"))


# ---- the page -------------------------------------------------------------------------------

def px(v: float) -> str:
    """An SVG coordinate: one decimal, no trailing zero."""
    text = f"{v:.1f}"
    return text[:-2] if text.endswith(".0") else text


@functools.cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["human"] = human_bytes
    env.filters["px"] = px
    env.filters["counted"] = counted
    return env


def render_html(plan: Plan) -> str:
    """The report as one self-contained HTML page (no network: inline CSS, JS and SVG)."""
    stats = plan.stats
    pairs = analysis.traffic(plan)
    loads = analysis.rank_loads(plan, pairs)
    recv_share = stats["bytes"] / max(1, loads.receiving)
    patterns = tensor_groups(plan)
    groups = [g for p in patterns for g in p.groups]
    context = {
        "title": f"plan {plan.src.name or plan.src.path} -> {plan.dst.name or plan.dst.path}",
        "src": layout_title(plan.src), "dst": layout_title(plan.dst),
        "src_ranks": rank_ranges(covered_ranks(plan.src)), "dst_ranks": rank_ranges(covered_ranks(plan.dst)),
        "selector": plan.selector_name, "ranks_per_node": plan.ranks_per_node,
        "digest": plan.digest[:12], "stats": stats, "keys": len(plan.tensors),
        "buckets": len(buckets(plan, None)), "recv_share": recv_share,
        "unused": list(plan.unused_keys),
        "heatmap": heatmap(analysis.block_traffic(plan, pairs)),
        "send_bars": bar_chart("network bytes sent per source rank (light: local copies)", "sends",
                               loads.senders, loads.send_net, loads.local, stats["send_floor_bytes"],
                               f"floor {human_bytes(stats['send_floor_bytes'])}"),
        "recv_bars": bar_chart("network bytes received per destination rank (light: local copies)", "receives",
                               loads.receivers, loads.recv_net, loads.local, recv_share,
                               f"even share {human_bytes(recv_share)}"),
        "patterns": patterns, "group_count": len(groups),
        "pictured": sum(1 for g in groups if g.pictures), "max_pictures": analysis.MAX_PICTURES,
        "max_blocks": analysis.MAX_REPORT_BLOCKS,
        "sources": [(layout_title(plan.src), _source(plan.src)), (layout_title(plan.dst), _source(plan.dst))],
        "pygments_css": _pygments_css(),
        "heat_stops": heat_stops(),
    }
    return _env().get_template("report.html.j2").render(context)


__all__ = ["render_html", "tensor_groups", "source_text"]
