"""A layout for a new value of one table arg, without elaborating it again (when that is exact).

An EPLB map (docs/language.md 14.8) is a table arg that only the keys of a
stored tensor read: `[p in 0..P over ep, ... as ...experts.{EPLB[l][p]}...]`.
vLLM rebalances it every `step_interval` steps, and a refit must then re-plan
(layoutlang/compiler/tables.py). Elaborating the whole layout again for each map costs
what the first load did; but when the table's entries are read ONLY as whole
interpolations of keys (`{T[i][j]}`, never in a shape, a loop bound, a const
or arithmetic), a new map of the same lengths changes nothing but those keys.

`watch(source, args, table)` elaborates once, counting every integer read of
the table, and records per key that reads it a recipe: its text with the
entries left open (their indices evaluated). The layout is re-keyable when the
recipes account for every read. `TableKeys.rekey(value)` then renders each
recipe for the new value and checks the rules elaboration checks on keys (a
key held by one stored tensor only; twice in one tensor only as the same
template at another stack index: EPLB's redundant experts). It returns None
whenever the shortcut is not exact: a value of other lengths, a broken key
rule (a fresh load then raises the real diagnostic), a layout that is not
re-keyable.

Preserves: `rekey(v)` equals `loads(text, path, {**args, table: v})` in every
field the plan reads (tensors, names, regions, args, digest); meshes, dims and
fixed coordinates are the very objects of the first load (so placements and
templates stay shared).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from ..ir import KeyRegion, Layout, TensorIR
from .driver import Elaboration, finish, run_file
from .keys import NOT_REKEYABLE
from .scope import Table, table_value
from .limits import INT64_MAX
from .sources import Source, digest_of
from ..gcpause import gc_paused

_new, _set = object.__new__, object.__setattr__
# KeyRegion's slot setters: a re-keyed region is made through them (rekey)
_SLOTS = tuple(KeyRegion.__dict__[name].__set__ for name in ("key", "box", "stacked", "transposed", "part_dim", "shape"))
# memos a tensor may carry that do not depend on its keys (copied into a re-keyed tensor)
_KEPT_MEMOS = ("_placement", "local_bytes", "used_axes")


def watch(source: Source, args: dict | None, table: str, unknown_args: str = "error") -> tuple[Layout, "TableKeys"]:
    """The layout, elaborated once, and what re-keys it for other values of `table`."""
    el = Elaboration(args or {})
    el.scope.watch = table
    with gc_paused():
        run_file(el, source)
        layout = finish(el, source.path, unknown_args)
    return layout, TableKeys(layout, table, el.recipes, el.scope.watch_reads)


def _shape(value) -> tuple | None:
    """A table's lengths at every level (None for an int): equal shapes, same entries read."""
    return tuple(_shape(v) for v in value) if isinstance(value, tuple) else None


def _table(value, name: str) -> tuple[Table, tuple]:
    """(`value` as the layout holds a table (scope.table_value's rules), its lengths): a list of
    lists of plain ints, a map's usual form, is checked at C speed (its lengths: each row's)."""
    if isinstance(value, (list, tuple)) and all(type(row) in (list, tuple) and all(type(x) is int for x in row)
                                                and (not row or -INT64_MAX - 1 <= min(row) and max(row) <= INT64_MAX)
                                                for row in value):
        return tuple(map(tuple, value)), ("rows",) + tuple(map(len, value))
    value = table_value(value, name)
    return value, _shape(value)


def _entry(value: Table, at: tuple[int, ...]) -> int:
    for i in at:
        value = value[i]
    return value


@dataclass(frozen=True)
class _Watched:
    """A stored tensor whose keys read the table: its position, per region the recipe (None:
    a key that does not read the table), per region its stack index and span."""

    position: int
    recipes: tuple
    indices: tuple
    spans: tuple

    @property
    def by_span(self) -> tuple[tuple[int, ...], ...] | None:
        """The regions per key template (span), when no template holds two regions at one stack
        index: then keys.py's rule (a key held twice only by one template, at another index)
        holds exactly when no key is in two of these groups. None otherwise."""
        hit = self.__dict__.get("_by_span", False)
        if hit is False:
            groups: dict[int, list[int]] = {}
            for k, span in enumerate(self.spans):
                groups.setdefault(id(span), []).append(k)
            pairs = {(id(span), index) for span, index in zip(self.spans, self.indices)}
            hit = tuple(map(tuple, groups.values())) if len(pairs) == len(self.spans) else None
            object.__setattr__(self, "_by_span", hit)
        return hit

    @property
    def compiled(self) -> tuple:
        """Per re-keyed region (k, text before, i, j, text after): a key of one entry `{T[i][j]}`
        is `before + str(T[i][j]) + after`; any other recipe is (k, None, recipe, None, "")."""
        hit = self.__dict__.get("_compiled")
        if hit is None:
            out = []
            for k, r in enumerate(self.recipes):
                if r is None or r is NOT_REKEYABLE:
                    continue
                at = [i for i, p in enumerate(r) if p.__class__ is tuple]
                if len(at) == 1 and len(r[at[0]]) == 2:
                    i = at[0]
                    out.append((k, "".join(r[:i]), r[i][0], r[i][1], "".join(r[i + 1:])))
                else:
                    out.append((k, None, r, None, ""))
            hit = tuple(out)
            object.__setattr__(self, "_compiled", hit)
        return hit


def _held_once(keys: list[str], w: _Watched) -> bool:
    """keys.py's rule for a key held twice in one tensor: only by the same template (span) at
    another stack index, compared with the key's first holder."""
    first: dict[str, int] = {}
    for k, key in enumerate(keys):
        j = first.setdefault(key, k)
        if j != k and not (w.spans[j] is w.spans[k] and w.indices[j] != w.indices[k]):
            return False
    return True


