"""Execute a compiled plan on torch.distributed: the refit step.

`Refitter` makes no planning decisions: it walks the compiler's buckets in
order and, per bucket, posts this rank's sends and receives as one
`batch_isend_irecv` (deadlock-free on gloo and NCCL: every rank posts its
ops in canonical op order), does local copies without the network, then
assembles, zeroes padding and quantizes. Before a byte moves, every rank
checks that all ranks hold the same plan and that every local tensor has the
layout's shape and dtype.

Every wait has a deadline (`timeout`): ranks meet in the process group's
store (runtime/rendezvous.py), never in a collective, so a stalled or dead
rank is named instead of hanging everyone, and every failure is a
`RefitError` that says whether this Refitter can be used again.
"""

from __future__ import annotations

import bisect
import hashlib
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from layoutlang.compiler import Plan
from layoutlang.compiler.graph import Bucket, buckets
from layoutlang.ir import QUANTIZED, TensorIR
from layoutlang.modes import PadRun

from .errors import RefitError
from .quant import PLAIN_DTYPES, as_quantized, dequantize, quantize_into, storage_problem, tensors_of
from .rendezvous import Abandoned, Rendezvous, StoreUnreachable, parse_gate
from .views import shape as _shape
from .views import view as _view

WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NOTE_CHARS = 4000   # what one rank tells the others about its tensors, at most
STRIDED = 1 << 20   # agreement flags: problems count in the low bits, strided ranks above


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


class RefitHooks:
    """Test seams of a refit (fault injection); the default changes nothing.

    Pass a subclass as ``Refitter(..., hooks=...)``: ``before_refit`` runs as a
    step starts (before the agreement), ``before_bucket`` before a bucket's
    transfers are posted, ``on_send`` may replace a send buffer.
    """

    def before_refit(self, refitter: "Refitter", step: int) -> None:
        pass

    def before_bucket(self, refitter: "Refitter", step: int, bucket: int) -> None:
        pass

    def on_send(self, buf: torch.Tensor, op) -> torch.Tensor:
        return buf


@dataclass(frozen=True)
class Schedule:
    """This rank's share of one bucketing of the plan."""

    buckets: tuple[Bucket, ...]
    ops: tuple[tuple, ...]                      # per bucket: this rank's ops
    dst: tuple[tuple[TensorIR, ...], ...]       # per bucket: destination tensors it completes here


def _slices(sl) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted float64 sum: detects changed, lost and swapped elements."""
    flat = t.reshape(-1).to(torch.float64)
    weights = (torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 251) + 1.0
    return (flat * weights).sum().reshape(1)


def _first_line(exc: BaseException) -> str:
    """The useful part of a torch/gloo error: its first line, without source paths and advice."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text.splitlines()[0])
    return line.split(". This is typically caused", 1)[0].rstrip(".")


