"""Parts on one side only: a plain dim read as the other side's parts of the same key.

LANGUAGE.md 3 matches two dims by their hoisted part trees. Where one side stores a
key's rows plainly (`NH*D`) and the other writes the SAME rows as parts of that key
(`(NH, (re: D/2 | im: D/2))`, no `as`: HF's rotary halves, a checkpoint read without
its config.json), the plain rows are the parts in their WRITTEN order: storage order is
the written order on both sides, only the logical index differs (hoisting puts every re
half before every im half). So the plan refines the plain side: its mode becomes the
other side's parts, with its own split, padding and `chunk` kept, and every later stage
sees two sides with the same part tree.

    plain     [64, H]                        one rank: rows 0..63 as stored
    parts     [(4, (re: 8 | im: 8)) over tp, H]
    refined   [(4, (re: 8 | im: 8)), H]      the same rows, logical order hoisted

Preserves: the plain side's storage. Every rank stores the same stored rows of the dim
after refinement as before (`select` of each `over` coordinate compared, `pad` and
`chunk` kept); a refinement that would move a row (a plain `2*F over tp` against a
strided `(gate: F | up: F) over tp`: `over` splits each part of a concatenation) is
refused, naming the split. Only the logical index of the plain side changes, and only
inside that key: a refined key's box in its stored tensor is unchanged (a leaf and the
parts that replace it have one extent).

A plain side is refined only by parts that keep runs of rows together. Where the parts it
would adopt interleave element by element (a concatenation of two or more parts of one row
each, under a product of more than one copy: Meta's `(NH, D/2, (re: 1 | im: 1))`), the
orders differ in the world (Meta's checkpoints and torchtitan's Llama3 against HF's halves,
which plain HF-named rows hold by the project's key convention) and the plain side cannot
say which it holds: refused at the plain side's declaration, naming the key and the
interleaved parts, help: write the parts on this side too (a checkpoint: its config.json).
The hoisted trees of the two orders are the same, `(re: NH*D/2 | im: NH*D/2)`, and so is
the depth of products above the concatenation where Megatron groups its q heads
(`(KV, (q: (QG, (re: D/2 | im: D/2)) | ...))`): the extent of the interleaved parts is what
tells them apart. Only where both sides write the parts is Meta's order paired with HF's.

Pairs that plan without refinement are untouched (`pair` returns the same layouts).
"""

from __future__ import annotations

import dataclasses

from layoutlang.diagnostics import Note
from layoutlang.ir import DimIR, KeyRegion, Layout, TensorIR
from layoutlang.modes import (ConcatM, Leaf, PadM, PartM, PartNode, PartTree, PlainM, ProductM, SplitError,
                              check_split, select, select_uneven, tree_extent)

from .match import Match, PlanError, describe_tree, key_trees, match, match_collecting

Path = tuple[int, ...]  # part indices from a dim's root, one per concatenation level of its hoisted tree


def pair(src: Layout, dst: Layout) -> tuple[Layout, Layout, list[Match], list[str]]:
    """(src, dst, matches, unused source keys): `match`, after refining the plain side of every
    key whose rows one side writes as parts and the other plainly. Layouts that need no
    refinement come back as the same objects."""
    one_sided: list[Match] = []
    matches, unused = match_collecting(src, dst, one_sided)
    if not one_sided:
        return src, dst, matches, unused
    src, dst = refine(src, dst, matches)
    matches, unused = match(src, dst)  # every part tree compared again, strictly
    return src, dst, matches, unused


