"""Strided slices: one dim of a piece or op that is a regular set of blocks.

A slice holds one *entry* per dim (LANGUAGE.md 6; docs/compiler.md "Strided pieces")::

    (start, stop)                 contiguous [start, stop)
    (start, stop, step)           one element at each k in range(start, stop, step)
    (start, stop, step, block)    `block` consecutive elements at each k in range(start, stop, step)

so a dim holds count x block elements, count = len(range(start, stop, step)),
in order: block by block, each block in order. Forms are canonical (what
`entry` builds): a contiguous set is always `(start, stop)`, a step form has
count >= 2 and step > block, and stop is the last block's start + 1. The JSON
plan writes the first three numbers as the slice and the block, where one dim
needs it, in a separate field (`src_block` / `dst_block`).

Two levels are what a real layout needs: Meta's interleaved rotary rows are one
stride-2 set (`(start, stop, 2)`) while HF's split halves are NH blocks of D/2
rows at stride D (`(start, stop, D, D/2)`).

A piece's LOGICAL side may also be a *chain* (`Chain`): contiguous blocks read in
turn, where the piece's storage continues on both ends while the logical order
jumps (layoutlang/compiler/pieces.py: HF's `(NH, (re: D/2 | im: D/2))` rows on both sides are
one piece, whose logical rows are head 0's re half, its im half, head 1's re half,
...). Storage slices are never chains: an op is a pair of entries.

>>> chain([(0, 4), (32, 36), (4, 8)])
Chain(blocks=((0, 4), (32, 36), (4, 8)))
>>> chain([(0, 4), (4, 8)]), sub(chain([(0, 4), (32, 36), (4, 8)]), 2, 7)
((0, 8), Chain(blocks=((2, 4), (32, 35))))
"""

from __future__ import annotations

from dataclasses import dataclass

Entry = tuple[int, ...]


@dataclass(frozen=True)
class Chain:
    """A logical dim's elements as contiguous [lo, hi) blocks read in turn (at least two, none
    continuing the one before it: `chain` builds the canonical form)."""

    blocks: tuple[tuple[int, int], ...]


Logical = Entry | Chain  # one dim of a piece's logical side


def chain(parts) -> Logical:
    """The elements of contiguous blocks `parts`, in turn: a plain entry where they continue."""
    out: list[tuple[int, int]] = []
    for lo, hi in parts:
        if lo == hi:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    assert out, parts
    return out[0] if len(out) == 1 else Chain(tuple(out))


def then(a: Logical, b: Logical) -> Logical:
    """The elements of `a`, then those of `b` (a chain where b does not continue a)."""
    return chain(blocks(a) + blocks(b))


def cuttable(e: Logical) -> bool:
    """Whether every element range [k0, k1) of `e` is again one entry or chain (`sub`):
    contiguous entries and chains; a strided entry only on block boundaries."""
    return isinstance(e, Chain) or len(e) == 2


def entry(start: int, count: int, step: int, block: int) -> Entry:
    """The canonical entry of `count` blocks of `block` elements, `step` apart."""
    if count == 1 or step == block:
        return (start, start + count * block)
    if block == 1:
        return (start, start + (count - 1) * step + 1, step)
    return (start, start + (count - 1) * step + 1, step, block)


def parts(e: Entry) -> tuple[int, int, int, int]:
    """(start, count, step, block) of an entry."""
    if len(e) == 2:
        return e[0], 1, e[1] - e[0], e[1] - e[0]
    step = e[2]
    return e[0], len(range(e[0], e[1], step)), step, (e[3] if len(e) == 4 else 1)


def extent(e: Logical) -> int:
    """Elements of the dim."""
    if isinstance(e, Chain):
        return sum(hi - lo for lo, hi in e.blocks)
    if len(e) == 2:
        return e[1] - e[0]
    _, count, _, block = parts(e)
    return count * block


def elements(sl) -> int:
    """Elements of a whole slice."""
    n = 1
    for e in sl:
        n *= extent(e)
    return n


def strided(sl) -> bool:
    """Whether any dim of a slice is strided."""
    return any(len(e) > 2 for e in sl)


def blocks(e: Logical) -> list[tuple[int, int]]:
    """The contiguous [lo, hi) blocks of an entry (or chain), in order."""
    if isinstance(e, Chain):
        return list(e.blocks)
    if len(e) == 2:
        return [e]
    start, count, step, block = parts(e)
    return [(start + i * step, start + i * step + block) for i in range(count)]


def hull(e: Logical) -> tuple[int, int]:
    """[first, last + 1) of the entry's elements (a chain: its lowest and highest)."""
    if isinstance(e, Chain):
        return min(lo for lo, _ in e.blocks), max(hi for _, hi in e.blocks)
    if len(e) == 2:
        return e
    start, count, step, block = parts(e)
    return start, start + (count - 1) * step + block


def shift(e: Logical, delta: int) -> Logical:
    if isinstance(e, Chain):
        return Chain(tuple((lo + delta, hi + delta) for lo, hi in e.blocks))
    return (e[0] + delta, e[1] + delta, *e[2:])


def sub(e: Logical, k0: int, k1: int) -> Logical:
    """Elements [k0, k1) of the entry (in its element order), as an entry; both must sit on
    block boundaries of a strided entry. A chain is cut anywhere (`cuttable`)."""
    if isinstance(e, Chain):
        out, seen = [], 0
        for lo, hi in e.blocks:
            a, b = max(lo, lo + k0 - seen), min(hi, lo + k1 - seen)
            if a < b:
                out.append((a, b))
            seen += hi - lo
        return chain(out)
    start, count, step, block = parts(e)
    if count == 1:
        return (start + k0, start + k1)
    assert k0 % block == 0 and k1 % block == 0, (e, k0, k1)
    return entry(start + k0 // block * step, (k1 - k0) // block, step, block)


def text(e: Logical) -> str:
    """`a:b`, `a:b:step`, `a:b:step:block` (the text and dot renderings); a chain `a:b+c:d`."""
    if isinstance(e, Chain):
        return "+".join(f"{lo}:{hi}" for lo, hi in e.blocks)
    return ":".join(str(x) for x in e)


def slice_text(sl) -> str:
    return "[" + ", ".join(text(e) for e in sl) + "]"
