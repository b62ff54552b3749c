"""A rank's refit as steps, made once by the compiler and walked by the runtime.

Every decision about buffers is made here, from the plan and the layouts
alone (plus one flag the ranks agree on: whether some rank passes tensors
that are not contiguous): which destination tensors are assembled in bf16,
which sources are dequantized, which transfers go through a staging buffer,
which carry quantized bytes (layoutlang/compiler/wire.py), and in which round of
point-to-point messages each transfer is posted. The runtime
(layoutlang/runtime/refit.py) executes the steps in order, one handler per kind, and
decides nothing; `layoutlang/compiler/graph.py` counts the staging the same steps
allocate to cut buckets under the budget (both by layoutlang/compiler/staging.py's rule),
and layoutlang/compiler/stepgraph.py draws them as a dependency graph.

Per bucket, in order::

    zero T | assemble T          padding of a plain destination zeroed (never a flat dim's:
                                 `TensorIR.zeroed_padding`); a quantized one that
                                 receives bf16 somewhere (or holds padding) assembled in bf16
    dequantize S                 a quantized source, whole, to bf16 (once per bucket)
    pack K                       a quantized-wire op's block quantized by its sender
    send K / recv K / amax K     round 0: transfers, and amaxes of per-tensor-scale ops
    post 0, copy K ...           local copies run while the network works
    land K ...                   a staged receive copied into its destination view once ITS
                                 message is in, while the round's other messages still fly
    wait 0                       the rest of the round (sends, receives into their views)
    agree T, post 1, wait 1      per-tensor scales: the receiver's amax back to the senders
    pack K, send K / recv K, post 2, wait 2    their quantized blocks
    quantize T | scale T         quantize-once of an assembly, or the agreed per-tensor scale
    unpack K                     a quantized-wire op's bytes into the destination storage

Each step has a one-line text form (`layoutc plan --rank R --steps`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from math import prod

from layoutlang.ir import QUANTIZED, TensorIR

from .graph import buckets
from .plan import Op, Plan
from .staging import recv_staged, send_staged
from .wire import forwards, tensor_scaled, wire_dtype

ROUNDS = 3  # 0: transfers and amaxes; 1: agreed amaxes back; 2: per-tensor-scale blocks
# the kinds that post a point-to-point message: (what it says, whether this rank sends it)
MESSAGES = {"send": ("send", True), "recv": ("recv", False), "amax-send": ("amax", True),
            "amax-recv": ("amax", False), "reply-send": ("reply", True), "reply-recv": ("reply", False)}


@dataclass(frozen=True)
class Step:
    """One thing a rank does. `op`: the transfer it serves; `tensor`: the stored tensor it
    prepares or completes; `staged`: a transfer that goes through a buffer of `bytes`
    (a sender's cast/turn/gather, a receiver's non-contiguous or dtype-changing view);
    `round`: the batch of point-to-point messages a send/recv/amax is posted in (a land: the
    round of the receive it waits for)."""

    kind: str
    bucket: int
    op: Op | None = None
    tensor: str | None = None
    bytes: int = 0
    staged: bool = False
    round: int = 0

    def __str__(self) -> str:
        o = self.op
        if self.kind in ("post", "wait"):
            return f"{self.kind} round {self.round}"
        if self.kind in MESSAGES:
            name, sending = MESSAGES[self.kind]
            # a message goes between the op's two ranks; a reply from its receiver back to its sender
            peer = o.src_rank if self.kind in ("recv", "amax-recv", "reply-send") else o.dst_rank
            return (f"{name} op {o.id} {'->' if sending else '<-'} rank {peer} ({self.bytes} B"
                    f"{' ' + o.wire if o.wire and name in ('send', 'recv') else ''}"
                    f"{', staged' if self.staged else ''}) round {self.round}")
        if o is not None:
            return f"{self.kind} op {o.id} {o.key} ({self.bytes} B{' ' + o.wire if o.wire else ''})"
        return f"{self.kind} {self.tensor}" + (f" ({self.bytes} B)" if self.bytes else "")


def _has_padding(t: TensorIR, rank: int) -> bool:
    return bool(t.zeroed_padding(rank))


def bucket_steps(rank: int, index: int, ops: tuple[Op, ...], completes: tuple[TensorIR, ...],
                 src_of: dict[str, TensorIR], dst_of: dict[str, TensorIR], dtype_of: dict[str, str],
                 strided: bool = False, depth_of: dict[int, int] | None = None, depth: int = 0) -> tuple[Step, ...]:
    """The steps of one bucket on `rank`: `ops` are its ops there (canonical order), `completes`
    the destination tensors it completes there; `src_of`/`dst_of`: the tensors `rank` holds, by
    name; `dtype_of`: each key's destination dtype; `depth_of`: relay depths (plan.relay_depths),
    `depth` the plan's deepest. Round d carries the transfers of relay depth d; the per-tensor
    scale exchange takes rounds depth + 1 and depth + 2: numbers every rank gives the same
    message, and every rank walks them in increasing order, so no round waits on a later one."""
    out: list[Step] = []
    add = lambda kind, **kw: out.append(Step(kind, index, **kw))  # noqa: E731
    plain_into = {op.dst_name for op in ops if op.dst_rank == rank and not op.wire}
    packed_into = {op.dst_name for op in ops if op.dst_rank == rank and op.wire}
    assembled = set()
    for t in completes:
        if t.dtype not in QUANTIZED:
            if _has_padding(t, rank):
                add("zero", tensor=t.name)
        elif t.name in plain_into or t.name not in packed_into or _has_padding(t, rank):
            assembled.add(t.name)
            add("assemble", tensor=t.name, bytes=prod(t.local_shape_at(rank)) * 2)
    seen = set()
    for op in ops:
        if op.src_rank != rank or op.after or op.src_name in seen:
            continue  # (a relay reads this rank's destination copy)
        s = src_of[op.src_name]
        if s.dtype in QUANTIZED and not all(forwards(o, s.dtype, tuple(s.local_shape_at(rank))) for o in ops
                                            if o.src_rank == rank and not o.after and o.src_name == op.src_name):
            seen.add(op.src_name)  # (every op forwarding the source's own blocks: no bf16 copy of it)
            add("dequantize", tensor=op.src_name, bytes=prod(s.local_shape_at(rank)) * 2)
    depth_of = depth_of or {}
    exchange = [op for op in ops if op.wire and tensor_scaled(op.wire) and not op.local]
    scaled_ops = set(op.id for op in exchange)
    by_round: dict[int, list[Op]] = {}
    for op in ops:
        if not op.local and op.id not in scaled_ops:
            by_round.setdefault(depth_of.get(op.id, 0), []).append(op)
    lands: set[int] = set()  # staged bf16 receives: copied into their view after their round
    for op in ops:  # a local quantized-wire block a relay may forward: packed before any round
        if op.local and op.wire and not tensor_scaled(op.wire):
            add("pack", op=op, bytes=op.bytes)
    for d in range(depth + 1):
        if d == 0:
            for op in exchange:
                add("amax-send" if op.src_rank == rank else "amax-recv", op=op, bytes=4)
        for op in by_round.get(d, ()):
            if op.src_rank == rank:
                if op.after:  # a relay forwards this rank's copy: its landed packed bytes, or its view
                    staged = not op.wire and recv_staged(op.src_slice, tuple(dst_of[op.src_name].local_shape_at(rank)),
                                                         dst_of[op.src_name].dtype, strided)
                    add("send", op=op, bytes=op.bytes, staged=staged, round=d)
                elif op.wire:
                    add("pack", op=op, bytes=op.bytes)
                    add("send", op=op, bytes=op.bytes, staged=True, round=d)
                else:
                    s = src_of[op.src_name]
                    add("send", op=op, bytes=op.bytes, round=d, staged=send_staged(
                        op.src_slice, tuple(s.local_shape_at(rank)), s.dtype, wire_dtype(dtype_of[op.key]),
                        op.transpose is not None, strided))
            else:
                d_ = dst_of[op.dst_name]
                staged = bool(op.wire) or recv_staged(op.dst_slice, tuple(d_.local_shape_at(rank)), d_.dtype, strided)
                add("recv", op=op, bytes=op.bytes, round=d, staged=staged)
                if staged and not op.wire:
                    lands.add(op.id)
        if d == 0 or d in by_round:
            add("post", round=d)
            if d == 0:
                for op in ops:
                    if op.local and not op.wire:
                        add("copy", op=op, bytes=op.bytes)
            for op in by_round.get(d, ()):  # each as soon as its own receive is in, while the rest fly
                if op.id in lands:
                    add("land", op=op, bytes=op.bytes, round=d)
            add("wait", round=d)
    scaled = sorted({op.dst_name for op in ops if op.dst_rank == rank and op.wire and tensor_scaled(op.wire)})
    if exchange or scaled:
        for name in scaled:
            add("agree", tensor=name)
        if exchange:
            for op in exchange:
                add("reply-recv" if op.src_rank == rank else "reply-send", op=op, bytes=4, round=depth + 1)
            add("post", round=depth + 1)
            add("wait", round=depth + 1)
            for op in exchange:
                if op.src_rank == rank:
                    add("pack", op=op, bytes=op.bytes)
                    add("send", op=op, bytes=op.bytes, staged=True, round=depth + 2)
                else:
                    add("recv", op=op, bytes=op.bytes, staged=True, round=depth + 2)
            add("post", round=depth + 2)
            add("wait", round=depth + 2)
    for t in completes:
        if t.name in assembled:
            add("quantize", tensor=t.name)
        elif t.name in scaled:
            add("scale", tensor=t.name)
    for op in ops:
        if op.wire and op.dst_rank == rank:
            if op.local and tensor_scaled(op.wire):
                add("pack", op=op, bytes=op.bytes)  # with the agreed amax
            add("unpack", op=op, bytes=op.bytes)
    return tuple(out)



@dataclass(frozen=True)
class Schedule:
    """This rank's share of one bucketing of the plan: per bucket, its ops, the destination
    tensors it completes there, and its steps."""

    buckets: tuple
    ops: tuple[tuple[Op, ...], ...]
    dst: tuple[tuple[TensorIR, ...], ...]
    steps: tuple[tuple[Step, ...], ...]


def schedule(plan: Plan, rank: int, budget_bytes: int | None, strided: bool = False,
             cut: bool | None = None) -> Schedule:
    """The buckets `rank` walks and its steps in each (every rank cuts the same buckets).

    `strided`: this rank's steps stage every transfer (some tensor is not contiguous). `cut`:
    the buckets as cut for that flag (None: `strided`). Cutting with True on every rank and
    building the steps with each rank's own flag is exact as well: a message is one op's bytes,
    contiguous on the wire whether either end stages it, and staging only what a rank's own
    tensors need stays under what the cut counted (layoutlang/runtime/jobgroups.py: the ranks of separate
    jobs learn at their start meeting whether any of them holds a non-contiguous tensor)."""
    bucket_list = buckets(plan, budget_bytes, strided if cut is None else cut)
    stops = [b.stop_op for b in bucket_list]
    ops: list[list[Op]] = [[] for _ in bucket_list]
    mine = plan.ops_for_rank(rank) if rank < plan.world else ()
    for op in mine:
        ops[bisect.bisect_right(stops, op.id)].append(op)
    held = {t.name: t for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)}
    dst: list[list[TensorIR]] = [[] for _ in bucket_list]
    for b in bucket_list:
        for i in range(b.first_instance, b.stop_instance):
            t = plan.stored(i)
            if held.get(t.name) is t and (not dst[b.index] or dst[b.index][-1] is not t):
                dst[b.index].append(t)  # once per stored tensor, however many keys it holds
    src_of = {t.name: t for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
    dtype_of = {e.key: e.dst_dtype for e in plan.tensors}
    depth_of = plan.relay_depths
    depth = max(depth_of.values(), default=0)
    steps = tuple(bucket_steps(rank, b.index, tuple(ops[b.index]), tuple(dst[b.index]), src_of, held, dtype_of,
                               strided, depth_of, depth) for b in bucket_list)
    return Schedule(tuple(bucket_list), tuple(map(tuple, ops)), tuple(map(tuple, dst)), steps)