def refine(src: Layout, dst: Layout, matches: list[Match]) -> tuple[Layout, Layout]:
    """The two layouts with every plain instance of a key refined by the parts another
    instance of that key writes (the destination's, else the first source's that has them)."""
    wanted: dict[int, tuple[TensorIR, dict]] = {}  # id(instance) -> (it, {(dim, path): mode})
    memo: dict[tuple, list] = {}
    for m in matches:
        instances = [(m.dst, m.region)] + [(s, m.src_region(i)) for i, s in enumerate(m.src)]
        sig = tuple((id(t.dims), None if r is None else (r.box, r.stacked, r.transposed, r.part_dim))
                    for t, r in instances)
        found = memo.get(sig)
        if found is None:
            found = memo[sig] = _refinements(m, instances)
        for which, dim, path, mode in found:
            t = instances[which][0]
            entry = wanted.setdefault(id(t), (t, {}))[1]
            before = entry.setdefault((dim, path), mode)
            if before != mode:
                raise PlanError(f"`{m.key}`: stored tensor `{t.name}` holds plain rows that two instances of its "
                                f"keys write as different parts", t.span,
                                help="write the parts on this side too (LANGUAGE.md 3)")
    if not wanted:
        return src, dst
    dims_memo: dict = {}

    def refined(layout: Layout) -> Layout:
        if not any(id(t) in wanted for t in layout.tensors):
            return layout
        tensors = tuple(_refined_tensor(t, wanted[id(t)][1], dims_memo) if id(t) in wanted else t
                        for t in layout.tensors)
        return dataclasses.replace(layout, tensors=tensors)

    return refined(src), refined(dst)


def _refinements(m: Match, instances) -> list[tuple[int, int, Path, object]]:
    """(instance index, stored dim, path, the mode that replaces the plain node there) for every
    place where some instance of `m`'s key is a leaf and another has parts."""
    if any(r is not None and r.shape is not None for _, r in instances):
        return []  # a flat dim's key is never refined (docs/language.md 14.9): `match` compares strictly
    dims = [key_dims(t, r) for t, r in instances]
    trees = [key_trees(t, r) for t, r in instances]
    ndim = len(dims[0])
    if any(len(d) != ndim for d in dims):  # another key shape: `match` refuses it
        return []
    out = []
    for j in range(ndim):
        for sub, donor, plain in _one_sided([tr[j] for tr in trees]):
            d_dim, d_prefix = dims[donor][j]
            d_mode = instances[donor][0].dims[d_dim].mode
            products, node = _descend(d_mode, d_prefix + sub)
            parts = _unpadded(_wrap(products, node))
            woven = _interleaved(parts)
            if woven is not None:
                raise _unordered(m, j, plain[0], donor, instances, trees, sub, woven)
            for i in plain:
                t = instances[i][0]
                p_dim, p_prefix = dims[i][j]
                path = p_prefix + sub
                mode = _refined_node(t.dims[p_dim], path, parts)
                reason = mode if isinstance(mode, str) else None
                if reason is None:
                    reason = _storage_moves(t.dims[p_dim], _replace(t.dims[p_dim].mode, path, mode))
                if reason is not None:
                    raise _refused(m, j, i, donor, instances, trees, sub, reason)
                out.append((i, p_dim, path, mode))
    return out


def _one_side(m: Match, j: int, plain: int, donor: int, instances, trees, sub: Path):
    """(the plain instance, a note at the other side's declaration, the message's opening) of a
    refinement refused at `sub` of dim `j`."""
    t, other = instances[plain][0], instances[donor][0]
    here, there = _subtree(trees[plain][j], sub), _subtree(trees[donor][j], sub)
    side = "source" if donor else "destination"
    at = f" in part {'.'.join(map(str, sub))}" if sub else ""
    opening = (f"`{m.key}` dim {j}: parts on one side only{at}: {describe_tree(here)} in `{t.name}`, "
               f"{describe_tree(there)} in the {side}")
    return t, Note(f"the {side} declaration", other.span), opening


def _refused(m: Match, j: int, plain: int, donor: int, instances, trees, sub: Path, reason: str) -> PlanError:
    t, note, opening = _one_side(m, j, plain, donor, instances, trees, sub)
    return PlanError(
        f"{opening}; the plain rows cannot be read as those parts: {reason}",
        t.span, notes=[note],
        help="write the same parts on both sides (LANGUAGE.md 3); a plain side is read as the other "
             "side's parts only where that leaves every rank's rows where they are")


def _unordered(m: Match, j: int, plain: int, donor: int, instances, trees, sub: Path, woven) -> PlanError:
    t, note, opening = _one_side(m, j, plain, donor, instances, trees, sub)
    return PlanError(
        f"{opening}, which interleaves them row by row, `{written(woven)}`; "
        "plain rows do not say whether they are stored in that order or in runs of each part "
        "(Meta's interleaved rotary pairs against HF's halves)",
        t.span, notes=[note],
        help="write the parts on this side too (LANGUAGE.md 3); for a checkpoint, give it its config.json: "
             "beside the files (`layoutc new checkpoint DIR` reads it), `describe(dir, config=...)` or "
             "`save(..., config=...)`, which write HF's rotary halves")


