"""Per-rank execution graphs and the buckets that bound staging memory.

Buckets are global: contiguous runs of destination instances in plan order,
closed as soon as adding the next instance would push some rank's staging
past the budget (an instance larger than the budget alone is its own
bucket). The keys of one stored tensor (v2 part keys) never straddle two
buckets: it is assembled and quantized once, whole. Every rank computes the same buckets, so every rank walks them in
the same order and batched point-to-point exchanges pair up.

A rank's graph (networkx.DiGraph), per bucket::

    dequantize(src) -> send(op) / copy(op)
    recv(op) / copy(op) -> assemble(dst) [-> quantize(dst)] -> done(dst)
    ... every node of bucket k -> barrier(k) -> the roots of bucket k+1

Staging a rank needs (what the budget limits): a quantized destination is
assembled whole in bf16; a quantized source is dequantized whole to bf16; a
slice that is not contiguous in local storage, or whose dtype changes on the
wire, goes through a buffer of its own size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from math import prod

import networkx as nx

from layoutlang.ir import QUANTIZED

from .plan import Op, Plan, Transfer, wire_dtype


def contiguous(sl: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    """Is this slice one contiguous block of a row-major tensor of `shape`? (A strided dim,
    compiler/strides.py, never is.)"""
    k = 0
    while k < len(sl) and sl[k][1] - sl[k][0] == 1:
        k += 1  # leading dims of extent one
    return (k == len(sl) or len(sl[k]) == 2) and all(sl[i] == (0, shape[i]) for i in range(k + 1, len(sl)))


@dataclass(frozen=True)
class Bucket:
    index: int
    first_instance: int  # range of Plan.matches
    stop_instance: int
    first_op: int        # range of op ids
    stop_op: int


def _op_staging(plan: Plan, t: Transfer, strided: bool = False) -> tuple[int, int]:
    """(sender bytes, receiver bytes) of staging for one transfer.

    `strided`: some rank passes tensors that are not contiguous, so any
    transfer may have to go through a buffer of its own size on both ends.
    """
    if t.sender == t.dst_rank:
        return 0, 0  # a local copy casts in place of its destination view
    m = plan.matches[t.instance]
    src_inst = m.src[t.source.instance]
    src_region = m.src_region(t.source.instance)
    turned = (m.region is not None and m.region.transposed) != (src_region is not None and src_region.transposed)
    send = 0 if (not strided and not turned and contiguous(t.source.src_slice, src_inst.local_shape_at(t.sender))
                 and src_inst.dtype == wire_dtype(m.dst.dtype)) else t.bytes
    recv = 0 if (not strided and m.dst.dtype not in QUANTIZED
                 and contiguous(t.piece.dst_slice, m.dst.local_shape_at(t.dst_rank))) else t.bytes
    if m.dst.dtype in QUANTIZED:
        recv = 0  # lands in the whole-tensor bf16 assembly buffer, counted per instance
    return send, recv


def instance_staging(plan: Plan, i: int, strided: bool = False) -> dict[int, int]:
    """Staging bytes per rank that destination instance i needs while it moves."""
    m = plan.matches[i]
    out: dict[int, int] = {}
    transfers = list(plan.transfers(instance=i))
    first_key = i == 0 or plan.matches[i - 1].dst is not m.dst  # keys of one stored tensor share it
    if m.dst.dtype in QUANTIZED and first_key:
        for r in {t.dst_rank for t in transfers}:
            out[r] = out.get(r, 0) + prod(m.dst.local_shape_at(r)) * 2
    dequantized: set[tuple[int, int]] = set()
    for t in transfers:
        send, recv = _op_staging(plan, t, strided)
        src = m.src[t.source.instance]
        if src.dtype in QUANTIZED and (t.sender, id(src)) not in dequantized:
            dequantized.add((t.sender, id(src)))
            send += prod(src.local_shape_at(t.sender)) * 2
        if send:
            out[t.sender] = out.get(t.sender, 0) + send
        if recv:
            out[t.dst_rank] = out.get(t.dst_rank, 0) + recv
    return out


def buckets(plan: Plan, budget_bytes: int | None, strided: bool = False) -> tuple[Bucket, ...]:
    """Split the plan into buckets whose staging stays under the budget on every rank.

    `strided=True` plans for tensors of any strides (every transfer staged);
    the runtime uses it when the ranks agree that some tensor is not contiguous.
    """
    n = len(plan.matches)
    if budget_bytes is None:
        return (Bucket(0, 0, n, 0, plan.op_count),) if n else ()
    out: list[Bucket] = []
    start, used = 0, {}
    for i in range(n):
        need = instance_staging(plan, i, strided)
        fits = all(used.get(r, 0) + b <= budget_bytes for r, b in need.items())
        same_tensor = i > 0 and plan.matches[i - 1].dst is plan.matches[i].dst  # quantized once, whole
        if not fits and i > start and not same_tensor:
            out.append(Bucket(len(out), start, i, plan.op_range(start).start, plan.op_range(i).start))
            start, used = i, {}
        for r, b in need.items():
            used[r] = used.get(r, 0) + b
    if n > start:
        out.append(Bucket(len(out), start, n, plan.op_range(start).start, plan.op_count))
    return tuple(out)


def staging_per_bucket(plan: Plan, bucket: Bucket, strided: bool = False) -> dict[int, int]:
    used: dict[int, int] = {}
    for i in range(bucket.first_instance, bucket.stop_instance):
        for r, b in instance_staging(plan, i, strided).items():
            used[r] = used.get(r, 0) + b
    return used


def rank_graph(plan: Plan, rank: int, budget_bytes: int | None = None) -> nx.DiGraph:
    """The steps `rank` executes, as a DAG (checked), with a `bucket` on every node."""
    g = nx.DiGraph()
    ops = plan.ops_for_rank(rank)
    bucket_list = buckets(plan, budget_bytes)
    stops = [b.stop_op for b in bucket_list]
    entry = {e.key: e for e in plan.tensors}

    def bucket_of(op: Op) -> int:
        return bisect.bisect_right(stops, op.id)

    prev_barrier = None
    by_bucket: dict[int, list[Op]] = {}
    for op in ops:
        by_bucket.setdefault(bucket_of(op), []).append(op)
    held: dict[int, list] = {}  # instances this rank holds, even those that receive nothing
    for b in bucket_list:
        for i in range(b.first_instance, b.stop_instance):
            if plan.matches[i].dst.holds(rank):
                held.setdefault(b.index, []).append(plan.matches[i].dst)
    for b in range(len(bucket_list)):
        nodes = []
        for t in held.get(b, []):  # padding-only tensors are still zeroed (assembled)
            e = entry[t.key]
            asm, done = ("assemble", t.name), ("done", t.name)
            g.add_node(asm, bucket=b, key=t.key)
            g.add_node(done, bucket=b)
            if e.dst_dtype in QUANTIZED:
                q = ("quantize", t.name)
                g.add_node(q, bucket=b)
                g.add_edge(asm, q)
                g.add_edge(q, done)
            else:
                g.add_edge(asm, done)
            nodes.extend([asm, done])
        for op in by_bucket.get(b, []):
            e = entry[op.key]
            if op.src_rank == rank:
                step = ("copy", op.id) if op.local else ("send", op.id)
                g.add_node(step, bucket=b, op=op)
                nodes.append(step)
                if e.src_dtype in QUANTIZED:
                    deq = ("dequantize", op.src_name, b)
                    g.add_node(deq, bucket=b)
                    g.add_edge(deq, step)
                    nodes.append(deq)
            if op.dst_rank == rank:
                step = ("copy", op.id) if op.local else ("recv", op.id)
                g.add_node(step, bucket=b, op=op)
                nodes.append(step)
                g.add_edge(step, ("assemble", op.dst_name))
        barrier = ("barrier", b)
        g.add_node(barrier, bucket=b)
        for n_ in nodes:
            if prev_barrier is not None and g.in_degree(n_) == 0:
                g.add_edge(prev_barrier, n_)
            if g.out_degree(n_) == 0:
                g.add_edge(n_, barrier)
        if prev_barrier is not None and not nodes:
            g.add_edge(prev_barrier, barrier)
        prev_barrier = barrier
    if not nx.is_directed_acyclic_graph(g):
        raise AssertionError(f"rank {rank}'s graph has a cycle")
    return g
