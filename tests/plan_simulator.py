"""A slow, obviously-correct executor of a plan, and the checks it makes.

Why: the compiler proves coverage symbolically (layoutlang/compiler/verify.py) with
rectangle sweeps. This module checks the same promise (LANGUAGE.md 5,
DESIGN.md invariant 1) the dumbest possible way: it materializes every local
tensor of both layouts on the CPU, runs every op as a tensor slice copy, and
looks at every destination element.

    source    every DATA element holds a value unique to (key, logical index);
              every PADDING element holds NaN
    dest      every element starts as SENTINEL, with a write counter of 0
    ops       dst[dst_slice] = src[src_slice]; counter[dst_slice] += 1
              (a strided dim, LANGUAGE.md 6 and docs/compiler.md: `(start, stop, step)`
              is range(start, stop, step); `(start, stop, step, block)` is `block`
              elements from each k in that range; written out here as index lists)
    then      every destination DATA element (every rank that holds the
              tensor, replicas included) was written exactly once and equals
              the value of its logical index; every PADDING element was never
              written (the runtime zeroes it; padding is never sent)

and per op: the named tensors exist on the named ranks, slices lie inside the
local shapes and have equal extents, the source slice holds no padding, the
keys agree, `op.id` is the op's position, and `op.bytes` is elements times the
wire size (the destination dtype's size; bf16 for a quantized destination).

Which local element is which logical index comes from a *view* of a layout:

- `ReferenceView(layout, spec)`: for layouts generated from a
  `reference_enumerator.LayoutSpec` (the property tests). Holders and the
  per-element logical indices come from the reference enumerator, which was
  written from the spec alone; the front end is used only to pair each IR
  instance with its reference instance (checked by key and name).
- `RunsView(layout)`: for hand-written layouts (the examples). Holders come from
  `t.ranks()` and the maps from expanding `t.runs(rank)`, which
  tests/test_runs_property.py checks against the reference; the keys inside a
  v2 stored tensor from the front end's `t.regions`.
- `ModelView(layout, model)`: for random v2 layouts whose test writes down its
  own model of every instance (`ModelInstance`: reference `Dim`s, holders, key
  boxes as `ModelRegion`s): nothing but the pairing by name comes from the
  front end, so stacked dims, part keys and transposed storage are checked
  against the test's rule, not against what the compiler was given.

A view says which keys a stored tensor holds (`regions(t)`: None for a v1
tensor, one key, the whole of it). An element of a v2 tensor takes the value of
its key at its row-major index in the key: the key's coordinates are the stored
ones minus the box's corner, stacked dims dropped, a transposed key's two dims
read in reverse (a flat dim's key: its flat position minus the box's start);
an element in no box is padding.

`simulate` returns a `SimReport` (bytes per rank, local vs network bytes, ops
per key) or raises AssertionError naming key, rank, tensor, local index and
expected vs actual values. `check_plan_views` and `check_stats` check the
plan's bookkeeping (ops_for_rank, stats) against the op list.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

with warnings.catch_warnings():  # torch warns when numpy is absent; we never use numpy
    warnings.simplefilter("ignore")
    import torch

# The simulator's tensors are small: torch's intra-op threads only contend for the CPU
# (one small pair: 1.6 s with 2 threads, 0.09 s with 1, on a 2-core machine).
torch.set_num_threads(1)

from wire_rule import op_wire
from reference_enumerator import Dim, LayoutSpec, MeshSpec, dim_local, instances, logical_extent

SENTINEL = -1e30
WIRE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "mxfp8", "fp8_b128", "mxfp4", "nvfp4")  # written out: independent of the vocabulary
MAX_PROBLEMS = 12

LocalMap = list[list[int | None]]  # per dim, per local element: logical index or None (padding)


def wire_size(dst_dtype: str) -> int:
    """Bytes per element on the wire (LANGUAGE.md 4): quantized values travel as bf16."""
    return 2 if dst_dtype in QUANTIZED else WIRE_BYTES[dst_dtype]


# ---------------------------------------------------------------------------
# Views: who holds a tensor instance, and which logical index each local element is


class RunsView:
    """Holders from `t.ranks()`, maps from `t.runs(rank)` (hand-written layouts)."""

    source = "runs"

    def __init__(self, layout):
        self.layout = layout

    def holders(self, t) -> list[int]:
        return sorted(t.ranks())

    def logical_shape(self, t) -> tuple[int, ...]:
        return tuple(t.logical_shape)

    def regions(self, t):
        """The keys inside a v2 stored tensor, from the front end (None: v1, the whole tensor)."""
        return getattr(t, "regions", None)

    def local(self, t, rank: int) -> LocalMap:
        out: LocalMap = []
        for dim_runs in t.runs(rank):
            xs: list[int | None] = []
            for run in dim_runs:
                assert run.local_start == len(xs), f"runs of {t.name} on rank {rank} do not tile"
                if hasattr(run, "logical_start"):
                    xs.extend(range(run.logical_start, run.logical_start + run.length))
                else:
                    xs.extend([None] * run.length)
            out.append(xs)
        return out


class ReferenceView:
    """Holders and maps from the reference enumerator (layouts rendered from a LayoutSpec)."""

    source = "reference"

    def __init__(self, layout, spec: LayoutSpec):
        self.layout, self.spec = layout, spec
        expected = instances(spec)
        got = [(t.key, t.name) for t in layout.tensors]
        want = [(e.key, e.name) for e in expected]
        assert got == want, f"front end and reference disagree on instances: {got} vs {want}"
        self._inst = {id(t): e for t, e in zip(layout.tensors, expected)}

    def holders(self, t) -> list[int]:
        return sorted(self._inst[id(t)].holders)

    def logical_shape(self, t) -> tuple[int, ...]:
        return tuple(logical_extent(d.mode) for d in self._inst[id(t)].spec.dims)

    def regions(self, t):
        return None  # LayoutSpec layouts are version 1: one key per tensor

    def local(self, t, rank: int) -> LocalMap:
        mesh = self.spec.mesh
        coords = mesh.coords(rank)
        assert coords is not None, f"rank {rank} is outside mesh {mesh}"
        return [dim_local(d, mesh.sizes, coords) for d in self._inst[id(t)].spec.dims]


@dataclass(frozen=True)
class ModelRegion:
    """One key inside a modelled v2 stored tensor (LANGUAGE.md 8), written down by a test from
    its own rule: `box` per stored dim [lo, hi) of the stored tensor's logical coordinates,
    `stacked` the stored dims that are stack indices, `transposed` the key's two dims stored in
    the opposite order."""

    key: str
    box: tuple[tuple[int, int], ...]
    stacked: tuple[int, ...] = ()
    transposed: bool = False
    # a key of a flat dim (docs/language.md 14.9): its shape; `box` is its range of the flat dim's
    # logical elements, which are the key's elements in row-major order
    shape: tuple[int, ...] | None = None

    @property
    def key_shape(self) -> tuple[int, ...]:
        if self.shape is not None:
            return self.shape
        shape = tuple(hi - lo for d, (lo, hi) in enumerate(self.box) if d not in self.stacked)
        return shape[::-1] if self.transposed else shape


@dataclass(frozen=True)
class ModelInstance:
    """A stored tensor instance as a test models it: its dims as reference_enumerator `Dim`s on
    `mesh`, the ranks that hold it, and its keys (None: a v1 tensor, key `key`, the whole of it)."""

    name: str
    key: str
    mesh: MeshSpec
    dims: tuple[Dim, ...]
    holders: tuple[int, ...]
    regions: tuple[ModelRegion, ...] | None


class ModelView:
    """Everything from a test's own model (v2 layouts, tests/test_v2_plan_property.py): holders,
    per-element logical indices (reference_enumerator, from the spec alone) and key boxes. The
    front end is used only to pair each IR instance with its model, by name."""

    source = "model"

    def __init__(self, layout, model: Iterable[ModelInstance]):
        self.layout = layout
        self._inst = {m.name: m for m in model}
        got = sorted(t.name for t in layout.tensors)
        assert got == sorted(self._inst), f"front end and model disagree on instances: {got} vs {sorted(self._inst)}"

    def holders(self, t) -> list[int]:
        return sorted(self._inst[t.name].holders)

    def logical_shape(self, t) -> tuple[int, ...]:
        return tuple(logical_extent(d.mode) for d in self._inst[t.name].dims)

    def regions(self, t):
        return self._inst[t.name].regions

    def local(self, t, rank: int) -> LocalMap:
        m = self._inst[t.name]
        coords = m.mesh.coords(rank)
        assert coords is not None, f"rank {rank} is outside mesh {m.mesh}"
        return [dim_local(d, m.mesh.sizes, coords) for d in m.dims]


# ---------------------------------------------------------------------------
# Materialized local tensors


@dataclass
class Local:
    """One tensor instance on one rank: values, padding mask, write counts (destination)."""

    tensor: object
    rank: int
    maps: LocalMap
    values: torch.Tensor
    pad: torch.Tensor
    expected: torch.Tensor
    regions: tuple | None                 # the keys inside a v2 stored tensor (the view's), None: v1
    writes: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(xs) for xs in self.maps)

    def logical_of(self, index: tuple[int, ...]) -> tuple[int | None, ...]:
        return tuple(self.maps[d][i] for d, i in enumerate(index))


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _materialize(maps: LocalMap, logical_shape: tuple[int, ...], base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected values, padding mask): value = base + 1 + row-major logical index."""
    shape = [len(xs) for xs in maps]
    values = torch.full(shape, float(base + 1), dtype=torch.float64)
    pad = torch.zeros(shape, dtype=torch.bool)
    for d, (xs, stride) in enumerate(zip(maps, _strides(logical_shape))):
        view = [1] * len(shape)
        view[d] = len(xs)
        idx = torch.tensor([0 if x is None else x * stride for x in xs], dtype=torch.float64)
        values = values + idx.view(view)
        pad = pad | torch.tensor([x is None for x in xs], dtype=torch.bool).view(view)
    return values, pad


