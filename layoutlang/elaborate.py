"""AST -> IR: args and overrides, consts, includes, meshes, loops, placement.

Elaboration walks statements in order with one scope of constants, a stack of
loop frames, and the meshes declared so far. It evaluates every expression to
an int, checks every rule of LANGUAGE.md that needs no second layout, and
emits one `TensorIR` per tensor instance. Every user error becomes an
`ElaborationError` at the offending span, with a fix hint where one is known.
"""

from __future__ import annotations

import bisect
import difflib
import errno
import hashlib
import os
import stat
from dataclasses import dataclass, field
from typing import Iterable

from . import ast
from .gcpause import gc_paused
from .diagnostics import ElaborationError, LayoutError, Note, Source, Span, UsageError
from .ir import DTYPES, MXFP8_BLOCK, Axis, ChunkSplit, DimIR, Layout, Mesh, Split, TensorIR, storage_bytes
from .modes import MAX_RUNS, ConcatM, PadM, PartM, PlainM, ProductM, SplitError, check_split, fragments
from .parser import decode, parse_source

INT64_MAX = (1 << 63) - 1
MAX_RANKS = 1 << 20
MAX_TENSORS = 1 << 20        # tensor instances per layout; also `tensor` statements, counted before parsing
MAX_INCLUDE_DEPTH = 64       # nested includes below the top-level file
MAX_FILE_BYTES = 64 << 20    # per file read; 1<<20 tensor lines of 64 bytes fit
FUNCTIONS = {"min": None, "max": None, "cdiv": 2, "roundup": 2}


def _err(message: str, span: Span | None, help: str | None = None, notes=()) -> ElaborationError:
    return ElaborationError(message, span, help=help, notes=tuple(notes))


