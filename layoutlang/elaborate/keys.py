"""Which keys a stored tensor holds (version 2, LANGUAGE.md 8): part keys, stacked dims, `transposed`.

Guarantees, per statement (checked once, before its dims are built): keyed parts
do not nest and cover every leaf of their dim; at most one dim has part keys; a
tensor with part keys has no `as KEY`; a stacked variable shadows no name, is
absent from the NAME and is used by the keys (the tensor's `as KEY`, or every
part key); `transposed` leaves exactly two dims besides the stacked ones.
Per instance: every key renders (loop and stack variables substituted), no key
is held twice, and the regions tile the stored tensor's logical box (stack
indices outer, then parts in logical order: `KeyRegion` in ir.py). A flat dim
(docs/language.md 14.9) is the tensor's only dim, with no `as KEY` and no
`transposed`; its keys, in written order, tile its logical elements, each
region carrying the key's own shape.

A v1 statement costs one dictionary look-up per instance here: `shape_of`
remembers per statement (inside loops) that it holds no keys of its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .. import ast
from ..diagnostics import ElaborationError, Note, Span
from ..ir import DimIR, KeyRegion
from ..modes import part_range
from . import limits
from .dims import flat_mode
from .names import render
from .scope import LoopFrame, Scope


@dataclass(frozen=True, slots=True)
class KeyedPart:
    """A part with `as KEY`: its path (a part index per concatenation level) and key."""

    path: tuple[int, ...]
    part: ast.Part


@dataclass(frozen=True, slots=True)
class StoredKeys:
    """What makes a statement v2: its stacked dims, its keyed dim and parts, `transposed`."""

    stacked: tuple[tuple[int, ast.Stack], ...]  # (dim index, stack), in dim order
    keyed_dim: int | None
    parts: tuple[KeyedPart, ...]  # in written order, which is logical order
    transposed: bool
    flat: ast.Flat | None = None  # a flat dim (docs/language.md 14.9): the tensor's only dim, its keys in order


def _keyed_parts(mode: ast.Mode, path: tuple[int, ...] = ()) -> list[KeyedPart]:
    """Every keyed part of a mode, outermost first along each path."""
    match mode:
        case ast.Concat(parts=parts):
            out = []
            for i, p in enumerate(parts):
                if p.key is not None:
                    out.append(KeyedPart(path + (i,), p))
                out.extend(_keyed_parts(p.mode, path + (i,)))
            return out
        case ast.Product(inner=inner) | ast.Pad(inner=inner):
            return _keyed_parts(inner, path)
    return []


def _part_label(part: ast.Part) -> str:
    return f"part `{part.name}`" if part.name else "this part"


def _check_coverage(mode: ast.Mode, enclosing: ast.Part | None = None) -> None:
    """Every leaf under exactly one keyed part (the caller has refused nesting)."""
    match mode:
        case ast.Concat(parts=parts):
            for p in parts:
                if p.key is None:
                    _check_coverage(p.mode, p)
        case ast.Product(inner=inner) | ast.Pad(inner=inner):
            _check_coverage(inner, enclosing)
        case ast.Plain():
            part = enclosing
            raise ElaborationError(
                f"{_part_label(part)} has no key, but other parts of this dim do: every element of a dim "
                "with part keys belongs to exactly one key", part.span,
                help="add `as KEY` to this part, or to the part that encloses it")


def _uses(tpl: ast.NameTemplate, var: str) -> ast.Interp | None:
    """The first `{EXPR}` of a name that uses `var`, or None."""
    for piece in tpl.pieces:
        if piece.__class__ is str:
            continue
        stack = [piece.expr]
        while stack:
            e = stack.pop()
            if isinstance(e, (ast.Name, ast.Local)) and e.name == var:
                return piece
            if isinstance(e, ast.BinOp):
                stack += [e.left, e.right]
            elif isinstance(e, ast.Neg):
                stack.append(e.operand)
            elif isinstance(e, ast.Call):
                stack.extend(e.args)
            elif isinstance(e, ast.Index):
                stack.extend(e.indices)
    return None


def _name_in(node, var: str):
    """The first `Name`/`Local` node for `var` in an AST subtree (part keys aside), or None."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, (ast.Name, ast.Local)):
            if x.name == var:
                return x
        elif isinstance(x, tuple):
            stack.extend(reversed(x))
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f) for f in reversed(tuple(x.__dataclass_fields__))
                         if f not in ("span", "key", "var_span"))
    return None


