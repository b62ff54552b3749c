"""The IR of one layout: meshes and tensor instances, symbolic in ranks.

One `TensorIR` per tensor instance (one per loop iteration), never one per
(tensor, rank): a 1024-rank layout costs memory in proportion to its tensors.
Any rank's view is computed on demand::

    t.holds(rank)        does the rank store it
    t.name               its local state-dict name (fixed per instance)
    t.local_shape        stored extents after over / pad / chunk
    t.runs(rank)         per dim: Run(local_start, logical_start, length) and
                         PadRun(local_start, length), covering local storage
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from .diagnostics import Span
from .modes import (ModeIR, PadRun, PartTree, Run, RunLike, _cached_hash, cached_property, chunk_intervals,
                    runs, select)

DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "mxfp8")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1}
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "mxfp8")
MXFP8_BLOCK = 32


@dataclass(frozen=True)
class Axis:
    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    __hash__ = _cached_hash
    """Ranks offset .. offset+size-1, row-major coordinates (last axis fastest)."""

    name: str
    axes: tuple[Axis, ...]
    offset: int
    span: Span | None = field(default=None, compare=False, repr=False)

    @cached_property
    def size(self) -> int:
        return prod(a.size for a in self.axes)

    @property
    def end(self) -> int:
        return self.offset + self.size

    @cached_property
    def _axis_map(self) -> dict[str, int]:
        return {a.name: i for i, a in enumerate(self.axes)}

    def axis_index(self, name: str) -> int | None:
        return self._axis_map.get(name)

    def coords(self, rank: int) -> tuple[int, ...] | None:
        """The rank's coordinate on each axis, or None outside the mesh."""
        if not self.offset <= rank < self.end:
            return None
        rest, out = rank - self.offset, []
        for a in reversed(self.axes):
            rest, c = divmod(rest, a.size)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for a, c in zip(self.axes, coords):
            r = r * a.size + c
        return self.offset + r


@dataclass(frozen=True)
class Split:
    """`over AXES`: one combined axis, first listed axis major."""

    axes: tuple[int, ...]  # indices into the mesh's axes
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return prod(self.sizes)


@dataclass(frozen=True)
class ChunkSplit:
    """`chunk AXIS [align K]` on a dim's local storage."""

    axis: int
    name: str
    size: int
    align: int | None