def _did_you_mean(name: str, options: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean `{close[0]}`?" if close else None


class FileRefused(Exception):
    """A path that is not a layout file we will read: `reason` completes
    "cannot read PATH: ...", `help` says what to do (None: the path is wrong)."""

    def __init__(self, reason: str, help: str | None = None):
        super().__init__(reason)
        self.reason, self.help = reason, help


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> FileRefused:
    if stat.S_ISDIR(mode):
        return FileRefused(os.strerror(errno.EISDIR))
    kind = next((word for test, word in _KINDS if test(mode)), "not a regular file")
    return FileRefused(f"not a regular file but {kind}" if kind.startswith("a ") else kind,
                       help="a layout is a regular file: name a `.layout` file, not a device, pipe or socket")


def _too_large(size: str) -> FileRefused:
    cap = f"{MAX_FILE_BYTES} bytes"
    if MAX_FILE_BYTES >= 1 << 20 and MAX_FILE_BYTES % (1 << 20) == 0:
        cap += f" ({MAX_FILE_BYTES >> 20} MiB)"
    return FileRefused(f"the file has {size} bytes; at most {cap} are read",
                       help="a layout file is far smaller: check that the path names the right file")


def _read_at_most(fh, expected: int, limit: int) -> bytes:
    """Up to `limit` bytes: one read when the file has the size `stat` gave, else
    chunks (a buffer of `limit` bytes up front would cost 64 MiB per file)."""
    data = fh.read(min(expected + 1, limit))
    if len(data) <= expected:
        return data
    parts, total = [data], len(data)
    while total < limit:
        chunk = fh.read(min(1 << 20, limit - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


def read_layout_file(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES, else FileRefused.

    The type is checked with `stat` before opening (opening a FIFO blocks) and
    again on the open descriptor (the path may change in between); at most
    MAX_FILE_BYTES + 1 bytes are read, so a file that grows, or a /proc file
    that reports size 0, cannot exhaust memory.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(st.st_mode)
        if st.st_size > MAX_FILE_BYTES:
            raise _too_large(str(st.st_size))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(mode)
            data = _read_at_most(fh, st.st_size, MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise FileRefused(exc.strerror or str(exc)) from None
    except ValueError:  # a NUL in the path
        raise FileRefused("a path cannot contain a NUL character") from None
    if len(data) > MAX_FILE_BYTES:
        raise _too_large(f"more than {MAX_FILE_BYTES}")
    return data


@dataclass
class _Value:
    value: int
    kind: str  # "arg" or "const"
    span: Span


@dataclass
class _Loop:
    """One enclosing `for`: its variable's current value and, with `over`, its blocks."""

    node: ast.ForLoop
    start: int
    stop: int
    value: int = 0
    axis_size: int | None = None  # fixed by the first tensor it governs
    axis_mesh: str | None = None
    block_starts: list[int] = field(default_factory=list)


class _Elaborator:
    def __init__(self, overrides: dict[str, int]):
        self.overrides = dict(overrides)
        self.used_overrides: set[str] = set()
        self.values: dict[str, _Value] = {}
        self.arg_values: list[tuple[str, int]] = []
        self.meshes: dict[str, Mesh] = {}
        self.default_dtype = "bf16"
        self.loops: list[_Loop] = []
        self.tensors: list[TensorIR] = []
        self.header: str | None = None
        self.include_stack: list[str] = []
        self.included: set[str] = set()
        self.tensor_statements = 0  # in the files parsed so far, loop bodies included
        # Per instance the elaborator keeps a few words: the first instance of
        # each key, of each name (a group table only for names declared again).
        self.keys: dict[str, TensorIR] = {}
        self.names: dict[str, TensorIR | dict[tuple, dict[tuple, TensorIR]]] = {}
        # Inside loops, a statement's dims are built once per distinct value of the
        # loop variables they use (by the statement's id: cleared with the loop).
        self.dim_memo: dict[tuple, tuple[DimIR, ...]] = {}
        self.free_memo: dict[int, tuple[str, ...]] = {}
        self.dim_pool: dict[DimIR, DimIR] = {}  # equal dims of different statements: one object
        self.fixed_pool: dict[tuple, tuple] = {}  # placement coordinates, one object per value
        self.texts: list[str] = []  # every source read, in order: the layout's digest
        self.sized: set[tuple[tuple[DimIR, ...], str]] = set()  # (dims, dtype) already size-checked
        self.signatures: dict[tuple[DimIR, ...], tuple] = {}  # dims -> (logical shape, part trees)

    # ---- files and statements -------------------------------------------
    def run_file(self, source: Source, span: Span | None = None) -> None:
        real = os.path.realpath(source.path) if source.path != "<string>" else "<string>"
        self.include_stack.append(real)
        self.included.add(real)
        self.texts.append(source.text)
        statements = list(parse_source(source, max_tensors=MAX_TENSORS, tensors_before=self.tensor_statements,
                                       comments=False).statements)
        self.tensor_statements += _count_statements(statements)
        for i, stmt in enumerate(statements):
            statements[i] = None  # done with its AST as soon as it is elaborated: the IR
            if isinstance(stmt, ast.Header):  # keeps only spans (and a mode's origin)
                if i != 0:
                    raise _err("`layout` must be the first statement of a file", stmt.span,
                               help="move the `layout NAME` header to the top")
                if len(self.include_stack) == 1:
                    self.header = stmt.name
                continue
            self.statement(stmt, source)
        self.include_stack.pop()

    def statement(self, stmt: ast.Stmt, source: Source) -> None:
        match stmt:
            case ast.Include():
                self.include(stmt, source)
            case ast.Arg() | ast.Const():
                for b in stmt.bindings:
                    self.define(b, "arg" if isinstance(stmt, ast.Arg) else "const")
            case ast.MeshDecl():
                self.mesh(stmt)
            case ast.DefaultDtype():
                self.default_dtype = self.dtype_name(stmt.dtype, stmt.dtype_span)
            case ast.TensorDecl():
                self.tensor(stmt)
            case ast.ForLoop():
                self.for_loop(stmt, source)
            case ast.Header():
                raise _err("`layout` must be the first statement of a file", stmt.span)

    def include(self, stmt: ast.Include, source: Source) -> None:
        if self.loops:
            raise _err("`include` must be at the top level of a file, not inside `for`", stmt.span)
        if "\x00" in stmt.path:
            shown = stmt.path.replace("\x00", "\\x00")
            raise _err(f"cannot include \"{shown}\": a path cannot contain a NUL character", stmt.span,
                       help="remove the NUL character from the path")
        base = os.path.dirname(source.path) if source.path != "<string>" else os.getcwd()
        path = os.path.normpath(os.path.join(base, stmt.path))
        real = os.path.realpath(path)
        if real in self.include_stack:
            chain = " -> ".join(os.path.basename(p) for p in self.include_stack + [real])
            raise _err(f"include cycle: {chain}", stmt.span,
                       help="remove one of the includes; shared definitions belong in a third file")
        if real in self.included:
            return  # already included: a file's definitions are taken once
        depth = len(self.include_stack)  # the top-level file is depth 0
        if depth > MAX_INCLUDE_DEPTH:
            raise _err(f"include depth {depth} exceeds the limit of {MAX_INCLUDE_DEPTH} nested includes",
                       stmt.span, help="include shared files from one place instead of chaining them")
        try:
            data = read_layout_file(path)
        except FileRefused as exc:
            raise _err(f"cannot include \"{stmt.path}\": {exc.reason}", stmt.span,
                       help=(f"{exc.help}; looked for {path}" if exc.help else
                             f"the path is relative to this file: looked for {path}")) from None
        self.run_file(decode(data, path), stmt.span)

    def define(self, b: ast.Binding, kind: str) -> None:
        if self.loops:
            raise _err(f"`{kind}` must be at the top level of a file, not inside `for`", b.span)
        if b.name in self.values:
            first = self.values[b.name]
            raise _err(f"`{b.name}` is already defined", b.span,
                       notes=[Note(f"first defined here as {first.kind}", first.span)],
                       help="give it another name")
        if kind == "arg" and b.name in self.overrides:
            value = self.overrides[b.name]
            self.used_overrides.add(b.name)
        else:
            value = self.evaluate(b.value)
        self.values[b.name] = _Value(value, kind, b.span)
        if kind == "arg":
            self.arg_values.append((b.name, value))

    def mesh(self, stmt: ast.MeshDecl) -> None:
        if self.loops:
            raise _err("`mesh` must be at the top level of a file, not inside `for`", stmt.span)
        if stmt.name in self.meshes:
            raise _err(f"mesh `{stmt.name}` is already declared", stmt.name_span,
                       notes=[Note("first declared here", self.meshes[stmt.name].span)])
        axes, seen = [], {}
        for b in stmt.axes:
            if b.name in seen:
                raise _err(f"axis `{b.name}` appears twice in mesh `{stmt.name}`", b.span,
                           notes=[Note("first here", seen[b.name])])
            seen[b.name] = b.span
            size = self.evaluate(b.value)
            if size < 1:
                raise _err(f"axis `{b.name}` has size {size}; sizes must be at least 1", b.value.span)
            axes.append(Axis(b.name, size))
        offset = self.evaluate(stmt.offset) if stmt.offset is not None else 0
        if offset < 0:
            raise _err(f"mesh offset {offset} is negative", stmt.offset.span)
        mesh = Mesh(stmt.name, tuple(axes), offset, stmt.name_span)
        if mesh.end > MAX_RANKS:
            raise _err(f"mesh `{stmt.name}` reaches rank {mesh.end - 1}; at most {MAX_RANKS} ranks "
                       "are supported", stmt.span, help="check the axis sizes and the offset")
        self.meshes[stmt.name] = mesh

    def dtype_name(self, name: str, span: Span) -> str:
        if name not in DTYPES:
            hint = _did_you_mean(name, DTYPES)
            raise _err(f"unknown dtype `{name}`", span,
                       help=(hint + " " if hint else "") + "dtypes are: " + ", ".join(DTYPES))
        return name

    # ---- loops ------------------------------------------------------------
    def for_loop(self, stmt: ast.ForLoop, source: Source) -> None:
        if stmt.var in self.values or any(f.node.var == stmt.var for f in self.loops):
            raise _err(f"loop variable `{stmt.var}` shadows an existing name", stmt.var_span,
                       help="choose another variable name")
        start, stop = self.evaluate(stmt.start), self.evaluate(stmt.stop)
        if stop < start:
            raise _err(f"empty range {start}..{stop}: the end is before the start", stmt.head_span,
                       help="ranges are half-open `A..B` with A <= B")
        outer = 1
        for f in self.loops:
            outer *= max(1, f.stop - f.start)
        tensors_inside = max(1, _count_tensors(stmt.body))
        if outer * (stop - start) * tensors_inside + len(self.tensors) > MAX_TENSORS:
            raise _err(f"this loop makes {outer * (stop - start) * tensors_inside} tensors; at most "
                       f"{MAX_TENSORS} per layout are supported", stmt.head_span,
                       help="check the range")
        if stmt.over is not None and stop == start:
            raise _err(f"loop over `{stmt.over.name}` has an empty range", stmt.head_span)
        frame = _Loop(stmt, start, stop)
        self.loops.append(frame)
        for v in range(start, stop):
            frame.value = v
            for inner in stmt.body:
                if not isinstance(inner, (ast.TensorDecl, ast.ForLoop)):
                    raise _err("only `tensor` and `for` may appear inside a `for` block",
                               inner.span, help="move it above the loop")
                self.statement(inner, source)
        self.loops.pop()
        if not self.loops:  # the memos are keyed by statement ids, which die with the loop
            self.dim_memo.clear()
            self.free_memo.clear()

    def loop_blocks(self, frame: _Loop, size: int, mesh: Mesh, tensor_span: Span) -> None:
        """Fix a loop's distribution over its axis (size from the first governed tensor)."""
        node = frame.node
        if frame.axis_size is not None:
            if frame.axis_size != size:
                raise _err(f"loop over `{node.over.name}` governs tensors whose meshes give the axis "
                           f"different sizes ({frame.axis_mesh}: {frame.axis_size}, {mesh.name}: {size})",
                           tensor_span, notes=[Note("the loop", node.head_span)],
                           help="put every tensor of this loop on meshes with the same axis size")
            return
        n = frame.stop - frame.start
        if node.sizes is None:
            if n % size:
                base, extra = divmod(n, size)
                suggestion = [base + 1] * extra + [base] * (size - extra)
                raise _err(f"{n} iterations do not split evenly over {node.over.name}={size} "
                           f"(remainder {n % size})", node.head_span,
                           help=f"give the blocks: `sizes [{', '.join(map(str, suggestion))}]`")
            blocks = [n // size] * size
        else:
            blocks = [self.evaluate(e) for e in node.sizes]
            first, last = node.sizes[0].span, node.sizes[-1].span
            entries = Span(first.source, first.line, first.col, last.end_line, last.end_col)
            if len(blocks) != size:
                raise _err(f"`sizes` has {len(blocks)} entries but {node.over.name} has size {size}",
                           entries, help="give one entry per coordinate of the axis")
            for e, b in zip(node.sizes, blocks):
                if b < 0:
                    raise _err(f"block size {b} is negative", e.span)
            if sum(blocks) != n:
                raise _err(f"`sizes` sum to {sum(blocks)} but the range {frame.start}..{frame.stop} "
                           f"has {n} iterations", entries,
                           help="the entries must sum to the number of iterations")
        starts, acc = [], frame.start
        for b in blocks:
            starts.append(acc)
            acc += b
        frame.axis_size, frame.axis_mesh, frame.block_starts = size, mesh.name, starts

    def owner(self, frame: _Loop) -> tuple[int, int]:
        """(coordinate owning the loop's current value, that block's first value)."""
        starts = frame.block_starts
        c = bisect.bisect_right(starts, frame.value) - 1
        while c + 1 < len(starts) and starts[c + 1] == frame.value:
            c += 1  # skip empty blocks that start at the same value
        return c, starts[c]

    # ---- tensors ------------------------------------------------------------
    def tensor(self, stmt: ast.TensorDecl) -> None:
        mesh = self.tensor_mesh(stmt)
        used: dict[str, Span] = {}

        def use_axis(ref: ast.AxisRef, what: str, extra_notes=(), loop: bool = False) -> int:
            idx = mesh.axis_index(ref.name)
            if idx is None:
                whose = "a tensor inside this loop" if loop else "this tensor"
                raise _err(f"axis `{ref.name}` is not in mesh `{mesh.name}` of {whose}", ref.span,
                           notes=[Note("the tensor", stmt.name.span)] if loop else list(extra_notes),
                           help=f"mesh `{mesh.name}` has axes: {', '.join(a.name for a in mesh.axes)}"
                                + (f"; use `on MESH` to pick another mesh" if len(self.meshes) > 1 else ""))
            if ref.name in used:
                raise _err(f"axis `{ref.name}` is used twice by this tensor ({what})", ref.span,
                           notes=[Note("first used here", used[ref.name]), *extra_notes],
                           help="an axis may split or place a tensor at most once")
            used[ref.name] = ref.span
            return idx

        fixed: list[tuple[int, int]] = []
        for frame in self.loops:
            node = frame.node
            if node.over is None:
                continue
            idx = use_axis(node.over, "by an enclosing `for ... over`", [Note("the loop", node.head_span)],
                           loop=True)
            self.loop_blocks(frame, mesh.axes[idx].size, mesh, stmt.span)
            fixed.append((idx, self.owner(frame)[0]))
        dims = self.tensor_dims(stmt, mesh, use_axis)
        for place in stmt.placement:
            idx = use_axis(place.axis, "by `at`")
            coord = self.evaluate(place.coord)
            size = mesh.axes[idx].size
            if not 0 <= coord < size:
                raise _err(f"`at {place.axis.name}={coord}` is out of range: {place.axis.name} has "
                           f"coordinates 0..{size - 1}", place.coord.span,
                           help=f"use `at {place.axis.name}={place.axis.name}-1` for the last one")
            fixed.append((idx, coord))
        dtype = (self.dtype_name(stmt.dtype.name, stmt.dtype.span) if stmt.dtype
                 else self.default_dtype)
        if (dims, dtype) not in self.sized:
            local = tuple(d.local for d in dims)
            if dtype == "mxfp8" and (not dims or local[-1] % MXFP8_BLOCK):
                raise _err(f"mxfp8 needs the local last dim to be a multiple of {MXFP8_BLOCK}; "
                           f"here it is {local[-1] if dims else 'absent (0-d tensor)'}",
                           stmt.dims[-1].span if stmt.dims else stmt.span,
                           help="use another dtype, or a shape whose local last dim is a multiple of 32")
            self.check_size(dims, dtype, stmt)
            self.sized.add((dims, dtype))
        name = self.render(stmt.name, "value")
        key = self.render(stmt.key, "reject") if stmt.key else self.render(stmt.name, "global")
        if key == name:
            key = name  # one string object for both
        fixed = tuple(sorted(fixed))
        fixed = self.fixed_pool.setdefault(fixed, fixed)
        t = TensorIR(key, name, dtype, mesh, dims, fixed, stmt.span)
        self.register(t, stmt)
        if len(self.tensors) >= MAX_TENSORS:
            raise _err(f"more than {MAX_TENSORS} tensor instances", stmt.span)
        self.tensors.append(t)

    def tensor_mesh(self, stmt: ast.TensorDecl) -> Mesh:
        if stmt.mesh is not None:
            mesh = self.meshes.get(stmt.mesh.name)
            if mesh is None:
                hint = _did_you_mean(stmt.mesh.name, self.meshes)
                raise _err(f"unknown mesh `{stmt.mesh.name}`", stmt.mesh.span,
                           help=hint or ("declared meshes: " + ", ".join(self.meshes) if self.meshes
                                         else "declare one first: `mesh NAME (tp=2)`"))
            return mesh
        if not self.meshes:
            raise _err("tensor declared before any mesh", stmt.name.span,
                       help="declare a mesh first, e.g. `mesh train (dp=1, tp=8)`")
        return next(iter(self.meshes.values()))

    def tensor_dims(self, stmt: ast.TensorDecl, mesh: Mesh, use_axis) -> tuple[DimIR, ...]:
        """The statement's dims: one tuple per statement (and loop values it uses),
        so instances of one statement share it; its DimIRs are pooled by value."""
        if not self.loops:  # elaborated once: nothing to remember
            return self.build_dims(stmt, mesh, use_axis)
        free = self.free_memo.get(id(stmt))
        if free is None:
            free = tuple(sorted(_free_names(stmt.dims)))
            self.free_memo[id(stmt)] = free
        loop_vals = {f.node.var: f.value for f in self.loops}
        memo_key = (id(stmt), mesh.name, tuple(loop_vals.get(n) for n in free))
        cached = self.dim_memo.get(memo_key)
        if cached is not None:
            for d, ast_dim in zip(cached, stmt.dims):  # still claim the axes
                for ref in ast_dim.over:
                    use_axis(ref, "by `over`")
                if ast_dim.chunk:
                    use_axis(ast_dim.chunk.axis, "by `chunk`")
            return cached
        out = self.build_dims(stmt, mesh, use_axis)
        self.dim_memo[memo_key] = out
        return out

    def build_dims(self, stmt: ast.TensorDecl, mesh: Mesh, use_axis) -> tuple[DimIR, ...]:
        dims = []
        for d in stmt.dims:
            mode = self.mode(d.mode)
            if fragments(mode) > MAX_RUNS:
                raise _err(f"this dimension's storage alternates in {fragments(mode)} pieces; at most "
                           f"{MAX_RUNS} are supported", d.mode.span,
                           help="a real layout is far less fragmented; check the counts")
            over = None
            if d.over:
                idx = tuple(use_axis(ref, "by `over`") for ref in d.over)
                sizes = tuple(mesh.axes[i].size for i in idx)
                over = Split(idx, tuple(r.name for r in d.over), sizes)
                label = d.over[0].name if len(d.over) == 1 else "(" + ", ".join(r.name for r in d.over) + ")"
                try:
                    check_split(mode, over.size, label)
                except SplitError as e:
                    raise _err(e.message, e.node.origin.span if e.node.origin else d.span, help=e.help) from None
            chunk = None
            if d.chunk:
                idx = use_axis(d.chunk.axis, "by `chunk`")
                align = self.evaluate(d.chunk.align) if d.chunk.align is not None else None
                if align is not None and align < 1:
                    raise _err(f"`align {align}` must be at least 1", d.chunk.align.span)
                chunk = ChunkSplit(idx, d.chunk.axis.name, mesh.axes[idx].size, align)
            dim = DimIR(mode, over, chunk)
            if chunk is not None and chunk.align is None and dim.split_extent % chunk.size:
                n, g = dim.split_extent, chunk.size
                raise _err(f"chunk {chunk.name}={g}: local extent {n} leaves remainder {n % g}",
                           d.chunk.span, help=f"use `chunk {chunk.name} align 1` to pad the tail, "
                                              f"or an extent divisible by {g}")
            dims.append(self.dim_pool.setdefault(dim, dim))
        return tuple(dims)

    def mode(self, node: ast.Mode):
        match node:
            case ast.Plain(extent=e):
                return PlainM(self.extent(e, "extent"), node)
            case ast.Product(count=n, inner=inner):
                return self.checked(ProductM(self.extent(n, "count"), self.mode(inner), node))
            case ast.Concat(parts=parts):
                names = {}
                for p in parts:
                    if p.name is not None and p.name in names:
                        raise _err(f"part name `{p.name}` is used twice in this concatenation", p.span,
                                   notes=[Note("first here", names[p.name])])
                    if p.name is not None:
                        names[p.name] = p.span
                return self.checked(ConcatM(tuple(PartM(p.name, self.mode(p.mode)) for p in parts), node))
            case ast.Pad(inner=inner, multiple=k):
                return self.checked(PadM(self.mode(inner), self.extent(k, "pad multiple"), node))
        raise AssertionError(node)

    def checked(self, mode):
        if mode.stored > INT64_MAX:
            raise _err(f"stored extent {mode.stored} does not fit in 64 bits", mode.origin.span)
        return mode

    def extent(self, expr: ast.Expr, what: str) -> int:
        v = self.evaluate(expr)
        if v < 1:
            raise _err(f"{what} {v} is not positive; extents must be at least 1", expr.span,
                       help="check the expression")
        return v

    def check_size(self, dims, dtype: str, stmt: ast.TensorDecl) -> None:
        n = 1
        for d in dims:
            n *= max(d.logical, d.local)
        if n * 4 > INT64_MAX or storage_bytes(dtype, tuple(d.local for d in dims)) > INT64_MAX:
            raise _err(f"tensor of {n} elements does not fit in 64-bit sizes", stmt.span,
                       help="check the extents")

    def signature(self, dims: tuple[DimIR, ...]) -> tuple:
        """What replicas must agree on: the logical shape and the part trees."""
        sig = self.signatures.get(dims)
        if sig is None:
            sig = self.signatures[dims] = (tuple(d.logical for d in dims), tuple(d.part_tree for d in dims))
        return sig

    def register(self, t: TensorIR, stmt: ast.TensorDecl) -> None:
        """Keys unique per statement (replicas across statements); names unique per rank."""
        prior = self.keys.get(t.key)
        if prior is not None and prior.span is stmt.span:  # each statement has its own span object
            raise _err(f"key `{t.key}` repeats across iterations of this statement", stmt.name.span,
                       help="interpolate every loop variable into the name, e.g. `{l}`")
        self.check_name(t, stmt)
        if prior is None:
            self.keys[t.key] = t
        elif prior.dims is not t.dims and self.signature(prior.dims) != self.signature(t.dims):
            raise _err(f"key `{t.key}` is declared again with a different logical tensor "
                       f"({_shape(t.logical_shape)} vs {_shape(prior.logical_shape)})", stmt.name.span,
                       notes=[Note("first declared here", prior.span)],
                       help="statements may share a key only as replicas of one weight; "
                            "use `as KEY` to give this one its own key")

    def check_name(self, t: TensorIR, stmt: ast.TensorDecl) -> None:
        """A NAME is declared once per rank (LANGUAGE.md 2.4)."""
        group_key = (t.mesh.name, tuple(i for i, _ in t.fixed))
        coords = tuple(c for _, c in t.fixed)
        by_group = self.names.get(t.name)
        if by_group is None:  # most names: declared once, remembered as the instance alone
            self.names[t.name] = t
            return
        if isinstance(by_group, TensorIR):
            first = by_group
            by_group = self.names[t.name] = {
                (first.mesh.name, tuple(i for i, _ in first.fixed)): {tuple(c for _, c in first.fixed): first}}
        clash = by_group.get(group_key, {}).get(coords)
        if clash is None:
            for gk, members in by_group.items():
                if gk == group_key:
                    continue
                clash = next((other for other in members.values() if _intersect(t, other)), None)
                if clash is not None:
                    break
        if clash is not None:
            rank = next(r for r in t.ranks() if clash.holds(r))
            raise _err(f"tensor name `{t.name}` is declared twice on rank {rank}", stmt.name.span,
                       notes=[Note("also declared here", clash.span)],
                       help="names are local state-dict keys; each rank may hold a name once")
        by_group.setdefault(group_key, {})[coords] = t

    # ---- names --------------------------------------------------------------
    def render(self, tpl: ast.NameTemplate, local: str) -> str:
        """A name's text; `local` is "value" (a NAME), "global" (its default KEY)
        or "reject" (an explicit KEY, which never contains `.local`)."""
        out = []
        for p in tpl.pieces:
            if p.__class__ is str:
                out.append(p)
            elif p.expr.__class__ is ast.Name and self.loops and p.expr.name == self.loops[-1].node.var:
                out.append(str(self.loops[-1].value))  # the innermost loop variable: most names
            else:
                out.append(str(self.evaluate(p.expr, local)))
        return "".join(out)

    # ---- expressions ----------------------------------------------------------
    def evaluate(self, expr: ast.Expr, local: str = "forbid") -> int:
        """Evaluate an integer expression; `local` says what `x.local` means here."""
        match expr:
            case ast.Num(value=v):
                return self.fit(v, expr)
            case ast.Name(name=n):
                return self.lookup(n, expr.span)
            case ast.Local(name=n):
                return self.local_value(n, expr.span, local)
            case ast.Neg(operand=o):
                return self.fit(-self.evaluate(o, local), expr)
            case ast.BinOp(op=op, left=l, right=r):
                a, b = self.evaluate(l, local), self.evaluate(r, local)
                return self.fit(self.binop(op, a, b, expr), expr)
            case ast.Call(func=f, args=args):
                if f not in FUNCTIONS:
                    hint = _did_you_mean(f, FUNCTIONS)
                    raise _err(f"unknown function `{f}`", expr.span,
                               help=(hint + " " if hint else "") + "functions are: min, max, cdiv, roundup")
                arity = FUNCTIONS[f]
                if (arity is None and len(args) < 2) or (arity is not None and len(args) != arity):
                    raise _err(f"`{f}` takes {'2 or more' if arity is None else arity} arguments, "
                               f"got {len(args)}", expr.span)
                vals = [self.evaluate(a, local) for a in args]
                if f == "min":
                    return min(vals)
                if f == "max":
                    return max(vals)
                if vals[1] == 0:
                    raise _err(f"`{f}` by zero", expr.span)
                if f == "cdiv":
                    return self.fit(-(-vals[0] // vals[1]), expr)
                return self.fit(-(-vals[0] // vals[1]) * vals[1], expr)
        raise AssertionError(expr)

    def binop(self, op: str, a: int, b: int, expr: ast.BinOp) -> int:
        if op in ("/", "//", "%") and b == 0:
            raise _err(f"division by zero: `{_text(expr.right)}` is 0", expr.right.span)
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "//":
            return a // b
        if op == "%":
            return a % b
        q, r = divmod(a, b)
        if r:
            raise _err(f"`{_text(expr.left)}/{_text(expr.right)}` is not exact: {a} / {b} leaves "
                       f"remainder {r}", expr.span,
                       help="`/` is exact division; use `//` to round down or `cdiv` to round up "
                            "if that is really meant")
        return q

    def fit(self, v: int, expr: ast.Expr) -> int:
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise _err("value does not fit in a signed 64-bit integer", expr.span,
                       help="extents, counts and byte sizes must be below 2**63")
        return v

    def lookup(self, name: str, span: Span) -> int:
        for frame in reversed(self.loops):
            if frame.node.var == name:
                return frame.value
        if name in self.values:
            return self.values[name].value
        sizes = {(a.size, m.name) for m in self.meshes.values() for a in m.axes if a.name == name}
        if sizes:
            distinct = {s for s, _ in sizes}
            if len(distinct) > 1:
                desc = ", ".join(f"{m}: {s}" for s, m in sorted(sizes, key=lambda x: x[1]))
                raise _err(f"axis `{name}` has different sizes in different meshes ({desc}); its size "
                           "is ambiguous in arithmetic", span,
                           help="define a const for the size you mean")
            return distinct.pop()
        options = [f.node.var for f in self.loops] + list(self.values) + \
            [a.name for m in self.meshes.values() for a in m.axes]
        hint = _did_you_mean(name, options)
        raise _err(f"undefined name `{name}`", span,
                   help=hint or "define it with `const`, `arg`, a mesh axis, or a loop variable")

    def local_value(self, name: str, span: Span, mode: str) -> int:
        frame = next((f for f in reversed(self.loops) if f.node.var == name), None)
        if mode == "forbid":
            raise _err(f"`{name}.local` is allowed only in tensor names", span,
                       help=f"use `{name}` here")
        if mode == "reject":
            raise _err(f"a key never contains `.local`: `{name}.local` is rank-local", span,
                       help=f"write `{{{name}}}` in the key")
        if frame is None:
            raise _err(f"`{name}.local`: `{name}` is not a loop variable", span)
        if frame.node.over is None:
            raise _err(f"`{name}.local` needs a loop with `over`; loop `{name}` is not distributed",
                       span, notes=[Note("the loop", frame.node.head_span)],
                       help=f"use `{{{name}}}`, or distribute the loop: `over AXIS`")
        if mode == "global":
            return frame.value
        if not frame.block_starts:
            raise _err(f"`{name}.local` is used before the loop's axis is known", span)
        return frame.value - self.owner(frame)[1]


def _count_statements(statements) -> int:
    """`tensor` statements, loop bodies included (what the parser counted)."""
    n = 0
    for s in statements:
        if isinstance(s, ast.TensorDecl):
            n += 1
        elif isinstance(s, ast.ForLoop):
            n += _count_statements(s.body)
    return n


def _count_tensors(body) -> int:
    """Statements directly in a loop body that make instances (a nested loop counts
    once here; its own trip count is checked when it is entered)."""
    return sum(1 for s in body if isinstance(s, (ast.TensorDecl, ast.ForLoop)))


def _free_names(nodes) -> set[str]:
    out: set[str] = set()

    def visit(x):
        if isinstance(x, (ast.Name, ast.Local)):
            out.add(x.name)
        elif isinstance(x, tuple):
            for y in x:
                visit(y)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                if f != "span":
                    visit(getattr(x, f))

    visit(nodes)
    return out


def _intersect(a: TensorIR, b: TensorIR) -> bool:
    if a.mesh.end <= b.mesh.offset or b.mesh.end <= a.mesh.offset:
        return False
    if a.mesh == b.mesh:
        fa, fb = dict(a.fixed), dict(b.fixed)
        return all(fb.get(i, c) == c for i, c in fa.items())
    return any(b.holds(r) for r in a.ranks())


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _text(expr: ast.Expr) -> str:
    span = expr.span
    if span is None or span.line != span.end_line:
        return "..."
    return span.source.line_text(span.line)[span.col - 1:span.end_col - 1]


def _finish(el: _Elaborator, path: str, unknown_args: str = "error") -> Layout:
    unknown = sorted(set(el.overrides) - el.used_overrides)
    if unknown and unknown_args == "error":
        name = unknown[0]
        if name in el.values:
            raise UsageError(f"--set {name}: `{name}` is a const, not an arg", None,
                             help=f"declare it with `arg {name} = ...` to make it overridable")
        args = [n for n, v in el.values.items() if v.kind == "arg"]
        raise UsageError(f"--set {name}: the layout has no arg `{name}`", None,
                         help=("args are: " + ", ".join(args)) if args else "the layout declares no args")
    h = hashlib.sha256()
    for text in el.texts:
        h.update(len(text).to_bytes(8, "little") + text.encode("utf-8"))
    h.update(repr(el.arg_values).encode("utf-8"))
    return Layout(path, el.header, tuple(el.meshes.values()), tuple(el.tensors), tuple(el.arg_values),
                  h.hexdigest())


def loads(text: str | bytes, path: str = "<string>", args: dict[str, int] | None = None,
          *, unknown_args: str = "error") -> Layout:
    """Elaborate layout text. Raises LayoutError (with position) for any user error.

    >>> loads("mesh m (tp=2)\\ntensor w [(gate: 4 | up: 4) over tp]").tensors[0].local_shape
    (4,)
    """
    el = _Elaborator(args or {})
    source = decode(text, path) if isinstance(text, bytes) else Source(path, text)
    with gc_paused():
        el.run_file(source)
        return _finish(el, path, unknown_args)


def load(path: str | os.PathLike, args: dict[str, int] | None = None,
         *, unknown_args: str = "error") -> Layout:
    """Read and elaborate a `.layout` file (includes are relative to it).

    `unknown_args="ignore"` lets one set of args serve two layouts (a plan).
    """
    path = os.fspath(path)
    try:
        data = read_layout_file(path)
    except FileRefused as exc:
        raise UsageError(f"cannot read {path}: {exc.reason}", help=exc.help) from None
    return loads(data, path, args, unknown_args=unknown_args)
