"""The buckets that bound staging memory.

Buckets are global: contiguous runs of destination instances in plan order,
closed as soon as adding the next instance would push some rank's staging
past the budget (an instance larger than the budget alone is its own
bucket). The keys of one stored tensor (v2 part keys) never straddle two
buckets: whatever of it is assembled in bf16 is quantized once, whole. Every
rank computes the same buckets, so every rank walks them in the same order
and batched point-to-point exchanges pair up.

Staging a rank needs (what the budget limits), as layoutlang/compiler/steps.py decides
it (layoutlang/compiler/staging.py's rule, which both read): a quantized destination
that receives bf16 somewhere is assembled whole in bf16; a quantized source is dequantized whole to bf16; a transfer whose
slice is not contiguous in local storage, or whose dtype changes on the wire,
goes through a buffer of its own size; a quantized-wire transfer through a
buffer of its bytes on both ends.

A rank's steps as a dependency graph are layoutlang/compiler/stepgraph.py's `rank_graph`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from layoutlang.ir import QUANTIZED
from layoutlang.modes import Run

from .plan import Plan, Transfer
from .staging import contiguous, recv_staged, send_staged
from .wire import wire_dtype


@dataclass(frozen=True)
class Bucket:
    index: int
    first_instance: int  # range of Plan.matches
    stop_instance: int
    first_op: int        # range of op ids
    stop_op: int


def _op_staging(plan: Plan, t: Transfer, strided: bool = False) -> tuple[int, int]:
    """(sender bytes, receiver bytes) of staging for one transfer: the buffers its steps
    allocate (layoutlang/compiler/steps.py decides which transfers are staged; this counts them).

    `strided`: some rank passes tensors that are not contiguous. A quantized-wire
    transfer (`t.wire`) is packed by its sender into a buffer of its bytes (after
    turning its block into bf16 when the source is not already that) and lands in one
    on the receiver (a local one: one buffer).
    """
    m, dst = plan.key_matches[t.instance], plan.stored(t.instance)
    if t.after:  # a relay forwards the sender's copy: its landed packed buffer, or its destination view
        if t.wire:
            return 0, t.bytes
        send = t.bytes if recv_staged(t.source.src_slice, tuple(dst.local_shape_at(t.sender)), dst.dtype,
                                      strided) else 0  # (what it reads: a copy relay's is another slot)
        return send, t.bytes if recv_staged(t.piece.dst_slice, tuple(dst.local_shape_at(t.dst_rank)),
                                            dst.dtype, strided) else 0
    src_inst = m.src[t.source.instance]
    src_region = m.src_region(t.source.instance)
    turned = (m.region is not None and m.region.transposed) != (src_region is not None and src_region.transposed)
    src_local = tuple(src_inst.local_shape_at(t.sender))
    if t.wire:
        as_is = not turned and src_inst.dtype == "bf16" and contiguous(t.source.src_slice, src_local)
        block = 0 if as_is else t.piece.elements * 2  # the bf16 block it quantizes
        return (t.bytes + block, 0) if t.sender == t.dst_rank else (t.bytes + block, t.bytes)
    if t.sender == t.dst_rank:
        return 0, 0  # a local copy casts in place of its destination view
    send = t.bytes if send_staged(t.source.src_slice, src_local, src_inst.dtype, wire_dtype(dst.dtype), turned,
                                  strided) else 0
    recv = t.bytes if recv_staged(t.piece.dst_slice, tuple(dst.local_shape_at(t.dst_rank)), dst.dtype,
                                  strided) else 0
    return send, recv


def _assembled(plan: Plan, i: int) -> set[int]:
    """The ranks that assemble destination instance i's stored tensor in bf16 (it is quantized):
    those receiving any bf16-path op of any of its keys, or holding padding (quantized-wire ops
    alone land in the quantized storage directly)."""
    dst, n = plan.stored(i), len(plan.key_matches)
    j = i
    while j < n and plan.stored(j) is dst:
        j += 1
    packed, plain = set(), set()
    for k in range(i, j):
        for t in plan.transfers(instance=k):
            (packed if t.wire else plain).add(t.dst_rank)
    out = set(plain)
    for r in packed - plain:
        if any(not isinstance(run, Run) for runs in dst.runs(r) for run in runs):
            out.add(r)
    return out


def instance_staging(plan: Plan, i: int, strided: bool = False) -> dict[int, int]:
    """Staging bytes per rank that destination instance i needs while it moves."""
    m, dst = plan.key_matches[i], plan.stored(i)
    out: dict[int, int] = {}
    transfers = list(plan.transfers(instance=i))
    first_key = i == 0 or plan.stored(i - 1) is not dst  # keys of one stored tensor share it
    if dst.dtype in QUANTIZED and first_key:
        for r in _assembled(plan, i):
            out[r] = out.get(r, 0) + prod(dst.local_shape_at(r)) * 2
    dequantized: set[tuple[int, int]] = set()
    for t in transfers:
        send, recv = _op_staging(plan, t, strided)
        src = None if t.after else m.src[t.source.instance]  # a relay sends from its destination
        if src is not None and src.dtype in QUANTIZED and (t.sender, id(src)) not in dequantized:
            dequantized.add((t.sender, id(src)))
            send += prod(src.local_shape_at(t.sender)) * 2
        if send:
            out[t.sender] = out.get(t.sender, 0) + send
        if recv:
            out[t.dst_rank] = out.get(t.dst_rank, 0) + recv
    return out


def buckets(plan: Plan, budget_bytes: int | None, strided: bool = False) -> tuple[Bucket, ...]:
    """Split the plan into buckets whose staging stays under the budget on every rank.

    The keys of one stored destination tensor (q | k | v of a packed `qkv_proj`, consecutive
    instances) never straddle a cut (a quantized one is quantized once, whole): a cut is judged
    at the tensor's first key on the staging of all of its keys, so a bucket exceeds the budget
    only where one tensor alone does. `strided=True` plans for tensors of any strides (every
    transfer staged); the runtime uses it when the ranks agree that some tensor is not contiguous.
    """
    n = len(plan.key_matches)
    if budget_bytes is None:
        return (Bucket(0, 0, n, 0, plan.op_count),) if n else ()
    out: list[Bucket] = []
    start, used, i = 0, {}, 0
    while i < n:
        stop = i + 1
        while stop < n and plan.stored(stop) is plan.stored(i):
            stop += 1
        need: dict[int, int] = {}
        for k in range(i, stop):
            for r, b in instance_staging(plan, k, strided).items():
                need[r] = need.get(r, 0) + b
        if i > start and not all(used.get(r, 0) + b <= budget_bytes for r, b in need.items()):
            out.append(Bucket(len(out), start, i, plan.op_range(start).start, plan.op_range(i).start))
            start, used = i, {}
        for r, b in need.items():
            used[r] = used.get(r, 0) + b
        i = stop
    if n > start:
        out.append(Bucket(len(out), start, n, plan.op_range(start).start, plan.op_count))
    return tuple(out)


def staging_per_bucket(plan: Plan, bucket: Bucket, strided: bool = False) -> dict[int, int]:
    used: dict[int, int] = {}
    for i in range(bucket.first_instance, bucket.stop_instance):
        for r, b in instance_staging(plan, i, strided).items():
            used[r] = used.get(r, 0) + b
    return used
