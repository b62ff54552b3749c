"""Unit tests of the plan compiler stages: matching, pieces, proof, selection, graph."""

import networkx as nx
import pytest

from layoutlang import loads
from layoutlang.compiler import PlanError, compile_plan
from layoutlang.compiler.graph import buckets, instance_staging, staging_per_bucket
from layoutlang.compiler.staging import contiguous
from layoutlang.compiler.stepgraph import rank_graph
from layoutlang.compiler.verify import check_tiling
from layoutlang.modes import PadRun, Run


def pair(src_text, dst_text, **kw):
    return compile_plan(loads(src_text, "src.layout"), loads(dst_text, "dst.layout"), **kw)


def test_replicated_tensor_is_one_op_and_tp4_to_tp2_is_two():
    plan = pair("mesh m (tp=4)\ntensor n [8]\ntensor w [16 over tp, 4]",
                "mesh m (tp=2) at 4\ntensor n [8]\ntensor w [16 over tp, 4]")
    by_key = {}
    for op in plan.ops:
        by_key.setdefault((op.key, op.dst_rank), []).append(op)
    assert [len(by_key[("n", r)]) for r in (4, 5)] == [1, 1]
    assert [len(by_key[("w", r)]) for r in (4, 5)] == [2, 2]
    a, b = by_key[("w", 5)]
    assert (a.src_rank, a.src_slice, a.dst_slice) == (2, ((0, 4), (0, 4)), ((0, 4), (0, 4)))
    assert (b.src_rank, b.src_slice, b.dst_slice) == (3, ((0, 4), (0, 4)), ((4, 8), (0, 4)))
    assert [op.id for op in plan.ops] == list(range(len(plan.ops)))


def test_grouped_qkv_feeds_packed_qkv_with_kv_replication():
    # Megatron grouped (KV=2 groups of 2 q heads + k + v, head dim 1) on TP2 ->
    # vLLM packed q|k|v on TP4: each k/v head is stored whole by 2 ranks.
    src = "mesh m (tp=2)\ntensor qkv [(2, (q: 2 | k: 1 | v: 1)) over tp, 3]"
    dst = "mesh m (tp=4) at 2\ntensor qkv [(q: (4, 1) | k: (2, 1) | v: (2, 1)) over tp, 3]"
    plan = pair(src, dst)
    got = sorted((op.dst_rank, op.dst_slice[0], op.src_rank, op.src_slice[0]) for op in plan.ops)
    # dst rank 2 (tp0): q head 0, k head 0, v head 0 -- all from src rank 0 (group 0); k and v lie
    # back to back on both sides (rows 1-2 here, 2-3 there): one op (layoutlang/compiler/pieces.py, spans)
    assert got[:2] == [(2, (0, 1), 0, (0, 1)), (2, (1, 3), 0, (2, 4))]
    # dst rank 4 (tp2): q head 2 and k/v head 1 from src rank 1 (group 1)
    assert [g for g in got if g[0] == 4] == [(4, (0, 1), 1, (0, 1)), (4, (1, 3), 1, (2, 4))]


def test_missing_key_points_at_destination():
    with pytest.raises(PlanError) as e:
        pair("mesh m (tp=1)\ntensor a.weight [4]", "mesh m (tp=1)\ntensor a.wieght [4]")
    assert e.value.span.source.path == "dst.layout" and (e.value.line, e.value.col) == (2, 1)
    assert "key `a.wieght` is not in the source layout src.layout" in e.value.message
    assert "did you mean `a.weight`?" in e.value.help


def test_extent_mismatch_points_at_both_files():
    with pytest.raises(PlanError) as e:
        pair("mesh m (tp=1)\nconst H = 8\ntensor w [H, 4]", "mesh m (tp=1)\ntensor w [6, 4]")
    assert "logical shape [6, 4] here but [8, 4] in the source" in e.value.message
    assert (e.value.span.source.path, e.value.line) == ("dst.layout", 2)
    assert (e.value.notes[0].span.source.path, e.value.notes[0].span.line) == ("src.layout", 3)


def test_strided_never_meets_plain():
    """A plain side split over tp would be read as the strided parts' rows (layoutlang/compiler/refine.py):
    refused. Whole on one rank, the plain rows are the parts in their written order: it plans."""
    with pytest.raises(PlanError) as e:
        pair("mesh m (tp=2)\ntensor fc1 [(gate: 4 | up: 4) over tp]", "mesh m (tp=2)\ntensor fc1 [8 over tp]")
    assert "parts on one side only" in e.value.message and "`over tp` cuts plain rows" in e.value.message
    assert e.value.notes[0].span.source.path == "src.layout"
    assert pair("mesh m (tp=2)\ntensor fc1 [(gate: 4 | up: 4) over tp]", "mesh m (tp=1)\ntensor fc1 [8]").stats["ops"] == 4


