"""Which ranks exist, which mesh a tensor is on, and which of its axes each instance claims.

Guarantees: a mesh is declared once, its axis names are distinct, every size
is at least 1 and the offset not negative, and it stays below
`limits.MAX_RANKS`; a tensor is on a declared mesh (by default the first).
Per instance, `AxisClaims` lets each axis of its mesh cut or place it at most
once (`over`, `chunk`, `at`, an enclosing `for ... over`), and refuses an axis
that is not in the mesh; `at AXIS=C` places it at a coordinate in range.
"""

from __future__ import annotations

from .. import ast
from ..diagnostics import ElaborationError, Note, Span, did_you_mean
from ..ir import Axis, Mesh
from . import limits
from .scope import Scope


def declare(stmt: ast.MeshDecl, scope: Scope, meshes: dict[str, Mesh]) -> Mesh:
    """The mesh `stmt` declares, checked against the meshes declared before it."""
    if stmt.name in meshes:
        raise ElaborationError(f"mesh `{stmt.name}` is already declared", stmt.name_span,
                               notes=[Note("first declared here", meshes[stmt.name].span)])
    axes, seen = [], {}
    for b in stmt.axes:
        if b.name in seen:
            raise ElaborationError(f"axis `{b.name}` appears twice in mesh `{stmt.name}`", b.span,
                                   notes=[Note("first here", seen[b.name])])
        seen[b.name] = b.span
        size = scope.evaluate(b.value)
        if size < 1:
            raise ElaborationError(f"axis `{b.name}` has size {size}; sizes must be at least 1", b.value.span)
        axes.append(Axis(b.name, size))
    offset = scope.evaluate(stmt.offset) if stmt.offset is not None else 0
    if offset < 0:
        raise ElaborationError(f"mesh offset {offset} is negative", stmt.offset.span)
    mesh = Mesh(stmt.name, tuple(axes), offset, stmt.name_span)
    if mesh.end > limits.MAX_RANKS:
        raise ElaborationError(f"mesh `{stmt.name}` reaches rank {mesh.end - 1}; at most {limits.MAX_RANKS} "
                               "ranks are supported", stmt.span, help="check the axis sizes and the offset")
    return mesh


def mesh_of(stmt: ast.TensorDecl, meshes: dict[str, Mesh]) -> Mesh:
    """The mesh a tensor is on: `on MESH`, else the first declared."""
    if stmt.mesh is not None:
        mesh = meshes.get(stmt.mesh.name)
        if mesh is None:
            hint = did_you_mean(stmt.mesh.name, meshes)
            raise ElaborationError(f"unknown mesh `{stmt.mesh.name}`", stmt.mesh.span,
                                   help=hint or ("declared meshes: " + ", ".join(meshes) if meshes
                                                 else "declare one first: `mesh NAME (tp=2)`"))
        return mesh
    if not meshes:
        raise ElaborationError("tensor declared before any mesh", stmt.name.span,
                               help="declare a mesh first, e.g. `mesh train (dp=1, tp=8)`")
    return next(iter(meshes.values()))


class AxisClaims:
    """The axes one tensor instance has used so far: each may cut or place it once.

    >>> from layoutlang.parser import parse
    >>> stmt = parse("tensor w [8 over tp, 4 chunk tp]").statements[0]
    >>> claims = AxisClaims(Mesh("m", (Axis("dp", 2), Axis("tp", 2)), 0), stmt, several_meshes=False)
    >>> claims.claim(stmt.dims[0].over[0], "by `over`")
    1
    >>> try:
    ...     claims.claim(stmt.dims[1].chunk.axis, "by `chunk`")
    ... except ElaborationError as e:
    ...     print(e.message)
    axis `tp` is used twice by this tensor (by `chunk`)
    """

    __slots__ = ("mesh", "tensor", "several_meshes", "used")

    def __init__(self, mesh: Mesh, tensor: ast.TensorDecl, several_meshes: bool):
        self.mesh, self.tensor, self.several_meshes = mesh, tensor, several_meshes
        self.used: dict[str, Span] = {}

    def claim(self, ref: ast.AxisRef, what: str, notes=(), loop: bool = False) -> int:
        """The index of `ref`'s axis in the mesh, now used by `what` (`loop`: an enclosing `for`)."""
        mesh = self.mesh
        idx = mesh.axis_index(ref.name)
        if idx is None:
            whose = "a tensor inside this loop" if loop else "this tensor"
            raise ElaborationError(f"axis `{ref.name}` is not in mesh `{mesh.name}` of {whose}", ref.span,
                                   notes=[Note("the tensor", self.tensor.name.span)] if loop else list(notes),
                                   help=f"mesh `{mesh.name}` has axes: {', '.join(a.name for a in mesh.axes)}"
                                        + ("; use `on MESH` to pick another mesh" if self.several_meshes else ""))
        used = self.used
        if ref.name in used:
            raise ElaborationError(f"axis `{ref.name}` is used twice by this tensor ({what})", ref.span,
                                   notes=[Note("first used here", used[ref.name]), *notes],
                                   help="an axis may split or place a tensor at most once")
        used[ref.name] = ref.span
        return idx


class Claimed:
    """The claims of an instance whose statement's first instance made them (a `Repeat`):
    only the mesh is read from here on."""

    __slots__ = ("mesh",)

    def __init__(self, mesh: Mesh):
        self.mesh = mesh


def placement(stmt: ast.TensorDecl, claims: AxisClaims, scope: Scope) -> list[tuple[int, int]]:
    """The (axis, coordinate) pairs of `at AXIS=C, ...`, each in range."""
    fixed = []
    for place in stmt.placement:
        idx = claims.claim(place.axis, "by `at`")
        fixed.append((idx, coordinate(place, idx, claims.mesh, scope)))
    return fixed


def coordinate(place: ast.Place, idx: int, mesh: Mesh, scope: Scope) -> int:
    """`at AXIS=C`'s coordinate on axis `idx` of `mesh`, in range."""
    coord = scope.evaluate(place.coord)
    size = mesh.axes[idx].size
    if not 0 <= coord < size:
        raise ElaborationError(f"`at {place.axis.name}={coord}` is out of range: {place.axis.name} has "
                               f"coordinates 0..{size - 1}", place.coord.span,
                               help=f"use `at {place.axis.name}={place.axis.name}-1` for the last one")
    return coord
