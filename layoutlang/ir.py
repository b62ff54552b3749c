"""The IR of one layout: meshes and tensor instances, symbolic in ranks.

One `TensorIR` per tensor instance (one per loop iteration), never one per
(tensor, rank): a 1024-rank layout costs memory in proportion to its tensors.
Any rank's view is computed on demand::

    t.holds(rank)        does the rank store it
    t.name               its local state-dict name (fixed per instance)
    t.local_shape        stored extents after over / pad / chunk
    t.runs(rank)         per dim: Run(local_start, logical_start, length) and
                         PadRun(local_start, length), covering local storage

What is computed on demand is remembered by the object it describes (a dim
keeps its runs per coordinate, a tensor its shapes), never in a process-wide
memo: dropping a layout drops everything computed about it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from math import prod
from typing import ClassVar

from .diagnostics import Source, Span
from .modes import (RAGGED, FlatM, ModeIR, PadM, PadRun, PartTree, Run, RunLike, cached_hash, cached_property,
                    chunk_intervals, runs, select, select_uneven)
from .vocabulary import DTYPE, DTYPES, ELEMENT_BYTES, MXFP8_BLOCK, QUANTIZED


@dataclass(frozen=True)
class Axis:
    name: str
    size: int


@dataclass(frozen=True)
class Mesh:
    """Ranks offset .. offset+size-1, row-major coordinates (last axis fastest).

    >>> Mesh("m", (Axis("dp", 2), Axis("tp", 4)), 8).coords(13)
    (1, 1)
    """

    __hash__ = cached_hash

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
    # "even" (LANGUAGE.md 3), or an uneven placement (`modes.UNEVEN`): "ragged" (torch.chunk's
    # blocks, 8.5), "balanced" (the first n mod s one longer), "cyclic" (round-robin) (docs/language.md 14.8)
    placement: str = "even"

    @property
    def size(self) -> int:
        return prod(self.sizes)

    @property
    def ragged(self) -> bool:
        """Whether coordinates may hold different extents (any placement but "even")."""
        return self.placement != "even"


@dataclass(frozen=True)
class ChunkSplit:
    """`chunk AXIS [align K]` on a dim's local storage."""

    axis: int
    name: str
    size: int
    align: int | None
    ragged: bool = False   # `chunk AXIS ragged`: torch.chunk's blocks of the local storage


