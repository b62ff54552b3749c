"""Copy relays (layoutlang/compiler/relay.py): two slots of one stored destination tensor that hold the
same elements of one key (EPLB's redundant experts) on different ranks; one is fed by the
source ranks, the other forwarded from the rank that received it.

Expected values come from the layout text (the map below, worked through by hand), the slow
simulator (tests/plan_simulator.py: relays in `after` order, reading the forwarding rank's
destination at the op's source slice), a loopback refit and a real gloo refit whose every
destination element is checked by layoutlang/runtime/fill.py.
"""

from __future__ import annotations

import dataclasses

import pytest

import layoutlang
from layoutlang.compiler import compile_plan
from layoutlang.compiler.tables import TablePlanner
from layoutlang.runtime import loopback
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor
from layoutlang.runtime.launch import launch

from plan_simulator import RunsView, check_stats, simulate

# one trainer rank holds all 4 experts of 2 layers; 4 engine ranks hold 8 physical slots
# (2 each), every expert twice (MAP: physical slot -> expert)
TRAINER = """mesh t (ep=1)
tensor emb [64, 32]
for l in 0..2 {
  for e in 0..4 over ep {
    tensor fc1.{l}.{e.local} as l.{l}.e.{e}.fc1 [64, 32] on t
  }
}
"""
MAP = [[0, 1, 2, 3, 0, 1, 2, 3], [3, 2, 1, 0, 0, 1, 2, 3]]


def engine(dtype: str = "") -> str:
    return f"""arg MAP = {MAP}
mesh x (ep=4) at 1
tensor emb [64, 32]
for l in 0..2 {{
  tensor w1.{{l}} as l.{{l}}.e.{{MAP[l][p]}}.fc1 [p in 0..8 over ep, 64, 32]{dtype}
}}
"""


EXPERT = 64 * 32 * 2   # one expert's bytes (bf16)
EMB = 64 * 32 * 2


def _plan(dst_text: str = engine(), **kw):
    return compile_plan(layoutlang.loads(TRAINER, "t.layout"), layoutlang.loads(dst_text, "e.layout"), **kw)


def _slot_expert(rank: int, local: int, layer: int) -> int:
    """Engine rank r (plan rank r, 1..4) holds slots 2(r-1), 2(r-1)+1 (balanced over 8)."""
    return MAP[layer][2 * (rank - 1) + local]


def test_each_expert_leaves_the_trainer_once_by_hand():
    """Direct: the trainer sends 16 expert copies and the embedding 4 times (20 blocks of 4 KiB).
    With copy relays each expert leaves it once (8), its second copy coming from the engine rank
    that holds the first; the embedding's 4 replicas take a tree as before (fan-out 1: the
    trainer feeds one, which feeds one, then both feed the last two: 3 relays; fan-out 2 would
    cost the trainer a tenth block). The trainer's link drops from 20 blocks to 9; an engine
    rank receives 4 slots and the embedding (5). A copy reads the slot its forwarder received
    (the map says which) and writes its own."""
    direct, plan = _plan(relay=False), _plan()
    assert direct.stats["relays"] == 0
    assert direct.stats["max_send_bytes"] == 16 * EXPERT + 4 * EMB
    copies = [op for op in plan.ops if op.after and op.key != "emb"]
    assert len(copies) == 8 and plan.stats["relays"] == 8 + 3
    assert sum(1 for op in plan.ops if op.key == "emb" and op.src_rank == 0) == 1
    assert plan.stats["max_send_bytes"] == plan.stats["busiest_link_bytes"] == 8 * EXPERT + EMB
    by_id = {op.id: op for op in plan.ops}
    for op in copies:
        first = by_id[op.after[0]]
        assert first.dst_rank == op.src_rank != op.dst_rank and first.src_rank == 0 and not first.after
        assert op.src_name == op.dst_name == first.dst_name and op.src_slice == first.dst_slice
        layer = int(op.dst_name.split(".")[1])
        # the forwarder's slot and the receiver's hold one expert (read off MAP, not the plan)
        assert _slot_expert(op.src_rank, op.src_slice[0][0], layer) == _slot_expert(op.dst_rank, op.dst_slice[0][0],
                                                                                    layer)
    assert any(op.src_slice != op.dst_slice for op in copies)  # another slot, not only another rank
    # relays change senders only: the same receivers, slices and bytes as the direct plan
    strip = lambda ops: [(o.id, o.key, o.dst_rank, o.dst_name, o.dst_slice, o.bytes) for o in ops]  # noqa: E731
    assert strip(plan.ops) == strip(direct.ops)


