"""What each tensor instance is called, and that names and keys stay unique.

Guarantees: a NAME or KEY template renders with the current loop values; in a
NAME `{l.local}` is the iteration's index within the block its rank holds, in
a default KEY (the NAME's text) it is `l` itself, and an explicit KEY never
holds `.local`. A statement's instances have distinct KEYs; statements share a
KEY only as replicas of one logical tensor (equal logical shape and part
trees); a NAME is declared at most once per rank (LANGUAGE.md 2.4).

Per instance this keeps a few words: the first instance of each key and of each
name; a table of placement groups only for names declared again.
"""

from __future__ import annotations

from .. import ast
from ..diagnostics import ElaborationError, Note
from ..ir import DimIR, TensorIR
from .scope import Scope


def render(tpl: ast.NameTemplate, local: str, scope: Scope) -> str:
    """A name's text; `local` is "value" (a NAME), "global" (its default KEY)
    or "reject" (an explicit KEY).

    Inside loops a template is rendered once per iteration, so its pieces are
    resolved once (`_resolve`): a loop variable (or `.local`) to the depth of its
    frame, which is the same in every iteration of the statement."""
    loops = scope.loops
    if not loops:
        return "".join(p if p.__class__ is str else str(scope.evaluate(p.expr, local)) for p in tpl.pieces)
    pieces = scope.renders.get((id(tpl), local))
    if pieces is None:
        pieces = scope.renders[(id(tpl), local)] = _resolve(tpl, local, loops)
    out = []
    for kind, x in pieces:
        if kind is _TEXT:
            out.append(x)
        elif kind is _VALUE:
            out.append(str(loops[x].value))
        elif kind is _IN_BLOCK and loops[x[0]].block_starts:
            frame = loops[x[0]]
            out.append(str(frame.value - frame.block()[1]))
        else:  # any other expression, or a `.local` whose axis is not known yet (which raises)
            out.append(str(scope.evaluate(x if kind is _EXPR else x[1], local)))
    return "".join(out)


_TEXT, _VALUE, _IN_BLOCK, _EXPR = "text", "value", "in block", "expr"


def _resolve(tpl: ast.NameTemplate, local: str, loops: list) -> tuple[tuple[str, object], ...]:
    """(kind, what) per piece: text; a loop value (frame depth); a `.local` index in
    its block ((depth, expr)); or an expression `Scope.evaluate` computes (and checks)."""
    depth = {f.node.var: i for i, f in enumerate(loops)}  # loop variables shadow nothing
    out = []
    for p in tpl.pieces:
        if p.__class__ is str:
            out.append((_TEXT, p))
            continue
        expr = p.expr
        i = depth.get(expr.name) if expr.__class__ in (ast.Name, ast.Local) else None
        if i is None:
            out.append((_EXPR, expr))
        elif expr.__class__ is ast.Name:
            out.append((_VALUE, i))
        elif local not in ("value", "global") or getattr(loops[i].node, "over", None) is None:
            out.append((_EXPR, expr))  # `Scope.local_value` says why not
        else:
            out.append((_VALUE, i) if local == "global" else (_IN_BLOCK, (i, expr)))
    return tuple(out)


def names_and_key(stmt: ast.TensorDecl, scope: Scope) -> tuple[str, str]:
    """(NAME, KEY) of the current instance; one string object when they are equal."""
    name = render(stmt.name, "value", scope)
    key = render(stmt.key, "reject", scope) if stmt.key else render(stmt.name, "global", scope)
    return name, (name if key == name else key)


