"""The Megatron-Core bridge on megatron-core 0.19: multi-latent attention and grouped GEMM (issue 29).

One launch of two gloo ranks (tests/megatron_worker.py, scenarios run one after
the other in the same processes) builds, describes and refits four models; each
test below reads its scenario's results, so the imports are paid once:

- DeepSeek-V3 MLA with q LoRA at TP2 (local spec, `core_attention` an SDPA module):
  a dense layer, then a MoE layer with `moe_grouped_gemm=True` (experts over etp=2),
  shared experts and a sigmoid router with a score-correction bias;
- MLA without q LoRA (`linear_q_proj`);
- MLA with its down projections whole on every TP rank (ModelOpt's `Linear`, what
  the Transformer Engine spec's duplicated TELinear stores; TE itself needs a GPU);
- Qwen3-MoE with `moe_grouped_gemm=True` at EP2.

Each is refit three times (an SGD step before the second and third) into an HF
transformers model on rank 0 (DeepseekV3ForCausalLM, Qwen3MoeForCausalLM) and the
HF logits, transformers' own forward, are compared with Megatron's: the reference
is independent of the bridge. The described text must also elaborate to every
rank's real parameter shapes and (local spec) equal `layoutc new megatron`.
"""

from __future__ import annotations

import pytest

megatron_core = pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
if tuple(int(x) for x in megatron_core.__version__.split("+")[0].split(".")[:2]) < (0, 19):
    pytest.skip(f"megatron-core {megatron_core.__version__}: MLA builds on the local spec from 0.19 "
                "(scripts/megatron_matrix.sh runs 0.16.1; CI runs 0.19.2)", allow_module_level=True)

from test_bridge_megatron import _check_run, _launch  # tests/: the launcher and the common checks

from layoutlang import loads

SCENARIOS = "deepseek_mla_tp2,deepseek_mla_no_q_lora_tp2,deepseek_mla_replicated_down_tp2,moe_ep2_grouped_gemm"


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """The one launch every test of this file reads."""
    return _launch(SCENARIOS, timeout=200)


def _statement(text: str, name: str) -> str:
    line = next((line for line in text.splitlines() if f"tensor {name} " in line), None)
    assert line is not None, f"{name} is not described:\n{text}"
    return line.strip()


@pytest.mark.timeout(260)
def test_mla_with_q_lora_at_tp2_refits_into_hf_deepseek_v3_and_the_logits_match(runs):
    text = _check_run("deepseek_mla_tp2", runs["deepseek_mla_tp2"], engine_rank=0)
    attn = "decoder.layers.{l}.self_attention"
    # the local spec splits every projection on dim 0 over tp, the down projections too
    assert _statement(text, f"{attn}.linear_q_down_proj.weight") == (
        f"tensor {attn}.linear_q_down_proj.weight as model.layers.{{l}}.self_attn.q_a_proj.weight "
        "[Q_LORA over tp, H]")
    # the kv down projection's split crosses the latent / rope boundary: one extent, as stored
    assert _statement(text, f"{attn}.linear_kv_down_proj.weight") == (
        f"tensor {attn}.linear_kv_down_proj.weight as model.layers.{{l}}.self_attn.kv_a_proj_with_mqa.weight "
        "[KV_LORA + QK_ROPE over tp, H]")
    assert "[(NH, QK_NOPE + QK_ROPE) over tp, Q_LORA]" in _statement(text, f"{attn}.linear_q_up_proj.weight")
    assert "[(NH, QK_NOPE + V_HEAD) over tp, KV_LORA]" in _statement(text, f"{attn}.linear_kv_up_proj.weight")
    assert "o_proj.weight [H, NH*V_HEAD over tp]" in _statement(text, f"{attn}.linear_proj.weight")
    assert "q_a_layernorm.weight [Q_LORA]" in _statement(text, f"{attn}.q_layernorm.weight")
    assert "kv_a_layernorm.weight [KV_LORA]" in _statement(text, f"{attn}.kv_layernorm.weight")
    # grouped GEMM with the local spec: per-expert SequentialMLP weights, experts over etp
    assert "mesh experts (pp=1, edp=1, ep=1, etp=2) at 0" in text
    assert ("tensor decoder.layers.{l}.mlp.experts.local_experts.{e.local}.linear_fc2.weight as "
            "model.layers.{l}.mlp.experts.{e}.down_proj.weight [H, I over etp] on experts") in text
    assert "as model.layers.{l}.mlp.gate.e_score_correction_bias [E]" in text   # an fp32 buffer
    assert "mlp.shared_experts.gate_proj.weight" in text
    # rank 1 holds the second half of the kv down projection's rows: the last 2 latent rows, then the
    # 4 rope rows (KV_LORA 12 + QK_ROPE 4 = 16, 8 per rank)
    name = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    kv_down = next(t for t in loads(text).tensors if t.name == name)
    assert kv_down.local_shape_at(1) == (8, 32)
    assert [(r.logical_start, r.length) for r in kv_down.runs(1)[0]] == [(8, 8)]


