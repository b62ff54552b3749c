"""TablePlanner (layoutlang/compiler/tables.py) and re-keying (layoutlang/elaborate/rekey.py): an EPLB map
re-planned from kept state is the plan compile_plan makes from a fresh load of the same map.

Two independent references: compile_plan on `loads(text, {MAP: value})` (another code path: the
elaborator, match.py, group_templates, build_geometry, select_stage), compared field by field;
and a loopback refit whose every physical slot is checked against the expert the map names,
filled by a formula (tests/test_placements_tables.py's trainer).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from layoutlang import loads
from layoutlang.compiler import compile_plan
from layoutlang.compiler.tables import TablePlanner, _Moved
from layoutlang.diagnostics import LayoutError
from layoutlang.elaborate.rekey import watch
from layoutlang.elaborate.sources import Source
from layoutlang.runtime import loopback

L, E, I, H = 3, 8, 32, 32  # layers, logical experts, expert rows per part, hidden

TRAINER = f"""mesh d (dp=4)
mesh t (ep=4)
tensor emb [4096, 64]
tensor norm [64]
for l in 0..{L} {{
  for e in 0..{E} over ep {{
    tensor dec.{{l}}.fc1.{{e.local}} [(gate: {I} as l.{{l}}.e.{{e}}.gate | up: {I} as l.{{l}}.e.{{e}}.up), {H}] on t
    tensor dec.{{l}}.fc2.{{e.local}} as l.{{l}}.e.{{e}}.down [{H}, {I}] on t
  }}
}}
"""


def engine(first: int, extra: str = "", key: str = "{MAP[l][p]}", dtype: str = "") -> str:
    """The engine: 3 ranks at `first`, EP3 over P physical slots placed by the table MAP."""
    return f"""arg MAP = {eplb_map(0, 12)}
