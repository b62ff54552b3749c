"""A checkpoint's layouts built straight as IR: the same Layout its text elaborates to, without parsing.

The text a checkpoint's layout is written as (describe.py, load.py's readers, save.py's
file rank) is one mesh and one `tensor NAME [E1, E2, ...] [DTYPE] [at AXIS=C]` statement
per key: no loops, no splits, no args. Parsing that text with the grammar costs about
0.2 ms a line (a 1000-key checkpoint: 0.2 s, on every rank, for every load), so the IR
is made here from the statements' values, with the spans the parser would give (one per
statement line, so a diagnostic shows the line). tests/test_checkpoint_rules.py checks
the result equals `loads(text)` field by field, digest included.
"""

from __future__ import annotations

from collections import OrderedDict

from ..diagnostics import Source, Span
from ..elaborate.sources import digest_of
from ..ir import Axis, DimIR, Layout, Mesh, TensorIR
from ..modes import ConcatM, PartM, PlainM, ProductM


def plain_layout(text: str, path: str, mesh: tuple[str, tuple[tuple[str, int], ...]],
                 tensors: dict[str, tuple[str, tuple[int, ...]]], at: dict[str, int] | None = None,
                 name: str | None = "checkpoint", rows: dict[str, tuple[int, int]] | None = None) -> Layout:
    """The Layout of `text`, given its mesh (name, ((axis, size), ...)), each tensor's (dtype,
    logical shape) by NAME and, for `at AXIS=C` statements, C on the mesh's first axis by NAME.
    `text` is what those statements print (describe.py `_text`): one `tensor NAME ...` line each;
    `rows`: (heads, half) of the tensors whose dim 0 is rotary rows, `(heads, (re: half | im: half))`."""
    source = Source(path, text)
    lines = text.split("\n")
    mesh_line = next(i for i, line in enumerate(lines, 1) if line.startswith("mesh "))
    m = Mesh(mesh[0], tuple(Axis(a, n) for a, n in mesh[1]), 0,
             Span(source, mesh_line, 6, mesh_line, 6 + len(mesh[0])))
    dims: dict[int, DimIR] = {}
    fixed_pool: dict = {}
    out = []
    for i, line in enumerate(lines, 1):
        if not line.startswith("tensor "):
            continue
        tname = line.split(" ", 2)[1]
        dtype, shape = tensors[tname]
        coord = (at or {}).get(tname)
        fixed = ((0, coord),) if coord is not None else ()
        fixed = fixed_pool.setdefault(fixed, fixed)
        shape = tuple(shape)
        tdims = tuple(dims.setdefault(e, DimIR(PlainM(e), None, None)) for e in shape)
        if rows and tname in rows:
            n, half = rows[tname]
            halves = DimIR(ProductM(n, ConcatM((PartM("re", PlainM(half)), PartM("im", PlainM(half))))), None, None)
            tdims = (dims.setdefault(("rotary", n, half), halves), *tdims[1:])
        out.append(TensorIR(tname, tname, dtype, m, tdims, fixed, shape, shape, Span(source, i, 1, i, len(line) + 1)))
    return Layout(path, name, (m,), tuple(out), (), digest_of([source], []), (source,))


PLANS_KEPT = 4  # plans kept per process (a trainer saving every N steps plans its save once)
_PLANS: "OrderedDict[tuple, object]" = OrderedDict()


def text_digest(text: str) -> str:
    """The digest of the layout `text` elaborates to (`plain_layout`'s, `loads`'): its text's."""
    return digest_of([Source("", text)], [])


def cached_plan(kind: str, src: Layout, dst_digest: str, build):
    """`build()` (a compile_plan from `src` to the layout of digest `dst_digest`), or the plan it
    gave before for the same digests. Equal digests are equal layouts (DESIGN.md) and a plan is
    a pure function of its layouts and options (its own digest hashes just these), so a save
    repeated with the same layout and files, to any directory, reuses its plans (the file plan
    of benchmarks/checkpoint_io.py's full-size save: 20-50 ms a rank made, 2 ms kept)."""
    key = (kind, src.digest, dst_digest)
    plan = _PLANS.get(key)
    if plan is None:
        plan = build()
        _PLANS[key] = plan
        while len(_PLANS) > PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


__all__ = ["plain_layout", "cached_plan", "text_digest"]
