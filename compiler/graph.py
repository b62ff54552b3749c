"""The buckets that bound staging memory, and a rank's steps as a dependency graph.

Buckets are global: contiguous runs of destination instances in plan order,
closed as soon as adding the next instance would push some rank's staging
past the budget (an instance larger than the budget alone is its own
bucket). The keys of one stored tensor (v2 part keys) never straddle two
buckets: whatever of it is assembled in bf16 is quantized once, whole. Every
rank computes the same buckets, so every rank walks them in the same order
and batched point-to-point exchanges pair up.

Staging a rank needs (what the budget limits), as compiler/steps.py decides
it: a quantized destination that receives bf16 somewhere is assembled whole
in bf16; a quantized source is dequantized whole to bf16; a transfer whose
slice is not contiguous in local storage, or whose dtype changes on the wire,
goes through a buffer of its own size; a quantized-wire transfer through a
buffer of its bytes on both ends.

`rank_graph` is a rank's steps as a networkx DiGraph (data edges, a barrier
per bucket), checked acyclic: what `layoutc plan --rank R --steps` lists in
order and the runtime walks.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import networkx as nx

from layoutlang.ir import QUANTIZED
from layoutlang.modes import Run

from .plan import Plan, Transfer
from .steps import contiguous, recv_staged, send_staged
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
    allocate (compiler/steps.py decides which transfers are staged; this counts them).

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

    `strided=True` plans for tensors of any strides (every transfer staged);
    the runtime uses it when the ranks agree that some tensor is not contiguous.
    """
    n = len(plan.key_matches)
    if budget_bytes is None:
        return (Bucket(0, 0, n, 0, plan.op_count),) if n else ()
    out: list[Bucket] = []
    start, used = 0, {}
    for i in range(n):
        need = instance_staging(plan, i, strided)
        fits = all(used.get(r, 0) + b <= budget_bytes for r, b in need.items())
        same_tensor = i > 0 and plan.stored(i - 1) is plan.stored(i)  # quantized once, whole
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