def _flat_of(dim: ast.Dim) -> ast.Flat | None:
    mode = dim.mode
    if mode.__class__ is ast.Pad:
        mode = mode.inner
    return mode if mode.__class__ is ast.Flat else None


def _analyze_flat(stmt: ast.TensorDecl, at: int, flat: ast.Flat) -> StoredKeys:
    """A tensor with a flat dim (docs/language.md 14.9): that dim alone, its keys named in it."""
    if len(stmt.dims) != 1:
        other = stmt.dims[1 if at == 0 else 0]
        raise ElaborationError("a flat dim must be the tensor's only dim", other.span,
                               notes=[Note("the flat dim", flat.span)],
                               help="a flat dim holds whole keys of any shape: write each key's dims in its "
                                    "`[...] as KEY`")
    if stmt.key is not None:
        raise ElaborationError("a tensor with a flat dim has no key of its own", stmt.key.span,
                               notes=[Note("its keys", flat.span)],
                               help="remove `as KEY` here: each key is named in the flat dim")
    if stmt.transposed is not None:
        raise ElaborationError("a flat dim stores its keys row-major; it cannot be `transposed`",
                               stmt.transposed.span, help="remove `transposed`")
    return StoredKeys((), None, (), False, flat)


def analyze(stmt: ast.TensorDecl, scope: Scope) -> StoredKeys | None:
    """The statement's keys structure, checked; None for a v1 statement."""
    for i, d in enumerate(stmt.dims):
        flat = _flat_of(d) if d.mode.__class__ is not ast.Stack else None
        if flat is not None:
            return _analyze_flat(stmt, i, flat)
    stacked = tuple((i, d.mode) for i, d in enumerate(stmt.dims) if d.mode.__class__ is ast.Stack)
    keyed: list[tuple[int, list[KeyedPart]]] = []
    for i, d in enumerate(stmt.dims):
        if d.mode.__class__ is not ast.Stack:
            found = _keyed_parts(d.mode)
            if found:
                keyed.append((i, found))
    if not stacked and not keyed and stmt.transposed is None:
        return None
    seen: dict[str, Span] = {}
    for _, stack in stacked:  # the variables first: every later message may name them
        var = stack.var
        loop = next((f.node for f in scope.loops if f.node.var == var), None)
        if var in scope.values or loop is not None or var in seen:
            notes = ([Note("the other stacked dim", seen[var])] if var in seen else
                     [Note("the loop", loop.var_span)] if loop is not None else [])
            raise ElaborationError(f"stacked variable `{var}` shadows an existing name", stack.var_span,
                                   notes=notes, help="choose another variable name")
        seen[var] = stack.var_span
        for d in stmt.dims:
            found = _name_in(d.mode if d.mode.__class__ is not ast.Stack else (d.mode.start, d.mode.stop), var)
            if found is not None:
                raise ElaborationError(f"the stacked variable `{var}` is visible only in the keys of this tensor, "
                                       "not in its dims", found.span, notes=[Note("the stacked dim", stack.span)],
                                       help="a dim's extent is the same for every index of the stack")
        used = _uses(stmt.name, var)
        if used is not None:
            raise ElaborationError(f"the stacked variable `{var}` cannot be used in the tensor's NAME: one "
                                   "stored tensor has one name", used.span,
                                   notes=[Note("the stacked dim", stack.span)],
                                   help=f"use `{{{var}}}` in the keys only (`as KEY` or the part keys)")
    parts: list[KeyedPart] = []
    keyed_dim = None
    if keyed:
        keyed_dim, parts = keyed[0]
        for kp in parts:
            inner = next((o for o in parts if o is not kp and o.path[:len(kp.path)] == kp.path), None)
            if inner is not None:
                raise ElaborationError("keyed parts do not nest: this part's key is inside another keyed part",
                                       inner.part.key.span, notes=[Note("the enclosing keyed part", kp.part.span)],
                                       help="keep the keys on one level: on the outer part or on the inner parts")
        _check_coverage(stmt.dims[keyed_dim].mode)
        if len(keyed) > 1:
            second = keyed[1][1][0].part
            raise ElaborationError(f"dims {keyed_dim} and {keyed[1][0]} both have part keys; at most one dim of "
                                   "a tensor has part keys", second.key.span,
                                   notes=[Note("the first dim with part keys", stmt.dims[keyed_dim].span)],
                                   help="split the tensor into one statement per key of the other dim")
        if stmt.key is not None:
            raise ElaborationError("a tensor with part keys has no key of its own", stmt.key.span,
                                   notes=[Note("a part key", parts[0].part.key.span)],
                                   help="remove `as KEY` here: each element belongs to the key of its part")
    for _, stack in stacked:
        var = stack.var
        if parts:
            lacking = next((kp.part for kp in parts if _uses(kp.part.key, var) is None), None)
            if lacking is not None:
                raise ElaborationError(f"this part key does not use the stacked variable `{var}`: every index "
                                       "would hold the same key", lacking.key.span,
                                       notes=[Note("the stacked dim", stack.span)],
                                       help=f"interpolate it into the key, e.g. `...experts.{{{var}}}...`")
        elif stmt.key is None or _uses(stmt.key, var) is None:
            where = stmt.key.span if stmt.key is not None else stack.var_span
            raise ElaborationError(f"no key uses the stacked variable `{var}`: every index would hold the same "
                                   "key", where, notes=[Note("the stacked dim", stack.span)] if stmt.key else [],
                                   help=f"give the tensor a key that uses it: `as ...experts.{{{var}}}.weight`, "
                                        "or part keys that do")
    if stmt.transposed is not None:
        kept = len(stmt.dims) - len(stacked)
        if kept != 2:
            raise ElaborationError(f"`transposed` needs a key of exactly two dims; this one has {kept}"
                                   + (" (stacked dims aside)" if stacked else ""), stmt.transposed.span,
                                   help="`transposed` stores a 2-d key as [in, out]; remove it, or write the "
                                        "two dims (after any stacked ones)")
    return StoredKeys(tuple(stacked), keyed_dim, tuple(parts), stmt.transposed is not None)


