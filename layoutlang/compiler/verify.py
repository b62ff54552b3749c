"""The exactly-once proof: a destination's pieces tile its data, no gap, no overlap.

No element-by-element pass: a sweep over dim 0's breakpoints splits the
rectangles into slabs, and each slab is checked recursively on the remaining
dims; in the last dim, sorted intervals must meet end to start and cover the
data runs exactly. Padding is data-free, so a piece that touches padding is an
overlap with nothing — reported as well. A strided entry (layoutlang/compiler/strides.py)
takes part with each of its blocks: a piece is inside a slab when one of its
blocks along that dim covers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from layoutlang.modes import Run, RunLike

from .strides import blocks, hull

Slice = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class CoverageFault:
    kind: str                 # "gap" or "overlap" (or "padding")
    local: Slice              # the region, in destination local coordinates


def _expected(runs: tuple[RunLike, ...]) -> list[tuple[int, int]]:
    """The data intervals of one dim, merged when contiguous in local storage."""
    out: list[tuple[int, int]] = []
    for r in runs:
        if isinstance(r, Run):
            if out and out[-1][1] == r.local_start:
                out[-1] = (out[-1][0], r.local_start + r.length)
            else:
                out.append((r.local_start, r.local_start + r.length))
    return out


def check_tiling(rects: list[Slice], runs: tuple[tuple[RunLike, ...], ...]) -> CoverageFault | None:
    """None if `rects` cover the data region of `runs` exactly once."""
    expected = [_expected(r) for r in runs]
    return _check(rects, expected, 0, ())


def _check(rects: list[Slice], expected: list[list[tuple[int, int]]], dim: int,
           prefix: Slice) -> CoverageFault | None:
    if dim == len(expected):  # a 0-d tensor: exactly one piece
        if len(rects) == 1:
            return None
        return CoverageFault("gap" if not rects else "overlap", prefix)
    want = expected[dim]
    if dim == len(expected) - 1:
        return _check_1d(sorted(b for r in rects for b in blocks(r[dim])), want, prefix)
    # sweep: breakpoints of the rectangles' blocks and of the data along this dim
    spans = sorted((a, b, i) for i, r in enumerate(rects) for a, b in blocks(r[dim]))
    points = sorted({p for a, b, _ in spans for p in (a, b)} | {p for iv in want for p in iv})
    active: list[tuple[int, int]] = []  # (end, rect index) of the blocks started so far
    k = 0
    for lo, hi in zip(points, points[1:]):
        while k < len(spans) and spans[k][0] <= lo:
            active.append((spans[k][1], spans[k][2]))
            k += 1
        active = [x for x in active if x[0] > lo]
        inside = [rects[i] for _, i in sorted(active, key=lambda x: x[1])]
        if not any(a <= lo and hi <= b for a, b in want):
            if inside:
                return CoverageFault("padding", prefix + ((lo, hi),) + tuple(hull(e) for e in inside[0][dim + 1:]))
            continue
        fault = _check(inside, expected, dim + 1, prefix + ((lo, hi),))
        if fault:
            return fault
    return None


def _check_1d(spans: list[tuple[int, int]], want: list[tuple[int, int]],
              prefix: Slice) -> CoverageFault | None:
    """Sorted spans must meet end to start across each data interval, and stop there."""
    k = 0
    for lo, hi in want:
        cursor = lo
        while k < len(spans) and spans[k][0] < hi:
            a, b = spans[k]
            if a < lo:
                return CoverageFault("padding", prefix + ((a, lo),))
            if a < cursor:
                return CoverageFault("overlap", prefix + ((a, min(b, cursor)),))
            if a > cursor:
                return CoverageFault("gap", prefix + ((cursor, a),))
            if b > hi:
                return CoverageFault("padding", prefix + ((hi, b),))
            cursor = b
            k += 1
        if cursor < hi:
            return CoverageFault("gap", prefix + ((cursor, hi),))
    if k < len(spans):
        return CoverageFault("padding", prefix + (spans[k],))
    return None


def check_split(parent: Slice, parts: list[Slice]) -> CoverageFault | None:
    """None if `parts` tile the rectangle `parent` exactly once (a split piece, layoutlang/compiler/plan.py):
    with the parent proven to tile its shard, every destination element is still received once."""
    return check_tiling(parts, tuple(tuple(Run(a, a, b - a) for a, b in blocks(e)) for e in parent))