def _interleaved(mode, under: bool = False):
    """The first product (outer first) whose copies are a concatenation of two or more parts of
    one row each, somewhere under a product of more than one copy: parts interleaved element
    by element (Meta's `(D/2, (re: 1 | im: 1))`). None where every part keeps runs of rows."""
    if isinstance(mode, PadM):
        return _interleaved(mode.inner, under)
    if isinstance(mode, ProductM):
        inner = mode.inner
        while isinstance(inner, PadM):
            inner = inner.inner
        if (mode.count > 1 and isinstance(inner, ConcatM) and len(inner.parts) > 1
                and all(p.mode.logical == 1 for p in inner.parts)):
            return mode
        return _interleaved(mode.inner, under or mode.count > 1)
    if isinstance(mode, ConcatM):
        if under and len(mode.parts) > 1 and all(p.mode.logical == 1 for p in mode.parts):
            return mode
        for p in mode.parts:
            found = _interleaved(p.mode, under)
            if found is not None:
                return found
    return None


def written(mode) -> str:
    """A mode as the language writes it, extents as numbers: `(4, (re: 1 | im: 1))`."""
    if isinstance(mode, PlainM):
        return str(mode.extent)
    if isinstance(mode, PadM):
        inner = written(mode.inner)
        return f"({inner} pad {mode.multiple})" if isinstance(mode.inner, PadM) else f"{inner} pad {mode.multiple}"
    if isinstance(mode, ProductM):
        counts = [mode.count]
        while isinstance(mode.inner, ProductM):
            mode = mode.inner
            counts.append(mode.count)
        inner = mode.inner
        tail = f"({written(inner)})" if isinstance(inner, PadM) else written(inner)
        return "(" + ", ".join(map(str, counts)) + ", " + tail + ")"
    return "(" + " | ".join((f"{p.name}: " if p.name else "") + written(p.mode) for p in mode.parts) + ")"


def key_dims(t: TensorIR, region: KeyRegion | None) -> list[tuple[int, Path]]:
    """Per dim of the key (key order): the stored dim that holds it and the path from that dim's
    root to the key's part (empty but for the dim with part keys)."""
    if region is None:
        return [(i, ()) for i in range(len(t.dims))]
    out = []
    for i, (d, (lo, hi)) in enumerate(zip(t.dims, region.box)):
        if i not in region.stacked:
            out.append((i, keyed_path(d.part_tree, lo, hi) if i == region.part_dim else ()))
    return out[::-1] if region.transposed else out


def keyed_path(tree: PartTree, lo: int, hi: int) -> Path:
    """The path to the part that covers exactly logical [lo, hi), descending at least one level
    (match.keyed_part's subtree, as indices)."""
    path: list[int] = []
    while isinstance(tree, PartNode):
        at = 0
        for i, (_, part) in enumerate(tree.parts):
            n = tree_extent(part)
            if (at, at + n) == (lo, hi):
                return tuple(path + [i])
            if at <= lo and hi <= at + n:
                path.append(i)
                tree, lo, hi = part, lo - at, hi - at
                break
            at += n
        else:
            break
    return tuple(path)


def _one_sided(trees: list[PartTree], path: Path = ()):
    """(path, donor, plain instances): where some trees are leaves and others concatenations of
    the same extent. The donor is the first instance with parts. Other differences are left
    to `match`."""
    nodes = [i for i, t in enumerate(trees) if isinstance(t, PartNode)]
    if not nodes:
        return
    leaves = [i for i, t in enumerate(trees) if isinstance(t, Leaf)]
    if leaves:
        if len({tree_extent(t) for t in trees}) == 1:
            yield path, nodes[0], leaves
        return
    counts = {len(trees[i].parts) for i in nodes}
    if len(counts) == 1:
        for k in range(counts.pop()):
            yield from _one_sided([t.parts[k][1] for t in trees], path + (k,))


def _subtree(tree: PartTree, path: Path) -> PartTree:
    for k in path:
        tree = tree.parts[k][1]
    return tree


