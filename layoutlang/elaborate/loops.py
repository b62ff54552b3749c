"""Which iterations a `for` runs, and which coordinate of its `over` axis owns each.

Guarantees: a range `A..B` has A <= B (and, with `over`, A < B); the instances
a loop makes are counted when it is entered, before any is built, against
`limits.MAX_TENSORS`; a loop variable shadows no name. `for l in A..B over X`
cuts the iterations into one block per coordinate of X: evenly, or as its
`sizes [...]` say (one entry per coordinate, none negative, summing to the
count); the first tensor the loop governs fixes X's size, and every later one
must give X the same size. An instance inside the loop is held by the
coordinate whose block holds the loop's current value. An error raised in the
body says which iteration it was raised in, when it depends on it (`name_iteration`).
"""

from __future__ import annotations

from .. import ast
from ..diagnostics import ElaborationError, LayoutError, Note, Span
from ..ir import Mesh
from . import limits
from .meshes import AxisClaims
from .scope import LoopFrame, Scope


def enter(stmt: ast.ForLoop, scope: Scope, made: int) -> LoopFrame:
    """A checked frame for `stmt` (not yet pushed); `made`: instances built so far."""
    if stmt.var in scope.values or any(f.node.var == stmt.var for f in scope.loops):
        raise ElaborationError(f"loop variable `{stmt.var}` shadows an existing name", stmt.var_span,
                               help="choose another variable name")
    start, stop = scope.evaluate(stmt.start), scope.evaluate(stmt.stop)
    if stop < start:
        raise ElaborationError(f"empty range {start}..{stop}: the end is before the start", stmt.head_span,
                               help="ranges are half-open `A..B` with A <= B")
    outer = 1
    for f in scope.loops:
        outer *= max(1, f.stop - f.start)
    makes = outer * (stop - start) * max(1, count_tensors(stmt.body))
    if makes + made > limits.MAX_TENSORS:
        raise ElaborationError(f"this loop makes {makes} tensors; at most {limits.MAX_TENSORS} per layout are "
                               "supported", stmt.head_span, help="check the range")
    if stmt.over is not None and stop == start:
        raise ElaborationError(f"loop over `{stmt.over.name}` has an empty range", stmt.head_span)
    return LoopFrame(stmt, start, stop)


def name_iteration(err: LayoutError, frame: LoopFrame, scope: Scope) -> None:
    """Add to an error raised inside `frame`'s body a note naming the iteration it was raised in
    (an outer loop adds its own after), when the error depends on it: the failing statement
    evaluated an expression that reads the loop variable (a dim, an index, a range, `at`), or an
    earlier iteration of the same statements passed (a key that repeats, a limit reached). An
    error of the first iteration that evaluates no loop value (an unknown dtype, a `const` in
    the body, a key without the variable of an inner loop: a name's plain `{l}` is no
    expression) would be raised in every iteration: naming one would only say "the first"."""
    if frame.read_at != scope.statement and frame.value == frame.start:
        return
    var = frame.node.var
    err.notes += (Note(f"in iteration {var} = {frame.value} of `for {var} in {frame.start}..{frame.stop}`",
                       frame.node.head_span),)


def count_tensors(body) -> int:
    """Statements directly in a loop body that make instances (a nested loop counts
    once here; its own trip count is checked when it is entered)."""
    return sum(1 for s in body if isinstance(s, (ast.TensorDecl, ast.ForLoop)))


def claim_axes(frames: list[LoopFrame], claims: AxisClaims, scope: Scope, tensor_span: Span) -> list[tuple[int, int]]:
    """The (axis, coordinate) that each enclosing `for ... over` places the instance at."""
    fixed = []
    for frame in frames:
        node = frame.node
        if node.over is None:
            continue
        idx = claims.claim(node.over, "by an enclosing `for ... over`", [Note("the loop", node.head_span)],
                           loop=True)
        distribute(frame, claims.mesh.axes[idx].size, claims.mesh, tensor_span, scope)
        fixed.append((idx, frame.block()[0]))
    return fixed


def distribute(frame: LoopFrame, size: int, mesh: Mesh, tensor_span: Span, scope: Scope) -> None:
    """Fix a loop's blocks over its axis (the size comes from the first governed tensor)."""
    node = frame.node
    if frame.axis_size is not None:
        if frame.axis_size != size:
            raise ElaborationError(f"loop over `{node.over.name}` governs tensors whose meshes give the axis "
                                   f"different sizes ({frame.axis_mesh}: {frame.axis_size}, {mesh.name}: {size})",
                                   tensor_span, notes=[Note("the loop", node.head_span)],
                                   help="put every tensor of this loop on meshes with the same axis size")
        return
    n = frame.stop - frame.start
    if node.sizes is None:
        if n % size:
            base, extra = divmod(n, size)
            suggestion = [base + 1] * extra + [base] * (size - extra)
            raise ElaborationError(f"{n} iterations do not split evenly over {node.over.name}={size} "
                                   f"(remainder {n % size})", node.head_span,
                                   help=f"give the blocks: `sizes [{', '.join(map(str, suggestion))}]`")
        blocks = [n // size] * size
    else:
        blocks = [scope.evaluate(e) for e in node.sizes]
        first, last = node.sizes[0].span, node.sizes[-1].span
        entries = Span(first.source, first.line, first.col, last.end_line, last.end_col)
        if len(blocks) != size:
            raise ElaborationError(f"`sizes` has {len(blocks)} entries but {node.over.name} has size {size}",
                                   entries, help="give one entry per coordinate of the axis")
        for e, b in zip(node.sizes, blocks):
            if b < 0:
                raise ElaborationError(f"block size {b} is negative", e.span)
        if sum(blocks) != n:
            raise ElaborationError(f"`sizes` sum to {sum(blocks)} but the range {frame.start}..{frame.stop} "
                                   f"has {n} iterations", entries,
                                   help="the entries must sum to the number of iterations")
    starts, acc = [], frame.start
    for b in blocks:
        starts.append(acc)
        acc += b
    frame.axis_size, frame.axis_mesh, frame.block_starts = size, mesh.name, starts
