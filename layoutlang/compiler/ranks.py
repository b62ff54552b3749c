"""Sets of ranks that can send a piece: shared between requests, never copied per request.

A replicated tensor on `dp=16384` has 16384 holders; listing them per request
would make planning quadratic in replicas. A RankSet is built once per piece
and shared by every request for that piece. Ranks that form an arithmetic
progression (a mesh axis, a stride over one) are held as a `range`: O(1)
memory and membership; others as a sorted tuple with a frozenset for
membership.

>>> RankSet([0, 2, 4, 6]).ranks, 4 in RankSet([0, 2, 4, 6]), 5 in RankSet([0, 2, 4, 6])
(range(0, 8, 2), True, False)
>>> RankSet([3, 1, 7]).ranks, RankSet([3, 1, 7]).between(2, 8)
((1, 3, 7), (3, 7))
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence


class RankSet:
    """Sorted, duplicate-free ranks; equal sets compare equal whatever their storage."""

    __slots__ = ("ranks", "members")

    def __init__(self, ranks: Iterable[int]):
        rs = ranks if isinstance(ranks, range) and ranks.step > 0 else sorted(set(ranks))
        self.ranks: Sequence[int] = _as_range(rs)
        # a builtin container for hot membership tests (`rank in s.members`)
        self.members: range | frozenset[int] = self.ranks if isinstance(self.ranks, range) else frozenset(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self.members

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)

    def __getitem__(self, i: int) -> int:
        return self.ranks[i]

    def __eq__(self, other) -> bool:
        # storage is canonical (a progression is always a range), so equal sets store alike
        return isinstance(other, RankSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(self.ranks)

    def between(self, lo: int, hi: int) -> tuple[int, ...]:
        """The ranks in [lo, hi), in order (a node's ranks among these)."""
        rs = self.ranks
        return tuple(rs[bisect.bisect_left(rs, lo):bisect.bisect_left(rs, hi)])

    def __repr__(self) -> str:
        return f"RankSet({self.ranks!r})"


def _as_range(ranks: Sequence[int]) -> Sequence[int]:
    """A range when the sorted ranks are an arithmetic progression (two or more), else a tuple."""
    if isinstance(ranks, range):
        return ranks
    n = len(ranks)
    if n >= 2:
        step = ranks[1] - ranks[0]
        if all(ranks[i + 1] - ranks[i] == step for i in range(n - 1)):
            return range(ranks[0], ranks[-1] + step, step)
    return tuple(ranks)