@pytest.mark.timeout(260)
def test_mla_without_q_lora_refits_through_linear_q_proj(runs):
    text = _check_run("deepseek_mla_no_q_lora_tp2", runs["deepseek_mla_no_q_lora_tp2"], engine_rank=0)
    attn = "decoder.layers.{l}.self_attention"
    assert _statement(text, f"{attn}.linear_q_proj.weight") == (
        f"tensor {attn}.linear_q_proj.weight as model.layers.{{l}}.self_attn.q_proj.weight "
        "[(NH, QK_NOPE + QK_ROPE) over tp, H]")
    assert "q_a_proj" not in text and "Q_LORA" not in text


@pytest.mark.timeout(260)
def test_mla_with_replicated_down_projections_is_described_whole_on_every_tp_rank(runs):
    text = _check_run("deepseek_mla_replicated_down_tp2", runs["deepseek_mla_replicated_down_tp2"],
                      engine_rank=0)
    attn = "decoder.layers.{l}.self_attention"
    assert _statement(text, f"{attn}.linear_q_down_proj.weight").endswith("[Q_LORA, H]")
    assert _statement(text, f"{attn}.linear_kv_down_proj.weight").endswith("[KV_LORA + QK_ROPE, H]")
    assert "[(NH, QK_NOPE + V_HEAD) over tp, KV_LORA]" in _statement(text, f"{attn}.linear_kv_up_proj.weight")


@pytest.mark.timeout(260)
def test_grouped_gemm_moe_at_ep2_refits_into_hf_qwen3_moe(runs):
    text = _check_run("moe_ep2_grouped_gemm", runs["moe_ep2_grouped_gemm"], engine_rank=0)
    assert "mesh experts (pp=1, edp=1, ep=2, etp=1) at 0" in text
    assert ("tensor decoder.layers.{l}.mlp.experts.local_experts.{e.local}.linear_fc1.weight "
            "[(gate: I as model.layers.{l}.mlp.experts.{e}.gate_proj.weight | up: I as "
            "model.layers.{l}.mlp.experts.{e}.up_proj.weight) over etp, H] on experts") in text


@pytest.mark.timeout(260)
def test_mla_models_the_bridge_cannot_express_are_refused_naming_the_parameter(runs):
    errors = runs["deepseek_mla_tp2"][0]["errors"]
    assert "family `qwen3_moe` has no HF names for multi-latent attention" in errors["wrong_family"]
    assert "deepseek_v3" in errors["wrong_family"]
    # marked replicated while it holds only its TP slice: the shape check names it
    assert "`decoder.layers.0.self_attention.linear_kv_down_proj.weight` on rank 0 has shape [8, 32]" \
        in errors["kv_down_not_split"]
    assert "`decoder.layers.0.self_attention.linear_q_up_proj.weight` is tensor-parallel on dim 1" \
        in errors["q_up_wrong_dim"]
    assert "`decoder.layers.0.self_attention.linear_qkv_down_proj.weight`" in errors["fused_down_proj"]
    assert "mla_down_proj_fusion=False" in errors["fused_down_proj"]
    assert errors["after_probes"] == "no error"
