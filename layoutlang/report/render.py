"""Renderers of a compiled plan: JSON (LANGUAGE.md 6), a text report, a DOT graph.

Renderers only read a :class:`~layoutlang.compiler.plan.Plan`; they decide
nothing. Each output is deterministic (same plan, same bytes), so all three
are checked against golden files (tests/golden/).

- :func:`render_json` is the machine contract: ``"format": "layoutlang.plan/1"``,
  one op per line, built op by op (:func:`iter_json` yields the pieces so that
  a 100k-op plan can be written without holding a second copy).
- :func:`render_text` is the report a person reads (templates/plan.txt.j2).
- :func:`render_dot` is rank-to-rank traffic for Graphviz (templates/plan.dot.j2).

With ``rank=R``, JSON and text show only the ops rank R sends or receives;
the plan-wide ``stats`` stay plan-wide and ``rank_stats`` describes the ops shown.
Sizes and rank lists are written by units.py.

>>> from layoutlang import loads
>>> covered_ranks(loads("mesh a (tp=2)\\nmesh b (tp=2) at 4\\ntensor w [8 over tp, 4] on b"))
[0, 1, 4, 5]
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import jinja2

from layoutlang.compiler.plan import FORMAT, Op, Plan
from layoutlang.diagnostics import UsageError
from layoutlang.ir import Layout

from .units import counted, human_bytes, rank_ranges

TEMPLATES = Path(__file__).parent / "templates"  # layoutlang/report/templates (package data)

# The fields LANGUAGE.md 6 requires in "stats", in its order; the other stats follow sorted by name.
REQUIRED_STATS = ("ops", "bytes", "max_send_bytes", "max_recv_bytes")
UNUSED_SHOWN = 5  # unused source keys named in a warning before "..."


# ---- small helpers ------------------------------------------------------------

def covered_ranks(layout: Layout) -> list[int]:
    """The sorted ranks that the layout's meshes cover (idle ranks below a mesh's `at` excluded)."""
    ranks: set[int] = set()
    for m in layout.meshes:
        ranks.update(range(m.offset, m.end))
    return sorted(ranks)


def check_rank(plan: Plan, rank: int | None) -> None:
    """A rank filter must name a rank of the plan (0 .. world-1)."""
    if rank is not None and not 0 <= rank < plan.world:
        raise UsageError(f"--rank {rank}: the plan has ranks 0..{plan.world - 1}")


def unused_warning(plan: Plan, shown: int = UNUSED_SHOWN) -> str | None:
    """`warning: N source keys are not in the destination: a, b, ...`, or None."""
    keys = list(plan.unused_keys)
    if not keys:
        return None
    head = "1 source key is" if len(keys) == 1 else f"{len(keys)} source keys are"
    names = ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")
    return f"warning: {head} not in the destination: {names}"


def _rank_stats(plan: Plan, rank: int, ops: tuple[Op, ...]) -> dict:
    sends = [op for op in ops if op.src_rank == rank and not op.local]
    recvs = [op for op in ops if op.dst_rank == rank and not op.local]
    local = [op for op in ops if op.local]
    return {
        "rank": rank, "ops": len(ops),
        "sends": len(sends), "send_bytes": sum(op.bytes for op in sends),
        "receives": len(recvs), "recv_bytes": sum(op.bytes for op in recvs),
        "local": len(local), "local_bytes": sum(op.bytes for op in local),
    }


# ---- JSON -----------------------------------------------------------------------

def _layout_json(layout: Layout) -> dict:
    return {"layout": layout.path, "name": layout.name, "ranks": covered_ranks(layout),
            "args": dict(layout.args), "digest": layout.digest}


def _stats_json(stats: dict) -> dict:
    ordered = {k: stats[k] for k in REQUIRED_STATS}
    ordered.update((k, stats[k]) for k in sorted(stats) if k not in ordered)
    return ordered


def _op_json(op: Op) -> str:
    fields = {
        "id": op.id, "key": op.key, "src_rank": op.src_rank, "dst_rank": op.dst_rank,
        "src_name": op.src_name, "dst_name": op.dst_name,
        "src_slice": [list(d[:3]) for d in op.src_slice], "dst_slice": [list(d[:3]) for d in op.dst_slice],
        "bytes": op.bytes}
    # LANGUAGE.md 6: a dim `[start, stop, step]` holds one element per step; where a dim holds
    # blocks of several (layoutlang/compiler/strides.py), `src_block` / `dst_block` give each dim's block
    for side, sl in (("src_block", op.src_slice), ("dst_block", op.dst_slice)):
        if any(len(d) == 4 for d in sl):
            fields[side] = [d[3] if len(d) == 4 else 1 for d in sl]
    if op.transpose is not None:  # LANGUAGE.md 8.4: the receiver's slice is in its storage order
        fields["transposed"] = True
    if op.wire is not None:  # LANGUAGE.md 4.1: quantized data and scales cross the link
        fields["wire"] = op.wire
    if op.after:  # LANGUAGE.md 5: a relay waits for the op that delivered the piece to its sender
        fields["after"] = list(op.after)
    return json.dumps(fields)


def _json_list(items: Iterable[str]) -> Iterator[str]:
    """`[` + one item per line + `]`; `[]` when empty."""
    first = True
    for item in items:
        yield ("[\n  " if first else ",\n  ") + item
        first = False
    yield "]" if first else "\n ]"


def iter_json(plan: Plan, rank: int | None = None) -> Iterator[str]:
    """The JSON plan in pieces that concatenate to :func:`render_json`'s text."""
    check_rank(plan, rank)
    ops = plan.ops if rank is None else plan.ops_for_rank(rank)
    head = {"format": FORMAT, "digest": plan.digest, "src": _layout_json(plan.src), "dst": _layout_json(plan.dst),
            "selector": plan.selector_name, "ranks_per_node": plan.ranks_per_node, "rank": rank}
    yield "{" + ",\n ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items())
    yield ',\n "tensors": '
    yield from _json_list(json.dumps({"key": t.key, "shape": list(t.shape), "src_dtype": t.src_dtype,
                                      "dst_dtype": t.dst_dtype}) for t in plan.tensors)
    yield f',\n "unused_keys": {json.dumps(list(plan.unused_keys))}'
    yield ',\n "ops": '
    yield from _json_list(_op_json(op) for op in ops)
    yield f',\n "stats": {json.dumps(_stats_json(plan.stats))}'
    if rank is not None:
        yield f',\n "rank_stats": {json.dumps(_rank_stats(plan, rank, ops))}'
    yield "}\n"