@pytest.mark.parametrize("dtype, budget", [("", None), ("", 4096), (" mxfp8", None), (" fp8_b128", 4096)])
def test_copy_relays_deliver_every_element_once(dtype, budget):
    """bf16 slots, and block-quantized ones (the forwarder's packed blocks and scales are the
    copy's: the two slots' blocks fall alike), in one bucket or cut in several."""
    plan = _plan(engine(dtype))
    assert sum(1 for op in plan.ops if op.after and op.key != "emb") == 8
    src, dst = plan.src, plan.dst
    report = simulate(RunsView(src), RunsView(dst), plan)
    assert report.dst_data_elements == report.elements
    check_stats(plan, report)
    s = {r: {} for r in range(plan.world)}
    d = {r: {} for r in range(plan.world)}
    for t in src.tensors:
        for r in t.ranks():
            s[r][t.name] = source_tensor(t, r)
    for t in dst.tensors:
        for r in t.ranks():
            d[r][t.name] = empty_destination(t, rank=r)
    loopback.refit(plan, s, d, budget_bytes=budget)
    checked = [check_destination(t, r, d[r][t.name]) for t in dst.tensors for r in t.ranks()]
    assert checked == [None] * 12  # emb and w1.0, w1.1 on each of the 4 engine ranks


def test_the_simulator_rejects_a_copy_relay_that_reads_another_slot():
    """The check can fail: a copy relay reading its forwarder's other slot (another expert)."""
    plan = _plan()
    ops = list(plan.ops)
    k = next(i for i, op in enumerate(ops) if op.after)
    other = ((1 - ops[k].src_slice[0][0], 2 - ops[k].src_slice[0][0]),) + ops[k].src_slice[1:]
    ops[k] = dataclasses.replace(ops[k], src_slice=other)
    fake = type("P", (), {"ops": tuple(ops), "src": plan.src, "dst": plan.dst})()
    with pytest.raises(AssertionError):
        simulate(RunsView(plan.src), RunsView(plan.dst), fake)


def test_no_copy_relay_of_a_per_tensor_scale_or_with_relays_off():
    """fp8_e4m3 slots (a per-tensor scale: each receiver's blocks quantized with its own agreed
    amax) and relay=False: every copy leaves the trainer."""
    assert not any(op.after for op in _plan(engine(" fp8_e4m3")).ops if op.key != "emb")  # (emb: a tree)
    assert not any(op.after for op in _plan(relay=False).ops)


def test_table_planner_replans_copy_relays_as_compile_plan_does():
    """A rebalanced map re-planned from kept state equals compile_plan of a fresh load, relays and all."""
    other = [[3, 3, 2, 1, 0, 2, 1, 0], [0, 1, 2, 3, 3, 2, 1, 0]]
    tp = TablePlanner(layoutlang.loads(TRAINER, "t.layout"), engine(), "MAP", dst_path="e.layout")
    kept = tp.plan(other)
    fresh = compile_plan(layoutlang.loads(TRAINER, "t.layout"), layoutlang.loads(engine(), "e.layout",
                                                                                   {"MAP": other}))
    assert fresh.stats["relays"] > 0
    assert kept.ops == fresh.ops and kept.stats == fresh.stats and kept.digest == fresh.digest


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["", " mxfp8"], ids=["bf16", "mxfp8"])
def test_gloo_refit_with_copy_relays_is_exact(tmp_path, dtype):
    """5 gloo ranks, two steps, buckets of 4 KiB: every destination element checked (verify);
    mxfp8 slots: the forwarders send the packed blocks and scales they received."""
    (tmp_path / "train.layout").write_text(TRAINER)
    (tmp_path / "infer.layout").write_text(engine(dtype))
    src, dst = str(tmp_path / "train.layout"), str(tmp_path / "infer.layout")
    plan = compile_plan(src, dst)
    assert plan.stats["relays"] == 11
    results = launch({"src": src, "dst": dst, "verify": True, "budget": 4096, "steps": 2}, plan.world, timeout=200)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
    forwarded = sum(op.bytes for op in plan.ops if op.after)
    assert dtype or forwarded == 8 * EXPERT + 3 * EMB  # bf16: 8 expert copies and 3 embedding relays
    assert sum(r.result["sent_bytes"] for r in results if r.rank >= 1) == forwarded
    assert max(max(r.result["sent_bytes"], r.result["received_bytes"]) for r in results) == \
        plan.stats["busiest_link_bytes"]
