"""Planning keys inside stored tensors (LANGUAGE.md 8.1 part keys): every decomposition pairs.

The small v2 examples describe one Llama in three decompositions written to the
HF-key convention: Megatron (grouped QKV and gate|up fc1 with part keys, TP x GTP
x DP), vLLM (fused q|k|v and gate|up with part keys, MXFP8) and the HF checkpoint
(every weight unfused, one rank). Every ordered pair plans and the slow
simulator (tests/plan_simulator.py: values by key and index in the key, from the
front end's key boxes and runs) finds every destination element written once
with its value. Expected totals come from the v1 layouts of the same model.
"""

import itertools
import json
from pathlib import Path

import pytest

from layoutlang import compile_plan, loads
from layoutlang.compiler import PlanError
from layoutlang.report.render import iter_json
from plan_simulator import RunsView, check_plan_views, check_stats, simulate

EX = Path(__file__).parent.parent / "examples"
SMALL_V2 = EX / "small" / "v2"
DECOMPOSITIONS = ("megatron", "vllm", "hf")
KEYS = {"llama": 3 + 2 * 9,  # embed, lm_head, norm + per layer 2 norms, q, k, v, o, gate, up, down
        "moe": 2 * (1 + 8 * 3)}  # per layer the router + 8 experts x gate, up, down


def _path(name: str, model: str = "llama") -> str:
    return str(SMALL_V2 / f"{model}_{name}.layout")


@pytest.mark.parametrize("model", ["llama", "moe"])
@pytest.mark.parametrize("src,dst", list(itertools.permutations(DECOMPOSITIONS, 2)),
                         ids=lambda x: x)
@pytest.mark.parametrize("at", [0, 5])
def test_every_decomposition_pair_moves_every_element_once(model, src, dst, at):
    """moe: per-expert Megatron tensors (fc1 with part keys), vLLM FusedMoE stacked w13/w2
    (LANGUAGE.md 8.2: `e in 0..E over ep` with part keys inside), HF per-expert weights."""
    dst_args = {} if dst == "megatron" else {"AT": at}
    plan = compile_plan(_path(src, model), _path(dst, model), dst_args=dst_args)
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
    assert plan.unused_keys == []
    assert len({e.key for e in plan.tensors}) == KEYS[model]


def test_stacked_expert_ops_land_at_their_expert_index():
    """vLLM rank 1 of EP4 holds experts 2 and 3 at local indexes 0 and 1 of w13 and w2."""
    plan = compile_plan(_path("hf", "moe"), _path("vllm", "moe"), dst_args={"AT": 1})
    ops = [op for op in plan.ops if op.dst_rank == 2 and op.dst_name == "model.layers.0.mlp.experts.w13_weight"]
    got = sorted((op.key.split(".")[5], op.key.split(".")[6], op.dst_slice) for op in ops)
    assert got == [("2", "gate_proj", ((0, 1), (0, 32), (0, 64))), ("2", "up_proj", ((0, 1), (32, 64), (0, 64))),
                   ("3", "gate_proj", ((1, 2), (0, 32), (0, 64))), ("3", "up_proj", ((1, 2), (32, 64), (0, 64)))]
    assert all(op.src_rank == 0 and op.src_slice == ((0, 32), (0, 64)) for op in ops)


def test_v2_totals_equal_the_v1_layouts_of_the_same_model():
    """Megatron -> vLLM moves the same bytes as the v1 fused-key pair (examples/small/llama_*)."""
    v1 = compile_plan(str(EX / "small" / "llama_train.layout"), str(EX / "small" / "llama_infer.layout"))
    v2 = compile_plan(_path("megatron"), _path("vllm"))
    assert v2.stats["bytes"] == v1.stats["bytes"]
    assert v2.stats["max_send_bytes"] == v1.stats["max_send_bytes"]
    assert v2.stats["network_bytes"] == v1.stats["network_bytes"]


def test_full_size_llama_v2_pair_matches_the_v1_pair():
    for wire in ("auto", "bf16"):  # 32122109952: every element once, in bf16 (the v1 wire)
        v1 = compile_plan(str(EX / "llama3_8b_train.layout"), str(EX / "llama3_8b_infer.layout"), wire=wire)
        v2 = compile_plan(str(EX / "v2" / "llama3_8b_megatron.layout"), str(EX / "v2" / "llama3_8b_vllm.layout"),
                          wire=wire)
        assert v2.stats["bytes"] == v1.stats["bytes"] and (wire == "auto" or v1.stats["bytes"] == 32122109952)
        assert round(v2.stats["send_balance"], 4) == round(v1.stats["send_balance"], 4)


def test_ops_never_mix_keys_and_name_the_stored_tensors():
    plan = compile_plan(_path("hf"), _path("vllm"))
    fused = {op.dst_name for op in plan.ops if op.dst_name.endswith("qkv_proj.weight")}
    assert fused == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"}
    for op in plan.ops:
        if op.dst_name.endswith("qkv_proj.weight"):
            part = op.key.rsplit(".", 2)[-2]  # q_proj / k_proj / v_proj
            # a relay (a vLLM replica forwarding what it received) reads the stored destination tensor
            assert op.src_name == (op.dst_name if op.after else op.key) and part in ("q_proj", "k_proj", "v_proj")
    # rank 0 of the vLLM engine (TP2): q rows 0..63 of 128, k rows 0..7 of 16, v rows 0..7 of 16
    mine = [op for op in plan.ops_for_rank(0) if op.dst_name == "model.layers.0.self_attn.qkv_proj.weight"]
    got = sorted((op.key.rsplit(".", 2)[-2], op.src_slice[0], op.dst_slice[0]) for op in mine if op.dst_rank == 0)
    assert got == [("k_proj", (0, 8), (64, 72)), ("q_proj", (0, 64), (0, 64)), ("v_proj", (0, 8), (72, 80))]