@dataclass(frozen=True)
class DimIR:
    __hash__ = _cached_hash
    mode: ModeIR
    over: Split | None
    chunk: ChunkSplit | None

    @property
    def logical(self) -> int:
        return self.mode.logical

    @cached_property
    def split_extent(self) -> int:
        """Local extent after `over`, before `chunk`."""
        if self.over is None:
            return self.mode.stored
        return sum(b - a for a, b in select(self.mode, self.over.size, 0))

    @cached_property
    def local(self) -> int:
        if self.chunk is None:
            return self.split_extent
        n, g, k = self.split_extent, self.chunk.size, self.chunk.align
        total = n if k is None else -(-n // (k * g)) * (k * g)
        return total // g

    @property
    def part_tree(self) -> PartTree:
        return self.mode.part_tree

    def coordinate(self, coords: tuple[int, ...]) -> tuple[int, int]:
        """(over coordinate, chunk coordinate) of a rank with mesh coords."""
        c = 0
        if self.over is not None:
            for i, size in zip(self.over.axes, self.over.sizes):
                c = c * size + coords[i]
        g = coords[self.chunk.axis] if self.chunk is not None else 0
        return c, g

    def runs_at(self, c: int, g: int) -> tuple[RunLike, ...]:
        return _dim_runs(self, c, g)


@lru_cache(maxsize=65536)
def _dim_runs(dim: DimIR, c: int, g: int) -> tuple[RunLike, ...]:
    intervals = select(dim.mode, dim.over.size, c) if dim.over else [(0, dim.mode.stored)]
    tail = 0
    if dim.chunk is not None:
        intervals, tail = chunk_intervals(intervals, dim.chunk.size, g, dim.chunk.align)
    return runs(dim.mode, intervals, tail)


@lru_cache(maxsize=4096)
def _shapes(dims: tuple[DimIR, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(logical, local) shape, shared by every instance with equal dims (by value:
    DimIR hashes are cached, and equal dims are mostly the same objects)."""
    return tuple(d.logical for d in dims), tuple(d.local for d in dims)


@dataclass(frozen=True, eq=False)
class TensorIR:
    """One tensor instance: what ranks hold it, under which name, how it is cut."""

    key: str
    name: str
    dtype: str
    mesh: Mesh
    dims: tuple[DimIR, ...]
    fixed: tuple[tuple[int, int], ...]  # (mesh axis index, coordinate): `at` and `for ... over`
    span: Span | None = field(default=None, repr=False)

    @cached_property
    def logical_shape(self) -> tuple[int, ...]:
        return _shapes(self.dims)[0]

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        return _shapes(self.dims)[1]

    @cached_property
    def local_bytes(self) -> int:
        return storage_bytes(self.dtype, self.local_shape)

    @cached_property
    def used_axes(self) -> frozenset[int]:
        used = {i for i, _ in self.fixed}
        for d in self.dims:
            if d.over:
                used.update(d.over.axes)
            if d.chunk:
                used.add(d.chunk.axis)
        return frozenset(used)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        return tuple(a.name for i, a in enumerate(self.mesh.axes) if i not in self.used_axes)

    def holds(self, rank: int) -> bool:
        coords = self.mesh.coords(rank)
        return coords is not None and all(coords[i] == c for i, c in self.fixed)

    def runs(self, rank: int) -> tuple[tuple[RunLike, ...], ...]:
        """Per dim, the runs mapping the rank's local storage to logical coordinates."""
        coords = self.mesh.coords(rank)
        if coords is None or not all(coords[i] == c for i, c in self.fixed):
            raise ValueError(f"rank {rank} does not hold {self.name}")
        return tuple(d.runs_at(*d.coordinate(coords)) for d in self.dims)

    def ranks(self):
        """Every rank that holds this instance, ascending."""
        fixed = dict(self.fixed)
        ranges = [range(fixed[i], fixed[i] + 1) if i in fixed else range(a.size)
                  for i, a in enumerate(self.mesh.axes)]
        for coords in itertools.product(*ranges):
            yield self.mesh.rank(coords)


def storage_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a rank stores: elements (padding included) plus quantization scales."""
    n = prod(shape)
    size = n * ELEMENT_BYTES[dtype]
    if dtype == "mxfp8":
        size += n // MXFP8_BLOCK
    elif dtype in QUANTIZED:
        size += 4
    return size


@dataclass(frozen=True, eq=False)
class Layout:
    """One elaborated `.layout` file: meshes, tensors, and the args it used."""

    path: str
    name: str | None
    meshes: tuple[Mesh, ...]
    tensors: tuple[TensorIR, ...]
    args: tuple[tuple[str, int], ...]
    digest: str = ""  # sha256 of every source text read (includes too) and the args

    @cached_property
    def ranks(self) -> int:
        return max((m.end for m in self.meshes), default=0)

    @cached_property
    def by_key(self) -> dict[str, tuple[TensorIR, ...]]:
        out: dict[str, list[TensorIR]] = {}
        for t in self.tensors:
            out.setdefault(t.key, []).append(t)
        return {k: tuple(v) for k, v in out.items()}

    def tensors_on(self, rank: int) -> list[TensorIR]:
        return [t for t in self.tensors if t.holds(rank)]

    def bytes_per_rank(self) -> list[int]:
        """Stored bytes on every rank, computed per placement group, not per rank."""
        groups: dict[tuple, int] = {}
        for t in self.tensors:
            k = (t.mesh.name, t.fixed)
            groups[k] = groups.get(k, 0) + t.local_bytes
        meshes = {m.name: m for m in self.meshes}
        out = [0] * self.ranks
        for (mesh_name, fixed), size in groups.items():
            probe = TensorIR("", "", "bf16", meshes[mesh_name], (), fixed)
            for r in probe.ranks():
                out[r] += size
        return out


__all__ = ["Axis", "Mesh", "Split", "ChunkSplit", "DimIR", "TensorIR", "Layout", "Run", "PadRun",
           "DTYPES", "ELEMENT_BYTES", "QUANTIZED", "storage_bytes"]
