"""HF tensor parallel (`from_pretrained(..., tp_plan="auto")`, issue 29) through the HF and DTensor bridges.

One launch of tests/hf_tp_plan_program.py on 2 gloo ranks (127.0.0.1, a free
port, a deadline, every process killed at the end) serves every test here: a
tiny Llama and a tiny Qwen3-MoE saved and loaded back with transformers' TP
plan, described, and refit twice into a whole HF model (equal to torch's
`full_tensor()`, same logits) and into vLLM TP2 (equal to vLLM's rules applied
to the full tensors); then `_StridedShard` alone outside transformers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it

from layoutlang import loads  # noqa: E402
from layoutlang.bridges.families import layout_text  # noqa: E402
from layoutlang.runtime.launch import launch  # noqa: E402

PROGRAM = Path(__file__).with_name("hf_tp_plan_program.py")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = launch({"dir": str(tmp_path_factory.mktemp("tp_plan"))}, 2, timeout=240, program=str(PROGRAM))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', '')}{r.stderr[-3000:]}"
    return [r.result for r in results]


def test_transformers_places_the_weights_as_the_bridge_expects(ranks):
    """The inputs: what transformers' TP plan makes of each kind of parameter (so a change there shows here)."""
    llama, moe = ranks[0]["llama"]["placements"], ranks[0]["qwen3_moe"]["placements"]
    assert ranks[0]["llama"]["tp_size"] == 2
    assert llama["model.embed_tokens.weight"] == "Shard(dim=0)" and llama["lm_head.weight"] == "Shard(dim=0)"
    assert llama["model.layers.0.self_attn.k_proj.weight"] == "Shard(dim=0)"
    assert llama["model.layers.0.self_attn.o_proj.weight"] == "Shard(dim=1)"
    assert llama["model.layers.0.mlp.down_proj.weight"] == "Shard(dim=1)"
    assert llama["model.layers.0.input_layernorm.weight"] == "plain" and llama["model.norm.weight"] == "plain"
    assert moe["model.layers.0.mlp.experts.gate_up_proj"] == "_StridedShard(dim=1, sf=2)"
    assert moe["model.layers.0.mlp.experts.down_proj"] == "Shard(dim=2)"
    for plain in ("mlp.gate.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        assert moe[f"model.layers.1.{plain}"] == "plain"


def test_the_packed_expert_shard_is_each_ranks_gate_rows_then_its_up_rows(ranks):
    """Read independently of the bridge: `to_local()` of `_StridedShard(1, sf=2)` against `full_tensor()`."""
    assert all(r["qwen3_moe"]["packed_local_is_gate_then_up"] for r in ranks)


def test_describe_writes_shards_packed_parts_and_replicas(ranks):
    llama, moe = ranks[0]["llama"]["text"], ranks[0]["qwen3_moe"]["text"]
    assert llama == ranks[1]["llama"]["text"] and moe == ranks[1]["qwen3_moe"]["text"]  # every rank: one text
    # transformers' root mesh is (pp, dp_replicate, fsdp, tp); the plain parameters are uncut: replicas
    assert "mesh pp_dp_replicate_fsdp_tp (pp=1, dp_replicate=1, fsdp=1, tp=2)\n" in llama
    assert "tensor model.embed_tokens.weight [101 over tp ragged, 64] fp32\n" in llama
    assert "tensor model.layers.0.self_attn.o_proj.weight [64, 64 over tp ragged] fp32\n" in llama
    assert "tensor model.layers.1.input_layernorm.weight [64] fp32\n" in llama
    assert "tensor model.norm.weight [64] fp32\n" in llama
    assert ("tensor model.layers.0.mlp.experts.gate_up_proj [e in 0..4, (gate: 32 as "
            "model.layers.0.mlp.experts.{e}.gate_proj.weight | up: 32 as model.layers.0.mlp.experts.{e}."
            "up_proj.weight) over tp, 64] fp32\n") in moe
    assert ("tensor model.layers.0.mlp.experts.down_proj as model.layers.0.mlp.experts.{e}.down_proj.weight "
            "[e in 0..4, 64, 32 over tp ragged] fp32\n") in moe
    assert "tensor model.layers.0.mlp.gate.weight [4, 64] fp32\n" in moe
    assert "tensor model.layers.0.self_attn.k_norm.weight [16] fp32\n" in moe
    # local shapes as transformers stores them (the worker also checked them against the layout)
    shapes = [r["qwen3_moe"]["local_shapes"] for r in ranks]
    assert [s["model.embed_tokens.weight"] for s in shapes] == [[51, 64], [50, 64]]
    assert all(s["model.layers.0.mlp.experts.gate_up_proj"] == [4, 32, 64] for s in shapes)
    assert all(s["model.layers.0.mlp.experts.down_proj"] == [4, 64, 16] for s in shapes)
    assert all(s["model.layers.0.input_layernorm.weight"] == [64] for s in shapes)


def test_refits_into_a_whole_copy_and_vllm_tp2_are_exact(ranks):
    """Two refits each (an in-place update of every shard between them): the worker compared every element
    of the whole copy with full_tensor() and of vLLM TP2 with vLLM's rules; count that it compared them all."""
    from hf_tp_plan_program import MODELS  # tests/ is on sys.path (pytest's rootdir insertion)

    for family, cfg in MODELS.items():
        whole = ranks[0][family]["whole_elements"]  # torch's count of the copy's parameters
        sizes = {"TP": 2, **({"EP": 1} if "num_experts" in cfg else {})}
        engine = loads(layout_text(cfg, "vllm", sizes))
        for rank, r in enumerate(ranks):
            held = sum(math.prod(t.local_shape_at(rank)) for t in engine.tensors if t.holds(rank))
            assert r[family]["checked"] == 2 * (held + (whole if rank == 0 else 0)), (family, rank)
        # the whole copy answers as the TP model does (TP sums in another order: not bit-equal)
        assert ranks[0][family]["max_logit_diff_0"] < 1e-5 and ranks[0][family]["max_logit_diff_1"] < 1e-5
        # vLLM TP2 back into the TP model (its shards and replicas as destinations): full_tensor() as before
        assert all(r[family]["back_equal"] for r in ranks)


def test_strided_shard_alone_outside_transformers(ranks):
    """No form: `_StridedShard(0, sf=2)` of 8 rows over tp is two unnamed parts of 4, each split (rank 0 holds
    rows 0-1 and 4-5, as torch does), refit whole equal to full_tensor() in the worker. Refused, with the
    parameter named: 6 rows (torch's pieces straddle the parts) and a form whose parts are 2 | 6."""
    generic = ranks[0]["generic"]
    assert "mesh tp (tp=2)\n\ntensor w [(4 | 4) over tp, 3] fp32\n" in generic["text"]
    assert [row[0] for row in generic["local"]] == [0.0, 3.0, 12.0, 15.0]
    assert [row[0] for row in ranks[1]["generic"]["local"]] == [6.0, 9.0, 18.0, 21.0]
    assert generic["uneven"].startswith("error: parameter `u`: dim 0 (extent 6) is cut by _StridedShard(dim=0, "
                                        "sf=2) over 2 ranks: 6 is not a multiple of 2 x 2")
    assert "help: give dim 0 an extent that is a multiple of 4" in generic["uneven"]
    assert generic["misaligned"].startswith("error: parameter `w`: dim 0 is cut by _StridedShard(dim=0, sf=2) "
                                            "over 2 ranks, but the parts its form gives the dim do not line up")


def test_what_a_model_sharded_by_hand_does_not_record_stays_refused(tmp_path):
    """Only transformers' TP plan vouches for its plain parameters: an FSDP2 model whose root module was
    left unsharded (embeddings, final norm and lm_head plain) is refused, the parameter named; so is a
    persistent buffer of a sharded model (DeepSeek-V3's score bias), named as a buffer."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hf_tp_plan_program import LLAMA, build
    from layoutlang.bridges import hf
    from layoutlang.bridges.families import BridgeError

    deepseek = dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=101,
                    n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32,
                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build(LLAMA, seed=0)
        for layer in model.model.layers:
            fully_shard(layer)
        with pytest.raises(BridgeError, match="parameter `model.embed_tokens.weight` is a plain tensor among "
                                              "DTensors"):
            hf.describe(model)
        model = build(deepseek, seed=0)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        with pytest.raises(BridgeError, match="keeps `model.layers.1.mlp.gate.e_score_correction_bias` as a "
                                              "buffer: the layout of a sharded model describes its parameters"):
            hf.describe(model)
    finally:
        dist.destroy_process_group()