@dataclass(frozen=True)
class DimIR:
    """One dim of a tensor: its mode (logical order and storage), `over` and `chunk`.

    Equal dims of one layout are one object (the elaborator pools them), so the
    runs each coordinate holds are computed once per layout and kept here.
    """

    __hash__ = cached_hash
    mode: ModeIR
    over: Split | None
    chunk: ChunkSplit | None

    @property
    def logical(self) -> int:
        return self.mode.logical

    @cached_property
    def flat(self) -> bool:
        """A flat dim (docs/language.md 14.9), padded at its tail or not: its padding, between keys
        and at the tail, belongs to the trainer that keeps it and is never written by a refit."""
        mode = self.mode.inner if isinstance(self.mode, PadM) else self.mode
        return isinstance(mode, FlatM)

    @cached_property
    def split_extent(self) -> int:
        """Local extent after `over`, before `chunk` (ragged: coordinate 0's, the largest)."""
        if self.over is None:
            return self.mode.stored
        return sum(b - a for a, b in self._select(0))

    @cached_property
    def local(self) -> int:
        """Local extent after `over` and `chunk`; ragged: the largest any coordinate holds
        (`local_at` gives each coordinate's)."""
        if self.chunk is None:
            return self.split_extent
        n, g, k = self.split_extent, self.chunk.size, self.chunk.align
        if self.chunk.ragged:
            return -(-n // g)
        total = n if k is None else -(-n // (k * g)) * (k * g)
        return total // g

    @cached_property
    def ragged(self) -> bool:
        """Whether local extents may differ between coordinates (an uneven `over`, `chunk ... ragged`)."""
        return bool((self.over is not None and self.over.ragged) or (self.chunk is not None and self.chunk.ragged))

    def local_at(self, c: int, g: int) -> int:
        """Local extent of over coordinate `c`, chunk `g` (padding included)."""
        if not self.ragged:
            return self.local
        return sum(r.length for r in self.runs_at(c, g))

    def _select(self, c: int) -> list[tuple[int, int]]:
        if self.over.ragged:
            return select_uneven(self.mode, self.over.size, c, self.over.placement)
        return select(self.mode, self.over.size, c)

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
        """The runs of over coordinate `c`, chunk `g` (remembered by this dim)."""
        found = self._runs.get((c, g))
        if found is None:
            intervals = self._select(c) if self.over else [(0, self.mode.stored)]
            tail = 0
            if self.chunk is not None:
                align = RAGGED if self.chunk.ragged else self.chunk.align
                intervals, tail = chunk_intervals(intervals, self.chunk.size, g, align)
            found = self._runs[(c, g)] = runs(self.mode, intervals, tail)
        return found

    @cached_property
    def _runs(self) -> dict[tuple[int, int], tuple[RunLike, ...]]:
        return {}


@dataclass(frozen=True, slots=True)
class KeyRegion:
    """One key inside a stored tensor: the logical box of the STORED tensor that holds it.

    Version 2 (LANGUAGE.md 8): a tensor with part keys, stacked dims or
    `transposed` storage holds one region per key. `box` is per stored dim a
    half-open [lo, hi) in the stored tensor's logical coordinates (canonical
    order after hoisting, LANGUAGE.md 3); a stacked dim's entry is [i, i+1).

    >>> r = KeyRegion("h.0.w", ((0, 1), (0, 768), (0, 2304)), (0,), True)
    >>> r.key_shape
    (2304, 768)
    """

    key: str                                  # rendered (loop and stack variables substituted)
    box: tuple[tuple[int, int], ...]          # per stored dim, [lo, hi)
    stacked: tuple[int, ...]                  # stored dims that are stack indices, dropped from the key's shape
    transposed: bool                          # the key's two (non-stacked) dims are stored in the opposite order
    part_dim: int | None = None               # the dim whose concatenation part carries the key (part keys)
    # a key of a flat dim (docs/language.md 14.9): its logical shape; `box` is then its range of the flat
    # dim's logical elements, which hold the key's elements in row-major order
    shape: tuple[int, ...] | None = None

    @property
    def key_shape(self) -> tuple[int, ...]:
        """The key's logical shape: box extents without stacked dims, swapped if transposed; a flat
        dim's key: its own shape."""
        if self.shape is not None:
            return self.shape
        shape = tuple(hi - lo for i, (lo, hi) in enumerate(self.box) if i not in self.stacked)
        return shape[::-1] if self.transposed else shape


@dataclass(frozen=True, eq=False)
class TensorIR:
    """One tensor instance: what ranks hold it, under which name, how it is cut.

    `logical_shape` and `local_shape` are the dims' logical and local extents;
    the elaborator gives instances with equal dims the same two tuples.

    `regions` is None for a v1 tensor: it holds one key, `key`, the whole
    tensor. A v2 tensor (a `KeyedTensorIR`: part keys, stacked dims or
    `transposed`) lists every key it holds in canonical order (stack indices
    outer, row-major in dim order; then parts in logical order); its `key` is
    then its NAME, which is never matched: the compiler matches `regions` (and
    `Layout.by_key` files it under that NAME).
    """

    key: str
    name: str
    dtype: str
    mesh: Mesh
    dims: tuple[DimIR, ...]
    fixed: tuple[tuple[int, int], ...]  # (mesh axis index, coordinate): `at` and `for ... over`
    logical_shape: tuple[int, ...] = field(repr=False)
    local_shape: tuple[int, ...] = field(repr=False)
    span: Span | None = field(default=None, repr=False)
    # v1: one key, the whole tensor. A class attribute, not a field: a v1 instance
    # stores nothing for it (KeyedTensorIR, below, is the v2 instance).
    regions: ClassVar[tuple[KeyRegion, ...] | None] = None

    @cached_property
    def local_bytes(self) -> int:
        """Bytes one rank stores (ragged dims: the largest rank's; `local_shape_at` gives each)."""
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

    def local_shape_at(self, rank: int) -> tuple[int, ...]:
        """The rank's stored extents: `local_shape`, except where a dim is ragged
        (LANGUAGE.md 8.5), where ranks hold different extents (possibly 0)."""
        if not any(d.ragged for d in self.dims):
            return self.local_shape
        coords = self.mesh.coords(rank)
        return tuple(d.local_at(*d.coordinate(coords)) for d in self.dims)

    def runs(self, rank: int) -> tuple[tuple[RunLike, ...], ...]:
        """Per dim, the runs mapping the rank's local storage to logical coordinates."""
        coords = self.mesh.coords(rank)
        if coords is None or not all(coords[i] == c for i, c in self.fixed):
            raise ValueError(f"rank {rank} does not hold {self.name}")
        return tuple(d.runs_at(*d.coordinate(coords)) for d in self.dims)

    def zeroed_padding(self, rank: int) -> tuple[tuple[int, PadRun], ...]:
        """(dim, run) of the rank's padding a destination zeroes at every refit: every padding
        but a flat dim's, which is left as it is (docs/language.md 14.9)."""
        return tuple((d, r) for d, (dim, runs) in enumerate(zip(self.dims, self.runs(rank)))
                     if not dim.flat for r in runs if isinstance(r, PadRun))

    def ranks(self):
        """Every rank that holds this instance, ascending."""
        return placement_ranks(self.mesh, self.fixed)


@dataclass(frozen=True, eq=False)
class KeyedTensorIR(TensorIR):
    """A stored tensor that holds several keys, or one key stored transposed (LANGUAGE.md 8).

    Everything a TensorIR is, plus `regions` (never None, never empty); `key` is the NAME.
    """

    regions: tuple[KeyRegion, ...] = field(kw_only=True, repr=False)


def placement_ranks(mesh: Mesh, fixed: tuple[tuple[int, int], ...]):
    """Every rank of `mesh` whose coordinates are `fixed` (axis index, coordinate), ascending."""
    pinned = dict(fixed)
    ranges = [range(pinned[i], pinned[i] + 1) if i in pinned else range(a.size)
              for i, a in enumerate(mesh.axes)]
    for coords in itertools.product(*ranges):
        yield mesh.rank(coords)


def storage_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a rank stores: elements (padding included, packed as the dtype packs them)
    plus every quantization scale (LANGUAGE.md 4, 4.1).

    >>> storage_bytes("mxfp8", (4096, 2048)), storage_bytes("mxfp4", (64, 64)), storage_bytes("nvfp4", (64, 64))
    (8650752, 2176, 2308)
    >>> storage_bytes("fp8_b128", (300, 129))  # 3 x 2 blocks, edge blocks partial
    38724
    """
    kind = DTYPE[dtype]
    size = prod(kind.data_shape(shape)) * max(1, kind.element_bits // 8)
    return size + sum(prod(s.shape(shape)) * s.bytes for s in kind.scales)


@dataclass(frozen=True, eq=False)
class Layout:
    """One elaborated `.layout` file: meshes, tensors, the args it used, and its text.

    `sources` are the texts it was compiled from, the main file first, then each
    included file in the order it was read: the same `Source` objects the spans
    point at, so carrying them costs nothing.
    """

    path: str
    name: str | None
    meshes: tuple[Mesh, ...]
    tensors: tuple[TensorIR, ...]
    args: tuple[tuple[str, int], ...]
    digest: str  # sha256 of every source text read (includes too) and the args
    sources: tuple[Source, ...] = field(repr=False)

    @property
    def source_text(self) -> str:
        """The main file's text as it was compiled (a later edit of the file does not change it)."""
        return self.sources[0].text

    @cached_property
    def ranks(self) -> int:
        return max((m.end for m in self.meshes), default=0)

    @cached_property
    def by_key(self) -> dict[str, tuple[TensorIR, ...]]:
        out: dict[str, list[TensorIR]] = {}
        for t in self.tensors:
            out.setdefault(t.key, []).append(t)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def key_index(self) -> dict[str, tuple[tuple[TensorIR, KeyRegion | None], ...]]:
        """Every key, with the stored instances that hold it and, for a v2 tensor, the key's
        region inside it (None: a v1 tensor, the whole of it), in file order."""
        out: dict[str, list] = {}
        for t in self.tensors:
            if t.regions is None:
                out.setdefault(t.key, []).append((t, None))
            else:
                for r in t.regions:
                    out.setdefault(r.key, []).append((t, r))
        return {k: tuple(v) for k, v in out.items()}

    def bytes_per_rank(self) -> list[int]:
        """Stored bytes on every rank, computed per placement group, not per rank."""
        groups: dict[tuple, int] = {}
        meshes = {m.name: m for m in self.meshes}
        out = [0] * self.ranks
        for t in self.tensors:
            if any(d.ragged for d in t.dims):  # ranks hold different extents: count each
                for r in t.ranks():
                    out[r] += storage_bytes(t.dtype, t.local_shape_at(r))
                continue
            k = (t.mesh.name, t.fixed)
            groups[k] = groups.get(k, 0) + t.local_bytes
        for (mesh_name, fixed), size in groups.items():
            for r in placement_ranks(meshes[mesh_name], fixed):
                out[r] += size
        return out


__all__ = ["Axis", "Mesh", "Split", "ChunkSplit", "DimIR", "KeyRegion", "TensorIR", "KeyedTensorIR", "Layout", "Run", "PadRun",
           "DTYPES", "ELEMENT_BYTES", "QUANTIZED", "MXFP8_BLOCK", "storage_bytes", "placement_ranks"]