const P = len(MAP[0])
mesh x (ep=3) at {first}
tensor emb [4096, 64]
tensor norm [64]
{extra}for l in 0..{L} {{
  tensor w13.{{l}} [p in 0..P over ep, (gate: {I} as l.{{l}}.e.{key}.gate | up: {I} as l.{{l}}.e.{key}.up), {H}]{dtype}
  tensor w2.{{l}} as l.{{l}}.e.{key}.down [p in 0..P over ep, {H}, {I}]{dtype}
}}
"""


def eplb_map(seed: int, physical: int) -> list[list[int]]:
    """Per layer: every expert once, the redundant slots random repeats, shuffled (vLLM's EPLB)."""
    rng = random.Random(seed)
    out = []
    for _ in range(L):
        slots = list(range(E)) + [rng.randrange(E) for _ in range(physical - E)]
        rng.shuffle(slots)
        out.append(slots)
    return out


def same_plan(p, q) -> None:
    """p and q are one plan: ops, statistics, digest, and the model (templates field by field)."""
    assert p.dst.digest == q.dst.digest and p.digest == q.digest
    assert p.ops == q.ops
    assert p.stats == q.stats
    assert p.unused_keys == q.unused_keys and p.splits == q.splits
    instances = p.stats["tensors"]
    assert q.stats["tensors"] == instances
    assert [p.template_of(i) for i in range(instances)] == [q.template_of(i) for i in range(instances)]
    assert [p.op_range(i) for i in range(instances)] == [q.op_range(i) for i in range(instances)]
    assert len(p.templates) == len(q.templates)
    for a, b in zip(p.templates, q.templates):
        assert a.members == b.members
        for f in dataclasses.fields(b.geometry):  # meshes and dims of two loads are equal, not one object
            assert repr(getattr(a.geometry, f.name)) == repr(getattr(b.geometry, f.name)), f.name
    for t, template in enumerate(q.templates):
        for r in range(len(template.geometry.requests)):
            assert p.picks(t, r) == q.picks(t, r), (t, r)
    for rank in range(p.world):
        assert p.ops_for_rank(rank) == q.ops_for_rank(rank)


def fresh(text: str, value) -> object:
    return compile_plan(loads(TRAINER, "trainer.layout"), loads(text, "engine.layout", {"MAP": value}))


def planner(text: str, **kwargs) -> TablePlanner:
    return TablePlanner(loads(TRAINER, "trainer.layout"), text, "MAP", dst_path="engine.layout", **kwargs)


# ---- the same plan ---------------------------------------------------------------------------------

@pytest.mark.parametrize("first, dtype", [(0, ""), (4, ""), (4, " mxfp8")],
                         ids=["engine-on-trainer-ranks", "engine-after-trainer", "mxfp8-experts"])
def test_a_new_map_plans_as_compile_plan_does(first, dtype):
    text = engine(first, dtype=dtype)
    tp = planner(text)
    assert tp.rekeyable, tp.reason
    same_plan(tp.plan(), fresh(text, eplb_map(0, 12)))
    for seed in (1, 2, 3):
        value = eplb_map(seed, 12)
        plan = tp.plan(value)
        same_plan(plan, fresh(text, value))
        # the fast path ran: most expert templates are another's geometry moved, not built
        moved = sum(t.geometry.__class__ is _Moved for t in plan.templates)
        assert moved > len(plan.templates) // 2, (moved, len(plan.templates))


def test_the_split_stage_sees_the_moved_plan_as_it_sees_a_fresh_one():
    # `emb` has 4 holders and 3 receivers: whole pieces leave one sender far above the floor,
    # so compile_plan cuts them (its splits) and selects again, moved templates among the rest
    text = engine(4)
    tp = planner(text)
    for seed in (4, 5):
        value = eplb_map(seed, 12)
        reference = fresh(text, value)
        assert reference.splits > 0  # (the case this test is for)
        same_plan(tp.plan(value), reference)


def test_other_selectors_relays_nodes_and_no_split_plan_as_compile_plan_does():
    text = engine(4)
    # (split=False: `emb`'s whole picks see the experts' load at their place in the order)
    for options in ({"selector": "round_robin"}, {"relay": True, "ranks_per_node": 2}, {"split": False}):
        tp = planner(text, **options)
        value = eplb_map(6, 12)
        reference = compile_plan(loads(TRAINER, "trainer.layout"), loads(text, "engine.layout", {"MAP": value}),
                                 **options)
        same_plan(tp.plan(value), reference)


# ---- the oracle: each physical slot holds its logical expert -----------------------------------------

def _expert(l: int, e: int, which: str) -> torch.Tensor:
    rows, cols = (2 * I, H) if which == "fc1" else (H, I)
    r = torch.arange(rows, dtype=torch.float32)[:, None]
    c = torch.arange(cols, dtype=torch.float32)[None, :]
    return (l * 10_000 + e * 1000 + (0 if which == "fc1" else 500) + r * cols + c).to(torch.bfloat16)


def test_a_rebalanced_map_refits_every_physical_slot_with_its_expert():
    text = engine(4)
    tp = planner(text)
    per = E // 4
    for seed in (7, 8):
        value = eplb_map(seed, 12)
        plan = tp.plan(value)
        src = {r: {} for r in range(plan.world)}
        for rank in range(4):
            src[rank]["emb"] = torch.zeros(4096, 64, dtype=torch.bfloat16)
            src[rank]["norm"] = torch.zeros(64, dtype=torch.bfloat16)
            for l in range(L):
                for j in range(per):
                    for which in ("fc1", "fc2"):
                        src[rank][f"dec.{l}.{which}.{j}"] = _expert(l, rank * per + j, which)
        dst = {r: {} for r in range(plan.world)}
        for t in plan.dst.tensors:
            for r in t.ranks():
                dst[r][t.name] = torch.full(t.local_shape_at(r), float("nan"), dtype=torch.bfloat16)
        loopback.refit(plan, src, dst)
        for c in range(3):  # engine rank 4 + c holds slots 4c .. 4c+3
            for l in range(L):
                for j in range(4):
                    e = value[l][4 * c + j]
                    assert torch.equal(dst[4 + c][f"w13.{l}"][j], _expert(l, e, "fc1")), (c, l, j, e)
                    assert torch.equal(dst[4 + c][f"w2.{l}"][j], _expert(l, e, "fc2")), (c, l, j, e)


# ---- where only a fresh load is exact ------------------------------------------------------------------

def test_a_map_of_other_lengths_is_planned_from_a_fresh_load_and_the_fast_path_stays():
    text = engine(4)
    tp = planner(text)
    fewer = eplb_map(9, 9)  # 9 physical slots, not 12: P, and every shape, changes
    same_plan(tp.plan(fewer), fresh(text, fewer))
    value = eplb_map(10, 12)
    plan = tp.plan(value)
    same_plan(plan, fresh(text, value))
    assert any(t.geometry.__class__ is _Moved for t in plan.templates)


def _first_line(call) -> str:
    with pytest.raises(LayoutError) as err:
        call()
    return err.value.render().splitlines()[0]


def test_an_expert_the_trainer_lacks_is_compile_plans_diagnostic():
    text = engine(4)
    tp = planner(text)
    value = eplb_map(11, 12)
    value[1][5] = E + 3
    expected = _first_line(lambda: fresh(text, value))
    assert "l.1.e.11.gate" in expected and expected.startswith("engine.layout:")
    assert _first_line(lambda: tp.plan(value)) == expected


def test_a_map_that_breaks_a_key_rule_gets_the_elaborators_diagnostic():
    # another tensor holds l.0.e.8.gate: a map that puts expert 8 into layer 0 declares it twice
    trainer = TRAINER + f"tensor extra as l.0.e.8.gate [{I}, {H}]\n"
    text = engine(4, extra=f"tensor extra as l.0.e.8.gate [{I}, {H}]\n")
    tp = TablePlanner(loads(trainer, "trainer.layout"), text, "MAP", dst_path="engine.layout")
    value = eplb_map(12, 12)
    value[0][2] = 8
    expected = _first_line(lambda: loads(text, "engine.layout", {"MAP": value}))
    assert "l.0.e.8.gate" in expected and "engine.layout:" in expected
    assert _first_line(lambda: tp.plan(value)) == expected


@pytest.mark.parametrize("change, reason", [
    (("const P = len(MAP[0])", "const P = len(MAP[0]) + MAP[0][0] - MAP[0][0]"), "read 2 time(s)"),
    (("{MAP[l][p]}.down", "{MAP[l][p] * 1}.down"), "read 36 time(s)"),  # w2's 12 slots x 3 layers
    (("{MAP[l][p]}.down", "{MAP[l][p]}.{MAP[l][p] + 0}.down"), "computes with an entry"),
])
def test_a_layout_that_reads_the_table_elsewhere_is_elaborated_in_full(change, reason):
    text = engine(4).replace(*change)
    trainer = TRAINER.replace("as l.{l}.e.{e}.down", "as l.{l}.e.{e}.{e}.down") if ".{MAP[l][p] + 0}" in text else TRAINER
    tp = TablePlanner(loads(trainer, "trainer.layout"), text, "MAP", dst_path="engine.layout")
    assert not tp.rekeyable and reason in tp.reason and "`{MAP[i][j]}`" in tp.reason
    value = eplb_map(13, 12)
    same_plan(tp.plan(value), compile_plan(loads(trainer, "trainer.layout"), loads(text, "engine.layout", {"MAP": value})))


# ---- re-keying ----------------------------------------------------------------------------------------------

def test_a_rekeyed_layout_is_a_fresh_load_and_keeps_the_untouched_tensors():
    text = engine(4)
    layout, keys = watch(Source("engine.layout", text), None, "MAP")
    assert keys.rekeyable and len(keys.watched) == 2 * L
    value = eplb_map(14, 12)
    again = keys.rekey(value)
    reference = loads(text, "engine.layout", {"MAP": value})
    assert again.digest == reference.digest and again.args == reference.args
    for a, b, before in zip(again.tensors, reference.tensors, layout.tensors):
        assert (a.name, a.key, a.fixed, a.logical_shape) == (b.name, b.key, b.fixed, b.logical_shape)
        assert [r.key for r in a.regions or ()] == [r.key for r in b.regions or ()]
        assert a.regions == b.regions
        if before.regions is None or all(r.key == s.key for r, s in zip(before.regions, b.regions)):
            assert a is before  # nothing re-keyed: the very tensor of the first load
        assert a.dims is before.dims and a.mesh is before.mesh
    # slot 4c + j of layer l names the expert the map gives it
    w2 = {t.name: t for t in again.tensors}["w2.1"]
    assert [r.key for r in w2.regions] == [f"l.1.e.{e}.down" for e in value[1]]
    assert keys.rekey(eplb_map(0, 12)) is layout  # the first value: the first layout


def test_an_engine_replica_of_a_job_plans_as_the_member_planner_does():
    """replica_at=N: the plan a trainer job makes into one EPLB replica (its ranks after the
    trainer's, layoutlang/runtime/jobs.py), equal to MemberPlanner's plan(1) of a fresh load of each map."""
    from layoutlang.compiler.members import MemberPlanner, engine_rank

    src = loads(TRAINER, "trainer.layout")
    text = engine(0)
    tp = TablePlanner(src, text, "MAP", dst_path="engine.layout", replica_at=src.ranks, relay=False)
    assert tp.rekeyable, tp.reason
    for seed in (0, 5, 6):
        value = eplb_map(seed, 12)
        plan = tp.plan(None if seed == 0 else value)
        member = MemberPlanner(src, loads(text, "engine.layout", {"MAP": value})).plan(1)
        same_plan(plan, member)
        # the receivers are the replica's ranks as the job numbers them (4, 5, 6), never a trainer rank
        assert {op.dst_rank for op in plan.ops} == {engine_rank(src.ranks, 1, 0, t) for t in range(3)}
    fewer = eplb_map(9, 9)  # other lengths: a fresh load, moved the same way
    same_plan(tp.plan(fewer), MemberPlanner(src, loads(text, "engine.layout", {"MAP": fewer})).plan(1))
    with pytest.raises(Exception, match="relay"):
        TablePlanner(src, text, "MAP", dst_path="engine.layout", replica_at=src.ranks)