class Keys:
    """The per-statement analyses of one elaboration (dropped with their loops)."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.memo: dict[int, StoredKeys | None] = {}  # statement id -> analysis: cleared with the loop
        self.ranges: dict[tuple[DimIR, tuple], tuple[tuple[int, int], ...]] = {}
        self.count = 0  # regions made so far, against limits.MAX_KEYS
        # with `scope.watch` set (rekey.py): the last `regions` call's (per region its key recipe
        # or None, per region its stack index), else None
        self.last: tuple[tuple, tuple] | None = None

    def shape_of(self, stmt: ast.TensorDecl) -> StoredKeys | None:
        if not self.scope.loops:
            return analyze(stmt, self.scope)
        sid = id(stmt)
        if sid in self.memo:
            return self.memo[sid]
        found = self.memo[sid] = analyze(stmt, self.scope)
        return found

    def forget_statements(self) -> None:
        self.memo.clear()

    def part_ranges(self, dim: DimIR, parts: tuple[KeyedPart, ...]) -> tuple[tuple[int, int], ...]:
        """Each keyed part's logical [lo, hi) along its dim, after hoisting."""
        paths = tuple(kp.path for kp in parts)
        found = self.ranges.get((dim, paths))
        if found is None:
            found = self.ranges[(dim, paths)] = tuple(part_range(dim.part_tree, p) for p in paths)
        return found

    def regions(self, info: StoredKeys, stmt: ast.TensorDecl,
                dims: tuple[DimIR, ...]) -> tuple[tuple[KeyRegion, ...], tuple[Span, ...]]:
        """The instance's regions, and the span of the key template each came from."""
        if info.flat is not None:
            return self._flat_regions(info.flat, stmt, dims[0])
        scope = self.scope
        stacked_idx = tuple(i for i, _ in info.stacked)
        base = [(0, d.logical) for d in dims]
        if info.parts:
            cuts = self.part_ranges(dims[info.keyed_dim], info.parts)
            keyed = [(kp.part.key, cut) for kp, cut in zip(info.parts, cuts)]
        else:
            keyed = [(stmt.key, None)]
        makes = len(keyed)
        for i in stacked_idx:
            makes *= dims[i].logical
        if self.count + makes > limits.MAX_KEYS:
            raise ElaborationError(f"this tensor holds {makes} keys; at most {limits.MAX_KEYS} keys inside stored "
                                   "tensors per layout are supported", stmt.span, help="check the stacked ranges")
        self.count += makes
        starts = [scope.evaluate(s.start) for _, s in info.stacked]
        frames = [LoopFrame(s, a, a + dims[i].logical) for (i, s), a in zip(info.stacked, starts)]
        out: list[KeyRegion] = []
        spans: list[Span] = []
        held: dict[str, tuple[Span, tuple[int, ...]]] = {}  # key -> (template, stack index) first holding it
        watch = scope.watch
        recipes: list = []
        indices: list = []
        scope.loops.extend(frames)
        try:
            for index in itertools.product(*(range(dims[i].logical) for i in stacked_idx)):
                box = list(base)
                for frame, i, v in zip(frames, stacked_idx, index):
                    frame.value = frame.start + v
                    box[i] = (v, v + 1)
                for tpl, cut in keyed:
                    if cut is not None:
                        box[info.keyed_dim] = cut
                    key = render(tpl, "reject", scope) if tpl is not None else render(stmt.name, "global", scope)
                    span = tpl.span if tpl is not None else stmt.name.span
                    prior = held.get(key)
                    if prior is not None and not (prior[0] is span and prior[1] != index):
                        raise ElaborationError(f"key `{key}` is held twice by this tensor", span,
                                               notes=[Note("also here", prior[0])] if prior[0] is not span else [],
                                               help="every part key and every stack index must give its own key")
                    # the same key template at another stack index (a table maps both to one key:
                    # EPLB's redundant experts) holds a replica of the key (docs/language.md 14.8)
                    held.setdefault(key, (span, index))
                    out.append(KeyRegion(key, tuple(box), stacked_idx, info.transposed,
                                         info.keyed_dim if info.parts else None))
                    spans.append(span)
                    if watch is not None:
                        recipes.append(key_recipe(tpl, watch, scope) if tpl is not None else None)
                        indices.append(index)
        finally:
            del scope.loops[len(scope.loops) - len(frames):]
        self.last = (tuple(recipes), tuple(indices)) if any(r is not None for r in recipes) else None
        return tuple(out), tuple(spans)


    def _flat_regions(self, flat: ast.Flat, stmt: ast.TensorDecl,
                      dim: DimIR) -> tuple[tuple[KeyRegion, ...], tuple[Span, ...]]:
        """A flat dim's keys in written order: key i holds logical [L_i, L_i + numel_i) of the dim
        (L_i: the element counts before it) and has its own shape (docs/language.md 14.9)."""
        mode = flat_mode(dim.mode)
        if self.count + len(flat.keys) > limits.MAX_KEYS:
            raise ElaborationError(f"this tensor holds {len(flat.keys)} keys; at most {limits.MAX_KEYS} keys "
                                   "inside stored tensors per layout are supported", stmt.span)
        self.count += len(flat.keys)
        out: list[KeyRegion] = []
        held: dict[str, Span] = {}
        pos = 0
        for k, shape, n in zip(flat.keys, mode.shapes, mode.numels):
            key = render(k.key, "reject", self.scope)
            if key in held:
                raise ElaborationError(f"key `{key}` is held twice by this tensor", k.key.span,
                                       notes=[Note("also here", held[key])],
                                       help="every key of a flat dim is a different parameter: name each once")
            held[key] = k.key.span
            out.append(KeyRegion(key, ((pos, pos + n),), (), False, None, shape))
            pos += n
        self.last = None
        return tuple(out), tuple(k.key.span for k in flat.keys)


