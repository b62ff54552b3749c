"""Choosing a sender among every rank that holds a piece.

Load is network bytes sent: a local copy uses no link, so it adds none.

`Balanced` (the default) prefers the receiving rank itself (a local copy),
then ranks on the receiver's node (`ranks_per_node`), then the least-loaded
sender so far; ties go to the lowest rank, so the choice is deterministic.
`RoundRobin` is the rule of Megatron-LM's refit planner, kept to be measured
against: requests rotate over the candidates, the rotation restarting for
every tensor, so with fewer requests per tensor than replicas the first
replicas do all the work.

Selectors take a *batch*: the same request made by `n` tensors that share a
template (identical layers or experts). Cost grows with templates, not tensors.

Splitting (layoutlang/compiler/plan.py `split_stage`): whole pieces balance only when
there are more of them than senders. When a request overloads its sender,
`Balanced.parts` says into how many parts to cut it so that idle replicas can
share it; the SPLIT_* constants below are the policy.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

from .ranks import RankSet

# The policy of splitting (layoutlang/compiler/plan.py `split_stage`), in units of the send floor
# (all bytes / every rank that can send: what a perfectly even plan would give each).
SPLIT_TRIGGER = 1.1  # busiest sender above this x the floor: cut; at or below it the plan stays whole
SPLIT_GRAIN = 16     # parts of about floor / 16: greedy placement then overshoots the floor by ~1/16
SPLIT_MIN_BYTES = 64 * 1024  # no part below this: a smaller message costs its latency, not its bytes
SPLIT_GAIN = 0.99    # a split plan replaces the whole one only if its busiest sender is 1 % lower
SPLIT_ROUNDS = 4     # cut, select again: at most this many times


class Balanced:
    name = "balanced"

    HEAP_FROM = 128  # candidate sets this large keep a heap across requests (replicas in the thousands)

    def __init__(self, world: int, ranks_per_node: int | None):
        self.load = [0] * world
        self.ranks_per_node = ranks_per_node
        self._heaps: dict[int, tuple] = {}
        self._lowest: dict[int, int] = {}  # id(candidate range) -> its least load, once picking is over

    def candidates(self, receiver: int, ranks: RankSet):
        if receiver in ranks.members:
            return (receiver,)
        rpn = self.ranks_per_node
        if rpn:
            node = receiver // rpn
            near = ranks.between(node * rpn, (node + 1) * rpn)
            if near:
                return near
        return ranks.ranks

    def pick(self, receiver: int, ranks: RankSet, n: int, nbytes: int, ordinal: int) -> list[int]:
        """Senders for n identical requests of `nbytes` each, in member order."""
        cands = self.candidates(receiver, ranks)
        load = self.load
        if len(cands) == 1:
            if cands[0] != receiver:
                load[cands[0]] += n * nbytes
            return [cands[0]] * n
        if len(cands) >= self.HEAP_FROM and cands is ranks.ranks and n < len(cands):
            return self._from_heap(cands, n, nbytes)
        loads = [load[r] for r in cands]
        if max(loads) - min(loads) < nbytes:
            # Loads within one request of each other: the greedy sequence is
            # round after round over the candidates in (load, rank) order.
            order = sorted(cands, key=lambda r: (load[r], r))
            k = len(order)
            rounds, extra = divmod(n, k)
            for i, r in enumerate(order[:k if rounds else extra]):
                load[r] += (rounds + (1 if i < extra else 0)) * nbytes
            return (order * (rounds + 1))[:n]
        if n >= len(cands) and nbytes > 0:
            return self._levels(cands, loads, n, nbytes)
        if n <= len(cands):
            # The n least loaded, if none of them would be picked twice (the n-th is
            # within one request of the least): the greedy takes them in order.
            smallest = sorted(zip(loads, cands))[:n]  # a C sort beats nsmallest's Python loop
            if smallest[-1][0] < smallest[0][0] + nbytes:
                for _, r in smallest:
                    load[r] += nbytes
                return [r for _, r in smallest]
        if n * len(cands) <= 256:  # few picks: a C-speed scan beats building a heap
            out = []
            for _ in range(n):
                r = min(cands, key=load.__getitem__)  # first minimum: the lowest rank on ties
                load[r] += nbytes
                out.append(r)
            return out
        heap = [(load[r], r) for r in cands]
        heapq.heapify(heap)
        out = []
        for _ in range(n):
            lo, r = heap[0]
            out.append(r)
            heapq.heapreplace(heap, (lo + nbytes, r))
        for lo, r in heap:
            load[r] = lo
        return out

    @staticmethod
    def cuttable(ranks: RankSet, nbytes: int) -> bool:
        """Whether `parts` could cut a request for these candidates and bytes, whatever the loads:
        two candidates or more, and room for two parts of SPLIT_MIN_BYTES."""
        return len(ranks) >= 2 and nbytes // SPLIT_MIN_BYTES >= 2

    def parts(self, receiver: int, ranks: RankSet, nbytes: int, line: float, grain: float) -> int:
        """Into how many parts to cut a request picked from a sender above `line` (1: keep it whole).

        Parts of about `grain` bytes, never more than the candidate senders (more would
        only queue on them) nor smaller than SPLIT_MIN_BYTES; whole when the receiver
        holds the piece (a local copy uses no link), when it has one candidate, or when
        every candidate is above the line already (cutting would only move the overload).
        Read once picking is over: `load` is final.
        """
        if not self.cuttable(ranks, nbytes):
            return 1
        count = min(math.ceil(nbytes / grain), nbytes // SPLIT_MIN_BYTES)
        if count < 2:
            return 1
        cands = self.candidates(receiver, ranks)
        if len(cands) < 2:
            return 1
        shared = cands is ranks.ranks  # one object per piece: its least load is worth keeping
        low = self._lowest.get(id(cands)) if shared else None
        if low is None:
            low = min(self.load[r] for r in cands)
            if shared:
                self._lowest[id(cands)] = low  # the set outlives this selector, so the id stays unique
        return min(count, len(cands)) if low <= line else 1

    def _levels(self, cands, loads: list[int], n: int, nbytes: int) -> list[int]:
        """The greedy rule's n picks at once, for at least as many picks as candidates (a batch
        of requests that share one candidate set, layoutlang/compiler/members.py).

        Picking the least loaded (lowest rank on ties) and adding `nbytes`, n times, takes
        rank r for the k-th time (k >= 0) at load L_r + k * nbytes, which is
        lo + (b_r + k) * nbytes + e_r with lo the least load and (b_r, e_r) = divmod(L_r - lo,
        nbytes): the picks are these (load, rank) pairs in ascending order, so level by level
        (b_r + k = 0, 1, ...), each level holding the ranks with b_r <= level in (e_r, rank)
        order. Between two levels at which ranks join, every level repeats the same ranks.
        """
        lo = min(loads)
        keyed = sorted(((x - lo) % nbytes, r, (x - lo) // nbytes) for r, x in zip(cands, loads))
        joins = sorted({b for _, _, b in keyed})  # the levels at which ranks join
        out: list[int] = []
        need = n
        for i, level in enumerate(joins):
            active = [r for _, r, b in keyed if b <= level]
            span = joins[i + 1] - level if i + 1 < len(joins) else need  # levels until the next join
            full = min(span, need // len(active))
            out += active * full
            need -= full * len(active)
            if full < span:  # the last level taken, partly
                out += active[:need]
                break
        load = self.load
        for r, times in Counter(out).items():
            load[r] += times * nbytes
        return out

    def _from_heap(self, cands, n: int, nbytes: int) -> list[int]:
        """The greedy rule over a large shared candidate set, O(log n) a pick.

        One heap per set (sets are shared by every request for a piece), one
        entry per rank; an entry whose recorded load is older than the rank's
        load (raised through another set) is refreshed when it surfaces. Loads
        only grow, so a stale entry surfaces early: the top, once fresh, is the
        least loaded rank, lowest rank on ties — the same choice as a scan.
        """
        load = self.load
        hit = self._heaps.get(id(cands))
        if hit is None:
            heap = [(load[r], r) for r in cands]
            heapq.heapify(heap)
            self._heaps[id(cands)] = (cands, heap)  # the set stays alive, so its id stays unique
        else:
            heap = hit[1]
        out = []
        for _ in range(n):
            lo, r = heap[0]
            while lo != load[r]:
                heapq.heapreplace(heap, (load[r], r))
                lo, r = heap[0]
            out.append(r)
            load[r] += nbytes
            heapq.heapreplace(heap, (load[r], r))
        return out


class RoundRobin:
    name = "round_robin"

    def __init__(self, world: int, ranks_per_node: int | None):
        self.load = [0] * world

    def pick(self, receiver: int, ranks: RankSet, n: int, nbytes: int, ordinal: int) -> list[int]:
        r = ranks[ordinal % len(ranks)]
        if r != receiver:
            self.load[r] += n * nbytes
        return [r] * n


SELECTORS = {"balanced": Balanced, "round_robin": RoundRobin}


def select_senders(plan, templates: tuple) -> tuple[list[list], object]:
    """(picks per template request, the selector with its final load) for these templates.

    Whole requests go first, largest first; then the parts of split requests,
    largest first: parts fill the gaps the whole ones leave (they were cut for
    that), so placing them last keeps them off senders that still await whole
    requests only they can send.
    """
    selector = SELECTORS[plan.selector_name](plan.world, plan.ranks_per_node)
    order = sorted(((t.geometry.is_part(req), -req.bytes, i, j) for i, t in enumerate(templates)
                    for j, req in enumerate(t.geometry.requests)))
    picks: list[list] = [[None] * len(t.geometry.requests) for t in templates]
    for step, (_, neg_bytes, i, j) in enumerate(order):
        if step % 4096 == 0:
            plan.progress("senders", step, len(order))
        t = templates[i]
        req = t.geometry.requests[j]
        picks[i][j] = tuple(selector.pick(req.rank, req.senders, len(t.members), -neg_bytes, j))
    plan.progress("senders", len(order), len(order))
    return picks, selector
