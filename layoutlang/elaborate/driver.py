"""The elaboration driver: statements in order, each handed to the pass that owns it.

The order is written down as data: `STATEMENTS` says which pass elaborates
each kind of statement, `TENSOR_STEPS` what one tensor instance goes through,
in order. The order of the steps is the order of a tensor's diagnostics: a
statement with two mistakes reports the earlier step's. Inside loops, a
statement's later instances reuse what its first one checked (`Repeat`) and
redo only what reads loop values; anything new takes the full steps.

Guarantees: `loads` returns a complete, frozen `Layout` or raises a
`LayoutError` (a ParseError, an ElaborationError at the offending span, a
UsageError for bad overrides or an unreadable top-level file); nothing an
elaboration memoizes outlives it.
"""

from __future__ import annotations

import os

from .. import ast
from ..diagnostics import ElaborationError, LayoutError, Source
from ..gcpause import gc_paused
from ..ir import KeyedTensorIR, Layout, Mesh, TensorIR
from ..parser import decode
from ..vocabulary import DEFAULT_DTYPE
from . import limits, loops, meshes, names
from .dims import Dims, known_dtype
from .keys import Keys
from .meshes import AxisClaims
from .names import Names
from .scope import Scope
from .sources import Sources, read_source


class Elaboration:
    """One layout being elaborated: the state its passes read and extend."""

    def __init__(self, overrides: dict[str, int]):
        self.meshes: dict[str, Mesh] = {}  # in declaration order; the first is the default
        self.scope = Scope(overrides, self.meshes)
        self.sources = Sources()
        self.dims = Dims(self.scope)
        self.names = Names()
        self.keys = Keys(self.scope)
        self.tensors: list[TensorIR] = []
        self.default_dtype = DEFAULT_DTYPE
        self.header: str | None = None
        self.fixed_pool: dict[tuple, tuple] = {}  # placement coordinates, one object per value
        self.repeats: dict[int, Repeat] = {}  # statement id -> its first instance's checked shape
        # with `scope.watch` (rekey.py): per stored tensor whose keys read the table, (its position,
        # (per region its recipe or None, per region its stack index), its regions' spans)
        self.recipes: list[tuple] = []


def run_file(el: Elaboration, source: Source) -> None:
    """Elaborate one file's statements in order (an include runs its file in place)."""
    statements = el.sources.open(source)
    for i, stmt in enumerate(statements):
        statements[i] = None  # done with its AST as soon as it is elaborated: the IR
        if stmt.__class__ is ast.Header:  # keeps only spans (and a mode's origin)
            if i != 0:
                raise ElaborationError("`layout` must be the first statement of a file", stmt.span,
                                       help="move the `layout NAME` header to the top")
            if el.sources.at_top_level:
                el.header = stmt.name
            continue
        STATEMENTS[stmt.__class__](el, stmt, source)
    el.sources.close()


# ---- statements -----------------------------------------------------------------------

def include(el: Elaboration, stmt: ast.Include, source: Source) -> None:
    included = el.sources.include(stmt, source)
    if included is not None:
        run_file(el, included)


def args(el: Elaboration, stmt: ast.Arg, source: Source) -> None:
    for b in stmt.bindings:
        el.scope.define(b, "arg")


def consts(el: Elaboration, stmt: ast.Const, source: Source) -> None:
    for b in stmt.bindings:
        el.scope.define(b, "const")


def mesh(el: Elaboration, stmt: ast.MeshDecl, source: Source) -> None:
    el.meshes[stmt.name] = meshes.declare(stmt, el.scope, el.meshes)


def default_dtype(el: Elaboration, stmt: ast.DefaultDtype, source: Source) -> None:
    el.default_dtype = known_dtype(stmt.dtype, stmt.dtype_span)


def for_loop(el: Elaboration, stmt: ast.ForLoop, source: Source) -> None:
    scope = el.scope
    frame = loops.enter(stmt, scope, len(el.tensors))
    scope.loops.append(frame)
    try:
        for v in range(frame.start, frame.stop):
            frame.value = v
            for inner in stmt.body:
                if inner.__class__ is not ast.TensorDecl and inner.__class__ is not ast.ForLoop:
                    raise ElaborationError("only `tensor` and `for` may appear inside a `for` block",
                                           inner.span, help="move it above the loop")
                scope.statement += 1
                STATEMENTS[inner.__class__](el, inner, source)
    except LayoutError as err:  # (elaboration stops here: the frame stays pushed)
        loops.name_iteration(err, frame, scope)
        raise
    scope.loops.pop()
    if not el.scope.loops:
        el.dims.forget_statements()
        el.keys.forget_statements()
        el.repeats.clear()
        el.scope.renders.clear()