def test_quantized_stored_tensor_is_one_bucket_however_many_keys():
    from layoutlang.compiler.graph import buckets

    plan = compile_plan(_path("megatron"), _path("vllm"))
    bucket_list = buckets(plan, 1)  # the smallest budget: cut wherever a cut is allowed
    assert len(bucket_list) > 5
    where: dict[int, set[int]] = {}
    for b in bucket_list:
        for i in range(b.first_instance, b.stop_instance):
            where.setdefault(id(plan.matches[i].dst), set()).add(b.index)
    assert all(len(found) == 1 for found in where.values())
    assert max(sum(1 for m in plan.matches if m.dst is t) for t in plan.dst.tensors) == 3  # q, k, v


def test_missing_key_suggests_part_keys_on_a_fused_source():
    src = loads("mesh m (tp=2)\ntensor qkv [(q: 8 | k: 4 | v: 4) over tp, 8]\n", "fused.layout")
    dst = loads("mesh m (r=1)\ntensor q [8, 8]\n", "split.layout")
    with pytest.raises(PlanError) as info:
        compile_plan(src, dst)
    err = info.value
    assert err.message == "key `q` is not in the source layout fused.layout"
    assert (err.span.source.path, err.span.line, err.span.col) == ("split.layout", 2, 1)
    assert err.help == ("if it holds the key, give its parts keys: `(q: 8 as KEY | k: 4 as KEY | v: 4 as KEY)`, "
                        "one of them `q` (LANGUAGE.md 8.1)")
    # the line to edit: the fused source tensor's declaration
    assert [(n.span.source.path, n.span.line) for n in err.notes] == [("fused.layout", 2)]


def test_a_key_whose_parts_differ_is_a_diagnostic_at_both_declarations():
    src = loads("mesh m (r=1)\ntensor w [(a: (x: 2 | y: 2) as A | b: 4 as B), 8]\n", "s.layout")
    dst = loads("mesh m (r=1)\ntensor A [(x: 1 | y: 1 | z: 2), 8]\ntensor B [4, 8]\n", "d.layout")
    with pytest.raises(PlanError) as info:
        compile_plan(src, dst)
    err = info.value
    assert err.message.startswith("`A` dim 0: 3 parts here but 2 in the source")
    assert err.span.source.path == "d.layout" and err.span.line == 2
    assert err.notes[0].span.source.path == "s.layout"


@pytest.mark.parametrize("src,dst", [("hf", "tp"), ("tp", "hf")])
@pytest.mark.parametrize("at", [0, 3])
def test_transposed_conv1d_pairs_with_an_out_in_engine(src, dst, at):
    """GPT-2's HF Conv1D stores [in, out] (LANGUAGE.md 8.3) for keys [out, in]."""
    path = lambda name: str(SMALL_V2 / f"gpt2_{name}.layout")  # noqa: E731
    plan = compile_plan(path(src), path(dst), dst_args={"AT": at} if dst == "tp" else {})
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_stats(plan, report)
    assert sum(1 for op in plan.ops if op.transpose is not None) == 24  # every 2-d weight, both TP halves


def test_a_transposed_op_by_hand():
    """c_proj [H=32, H] transposed on the HF rank; the engine's row-parallel c_proj [H, H over tp]:
    tp rank 1 holds key columns 16..32 = stored ROWS 16..32 of the Conv1D weight, a [16, 32] block
    that arrives as its [32, 16] transpose."""
    plan = compile_plan(str(SMALL_V2 / "gpt2_hf.layout"), str(SMALL_V2 / "gpt2_tp.layout"), dst_args={"AT": 1})
    op = next(op for op in plan.ops if op.key == "transformer.h.0.attn.c_proj.weight" and op.dst_rank == 2)
    assert (op.src_rank, op.src_slice, op.dst_slice, op.transpose) == (0, ((16, 32), (0, 32)), ((0, 32), (0, 16)),
                                                                       (16, 32))
    ops = json.loads("".join(iter_json(plan)))["ops"]
    assert ops[op.id]["transposed"] is True  # LANGUAGE.md 8.4
    norm = next(o for o in plan.ops if o.key == "transformer.h.0.ln_1.weight")
    assert "transposed" not in ops[norm.id]


def test_explain_draws_a_key_inside_a_stacked_tensor_and_a_stored_tensor_by_name():
    from layoutlang import load
    from layoutlang.report.explain import explain_text

    src, dst = load(_path("megatron", "moe")), load(_path("vllm", "moe"))
    plan = compile_plan(src, dst)
    text = explain_text(src, "model.layers.0.mlp.experts.3.gate_proj.weight", dst, plan, width=160)
    # expert 3 sits at stacked index 3 of w13 (rows 0..32 = gate); vLLM's EP4 rank 1 holds experts 2, 3
    assert "holds this key at [3:4, 0:32, 0:64] of its logical tensor, stacked dims [0]" in text
    assert "[1:2, 0:16, 0:64]" in text and "[1:2, 16:32, 0:64]" in text  # local expert 1, two etp halves
    text = explain_text(dst, "model.layers.0.mlp.experts.w13_weight", width=160)
    assert "holds 16 keys: model.layers.0.mlp.experts.0.gate_proj.weight [0:1, 0:32, 0:64]" in text
