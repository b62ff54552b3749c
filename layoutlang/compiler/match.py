"""Matching destination tensors to source tensors by KEY (LANGUAGE.md 2.4, 5).

Every destination key must exist in the source with the same logical extents
per dim and the same part tree after hoisting; a mismatch is a diagnostic at
the destination declaration with a note at the source one. Source keys the
destination lacks are returned as warnings, not errors.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from layoutlang.diagnostics import LayoutError, Note
from layoutlang.ir import KeyRegion, Layout, TensorIR
from layoutlang.modes import ConcatM, Leaf, PartNode, PartTree, tree_extent


class PlanError(LayoutError):
    """Two layouts that cannot be planned together (missing key, shape, coverage)."""


@dataclass(frozen=True)
class Match:
    """One destination key in one stored instance, and every source instance that holds the key.

    v1 tensors hold one key, the whole tensor (`region` None). A v2 stored
    tensor with part keys (LANGUAGE.md 8.1) yields one Match per key, its
    `region` the key's logical box in the stored tensor; `src_regions[i]` is
    the same for `src[i]`. Matches of one stored instance are consecutive.
    """

    dst: TensorIR
    src: tuple[TensorIR, ...]
    region: KeyRegion | None = None
    src_regions: tuple[KeyRegion | None, ...] = ()

    @property
    def key(self) -> str:
        return self.region.key if self.region is not None else self.dst.key

    @property
    def shape(self) -> tuple[int, ...]:
        """The key's logical shape."""
        return self.region.key_shape if self.region is not None else self.dst.logical_shape

    def src_region(self, i: int) -> KeyRegion | None:
        return self.src_regions[i] if self.src_regions else None


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def describe_tree(tree: PartTree) -> str:
    """A hoisted part tree as the language writes it: `(re: 16 | im: 16)`, `32`."""
    if isinstance(tree, Leaf):
        return str(tree.extent)
    return "(" + " | ".join((f"{n}: " if n else "") + describe_tree(t) for n, t in tree.parts) + ")"


ROTARY_HELP = ("q/k rows under rotary are each head's halves, `(heads, (re: D/2 | im: D/2))` as HF stores "
               "them: every `layoutc new` convention and the HF, Megatron and torchtitan bridges write them "
               "so; compile_plan reads a plain side as the halves it meets (layoutlang/compiler/refine.py), this planner "
               "compares part trees strictly: write the plain side so too (docs/bridges.md, rotary rows)")


def _rotary(tree: PartTree) -> bool:
    """Whether a hoisted part tree is rotary halves, `(re: ... | im: ...)`."""
    return isinstance(tree, PartNode) and tuple(n for n, _ in tree.parts) == ("re", "im")


def tree_difference(dst: PartTree, src: PartTree, path: str = "") -> str | None:
    """Why two hoisted part trees differ, or None if they match."""
    where = f" in part {path}" if path else ""
    if isinstance(dst, Leaf) and isinstance(src, Leaf):
        if dst.extent != src.extent:
            return f"extent {dst.extent} here but {src.extent} in the source{where}"
        return None
    if isinstance(dst, Leaf) or isinstance(src, Leaf):
        side = "the source" if isinstance(dst, Leaf) else "the destination"
        return (f"parts on one side only{where}: {describe_tree(dst)} here, {describe_tree(src)} in the "
                f"source ({side} is a concatenation)")
    if len(dst.parts) != len(src.parts):
        return (f"{len(dst.parts)} parts here but {len(src.parts)} in the source{where}: "
                f"{describe_tree(dst)} vs {describe_tree(src)}")
    for i, ((dn, dt), (sn, st)) in enumerate(zip(dst.parts, src.parts)):
        if dn and sn and dn != sn:
            return f"part {i} is named `{dn}` here but `{sn}` in the source{where}"
        label = dn or sn or str(i)
        diff = tree_difference(dt, st, f"{path}.{label}" if path else label)
        if diff:
            return diff
    return None


def key_items(layout: Layout) -> dict[str, tuple[tuple[TensorIR, KeyRegion | None], ...]]:
    """Every key of a layout with the stored instances (and regions) that hold it, in file order."""
    return layout.key_index


def key_trees(t: TensorIR, region: KeyRegion | None) -> list[PartTree]:
    """The key's hoisted part tree per dim: a keyed dim contributes the keyed part's subtree."""
    if region is None:
        return [d.part_tree for d in t.dims]
    if region.shape is not None:  # a flat dim's key (docs/language.md 14.9): its own dims' trees
        return [m.part_tree for m in flat_key(t, region).dims]
    out = []
    for i, (d, (lo, hi)) in enumerate(zip(t.dims, region.box)):
        if i not in region.stacked:  # a stacked dim is not a dim of the key
            out.append(keyed_part(d.part_tree, lo, hi) if i == region.part_dim else d.part_tree)
    return out[::-1] if region.transposed else out


