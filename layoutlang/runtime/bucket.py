"""One bucket of a refit while its steps run (`BucketRun`): the handler of each step kind.

The Refitter (layoutlang/runtime/refit.py) decides nothing here either: it hands a bucket's ops and
the steps layoutlang/compiler/steps.py made for this rank, and `BucketRun.do` runs each step against
the bucket's buffers (assemblies, staged sends and receives, packed quantized blocks,
agreed amaxes). layoutlang/runtime/loopback.py runs the same handlers with copies for messages.
"""

from __future__ import annotations

import time

import torch

from layoutlang.compiler.steps import Step
from layoutlang.compiler.wire import forwards
from layoutlang.ir import QUANTIZED, TensorIR

from .quant import dequantize, quantize_into
from .staging import StagingArena
from .views import aligned, turned
from .views import view as _view
from .wire import forwarded, pack, unpack_into, write_tensor_scale
from .wire import wire_bytes as packed_bytes

WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class BucketRun:
    """The state of one bucket while its steps run: buffers by op, assemblies, dequantized
    sources, the point-to-point messages of each round, agreed amaxes."""

    def __init__(self, refitter, ops, src, dst, device, arena: StagingArena | None = None):
        self.r, self.src, self.dst, self.device = refitter, src, dst, device
        self.arena = arena
        self.me = refitter.rank
        self.assembly: dict[str, torch.Tensor] = {}
        self.dequantized: dict[str, torch.Tensor] = {}
        self.bufs: dict[int, torch.Tensor] = {}            # op id -> its send, receive or packed buffer
        self.landing: dict[int, torch.Tensor] = {}         # op id -> destination view of a staged receive
        self.rounds: dict[int, list] = {}                  # round -> [(P2POp, op)]
        self.works: dict[int, list] = {}
        self.amax: dict[int, torch.Tensor] = {}            # op id -> an amax received (block's or agreed)
        self.agreed: dict[str, torch.Tensor] = {}          # destination name -> its tensor's agreed amax
        self.into: dict[str, list] = {}                    # destination name -> quantized-wire ops into it
        self.allocated = 0                                 # staging bytes this bucket allocated
        self.record = refitter.recording                   # a steady step's actions (layoutlang/runtime/replay.py)
        self.posted: dict[int, int] = {}                   # round -> its post's index in the record
        self.deadline: dict[int, float] = {}               # round -> when its messages are late
        self.waited: dict[int, set] = {}                   # round -> its works waited for already
        self.slot: dict[int, int] = {}                     # op id -> a staged receive's index in its round
        for op in ops:
            if op.wire and op.dst_rank == self.me:
                self.into.setdefault(op.dst_name, []).append(op)

    def do(self, step: Step) -> None:
        getattr(self, "_" + step.kind.replace("-", "_"))(step)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized staging buffer: from the kept arena, or fresh."""
        if self.arena is not None:
            return self.arena.empty(shape, dtype, self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def alloc(self, t: torch.Tensor) -> torch.Tensor:
        """A staging buffer of this bucket (counted by the Refitter's meter until released)."""
        self.allocated += t.numel() * t.element_size()
        return self.r.meter.alloc(t)

    # ---- views ---------------------------------------------------------------------
    def source_view(self, op) -> torch.Tensor:
        """The source block, in the RECEIVER's element order (a transposed key is turned here); a
        relay's: this rank's destination copy (a quantized one: its bf16 assembly). Always a view
        of that storage, never a copy (a steady step's record holds it: layoutlang/runtime/replay.py), in
        its view's shape: a blocked dim is a (count, block) pair, stacked dims are there."""
        if op.after:
            base = self.assembly.get(op.src_name)
            return _view(base if base is not None else self.dst[op.src_name], op.src_slice)
        value = self.dequantized.get(op.src_name)
        if value is None:
            value = self.src[op.src_name]
        block = _view(value, op.src_slice)  # strided slices too (layoutlang/runtime/views.py)
        return block if op.transpose is None else turned(block, op.transpose)

    def block_of(self, op) -> torch.Tensor:
        """What a quantized-wire op quantizes: the bf16 values the receiver would assemble."""
        return self.source_view(op).to(torch.bfloat16).reshape([b - a for a, b in op.dst_slice])

    def dst_view(self, op) -> torch.Tensor:
        base = self.assembly.get(op.dst_name)
        return _view(base if base is not None else self.dst[op.dst_name], op.dst_slice)

    def packed(self, op) -> torch.Tensor:
        held = self.r.src_held.get(op.src_name) if not op.after else None
        if held is not None and forwards(op, held.dtype, tuple(held.local_shape_at(self.me))):
            return self.alloc(forwarded(self.src[op.src_name], op.wire, op.src_slice, tuple(held.local_shape_at(self.me))))
        amax = self.amax[op.id].reshape(()) if op.id in self.amax else self.agreed.get(op.dst_name)
        return self.alloc(pack(self.block_of(op), op.wire, amax))

    def local_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.r.dst_held[name].local_shape_at(self.me))

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Every copy of the plain path goes through here (a steady step records it). `source`
        holds the target's elements in row-major order, in any shape: both are viewed in one
        shape (`views.aligned`), so that a record refers to the two storages, never to a
        reshaped copy of the source made when it was recorded (its values would be replayed)."""
        pair = aligned(target, source)
        if pair is None:  # no common view: the source is reshaped (copied) at every step, replays too
            target.copy_(source.reshape(target.shape))
            if self.record is not None:
                self.record.append(("reshape", target, source))
            return
        target, source = pair
        target.copy_(source)
        if self.record is not None:
            self.record.append(("copy", target, source))

    def _message(self, step: Step, buf: torch.Tensor, sending: bool) -> None:
        """Queue a message of the step's round: to/from the op's other end (a reply goes back
        from the op's receiver to its sender)."""
        op, r = step.op, self.r
        peer = op.src_rank if op.dst_rank == self.me else op.dst_rank
        self.rounds.setdefault(step.round, []).append((r.transport.message(sending, buf, peer), op))

    # ---- preparing ---------------------------------------------------------------
    def _zero(self, step: Step) -> None:
        for pad in padding(self.dst[step.tensor], self.r.dst_held[step.tensor], self.me):
            pad.zero_()
            if self.record is not None:
                self.record.append(("zero", pad, None))

    def _assemble(self, step: Step) -> None:
        self.assembly[step.tensor] = self.alloc(self.empty(self.local_shape(step.tensor), torch.bfloat16).zero_())

    def _dequantize(self, step: Step) -> None:
        held = self.r.src_held[step.tensor]
        self.dequantized[step.tensor] = self.alloc(dequantize(self.src[step.tensor], held.dtype))

    def _pack(self, step: Step) -> None:
        self.bufs[step.op.id] = self.packed(step.op)

    # ---- transfers ---------------------------------------------------------------
    def _send(self, step: Step) -> None:
        op, r = step.op, self.r
        if op.wire and op.after:  # a relay forwards the packed bytes it received (or packed locally)
            buf = self.bufs[op.after[0]]
        elif op.wire:
            buf = self.bufs.pop(op.id)
        else:
            view = self.source_view(op)
            wire = wire_dtype(r.entry[op.key])
            if step.staged:
                buf = self.alloc(self.empty(view.shape, wire))
                self.copy(buf, view)
            else:
                buf = view
        self._message(step, r.hooks.on_send(buf, op), True)
        r.sent_bytes += op.bytes

    def _recv(self, step: Step) -> None:
        op, r = step.op, self.r
        if op.wire:
            buf = self.bufs[op.id] = self.alloc(self.empty(
                (packed_bytes(op.wire, op.dst_slice, self.local_shape(op.dst_name)),), torch.uint8))
        else:
            view = self.dst_view(op)
            if step.staged:
                buf = self.bufs[op.id] = self.alloc(self.empty(view.shape, wire_dtype(r.entry[op.key])))
                self.landing[op.id] = view
                self.slot[op.id] = len(self.rounds.get(step.round, ()))  # (its land waits for it alone)
            else:
                buf = view
        self._message(step, buf, False)
        r.received_bytes += op.bytes

    def _amax_send(self, step: Step) -> None:
        amax = self.alloc(self.block_of(step.op).to(torch.float32).abs().amax().reshape(1))
        self._message(step, amax, True)

    def _amax_recv(self, step: Step) -> None:
        self.amax[step.op.id] = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._message(step, self.amax[step.op.id], False)

    def _reply_send(self, step: Step) -> None:
        self._message(step, self.agreed[step.op.dst_name].reshape(1).clone(), True)

    def _reply_recv(self, step: Step) -> None:
        self.amax[step.op.id] = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._message(step, self.amax[step.op.id], False)

    def _post(self, step: Step) -> None:
        messages = [p for p, _ in self.rounds.get(step.round, [])]
        what = "transfers" if step.round == 0 else f"round {step.round} messages"
        self.works[step.round] = self.r.transport.post(messages, what)
        self.deadline[step.round] = time.monotonic() + self.r.timeout.total_seconds()
        if self.record is not None:
            self.posted[step.round] = len(self.record)
            calls = self.r.transport.resolved(messages) if messages else None
            self.record.append(("post", len(self.record), (messages, what, calls)))

    def _await(self, round_: int, which: list[int]) -> None:
        """Wait for these works of a round (indices into its messages; a backend that grouped the
        round, as NCCL does, has one work for all of them) under the round's one deadline."""
        works, entries = self.works.get(round_, []), self.rounds.get(round_, [])
        if len(works) != len(entries):
            which = list(range(len(works)))  # one grouped work: it is every message's
        done = self.waited.setdefault(round_, set())
        which = [i for i in which if i not in done]
        if not which:
            return
        done.update(which)
        # (a grouped round's one work names its first message's op, as before)
        ops = [entries[i][1] for i in which]
        deadline = self.deadline[round_]
        if self.record is not None:
            self.record.append(("wait", self.posted[round_], (which, ops, "transfer")))
        self.r.transport.wait([works[i] for i in which], ops, "transfer", deadline)

    def _wait(self, step: Step) -> None:
        self._await(step.round, list(range(len(self.rounds.get(step.round, ())))))
        for table in (self.works, self.rounds, self.posted, self.deadline, self.waited):
            table.pop(step.round, None)

    # ---- completing ----------------------------------------------------------------
    def _copy(self, step: Step) -> None:
        op = step.op
        view = self.dst_view(op)
        # a stacked side's block carries its extent-1 expert dim, a blocked dim its (count, block)
        # pair, a turned one its permuted dims: same elements, same order (`copy` views them alike)
        self.copy(view, self.source_view(op))
        self.r.local_bytes += op.bytes

    def _land(self, step: Step) -> None:
        """A staged receive into its view, as soon as its own message is in."""
        self._await(step.round, [self.slot.pop(step.op.id)])
        self.copy(self.landing.pop(step.op.id), self.bufs.pop(step.op.id))

    def _agree(self, step: Step) -> None:
        """The destination tensor's amax: its senders' blocks, its local blocks, its bf16 assembly."""
        found = []
        for op in self.into.get(step.tensor, ()):
            if op.local:
                found.append(self.block_of(op).to(torch.float32).abs().amax())
            else:
                found.append(self.amax.pop(op.id).reshape(()))
        if step.tensor in self.assembly:
            found.append(self.assembly[step.tensor].to(torch.float32).abs().amax())
        self.agreed[step.tensor] = torch.stack(found).amax() if found else torch.zeros((), device=self.device)

    def _quantize(self, step: Step) -> None:
        t = self.r.dst_held[step.tensor]
        quantize_into(self.assembly[t.name], self.dst[t.name], t.dtype, self.agreed.get(t.name))

    def _scale(self, step: Step) -> None:
        t = self.r.dst_held[step.tensor]
        write_tensor_scale(self.dst[t.name], t.dtype, self.agreed[t.name])

    def _unpack(self, step: Step) -> None:
        op = step.op
        unpack_into(self.bufs.pop(op.id), self.dst[op.dst_name], op.wire, op.dst_slice, self.local_shape(op.dst_name))
        if op.local:
            self.r.local_bytes += op.bytes


def wire_dtype(entry) -> torch.dtype:
    return WIRE["bf16" if entry.dst_dtype in QUANTIZED else entry.dst_dtype]


def padding(tensor: torch.Tensor, t: TensorIR, rank: int) -> list[torch.Tensor]:
    """Views of the tensor's padding on this rank that a refit zeroes (every step; never a flat
    dim's: `TensorIR.zeroed_padding`)."""
    return [tensor.narrow(d, r.local_start, r.length) for d, r in t.zeroed_padding(rank)]
