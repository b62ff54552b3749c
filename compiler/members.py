"""Engine replicas as one destination layout: one replica's layout, repeated.

A refit between jobs (runtime/jobs.py) feeds K engine replicas that each run
the same `.layout` (its ranks 0..R-1). The plan needs them as one destination
side whose ranks follow the trainer's N ranks. `replicate` builds that side
from the one-replica IR without re-elaborating anything: every mesh gets one
more axis, `replica`, appended LAST, and is moved to start at rank N.

Why last: a tensor's `over`, `chunk` and `at` name mesh axes by index, so an
axis appended after the others leaves every dim (`DimIR`) and every `fixed`
coordinate valid as it is; the dims stay the very objects of the replica's
layout, which is what lets identical placements share one template. Nothing
splits over `replica`, so every replica holds every tensor in full, as its
own ranks hold it.

Notation: replica i (0..K-1, in membership order), its local rank t (0..R-1)::

    engine_rank(i, t) = N + t * K + i        (row-major, `replica` fastest)

Preserves: each replica's local tensors, names, keys, shapes and dtypes are the
one-replica layout's; rank t of every replica holds what rank t of the
one-replica layout holds.

>>> from layoutlang import loads
>>> one = loads("mesh e (tp=2)\\ntensor w [8 over tp, 4]")
>>> both = replicate(one, 3, 4)
>>> [both.tensors[0].holds(r) for r in range(4, 10)], both.ranks
([True, True, True, True, True, True], 10)
>>> engine_rank(4, 3, 2, 1), [both.tensors[0].runs(r)[0][0].logical_start for r in (4, 7)]
(9, [0, 4])
"""

from __future__ import annotations

import dataclasses
import hashlib

from layoutlang.ir import Axis, Layout, Mesh

REPLICA_AXIS = "replica"


def engine_rank(first: int, copies: int, replica: int, local: int) -> int:
    """The plan rank of `replica`'s local rank `local` (K = `copies` replicas after `first` ranks)."""
    return first + local * copies + replica


def replicate(one: Layout, copies: int, first: int) -> Layout:
    """`copies` replicas of `one` as one layout whose ranks start at `first`."""
    if copies < 1:
        raise ValueError(f"replicate: {copies} copies; a destination needs at least one replica")
    meshes = {m.name: _replicated_mesh(m, copies, first) for m in one.meshes}
    tensors = tuple(dataclasses.replace(t, mesh=meshes[t.mesh.name]) for t in one.tensors)
    digest = hashlib.sha256(f"{one.digest}/replicas={copies}/first={first}".encode()).hexdigest()
    return Layout(one.path, one.name, tuple(meshes.values()), tensors, one.args, digest, one.sources)


def _replicated_mesh(m: Mesh, copies: int, first: int) -> Mesh:
    if m.axis_index(REPLICA_AXIS) is not None:
        raise ValueError(f"mesh `{m.name}` already has an axis `{REPLICA_AXIS}`: rename it in the engine's layout")
    return Mesh(m.name, m.axes + (Axis(REPLICA_AXIS, copies),), first + m.offset * copies, m.span)
