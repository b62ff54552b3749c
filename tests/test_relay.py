"""Relays (LANGUAGE.md 5, version 2): destination replicas forward pieces they received.

Expected values come from hand-computed trees (written out below), the layout
text, the slow simulator (tests/plan_simulator.py, which runs relays in
`after` order reading the forwarding rank's destination) and the reference
enumerator (random layouts with destination replicas), and a real gloo refit
whose every destination element is checked by layoutlang/runtime/fill.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from math import prod

import networkx as nx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import layoutlang
from layoutlang.compiler import compile_plan
from layoutlang.elaborate import load
from layoutlang.modes import Run
from layoutlang.report.render import render_json, render_text
from layoutlang.runtime.launch import launch

from layout_strategies import Style, render_layout
from plan_simulator import ReferenceView, check_plan_views, check_stats, simulate
from reference_enumerator import MeshSpec
from wire_rule import op_wire, slice_elements
from test_plan_property import DST_PATH, SRC_PATH, pairs

SRC1 = "mesh m (dp=1)\ntensor w [64, 64]\n"
DST4 = "mesh m (dp=4) at 1\ntensor w [64, 64]\n"
W = 64 * 64 * 2  # one bf16 copy of w: 8192 B


def _plan(src: str, dst: str, **kw):
    return compile_plan(layoutlang.loads(src, "src.layout"), layoutlang.loads(dst, "dst.layout"), **kw)


def test_one_source_rank_to_four_replicas_by_hand():
    """Rank 0 holds w; ranks 1-4 each want all of it.

    Direct: rank 0 sends w four times: busiest link 4 W. Relays (layoutlang/compiler/relay.py):
    fan-out 1 gives root 1; 1 -> 2; then 2 -> 3, 1 -> 4: rank 1 sends 2 W, link 2 W.
    Fan-out 2 gives roots 1, 2 (rank 0 sends 2 W); 1 -> 3, 2 -> 4: link 2 W too; the
    tie goes to the wider fan-out (a shallower tree). Ops stay in canonical order
    (destination rank); a relay names the op that delivered w to its sender.
    """
    direct = _plan(SRC1, DST4, relay=False)
    assert [(op.src_rank, op.dst_rank, op.after) for op in direct.ops] == [(0, 1, ()), (0, 2, ()), (0, 3, ()),
                                                                           (0, 4, ())]
    assert direct.stats["busiest_link_bytes"] == 4 * W
    plan = _plan(SRC1, DST4)
    assert [(op.src_rank, op.dst_rank, op.after) for op in plan.ops] == [(0, 1, ()), (0, 2, ()), (1, 3, (0,)),
                                                                         (2, 4, (1,))]
    relay = plan.ops[2]
    assert (relay.src_name, relay.src_slice, relay.dst_slice) == ("w", ((0, 64), (0, 64)), ((0, 64), (0, 64)))
    stats = plan.stats
    assert (stats["busiest_link_bytes"], stats["link_floor_bytes"], stats["relays"]) == (2 * W, W, 2)
    assert (stats["max_send_bytes"], stats["max_recv_bytes"]) == (2 * W, W)
    assert plan.relay_depths == {2: 1, 3: 1}
    assert plan.digest != direct.digest


def test_relay_renders_after_in_json_and_text():
    plan = _plan(SRC1, DST4)
    ops = json.loads(render_json(plan))["ops"]
    assert [op.get("after") for op in ops] == [None, None, [0], [1]]
    text = render_text(plan, rank=3)
    assert "op 2 w: rank 1 w[0:64, 0:64] -> rank 3 w[0:64, 0:64] (8192 B) after 0" in text


@pytest.mark.parametrize("src, dst", [
    ("mesh m (dp=4)\ntensor w [64, 64]\n", "mesh m (dp=4)\ntensor w [64, 64]\n"),       # every copy local
    ("mesh m (dp=4)\ntensor w [64, 64]\n", "mesh m (dp=1) at 4\ntensor w [64, 64]\n"),  # the receiver is busiest
    ("mesh m (tp=2)\ntensor w [64 over tp, 64]\n", "mesh m (tp=2) at 2\ntensor w [64 over tp, 64]\n"),  # no replicas
])
def test_plans_relays_cannot_improve_stay_as_they_were(src, dst):
    plan, direct = _plan(src, dst), _plan(src, dst, relay=False)
    assert plan.ops == direct.ops and plan.stats["relays"] == 0
    assert plan.stats["busiest_link_bytes"] == direct.stats["busiest_link_bytes"]


def test_relay_off_is_named_in_the_digest_only():
    """The default plan keeps the digest inputs it always had; `relay=False` adds ("relay", False)."""
    on, off = _plan(SRC1, DST4), _plan(SRC1, DST4, relay=False)
    assert on.digest == _plan(SRC1, DST4, relay=True).digest and on.digest != off.digest
    assert _plan(SRC1, DST4, split=False).digest != off.digest


def test_simulator_rejects_a_relay_of_data_not_yet_received():
    """A relay whose sender never received the piece: the simulator names it (the check can fail)."""
    plan = _plan(SRC1, DST4)
    bad = list(plan.ops)
    bad[3] = dataclasses.replace(bad[3], src_rank=3, after=(0,))  # op 0 delivers to rank 1, not 3
    fake = type("P", (), {"ops": tuple(bad), "src": plan.src, "dst": plan.dst})()
    src, dst = layoutlang.loads(SRC1, "src.layout"), layoutlang.loads(DST4, "dst.layout")
    from plan_simulator import RunsView
    with pytest.raises(AssertionError, match="do not deliver to rank 3"):
        simulate(RunsView(src), RunsView(dst), fake)
    early = list(plan.ops)
    early[3] = dataclasses.replace(early[3], after=())  # read rank 2's copy with no wait: maybe empty yet
    early[1] = dataclasses.replace(early[1], after=(3,))  # ... and rank 2 receives only after it
    fake = type("P", (), {"ops": tuple(early), "src": plan.src, "dst": plan.dst})()
    with pytest.raises(AssertionError):
        simulate(RunsView(src), RunsView(dst), fake)


# ---- property: random layouts with destination replicas against the reference ----------

@st.composite
def replica_pairs(draw):
    """A random pair whose destination mesh gains a replica axis (no tensor splits over it)."""
    pair = draw(pairs())
    k = draw(st.sampled_from([3, 4, 6]))
    mesh = pair.dst.mesh
    axes = (("rep", k),) + mesh.axes if draw(st.booleans()) else mesh.axes + (("rep", k),)
    dst = dataclasses.replace(pair.dst, mesh=MeshSpec(mesh.name, axes, mesh.offset))
    return dataclasses.replace(pair, dst=dst, dst_text=render_layout(dst, Style(draw)))


@pytest.mark.timeout(900)
@settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(replica_pairs())
def test_relay_plans_are_exactly_once_against_the_reference(pair):
    src = layoutlang.loads(pair.src_text, SRC_PATH)
    dst = layoutlang.loads(pair.dst_text, DST_PATH)
    plan, direct = compile_plan(src, dst), compile_plan(src, dst, relay=False)
    report = simulate(ReferenceView(src, pair.src), ReferenceView(dst, pair.dst), plan)
    assert report.dst_data_elements == report.elements, "every data element is received once"
    check_plan_views(plan, range(plan.world))
    check_stats(plan, report)
    # relays change senders only: the same receivers, slices and bytes as the direct plan
    strip = lambda ops: [(o.id, o.key, o.dst_rank, o.dst_name, o.dst_slice, o.bytes) for o in ops]
    assert strip(plan.ops) == strip(direct.ops)
    link, was = plan.stats["busiest_link_bytes"], direct.stats["busiest_link_bytes"]
    if plan.stats["relays"]:
        event("relays")
        assert link < was * 0.9  # kept only when they lower the busiest link by 10 % (layoutlang/compiler/relay.py)
        assert link >= plan.stats["link_floor_bytes"]
    else:
        assert plan.ops == direct.ops
    assert compile_plan(src, dst).ops == plan.ops  # a pure function of the inputs


# ---- gloo: a real refit with relays, every destination element checked --------------------

TRAIN = """
mesh train (tp=2)
tensor emb [100 pad 8 over tp, 32]
tensor norm [32]
for l in 0..2 {
  tensor layers.{l}.fc1 [(gate: 32 | up: 32) over tp, 32]
  tensor layers.{l}.fc2 [32, 32 over tp]
}
"""

# six single-rank engine replicas on ranks 2-7 (disjoint from the trainer), or on 0-5 (collocated)
INFER = """
arg AT = 2
mesh infer (dp=6) at AT
tensor embed as emb [100 pad 64, 32]
tensor norm [32] fp32
for l in 0..2 {
  tensor l{l}.gate_up as layers.{l}.fc1 [(gate: 32 | up: 32), 32] mxfp8
  tensor l{l}.down as layers.{l}.fc2 [32, 32] bf16
}
"""


def _destination_bytes(path: str, plan, args=None) -> int:
    """Every data element of every destination instance, once (counted from the layout), in the
    bytes the wire rule gives each op (tests/wire_rule.py)."""
    layout = load(path, args=args)
    data = sum(prod(sum(r.length for r in runs if isinstance(r, Run)) for runs in t.runs(rank))
               for t in layout.tensors for rank in range(layout.ranks) if t.holds(rank))
    assert sum(slice_elements(op.dst_slice) for op in plan.ops) == data
    held = {t.name: t for t in layout.tensors}
    return sum(op_wire(op.dst_slice, held[op.dst_name].dtype, tuple(held[op.dst_name].local_shape_at(op.dst_rank)))[1]
               for op in plan.ops)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("at, budget", [(2, None), (2, 2048), (0, None)], ids=["disjoint", "disjoint-buckets",
                                                                              "collocated"])
def test_gloo_refit_with_relays_is_exact(tmp_path, at, budget):
    (tmp_path / "train.layout").write_text(TRAIN)
    (tmp_path / "infer.layout").write_text(INFER)
    src, dst = str(tmp_path / "train.layout"), str(tmp_path / "infer.layout")
    plan = compile_plan(src, dst, dst_args={"AT": at})
    assert plan.stats["relays"] > 0
    assert any(op.after for op in plan.ops if op.key.endswith("fc1"))  # relays of an mxfp8 destination
    nproc = plan.world
    job = {"src": src, "dst": dst, "dst_args": {"AT": at}, "verify": True, "budget": budget, "steps": 2}
    results = launch(job, nproc, timeout=200)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
        assert r.result["checked_tensors"] == sum(1 for t in load(dst, {"AT": at}).tensors if t.holds(r.rank))
    received = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results)
    assert received == _destination_bytes(dst, plan, {"AT": at})  # every destination element once per step
    engine_only = [r for r in results if r.rank >= 2]
    if at == 2:  # engine ranks hold no source: what they send, they relay
        assert sum(r.result["sent_bytes"] for r in engine_only) > 0
    busiest = max(max(r.result["sent_bytes"], r.result["received_bytes"]) for r in results)
    assert busiest == plan.stats["busiest_link_bytes"]
    if budget is not None:
        for r in results:
            assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]


def test_staging_and_step_graph_count_relays():
    """Rank 0-1 hold column halves of w; ranks 2-5 want all of w (replicas). Every piece is a
    [64, 32] column block: contiguous on the trainer (its whole local tensor), not inside a
    replica's [64, 64], so each network receive and each relay send is staged at 64*32*2 B."""
    from layoutlang.compiler.graph import instance_staging
    from layoutlang.compiler.stepgraph import rank_graph

    plan = _plan("mesh m (tp=2)\ntensor w [64, 64 over tp]\n", "mesh m (dp=4) at 2\ntensor w [64, 64]\n")
    relays = [op for op in plan.ops if op.after]
    assert relays and all(op.src_rank >= 2 for op in relays)
    block = 64 * 32 * 2
    want: dict[int, int] = {}
    for op in plan.ops:
        want[op.dst_rank] = want.get(op.dst_rank, 0) + block
        if op.after:
            want[op.src_rank] = want.get(op.src_rank, 0) + block
    assert instance_staging(plan, 0) == want
    for op in relays:  # the forwarding rank sends only after the op it waits for landed
        g = rank_graph(plan, op.src_rank)
        step = {(g.nodes[n]["kind"], g.nodes[n]["step"].op.id): n for n in g.nodes
                if g.nodes[n].get("step") is not None and g.nodes[n]["step"].op is not None}
        assert nx.has_path(g, step[("recv", op.after[0])], step[("send", op.id)])
        assert nx.has_path(g, step[("land", op.after[0])], step[("send", op.id)])  # staged: landed first