class Refitter:
    """Moves weights from the source layout's tensors into the destination's, every step.

    ``Refitter(plan).refit(src_tensors, dst_tensors)`` on every rank of the group
    (ranks that hold neither model pass ``None, None``). Destination tensors are
    updated in place. Create Refitters in the same order on every rank: the
    n-th Refitter of a group on one rank meets the n-th on the others.
    """

    def __init__(self, plan: Plan, *, group=None, device=None, budget_bytes: int | None = None,
                 timeout: timedelta | float = timedelta(seconds=60), verify: bool = False,
                 hooks: RefitHooks | None = None):
        self.plan = plan
        self.group = group
        self.device = device
        self.budget_bytes = budget_bytes
        # seconds or a timedelta (torch.distributed's own timeouts are timedeltas)
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.verify = verify
        self.hooks = hooks or RefitHooks()
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.world < plan.world:
            raise RefitError.at(self.rank, 0, "setup", f"the plan spans {plan.world} ranks but the process group "
                                f"has {self.world}", reusable=False)
        self.ops = plan.ops_for_rank(self.rank) if self.rank < plan.world else ()
        self.src_held = {t.name: t for t in plan.src.tensors if self.rank < plan.src.ranks and t.holds(self.rank)}
        self.dst_held = {t.name: t for t in plan.dst.tensors if self.rank < plan.dst.ranks and t.holds(self.rank)}
        self.entry = {e.key: e for e in plan.tensors}
        self._schedules: dict[bool, Schedule] = {}
        self.buckets = self.schedule(False).buckets
        self.meter = StagingMeter()
        self.sent_bytes = self.received_bytes = self.local_bytes = 0
        self._digest = hashlib.sha256(f"{plan.digest}/{budget_bytes}".encode()).hexdigest()[:16]
        self._rv = self._rendezvous()
        self._step = 0
        self._fence: str | None = None  # the step's one meeting after the buckets (its prefix)
        self._phase = "setup"
        self._broken: str | None = None
        self._keys: dict[int, list[tuple[str, bool]]] = {}  # step -> (key, shared)

    @property
    def reusable(self) -> bool:
        """False after a failure that left transfers in flight (see `refit`)."""
        return self._broken is None

    def schedule(self, strided: bool) -> Schedule:
        """The buckets this rank walks; `strided` when some rank's tensors are not contiguous."""
        if strided not in self._schedules:
            bucket_list = buckets(self.plan, self.budget_bytes, strided)
            stops = [b.stop_op for b in bucket_list]
            ops: list[list] = [[] for _ in bucket_list]
            for op in self.ops:
                ops[bisect.bisect_right(stops, op.id)].append(op)
            dst: list[list[TensorIR]] = [[] for _ in bucket_list]
            for b in bucket_list:
                for i in range(b.first_instance, b.stop_instance):
                    t = self.plan.matches[i].dst
                    if self.dst_held.get(t.name) is t and (not dst[b.index] or dst[b.index][-1] is not t):
                        dst[b.index].append(t)  # once per stored tensor, however many keys it holds
            self._schedules[strided] = Schedule(bucket_list, tuple(map(tuple, ops)), tuple(map(tuple, dst)))
        return self._schedules[strided]

    def _rendezvous(self) -> Rendezvous:
        """Meetings in the default store, under a namespace of this group and Refitter.

        The n-th Refitter created on a rank (for this group) meets the n-th on every other rank.
        """
        store = _default_store()
        if store is None:
            raise RefitError.at(self.rank, 0, "setup", "the process group has no store to meet in "
                                "(initialize it with torch.distributed.init_process_group)", reusable=False)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(self.world)
        members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:8]
        base = f"layoutlang/{members}"  # not the plan's digest: ranks with different plans must meet
        rv = Rendezvous(store, self.rank, self.world, base)
        try:
            generation = rv.add(f"{base}/generation/{self.rank}", 1)
        except StoreUnreachable as exc:
            raise RefitError.at(self.rank, 0, "setup", str(exc), reusable=False) from None
        rv.namespace = f"{base}/{generation}"
        return rv

    # ---- the step ---------------------------------------------------------------
    def refit(self, src_tensors, dst_tensors) -> None:
        """Move every destination tensor's data into place; raise RefitError on any fault.

        A failure before any transfer is posted (a rank late or missing at the
        start, different plans, wrong tensors, a failed verification) fails the
        same step on every rank and leaves this Refitter usable. A failure while
        transfers are in flight leaves it unusable: the next call says so at once.
        """
        if self._broken is not None:
            raise RefitError.at(self.rank, self._step + 1, "setup", f"this Refitter cannot be reused: {self._broken}",
                                reusable=False)
        self._step += 1
        step = self._step
        self._phase = "agreement"
        try:
            self.hooks.before_refit(self, step)
            self._refit(step, src_tensors, dst_tensors)
        except RefitError as exc:
            if not exc.reusable:
                self._broken = f"step {step} failed in {exc.phase}: {exc.detail}"
            raise
        except StoreUnreachable as exc:
            self._broken = f"step {step} failed in {self._phase}: {exc}"
            raise RefitError.at(self.rank, step, self._phase, str(exc), reusable=False) from None

    def _refit(self, step: int, src_tensors, dst_tensors) -> None:
        self._forget(step - 2)
        src = {k: as_quantized(v, self.src_held[k].dtype) if k in self.src_held else v
               for k, v in (src_tensors or {}).items()}
        dst = {k: as_quantized(v, self.dst_held[k].dtype) if k in self.dst_held else v
               for k, v in (dst_tensors or {}).items()}
        device = self._device(list(src.values()) + list(dst.values()))
        strided = any(_strided(v) for v in list(src.values()) + list(dst.values()))
        schedule = self.schedule(self._agree(step, src_tensors, dst_tensors, strided))
        self.meter = StagingMeter()
        mismatches: list[str] = []
        # One fence per step, not per bucket: the last bucket's meeting (store traffic is
        # O(ranks) per step; benchmarks/store_scale.py). Between buckets a rank only waits
        # for its own peers' transfers, under the timeout; a rank that fails gives up the
        # fence with its reason, so every rank is released at once, with that reason.
        last = schedule.buckets[-1].index if schedule.buckets else 0
        self._fence = fence = self._prefix(step, "bucket", last)
        for b in schedule.buckets:
            self._phase = f"bucket {b.index}"
            try:
                self.hooks.before_bucket(self, step, b.index)
                mismatches += self._bucket(schedule, b.index, src, dst, device)
            except Exception as exc:  # noqa: BLE001 - every fault in a bucket is a RefitError
                err = exc if isinstance(exc, RefitError) else RefitError.at(
                    self.rank, step, self._phase, f"{type(exc).__name__}: {_first_line(exc)}", reusable=False)
                self._rv.give_up(fence, f"rank {self.rank} failed in bucket {b.index}: {err.detail}",
                                 err.peers or (self.rank,))
                raise err from (None if err is exc else exc)
        self._phase = f"bucket {last}"
        self._meet(step, fence, f"finish bucket {last}", reusable=False)
        if self.verify:
            self._phase = "verification"
            self._verify_result(step, mismatches)

    def _prefix(self, step: int, *parts) -> str:
        """A meeting's prefix, remembered for cleanup two steps later."""
        prefix = self._rv.key(step, *parts)
        keys = self._keys.setdefault(step, [])
        keys.append((f"{prefix}/here/{self.rank}", False))
        keys += [(f"{prefix}/count", True), (f"{prefix}/gate", True)]
        return prefix

    def _meet(self, step: int, prefix: str, what: str, *, reusable: bool, note: str = "") -> None:
        try:
            self._rv.meet(prefix, self.timeout, what=what, note=note)
        except Abandoned as exc:
            raise RefitError.at(self.rank, step, self._phase, exc.reason, peers=exc.peers,
                                reusable=reusable) from None

    def _read_notes(self, step: int, meeting: str) -> list[str]:
        """Every rank's note at `meeting`, then one more meeting: rank 0 may host the store, and a
        rank 0 that raised and exited at once would leave the others reading a dead store."""
        notes = self._rv.notes(self._rv.key(step, meeting))
        self._meet(step, self._prefix(step, meeting, "read"), "read the others' notes", reusable=True)
        return notes

    def _forget(self, step: int) -> None:
        """Every rank met at step+1, so step's keys are unused: delete ours (rank 0: the shared ones)."""
        for key, shared in self._keys.pop(step, ()):
            if not shared or self.rank == 0:
                self._rv.delete(key)

    # ---- agreement ------------------------------------------------------------------
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

    def _agree(self, step: int, src_tensors, dst_tensors, strided: bool) -> bool:
        """Same plan everywhere, right tensors everywhere, every rank present in time.

        Three counters in the store: ranks per plan digest, ranks with problems,
        ranks with non-contiguous tensors; notes are read only on trouble.
        Returns whether any rank passes non-contiguous tensors.
        """
        prefix = self._prefix(step, "agree")
        problems = self._check_tensors(src_tensors, dst_tensors)
        digest_key, flags_key = f"{prefix}/digest/{self._digest}", f"{prefix}/flags"
        self._keys[step] += [(digest_key, False), (flags_key, True)]
        self._rv.add(digest_key, 1)
        flags = (1 if problems else 0) + (STRIDED if strided else 0)
        if flags:
            self._rv.add(flags_key, flags)
        note = (self._digest + "\n" + "\n".join(problems))[:NOTE_CHARS]
        self._meet(step, prefix, f"start step {step}", reusable=True, note=note)
        same = self._rv.add(digest_key, 0) == self.world
        flags = self._rv.add(flags_key, 0)
        if same and flags % STRIDED == 0:
            return flags >= STRIDED
        notes = self._read_notes(step, "agree")
        digests = [n.split("\n", 1)[0] for n in notes]
        if len(set(digests)) != 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise RefitError.at(self.rank, step, "agreement", f"ranks hold different plans: rank 0 has {digests[0][:12]}, "
                                f"ranks {odd} differ (compile the same two layouts with the same args and budget "
                                "everywhere)", peers=odd, reusable=True)
        bad = [(r, n.split("\n", 1)[1]) for r, n in enumerate(notes) if "\n" in n and n.split("\n", 1)[1]]
        text = "; ".join(f"rank {r}: {p.replace(chr(10), '; ')}" for r, p in bad)
        raise RefitError.at(self.rank, step, "agreement", f"local tensors do not match the layouts, nothing was "
                            f"moved: {text}", peers=[r for r, _ in bad], reusable=True)

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
                problem = _shape_problem(t, given[name], self.rank)
                if problem:
                    problems.append(f"{side} tensor `{name}`: {problem}")
                    if len(problems) > 8:
                        return problems
        return problems

    # ---- one bucket -----------------------------------------------------------------
    def _bucket(self, schedule: Schedule, b: int, src, dst, device) -> list[str]:
        me, entry = self.rank, self.entry
        ops = schedule.ops[b]
        dequantized: dict[str, torch.Tensor] = {}
        assembly: dict[str, torch.Tensor] = {}
        for t in schedule.dst[b]:
            if t.dtype in QUANTIZED:
                assembly[t.name] = self.meter.alloc(torch.zeros(t.local_shape_at(me), dtype=torch.bfloat16,
                                                                 device=device))
            else:
                _zero_padding(dst[t.name], t, me)

        def source_view(op) -> torch.Tensor:
            """The source block, in the RECEIVER's order (a transposed key is turned here)."""
            held = self.src_held[op.src_name]
            value = src[op.src_name]
            if held.dtype in QUANTIZED:
                if op.src_name not in dequantized:
                    dequantized[op.src_name] = self.meter.alloc(dequantize(value, held.dtype))
                value = dequantized[op.src_name]
            block = _view(value, op.src_slice)  # strided slices too (runtime/views.py)
            if op.transpose is not None:
                block = block.reshape(op.transpose).t().reshape(_shape(op.dst_slice))
            return block

        def target(op):
            """(tensor to receive into, view to copy it to afterwards or None)."""
            held = self.dst_held[op.dst_name]
            base = assembly[op.dst_name] if held.dtype in QUANTIZED else dst[op.dst_name]
            view = _view(base, op.dst_slice)
            if view.is_contiguous() and view.dtype == _wire(entry[op.key]):
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
                buf = self.hooks.on_send(buf, op)
                p2p.append((dist.P2POp(dist.isend, buf, self._peer(op.dst_rank), self.group), op))
                self.sent_bytes += op.bytes
            else:
                buf, view = target(op)
                p2p.append((dist.P2POp(dist.irecv, buf, self._peer(op.src_rank), self.group), op))
                pending.append((buf, view))
                self.received_bytes += op.bytes
        works = self._post([p for p, _ in p2p], "transfers")
        for op in local:  # while the network works
            target_view = _view(assembly[op.dst_name] if op.dst_name in assembly else dst[op.dst_name],
                                op.dst_slice)
            # a stacked side's block carries its extent-1 expert dim: same elements, same order
            target_view.copy_(source_view(op).reshape(target_view.shape))
            self.local_bytes += op.bytes
        self._wait(works, [op for _, op in p2p], "transfer")
        for buf, view in pending:
            if view is not None:
                view.copy_(buf)
        mismatches = self._bucket_checksums(ops, dst, assembly, source_view, device) if self.verify else []
        for t in schedule.dst[b]:
            if t.dtype in QUANTIZED:
                quantize_into(assembly[t.name], dst[t.name], t.dtype)
        self.meter.reset_bucket()
        return mismatches

    def _post(self, p2p: list, what: str) -> list:
        if not p2p:
            return []
        try:
            return dist.batch_isend_irecv(p2p)
        except Exception as exc:  # noqa: BLE001
            raise RefitError.at(self.rank, self._step, self._phase, f"posting {len(p2p)} {what} failed: "
                                f"{_first_line(exc)}", reusable=False) from exc

    def _wait(self, works: list, ops: list, what: str) -> None:
        """Wait for a bucket's transfers under ONE deadline (not one timeout per transfer)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        for work, op in zip(works, ops):
            peer = op.dst_rank if op.src_rank == self.rank else op.src_rank
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                ok = work.wait(left)
            except Exception as exc:  # noqa: BLE001 - every transport error becomes one message
                text = _first_line(exc)
                if "timed out" in text.lower() or "timeout" in text.lower():
                    text = f"peer rank {peer} did not complete it within {self.timeout.total_seconds():g} s"
                raise self._root_cause() or RefitError.at(
                    self.rank, self._step, self._phase, f"{what} of op {op.id} (`{op.key}`) with peer rank {peer} "
                    f"failed: {text}", peers=(peer,), reusable=False) from exc
            if ok is False:
                raise self._root_cause() or RefitError.at(
                    self.rank, self._step, self._phase, f"peer rank {peer} did not complete {what} of op {op.id} "
                    f"(`{op.key}`) within {self.timeout.total_seconds():g} s", peers=(peer,), reusable=False)

    def _root_cause(self) -> RefitError | None:
        """The reason a rank already left at the step's fence, if any: a peer that stopped
        answering is usually waiting on the rank that failed first, which this names."""
        fence = self._fence
        if fence is None:
            return None
        try:
            if not self._rv.store.check([f"{fence}/gate"]):
                return None
            reason, peers = parse_gate(self._rv.store.get(f"{fence}/gate"))
        except Exception:  # noqa: BLE001 - no store, no better reason: the caller's stands
            return None
        if not reason:
            return None
        return RefitError.at(self.rank, self._step, self._phase, reason, peers=peers, reusable=False)

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    # ---- verification ---------------------------------------------------------------
    def _bucket_checksums(self, ops, dst, assembly, source_view, device) -> list[str]:
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
        self._wait(self._post(p2p, "checksums"), [op for _, op in outgoing + incoming], "checksum")
        for expected, op in incoming:
            got = _checksum(self._landed(op, dst, assembly))
            if not torch.allclose(expected, got, rtol=1e-9, atol=0.0):
                mismatches.append(self._mismatch(op))
        return mismatches

    def _landed(self, op, dst, assembly) -> torch.Tensor:
        base = assembly[op.dst_name] if op.dst_name in assembly else dst[op.dst_name]
        return _view(base, op.dst_slice)

    def _mismatch(self, op) -> str:
        return (f"`{op.key}` ({op.dst_name}[{', '.join(':'.join(map(str, e)) for e in op.dst_slice)}] on rank "
                f"{op.dst_rank}, from rank {op.src_rank}, op {op.id})")

    def _verify_result(self, step: int, mismatches: list[str]) -> None:
        """Every rank learns every rank's mismatches (through the store, only on trouble)."""
        prefix = self._prefix(step, "verify")
        bad_key = f"{prefix}/bad"
        self._keys[step].append((bad_key, True))
        if mismatches:
            self._rv.add(bad_key, 1)
        self._meet(step, prefix, "finish verification", reusable=True, note="; ".join(mismatches)[:NOTE_CHARS])
        if self._rv.add(bad_key, 0) == 0:
            return
        bad = [n for n in self._read_notes(step, "verify") if n and n != "1"]
        raise RefitError.at(self.rank, step, "verification", "verification failed: destination contents differ "
                            "from the source: " + "; ".join(bad), reusable=True)


