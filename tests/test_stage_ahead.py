"""`overlap=True` stages the next bucket while this one's messages fly, and stays exact.

With overlap, a bucket's steps before its first post (zero padding, bf16 assemblies,
dequantized sources, sender-side packing of quantized-wire blocks, staged sends, receive
buffers) run right after the previous bucket's first post (layoutlang/runtime/refit.py `_stage_ahead`).
These refits cut many buckets (a small budget) over every kind of such step, on real gloo
processes; each worker checks every destination element against the layouts
(layoutlang/runtime/fill.py: the fill of each key, quantized once by the written-out format rules) and
reports how many steps it ran ahead, which must not be zero: a refit that never staged ahead
would pass the element check without testing anything. Its staging peak (the runtime's meter:
what it really allocated) stays within two consecutive buckets' staging as the compiler counts
it (layoutlang/compiler/graph.py), and each bucket within half the budget unless its first tensor alone exceeds it.
"""

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.compiler.graph import buckets, instance_staging, staging_per_bucket
from layoutlang.runtime.launch import launch

from test_quant_formats import ENGINE, PLAIN_DST, QUANTIZED_SRC
from test_quant_formats import TRAIN as BF16_TRAIN
from test_relay import INFER as REPLICAS
from test_relay import TRAIN as RELAY_TRAIN

CASES = {
    # bf16 trainer -> fp8_b128 / mxfp4 / nvfp4 engine: blocks packed by their senders
    "packed-wire": (BF16_TRAIN, ENGINE, {"AT": 0}, {}),
    # the same into strided views: every send staged
    "packed-wire-strided": (BF16_TRAIN, ENGINE, {"AT": 2}, {"strided": True}),
    # quantized sources, dequantized whole by their rank, into bf16/fp32 on two other ranks
    "dequantized-sources": (QUANTIZED_SRC, PLAIN_DST, {}, {}),
    # one trainer into six replicas: relays (a relay send waits for its bucket's first round)
    "relays": (RELAY_TRAIN, REPLICAS, {"AT": 2}, {}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_staging_ahead_is_exact(tmp_path, case):
    src_text, dst_text, dst_args, extra = CASES[case]
    (tmp_path / "src.layout").write_text(src_text)
    (tmp_path / "dst.layout").write_text(dst_text)
    src, dst = str(tmp_path / "src.layout"), str(tmp_path / "dst.layout")
    plan = compile_plan(src, dst, dst_args=dst_args)
    budget = 2048
    results = launch({"src": src, "dst": dst, "dst_args": dst_args, "budget": budget, "overlap": True,
                      "steps": 2, **extra}, plan.world, timeout=240)
    strided = bool(extra.get("strided"))
    cut = buckets(plan, budget // 2, strided)  # overlap: buckets of half the budget, two live at once
    assert len(cut) >= 3
    staging = [staging_per_bucket(plan, b, strided) for b in cut]
    for b, per_rank in zip(cut, staging):
        if max(per_rank.values(), default=0) > budget // 2:  # only its first tensor may overflow it
            first = plan.matches[b.first_instance].dst
            alone: dict[int, int] = {}
            for i in range(b.first_instance, b.stop_instance):
                if plan.matches[i].dst is first:
                    for rank, n in instance_staging(plan, i, strided).items():
                        alone[rank] = alone.get(rank, 0) + n
            assert {r: n for r, n in per_rank.items() if n} == {r: n for r, n in alone.items() if n}, b
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
        held = sum(1 for t in plan.dst.tensors if r.rank < plan.dst.ranks and t.holds(r.rank))
        assert r.result["checked_tensors"] == held
        pairs = [staging[i].get(r.rank, 0) + staging[i + 1].get(r.rank, 0) for i in range(len(staging) - 1)]
        assert r.result["staging_peak"] <= max(pairs)
    assert sum(r.result["staged_ahead"] for r in results) > 0


def test_the_step_graph_with_overlap_stages_the_next_bucket_during_this_one(tmp_path):
    """`rank_graph(..., overlap=True)`: a bucket's steps before its first post (here a sender's
    packs and sends) wait for the bucket two before (its staging released) and for the previous
    bucket's first post, not for the previous bucket to finish; without overlap they wait for it."""
    import networkx as nx

    from layoutlang.compiler.stepgraph import rank_graph

    (tmp_path / "src.layout").write_text(BF16_TRAIN)
    (tmp_path / "dst.layout").write_text(ENGINE)
    plan = compile_plan(str(tmp_path / "src.layout"), str(tmp_path / "dst.layout"), dst_args={"AT": 2})
    for overlap in (False, True):
        staged = 0
        for rank in range(plan.world):
            g = rank_graph(plan, rank, 2048, overlap=overlap)
            assert nx.is_directed_acyclic_graph(g)
            for n in g.nodes:
                if g.nodes[n]["kind"] in ("pack", "send") and n[0] >= 2:
                    staged += 1
                    assert nx.has_path(g, ("barrier", n[0] - 2), n)
                    assert nx.has_path(g, ("barrier", n[0] - 1), n) is not overlap, (overlap, rank, n)
        assert staged
