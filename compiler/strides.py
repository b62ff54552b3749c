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
"""

from __future__ import annotations

Entry = tuple[int, ...]


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


def extent(e: Entry) -> int:
    """Elements of the dim."""
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


def blocks(e: Entry) -> list[tuple[int, int]]:
    """The contiguous [lo, hi) blocks of an entry, in order."""
    if len(e) == 2:
        return [e]
    start, count, step, block = parts(e)
    return [(start + i * step, start + i * step + block) for i in range(count)]


def hull(e: Entry) -> tuple[int, int]:
    """[first, last + 1) of the entry's elements."""
    if len(e) == 2:
        return e
    start, count, step, block = parts(e)
    return start, start + (count - 1) * step + block


def shift(e: Entry, delta: int) -> Entry:
    return (e[0] + delta, e[1] + delta, *e[2:])


def sub(e: Entry, k0: int, k1: int) -> Entry:
    """Elements [k0, k1) of the entry (in its element order), as an entry; both must sit on
    block boundaries of a strided entry."""
    start, count, step, block = parts(e)
    if count == 1:
        return (start + k0, start + k1)
    assert k0 % block == 0 and k1 % block == 0, (e, k0, k1)
    return entry(start + k0 // block * step, (k1 - k0) // block, step, block)


def text(e: Entry) -> str:
    """`a:b`, `a:b:step`, `a:b:step:block` (the text and dot renderings)."""
    return ":".join(str(x) for x in e)


def slice_text(sl) -> str:
    return "[" + ", ".join(text(e) for e in sl) + "]"
