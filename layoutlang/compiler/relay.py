"""Relays: destination replicas forward what they received (LANGUAGE.md 5, version 2).

When destination replicas outnumber the ranks that can feed them, every byte
leaves a source rank once per replica: a 4-rank trainer feeding 16 engine
replicas sends the model 4 times over each trainer link while the engine links
idle. A relay is the op that delivers a request from a destination rank that
already received the same piece (its `after` op) instead of from a source rank.

Groups: the requests of one template with the same piece index need identical
data (the ranks of one destination shard: replicas; the parts of a split piece
alike), at the same local slice. Per group and template member, a tree:

    roots     the members that hold the piece themselves (a local copy, free),
              else the `fanout` least-loaded members, fed by the source ranks
    rounds    every member that has the piece sends it to one that has not,
              least forwarding load first on both sides (doubling: depth
              ceil(log2(replicas / roots)) + 1)

Groups go largest bytes first and members in order, loads accumulating, so the
forwarding spreads over the replicas (greedy, like the selector). The source
ranks then feed the roots through the selector, seeded with the relay sends.

Copies: the same elements of one key in two slots of one stored destination
tensor on different ranks (EPLB's redundant experts: two physical slots of one
logical expert) are two instances, two templates, at different local slices,
so the trees above never see them together. A copy relay delivers one such
request from a rank that received the other (`Plan._copied`: op id -> the op it
waits for and that op's destination slice, which the forwarder reads): per
group, the least-loaded receiver is fed by the source ranks, and every holder
forwards to one that waits per round (a forwarder is never the receiver). The
two blocks sit alike but for their slot (the extent-1 stacked dims), so a
quantized wire's blocks and scales fall alike and the forwarder's packed bytes
are the copy's (per-tensor-scaled formats excepted, as above); never in a
template that the trees relay, and one stored tensor's instances share a bucket (graph.py), so a
copy's source has landed by the round it is sent in. Each fan-out is tried with
and without copy relays, under the same rule below.

Cost model: the busiest link, per rank the larger of network bytes sent and
received. Relays add sends and never remove a receive, so when the busiest
receiver is within RELAY_GAIN of the busiest link already the plan is left
alone at once (DeepSeek-V3 at 256 ranks: 0.92; no tree is built). Otherwise
every fan-out 1, 2, 4, ... below the largest group is tried; the widest within
RELAY_SLACK of the best link wins (shallower trees), and it replaces the plan
only if its busiest link is below RELAY_GAIN x the direct one (10 % lower: a
relay costs a round of latency, a smaller gain is not worth it): plans relays
cannot improve stay exactly as they were. `_prove` checks every relay before
the plan is kept.
"""

from __future__ import annotations

from .select import SELECTORS
from .wire import tensor_scaled

RELAY_GAIN = 0.9    # relays replace the direct plan only if its busiest link is 10 % lower
RELAY_SLACK = 1.01  # fan-outs within 1 % of the best busiest link: the widest wins (shallower trees)


def needed_recv(templates, world: int) -> list[int]:
    """Per rank, the network bytes it must receive whoever sends: its requests for pieces it does
    not hold (the receive floor of the busiest link)."""
    must = [0] * world
    for t in templates:
        n = len(t.members)
        for req in t.geometry.requests:
            if req.rank not in req.senders.members:
                must[req.rank] += req.bytes * n
    return must