def test_part_names_must_agree_where_both_name_them():
    with pytest.raises(PlanError) as e:
        pair("mesh m (tp=1)\ntensor w [(gate: 4 | up: 4)]", "mesh m (tp=1)\ntensor w [(up: 4 | gate: 4)]")
    assert "part 0 is named `up` here but `gate` in the source" in e.value.message
    # unnamed on one side matches
    assert pair("mesh m (tp=1)\ntensor w [(gate: 4 | up: 4)]", "mesh m (tp=1)\ntensor w [(4 | 4)]").ops


def test_unused_source_keys_are_reported():
    plan = pair("mesh m (tp=1)\ntensor a [4]\ntensor opt [4]", "mesh m (tp=1) at 1\ntensor a [4]")
    assert plan.unused_keys == ["opt"]


def test_padding_is_never_sent():
    plan = pair("mesh m (tp=2)\ntensor e [10 pad 4 over tp]", "mesh m (tp=4) at 2\ntensor e [10 pad 8 over tp]")
    covered = sorted((op.dst_rank, op.dst_slice) for op in plan.ops)
    # src: stored 12 over 2 -> rank 0 holds 0..6, rank 1 holds 6..10 then 2 pad
    # dst: stored 16 over 4 -> rank 3 holds 4..8 (from both), rank 4 holds 8..10
    # then 2 pad, rank 5 only padding (it receives nothing)
    assert covered == [(2, ((0, 4),)), (3, ((0, 2),)), (3, ((2, 4),)), (4, ((0, 2),))]


def test_local_copy_first_then_least_loaded():
    plan = pair("mesh m (dp=4, tp=1)\ntensor w [8]", "mesh m (dp=2, tp=2)\ntensor w [8 over tp]")
    senders = {op.dst_rank: op.src_rank for op in plan.ops}
    assert senders == {0: 0, 1: 1, 2: 2, 3: 3}  # every rank copies locally
    plan = pair("mesh m (dp=4, tp=1)\ntensor w [8]", "mesh m (tp=4) at 4\ntensor w [8 over tp]")
    assert sorted(op.src_rank for op in plan.ops) == [0, 1, 2, 3]  # spread over replicas


