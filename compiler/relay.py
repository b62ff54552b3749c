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
    if not groups:
        return
    widest = max(len(js) for _, _, js in groups)
    tried = []
    fanout = 1
    while fanout < widest:
        after, fwd = _trees(plan, groups, fanout)
        picks, load = _select_roots(plan, after, fwd)
        tried.append((max(max(load), max(recv)), fanout, after, picks, load))
        fanout *= 2
    if not tried:
        return
    best = min(link for link, *_ in tried)
    link, _, after, picks, load = max((x for x in tried if x[0] <= best * RELAY_SLACK), key=lambda x: x[1])
    if link >= direct * RELAY_GAIN:
        return
    plan.relays = _prove(plan.templates, after, picks)
    plan._after, plan._picks, plan.send_load = after, picks, load


def _received(plan) -> list[int]:
    """Network bytes each rank receives under the current picks (relays leave this unchanged:
    a request relayed was a network request, a local copy stays one)."""
    recv = [0] * plan.world
    for ti, t in enumerate(plan.templates):
        for j, req in enumerate(t.geometry.requests):
            for s in plan._picks[ti][j]:
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


def _select_roots(plan, after, fwd: list[int]):
    """Senders for every request that is not a relay (the selector's order and rule, its load
    seeded with the relay sends); a relay's sender is the rank of the request it waits for."""
    selector = SELECTORS[plan.selector_name](plan.world, plan.ranks_per_node)
    selector.load[:] = fwd
    templates = plan.templates
    order = sorted((t.geometry.is_part(req), -req.bytes, i, j) for i, t in enumerate(templates)
                   for j, req in enumerate(t.geometry.requests))
    picks: list[list] = [[None] * len(t.geometry.requests) for t in templates]
    for _, neg_bytes, i, j in order:
        t = templates[i]
        reqs = t.geometry.requests
        req = reqs[j]
        waits = after[i][j] if after[i] is not None else None
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