def relay_stage(plan) -> None:
    """Route pieces through destination replicas when that lowers the busiest link (module doc)."""
    if not plan.relay or plan.selector_name != "balanced" or not plan.templates:
        return
    if not any(plan.send_load):
        return  # nothing crosses the network
    recv = _received(plan)
    direct = max(max(plan.send_load), max(recv))
    if max(recv) >= direct * RELAY_GAIN:
        return  # relays never lower a receive: they cannot gain enough (a receiver is busiest already)
    groups = _groups(plan.templates)
    copies = _copy_candidates(plan)
    if not groups and not copies:
        return
    widest = max((len(js) for _, _, js in groups), default=0)
    tried = []
    fanouts = []
    fanout = 1
    while fanout < widest:
        fanouts.append(fanout)
        fanout *= 2
    for fanout in fanouts or [None]:
        after, fwd = _trees(plan, groups, fanout) if fanout is not None else ((None,) * len(plan.templates),
                                                                              [0] * plan.world)
        for copying in ((False, True) if copies else (False,)):
            if fanout is None and not copying:
                continue  # nothing relayed: the direct plan
            copied, load = _copy_trees(plan, copies, after, list(fwd)) if copying else ({}, list(fwd))
            picks, load = _select_roots(plan, after, load, copied)
            # ties: the widest fan-out, then without copy relays (fewer hops)
            tried.append((max(max(load), max(recv)), fanout or 0, not copying, after, copied, picks, load))
    if not tried:
        return
    best = min(link for link, *_ in tried)
    link, _, _, after, copied, picks, load = max((x for x in tried if x[0] <= best * RELAY_SLACK),
                                                 key=lambda x: (x[1], x[2]))
    if link >= direct * RELAY_GAIN:
        return
    relays = _prove(plan.templates, after, picks) + _prove_copies(plan, after, copied, picks)
    plan.record_relays(after, {op: (src_op, slice_) for op, (src_op, slice_, *_) in copied.items()}, relays)
    plan.record_picks(picks, load)


def _received(plan) -> list[int]:
    """Network bytes each rank receives under the current picks (relays leave this unchanged:
    a request relayed was a network request, a local copy stays one)."""
    recv = [0] * plan.world
    for ti, t in enumerate(plan.templates):
        for j, req in enumerate(t.geometry.requests):
            for s in plan.picks(ti, j):
                if s != req.rank:
                    recv[req.rank] += req.bytes
    return recv


def _groups(templates) -> list[tuple[int, int, tuple[int, ...]]]:
    """(bytes, template, request indexes) of every piece two or more requests need, some of them
    over the network; largest first, then in template and request order."""
    out = []
    for ti, t in enumerate(templates):
        by_piece: dict[int, list[int]] = {}
        for j, req in enumerate(t.geometry.requests):
            by_piece.setdefault(req.piece, []).append(j)
        for js in by_piece.values():
            reqs = [t.geometry.requests[j] for j in js]
            if reqs[0].wire and tensor_scaled(reqs[0].wire):
                continue  # its blocks are quantized with the receiver's agreed amax: not forwarded
            if len(js) > 1 and any(r.rank not in r.senders.members for r in reqs):
                out.append((reqs[0].bytes, ti, tuple(js)))
    out.sort(key=lambda x: (-x[0], x[1], x[2]))
    return out


def _trees(plan, groups, fanout: int):
    """(after, forwarding load): per template None or per request None or per member the request
    whose receiver forwards to it (-1: fed by a source rank or locally)."""
    templates = plan.templates
    load = [0] * plan.world
    after: list = [None] * len(templates)
    for nbytes, ti, js in groups:
        t = templates[ti]
        reqs = t.geometry.requests
        rank = {j: reqs[j].rank for j in js}
        local = [j for j in js if rank[j] in reqs[j].senders.members]
        net = [j for j in js if rank[j] not in reqs[j].senders.members]
        if not local and len(net) <= fanout:
            continue  # every member fed directly: what the direct plan does
        n = len(t.members)
        waits = after[ti]
        if waits is None:
            waits = after[ti] = [None] * len(reqs)
        for j in net:
            if waits[j] is None:
                waits[j] = [-1] * n
        least = lambda j: (load[rank[j]], rank[j])
        for m in range(n):
            if local:
                holders, waiting = sorted(local, key=least), sorted(net, key=least)
            else:
                order = sorted(net, key=least)
                holders, waiting = order[:fanout], order[fanout:]
            while waiting:
                senders = sorted(holders, key=least)
                take, waiting = waiting[:len(senders)], waiting[len(senders):]
                for h, w in zip(senders, take):
                    waits[w][m] = h
                    load[rank[h]] += nbytes
                holders = holders + take
    frozen = tuple(None if w is None else tuple(None if x is None else tuple(x) for x in w) for w in after)
    return frozen, load