def test_same_node_preferred():
    plan = pair("mesh m (dp=4, tp=1)\ntensor w [8]", "mesh m (tp=2) at 6\ntensor w [8 over tp]",
                ranks_per_node=2)
    # receivers 6 and 7 share node 3; no source there, so least loaded wins
    assert sorted(op.src_rank for op in plan.ops) == [0, 1]
    plan = pair("mesh m (dp=8, tp=1)\ntensor w [8]", "mesh m (tp=2) at 8\ntensor w [8 over tp]",
                ranks_per_node=4)
    assert all(op.src_rank // 4 != op.dst_rank // 4 for op in plan.ops)
    plan = pair("mesh s (dp=8)\ntensor w [8]", "mesh d (tp=2) at 6\ntensor w [8 over tp]", ranks_per_node=4)
    assert sorted(op.src_rank for op in plan.ops) == [6, 7]  # local copies


def test_plan_is_deterministic():
    src = "mesh m (dp=2, gtp=2, tp=2)\nfor l in 0..3 { tensor w{l} [(gate: 8 | up: 8) over tp chunk gtp, 4] }"
    dst = "mesh m (tp=2) at 3\nfor l in 0..3 { tensor w{l} [(gate: 8 | up: 8) over tp, 4] }"
    assert pair(src, dst).ops == pair(src, dst).ops


def test_ops_for_rank_matches_full_plan():
    src = "mesh m (dp=2, tp=4)\nfor l in 0..4 { tensor w{l} [16 over tp, 4]\n tensor n{l} [4] }"
    dst = "mesh m (dp=2, tp=2) at 2\nfor l in 0..4 { tensor w{l} [16 over tp, 4]\n tensor n{l} [4] }"
    plan = pair(src, dst)
    for r in range(plan.world):
        assert plan.ops_for_rank(r) == tuple(op for op in plan.ops if r in (op.src_rank, op.dst_rank))


def test_tiling_proof_detects_gap_overlap_and_padding():
    runs = ((Run(0, 0, 4), PadRun(4, 2)), (Run(0, 0, 3),))
    assert check_tiling([((0, 2), (0, 3)), ((2, 4), (0, 3))], runs) is None
    assert check_tiling([((0, 2), (0, 3)), ((2, 4), (0, 2))], runs).kind == "gap"
    fault = check_tiling([((0, 2), (0, 3)), ((1, 4), (0, 3))], runs)
    assert (fault.kind, fault.local) == ("overlap", ((1, 2), (0, 3)))
    assert check_tiling([((0, 5), (0, 3))], runs).kind == "padding"
    assert check_tiling([()], ()) is None


def test_contiguous_slices():
    assert contiguous(((0, 2), (0, 4)), (4, 4))
    assert contiguous(((1, 2), (1, 3)), (4, 4))
    assert not contiguous(((0, 2), (0, 3)), (4, 4))
    assert contiguous((), ())


def test_buckets_bound_staging_and_graph_is_acyclic():
    src = "mesh m (tp=4)\nfor l in 0..6 { tensor w{l} [64 over tp, 32] }"
    dst = "mesh m (tp=2) at 4\nfor l in 0..6 { tensor w{l} [64 over tp, 32] mxfp8 }"
    plan = pair(src, dst, wire="bf16")  # bf16 path: every mxfp8 tensor assembled whole
    budget = 4096 * 2  # bf16 assembly of one local [32, 32] tensor is 2048 B
    bs = buckets(plan, budget)
    assert len(bs) > 1 and bs[0].first_op == 0 and bs[-1].stop_op == len(plan.ops)
    for b in bs:
        assert max(staging_per_bucket(plan, b).values()) <= budget
    tiny = buckets(plan, 1)  # every tensor larger than the budget: one bucket each
    assert len(tiny) == 6
    for r in range(plan.world):
        g = rank_graph(plan, r, budget)
        assert nx.is_directed_acyclic_graph(g)
        kinds = {g.nodes[n]["kind"] for n in g.nodes}
        assert "barrier" in kinds
        if r >= 4:
            assert {"recv", "assemble", "quantize", "done"} <= kinds
        else:
            assert "send" in kinds


def test_a_packed_destination_is_judged_whole_at_its_first_key():
    """bf16 -> fp32 is converted in the sender's staging: a [64, 32] tensor stages 64*32*4 = 8192 B,
    each [16, 32] key of the packed qkv 2048 B, the packed tensor 6144 B. Under a 10240 B budget,
    `a` and q alone would fit (10240) but k and v cannot be cut from q: the cut comes before q, and
    no bucket exceeds the budget (before: one bucket of 14336 B)."""
    src = "mesh m (r=1)\ntensor a [64, 32] bf16\ntensor q [16, 32] bf16\ntensor k [16, 32] bf16\ntensor v [16, 32] bf16\n"
    dst = "mesh e (r=1) at 1\ntensor a [64, 32] fp32\ntensor qkv [(q: 16 as q | k: 16 as k | v: 16 as v), 32] fp32\n"
    plan = pair(src, dst)
    cut = buckets(plan, 10240)
    assert [(b.first_instance, b.stop_instance) for b in cut] == [(0, 1), (1, 4)]
    assert [staging_per_bucket(plan, b) for b in cut] == [{0: 8192}, {0: 6144}]
    assert len(buckets(plan, 14336)) == 1  # all of it fits: one bucket


def test_quantized_wire_ops_bytes_and_staging_by_hand():
    """TP4 [64 over tp, 32] bf16 -> TP2 mxfp8: each engine rank gets two [16, 32] blocks. Whole
    32-element blocks, so each op carries 512 e4m3 bytes + 16 E8M0 scales = 528 B (bf16: 1024 B),
    is packed by its sender (a 528 B buffer) and lands in one 528 B buffer; no bf16 assembly."""
    src = "mesh m (tp=4)\ntensor w [64 over tp, 32]"
    dst = "mesh m (tp=2) at 4\ntensor w [64 over tp, 32] mxfp8"
    plan = pair(src, dst)
    assert [(op.wire, op.bytes) for op in plan.ops] == [("mxfp8", 528)] * 4
    assert plan.stats["bytes"] == 4 * 528
    assert instance_staging(plan, 0) == {0: 528, 1: 528, 2: 528, 3: 528, 4: 1056, 5: 1056}
    bf16 = pair(src, dst, wire="bf16")
    assert [(op.wire, op.bytes) for op in bf16.ops] == [(None, 1024)] * 4
    # the bf16 path assembles each [32, 32] local tensor whole: 2048 B; the ops land in it directly
    assert instance_staging(bf16, 0) == {4: 2048, 5: 2048}
    # a cut inside a block travels bf16: TP4 over columns -> [8-column slices of 32-element rows]
    cols = pair("mesh m (tp=4)\ntensor w [64, 32 over tp]", "mesh m (tp=2) at 4\ntensor w [64 over tp, 32] mxfp8")
    assert {(op.wire, op.bytes) for op in cols.ops} == {(None, 32 * 8 * 2)}
