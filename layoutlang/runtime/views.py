"""An op's slice of a local tensor as a torch view: plain, stepped or strided blocks.

A slice holds one entry per dim (layoutlang/compiler/strides.py, LANGUAGE.md 6):
`(start, stop)`, `(start, stop, step)` or `(start, stop, step, block)`. The view
has one torch dim per plain or stepped entry and two (count, block) per
blocked entry; `shape(slice)` is the receiver's shape of it. No copy, no Python
loop over rows: one `as_strided` over the tensor's storage. A copy between two
such views of different shapes (a blocked source into a plain destination, a
transposed key's block, `turned` here) views both ends in one shape (`aligned`)
instead of reshaping the source, which would copy it: a steady step's record
(layoutlang/runtime/replay.py) keeps the views, and a copy would keep the recorded values.
"""

from __future__ import annotations

import torch

from layoutlang.compiler.strides import parts


def shape(sl) -> list[int]:
    """The view's shape: per dim its extent, or (count, block) for a blocked entry."""
    out = []
    for e in sl:
        if len(e) == 4:
            _, count, _, block = parts(e)
            out += [count, block]
        elif len(e) == 3:
            out.append(parts(e)[1])
        else:
            out.append(e[1] - e[0])
    return out


def view(tensor: torch.Tensor, sl) -> torch.Tensor:
    """tensor[sl] as a view (sharing storage: writes land in `tensor`)."""
    if all(len(e) == 2 for e in sl):
        return tensor[tuple(slice(a, b) for a, b in sl)]
    offset, sizes, strides_ = tensor.storage_offset(), [], []
    for e, stride in zip(sl, tensor.stride()):
        start, count, step, block = parts(e)
        offset += start * stride
        if len(e) == 4:
            sizes += [count, block]
            strides_ += [step * stride, stride]
        elif len(e) == 3:
            sizes.append(count)
            strides_.append(step * stride)
        else:
            sizes.append(e[1] - e[0])
            strides_.append(stride)
    return tensor.as_strided(sizes, strides_, offset)


def turned(block: torch.Tensor, pq: tuple[int, int]) -> torch.Tensor:
    """A transposed key's source block `(p, q)` (its view: any dims of extent 1, each of p
    and q one dim or a (count, block) pair) as its transpose `(q, p)`, without copying: the
    dims that make up q moved before those of p (a view; the shape keeps the pairs)."""
    if block.numel() == 0:
        return block.reshape(pq).t()
    dims = [(n, s) for n, s in zip(block.shape, block.stride()) if n != 1]
    p, k, n = pq[0], 0, 1
    while n < p and k < len(dims):
        n, k = n * dims[k][0], k + 1
    if n != p or block.numel() != p * pq[1]:
        if block.numel() == p * pq[1]:
            try:  # a flat source's block (docs/language.md 14.9): p * q elements in one dim, row-major
                return block.view(pq).t()
            except RuntimeError:
                pass
        raise ValueError(f"a transposed block of shape {list(block.shape)} does not split into {pq[0]} x {pq[1]}")
    order = dims[k:] + dims[:k]
    return block.as_strided([n for n, _ in order], [s for _, s in order], block.storage_offset())


def aligned(target: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`target` and `source` (the same elements in row-major order, in shapes that may differ:
    a blocked dim's (count, block) pair against one dim, extent-1 stacked dims) as views of
    one shape, so that `target.copy_(source)` moves them: one strided copy, nothing
    materialised (a steady step's record holds these views, layoutlang/runtime/replay.py). None where
    no such views exist (neither merges into the other's dims and they share no refinement)."""
    if target.shape == source.shape:
        return target, source
    if target.numel() != source.numel():
        raise ValueError(f"copy of {list(source.shape)} into {list(target.shape)}: element counts differ")
    if target.numel() == 0:
        return target, source.reshape(target.shape)
    for into, other, flip in ((source, target, False), (target, source, True)):
        try:
            moved = into.view(other.shape)
        except RuntimeError:
            continue
        return (moved, source) if flip else (target, moved)
    # both split into their common refinement: cuts at every prefix product of either shape
    cuts = sorted({c for shape in (target.shape, source.shape) for c in _prefixes(shape)})
    refined = [b // a for a, b in zip([1] + cuts, cuts)]
    if any(b % a for a, b in zip([1] + cuts, cuts)):
        return None
    try:
        return target.view(refined), source.view(refined)
    except RuntimeError:
        return None


def _prefixes(shape) -> list[int]:
    out, n = [], 1
    for e in shape:
        if e != 1:
            n *= e
            out.append(n)
    return out