def _select_roots(plan, after, fwd: list[int], copied: dict | None = None):
    """Senders for every request that is not a relay (the selector's order and rule, its load
    seeded with the relay sends); a relay's sender is the rank of the request it waits for (a
    copy relay's: the receiver of the op it waits for)."""
    selector = SELECTORS[plan.selector_name](plan.world, plan.ranks_per_node)
    selector.load[:] = fwd
    templates = plan.templates
    by_request: dict[tuple[int, int], dict[int, int]] = {}  # (template, request) -> member -> forwarder
    for _, _, forwarder, ti, j, member in (copied or {}).values():
        by_request.setdefault((ti, j), {})[member] = forwarder
    order = sorted((t.geometry.is_part(req), -req.bytes, i, j) for i, t in enumerate(templates)
                   for j, req in enumerate(t.geometry.requests))
    picks: list[list] = [[None] * len(t.geometry.requests) for t in templates]
    for _, neg_bytes, i, j in order:
        t = templates[i]
        reqs = t.geometry.requests
        req = reqs[j]
        waits = after[i][j] if after[i] is not None else None
        forwarded = by_request.get((i, j))
        if forwarded is not None:
            n = len(t.members)
            fed = iter(selector.pick(req.rank, req.senders, n - len(forwarded), -neg_bytes, j)
                       if n > len(forwarded) else ())
            picks[i][j] = tuple(forwarded[m] if m in forwarded else next(fed) for m in range(n))
            continue
        if waits is None:
            picks[i][j] = tuple(selector.pick(req.rank, req.senders, len(t.members), -neg_bytes, j))
            continue
        roots = sum(1 for k in waits if k < 0)
        fed = iter(selector.pick(req.rank, req.senders, roots, -neg_bytes, j) if roots else ())
        picks[i][j] = tuple(next(fed) if k < 0 else reqs[k].rank for k in waits)
    return picks, selector.load


def _prove(templates, after, picks) -> int:
    """Every relay forwards what its `after` op delivered: the same piece (same logical elements,
    same local slice), received by the forwarding rank, and the chain of waits ends at an op fed
    by a source rank (acyclic). Each request is still delivered by exactly one op, so the tiling
    proof (verify.py) still gives exactly-once per destination element. Returns the relay count."""
    count = 0
    for ti, waits in enumerate(after):
        if waits is None:
            continue
        t = templates[ti]
        reqs = t.geometry.requests
        for j, per_member in enumerate(waits):
            if per_member is None:
                continue
            for m, k in enumerate(per_member):
                if k < 0:
                    continue
                count += 1
                fault = None
                if not 0 <= k < len(reqs) or k == j:
                    fault = f"waits for request {k}"
                elif reqs[k].piece != reqs[j].piece:
                    fault = f"waits for request {k} of another piece"
                elif picks[ti][j][m] != reqs[k].rank or reqs[k].rank == reqs[j].rank:
                    fault = f"is sent by rank {picks[ti][j][m]}, not by request {k}'s receiver"
                else:
                    steps, x = 0, k
                    while waits[x] is not None and waits[x][m] >= 0:
                        x, steps = waits[x][m], steps + 1
                        if steps > len(reqs):
                            fault = "waits in a cycle"
                            break
                if fault:
                    raise AssertionError(f"relay of template {ti} request {j} member {m} {fault}")
    return count


def _copy_candidates(plan) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """(bytes, [(instance, request, receiver)]) per group of network requests that carry the same
    elements of one key into blocks of one shape in one stored tensor, on two ranks or more;
    largest first. Only instances whose (stored tensor, key) occurs more than once are read."""
    matches = plan.key_matches
    seen: dict[tuple[int, str], int] = {}
    dup: set[tuple[int, str]] = set()
    for i, m in enumerate(matches):
        k = (id(plan.stored(i)), m.key)
        if seen.setdefault(k, i) != i:
            dup.add(k)
    if not dup:
        return []
    groups: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, m in enumerate(matches):
        stored = plan.stored(i)
        if (id(stored), m.key) not in dup:
            continue
        ti, _ = plan.template_of(i)
        g = plan.templates[ti].geometry
        for j, req in enumerate(g.requests):
            if req.rank in req.senders.members or (req.wire and tensor_scaled(req.wire)):
                continue  # a local copy; blocks quantized with the receiver's agreed amax
            piece = g.pieces[req.piece]
            if any(len(d) != 2 for d in piece.dst_slice):
                continue  # a strided slice: its element order is its own
            # the block's place but for its slot (extent-1 stacked dims): a quantized wire's
            # blocks and scales then fall alike, so the forwarder's packed bytes are the copy's
            place = tuple(d if d[1] - d[0] != 1 else None for d in piece.dst_slice)
            shape = tuple(b - a for a, b in piece.dst_slice)
            key = (id(stored), m.key, piece.logical, shape, place, req.wire, req.bytes)
            groups.setdefault(key, []).append((i, j, req.rank))
    out = [(key[-1], nodes) for key, nodes in groups.items() if len({r for *_, r in nodes}) > 1]
    out.sort(key=lambda x: (-x[0], x[1][0]))
    return out


