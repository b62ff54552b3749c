"""Membership plans (layoutlang/compiler/members.py) against compile_plan, the independent reference.

`MemberPlanner(src, one).plan(K)` claims to be exactly `compile_plan(src, replicate(one, K,
src.ranks), relay=False)`: the same ops (every field) in the same order, the same digest, the
same statistics and send loads. Checked on the shipped pairs, for K = 1..4 with one planner
reused in mixed order (what it keeps between plans must not leak from one K into another),
under every option, and on random layout pairs.

Its batched sender choice rests on `Balanced.pick` giving, for many picks at once, the picks
of the plain greedy rule one at a time; the first test checks that against the rule written
out, on random loads, counts, sizes and candidate sets (the batch path, `_levels`, is taken
whenever there are at least as many picks as candidates).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layoutlang import UsageError, load, loads
from layoutlang.compiler import compile_plan
from layoutlang.compiler.members import MemberPlanner, replicate
from layoutlang.compiler.ranks import RankSet
from layoutlang.compiler.select import Balanced

# ---- the selector: batched picks are the greedy's ---------------------------------


def greedy(load: list[int], receiver: int, ranks: list[int], rpn: int | None, n: int, nbytes: int) -> list[int]:
    """The rule, one pick at a time: the receiver itself (no load), else its node's holders, else
    every holder; among those the least loaded, lowest rank on ties; the pick adds `nbytes`."""
    if receiver in ranks:
        return [receiver] * n
    cands = ranks
    if rpn:
        near = [r for r in ranks if r // rpn == receiver // rpn]
        cands = near or ranks
    out = []
    for _ in range(n):
        r = min(cands, key=lambda x: (load[x], x))
        if r != receiver:
            load[r] += nbytes
        out.append(r)
    return out


@st.composite
def pick_scenarios(draw):
    world = draw(st.integers(2, 200))
    sets = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            start, step = draw(st.integers(0, min(8, world - 1))), draw(st.integers(1, 3))  # large sets: the heap
            sets.append(RankSet(range(start, world, step)))
        else:
            sets.append(RankSet(draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=min(world, 140)))))
    # loads drawn apart by whole and partial requests, so the batch path meets every level shape
    unit = draw(st.sampled_from([1, 3, 64, 4096]))
    loads_ = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2 * unit)), min_size=world, max_size=world))
    start = [a * unit + b for a, b in loads_]
    receivers = st.one_of(st.integers(0, world - 1), st.integers(world, world + 3))  # half outside every set
    picks = draw(st.lists(st.tuples(st.integers(0, len(sets) - 1), receivers,
                                    st.integers(1, 200), st.sampled_from([unit, 2 * unit, unit // 2 + 1, 7])),
                          min_size=1, max_size=12))
    rpn = draw(st.sampled_from([None, None, 2, 8]))
    return world, sets, start, picks, rpn


@settings(max_examples=200, deadline=None)
@given(pick_scenarios())
def test_balanced_picks_are_the_greedy_ones_at_any_count(scenario):
    world, sets, start, picks, rpn = scenario
    selector = Balanced(world + 4, rpn)
    selector.load[:world] = start
    load = list(selector.load)
    for which, receiver, n, nbytes in picks:
        want = greedy(load, receiver, list(sets[which]), rpn, n, nbytes)
        assert selector.pick(receiver, sets[which], n, nbytes, 0) == want
        assert selector.load == load


def test_the_batch_path_takes_levels_in_order():
    """Loads 0, 10, 25 and requests of 10: rank 0 alone, then 0 and 1, then all three."""
    selector = Balanced(3, None)
    selector.load[:] = [0, 10, 25]
    assert selector.pick(9, RankSet([0, 1, 2]), 6, 10, 0) == [0, 0, 1, 0, 1, 2]
    assert selector.load == [30, 30, 35]


# ---- plans: MemberPlanner(src, one).plan(K) is compile_plan's ------------------------

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"


def _load(path: str, **args):
    return load(EX / path, args, unknown_args="ignore")


def cold(src, one, copies: int, first: int | None = None, **options):
    """The reference: the plan compile_plan makes of the replicated layout."""
    return compile_plan(src, replicate(one, copies, src.ranks if first is None else first), relay=False, **options)


def assert_same_plan(got, want) -> None:
    """Every op (every field, in order: ids are positions), the digest, the statistics and loads,
    and the grouped model read through the public door (templates, picks, instances)."""
    assert got.digest == want.digest
    assert (got.world, got.dst.digest, got.dst.ranks) == (want.world, want.dst.digest, want.dst.ranks)
    assert got.ops == want.ops
    assert got.stats == want.stats
    assert list(got.send_load) == list(want.send_load)
    assert got.recv_load == want.recv_load
    assert (got.splits, got.relays) == (want.splits, want.relays)
    assert (got.tensors, got.unused_keys) == (want.tensors, want.unused_keys)
    assert len(got.templates) == len(want.templates)
    for i, (a, b) in enumerate(zip(got.templates, want.templates)):
        assert a.members == b.members
        assert a.geometry == b.geometry  # placements, pieces, requests, candidate senders, local shapes
        for j in range(len(a.geometry.requests)):
            assert got.picks(i, j) == want.picks(i, j)
    for inst in range(len(want.matches)):
        assert got.template_of(inst) == want.template_of(inst)
        assert got.op_range(inst) == want.op_range(inst)


PAIRS = {
    # the jobs example: a TP2 x DP2 trainer, one TP2 engine replica
    "jobs": lambda: (_load("jobs/train.layout"), _load("jobs/infer.layout")),
    # Llama-3-8B: 64 trainer ranks (dp4 x gtp2 x tp8), a TP2 x DP2 engine replica
    "llama3-8b": lambda: (_load("llama3_8b_train.layout"), _load("llama3_8b_infer.layout")),
    # v2 (part keys): Megatron's fused qkv / fc1 into vLLM's, one TP2 replica
    "llama3-8b v2": lambda: (_load("v2/llama3_8b_megatron.layout"), _load("v2/llama3_8b_vllm.layout", DP=1)),
    # DeepSeek-V3 at 10 layers x 16 experts: 64 trainer ranks, one EP8 engine replica (MXFP8)
    "deepseek-v3": lambda: (_load("deepseek_v3_moe.layout", L=10, E=16, TP=2, DP=4, EP=4, ETP=2),
                            _load("deepseek_v3_infer.layout", L=10, E=16, ENGINE_TP=8, ENGINE_DP=1, ENGINE_EP=8,
                                  ENGINE_ETP=1)),
    # ... its stacked-experts engine (v2: stacked dims)
    "deepseek-v3 stacked": lambda: (_load("deepseek_v3_moe.layout", L=10, E=16, TP=2, DP=4, EP=4, ETP=2),
                                    _load("v2/deepseek_v3_infer_stacked.layout", L=10, E=16, ENGINE_TP=8,
                                          ENGINE_DP=1, ENGINE_EP=8, ENGINE_ETP=1)),
    # the same at 8 experts (the option grid below runs it often)
    "deepseek-v3 e8": lambda: (_load("deepseek_v3_moe.layout", L=10, E=8, TP=2, DP=4, EP=4, ETP=2),
                               _load("deepseek_v3_infer.layout", L=10, E=8, ENGINE_TP=8, ENGINE_DP=1, ENGINE_EP=8,
                                     ENGINE_ETP=1)),
    # whole pieces from 256 trainer ranks into TP1 replicas: the plan splits requests (K = 1..3)
    "llama3-8b split": lambda: (_load("llama3_8b_train.layout", DP=16), _load("llama3_8b_infer.layout", DP=1, TP=1)),
}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request):
    return PAIRS[request.param]()


def test_every_membership_is_the_cold_plan(pair):
    """One planner, K in mixed order: what it keeps between plans does not leak from one K into another."""
    src, one = pair
    planner = MemberPlanner(src, one)
    for copies in (3, 1, 4, 2, 3):
        assert_same_plan(planner.plan(copies), cold(src, one, copies))


def test_the_batched_selection_is_taken(monkeypatch):
    """The shipped DeepSeek-V3 pair picks its senders in batches (select_stage is never called),
    and the split case really splits, so the tests above check both paths."""
    from layoutlang.compiler import members

    src, one = PAIRS["deepseek-v3"]()
    planner = MemberPlanner(src, one)

    def fail(plan):
        raise AssertionError("select_stage called: the batched selection was not used")

    monkeypatch.setattr(members, "select_stage", fail)
    assert_same_plan(planner.plan(2), cold(src, one, 2))
    src, one = PAIRS["llama3-8b split"]()
    planner = MemberPlanner(src, one)
    assert all(planner.plan(copies).splits > 0 for copies in (1, 2, 3))


def test_matches_are_the_cold_plans_and_the_runtime_never_needs_them():
    """A membership plan keeps one replica's matches (`key_matches`) and where each instance's
    stored tensor is (`stored`); `matches`, built on first use, is compile_plan's, field for
    field, each `dst` one of the plan's own tensors. What the runtime reads of a plan (a rank's
    ops and steps, buckets under a budget, statistics) never builds it."""
    import dataclasses

    from layoutlang.compiler.steps import schedule

    def fields(t):  # tensors compare by identity: their fields, then
        return tuple(getattr(t, f.name) for f in dataclasses.fields(t))

    for name in ("deepseek-v3", "llama3-8b v2"):
        src, one = PAIRS[name]()
        planner = MemberPlanner(src, one)
        got, want = planner.plan(3), cold(src, one, 3)
        for rank in (0, got.world - 1):
            got.ops_for_rank(rank)
            for budget in (None, 1 << 20):
                schedule(got, rank, budget)
        got.stats, got.tensors, got.relay_depths
        assert "matches" not in vars(got)
        tensors = {id(t) for t in got.dst.tensors}
        assert len(got.key_matches) == len(got.matches) == len(want.matches)
        for i, (a, b, k) in enumerate(zip(got.matches, want.matches, got.key_matches)):
            assert (type(a), a.src, a.region, a.src_regions) == (type(b), b.src, b.region, b.src_regions)
            assert fields(a.dst) == fields(b.dst) and id(a.dst) in tensors and got.stored(i) is a.dst
            assert (k.key, k.src, k.region, k.src_regions, k.dst.name, k.dst.dtype) == \
                (a.key, a.src, a.region, a.src_regions, a.dst.name, a.dst.dtype)
            assert want.stored(i) is b.dst
        for rank in (0, got.world - 1):  # the same buckets, ops and tensors completed (by name: tensors are
            a, b = schedule(got, rank, 1 << 20), schedule(want, rank, 1 << 20)  # not shared between plans)
            assert (a.buckets, a.ops) == (b.buckets, b.ops)
            assert [[t.name for t in ts] for ts in a.dst] == [[t.name for t in ts] for ts in b.dst]


OPTIONS = [
    {"ranks_per_node": 4},   # the engine's nodes hold no trainer rank: batched
    {"ranks_per_node": 3},   # the first engine node holds trainer ranks: one by one
    {"ranks_per_node": 8},
    {"selector": "round_robin"},
    {"split": False},
    {"wire": "bf16"},
    {"ranks_per_node": 2, "wire": "bf16", "split": False},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("name", ["jobs", "deepseek-v3 e8", "llama3-8b split"])
def test_options_are_compile_plans(name, options):
    src, one = PAIRS[name]()
    planner = MemberPlanner(src, one, **options)
    for copies in (2, 1, 3):
        assert_same_plan(planner.plan(copies), cold(src, one, copies, **options))


@pytest.mark.parametrize("first", [0, 1])
def test_an_engine_among_the_trainer_ranks(first):
    """`first` inside the trainer: receivers hold pieces (local copies), picked one by one."""
    src, one = PAIRS["llama3-8b"]()
    planner = MemberPlanner(src, one, first=first)
    for copies in (2, 1, 3):
        assert_same_plan(planner.plan(copies), cold(src, one, copies, first=first))


def test_paths_and_args_load_as_compile_plan_loads_them():
    src, one = EX / "jobs/train.layout", EX / "jobs/infer.layout"
    planner = MemberPlanner(src, one, src_args={"DP": 3}, dst_args={"TP": 1})
    want = compile_plan(load(src, {"DP": 3}), replicate(load(one, {"TP": 1}), 2, 6), relay=False)
    assert_same_plan(planner.plan(2), want)


# ---- random layouts --------------------------------------------------------------------

from test_plan_property import pairs as layout_pairs  # noqa: E402 - the random pairs of the plan property tests


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layout_pairs(), st.lists(st.integers(1, 3), min_size=1, max_size=3),
       st.sampled_from([{}, {}, {"ranks_per_node": 2}, {"ranks_per_node": 3}, {"split": False},
                        {"selector": "round_robin"}, {"wire": "bf16"}]))
def test_random_layouts_plan_as_compile_plan(pair, counts, options):
    src, one = loads(pair.src_text, "src.layout"), loads(pair.dst_text, "dst.layout")
    planner = MemberPlanner(src, one, **options)
    for copies in counts:
        assert_same_plan(planner.plan(copies), cold(src, one, copies, **options))


# ---- diagnostics --------------------------------------------------------------------------

def test_relays_are_refused_with_help():
    src, one = PAIRS["jobs"]()
    with pytest.raises(UsageError) as err:
        MemberPlanner(src, one, relay=True)
    assert "relay=True" in err.value.message and "separate jobs" in err.value.message
    assert err.value.help == "leave `relay` out (it is always off here)"
    MemberPlanner(src, one, relay=False)  # saying what is always so is fine


def test_unknown_options_are_refused_with_the_known_ones():
    src, one = PAIRS["jobs"]()
    with pytest.raises(UsageError) as err:
        MemberPlanner(src, one, relays=False, selectr="balanced")
    assert err.value.message == "MemberPlanner: unknown option(s) relays, selectr"
    assert "ranks_per_node" in err.value.help and "selector" in err.value.help and "src_args" in err.value.help


def test_bad_option_values_are_compile_plans_errors():
    src, one = PAIRS["jobs"]()
    for options in ({"selector": "fastest"}, {"wire": "fp4"}, {"ranks_per_node": 0}):
        with pytest.raises(UsageError) as mine:
            MemberPlanner(src, one, **options)
        with pytest.raises(UsageError) as theirs:
            compile_plan(src, replicate(one, 1, src.ranks), **options)
        assert mine.value.message == theirs.value.message


def test_no_replicas_is_refused():
    src, one = PAIRS["jobs"]()
    with pytest.raises(ValueError, match="at least one replica"):
        MemberPlanner(src, one).plan(0)


# ---- replicate ------------------------------------------------------------------------------

def test_replicate_is_dataclasses_replace_of_the_mesh():
    """What the committed definition said, field for field, also for a layout a plan has used
    (its tensors then carry memos, `_placement`, that must not travel to the replicas)."""
    import dataclasses

    from layoutlang.compiler.shards import placement_of

    src, one = PAIRS["llama3-8b v2"]()
    compile_plan(src, one)  # memoizes placements (and cached properties) on one's tensors
    assert any("_placement" in t.__dict__ for t in one.tensors)
    both = replicate(one, 3, src.ranks)
    meshes = {m.name: m for m in both.meshes}
    assert len(both.tensors) == len(one.tensors)
    for t, r in zip(one.tensors, both.tensors):
        want = dataclasses.replace(t, mesh=meshes[t.mesh.name])
        assert type(r) is type(want)
        assert {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} == \
            {f.name: getattr(want, f.name) for f in dataclasses.fields(want)}
        assert "_placement" not in r.__dict__ and placement_of(r).mesh is meshes[t.mesh.name]