def render_json(plan: Plan, rank: int | None = None) -> str:
    """The plan as LANGUAGE.md 6 JSON, keys in a fixed order, one op per line.

    Extra fields beyond the required ones: per layout `name`, `args` and
    `digest` (of its sources and args); top-level `digest` (of the plan's
    inputs, the same on every rank), `selector`, `ranks_per_node`, `rank`, `unused_keys`; every
    `stats` entry of the plan; with `rank`, `rank_stats` for the ops listed.
    """
    return "".join(iter_json(plan, rank))


# ---- templates --------------------------------------------------------------------

def _dot_string(text: object) -> str:
    """A DOT double-quoted string."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@functools.cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["human"] = human_bytes
    env.filters["dot"] = _dot_string
    env.filters["counted"] = counted
    return env


def layout_title(layout: Layout) -> str:
    """`path (name)`, or the path of an unnamed layout."""
    return f"{layout.path} ({layout.name})" if layout.name else layout.path


def _top(load: list[int], n: int) -> list[tuple[int, int]]:
    """(rank, bytes) of the n ranks with the most bytes (ties: lower rank first), zeros left out."""
    busy = sorted(((r, b) for r, b in enumerate(load) if b), key=lambda rb: (-rb[1], rb[0]))
    return busy[:n]


def _per_key(ops: Iterable[Op]) -> dict[str, list[int]]:
    """key -> [ops, bytes], in first-appearance (canonical) order."""
    out: dict[str, list[int]] = {}
    for op in ops:
        entry = out.setdefault(op.key, [0, 0])
        entry[0] += 1
        entry[1] += op.bytes
    return out


def render_steps(plan: Plan, rank: int, budget_bytes: int | None = None) -> str:
    """The steps `rank` executes (layoutlang/compiler/steps.py), bucket by bucket, one line each."""
    from layoutlang.compiler.steps import schedule

    check_rank(plan, rank)
    sched = schedule(plan, rank, budget_bytes)
    budget = "no budget" if budget_bytes is None else f"budget {budget_bytes} B"
    lines = [f"rank {rank}: {len(sched.buckets)} buckets ({budget}), "
             f"{sum(map(len, sched.steps))} steps"]
    for b, steps in zip(sched.buckets, sched.steps):
        lines.append(f"bucket {b.index}: destination instances {b.first_instance}..{b.stop_instance - 1}, "
                     f"ops {b.first_op}..{b.stop_op - 1}")
        lines += [f"  {st}" for st in steps]
    return "\n".join(lines) + "\n"


def render_text(plan: Plan, rank: int | None = None, top: int = 8, max_ops: int = 32) -> str:
    """A report: summary, balance against the floor, busiest ranks and tensors, warnings.

    With `rank`, also that rank's ops (the first `max_ops`, one line each).
    """
    check_rank(plan, rank)
    stats = plan.stats
    entries = {t.key: t for t in plan.tensors}
    per_key = _per_key(plan.ops)
    order = {k: i for i, k in enumerate(per_key)}
    busiest_keys = sorted(per_key, key=lambda k: (-per_key[k][0], -per_key[k][1], order[k]))[:top]
    tensors = [{"key": k, "ops": per_key[k][0], "bytes": per_key[k][1],
                "shape": "[" + ", ".join(map(str, entries[k].shape)) + "]",
                "src_dtype": entries[k].src_dtype, "dst_dtype": entries[k].dst_dtype}
               for k in busiest_keys]
    rank_view = None
    if rank is not None:
        ops = plan.ops_for_rank(rank)
        rank_view = {**_rank_stats(plan, rank, ops), "shown": [str(op) for op in ops[:max_ops]]}
    context = {
        "src": layout_title(plan.src), "dst": layout_title(plan.dst),
        "src_ranks": rank_ranges(covered_ranks(plan.src)),
        "dst_ranks": rank_ranges(covered_ranks(plan.dst)),
        "selector": plan.selector_name, "ranks_per_node": plan.ranks_per_node,
        "digest": plan.digest[:12], "stats": stats, "keys": len(plan.tensors),
        "senders": _top(plan.send_load, top), "sending": sum(1 for b in plan.send_load if b),
        "receivers": _top(plan.recv_load, top), "receiving": sum(1 for b in plan.recv_load if b),
        "tensors": tensors, "ops_keys": len(per_key),
        "unused": list(plan.unused_keys[:UNUSED_SHOWN]), "unused_count": len(plan.unused_keys),
        "rank": rank_view,
    }
    return _env().get_template("plan.txt.j2").render(context)


def render_dot(plan: Plan) -> str:
    """Rank-to-rank traffic: one edge per (sender, receiver) with bytes summed.

    Local copies (sender == receiver) are not drawn; the graph label counts
    them. Ranks are grouped into clusters where the two layouts' ranks differ:
    source only, destination only, and both (no clusters when they coincide).
    """
    edges: dict[tuple[int, int], list[int]] = {}
    local_ops = local_bytes = 0
    for op in plan.ops:
        if op.local:
            local_ops += 1
            local_bytes += op.bytes
            continue
        e = edges.setdefault((op.src_rank, op.dst_rank), [0, 0])
        e[0] += 1
        e[1] += op.bytes
    heaviest = max((b for _, b in edges.values()), default=0)
    src, dst = set(covered_ranks(plan.src)), set(covered_ranks(plan.dst))
    clusters = []
    if src != dst:
        for name, title, ranks in (("src", f"source {plan.src.name or plan.src.path}", src - dst),
                                   ("both", "source and destination", src & dst),
                                   ("dst", f"destination {plan.dst.name or plan.dst.path}", dst - src)):
            if ranks:
                clusters.append({"name": name, "label": title, "ranks": sorted(ranks)})
    clustered = {r for c in clusters for r in c["ranks"]}
    context = {
        "src": layout_title(plan.src), "dst": layout_title(plan.dst), "stats": plan.stats,
        "clusters": clusters, "loose": sorted((src | dst) - clustered),
        "edges": [{"src": s, "dst": d, "ops": n, "bytes": b,
                   "penwidth": f"{1 + 4 * b / heaviest:.2f}"}
                  for (s, d), (n, b) in sorted(edges.items())],
        "local_ops": local_ops, "local_bytes": local_bytes,
    }
    return _env().get_template("plan.dot.j2").render(context)


__all__ = ["render_json", "iter_json", "render_text", "render_dot", "covered_ranks", "layout_title",
           "check_rank", "unused_warning"]