def _default_store():
    """The default process group's store (where ranks meet), if any."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - reported by the caller
        return None


def _strided(value) -> bool:
    """Is this tensor (or any tensor of a quantized value: data, scales) not contiguous?"""
    parts = [value] if isinstance(value, torch.Tensor) else tensors_of(value)
    return any(isinstance(p, torch.Tensor) and not p.is_contiguous() for p in parts)


def _wire(entry) -> torch.dtype:
    return WIRE["bf16" if entry.dst_dtype in QUANTIZED else entry.dst_dtype]


def _zero_padding(tensor: torch.Tensor, t: TensorIR, rank: int) -> None:
    for d, runs in enumerate(t.runs(rank)):
        for r in runs:
            if isinstance(r, PadRun):
                tensor.narrow(d, r.local_start, r.length).zero_()


def _shape_problem(t: TensorIR, value, rank: int) -> str | None:
    expected = tuple(t.local_shape_at(rank))  # ranks of a ragged split hold different extents
    if t.dtype in QUANTIZED:
        return storage_problem(as_quantized(value, t.dtype), t.dtype, expected)
    if not isinstance(value, torch.Tensor):
        return f"expected a torch.Tensor, got {type(value).__name__}"
    if tuple(value.shape) != expected or value.dtype != PLAIN_DTYPES[t.dtype]:
        return f"expected {list(expected)} {PLAIN_DTYPES[t.dtype]}, got {list(value.shape)} {value.dtype}"
    return None