def tensor(el: Elaboration, stmt: ast.TensorDecl, source: Source) -> None:
    loops_now = el.scope.loops
    if loops_now:
        seen = el.repeats.get(id(stmt))
        if seen is not None and repeat(el, seen):
            return
    draft = Draft(stmt)
    for step in TENSOR_STEPS:
        step(el, draft)
    if loops_now:
        el.repeats[id(stmt)] = Repeat(draft, loops_now)


# ---- the same statement again, in a later iteration ------------------------------------------

class Repeat:
    """What a statement's first instance inside its loops settled, that later iterations share.

    Which mesh it is on, which axes it claims (and that no axis is claimed twice),
    which `for ... over` frames place it on which axis, its stored keys and its
    dtype depend on the statement alone, not on loop values: checked once, they
    hold for every iteration. What does depend on loop values is redone per
    instance: the coordinates of the `over` loops and of `at`, the dims (from the
    dims memo; a miss takes the full steps), the dtype's fit to those dims, the
    names, keys and regions. The result is the instance the full steps would
    build, and an instance the full steps would refuse is built by them (the
    fallback), so its diagnostic is theirs."""

    __slots__ = ("stmt", "mesh", "over", "stored_keys", "dtype")

    def __init__(self, d: Draft, frames: list):
        self.stmt, self.mesh, self.stored_keys, self.dtype = d.stmt, d.claims.mesh, d.stored_keys, d.dtype
        # (depth of the frame, axis index): a nested loop's frame is made anew each outer iteration
        self.over = tuple((depth, d.claims.mesh.axis_index(f.node.over.name))
                          for depth, f in enumerate(frames) if f.node.over is not None)


def repeat(el: Elaboration, seen: Repeat) -> bool:
    """Build the statement's instance from its first one's shape; False: take the full steps."""
    mesh, frames = seen.mesh, el.scope.loops
    fixed = []
    for depth, idx in seen.over:
        frame = frames[depth]
        if frame.axis_size != mesh.axes[idx].size:  # a fresh inner frame: not distributed yet
            return False
        fixed.append((idx, frame.block()[0]))
    built = el.dims.cached(seen.stmt, mesh)
    if built is None:
        return False
    d = Draft(seen.stmt)
    d.stored_keys, d.dtype, d.built = seen.stored_keys, seen.dtype, built
    d.claims = meshes.Claimed(mesh)
    d.fixed = fixed
    for place in seen.stmt.placement:
        idx = mesh.axis_index(place.axis.name)
        fixed.append((idx, meshes.coordinate(place, idx, mesh, el.scope)))
    el.dims.check_storage(built, d.dtype, d.stmt)
    naming(el, d)
    key_regions(el, d)
    emit(el, d)
    return True


# ---- one tensor instance ----------------------------------------------------------------

class Draft:
    """A tensor instance as its steps fill it in: `claims` (AxisClaims, its mesh
    inside), `fixed` (axis, coordinate) pairs, `built` (BuiltDims), `dtype`,
    `name`, `key`; for a v2 tensor `stored_keys` (StoredKeys, else None), its
    `regions` and the span of the key each came from; `emit` turns it into a TensorIR."""

    __slots__ = ("stmt", "claims", "fixed", "built", "dtype", "name", "key", "stored_keys", "regions",
                 "region_spans", "recipes")

    def __init__(self, stmt: ast.TensorDecl):
        self.stmt = stmt


def on_mesh(el: Elaboration, d: Draft) -> None:
    """Its mesh (`on MESH` or the first); from here on it claims that mesh's axes."""
    d.claims = AxisClaims(meshes.mesh_of(d.stmt, el.meshes), d.stmt, len(el.meshes) > 1)


def stored_keys(el: Elaboration, d: Draft) -> None:
    """v2: its part keys, stacked dims and `transposed`, checked (None for a v1 tensor)."""
    d.stored_keys = el.keys.shape_of(d.stmt)


def loop_axes(el: Elaboration, d: Draft) -> None:
    """Enclosing `for ... over` loops place it at the coordinate owning the iteration."""
    d.fixed = loops.claim_axes(el.scope.loops, d.claims, el.scope, d.stmt.span)


def dims(el: Elaboration, d: Draft) -> None:
    """Its dims, split and chunked (built once per statement and loop values used)."""
    d.built = el.dims.of(d.stmt, d.claims.mesh, d.claims)


