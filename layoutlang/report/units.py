"""Numbers as people read them, in one place: bytes, rank lists, counts, slices.

Every renderer, the HTML report, `layoutc explain` and the CLI's summaries
write sizes and rank lists through these functions, so the same plan reads
the same everywhere (`1.50 KiB`, `ranks 0..3, 8`).

>>> human_bytes(1536), human_bytes(1023), human_bytes(3 * 2**30), human_bytes(56768.0)
('1.50 KiB', '1023 B', '3.00 GiB', '55.44 KiB')
>>> rank_ranges([0, 1, 2, 3, 8, 10, 11])
'0..3, 8, 10..11'
>>> rank_ranges(range(0, 64, 2), limit=24)
'0, 2, 4, 6, 8, 10, 12, ... (32 ranks)'
>>> counted(1, "op"), counted(3, "op"), ranks_word([5]), ranks_word([0, 1, 2])
('1 op', '3 ops', 'rank 5', 'ranks 0..2')
>>> slice_text(((0, 4), (8, 16)))
'[0:4, 8:16]'
"""

from __future__ import annotations

from collections.abc import Iterable

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """Bytes in binary units with two decimals; below 1 KiB the exact (rounded) count."""
    n = int(round(n))
    size = float(n)
    for unit in UNITS[:-1]:
        if abs(size) < 1024:
            return f"{n} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} {UNITS[-1]}"


def rank_ranges(ranks: Iterable[int], limit: int | None = None) -> str:
    """Sorted ranks as inclusive runs, `0..3, 8`, the notation of `layoutc check`; `none` when empty.

    With `limit`, a longer text is cut after its last whole run that fits and
    ends with `, ... (N ranks)`.
    """
    ranks = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}..{ranks[j]}")
        i = j + 1
    text = ", ".join(out) or "none"
    if limit is None or len(text) <= limit:
        return text
    return text[:limit - 1].rsplit(", ", 1)[0] + f", ... ({len(ranks)} ranks)"


def counted(n: int, noun: str) -> str:
    """`1 op`, `2 ops`."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def ranks_word(ranks: Iterable[int], limit: int = 60) -> str:
    """`rank 3`, or `ranks 0..3, 8` (cut at `limit` characters)."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks, limit)}"


def slice_text(slices: Iterable[tuple[int, ...]]) -> str:
    """A slice per dim, `[0:4, 8:16]`; a strided dim as `start:stop:step[:block]`
    (layoutlang/compiler/strides.py), e.g. `[0:4993:128:64, 0:5120]`."""
    return "[" + ", ".join(":".join(str(x) for x in e) for e in slices) + "]"


__all__ = ["human_bytes", "rank_ranges", "counted", "ranks_word", "slice_text"]