class TableKeys:
    """What `rekey` needs, kept from the first elaboration (see the module docstring)."""

    def __init__(self, layout: Layout, table: str, recorded: list, reads: int):
        self.layout, self.table = layout, table
        args = dict(layout.args)
        self.reason: str | None = None
        if table not in args or not isinstance(args[table], tuple):
            self.reason = f"the layout has no table arg `{table}`"
        self.value = args.get(table)
        self._shape = _table(self.value, table)[1] if isinstance(self.value, tuple) else None
        self.watched = tuple(_Watched(pos, rs, ix, sp) for pos, (rs, ix), sp in recorded)
        entries = 0
        for w in self.watched:
            for r in w.recipes:
                if r is NOT_REKEYABLE:
                    self.reason = (f"a key computes with an entry of `{table}`, other than as a whole key "
                                   f"interpolation `{{{table}[i][j]}}`: every value is elaborated in full")
                elif r is not None:
                    entries += sum(1 for p in r if p.__class__ is tuple)
        if self.reason is None and entries != reads:
            self.reason = (f"`{table}` is read {reads - entries} time(s) other than as a whole key interpolation "
                           f"`{{{table}[i][j]}}` (in a shape, a bound, a const or arithmetic): every value is "
                           "elaborated in full")
        # every key not made by a recipe, with the tensor holding it: a re-keyed key must not be one
        made = {(w.position, k) for w in self.watched for k, r in enumerate(w.recipes) if r is not None}
        self._others: dict[str, int] = {}
        for pos, t in enumerate(layout.tensors):
            if t.regions is None:
                self._others.setdefault(t.key, pos)
                continue
            for k, r in enumerate(t.regions):
                if (pos, k) not in made:
                    self._others.setdefault(r.key, pos)
        self._fields = {}
        self._suffix = ""

    @property
    def rekeyable(self) -> bool:
        return self.reason is None

    def placed(self, layout: Layout, suffix: str) -> "TableKeys":
        """These keys over `layout`: the first layout with other meshes (its tensors in the same
        order, the same keys), such as one engine replica of a job moved after the trainer's
        ranks (layoutlang/compiler/members.py `replicate`). Its re-keyed layouts take those meshes, and
        their digests are `sha256(digest + suffix)`, the digest that move gives the fresh load."""
        if len(layout.tensors) != len(self.layout.tensors) or dict(layout.args) != dict(self.layout.args):
            raise ValueError("TableKeys.placed: another layout, not this one placed elsewhere")
        out = object.__new__(TableKeys)
        out.__dict__.update(self.__dict__, layout=layout, _suffix=suffix)
        return out

    def rekey(self, value) -> Layout | None:
        """The layout for `table = value`, or None where only a fresh load is exact."""
        if self.reason is not None:
            return None
        value, shape = _table(value, self.table)
        if shape != self._shape:
            return None
        if value == self.value:
            return self.layout
        old = self.layout
        tensors = list(old.tensors)
        others, made, total = self._others, set(), 0
        strs: dict[int, str] = {}
        new = _new
        set_key, set_box, set_stacked, set_transposed, set_part, set_shape = _SLOTS
        for w in self.watched:
            t = tensors[w.position]
            regions = list(t.regions)
            for k, pre, a, b, post in w.compiled:
                if pre is None:  # another form: the recipe (in `a`) in full
                    key = "".join(p if p.__class__ is str else str(_entry(value, p)) for p in a)
                else:  # one entry of a two-level table, `{T[a][b]}`
                    e = value[a][b]
                    text = strs.get(e)
                    if text is None:
                        text = strs[e] = str(e)
                    key = pre + text + post
                r = regions[k]
                if key != r.key:  # KeyRegion(key, ...) through its slots: half the time
                    o = new(KeyRegion)
                    set_key(o, key), set_box(o, r.box), set_stacked(o, r.stacked)
                    set_transposed(o, r.transposed), set_part(o, r.part_dim), set_shape(o, r.shape)
                    regions[k] = o
            if w.by_span is not None:  # keys.py's rule, as set sizes (`_Watched.by_span`)
                groups = [{regions[k].key for k in ks} for ks in w.by_span]
                distinct = set().union(*groups)
                if len(distinct) != sum(map(len, groups)):
                    return None  # one key under two templates of one tensor: a fresh load says where
            else:
                keys = [r.key for r in regions]
                distinct = set(keys)
                if len(distinct) != len(keys) and not _held_once(keys, w):
                    return None  # held twice in one tensor (keys.py's rule): a fresh load says where
            for key in distinct.intersection(others):
                if others[key] != w.position:
                    return None  # a key of another tensor
            made |= distinct
            total += len(distinct)
            tensors[w.position] = self._retyped(t, tuple(regions))
        if len(made) != total:
            return None  # two re-keyed tensors hold one key
        args = [(n, value if n == self.table else v) for n, v in old.args]
        digest = digest_of(old.sources, args)
        if self._suffix:
            digest = hashlib.sha256(f"{digest}{self._suffix}".encode()).hexdigest()
        return Layout(old.path, old.name, old.meshes, tuple(tensors), tuple(args), digest, old.sources)

    def _retyped(self, t: TensorIR, regions: tuple[KeyRegion, ...]) -> TensorIR:
        """`t` with other regions: its fields and key-independent memos, regions replaced."""
        cls = type(t)
        names = self._fields.get(cls)
        if names is None:
            names = self._fields[cls] = tuple(f.name for f in dataclasses.fields(cls)) + _KEPT_MEMOS
        d = t.__dict__
        fields = {n: d[n] for n in names if n in d}
        fields["regions"] = regions
        out = _new(cls)
        _set(out, "__dict__", fields)
        return out