def _materialize_regions(maps: LocalMap, regions, shapes, base) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored tensor holding several keys: each element's value is its key's base + 1 + its
    row-major index in that key (the key's coordinates are the stored ones minus the box corner);
    an element in no key's box (padding) is padding."""
    shape = [len(xs) for xs in maps]
    values = torch.zeros(shape, dtype=torch.float64)
    owned = torch.zeros(shape, dtype=torch.int64)
    # per dim, the logical index of each local element (-1: padding), made once for every region
    logical = [torch.tensor([-1 if x is None else x for x in xs], dtype=torch.int64) for xs in maps]
    for r in regions:
        inside = torch.ones(shape, dtype=torch.bool)
        idx = torch.full(shape, float(base[r.key] + 1), dtype=torch.float64)
        for d, (xs, (lo, hi), stride) in enumerate(zip(logical, r.box, _key_strides(r))):
            view = [1] * len(shape)
            view[d] = len(xs)
            inside = inside & ((xs >= lo) & (xs < hi)).view(view)
            idx = idx + torch.where(xs >= 0, (xs - lo) * stride, 0).to(torch.float64).view(view)
        values = torch.where(inside, idx, values)
        owned = owned + inside.to(torch.int64)
    assert owned.numel() == 0 or int(owned.max()) <= 1, "two keys' boxes overlap"
    return values, owned == 0


def _key_strides(r) -> list[int]:
    """Per STORED dim, its stride in the key's row-major index: stacked dims count 0; a
    transposed key (LANGUAGE.md 8.3) takes its two dims in the opposite order."""
    dims = [d for d in range(len(r.box)) if d not in r.stacked]
    order = dims[::-1] if r.transposed else dims
    strides = dict(zip(order, _strides([r.box[d][1] - r.box[d][0] for d in order])))
    return [strides.get(d, 0) for d in range(len(r.box))]


def _holds_key(local: Local, key: str) -> bool:
    if local.regions is None:
        return local.tensor.key == key
    return any(r.key == key for r in local.regions)


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The first (row-major) index where mask is true, or None."""
    if mask.dim() == 0:
        return () if bool(mask) else None
    hits = mask.nonzero()
    return tuple(int(v) for v in hits[0]) if len(hits) else None


def _indices(e: Sequence[int]) -> list[int]:
    """The local indices one dim of a slice names, in the op's element order."""
    if len(e) == 2:
        return list(range(e[0], e[1]))
    block = e[3] if len(e) == 4 else 1
    return [k + i for k in range(e[0], e[1], e[2]) for i in range(block)]


def _well_formed(e: Sequence[int]) -> bool:
    """A slice entry whose indices are distinct and increasing: a step >= its block."""
    if len(e) == 2:
        return True
    block = e[3] if len(e) == 4 else 1
    return len(e) in (3, 4) and block >= 1 and e[2] >= block


def _region(sl: Sequence[Sequence[int]]):
    """An index for tensor[...]: slices, or per-dim index lists broadcast against each other."""
    if all(len(e) == 2 for e in sl):
        return tuple(slice(a, b) for a, b in sl)
    n = len(sl)
    return tuple(torch.tensor(_indices(e)).reshape([-1 if i == d else 1 for i in range(n)])
                 for d, e in enumerate(sl))


def _fmt_slice(sl) -> str:
    return "[" + ", ".join(":".join(str(x) for x in e) for e in sl) + "]"


# ---------------------------------------------------------------------------
# The report


@dataclass
class SimReport:
    ops: int = 0
    elements: int = 0
    bytes: int = 0
    local_bytes: int = 0
    network_bytes: int = 0
    sent: Counter = field(default_factory=Counter)        # rank -> network bytes sent
    received: Counter = field(default_factory=Counter)    # rank -> network bytes received
    ops_per_key: Counter = field(default_factory=Counter)
    dst_locals: int = 0                                   # (rank, tensor) pairs checked
    dst_data_elements: int = 0
    dst_pad_elements: int = 0
    src_pad_elements: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def max_send_bytes(self) -> int:
        return max(self.sent.values(), default=0)

    @property
    def max_recv_bytes(self) -> int:
        return max(self.received.values(), default=0)


class _Failed(Exception):
    pass


class _Collector:
    def __init__(self, report: SimReport):
        self.report = report

    def __call__(self, message: str) -> None:
        self.report.problems.append(message)
        if len(self.report.problems) >= MAX_PROBLEMS:
            raise _Failed


# ---------------------------------------------------------------------------
# The simulation


def simulate(src_view, dst_view, plan, *, raise_on_failure: bool = True) -> SimReport:
    """Run `plan` element by element between the two layouts the views describe."""
    report = SimReport()
    problem = _Collector(report)
    try:
        _simulate(src_view, dst_view, plan, report, problem)
    except _Failed:
        pass
    if report.problems and raise_on_failure:
        more = "" if len(report.problems) < MAX_PROBLEMS else "\n  ... (stopped at the first problems)"
        raise AssertionError(
            f"plan simulation failed ({len(report.problems)} problems; maps from "
            f"{src_view.source}/{dst_view.source}):\n  " + "\n  ".join(report.problems) + more)
    return report


def _simulate(src_view, dst_view, plan, report: SimReport, problem) -> None:
    src, dst = src_view.layout, dst_view.layout

    # Logical shapes and value bases: keys in sorted order, bases cumulative. A v2 stored
    # tensor (LANGUAGE.md 8.1: `regions`) holds several keys, each a box of its logical tensor.
    def keys_of(view, t) -> list[tuple[str, tuple[int, ...]]]:
        regions = view.regions(t)
        if regions is None:
            return [(t.key, view.logical_shape(t))]
        return [(r.key, r.key_shape) for r in regions]

    shapes: dict[str, tuple[int, ...]] = {}
    for view in (dst_view, src_view):
        for t in view.layout.tensors:
            for key, shape in keys_of(view, t):
                if shapes.setdefault(key, shape) != shape and view is dst_view:
                    problem(f"key {key}: destination statements disagree on the logical shape")
    src_shapes: dict[str, set] = defaultdict(set)
    for t in src.tensors:
        for key, shape in keys_of(src_view, t):
            src_shapes[key].add(shape)
    for t in dst.tensors:
        for key, shape in keys_of(dst_view, t):
            if not src_shapes[key]:
                problem(f"key {key}: destination tensor {t.name} has no source tensor")
            elif src_shapes[key] != {shape}:
                problem(f"key {key}: logical shape {shape} in the destination, "
                        f"{sorted(src_shapes[key])} in the source")
    base, acc = {}, 0
    for key in sorted(shapes):
        base[key] = acc
        acc += math.prod(shapes[key])
    assert acc + 1 < 2**53, "values would not be exact in float64"

    def build(view, t, rank, is_dst: bool) -> Local:
        maps = view.local(t, rank)
        lshape = view.logical_shape(t)
        if tuple(len(xs) for xs in maps) != tuple(t.local_shape_at(rank)):
            problem(f"key {t.key}: {t.name} on rank {rank}: map shape "
                    f"{tuple(len(xs) for xs in maps)} != local_shape {tuple(t.local_shape_at(rank))}")
        for d, xs in enumerate(maps):
            data = [x for x in xs if x is not None]
            if any(not 0 <= x < lshape[d] for x in data) or len(set(data)) != len(data):
                problem(f"key {t.key}: {t.name} on rank {rank}, dim {d}: bad logical map {xs}")
        regions = view.regions(t)
        if regions is None:
            expected, pad = _materialize(maps, shapes[t.key], base[t.key])
        else:
            expected, pad = _materialize_regions(maps, regions, shapes, base)
        if is_dst:
            values = torch.full(expected.shape, SENTINEL, dtype=torch.float64)
            writes = torch.zeros(expected.shape, dtype=torch.int64)
            return Local(t, rank, maps, values, pad, expected, regions, writes)
        values = expected.clone()
        values[pad] = math.nan
        return Local(t, rank, maps, values, pad, expected, regions)

    def store(view, is_dst: bool) -> dict[tuple[int, str], Local]:
        out: dict[tuple[int, str], Local] = {}
        for t in view.layout.tensors:
            for rank in view.holders(t):
                if (rank, t.name) in out:
                    problem(f"name {t.name} is held twice on rank {rank}")
                out[(rank, t.name)] = build(view, t, rank, is_dst)
        return out

    src_store = store(src_view, False)
    dst_store = store(dst_view, True)
    report.src_pad_elements = sum(int(x.pad.sum()) for x in src_store.values())

    # Apply every op, each relay after the ops it waits for (LANGUAGE.md 5), reading the
    # forwarding rank's destination as it stands then.
    ops = list(plan.ops)
    for position, op in enumerate(ops):
        if op.id != position:
            problem(f"op {op.id}: id {op.id} at position {position}")
    for op in _after_order(ops, problem):
        report.ops += 1
        where = f"op {op.id} ({op.key}: rank {op.src_rank} {op.src_name}{_fmt_slice(op.src_slice)} -> " \
                f"rank {op.dst_rank} {op.dst_name}{_fmt_slice(op.dst_slice)})"
        after = tuple(getattr(op, "after", ()))
        s = (dst_store if after else src_store).get((op.src_rank, op.src_name))
        d = dst_store.get((op.dst_rank, op.dst_name))
        if s is None:
            problem(f"{where}: {'relay' if after else 'source'} rank {op.src_rank} holds no "
                    f"{'destination ' if after else ''}tensor named {op.src_name}")
            continue
        if after and any(ops[k].dst_rank != op.src_rank or ops[k].dst_name != op.src_name for k in after):
            problem(f"{where}: waits for ops {list(after)}, which do not deliver to rank {op.src_rank} "
                    f"{op.src_name}")
            continue
        if d is None:
            problem(f"{where}: destination rank {op.dst_rank} holds no tensor named {op.dst_name}")
            continue
        if not _holds_key(s, op.key) or not _holds_key(d, op.key):
            problem(f"{where}: op key {op.key}, source tensor key {s.tensor.key}, "
                    f"destination tensor key {d.tensor.key}")
            continue
        bad = False
        for what, sl, local in (("src_slice", op.src_slice, s), ("dst_slice", op.dst_slice, d)):
            if len(sl) != len(local.shape) or not all(map(_well_formed, sl)) or any(
                    not ix or not 0 <= ix[0] <= ix[-1] < n for ix, n in zip(map(_indices, sl), local.shape)):
                problem(f"{where}: {what} {_fmt_slice(sl)} is empty or outside local shape "
                        f"{local.shape} of {local.tensor.name} on rank {local.rank}")
                bad = True
        if bad:
            continue
        extents = [len(_indices(e)) for e in op.src_slice]
        # a stacked dim (LANGUAGE.md 8.2) is an extent-1 slice on one side only: compare the rest;
        # a key stored transposed on one side (8.3) arrives as the transpose of the (p, q) block
        want = [n for n in extents if n != 1]
        turned = getattr(op, "transpose", None)
        if turned is not None:
            if math.prod(turned) != math.prod(extents):
                problem(f"{where}: transpose block {turned} does not hold the source slice's elements")
                continue
            want = [n for n in turned[::-1] if n != 1]
        dst_extents = [len(_indices(e)) for e in op.dst_slice]
        # a flat side (docs/language.md 14.9) holds the key's block as one run of its 1-d storage:
        # the elements, in row-major order, are what must agree
        flat = any(getattr(r, "shape", None) is not None for x in (s, d) for r in (x.regions or ()))
        if flat and math.prod(extents) != math.prod(dst_extents):
            problem(f"{where}: slice element counts differ: {extents} vs {dst_extents}")
            continue
        if not flat and want != [n for n in dst_extents if n != 1]:
            problem(f"{where}: slice extents differ: {extents} vs {dst_extents}")
            continue
        elements = math.prod(extents)
        packed, want_bytes = op_wire(op.dst_slice, d.tensor.dtype, tuple(d.values.shape), getattr(plan, "wire", "auto"))
        if (getattr(op, "wire", None) is not None) != packed:
            problem(f"{where}: wire {getattr(op, 'wire', None)}, expected "
                    f"{d.tensor.dtype if packed else 'the bf16 path'} (wire_rule.py)")
        if op.bytes != want_bytes:
            problem(f"{where}: bytes {op.bytes}, expected {want_bytes} ({d.tensor.dtype} destination, "
                    f"{'quantized' if packed else 'plain'} wire, wire_rule.py)")
        src_region, dst_region = _region(op.src_slice), _region(op.dst_slice)
        hit = _first(s.pad[src_region])
        if hit is not None:
            index = tuple(_indices(e)[i] for e, i in zip(op.src_slice, hit))
            problem(f"{where}: the source slice covers padding at local index {index} of "
                    f"{op.src_name} on rank {op.src_rank}")
        if after and bool((s.writes[src_region] != 1)[~s.pad[src_region]].any()):
            problem(f"{where}: relays data that rank {op.src_rank} has not received exactly once yet")
        block = s.values[src_region]
        if getattr(op, "transpose", None) is not None:  # one side stores the key transposed
            block = block.reshape(op.transpose).t()
        d.values[dst_region] = block.reshape(d.values[dst_region].shape)
        d.writes[dst_region] += 1
        report.elements += elements
        report.bytes += op.bytes
        report.ops_per_key[op.key] += 1
        if op.src_rank == op.dst_rank:
            report.local_bytes += op.bytes
        else:
            report.network_bytes += op.bytes
            report.sent[op.src_rank] += op.bytes
            report.received[op.dst_rank] += op.bytes

    # Check every destination element.
    for (rank, name), d in sorted(dst_store.items(), key=lambda kv: kv[0]):
        report.dst_locals += 1
        data = ~d.pad
        report.dst_data_elements += int(data.sum())
        report.dst_pad_elements += int(d.pad.sum())
        head = f"key {d.tensor.key}: {name} on destination rank {rank}"
        for mask, what in (
            (data & (d.writes == 0), "data element never written"),
            (data & (d.writes > 1), "data element written more than once"),
            (d.pad & (d.writes > 0), "padding element written (padding is never sent)"),
        ):
            hit = _first(mask)
            if hit is not None:
                problem(f"{head}: {what} at local index {hit} (logical {d.logical_of(hit)}), "
                        f"{int(d.writes[hit])} writes, {int(mask.sum())} such elements")
        wrong = data & (d.writes == 1) & (d.values != d.expected)
        hit = _first(wrong)
        if hit is not None:
            got = float(d.values[hit])
            problem(f"{head}: wrong value at local index {hit} (logical {d.logical_of(hit)}): "
                    f"expected {float(d.expected[hit]):.0f}, got {_describe_value(got, base, shapes)}; "
                    f"{int(wrong.sum())} wrong elements")


def _after_order(ops, problem) -> list:
    """The ops in id order, except that an op with `after` comes after every op it names."""
    done: set[int] = set()
    out, waiting = [], list(ops)
    while waiting:
        later = []
        for op in waiting:
            if all(k in done for k in getattr(op, "after", ())):
                out.append(op)
                done.add(op.id)
            else:
                later.append(op)
        if len(later) == len(waiting):
            problem(f"ops {[op.id for op in later[:8]]} wait for ops that never run (a cycle or a missing id)")
            break
        waiting = later
    return out


def _describe_value(v: float, base: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> str:
    """Decode a value back to (key, logical index) so a wrong copy says what it copied."""
    if math.isnan(v):
        return "NaN (source padding)"
    if v == SENTINEL:
        return "the sentinel"
    flat = int(v) - 1
    for key in sorted(base, key=base.get, reverse=True):
        if flat >= base[key]:
            rest, index = flat - base[key], []
            for n in reversed(shapes[key]):
                rest, i = divmod(rest, n) if n else (rest, 0)
                index.append(i)
            return f"{v:.0f} = {key}{tuple(reversed(index))}"
    return f"{v!r}"


# ---------------------------------------------------------------------------
# Bookkeeping checks


def check_plan_views(plan, ranks: Iterable[int]) -> None:
    """`ops_for_rank(r)` equals filtering `plan.ops`; ids are positions."""
    ops = plan.ops
    for i, op in enumerate(ops):
        assert op.id == i, f"op at position {i} has id {op.id}"
    for r in ranks:
        want = tuple(op for op in ops if r in (op.src_rank, op.dst_rank))
        got = tuple(plan.ops_for_rank(r))
        assert got == want, (f"ops_for_rank({r}) differs from filtering plan.ops: "
                             f"{len(got)} vs {len(want)} ops; first difference "
                             f"{next(((g, w) for g, w in zip(got, want) if g != w), None)}")


def check_stats(plan, report: SimReport | None = None) -> None:
    """stats agree with the op list.

    ops and bytes count every op; `max_send_bytes` / `max_recv_bytes` are the
    busiest rank's NETWORK bytes (a local copy, src_rank == dst_rank, uses no
    link: select.py, DESIGN.md performance model); local + network == bytes.
    """
    ops, stats = plan.ops, plan.stats
    sent, received = per_rank_bytes(ops)
    local = sum(op.bytes for op in ops if op.src_rank == op.dst_rank)
    total = sum(op.bytes for op in ops)
    assert stats["ops"] == len(ops), (stats["ops"], len(ops))
    assert stats["bytes"] == total, (stats["bytes"], total)
    assert stats["max_send_bytes"] == max(sent.values(), default=0), \
        f"max_send_bytes {stats['max_send_bytes']}, network bytes sent per rank {sent}"
    assert stats["max_recv_bytes"] == max(received.values(), default=0), \
        f"max_recv_bytes {stats['max_recv_bytes']}, network bytes received per rank {received}"
    assert stats["local_bytes"] == local, (stats["local_bytes"], local)
    assert stats["network_bytes"] == total - local, (stats["network_bytes"], total - local)
    if "busiest_link_bytes" in stats:  # per rank the larger of network bytes sent and received
        link = max((max(sent.get(r, 0), received.get(r, 0)) for r in set(sent) | set(received)), default=0)
        assert stats["busiest_link_bytes"] == link, (stats["busiest_link_bytes"], link)
        assert stats["relays"] == sum(1 for op in ops if getattr(op, "after", ())), stats["relays"]
    rpn = getattr(plan, "ranks_per_node", None)
    if rpn:
        inter = sum(op.bytes for op in ops if op.src_rank // rpn != op.dst_rank // rpn)
        assert stats["inter_node_bytes"] == inter, (stats["inter_node_bytes"], inter)
        assert stats["intra_node_bytes"] == total - local - inter, (stats["intra_node_bytes"], total - local - inter)
    if report is not None:
        assert report.bytes == total and report.local_bytes == local


def per_rank_bytes(ops) -> tuple[dict[int, int], dict[int, int]]:
    """(network bytes sent per rank, network bytes received per rank); local copies excluded."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for op in ops:
        if op.src_rank != op.dst_rank:
            sent[op.src_rank] += op.bytes
            received[op.dst_rank] += op.bytes
    return dict(sent), dict(received)