def _copy_trees(plan, copies, after, load: list[int]):
    """(copied, load): per copy relay's op id (the op it waits for, that op's destination slice,
    the forwarding rank, its template, request and member), the forwarding load added. Groups
    in a template the trees relay are left to them."""
    copied: dict[int, tuple] = {}
    for nbytes, nodes in copies:
        nodes = [x for x in nodes if after[plan.template_of(x[0])[0]] is None]
        if len({r for *_, r in nodes}) < 2:
            continue
        least = lambda x: (load[x[2]], x[2], x[0])  # noqa: E731
        order = sorted(nodes, key=least)
        holders, waiting = order[:1], order[1:]
        while waiting:
            fed_now, still = [], []
            busy: set[int] = set()
            for w in waiting:
                free = [h for h in holders if h[2] != w[2] and id(h) not in busy]
                if not free:
                    still.append(w)
                    continue
                h = min(free, key=least)
                busy.add(id(h))
                ti, g = _geometry(plan, h[0])
                slice_ = g.pieces[g.requests[h[1]].piece].dst_slice
                wti, member = plan.template_of(w[0])
                copied[plan.op_range(w[0]).start + w[1]] = (plan.op_range(h[0]).start + h[1], slice_, h[2], wti, w[1],
                                                             member)
                load[h[2]] += nbytes
                fed_now.append(w)
            if not fed_now:
                break  # the rest sit on the holders' own ranks: fed directly
            holders = holders + fed_now
            waiting = still
    return copied, load


def _geometry(plan, instance: int):
    ti, _ = plan.template_of(instance)
    return ti, plan.templates[ti].geometry


def _prove_copies(plan, after, copied: dict, picks) -> int:
    """Every copy relay forwards what the op it waits for delivered: into the same stored tensor,
    the same key's same logical elements into a block of the same shape, received by the
    forwarding rank (not the relay's receiver), outside any template the trees relay, and the
    chain of waits ends at an op fed by a source rank. Returns the copy relay count."""
    for op, (src_op, slice_, forwarder, ti, j, member) in copied.items():
        i, k = plan.instance_of(op), plan.instance_of(src_op)
        g, h = _geometry(plan, i)[1], _geometry(plan, k)[1]
        req, held = g.requests[j], h.requests[src_op - plan.op_range(k).start]
        mine, theirs = g.pieces[req.piece], h.pieces[held.piece]
        fault = None
        if plan.stored(i) is not plan.stored(k) or plan.key_matches[i].key != plan.key_matches[k].key:
            fault = "waits for an op into another tensor or key"
        elif mine.logical != theirs.logical or slice_ != theirs.dst_slice or req.wire != held.wire or \
                [d for d in mine.dst_slice if d[1] - d[0] != 1] != [d for d in theirs.dst_slice if d[1] - d[0] != 1]:
            fault = "waits for an op of other elements (or another block place or wire)"
        elif held.rank != forwarder or forwarder == req.rank or picks[ti][j][member] != forwarder:
            fault = f"is sent by rank {picks[ti][j][member]}, not by the receiver of op {src_op}"
        elif after[ti] is not None or after[_geometry(plan, k)[0]] is not None:
            fault = "is in a template the trees relay"
        else:
            steps, x = 0, src_op
            while x in copied:
                x, steps = copied[x][0], steps + 1
                if steps > len(copied):
                    fault = "waits in a cycle"
                    break
        if fault:
            raise AssertionError(f"copy relay op {op} {fault}")
    return len(copied)