def flat_key(t: TensorIR, region: KeyRegion):
    """The KeyM of a flat dim's key (its region starts where the key's logical elements do)."""
    mode = t.dims[0].mode
    mode = getattr(mode, "inner", mode)  # `flat(...) pad K`
    lo, at = region.box[0][0], 0
    for k in mode.keys:
        if at == lo and k.logical == region.box[0][1] - lo:
            return k
        at += k.logical
    raise AssertionError((t.name, region))


def keyed_part(tree: PartTree, lo: int, hi: int) -> PartTree:
    """The subtree of the concatenation part that covers exactly logical [lo, hi): the part
    that carries a key (`(q: M as KEY | ...)`, hoisted), descending at least one level.

    >>> keyed_part(PartNode((("p0", Leaf(8)),)), 0, 8)
    Leaf(extent=8)
    """
    if isinstance(tree, PartNode):
        at = 0
        for _, part in tree.parts:
            n = tree_extent(part)
            if (at, at + n) == (lo, hi):
                return part
            if at <= lo and hi <= at + n:
                return keyed_part(part, lo - at, hi - at)
            at += n
    return Leaf(hi - lo)


def match(src: Layout, dst: Layout) -> tuple[list[Match], list[str]]:
    """Pair every destination key (per stored instance) with its source instances; list unused source keys."""
    return match_collecting(src, dst, None)


def match_collecting(src: Layout, dst: Layout, one_sided: list | None) -> tuple[list[Match], list[str]]:
    """`match`; with a list `one_sided`, a key whose part trees differ only where one side is plain
    and the other has parts of equal extent (layoutlang/compiler/refine.py reads the plain side as those
    parts) is appended to it instead of being refused."""
    by_key = key_items(src)
    matches: list[Match] = []
    checked: set[str] = set()
    compared: set[tuple] = set()  # (dst dims, dst box, src dims, src box) already compared
    for t in dst.tensors:
        for region in (None,) if t.regions is None else t.regions:
            key = region.key if region is not None else t.key
            items = by_key.get(key)
            if items is None:
                raise missing_key_error(key, t, region, src, by_key)
            sources, src_regions = zip(*items)
            if src_regions[0] is None and src_regions.count(None) == len(src_regions):  # v1 sources
                src_regions = ()
            m = Match(t, sources, region, src_regions)
            if key not in checked:
                checked.add(key)
                check_same_key(m, compared, one_sided)
            matches.append(m)
    unused = [k for k in by_key if k not in checked]
    return matches, unused


def missing_key_error(key: str, t: TensorIR, region: KeyRegion | None, src: Layout, by_key) -> PlanError:
    """A destination key the source lacks (LANGUAGE.md 8.4): say which stored tensor declares
    it, and point at the line to edit. A fused tensor whose parts have no keys, on either
    side, is the usual cause (HF keeps q/k/v apart, Megatron and vLLM fuse them): part
    keys are suggested there, never another weight's similar key."""
    error = f"key `{key}` is not in the source layout {src.path}"
    notes: list[Note] = []
    stacked = region is not None and region.stacked
    if stacked:
        at = ", ".join(f"{var} = {value}" for var, value in _stack_indices(t, region))
        notes.append(Note(f"stored tensor `{t.name}` declares it at stacked index {at}", t.span))
    elif key != t.key:
        notes.append(Note(f"stored tensor `{t.name}` declares it", t.span))
    close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.8)
    dst_parts = _parts_form(t) if t.regions is None else None
    if dst_parts:  # this fused tensor is one key; the source holds its parts apart
        if close:
            holder = by_key[close[0]][0][0]
            notes.append(Note(f"the source has a similarly named key `{close[0]}`", holder.span))
        return PlanError(error, t.span, notes=notes,
                         help="if the parts of this fused tensor are keys of their own in the source, give "
                              f"them their keys on this line: `{dst_parts}` (LANGUAGE.md 8.1)")
    fused = [(s, form) for s in src.tensors if s.regions is None for form in [_parts_form(s)] if form]
    if fused:
        nearest = difflib.get_close_matches(key, [s.name for s, _ in fused], n=1, cutoff=0.0)[0]
        holder, form = next((s, f) for s, f in fused if s.name == nearest)
        notes.append(Note(f"fused source tensor `{holder.name}` has parts without keys; edit this line",
                          holder.span))
        return PlanError(error, t.span, notes=notes,
                         help=f"if it holds the key, give its parts keys: `{form}`, one of them `{key}` "
                              "(LANGUAGE.md 8.1)")
    if stacked:
        template = _key_template(t) or key
        return PlanError(error, t.span, notes=notes,
                         help="the source must declare the key of every expert: give its per-expert tensors "
                              f"`as {template}`, or change this `as KEY` to the source's keys (LANGUAGE.md 8.2)")
    hint = f"did you mean `{close[0]}`? " if close else ""
    return PlanError(error, t.span, notes=notes,
                     help=hint + ("give the tensor the source's key with `as KEY`" if key == t.key
                                  else "give the part the source's key with `as KEY`"))


