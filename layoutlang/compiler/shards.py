"""Shards: the distinct pieces of one tensor instance, and who holds each.

A shard is one set of per-dim runs together with every rank that stores
exactly that (the replicas). Shards are computed from the mesh axes, not by
visiting ranks: the split axes (`over`, `chunk`) enumerate the distinct
pieces, the replica axes enumerate who holds each one. Instances with the
same (mesh, dims, placement) share their shards (a template).

Preserves: the union of an instance's shards is its whole logical tensor, and
every rank that holds the instance appears in exactly one shard.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from layoutlang.ir import DimIR, Mesh
from layoutlang.modes import RunLike, cached_hash


@dataclass(frozen=True)
class Shard:
    runs: tuple[tuple[RunLike, ...], ...]  # per dim, local storage -> logical
    ranks: tuple[int, ...]                 # ascending; every replica of this piece


@dataclass(frozen=True)
class Placement:
    """What makes two instances cut and place identically: a template key."""

    __hash__ = cached_hash

    mesh: Mesh
    dims: tuple[DimIR, ...]
    fixed: tuple[tuple[int, int], ...]


def placement_of(tensor) -> Placement:
    """The instance's placement (memoized on the instance: hashing it keys templates)."""
    p = tensor.__dict__.get("_placement")
    if p is None:
        p = Placement(tensor.mesh, tensor.dims, tensor.fixed)
        object.__setattr__(tensor, "_placement", p)
    return p


def shards(p: Placement) -> tuple[Shard, ...]:
    """Every distinct piece of an instance with placement p, in coordinate order.

    Not memoized here: a plan memoizes it for its own lifetime (`PlanCache`).
    """
    fixed = dict(p.fixed)
    split = sorted({i for d in p.dims for i in ((d.over.axes if d.over else ()) +
                                               ((d.chunk.axis,) if d.chunk else ()))})
    replica = [i for i in range(len(p.mesh.axes)) if i not in fixed and i not in split]
    by_runs: dict[tuple, list[int]] = {}
    for split_coords in itertools.product(*(range(p.mesh.axes[i].size) for i in split)):
        coords = [0] * len(p.mesh.axes)
        for i, c in fixed.items():
            coords[i] = c
        for i, c in zip(split, split_coords):
            coords[i] = c
        runs = tuple(d.runs_at(*d.coordinate(tuple(coords))) for d in p.dims)
        ranks = by_runs.setdefault(runs, [])
        for rep in itertools.product(*(range(p.mesh.axes[i].size) for i in replica)):
            for i, c in zip(replica, rep):
                coords[i] = c
            ranks.append(p.mesh.rank(tuple(coords)))
    return tuple(Shard(runs, tuple(sorted(ranks))) for runs, ranks in by_runs.items())

