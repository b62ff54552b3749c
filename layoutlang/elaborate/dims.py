"""What each dim of a tensor statement is: its mode, its `over` split and its `chunk`, checked.

Guarantees: a stacked dim `e in A..B` (v2) is a plain extent B - A >= 1; a flat dim
(docs/language.md 14.9) is a FlatM whose keys' dims have no padding or part keys, `align`
at least 1, dtype bf16, fp16 or fp32; every extent, count and pad multiple is at least 1 and every stored
extent fits in 64 bits; a dim's storage alternates in at most `modes.MAX_RUNS`
pieces; `over` splits the mode legally (`modes.check_split`), `chunk` divides
the local extent unless it has `align`, and `align` is at least 1; a dtype fits
the local shape (a block-scaled dtype needs a last dim of whole blocks and of
whole packed bytes, fp8_b128 two dims) and the tensor's bytes fit 64 bits.

Sharing (what keeps a layout of 10^5 instances small): equal dims are one
`DimIR` object per layout, equal shapes one tuple; inside loops a statement's
dims are built once per distinct value of the loop variables they use (the
axes are still claimed for every instance). These memos belong to one
elaboration and are dropped with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ast
from ..diagnostics import ElaborationError, Note, did_you_mean
from ..ir import ChunkSplit, DimIR, Mesh, Split, storage_bytes
from ..modes import MAX_RUNS, ConcatM, FlatM, KeyM, PadM, PartM, PlainM, ProductM, SplitError, check_split, fragments
from ..vocabulary import DTYPE
from . import limits
from .meshes import AxisClaims
from .scope import Scope


@dataclass(frozen=True, slots=True)
class BuiltDims:
    """A statement's dims and their shapes: one object for every instance that
    shares them (a statement inside loops, for the loop values its dims use)."""

    dims: tuple[DimIR, ...]
    logical_shape: tuple[int, ...]
    local_shape: tuple[int, ...]


class Dims:
    """Builds and checks dims for one elaboration, sharing what is equal."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.memo: dict[tuple, BuiltDims] = {}  # (statement id, mesh, loop values used): cleared with the loop
        self.free: dict[int, tuple[str, ...]] = {}  # statement id -> the names its dims use
        self.pool: dict[DimIR, DimIR] = {}  # equal dims of different statements: one object
        self.shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # equal shapes: one tuple
        self.stored: set[tuple[tuple[DimIR, ...], str]] = set()  # (dims, dtype) already checked

    def of(self, stmt: ast.TensorDecl, mesh: Mesh, claims: AxisClaims) -> BuiltDims:
        """The statement's dims on `mesh`, their axes claimed for this instance."""
        loops = self.scope.loops
        if not loops:  # elaborated once: nothing to remember
            return self.build(stmt, mesh, claims)
        free = self.free.get(id(stmt))
        if free is None:
            free = self.free[id(stmt)] = tuple(sorted(_free_names(stmt.dims)))
        memo_key = self._memo_key(stmt, mesh, free)
        cached = self.memo.get(memo_key)
        if cached is not None:
            for ast_dim in stmt.dims:  # still claim the axes
                for ref in ast_dim.over:
                    claims.claim(ref, "by `over`")
                if ast_dim.chunk:
                    claims.claim(ast_dim.chunk.axis, "by `chunk`")
            return cached
        built = self.memo[memo_key] = self.build(stmt, mesh, claims)
        return built

    def cached(self, stmt: ast.TensorDecl, mesh: Mesh) -> BuiltDims | None:
        """The statement's dims for the current loop values if built before (axes not claimed)."""
        free = self.free.get(id(stmt))
        return None if free is None else self.memo.get(self._memo_key(stmt, mesh, free))

    def _memo_key(self, stmt: ast.TensorDecl, mesh: Mesh, free: tuple[str, ...]) -> tuple:
        """(statement, mesh, the values of the loop variables its dims read)."""
        values = {f.node.var: f.value for f in self.scope.loops}
        return (id(stmt), mesh.name, tuple(values.get(n) for n in free))

    def forget_statements(self) -> None:
        """Drop the per-statement memos (keyed by statement ids, which die with the loop)."""
        self.memo.clear()
        self.free.clear()

    def build(self, stmt: ast.TensorDecl, mesh: Mesh, claims: AxisClaims) -> BuiltDims:
        dims = []
        for d in stmt.dims:
            mode = self.stack(d.mode) if d.mode.__class__ is ast.Stack else self.mode(d.mode)
            if fragments(mode) > MAX_RUNS:
                raise ElaborationError(f"this dimension's storage alternates in {fragments(mode)} pieces; at "
                                       f"most {MAX_RUNS} are supported", d.mode.span,
                                       help="a real layout is far less fragmented; check the counts")
            over = None
            if d.over:
                idx = tuple(claims.claim(ref, "by `over`") for ref in d.over)
                sizes = tuple(mesh.axes[i].size for i in idx)
                over = Split(idx, tuple(r.name for r in d.over), sizes, d.placement)
                label = d.over[0].name if len(d.over) == 1 else "(" + ", ".join(r.name for r in d.over) + ")"
                try:
                    if d.placement == "even":  # an uneven split cuts any extent (LANGUAGE.md 8.5, docs/language.md 14.8)
                        check_split(mode, over.size, label)
                except SplitError as e:
                    raise ElaborationError(e.message, e.node.origin.span if e.node.origin else d.span,
                                           help=e.help) from None
            chunk = None
            if d.chunk:
                idx = claims.claim(d.chunk.axis, "by `chunk`")
                align = self.scope.evaluate(d.chunk.align) if d.chunk.align is not None else None
                if align is not None and align < 1:
                    raise ElaborationError(f"`align {align}` must be at least 1", d.chunk.align.span)
                chunk = ChunkSplit(idx, d.chunk.axis.name, mesh.axes[idx].size, align, d.chunk.ragged)
            dim = DimIR(mode, over, chunk)
            if chunk is not None and dim.ragged and not chunk.ragged:
                raise ElaborationError(f"`chunk {chunk.name}` cuts equal chunks, but `over ... {over.placement}` leaves "
                                       "ranks different local extents", d.chunk.span,
                                       help=f"write `chunk {chunk.name} ragged` to cut each rank's storage like "
                                            "torch.chunk")
            if chunk is not None and chunk.align is None and not chunk.ragged and dim.split_extent % chunk.size:
                n, g = dim.split_extent, chunk.size
                raise ElaborationError(f"chunk {chunk.name}={g}: local extent {n} leaves remainder {n % g}",
                                       d.chunk.span, help=f"use `chunk {chunk.name} align 1` to pad the tail, "
                                                          f"or an extent divisible by {g}")
            dims.append(self.pool.setdefault(dim, dim))
        logical, local = tuple(d.logical for d in dims), tuple(d.local for d in dims)
        return BuiltDims(tuple(dims), self.shapes.setdefault(logical, logical), self.shapes.setdefault(local, local))

    def mode(self, node: ast.Mode):
        """AST mode -> IR mode, every extent evaluated and checked."""
        match node:
            case ast.Plain(extent=e):
                return PlainM(self.extent(e, "extent"), node)
            case ast.Product(count=n, inner=inner):
                return _checked(ProductM(self.extent(n, "count"), self.mode(inner), node))
            case ast.Concat(parts=parts):
                names = {}
                for p in parts:
                    if p.name is not None and p.name in names:
                        raise ElaborationError(f"part name `{p.name}` is used twice in this concatenation", p.span,
                                               notes=[Note("first here", names[p.name])])
                    if p.name is not None:
                        names[p.name] = p.span
                return _checked(ConcatM(tuple(PartM(p.name, self.mode(p.mode)) for p in parts), node))
            case ast.Pad(inner=inner, multiple=k):
                return _checked(PadM(self.mode(inner), self.extent(k, "pad multiple"), node))
            case ast.Flat(keys=keys, align=align):
                a = 1
                if align is not None:
                    a = self.scope.evaluate(align)
                    if a < 1:
                        raise ElaborationError(f"`align {a}` must be at least 1", align.span,
                                               help="each key starts at a multiple of A elements; "
                                                    "`align 1` (or none) packs them")
                return _checked(FlatM(tuple(KeyM(tuple(self.key_dim(m) for m in k.shape), k) for k in keys), a, node))
        raise AssertionError(node)

    def key_dim(self, node: ast.Mode):
        """One dim of a flat dim's key: a mode without padding or part keys (docs/language.md 14.9)."""
        stack = [node]
        while stack:
            x = stack.pop()
            if isinstance(x, ast.Pad):
                raise ElaborationError("a key of a flat dim has no padding: `pad` is storage of a stored dim",
                                       x.span, help="write the key's logical extent; `align` and the flat "
                                                    "dim's own `pad` place the padding")
            if isinstance(x, ast.Product):
                stack.append(x.inner)
            elif isinstance(x, ast.Concat):
                for p in x.parts:
                    if p.key is not None:
                        raise ElaborationError("a part of a flat dim's key has no key of its own", p.key.span,
                                               help="name the key once, after `as`; its parts are rows of it")
                    stack.append(p.mode)
        return self.mode(node)

    def stack(self, node: ast.Stack) -> PlainM:
        """`e in A..B`: stored like a plain extent B - A (LANGUAGE.md 8.2)."""
        start, stop = self.scope.evaluate(node.start), self.scope.evaluate(node.stop)
        if stop - start < 1:
            raise ElaborationError(f"stacked dim `{node.var} in {start}..{stop}` holds {max(0, stop - start)} "
                                   "indices; a stack holds at least 1", node.span,
                                   help="ranges are half-open `A..B` with A < B")
        return _checked(PlainM(stop - start, node))

    def extent(self, expr: ast.Expr, what: str) -> int:
        v = self.scope.evaluate(expr)
        if v < 1:
            raise ElaborationError(f"{what} {v} is not positive; extents must be at least 1", expr.span,
                                   help="check the expression")
        return v

    def check_storage(self, built: BuiltDims, dtype: str, stmt: ast.TensorDecl) -> None:
        """The dtype fits the local shape, and the bytes fit 64 bits (once per dims and dtype)."""
        dims = built.dims
        if (dims, dtype) in self.stored:
            return
        if dims and flat_mode(dims[0].mode) is not None and dtype not in FLAT_DTYPES:
            raise ElaborationError(f"a flat dim holds whole keys of different shapes: dtype {dtype} is not "
                                   "supported there", stmt.dtype.span if stmt.dtype else stmt.dims[0].span,
                                   help=f"store it in {', '.join(FLAT_DTYPES)} (a quantized dtype's scales "
                                        "would cut across keys)")
        local = built.local_shape
        kind = DTYPE[dtype]
        multiple = kind.last_dim_multiple
        last = _local_extents(dims[-1]) if dims else {0}
        if multiple > 1 and (not dims or any(n % multiple for n in last)):
            bad = next((n for n in sorted(last) if n % multiple), 0)
            raise ElaborationError(f"{dtype} needs the local last dim to be a multiple of {multiple}; "
                                   f"here it is {bad if dims else 'absent (0-d tensor)'}",
                                   stmt.dims[-1].span if stmt.dims else stmt.span,
                                   help=f"use another dtype, or a shape whose local last dim is a multiple "
                                        f"of {multiple}")
        if len(dims) < kind.min_dims:
            grid = " x ".join(str(b) for b in max((s.block for s in kind.scales), key=len))
            raise ElaborationError(f"{dtype} needs at least {kind.min_dims} dims (one scale per {grid} block of "
                                   f"the local last {kind.min_dims} dims); here there {_dims_text(len(dims))}",
                                   stmt.dims[-1].span if stmt.dims else stmt.span,
                                   help="store 1-d tensors (norms, biases) in bf16 or fp32, as DeepSeek-V3's "
                                        "checkpoint does, or use a dtype with a per-tensor or 1-d block scale")
        n = 1
        for d in dims:
            n *= max(d.logical, d.local)
        if n * 4 > limits.INT64_MAX or storage_bytes(dtype, local) > limits.INT64_MAX:
            raise ElaborationError(f"tensor of {n} elements does not fit in 64-bit sizes", stmt.span,
                                   help="check the extents")
        self.stored.add((dims, dtype))


