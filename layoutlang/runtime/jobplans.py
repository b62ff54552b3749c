"""What a trainer job knows of the replicas' layouts: how a replica describes its layout in the
store (`published`: digest, shapes, and its text's digest and args), why one differs from the
trainer's expectation (`layout_difference`), and the membership plans both sides compute from
them (`ReplicaPlans`). layoutlang/runtime/jobs.py runs the refits; docs/jobs.md "Membership"."""

from __future__ import annotations

import hashlib
import json

from layoutlang.compiler import members
from layoutlang.diagnostics import UsageError
from layoutlang.elaborate import loads
from layoutlang.ir import Layout

KEPT = 8             # layouts, plans and walks kept per replica layout (EPLB rebalances every `step_interval` steps)


def signature(layout: Layout) -> list:
    """Each tensor of a replica's layout as data: name, dtype, local shape on every rank."""
    return [[t.name, t.dtype, [list(t.local_shape_at(r)) if t.holds(r) else None for r in range(layout.ranks)]]
            for t in layout.tensors]


def text_digest(layout: Layout) -> str:
    """The digest of a layout's own text: two replicas with equal ones differ only in args."""
    return hashlib.sha256(layout.source_text.encode("utf-8")).hexdigest()


def published(layout: Layout) -> dict:
    """What an engine replica says of its layout under `replica/R/layout`: the digest, the
    shapes, and (one file) its text's digest and its args, so that a trainer holding the same
    text can plan for this replica's args (an EPLB map) without the text travelling."""
    record = {"digest": layout.digest, "ranks": layout.ranks, "tensors": signature(layout)}
    if len(layout.sources) == 1:
        record.update(text=text_digest(layout), args=args_json(layout))
    return record


def layout_difference(expected: Layout, theirs: dict) -> str | None:
    """Why an engine's layout (its `signature` and digest) is not the one the trainer plans for."""
    if theirs.get("digest") == expected.digest:
        return None
    mine = {name: (dtype, shapes) for name, dtype, shapes in signature(expected)}
    given = {name: (dtype, shapes) for name, dtype, shapes in theirs.get("tensors", [])}
    if theirs.get("ranks") != expected.ranks:
        return f"its layout spans {theirs.get('ranks')} ranks, the trainer's {expected.path} spans {expected.ranks}"
    for name in mine:
        if name not in given:
            return f"its layout has no tensor `{name}` ({expected.path} has)"
        if given[name] != mine[name]:
            (d0, s0), (d1, s1) = mine[name], given[name]
            return f"tensor `{name}`: the trainer expects {d0} {s0}, the replica's layout says {d1} {s1}"
    extra = sorted(set(given) - set(mine))
    if extra:
        return f"its layout has tensor `{extra[0]}`, which {expected.path} does not"
    return (f"its layout's text or args differ from {expected.path} (digest {str(theirs.get('digest'))[:12]}, "
            f"expected {expected.digest[:12]})")


class ReplicaPlans:
    """Membership plans by (replica layout, replica count), the same on trainer and engine ranks.

    Every replica of a job runs `one`'s text; its args may differ (an EPLB engine publishes
    the expert map it holds now: layoutlang/runtime/jobs.md "Replicas with their own args"). Replicas
    with equal layouts share one K-copy plan (MemberPlanner, geometry shared across K); one
    replica whose args differ from `one`'s in a single table arg is planned through that
    table's TablePlanner (its ranks after the trainer's), so a new map re-plans on its fast
    path. Both kinds equal `compile_plan(src, replicate(layout, K, N), relay=False)`, so
    both sides reach the same digest whichever path each takes (the engine checks it)."""

    def __init__(self, src: Layout, one: Layout):
        self.src, self.one = src, one
        self._layouts: dict[str, Layout] = {}                  # args as JSON -> layout
        self._members: dict[str, members.MemberPlanner] = {}   # layout digest -> its planner
        self.tables: dict[str, object] = {}                    # table arg -> its TablePlanner
        self._plans: dict[tuple[str, int], object] = {}        # (args as JSON, copies) -> plan

    def layout(self, args: dict | None) -> Layout:
        """`one`'s text with `args` over its own (a replica's published args)."""
        if not args:
            return self.one
        key = json.dumps(args, sort_keys=True)
        if key not in self._layouts:
            if len(self.one.sources) != 1:
                raise UsageError(f"{self.one.path} includes other files: only its own args can be planned for")
            merged = {**dict(self.one.args), **{k: arg_value(v) for k, v in args.items()}}
            keep(self._layouts, key, loads(self.one.source_text, self.one.path, merged, unknown_args="ignore"),
                  KEPT)
        return self._layouts[key]

    def plan(self, copies: int, args: dict | None = None):
        """The plan into `copies` replicas that hold `one`'s text with `args` (None: `one`)."""
        key = (json.dumps(args, sort_keys=True), copies)
        if key not in self._plans:
            keep(self._plans, key, self._make(copies, args), KEPT)
        return self._plans[key]

    def _make(self, copies: int, args: dict | None):
        table = self._table_of(args) if copies == 1 else None
        if table is not None:
            if table not in self.tables:
                from layoutlang.compiler.tables import TablePlanner
                self.tables[table] = TablePlanner(self.src, self.one.source_text, table, dst_path=self.one.path,
                                                   dst_args=dict(self.one.args), replica_at=self.src.ranks,
                                                   relay=False)
            return self.tables[table].plan(arg_value(args[table]))
        layout = self.layout(args)
        if layout.digest not in self._members:
            keep(self._members, layout.digest, members.MemberPlanner(self.src, layout), 2)
        return self._members[layout.digest].plan(copies)

    def _table_of(self, args: dict | None) -> str | None:
        """The one table arg in which `args` differ from `one`'s, if that is all they change."""
        if not args or len(self.one.sources) != 1:
            return None
        mine = dict(self.one.args)
        theirs = {name: arg_value(v) for name, v in args.items()}
        if not set(theirs) <= set(mine):
            return None
        changed = [name for name in theirs if theirs[name] != mine[name]]
        if len(changed) == 1 and isinstance(theirs[changed[0]], tuple):
            return changed[0]
        return None


def keep(cache: dict, key, value, most: int) -> None:
    """cache[key] = value, the oldest entries dropped past `most`."""
    cache[key] = value
    while len(cache) > most:
        cache.pop(next(iter(cache)))


def arg_value(v):
    """An arg as JSON carried it, as layouts hold it (tables: tuples of tuples)."""
    return tuple(arg_value(x) for x in v) if isinstance(v, list) else v


def args_json(layout: Layout) -> dict:
    """A layout's args as data (tables as lists)."""
    return {name: value for name, value in layout.args}