NOT_REKEYABLE = ("a key that computes with the table",)  # key_recipe's verdict, compared by identity


def key_recipe(tpl: ast.NameTemplate, table: str, scope: Scope) -> tuple | None:
    """The key of `tpl` as it stands now, its entries of `table` left open: per piece its text, or
    (for an interpolation that is exactly an entry, `{T[i][j]}`) the entry's indices. None when
    no piece is such an entry. Reads of `table` made here (an index that reads it, or an
    interpolation that computes with an entry) are left out of `scope.watch_reads`, so a key
    that reads the table in any other form leaves the count above the recipes' entries: the
    layout is then not re-keyable (rekey.py)."""
    if not any(p.__class__ is not str and p.expr.__class__ is ast.Index and p.expr.name == table
               for p in tpl.pieces):
        return None
    before = scope.watch_reads
    out: list = []
    for p in tpl.pieces:
        if p.__class__ is str:
            out.append(p)
        elif p.expr.__class__ is ast.Index and p.expr.name == table:
            out.append(tuple(scope.evaluate(i, "reject") for i in p.expr.indices))
        else:
            out.append(str(scope.evaluate(p.expr, "reject")))
    if scope.watch_reads != before:  # the table read other than as a whole entry: never re-keyed
        scope.watch_reads = before
        return NOT_REKEYABLE
    return tuple(out)
