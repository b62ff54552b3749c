"""Execute a compiled plan on torch.distributed: the refit step.

`Refitter` makes no planning decisions: it walks the compiler's buckets in
order and, in each, the steps the compiler made for this rank
(layoutlang/compiler/steps.py: which tensors are assembled, which transfers are staged
or carry quantized bytes, which round of point-to-point messages each is
posted in), one handler per step kind (`BucketRun`, layoutlang/runtime/bucket.py). A round's messages are
posted at once through its transport (layoutlang/runtime/transport.py; deadlock-free: every rank posts its messages in
canonical op order; one `batch_isend_irecv` group on NCCL); local copies run while the network works;
then staged receives land, assemblies are quantized once and quantized
blocks are unpacked. Before a byte moves, every rank checks that all ranks
hold the same plan and that every local tensor has the layout's shape and
dtype.

Every wait has a deadline (`timeout`): ranks meet in the process group's
store (layoutlang/runtime/rendezvous.py), never in a collective, so a stalled or dead
rank is named instead of hanging everyone, and every failure is a
`RefitError` that says whether this Refitter can be used again.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from layoutlang.compiler import Plan
from layoutlang.compiler.steps import Schedule, schedule
from layoutlang.ir import QUANTIZED, TensorIR

from .errors import RefitError, first_line
from .quant import PLAIN_DTYPES, as_quantized, storage_problem, tensors_of
from .wire import landed
from .rendezvous import Abandoned, Rendezvous, StoreUnreachable, parse_gate
from .replay import Recording, replayable, stages, tensor_key
from .bucket import BucketRun, wire_dtype
from .staging import StagingArena
from .transport import Transport, make_transport
from .views import view as _view

NOTE_CHARS = 4000   # what one rank tells the others about its tensors, at most
STALE_KEYS = 256    # store keys of finished steps a rank may defer deleting, at most


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

    def release(self, nbytes: int) -> None:
        """A bucket's buffers are dropped (with overlap, the next bucket's may still be live)."""
        self.per_bucket_peak.append(self.current)
        self.current -= nbytes


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


def _slices(sl) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


CHECKSUM_BASE = 251     # a position's weights are its digits in this base, plus one
CHECKSUM_DIGITS = 5     # 251**5 ~ 1e12 elements: more than any one op moves


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted float64 sums: detect changed, lost and swapped elements.

    Sum d weights each element by digit d of its position in base 251, plus one.
    Two positions differ in some digit, so a swap of two unequal elements changes
    at least one sum by a multiple of their difference (one weight alone, i % 251,
    is blind to elements 251 apart: two rows of a [N, 251] tensor). Digits a tensor
    of this size does not have are 0 (weight 1: the plain sum), so every checksum
    has CHECKSUM_DIGITS sums and the receiver's buffer needs no size from the sender.
    """
    flat = t.reshape(-1).to(torch.float64)
    position = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
    sums = []
    for _ in range(CHECKSUM_DIGITS):
        sums.append((flat * ((position % CHECKSUM_BASE) + 1).to(torch.float64)).sum())
        position = position // CHECKSUM_BASE
    return torch.stack(sums)