def _parts_form(t: TensorIR) -> str | None:
    """`(q: 64 as KEY | k: 16 as KEY | ...)` for the first concatenation among t's dims, or None."""
    from layoutlang.fmt import format_mode

    for d in t.dims:
        concat = _first_concat(d.mode)
        if concat is not None and concat.origin is not None:
            parts = [(f"{p.name}: " if p.name else "") + format_mode(p.mode) + " as KEY"
                     for p in concat.origin.parts]
            return "(" + " | ".join(parts) + ")"
    return None


def _first_concat(mode):
    if isinstance(mode, ConcatM):
        return mode if len(mode.parts) > 1 else None
    inner = getattr(mode, "inner", None)
    return _first_concat(inner) if inner is not None else None


def _stack_indices(t: TensorIR, region: KeyRegion) -> list[tuple[str, int]]:
    """(variable, value) of each stacked dim of `region`: `e in A..B` holds e = A + index."""
    out = []
    for i in region.stacked:
        origin = t.dims[i].mode.origin
        start = region.box[i][0]
        if origin is not None and hasattr(origin, "var"):
            out.append((origin.var, start + _literal(origin.start)))
        else:
            out.append((f"dim {i}", start))
    return out


def _literal(expr) -> int:
    """The value of a stack's start when it is a literal (the common `0..E`); else 0 offset unknown."""
    value = getattr(expr, "value", None)
    return value if isinstance(value, int) else 0


def _key_template(t: TensorIR) -> str | None:
    """The `as KEY` template of t's statement, as written (`...experts.{e}.down_proj.weight`)."""
    if t.span is None:
        return None
    text = t.span.source.line_text(t.span.line)
    found = re.search(r"\bas\s+(\S+)\s*\[", text)
    return found.group(1) if found else None


def region_signature(r: KeyRegion | None) -> tuple | None:
    return None if r is None else (r.box, r.stacked, r.transposed, r.part_dim, r.shape)


def one_sided_only(a: PartTree, b: PartTree) -> bool:
    """Whether two hoisted part trees differ only where one is a leaf and the other a
    concatenation of the same extent (names may be left out on one side).

    >>> one_sided_only(Leaf(32), PartNode((("re", Leaf(16)), ("im", Leaf(16)))))
    True
    """
    if isinstance(a, Leaf) or isinstance(b, Leaf):
        return tree_extent(a) == tree_extent(b)
    if len(a.parts) != len(b.parts):
        return False
    return all((not an or not bn or an == bn) and one_sided_only(at, bt)
               for (an, at), (bn, bt) in zip(a.parts, b.parts))


def check_same_key(m: Match, compared: set, one_sided: list | None = None) -> None:
    """Same logical shape and the same hoisted part trees for a key on both sides; with a list
    `one_sided`, trees that differ only where one side is plain put the match there instead."""
    first, first_region = m.src[0], m.src_region(0)
    # the same dims and regions (box, stacked dims, transposition, part dim) give the same shapes and
    # part trees (`key_trees`): each such pair is compared once
    sig = (id(m.dst.dims), region_signature(m.region), id(first.dims), region_signature(first_region))
    if sig in compared:
        return
    compared.add(sig)
    src_shape = first_region.key_shape if first_region is not None else first.logical_shape
    if m.shape != src_shape:
        raise PlanError(
            f"`{m.key}` has logical shape {_shape(m.shape)} here but {_shape(src_shape)} in the source",
            m.dst.span, notes=[Note("the source declaration", first.span)],
            help="the two layouts must describe the same logical tensor")
    pairs = list(zip(key_trees(m.dst, m.region), key_trees(first, first_region)))
    if one_sided is not None and any(tree_difference(d, s) for d, s in pairs) and all(one_sided_only(d, s) for d, s in pairs):
        one_sided.append(m)
        return
    for i, (d, s) in enumerate(pairs):
        diff = tree_difference(d, s)
        if diff:
            raise PlanError(
                f"`{m.key}` dim {i}: {diff}", m.dst.span,
                notes=[Note("the source declaration", first.span)],
                help=ROTARY_HELP if _rotary(d) != _rotary(s) else
                "write the same parts on both sides (names may be left out on one); "
                "a strided `(gate: F | up: F)` never matches a plain `2*F`")