FLAT_DTYPES = ("bf16", "fp16", "fp32")  # a flat dim's dtypes (docs/language.md 14.9)


def flat_mode(mode) -> FlatM | None:
    """The FlatM of a flat dim's mode (`flat(...)` or `flat(...) pad K`), else None."""
    if isinstance(mode, PadM):
        mode = mode.inner
    return mode if isinstance(mode, FlatM) else None


def _dims_text(n: int) -> str:
    return "is 1 dim" if n == 1 else f"are {n} dims"


def _local_extents(dim: DimIR) -> set[int]:
    """Every local extent a coordinate of `dim` holds (one, unless it is ragged)."""
    if not dim.ragged:
        return {dim.local}
    cs = range(dim.over.size) if dim.over is not None else range(1)
    gs = range(dim.chunk.size) if dim.chunk is not None else range(1)
    return {dim.local_at(c, g) for c in cs for g in gs}


def _checked(mode):
    if mode.stored > limits.INT64_MAX:
        raise ElaborationError(f"stored extent {mode.stored} does not fit in 64 bits", mode.origin.span)
    return mode


def _free_names(nodes) -> set[str]:
    """Every name an AST subtree uses (spans aside)."""
    out: set[str] = set()

    def visit(x):
        if isinstance(x, (ast.Name, ast.Local)):
            out.add(x.name)
        elif isinstance(x, tuple):
            for y in x:
                visit(y)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                if f != "span" and f != "key":  # a part's key is not the dim's
                    visit(getattr(x, f))

    visit(nodes)
    return out


def known_dtype(name: str, span) -> str:
    """`name` if it is a dtype of the vocabulary, else an error naming them all."""
    if name not in DTYPE:
        hint = did_you_mean(name, DTYPE)
        raise ElaborationError(f"unknown dtype `{name}`", span,
                               help=(hint + " " if hint else "") + "dtypes are: " + ", ".join(DTYPE))
    return name