def _descend(mode, path: Path):
    """(products passed, node): the mode node a path reaches, `pad` and products being
    transparent on the way (the hoisted tree's rule); a product passed is one the node's
    copies live under."""
    products = []
    while path:
        if isinstance(mode, PadM):
            mode = mode.inner
        elif isinstance(mode, ProductM):
            products.append(mode.count)
            mode = mode.inner
        elif isinstance(mode, ConcatM):
            mode, path = mode.parts[path[0]].mode, path[1:]
        else:
            raise AssertionError((mode, path))
    return tuple(products), mode


def _wrap(products: tuple[int, ...], mode):
    for n in reversed(products):
        mode = ProductM(n, mode)
    return mode


def _unpadded(mode):
    """The mode without its padding: the other side's storage, not the key's rows."""
    if isinstance(mode, PadM):
        return _unpadded(mode.inner)
    if isinstance(mode, ProductM):
        return ProductM(mode.count, _unpadded(mode.inner), mode.origin)
    if isinstance(mode, ConcatM):
        return ConcatM(tuple(PartM(p.name, _unpadded(p.mode)) for p in mode.parts), mode.origin)
    return mode


def _refined_node(d: DimIR, path: Path, parts):
    """What the plain node at `path` becomes: `parts` (the key's rows as the other side writes
    them, with the products above them) divided by the products the plain node lives under,
    inside the node's own padding. A reason (str) when the products do not divide."""
    products, node = _descend(d.mode, path)
    copies, core = 1, parts
    while isinstance(core, ProductM):
        copies, core = copies * core.count, core.inner
    outer = 1
    for n in products:
        outer *= n
    if copies % outer:
        return (f"the plain rows repeat {outer} times here, the parts' {copies} copies do not divide by it")
    inner = core if copies == outer else ProductM(copies // outer, core)
    return _with_content(node, inner)


def _with_content(node, inner):
    if isinstance(node, PadM):
        return PadM(_with_content(node.inner, inner), node.multiple, node.origin)
    return inner


def _replace(mode, path: Path, new):
    """`mode` with the node at `path` (as `_descend` reaches it) replaced by `new`."""
    if not path:
        return new
    if isinstance(mode, PadM):
        return PadM(_replace(mode.inner, path, new), mode.multiple, mode.origin)
    if isinstance(mode, ProductM):
        return ProductM(mode.count, _replace(mode.inner, path, new), mode.origin)
    parts = list(mode.parts)
    k = path[0]
    parts[k] = PartM(parts[k].name, _replace(parts[k].mode, path[1:], new))
    return ConcatM(tuple(parts), mode.origin)


def _storage_moves(d: DimIR, mode) -> str | None:
    """Why `mode` with d's split would store other rows on some rank than d stores, or None."""
    if mode.stored != d.mode.stored:
        return f"it stores {mode.stored} rows where the plain side stores {d.mode.stored}"
    if d.over is None:
        return None
    s, axis = d.over.size, "(" + ", ".join(d.over.names) + ")" if len(d.over.names) > 1 else d.over.names[0]
    if d.over.ragged:
        same = all(select_uneven(mode, s, c, d.over.placement) == select_uneven(d.mode, s, c, d.over.placement)
                   for c in range(s))
    else:
        try:
            check_split(mode, s, axis)
        except SplitError:
            same = False
        else:
            same = all(select(mode, s, c) == select(d.mode, s, c) for c in range(s))
    return None if same else (f"`over {axis}` cuts plain rows contiguously but would cut those parts "
                              "otherwise (each part of a concatenation, whole copies of a product)")


def _refined_tensor(t: TensorIR, refinements: dict, memo: dict) -> TensorIR:
    key = (id(t.dims), tuple(sorted(refinements.items(), key=lambda kv: kv[0])))
    dims = memo.get(key)
    if dims is None:
        dims = list(t.dims)
        for (i, path), mode in sorted(refinements.items(), key=lambda kv: kv[0]):
            d = dims[i]
            dims[i] = DimIR(_replace(d.mode, path, mode), d.over, d.chunk)
        dims = memo[key] = tuple(dims)
    return dataclasses.replace(t, dims=dims)


__all__ = ["pair", "refine", "key_dims", "keyed_path"]