class Refitter:
    """Moves weights from the source layout's tensors into the destination's, every step.

    ``Refitter(plan).refit(src_tensors, dst_tensors)`` on every rank of the group
    (ranks that hold neither model pass ``None, None``). Destination tensors are
    updated in place. Create Refitters in the same order on every rank: the
    n-th Refitter of a group on one rank meets the n-th on the others.
    `overlap=True` finishes each bucket (land, quantize, unpack) while the next
    bucket's transfers fly, and stages the next bucket (its sends packed and copied) while
    this one's fly, with buckets cut at half the budget (every rank must
    pass the same `budget_bytes` and `overlap`: they are part of the agreement).
    `transport`: how messages move (layoutlang/runtime/transport.py): "auto" (the default) moves
    the messages of a pair of ranks on one host through shared memory and every other pair's
    through `group` (layoutlang/runtime/transport_auto.py); "group" is `group`'s backend, gloo
    or NCCL, for every pair; "memory" shared memory for every pair (one host: an error naming
    the pair otherwise; layoutlang/runtime/transport_memory.py); "nixl" NIXL's one-sided writes;
    a name registered with `transport.register`, or a `Transport` instance (the jobs' walk
    passes its own). A transport connects at the first step; `close()` tears it down, and
    `transports` says what moves this rank's messages with each peer.
    `keep_staging`: carve staging buffers from arenas kept between steps (layoutlang/runtime/staging.py;
    they hold the largest bucket's staging, at most the budget, until `release_staging()`).
    By default only on CPU, where fresh buffers are fresh pages every step.
    `steady=True`: once one step has passed on every rank, skip the store meetings of later
    steps (the agreement and the fence; see `refit`): the fastest mode, at the price of a
    run-time tensor problem failing its peers after bytes moved (`verify=True` always meets).
    Steady steps given the same tensors as the step before run a record of that step's
    tensor operations instead of walking the steps again (layoutlang/runtime/replay.py; `replayed`
    counts them); the record holds views of those tensors until they change or
    `release_staging()`. A rank whose steps stage nothing (contiguous blocks both ways)
    replays anywhere; one that stages needs the staging kept (`keep_staging`): on CPU by
    default, on an accelerator pass `keep_staging=True` (docs/runtime.md).
    """

    def __init__(self, plan: Plan, *, group=None, device=None, budget_bytes: int | None = None,
                 timeout: timedelta | float = timedelta(seconds=60), verify: bool = False,
                 hooks: RefitHooks | None = None, overlap: bool = False, keep_staging: bool | None = None,
                 steady: bool = False, transport: str | Transport = "auto"):
        self.plan = plan
        self.group = group
        self.transport = make_transport(transport, group)
        self.transport.bind(self)
        self.device = device
        self.budget_bytes = budget_bytes
        # overlap: a bucket's last steps (land, quantize, unpack) run while the next bucket's
        # transfers fly; buckets are then cut at half the budget, so two live at once stay within it
        self.overlap = overlap
        # seconds or a timedelta (torch.distributed's own timeouts are timedeltas)
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.verify = verify
        self.hooks = hooks or RefitHooks()
        self.keep_staging = keep_staging
        self.steady = steady
        self._arenas: list[StagingArena] = []  # bucket b carves from arena b % len (2 with overlap)
        self.rank, self.world = self.transport.place()
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
        self.staged_ahead = 0  # steps run during the previous bucket's transfers (`overlap`), all steps
        self._digest = hashlib.sha256(f"{plan.digest}/{budget_bytes}/{overlap}".encode()).hexdigest()[:16]
        self._rv = self._rendezvous()
        self._step = 0
        self._fence: str | None = None  # the step's one meeting after the buckets (its prefix)
        self._phase = "setup"
        self._broken: str | None = None
        self._broken_peers: tuple[int, ...] = ()
        self._keys: dict[int, list[tuple[str, bool]]] = {}  # step -> (key, shared)
        self._stale: list[str] = []  # keys of finished steps, deleted while transfers fly
        self._plans_agreed = False   # every rank's plan digest equal: checked until one agreement passes
        # the strided flag of the first step every rank passed (its fence); with `steady`, later
        # steps have no meeting and each rank checks its own tensors against that agreement
        self._agreed_strided: bool | None = None
        self.recording: list | None = None   # the actions of a steady step being recorded
        self._record: Recording | None = None  # the last one, run while the tensors are the same
        self._last_key: tuple | None = None
        self.replayed = 0  # steady steps run from a record, passed or failed (layoutlang/runtime/replay.py)
        self._replayable: dict[int, tuple[bool, bool]] = {}  # id(schedule) -> (plain steps, stages)
        self._connected = False  # the transport met this rank's peers (`_connect`, at the first agreed step)

    @property
    def staging_held(self) -> int:
        """Bytes of staging this Refitter keeps between steps (`keep_staging`)."""
        return sum(a.held for a in self._arenas)

    def release_staging(self) -> None:
        """Give the kept staging arenas back (the next step takes them again), and the steady
        step's record with them (it holds their buffers and views of the caller's tensors)."""
        self._arenas = []
        self._record = None

    def _keeps_staging(self, device: torch.device) -> bool:
        return self.keep_staging if self.keep_staging is not None else device.type == "cpu"

    def _arena(self, b: int, device: torch.device) -> StagingArena | None:
        if not self._keeps_staging(device):
            return None
        if not self._arenas:
            self._arenas = [StagingArena() for _ in range(2 if self.overlap else 1)]
        return self._arenas[b % len(self._arenas)]

    @property
    def reusable(self) -> bool:
        """False after a failure that left transfers in flight (see `refit`)."""
        return self._broken is None

    def schedule(self, strided: bool, cut: bool | None = None) -> Schedule:
        """The buckets and steps this rank walks (layoutlang/compiler/steps.py); `strided` when some rank's
        tensors are not contiguous; `cut`: the buckets as cut for that flag instead (None: `strided`)."""
        key = (strided, strided if cut is None else cut)
        if key not in self._schedules:
            budget = self.budget_bytes
            if self.overlap and budget is not None:
                budget = max(1, budget // 2)  # two buckets' buffers live at once
            self._schedules[key] = schedule(self.plan, self.rank, budget, strided, cut=key[1])
        return self._schedules[key]

    def _rendezvous(self) -> Rendezvous | None:
        """Meetings in the transport's store (the default group's), under a namespace of the
        group's members and this Refitter; None where the caller meets (`Transport.meeting`).

        The n-th Refitter created on a rank (for this group) meets the n-th on every other rank.
        The rank that is global rank 0 (under env:// init its process hosts the store) is the
        meetings' host: it leaves a step only after every other rank's last store request of it.
        """
        meeting = self.transport.meeting()
        if meeting is None:
            return None  # (the jobs' walk: the job meets, layoutlang/runtime/jobs.py)
        store, ranks = meeting
        if store is None:
            raise RefitError.at(self.rank, 0, "setup", "the process group has no store to meet in "
                                "(initialize it with torch.distributed.init_process_group)", reusable=False)
        ranks = list(ranks)
        members = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:8]
        base = f"layoutlang/{members}"  # not the plan's digest: ranks with different plans must meet
        rv = Rendezvous(store, self.rank, self.world, base, host=ranks.index(0) if 0 in ranks else None)
        try:
            generation = rv.add(f"{base}/generation/{self.rank}", 1)
        except StoreUnreachable as exc:
            raise RefitError.at(self.rank, 0, "setup", str(exc), reusable=False) from None
        rv.namespace = f"{base}/{generation}"
        return rv

    # ---- the step ---------------------------------------------------------------
    def refit(self, src_tensors, dst_tensors) -> None:
        """Move every destination tensor's data into place; raise RefitError on any fault.

        Each step starts with an agreement (same plan everywhere, right tensors
        everywhere, every rank present) and ends with a fence (every rank finished): a
        failure before any transfer is posted (a rank late or missing at the start,
        different plans, wrong tensors, a failed verification) fails the same step on
        every rank, before a byte moves, and leaves this Refitter usable. With
        `steady=True`, once one step has passed on every rank, later steps have no store
        meeting at all (the plan cannot change): each rank checks its own tensors, and
        any failure, its own or a peer's, leaves the Refitter unusable, with bytes moved
        between the other ranks. A failure while transfers are in flight leaves it
        unusable: the next call says so at once. Once a step passed, any rank, the store's
        host included, may exit as soon as its call returns (docs/runtime.md).
        """
        if self._broken is not None:
            step = self._step + 1
            if self._steady():  # peers of a steady step wait on transfers, not a meeting: tell them
                self._rv.give_up(self._rv.key(step, "fence"), f"rank {self.rank} cannot refit step {step}: "
                                 f"{self._broken}", self._broken_peers or (self.rank,))
            raise RefitError.at(self.rank, step, "setup", f"this Refitter cannot be reused: {self._broken}",
                                reusable=False)
        self._step += 1
        step = self._step
        self._phase = "agreement"
        try:
            self.hooks.before_refit(self, step)
            with torch.no_grad():  # parameters as they come: a refit never records autograd history
                self._refit(step, src_tensors, dst_tensors)
        except RefitError as exc:
            if not exc.reusable:
                self._broken = f"step {step} failed in {exc.phase}: {exc.detail}"
                self._broken_peers = exc.peers
            raise
        except StoreUnreachable as exc:
            self._broken = f"step {step} failed in {self._phase}: {exc}"
            raise RefitError.at(self.rank, step, self._phase, str(exc), reusable=False) from None

    def _steady(self) -> bool:
        """Does this step go without meetings? (`steady`, once one step passed everywhere.)"""
        return self.steady and self._agreed_strided is not None and not self.verify

    def _refit(self, step: int, src_tensors, dst_tensors) -> None:
        self._forget(step - 2)
        if self._record is not None and self._steady():
            # The same memory, dtypes, shapes and strides as the recorded step, which passed its
            # check: this step's check would pass too, and its walk would be the record.
            if self._record.key == tensor_key(src_tensors or {}, dst_tensors or {}):
                self._fence = self._rv.key(step, "fence")
                self._replay(step, self._fence)
                return
        src, dst = as_given(src_tensors, self.src_held), as_given(dst_tensors, self.dst_held)
        device = self._device(list(src.values()) + list(dst.values()))
        strided = any(not_contiguous(v) for v in list(src.values()) + list(dst.values()))
        steady = self._steady()
        # One fence per step, not per bucket (store traffic is O(ranks) per step;
        # benchmarks/store_scale.py), and in steady steps none: its key is only where a rank
        # that fails leaves its reason. Between buckets a rank only waits for its own peers'
        # transfers, under the timeout; a rank that fails gives up the fence with its reason,
        # so every rank waiting there is released at once, and one whose transfer with a stuck
        # peer times out reads the reason (`_root_cause`).
        self._fence = fence = self._rv.key(step, "fence") if steady else self._prefix(step, "fence")
        if steady:
            self._phase = "check"
            self._check_steady(step, src_tensors, dst_tensors, strided)
            agreed = self._agreed_strided
        else:
            agreed = self._agree(step, src_tensors, dst_tensors, strided)
        schedule = self.schedule(agreed)
        if not self._connected:
            self._connect(step, fence, device)
        key = self._replay_key(schedule, src, dst, device)
        self._record = None  # (its views of other tensors go before this walk allocates)
        blocks = self._recordable(key, schedule)
        self._last_key = key
        self.recording = [] if steady and blocks is not None else None
        counters = (self.sent_bytes, self.received_bytes, self.local_bytes, self.staged_ahead)
        self.meter = StagingMeter()
        mismatches: list[str] = []
        last = schedule.buckets[-1].index if schedule.buckets else 0
        self._pending = None  # overlap: the previous bucket's run, its last steps not yet done
        self._ahead = None    # overlap: (bucket, its run, steps done) staged during the one before
        try:
            for b in schedule.buckets:
                self._set_phase(f"bucket {b.index}")
                try:
                    self.hooks.before_bucket(self, step, b.index)
                    mismatches += self._bucket(schedule, b.index, src, dst, device)
                    if b.index == last:
                        mismatches += self._finish_pending()
                except Exception as exc:  # noqa: BLE001 - every fault in a bucket is a RefitError
                    err = self._bucket_failed(step, fence, exc)
                    raise err from (None if err is exc else exc)
        finally:
            actions, self.recording = self.recording, None
        if steady:
            if actions is not None and all(a.block is b for a, b in zip(self._arenas, blocks)):
                self._record = Recording(key, actions, self.sent_bytes - counters[0], self.received_bytes - counters[1],
                                         self.local_bytes - counters[2], self.staged_ahead - counters[3],
                                         self.meter.peak, tuple(self.meter.per_bucket_peak))
            return
        self._phase = f"bucket {last}"
        self._meet(step, fence, f"finish bucket {last}", reusable=False, seat="fence", leave=not self.verify)
        if self.verify:
            self._phase = "verification"
            self._verify_result(step, mismatches)
        self._agreed_strided = agreed  # every rank passed this step: the next ones are steady

    def _connect(self, step: int, fence: str, device: torch.device) -> None:
        """Connect the transport to this rank's peers (`Transport.connect`), once: at the first
        step every rank agreed to, so every rank is there (a missing one is the agreement's
        to name). A failure fails the step as a bucket's would (its reason left at the fence)."""
        self._phase = "connect"
        try:
            self.transport.connect(self.ops, device, time.monotonic() + self.timeout.total_seconds())
        except Exception as exc:  # noqa: BLE001 - every fault is a RefitError
            err = self._bucket_failed(step, fence, exc)
            raise err from (None if err is exc else exc)
        self._connected = True

    @property
    def transports(self) -> dict[int, str]:
        """Plan rank of each peer this rank exchanges messages with -> what moves them, e.g.
        {1: "memory (cma)", 5: "group (gloo)"} (before the first step: the transport's name)."""
        peers = sorted({op.dst_rank if op.src_rank == self.rank else op.src_rank
                        for op in self.ops if op.src_rank != op.dst_rank})
        return {p: self.transport.carrier(p) for p in peers}

    def close(self) -> None:
        """Tear down what the transport set up (`Transport.close`: the memory transport's
        channels); the Refitter is not used again. The process group is the caller's."""
        self._broken = self._broken or "it was closed"
        self._record = None
        self.transport.close()

    def _bucket_failed(self, step: int, fence: str, exc: Exception) -> RefitError:
        """A fault in a bucket as the RefitError to raise; its reason is left at the fence."""
        err = exc if isinstance(exc, RefitError) else RefitError.at(
            self.rank, step, self._phase, f"{type(exc).__name__}: {first_line(exc)}", reusable=False)
        self._rv.give_up(fence, f"rank {self.rank} failed in {self._phase}: {err.detail}", err.peers or (self.rank,))
        return err

    def _set_phase(self, phase: str) -> None:
        self._phase = phase
        if self.recording is not None:
            self.recording.append(("phase", phase, None))

    # ---- steady steps replayed (layoutlang/runtime/replay.py) ------------------------------
    def _replay_key(self, schedule: Schedule, src: dict, dst: dict, device: torch.device) -> tuple | None:
        """What a record of this step would be valid for; None where no record can replay it."""
        hooks = type(self.hooks)
        if (not self.steady or self.verify
                or hooks.before_bucket is not RefitHooks.before_bucket or hooks.on_send is not RefitHooks.on_send):
            return None
        if id(schedule) not in self._replayable:  # (schedules live as long as the Refitter)
            self._replayable[id(schedule)] = (replayable(schedule), stages(schedule))
        plain, staged = self._replayable[id(schedule)]
        if not plain or (staged and not self._keeps_staging(device)):
            return None  # (a record of staged steps holds their buffers: only kept arenas' ones)
        return tensor_key(src, dst)

    def _recordable(self, key: tuple | None, schedule: Schedule) -> list | None:
        """The arenas' blocks if this step may be recorded: its tensors are the last step's, and
        the arenas already hold what a step carves (the record keeps their buffers); none
        where the rank stages nothing."""
        if key is None or key != self._last_key:
            return None
        if not self._replayable[id(schedule)][1]:
            return []  # every view is of the caller's tensors
        if not self._arenas:
            return None
        if any(a.block is None or a.want > a.held for a in self._arenas):
            return None
        return [a.block for a in self._arenas]

    def _replay(self, step: int, fence: str) -> None:
        """Run the record of the last walked steady step: its copies, posts and waits, in order."""
        record, works, deadlines = self._record, {}, {}
        self.replayed += 1
        try:
            for kind, a, b in record.actions:
                if kind == "copy":
                    a.copy_(b)
                elif kind == "post":
                    works[a] = self.transport.post(*b)
                    deadlines[a] = time.monotonic() + self.timeout.total_seconds()
                    if self._stale:
                        self._delete_stale()
                elif kind == "wait":
                    which, ops, what = b
                    posted = works[a]
                    self.transport.wait([posted[i] for i in which], ops, what, deadlines[a])
                elif kind == "zero":
                    a.zero_()
                elif kind == "reshape":  # (no view of one in the other's shape: `BucketRun.copy`)
                    a.copy_(b.reshape(a.shape))
                else:
                    self._phase = a
        except Exception as exc:  # noqa: BLE001 - as in a walked bucket
            err = self._bucket_failed(step, fence, exc)
            raise err from (None if err is exc else exc)
        self.sent_bytes += record.sent_bytes
        self.received_bytes += record.received_bytes
        self.local_bytes += record.local_bytes
        self.staged_ahead += record.staged_ahead
        self.meter = StagingMeter(peak=record.peak, per_bucket_peak=list(record.per_bucket_peak))

    def _check_steady(self, step: int, src_tensors, dst_tensors, strided: bool) -> None:
        """A steady step's check, local only: the agreement's tensor check, and no non-contiguous
        tensor where the agreed schedule assumed contiguous ones (it would cut other buckets).
        A failure leaves its reason at the step's fence, where peers that time out on this
        rank's transfers read it."""
        problems = self._check_tensors(src_tensors, dst_tensors)
        if strided and not self._agreed_strided:
            problems.append("a tensor is not contiguous, but every tensor was contiguous when the ranks agreed "
                            "(pass non-contiguous tensors from the first step on, or use Refitter(steady=False))")
        if not problems:
            return
        detail = "local tensors do not match the layouts: " + "; ".join(problems)
        self._rv.give_up(self._fence, f"rank {self.rank} failed its check in step {step}: {'; '.join(problems)}",
                         (self.rank,))
        raise RefitError.at(self.rank, step, "check", detail, peers=(self.rank,), reusable=False)

    def _prefix(self, step: int, *parts) -> str:
        """A meeting's prefix; its count and gate are deleted two steps later (by rank 0)."""
        prefix = self._rv.key(step, *parts)
        self._keys.setdefault(step, []).extend([(f"{prefix}/count", True), (f"{prefix}/gate", True)])
        return prefix

    def _meet(self, step: int, prefix: str, what: str, *, reusable: bool, note: str = "",
              marks: tuple[bool, ...] = (), seat: str, leave: bool = False) -> tuple[int, ...]:
        """Meet every rank at `prefix`, sitting in this Refitter's seats of kind `seat` (no
        per-rank key per step). `leave`: the step's last meeting, after which a rank returns
        (the store's host passes it only once every other rank has read it: rendezvous.py)."""
        if leave and self._rv.host is not None:
            self._keys.setdefault(step, []).append((f"{prefix}/left", True))
        try:
            return self._rv.meet(prefix, self.timeout, what=what, note=note, marks=marks,
                                 seat=self._rv.key("seat", seat), leave=leave)
        except Abandoned as exc:
            raise RefitError.at(self.rank, step, self._phase, exc.reason, peers=exc.peers,
                                reusable=reusable) from None

    def _read_notes(self, step: int, meeting: str) -> list[str]:
        """Every rank's note at `meeting`, then one more meeting: rank 0 may host the store, and a
        rank 0 that raised and exited at once would leave the others reading a dead store (and
        no rank may sit down at the next `meeting` before everyone has read this one's)."""
        notes = self._rv.notes(self._rv.key(step, meeting), self._rv.key("seat", meeting))
        self._meet(step, self._prefix(step, meeting, "read"), "read the others' notes", reusable=True, seat="read",
                   leave=True)  # (the step raises next)
        return notes

    def _forget(self, step: int) -> None:
        """Every rank met at step+1, so step's keys are unused: ours (rank 0: the shared ones) are
        deleted while this step's first transfers fly (off the critical path), or now if too
        many are waiting."""
        self._stale += [key for key, shared in self._keys.pop(step, ()) if not shared or self.rank == 0]
        if len(self._stale) > STALE_KEYS:
            self._delete_stale()

    def _delete_stale(self) -> None:
        stale, self._stale = self._stale, []
        for key in stale:
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
        return self.transport.device()

    def _agree(self, step: int, src_tensors, dst_tensors, strided: bool) -> bool:
        """Same plan everywhere, right tensors everywhere, every rank present in time.

        One meeting: each rank marks whether its tensors have problems and whether they are
        non-contiguous; the plan digests are counted in the store until one agreement
        passes (a Refitter's plan, budget and overlap never change, and the n-th Refitter
        of a rank meets the n-th of the others). Notes are read only on trouble.
        Returns whether any rank passes non-contiguous tensors.
        """
        prefix = self._prefix(step, "agree")
        problems = self._check_tensors(src_tensors, dst_tensors)
        digest_key = f"{prefix}/digest/{self._digest}"
        if not self._plans_agreed:
            self._keys[step].append((digest_key, False))
            self._rv.add(digest_key, 1)
        note = (self._digest + "\n" + "\n".join(problems))[:NOTE_CHARS]
        troubled, strided_ranks = self._meet(step, prefix, f"start step {step}", reusable=True, note=note,
                                             marks=(bool(problems), strided), seat="agree")
        same = self._plans_agreed or self._rv.add(digest_key, 0) == self.world
        if same and not troubled:
            self._plans_agreed = True
            return strided_ranks > 0
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
        """This rank's tensors against the layouts (by NAME: shape, dtype, storage): at most 9
        problems, then a `hint:` per side where they have a known cause (`_tensor_hints`)."""
        problems, hints = [], []
        for side, held, given in (("source", self.src_held, src_tensors), ("destination", self.dst_held, dst_tensors)):
            if held and given is None:
                problems.append(f"{side} tensors are None but this rank holds {len(held)} {side} tensors")
                continue
            before = len(problems)
            for name, t in held.items():
                if name not in given:
                    problems.append(f"{side} tensor `{name}` is missing")
                    continue
                problem = shape_problem(t, given[name], self.rank)
                if problem:
                    problems.append(f"{side} tensor `{name}`: {problem}")
                    if len(problems) > 8:
                        break
            if len(problems) > before:
                hints += _tensor_hints(side, held, given)
            if len(problems) > 8:
                break
        return problems + hints

    # ---- one bucket -----------------------------------------------------------------
    def _bucket(self, schedule: Schedule, b: int, src, dst, device) -> list[str]:
        """Walk one bucket's steps (layoutlang/compiler/steps.py: the compiler decided every buffer and
        round; each kind has one handler here). With `overlap`, the steps after the bucket's last
        wait are left for `_finish_pending`, run once the next bucket's first messages are posted
        (different destination tensors; every message of this bucket has landed by then), and
        the next bucket's steps before its first post (`_stage_ahead`) run while this bucket's
        first round flies."""
        if self._ahead is not None and self._ahead[0] == b:
            _, run, start = self._ahead
        else:
            run, start = BucketRun(self, schedule.ops[b], src, dst, device, self._arena(b, device)), 0
        self._ahead = None
        steps = schedule.steps[b]
        tail = len(steps)
        overlap = self.overlap and not self.verify  # (checksums are messages: they stay in their bucket)
        if overlap:
            waits = [i for i, st in enumerate(steps) if st.kind == "wait"]
            tail = waits[-1] + 1 if waits else 0
        mismatches: list[str] = []
        first_post = True
        for st in steps[start:tail]:
            run.do(st)
            if st.kind != "post":
                continue
            if self._pending is not None:
                mismatches += self._finish_pending()  # while this bucket's first round flies
            if first_post and overlap and b + 1 < len(schedule.steps):
                self._stage_ahead(schedule, b + 1, src, dst, device)  # (after the pending bucket's release)
            first_post = False
            if self._stale:
                self._delete_stale()  # store cleanup while the network works
        mismatches += self._finish_pending()
        self._pending = (run, steps[tail:], schedule.ops[b], dst, device)
        if not self.overlap:
            mismatches += self._finish_pending()
        return mismatches

    def _stage_ahead(self, schedule: Schedule, b: int, src, dst, device) -> None:
        """Bucket `b`'s steps before its first post (zeroing, assembling, dequantizing sources,
        packing and staging sends, receive buffers), run while the previous bucket's messages
        fly. They read source tensors and write fresh buffers and destination tensors that no
        earlier bucket touches, and with the bucket before released, two buckets' staging is
        live at once, as `overlap` budgets for. Relay sends (they read a received copy) wait."""
        steps = schedule.steps[b]
        posts = [i for i, st in enumerate(steps) if st.kind == "post"]
        if not posts:
            return
        run = BucketRun(self, schedule.ops[b], src, dst, device, self._arena(b, device))
        phase = self._phase
        self._set_phase(f"bucket {b}")
        done = 0
        for st in steps[:posts[0]]:
            if st.op is not None and st.op.after:
                break
            run.do(st)
            done += 1
        self._set_phase(phase)
        self.staged_ahead += done
        self._ahead = (b, run, done)

    def _finish_pending(self) -> list[str]:
        """The pending bucket's last steps, its checksums, and its buffers released."""
        if self._pending is None:
            return []
        run, rest, ops, dst, device = self._pending
        self._pending = None
        for st in rest:
            run.do(st)
        mismatches = self._bucket_checksums(ops, dst, run.assembly, run.source_view, run.packed,
                                            device) if self.verify else []
        self.meter.release(run.allocated)
        if run.arena is not None:
            run.arena.reset(device)  # every buffer of the bucket is dead: the next carves them again
        return mismatches

    def failure(self, detail: str, peers=(), grace: float = 0.0) -> RefitError:
        """The error a transport raises for a fault of this step (layoutlang/runtime/transport.py): the
        reason a rank that failed first left, if there is one (`_root_cause`, looked for up to
        `grace` s), else `detail`; either way this Refitter is not reusable."""
        return self._root_cause(grace) or RefitError.at(self.rank, self._step, self._phase, detail,
                                                        peers=peers, reusable=False)

    def _root_cause(self, grace: float = 0.0) -> RefitError | None:
        """The reason a rank already left at this step's fence or the previous one's, if any: a
        peer that stopped answering is usually waiting on the rank that failed first, which
        this names (in steady steps a rank may finish a step whose failure it never saw).
        `grace`: how long to look for it. A peer whose connection closed may be a survivor that
        failed first and is leaving its reason right now (its sockets can close before that
        reason reaches the store): the reason it leaves, not that survivor, is the cause."""
        if self._rv is None:
            return None  # (no store meetings: nothing is left there)
        give_up = time.monotonic() + grace
        while True:
            for step in (self._step, self._step - 1):
                gate = f"{self._rv.key(step, 'fence')}/gate"
                try:
                    if not self._rv.store.check([gate]):
                        continue
                    reason, peers = parse_gate(self._rv.store.get(gate))
                except Exception:  # noqa: BLE001 - no store, no better reason: the caller's stands
                    return None
                if reason:
                    return RefitError.at(self.rank, self._step, self._phase, reason, peers=peers, reusable=False)
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.02)

    # ---- verification ---------------------------------------------------------------
    def _bucket_checksums(self, ops, dst, assembly, source_view, packed, device) -> list[str]:
        """Per op: the sender's checksum of what it sent vs the receiver's of what landed
        (a quantized-wire op: of the bytes, as packed and as stored)."""
        me, entry = self.rank, self.entry
        mismatches = []
        outgoing, incoming = [], []
        for op in ops:
            if op.src_rank == me:
                if op.wire and op.after:  # a relay sent the bytes its own copy holds
                    sent = landed(dst[op.src_name], op.wire, op.src_slice,
                                  tuple(self.dst_held[op.src_name].local_shape_at(me)))
                else:
                    sent = packed(op) if op.wire else source_view(op).to(wire_dtype(entry[op.key]))
                mine = _checksum(sent)
                if op.local:
                    got = _checksum(self._landed(op, dst, assembly))
                    if not torch.allclose(mine, got, rtol=1e-9, atol=0.0):
                        mismatches.append(self._mismatch(op))
                else:
                    outgoing.append((mine, op))
            elif op.dst_rank == me:
                incoming.append((torch.zeros(CHECKSUM_DIGITS, dtype=torch.float64, device=device), op))
        t = self.transport
        p2p = [t.message(True, s, op.dst_rank) for s, op in outgoing]
        p2p += [t.message(False, s, op.src_rank) for s, op in incoming]
        t.wait(t.post(p2p, "checksums"), [op for _, op in outgoing + incoming], "checksum")
        for expected, op in incoming:
            got = _checksum(self._landed(op, dst, assembly))
            if not torch.allclose(expected, got, rtol=1e-9, atol=0.0):
                mismatches.append(self._mismatch(op))
        return mismatches

    def _landed(self, op, dst, assembly) -> torch.Tensor:
        if op.wire:
            return landed(dst[op.dst_name], op.wire, op.dst_slice,
                          tuple(self.dst_held[op.dst_name].local_shape_at(self.rank)))
        base = assembly[op.dst_name] if op.dst_name in assembly else dst[op.dst_name]
        return _view(base, op.dst_slice)

    def _mismatch(self, op) -> str:
        return (f"`{op.key}` ({op.dst_name}[{', '.join(':'.join(map(str, e)) for e in op.dst_slice)}] on rank "
                f"{op.dst_rank}, from rank {op.src_rank}, op {op.id})")

    def _verify_result(self, step: int, mismatches: list[str]) -> None:
        """Every rank learns every rank's mismatches (through the store, only on trouble)."""
        prefix = self._prefix(step, "verify")
        (bad,) = self._meet(step, prefix, "finish verification", reusable=True,
                            note="; ".join(mismatches)[:NOTE_CHARS], marks=(bool(mismatches),), seat="verify",
                            leave=True)  # (unless a rank found mismatches: then the notes are read)
        if not bad:
            return
        bad = [n for n in self._read_notes(step, "verify") if n and n != "1"]
        raise RefitError.at(self.rank, step, "verification", "verification failed: destination contents differ "
                            "from the source: " + "; ".join(bad), reusable=True)


