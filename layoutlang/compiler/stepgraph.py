"""A rank's steps as a dependency graph: what `layoutc plan --rank R --steps` lists in order.

`rank_graph` is the steps layoutlang/compiler/steps.py makes for one rank (what the runtime walks) as a
networkx DiGraph, data edges and a barrier per bucket, checked acyclic.
"""

from __future__ import annotations

import networkx as nx

from .plan import Plan
from .steps import MESSAGES, schedule


def rank_graph(plan: Plan, rank: int, budget_bytes: int | None = None, strided: bool = False,
               overlap: bool = False) -> nx.DiGraph:
    """The steps `rank` executes (layoutlang/compiler/steps.py, what the runtime walks) as a DAG (checked).

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
