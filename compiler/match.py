"""Matching destination tensors to source tensors by KEY (LANGUAGE.md 2.4, 5).

Every destination key must exist in the source with the same logical extents
per dim and the same part tree after hoisting; a mismatch is a diagnostic at
the destination declaration with a note at the source one. Source keys the
destination lacks are returned as warnings, not errors.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from layoutlang.diagnostics import LayoutError, Note
from layoutlang.ir import Layout, TensorIR
from layoutlang.modes import Leaf, PartTree


class PlanError(LayoutError):
    """Two layouts that cannot be planned together (missing key, shape, coverage)."""


@dataclass(frozen=True)
class Match:
    """A destination instance and every source instance of its key."""

    dst: TensorIR
    src: tuple[TensorIR, ...]


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _describe(tree: PartTree) -> str:
    if isinstance(tree, Leaf):
        return str(tree.extent)
    return "(" + " | ".join((f"{n}: " if n else "") + _describe(t) for n, t in tree.parts) + ")"


def tree_difference(dst: PartTree, src: PartTree, path: str = "") -> str | None:
    """Why two hoisted part trees differ, or None if they match."""
    where = f" in part {path}" if path else ""
    if isinstance(dst, Leaf) and isinstance(src, Leaf):
        if dst.extent != src.extent:
            return f"extent {dst.extent} here but {src.extent} in the source{where}"
        return None
    if isinstance(dst, Leaf) or isinstance(src, Leaf):
        side = "the source" if isinstance(dst, Leaf) else "the destination"
        return (f"parts on one side only{where}: {_describe(dst)} here, {_describe(src)} in the "
                f"source ({side} is a concatenation)")
    if len(dst.parts) != len(src.parts):
        return (f"{len(dst.parts)} parts here but {len(src.parts)} in the source{where}: "
                f"{_describe(dst)} vs {_describe(src)}")
    for i, ((dn, dt), (sn, st)) in enumerate(zip(dst.parts, src.parts)):
        if dn and sn and dn != sn:
            return f"part {i} is named `{dn}` here but `{sn}` in the source{where}"
        label = dn or sn or str(i)
        diff = tree_difference(dt, st, f"{path}.{label}" if path else label)
        if diff:
            return diff
    return None


def refuse_keys_inside(layout: Layout) -> None:
    """Keys inside stored tensors (LANGUAGE.md 8) are elaborated and checked but not planned yet."""
    t = next((t for t in layout.tensors if t.regions is not None), None)
    if t is not None:
        raise PlanError("keys inside stored tensors (part keys, stacked dims, transposed storage) are checked "
                        "but not planned yet", t.span,
                        help="planning them is the next step of issue 10; until then write one tensor "
                             "statement per key")


def match(src: Layout, dst: Layout) -> tuple[list[Match], list[str]]:
    """Pair every destination instance with its source instances; list unused source keys."""
    refuse_keys_inside(dst)
    refuse_keys_inside(src)
    by_key = src.by_key
    matches: list[Match] = []
    checked: set[str] = set()
    compared: set[tuple[int, int]] = set()  # (dst dims, src dims) objects already compared
    for t in dst.tensors:
        sources = by_key.get(t.key)
        if sources is None:
            close = difflib.get_close_matches(t.key, list(by_key), n=1, cutoff=0.8)
            raise PlanError(
                f"key `{t.key}` is not in the source layout {src.path}", t.span,
                help=(f"did you mean `{close[0]}`? " if close else "") +
                     "give the tensor the source's key with `as KEY`")
        if t.key not in checked:
            checked.add(t.key)
            first = sources[0]
            if len(t.dims) != len(first.dims) or t.logical_shape != first.logical_shape:
                raise PlanError(
                    f"`{t.key}` has logical shape {_shape(t.logical_shape)} here but "
                    f"{_shape(first.logical_shape)} in the source", t.span,
                    notes=[Note("the source declaration", first.span)],
                    help="the two layouts must describe the same logical tensor")
            if (id(t.dims), id(first.dims)) in compared:
                matches.append(Match(t, sources))
                continue
            compared.add((id(t.dims), id(first.dims)))
            for i, (d, s) in enumerate(zip(t.dims, first.dims)):
                diff = tree_difference(d.part_tree, s.part_tree)
                if diff:
                    raise PlanError(
                        f"`{t.key}` dim {i}: {diff}", t.span,
                        notes=[Note("the source declaration", first.span)],
                        help="write the same parts on both sides (names may be left out on one); "
                             "a strided `(gate: F | up: F)` never matches a plain `2*F`")
        matches.append(Match(t, sources))
    unused = [k for k in by_key if k not in checked]
    return matches, unused