def as_given(tensors, held: dict[str, TensorIR]) -> dict:
    """A caller's tensors by name, each quantized one as its format's class (a tuple accepted)."""
    return {k: as_quantized(v, held[k].dtype) if k in held else v for k, v in (tensors or {}).items()}


def not_contiguous(value) -> bool:
    """Is this tensor (or any tensor of a quantized value: data, scales) not contiguous?"""
    parts = [value] if isinstance(value, torch.Tensor) else tensors_of(value)
    return any(isinstance(p, torch.Tensor) and not p.is_contiguous() for p in parts)


def shape_problem(t: TensorIR, value, rank: int) -> str | None:
    expected = tuple(t.local_shape_at(rank))  # ranks of a ragged split hold different extents
    if t.dtype in QUANTIZED:
        return storage_problem(as_quantized(value, t.dtype), t.dtype, expected)
    if not isinstance(value, torch.Tensor):
        return f"expected a torch.Tensor, got {type(value).__name__}"
    if tuple(value.shape) != expected or value.dtype != PLAIN_DTYPES[t.dtype]:
        return f"expected {list(expected)} {PLAIN_DTYPES[t.dtype]}, got {list(value.shape)} {value.dtype}"
    return None


_LAYOUT_DTYPE = {v: k for k, v in PLAIN_DTYPES.items()}   # torch dtype -> the layout's word for it


