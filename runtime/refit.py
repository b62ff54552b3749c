"""Execute a compiled plan on torch.distributed: the refit step.

`Refitter` makes no planning decisions: it walks the compiler's buckets in
order and, per bucket, posts this rank's sends and receives as one
`batch_isend_irecv` (deadlock-free on gloo and NCCL: every rank posts its
ops in canonical op order), does local copies without the network, then
assembles, zeroes padding and quantizes. Before a byte moves, every rank
checks (with tensor collectives only) that all ranks hold the same plan and
that every local tensor has the layout's shape and dtype.
"""

from __future__ import annotations

import bisect
import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta
from math import prod

import torch
import torch.distributed as dist

from layoutlang.compiler import Plan
from layoutlang.compiler.graph import buckets, contiguous
from layoutlang.ir import QUANTIZED, TensorIR
from layoutlang.modes import PadRun

from .quant import FP8_DTYPES, MX_BLOCK, PLAIN_DTYPES, as_quantized, dequantize, quantize_into

MESSAGE_BYTES = 1024  # an error message travels as a fixed-size uint8 tensor
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class RefitError(RuntimeError):
    """A refit that cannot start or did not complete; the message says where."""


@dataclass
class StagingMeter:
    """Accounts every staging buffer a refit allocates (DESIGN.md invariant 5)."""

    current: int = 0
    peak: int = 0
    per_bucket_peak: list[int] = field(default_factory=list)

    def alloc(self, t: torch.Tensor) -> torch.Tensor:
        self.current += t.numel() * t.element_size()
        self.peak = max(self.peak, self.current)
        return t

    def reset_bucket(self) -> None:
        self.per_bucket_peak.append(self.current)
        self.current = 0