def rank_graph(plan: Plan, rank: int, budget_bytes: int | None = None, strided: bool = False,
               overlap: bool = False) -> nx.DiGraph:
    """The steps `rank` executes (compiler/steps.py, what the runtime walks) as a DAG (checked).

    Nodes are (bucket, position) with the `step` and its `kind`, plus ("done", bucket, T) for
    every tensor completed and ("barrier", bucket). Edges are data: a round's messages ->
    its post -> its wait -> what reads them (agree, the next round, unpack), and a staged
    receive's post -> its land (which waits for that message alone); an
    assembly -> what writes into it -> its quantize -> the packed blocks unpacked over it;
    dequantize / pack -> the sends and copies that read them; every sink of bucket k ->
    barrier k -> bucket k+1's first steps. With `overlap` (buckets cut at half the budget,
    as `Refitter(overlap=True)` walks them) bucket k+1's first steps follow barrier k-1 (its
    staging is released) and, those before bucket k+1's first post, bucket k's first post:
    they are staged while bucket k's messages fly.
    """
    from .steps import MESSAGES, schedule

    g = nx.DiGraph()
    if overlap and budget_bytes is not None:
        budget_bytes = max(1, budget_bytes // 2)
    sched = schedule(plan, rank, budget_bytes, strided)
    prev_barrier = None
    barriers: list[tuple] = []
    first_posts: list[tuple | None] = []
    for b, steps in enumerate(sched.steps):
        nodes = []
        last: dict[tuple, tuple] = {}   # what a later step reads: ("post", r), ("wait", r), ("tensor", T), ...
        writes: dict[str, list] = {}    # destination tensor -> steps writing it
        for i, st in enumerate(steps):
            n = (b, i)
            g.add_node(n, step=st, kind=st.kind, bucket=b)
            nodes.append(n)
            o = st.op

            def dep(key):
                if key in last:
                    g.add_edge(last[key], n)

            if st.kind in ("assemble", "zero", "dequantize"):
                last[("tensor", st.tensor)] = n
            elif st.kind == "pack":
                dep(("tensor", o.src_name))
                dep(("agree", o.dst_name))
                last[("pack", o.id)] = n
                if o.local:
                    last[("landed", o.id)] = n
            elif st.kind in MESSAGES:
                dep(("pack", o.id) if st.kind == "send" else ("tensor", o.src_name if MESSAGES[st.kind][1] else
                                                             o.dst_name))
                if st.kind == "reply-send":
                    dep(("agree", o.dst_name))
                if st.kind == "send" and o.after:  # a relay forwards what the op it waits for delivered
                    dep(("landed", o.after[0]))
                last.setdefault(("round", st.round), [])
                last[("round", st.round)].append(n)
                last[("op", o.id)] = n
            elif st.kind == "post":
                for m in last.get(("round", st.round), []):
                    g.add_edge(m, n)
                last[("post", st.round)] = n
            elif st.kind == "wait":
                dep(("post", st.round))
                last[("wait", st.round)] = n
                for m in last.get(("round", st.round), []):
                    if g.nodes[m]["kind"] == "recv":  # (a staged one landed already: its land step)
                        last.setdefault(("landed", g.nodes[m]["step"].op.id), n)
            elif st.kind == "copy":
                dep(("tensor", o.src_name))
                dep(("tensor", o.dst_name))
                writes.setdefault(o.dst_name, []).append(n)
                last[("landed", o.id)] = n
            elif st.kind == "land":  # its own receive, once its round is posted (not the whole round)
                dep(("op", o.id))
                dep(("post", st.round))
                writes.setdefault(o.dst_name, []).append(n)
                last[("landed", o.id)] = n
            elif st.kind == "agree":
                dep(("wait", 0))
                for w in writes.get(st.tensor, []):
                    g.add_edge(w, n)
                last[("agree", st.tensor)] = n
            elif st.kind in ("quantize", "scale"):
                for key in (("wait", 0), ("wait", 2), ("agree", st.tensor), ("tensor", st.tensor)):
                    dep(key)
                for w in writes.get(st.tensor, []):
                    g.add_edge(w, n)
                last[("tensor", st.tensor)] = n
                writes[st.tensor] = [n]
            elif st.kind == "unpack":
                for key in (("wait", 0), ("wait", 2), ("pack", o.id), ("tensor", o.dst_name)):
                    dep(key)
                writes.setdefault(o.dst_name, []).append(n)
        for t in sched.dst[b]:
            done = ("done", b, t.name)
            g.add_node(done, kind="done", bucket=b)
            for w in writes.get(t.name, []):
                g.add_edge(w, done)
            if ("tensor", t.name) in last:
                g.add_edge(last[("tensor", t.name)], done)
            nodes.append(done)
        barrier = ("barrier", b)
        g.add_node(barrier, kind="barrier", bucket=b)
        posts = [i for i, st in enumerate(steps) if st.kind == "post"]
        first_posts.append((b, posts[0]) if posts else None)
        if overlap:  # (the runtime's `_stage_ahead`; a relay send waits for its round anyway)
            prev_barrier = barriers[-2] if len(barriers) >= 2 else None
        for n_ in nodes:
            if g.in_degree(n_) == 0:
                if prev_barrier is not None:
                    g.add_edge(prev_barrier, n_)
                if overlap and b and first_posts[b - 1] and posts and n_[0] == b and n_[1] < posts[0]:
                    g.add_edge(first_posts[b - 1], n_)
            if g.out_degree(n_) == 0:
                g.add_edge(n_, barrier)
        if prev_barrier is not None and not nodes:
            g.add_edge(prev_barrier, barrier)
        barriers.append(barrier)
        prev_barrier = barrier
    if not nx.is_directed_acyclic_graph(g):
        raise AssertionError(f"rank {rank}'s graph has a cycle")
    return g