def placement(el: Elaboration, d: Draft) -> None:
    """`at AXIS=C` places it at coordinates."""
    d.fixed += meshes.placement(d.stmt, d.claims, el.scope)


def dtype(el: Elaboration, d: Draft) -> None:
    """Its dtype (or the default), which must fit its local shape."""
    stmt = d.stmt
    d.dtype = known_dtype(stmt.dtype.name, stmt.dtype.span) if stmt.dtype else el.default_dtype
    el.dims.check_storage(d.built, d.dtype, stmt)


def naming(el: Elaboration, d: Draft) -> None:
    """Its NAME and KEY, rendered with the loop values (a v2 tensor's keys are its regions')."""
    if d.stored_keys is None:
        d.name, d.key = names.names_and_key(d.stmt, el.scope)
    else:
        d.name = d.key = names.render(d.stmt.name, "value", el.scope)


def key_regions(el: Elaboration, d: Draft) -> None:
    """v2: the keys it holds, each a box of its logical tensor (its `key` is then its NAME)."""
    if d.stored_keys is None:
        d.regions = d.region_spans = None
        return
    d.regions, d.region_spans = el.keys.regions(d.stored_keys, d.stmt, d.built.dims)
    if el.scope.watch is not None:  # rekey.py: the keys' recipes, when some read the watched table
        d.recipes, el.keys.last = el.keys.last, None


def emit(el: Elaboration, d: Draft) -> None:
    """The instance, if its key and name keep the layout's rules and the count its bound."""
    fixed = tuple(sorted(d.fixed))
    fixed = el.fixed_pool.setdefault(fixed, fixed)
    b = d.built
    if d.regions is None:
        t = TensorIR(d.key, d.name, d.dtype, d.claims.mesh, b.dims, fixed, b.logical_shape, b.local_shape,
                     d.stmt.span)
    else:
        t = KeyedTensorIR(d.key, d.name, d.dtype, d.claims.mesh, b.dims, fixed, b.logical_shape, b.local_shape,
                          d.stmt.span, regions=d.regions)
    el.names.register(t, d.stmt, d.region_spans)
    if len(el.tensors) >= limits.MAX_TENSORS:
        raise ElaborationError(f"more than {limits.MAX_TENSORS} tensor instances", d.stmt.span)
    el.tensors.append(t)
    if el.scope.watch is not None and d.regions is not None and getattr(d, "recipes", None) is not None:
        el.recipes.append((len(el.tensors) - 1, d.recipes, d.region_spans))


# ---- the order, as data ---------------------------------------------------------------------

STATEMENTS = {
    ast.Include: include,
    ast.Arg: args,
    ast.Const: consts,
    ast.MeshDecl: mesh,
    ast.DefaultDtype: default_dtype,
    ast.TensorDecl: tensor,
    ast.ForLoop: for_loop,
}

TENSOR_STEPS = (on_mesh, stored_keys, loop_axes, dims, placement, dtype, naming, key_regions, emit)


# ---- the public doors -------------------------------------------------------------------------

def finish(el: Elaboration, path: str, unknown_args: str) -> Layout:
    """The Layout an elaboration that ran every statement (`run_file`) describes; every override named an arg."""
    el.scope.check_overrides(unknown_args)
    arg_values = el.scope.arg_values
    return Layout(path, el.header, tuple(el.meshes.values()), tuple(el.tensors), tuple(arg_values),
                  el.sources.digest(arg_values), tuple(el.sources.read))


def _elaborate(source: Source, args: dict[str, int] | None, unknown_args: str) -> Layout:
    el = Elaboration(args or {})
    with gc_paused():
        run_file(el, source)
        return finish(el, source.path, unknown_args)


def loads(text: str | bytes, path: str = "<string>", args: dict[str, int] | None = None,
          *, unknown_args: str = "error") -> Layout:
    """Elaborate layout text. Raises LayoutError (with position) for any user error.

    >>> loads("mesh m (tp=2)\\ntensor w [(gate: 4 | up: 4) over tp]").tensors[0].local_shape
    (4,)
    """
    source = decode(text, path) if isinstance(text, bytes) else Source(path, text)
    return _elaborate(source, args, unknown_args)


def load(path: str | os.PathLike, args: dict[str, int] | None = None,
         *, unknown_args: str = "error") -> Layout:
    """Read and elaborate a `.layout` file (includes are relative to it).

    `unknown_args="ignore"` lets one set of args serve two layouts (a plan).
    """
    return _elaborate(read_source(os.fspath(path)), args, unknown_args)