def _tensor_hints(side: str, held: dict[str, TensorIR], given) -> list[str]:
    """How to fix a side's tensors that do not match its layout, where the cause is a known one:
    tensors of another plain dtype than the layout says (fp32 masters where it says bf16), or
    tensors keyed by checkpoint keys where the layout wants its NAMEs (an HF `state_dict()`)."""
    return [h for h in (_dtype_hint(side, held, given), _key_hint(side, held, given)) if h]


def _dtype_hint(side: str, held: dict[str, TensorIR], given) -> str | None:
    """The first tensor whose torch dtype is another plain layout dtype: declare it in the layout."""
    for name, t in held.items():
        value = given.get(name)
        word = _LAYOUT_DTYPE.get(getattr(value, "dtype", None))
        if t.dtype in PLAIN_DTYPES and isinstance(value, torch.Tensor) and word and word != t.dtype:
            where = f" at {t.span.source.path}:{t.span.line}" if t.span is not None else ""
            return (f"hint: the {side} tensors are {word} where the {side} layout says {t.dtype} (`{name}`, declared"
                    f"{where}): declare `{word}` in the {side} layout (`default dtype {word}` before its tensors, or "
                    f"`{word}` after a tensor's dims) and keep passing them as they are: the plan converts between "
                    "the two sides' dtypes")
    return None


def _key_hint(side: str, held: dict[str, TensorIR], given) -> str | None:
    """Where a NAME is missing: the first given key that is a layout KEY (or a part's key) of a
    held tensor and not a NAME: the tensors are keyed by checkpoint keys."""
    if all(name in given for name in held):
        return None
    owners: dict[str, tuple[str, bool]] = {}   # key -> (NAME of the tensor holding it, is it a part's key)
    for name, t in held.items():
        owners.setdefault(t.key, (name, False))
        for region in t.regions or ():
            owners.setdefault(region.key, (name, region.key != t.key))
    for key in given:
        if key not in held and key in owners:
            name, part = owners[key]
            return (f"hint: the {side} tensors are keyed by checkpoint keys where the layout wants its NAMEs: "
                    f"`{key}` is the key of {'a part of ' if part else ''}`{name}`; pass each tensor under the NAME "
                    "its `tensor` statement declares (the rank's own state-dict names, e.g. "
                    "layoutlang.bridges.megatron.tensors(model) or named_parameters())")
    return None