def _slices(sl) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted float64 sum: detects changed, lost and swapped elements."""
    flat = t.reshape(-1).to(torch.float64)
    weights = (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 251) + 1.0
    return (flat * weights).sum().reshape(1)


class Refitter:
    """Moves weights from the source layout's tensors into the destination's, every step.

    ``Refitter(plan).refit(src_tensors, dst_tensors)`` on every rank of the group
    (ranks that hold neither model pass ``None, None``). Destination tensors are
    updated in place.
    """

    def __init__(self, plan: Plan, *, group=None, device=None, budget_bytes: int | None = None,
                 timeout: timedelta = timedelta(seconds=60), verify: bool = False):
        self.plan = plan
        self.group = group
        self.device = device
        self.budget_bytes = budget_bytes
        self.timeout = timeout
        self.verify = verify
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world < plan.world:
            raise RefitError(f"the plan spans {plan.world} ranks but the process group has {self.world}")
        self.ops = plan.ops_for_rank(self.rank) if self.rank < plan.world else ()
        self.buckets = buckets(plan, budget_bytes)
        stops = [b.stop_op for b in self.buckets]
        self.ops_by_bucket: list[list] = [[] for _ in self.buckets]
        for op in self.ops:
            self.ops_by_bucket[bisect.bisect_right(stops, op.id)].append(op)
        self.src_held = {t.name: t for t in plan.src.tensors if self.rank < plan.src.ranks and t.holds(self.rank)}
        self.dst_held = {t.name: t for t in plan.dst.tensors if self.rank < plan.dst.ranks and t.holds(self.rank)}
        self.dst_by_bucket: list[list[TensorIR]] = [[] for _ in self.buckets]
        for b in self.buckets:
            for i in range(b.first_instance, b.stop_instance):
                t = plan.matches[i].dst
                if t.name in self.dst_held and self.dst_held[t.name] is t:
                    self.dst_by_bucket[b.index].append(t)
        self.entry = {e.key: e for e in plan.tensors}
        self.meter = StagingMeter()
        self.sent_bytes = self.received_bytes = self.local_bytes = 0
        self._store = _default_store()
        self._step = 0
        self._keys: list[str] = []

    # ---- collectives ----------------------------------------------------------
    def _device(self, tensors) -> torch.device:
        """Where staging lives: `device=`, else the tensors' device, else the backend's."""
        if self.device is not None:
            return torch.device(self.device)
        for t in tensors:
            data = t if isinstance(t, torch.Tensor) else getattr(t, "data", None)
            if isinstance(data, torch.Tensor):
                return data.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_messages(self, message: str, device) -> list[str]:
        """Every rank's message (empty when fine), exchanged as fixed-size uint8 tensors."""
        data = message.encode("utf-8")[:MESSAGE_BYTES]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=device)
        if data:
            mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.group)
        return [bytes(g.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace") for g in gathered]

    def _agree(self, src_tensors, dst_tensors, device) -> None:
        """Same plan everywhere, right tensors everywhere: one small all_reduce per step.

        The digest travels as two int64 halves reduced with MAX of (x, -x): equal
        everywhere iff max == -max(-x). Details are exchanged only on trouble.
        """
        digest = hashlib.sha256(f"{self.plan.digest}/{self.budget_bytes}".encode()).hexdigest()
        problems = self._check_tensors(src_tensors, dst_tensors)
        word = int(digest[:15], 16)
        flags = torch.tensor([word, -word, 1 if problems else 0], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if flags[0].item() == -flags[1].item() and flags[2].item() == 0:
            return
        messages = self._all_messages(digest + "\n" + "\n".join(problems), device)
        digests = [m.split("\n", 1)[0] for m in messages]
        if len(set(digests)) != 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RefitError(f"ranks hold different plans: rank 0 has {digests[0][:12]}, ranks {odd} differ "
                             "(compile the same two layouts with the same args and budget everywhere)")
        bad = [(r, m.split("\n", 1)[1]) for r, m in enumerate(messages) if "\n" in m and m.split("\n", 1)[1]]
        if bad:
            text = "; ".join(f"rank {r}: {p}" for r, p in bad)
            raise RefitError(f"local tensors do not match the layouts, nothing was moved: {text}")

    def _check_tensors(self, src_tensors, dst_tensors) -> list[str]:
        problems = []
        for side, held, given in (("source", self.src_held, src_tensors), ("destination", self.dst_held, dst_tensors)):
            if held and given is None:
                problems.append(f"{side} tensors are None but this rank holds {len(held)} {side} tensors")
                continue
            for name, t in held.items():
                if name not in given:
                    problems.append(f"{side} tensor `{name}` is missing")
                    continue
                problem = _shape_problem(t, given[name])
                if problem:
                    problems.append(f"{side} tensor `{name}`: {problem}")
                    if len(problems) > 8:
                        return problems
        return problems

    # ---- the step ---------------------------------------------------------------
    def refit(self, src_tensors, dst_tensors) -> None:
        """Move every destination tensor's data into place; raise RefitError on any fault."""
        src = {k: as_quantized(v, self.src_held[k].dtype) if k in self.src_held else v
               for k, v in (src_tensors or {}).items()}
        dst = {k: as_quantized(v, self.dst_held[k].dtype) if k in self.dst_held else v
               for k, v in (dst_tensors or {}).items()}
        device = self._device(list(src.values()) + list(dst.values()))
        self._step += 1
        self._forget_old_keys()
        self._agree(src_tensors, dst_tensors, device)
        self.meter = StagingMeter()
        mismatches: list[str] = []
        for b in self.buckets:
            try:
                mismatches += self._bucket(b.index, src, dst, device)
            except RefitError as exc:
                self._fence(b.index, failure=str(exc))
                raise
            self._fence(b.index)
        if self.verify:
            self._verify_result(mismatches, device)

    def _fence(self, b: int, failure: str | None = None) -> None:
        """Wait until every rank has finished bucket b; name the ranks that never do.

        Uses the process group's store, not a collective: a collective with a
        dead peer fails without saying who, and on NCCL may never return. One
        counter per bucket: the last rank to arrive opens the gate key that the
        others wait on, so the store sees O(ranks) requests per bucket.
        """
        store = self._store
        if store is None:
            return
        prefix = self._prefix(self._step, b)
        self._keys.append(f"{prefix}/done/{self.rank}")
        if failure is not None:
            store.set(f"{prefix}/failed/{self.rank}", failure[:200])
            self._keys.append(f"{prefix}/failed/{self.rank}")
            return
        store.set(f"{prefix}/done/{self.rank}", "1")
        if store.add(f"{prefix}/count", 1) == self.world:
            store.set(f"{prefix}/gate", "1")
        try:
            store.wait([f"{prefix}/gate"], self.timeout)
        except Exception:  # noqa: BLE001 - a timeout: find out who is missing
            time.sleep(1.0)  # let ranks that failed at the same moment say so
            missing = [r for r in range(self.world) if not store.check([f"{prefix}/done/{r}"])]
            failed = [r for r in missing if store.check([f"{prefix}/failed/{r}"])]
            silent = [r for r in missing if r not in failed]
            parts = []
            if silent:
                parts.append(f"peer rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                             f"did not finish bucket {b} within {self.timeout.total_seconds():g} s (died or stalled)")
            if failed:
                parts.append(f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed in "
                             f"bucket {b}")
            raise RefitError(f"rank {self.rank}: bucket {b}: " + "; ".join(parts)) from None

    def _prefix(self, step: int, b: int) -> str:
        return f"layoutlang/{self.plan.digest[:16]}/{step}/{b}"

    def _forget_old_keys(self) -> None:
        """Every rank passed step-1's fences, so step-2's keys are unused: delete ours."""
        store = self._store
        if store is None:
            return
        keep, self._keys = [], self._keys
        for key in self._keys:
            if f"/{self._step - 2}/" in key:
                try:
                    store.delete_key(key)
                except Exception:  # noqa: BLE001 - a store without delete keeps them
                    pass
            else:
                keep.append(key)
        if self.rank == 0:
            for b in range(len(self.buckets)):
                for name in ("count", "gate"):
                    try:
                        store.delete_key(f"{self._prefix(self._step - 2, b)}/{name}")
                    except Exception:  # noqa: BLE001
                        pass
        self._keys = keep

    def _bucket(self, b: int, src, dst, device) -> list[str]:
        me, entry = self.rank, self.entry
        ops = self.ops_by_bucket[b]
        dequantized: dict[str, torch.Tensor] = {}
        assembly: dict[str, torch.Tensor] = {}
        for t in self.dst_by_bucket[b]:
            if t.dtype in QUANTIZED:
                assembly[t.name] = self.meter.alloc(torch.zeros(t.local_shape, dtype=torch.bfloat16, device=device))
            else:
                _zero_padding(dst[t.name], t, me)

        def source_view(op) -> torch.Tensor:
            held = self.src_held[op.src_name]
            value = src[op.src_name]
            if held.dtype in QUANTIZED:
                if op.src_name not in dequantized:
                    dequantized[op.src_name] = self.meter.alloc(dequantize(value, held.dtype))
                value = dequantized[op.src_name]
            return value[_slices(op.src_slice)]

        def target(op):
            """(tensor to receive into, view to copy it to afterwards or None)."""
            held = self.dst_held[op.dst_name]
            base = assembly[op.dst_name] if held.dtype in QUANTIZED else dst[op.dst_name]
            view = base[_slices(op.dst_slice)]
            if contiguous(op.dst_slice, held.local_shape) and view.dtype == _wire(entry[op.key]):
                return view, None
            return self.meter.alloc(torch.empty(view.shape, dtype=_wire(entry[op.key]), device=device)), view

        p2p, pending, local = [], [], []
        for op in ops:
            if op.local:
                local.append(op)
                continue
            if op.src_rank == me:
                view = source_view(op)
                wire = _wire(entry[op.key])
                if view.dtype != wire or not view.is_contiguous():
                    buf = self.meter.alloc(torch.empty(view.shape, dtype=wire, device=device))
                    buf.copy_(view)
                else:
                    buf = view
                buf = _corrupt_hook(buf, op)
                p2p.append((dist.P2POp(dist.isend, buf, self._peer(op.dst_rank), self.group), op))
                self.sent_bytes += op.bytes
            else:
                buf, view = target(op)
                p2p.append((dist.P2POp(dist.irecv, buf, self._peer(op.src_rank), self.group), op))
                pending.append((buf, view))
                self.received_bytes += op.bytes
        works = []
        if p2p:
            try:
                works = dist.batch_isend_irecv([p for p, _ in p2p])
            except Exception as exc:  # noqa: BLE001
                raise RefitError(f"rank {me}: bucket {b}: posting {len(p2p)} transfers failed: "
                                 f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
        for op in local:  # while the network works
            target_view = (assembly[op.dst_name] if op.dst_name in assembly else dst[op.dst_name])[
                _slices(op.dst_slice)]
            target_view.copy_(source_view(op))
            self.local_bytes += op.bytes
        if works:
            for work, (_, op) in zip(works, p2p):
                peer = op.dst_rank if op.src_rank == me else op.src_rank
                try:
                    ok = work.wait(self.timeout)
                except Exception as exc:  # noqa: BLE001 - every transport error becomes one message
                    raise RefitError(f"rank {me}: bucket {b}: transfer of op {op.id} (`{op.key}`) with peer "
                                     f"rank {peer} failed: {str(exc).splitlines()[0] if str(exc) else exc!r}") from exc
                if ok is False:
                    raise RefitError(f"rank {me}: bucket {b}: peer rank {peer} did not complete op {op.id} "
                                     f"(`{op.key}`) within {self.timeout.total_seconds():g} s")
        for buf, view in pending:
            if view is not None:
                view.copy_(buf)
        mismatches = self._bucket_checksums(ops, src, dst, assembly, source_view, device, b) if self.verify else []
        for t in self.dst_by_bucket[b]:
            if t.dtype in QUANTIZED:
                quantize_into(assembly[t.name], dst[t.name], t.dtype)
        self.meter.reset_bucket()
        return mismatches

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    # ---- verification ---------------------------------------------------------------
    def _bucket_checksums(self, ops, src, dst, assembly, source_view, device, b) -> list[str]:
        """Per op: the sender's checksum of what it sent vs the receiver's of what landed."""
        me, entry = self.rank, self.entry
        mismatches = []
        outgoing, incoming = [], []
        for op in ops:
            if op.src_rank == me:
                mine = _checksum(source_view(op).to(_wire(entry[op.key])))
                if op.local:
                    got = _checksum(self._landed(op, dst, assembly))
                    if not torch.allclose(mine, got, rtol=1e-9, atol=0.0):
                        mismatches.append(self._mismatch(op))
                else:
                    outgoing.append((mine, op))
            elif op.dst_rank == me:
                incoming.append((torch.zeros(1, dtype=torch.float64, device=device), op))
        p2p = [dist.P2POp(dist.isend, s, self._peer(op.dst_rank), self.group) for s, op in outgoing]
        p2p += [dist.P2POp(dist.irecv, s, self._peer(op.src_rank), self.group) for s, op in incoming]
        if p2p:
            for w in dist.batch_isend_irecv(p2p):
                w.wait(self.timeout)
        for expected, op in incoming:
            got = _checksum(self._landed(op, dst, assembly))
            if not torch.allclose(expected, got, rtol=1e-9, atol=0.0):
                mismatches.append(self._mismatch(op))
        return mismatches

    def _landed(self, op, dst, assembly) -> torch.Tensor:
        base = assembly[op.dst_name] if op.dst_name in assembly else dst[op.dst_name]
        return base[_slices(op.dst_slice)]

    def _mismatch(self, op) -> str:
        return (f"`{op.key}` ({op.dst_name}[{', '.join(f'{a}:{b}' for a, b in op.dst_slice)}] on rank "
                f"{op.dst_rank}, from rank {op.src_rank}, op {op.id})")

    def _verify_result(self, mismatches: list[str], device) -> None:
        messages = self._all_messages("; ".join(mismatches), device)
        bad = [m for m in messages if m]
        if bad:
            raise RefitError("verification failed: destination contents differ from the source: " + "; ".join(bad))


def _default_store():
    """The default process group's store (for fences that name a dead peer), if any."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store, fences are skipped
        return None


def _wire(entry) -> torch.dtype:
    return WIRE["bf16" if entry.dst_dtype in QUANTIZED else entry.dst_dtype]


def _zero_padding(tensor: torch.Tensor, t: TensorIR, rank: int) -> None:
    for d, runs in enumerate(t.runs(rank)):
        for r in runs:
            if isinstance(r, PadRun):
                tensor.narrow(d, r.local_start, r.length).zero_()


def _shape_problem(t: TensorIR, value) -> str | None:
    expected = tuple(t.local_shape)
    if t.dtype in QUANTIZED:
        value = as_quantized(value, t.dtype)
        data = getattr(value, "data", None)
        if data is None or not isinstance(data, torch.Tensor):
            return f"expected a quantized {t.dtype} tensor (data with its scale), got {type(value).__name__}"
        if tuple(data.shape) != expected or data.dtype != FP8_DTYPES[t.dtype]:
            return f"expected {t.dtype} data {list(expected)} {FP8_DTYPES[t.dtype]}, got {list(data.shape)} {data.dtype}"
        if t.dtype == "mxfp8":
            want = expected[:-1] + (expected[-1] // MX_BLOCK,)
            if tuple(value.scales.shape) != want:
                return f"expected mxfp8 scales {list(want)}, got {list(value.scales.shape)}"
        elif value.scale.numel() != 1:
            return f"expected a one-element scale, got {list(value.scale.shape)}"
        return None
    if not isinstance(value, torch.Tensor):
        return f"expected a torch.Tensor, got {type(value).__name__}"
    if tuple(value.shape) != expected or value.dtype != PLAIN_DTYPES[t.dtype]:
        return f"expected {list(expected)} {PLAIN_DTYPES[t.dtype]}, got {list(value.shape)} {value.dtype}"
    return None


def _corrupt_hook(buf: torch.Tensor, op) -> torch.Tensor:
    """Identity; tests replace it to corrupt a buffer on the wire (verify must catch it)."""
    return buf