class Names:
    """The keys and names declared so far in one layout."""

    def __init__(self):
        self.keys: dict[str, TensorIR] = {}
        self.names: dict[str, TensorIR | dict[tuple, dict[tuple, TensorIR]]] = {}
        self.signatures: dict[tuple[DimIR, ...], tuple] = {}  # dims -> (logical shape, part trees)

    def register(self, t: TensorIR, stmt: ast.TensorDecl, region_spans=None) -> None:
        """Keys unique per statement (replicas across statements); names unique per rank.

        A v2 tensor registers the keys of its regions (`region_spans`: where each
        was written); a key inside a stored tensor is declared by one statement only."""
        if t.regions is not None:
            self.check_name(t, stmt)
            for region, span in zip(t.regions, region_spans):
                prior = self.keys.get(region.key)
                if prior is None:
                    self.keys[region.key] = t
                elif prior is t:  # another stack index of this tensor holds a replica (keys.py)
                    continue
                elif prior.span is stmt.span:
                    raise ElaborationError(f"key `{region.key}` repeats across iterations of this statement", span,
                                           help="interpolate every loop variable into the key, e.g. `{l}`")
                else:
                    raise _declared_again(region.key, t, prior, span)
            return
        prior = self.keys.get(t.key)
        if prior is not None and prior.regions is not None:
            raise _declared_again(t.key, t, prior, stmt.name.span if stmt.key is None else stmt.key.span)
        if prior is not None and prior.span is stmt.span:  # each statement has its own span object
            raise ElaborationError(f"key `{t.key}` repeats across iterations of this statement", stmt.name.span,
                                   help="interpolate every loop variable into the name, e.g. `{l}`")
        self.check_name(t, stmt)
        if prior is None:
            self.keys[t.key] = t
        elif prior.dims is not t.dims and self.signature(prior.dims) != self.signature(t.dims):
            raise ElaborationError(f"key `{t.key}` is declared again with a different logical tensor "
                                   f"({_shape(t.logical_shape)} vs {_shape(prior.logical_shape)})", stmt.name.span,
                                   notes=[Note("first declared here", prior.span)],
                                   help="statements may share a key only as replicas of one weight; "
                                        "use `as KEY` to give this one its own key")

    def signature(self, dims: tuple[DimIR, ...]) -> tuple:
        """What replicas must agree on: the logical shape and the part trees."""
        sig = self.signatures.get(dims)
        if sig is None:
            sig = self.signatures[dims] = (tuple(d.logical for d in dims), tuple(d.part_tree for d in dims))
        return sig

    def check_name(self, t: TensorIR, stmt: ast.TensorDecl) -> None:
        """A NAME is declared once per rank (LANGUAGE.md 2.4)."""
        by_group = self.names.get(t.name)
        if by_group is None:  # most names: declared once, remembered as the instance alone
            self.names[t.name] = t
            return
        group_key = (t.mesh.name, tuple(i for i, _ in t.fixed))
        coords = tuple(c for _, c in t.fixed)
        if isinstance(by_group, TensorIR):
            first = by_group
            by_group = self.names[t.name] = {
                (first.mesh.name, tuple(i for i, _ in first.fixed)): {tuple(c for _, c in first.fixed): first}}
        clash = by_group.get(group_key, {}).get(coords)
        if clash is None:
            for gk, members in by_group.items():
                if gk == group_key:
                    continue
                clash = next((other for other in members.values() if _intersect(t, other)), None)
                if clash is not None:
                    break
        if clash is not None:
            rank = next(r for r in t.ranks() if clash.holds(r))
            raise ElaborationError(f"tensor name `{t.name}` is declared twice on rank {rank}", stmt.name.span,
                                   notes=[Note("also declared here", clash.span)],
                                   help="names are local state-dict keys; each rank may hold a name once")
        by_group.setdefault(group_key, {})[coords] = t


def _declared_again(key: str, t: TensorIR, prior: TensorIR, span) -> ElaborationError:
    """A key held inside a stored tensor (v2) and declared by another statement too."""
    inside = prior if prior.regions is not None else t
    return ElaborationError(f"key `{key}` is declared again; it is a key inside the stored tensor `{inside.name}`",
                            span, notes=[Note("first declared here", prior.span)],
                            help="a key held inside a stored tensor (part keys, stacked dims, `transposed`) is "
                                 "declared by one statement only; give one of them another key")


def _intersect(a: TensorIR, b: TensorIR) -> bool:
    """Do two instances share a rank?"""
    if a.mesh.end <= b.mesh.offset or b.mesh.end <= a.mesh.offset:
        return False
    if a.mesh == b.mesh:
        fa, fb = dict(a.fixed), dict(b.fixed)
        return all(fb.get(i, c) == c for i, c in fa.items())
    return any(b.holds(r) for r in a.ranks())


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"
