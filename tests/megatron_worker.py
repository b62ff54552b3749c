"""One rank of a Megatron-Core bridge test (tests/test_bridge_megatron.py).

Usage: python tests/megatron_worker.py SCENARIO[,SCENARIO...] OUT_DIR, with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (one gloo process per
rank). Several scenarios of one world size run one after the other in the same
processes (parallel_state torn down between them): the imports, most of a run's
time, are paid once.

Each scenario builds a tiny megatron-core model on CPU (the test-side patches
of issue 11: `torch.cuda.current_device` returns "cpu", the inference RNG
tracker, MoE through the allgather dispatcher without grouped GEMM and
without TE's GEMM, every fusion off), describes it with
`layoutlang.bridges.megatron.describe`, refits an HF transformers model held
on one rank (described by `layoutlang.bridges.hf.describe`) through
`compile_plan` + `Refitter`, and compares the HF logits
with Megatron's (gathered over TP) after every refit. Between refits the
trainer takes an SGD step, so each refit must carry new weights.

The worker writes OUT_DIR/SCENARIO.rank{R}.json: the described text, this rank's
parallel_state groups (global ranks, Megatron's own view), and per refit the
largest |HF - Megatron| logit difference and how far the engine was from the
trainer just before that refit. Errors are reported as data.

Multi-latent attention (the deepseek_v3 scenarios, megatron-core 0.19): MLA with the
local spec builds on CPU once `core_attention` is a module taking MLA's separate key
and value head sizes; `SDPAttention` below is that module (torch's
scaled_dot_product_attention, causal), the only test-side stand-in. The HF engine is
DeepseekV3ForCausalLM (rope_interleave: both sides rotate the rope dims in the
checkpoint's interleaved order).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Model sizes (fp32). GQA: 4 query heads in 2 groups of head size 8.
H, F, Q, KV, D = 32, 64, 4, 2, 8
V = 90                         # the true (HF) vocabulary; Megatron holds it padded (Scenario.padded_vocab)
E, TOPK, I, FS = 4, 2, 16, 24  # MoE: experts, routed per token, expert FFN size, shared expert FFN size
EPS, ROPE_BASE = 1e-6, 10000.0
SEQ, BATCH = 12, 2
# MLA (DeepSeek-V3 style, 4 heads): q LoRA rank, kv LoRA rank, per-head nope / rope / value sizes
Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 16, 12, 8, 4, 6
DS_SHARED, DS_SCALE, DS_GROUPS = 2, 2.5, 2   # shared experts (x I), routed scaling, expert groups (top-1 group)
STEPS = 3                      # refits; an optimizer step before each but the first


@dataclass(frozen=True)
class Scenario:
    """A trainer (parallel sizes, model family, layers) and the HF engine it refits."""

    world: int                  # processes
    tp: int
    pp: int
    ep: int
    family: str                 # llama | qwen3_moe | qwen2_moe | deepseek_v3 (MLA)
    layers: int = 2
    tied: bool = False          # embedding and output layer share one weight (PP=1 only: with PP > 1
    #                             Megatron copies it to the last stage with `.cuda()`, which CPU torch lacks)
    grouped_gemm: bool = False  # moe_grouped_gemm=True (the local spec still builds SequentialMLP experts)
    q_lora: int | None = Q_LORA  # deepseek_v3: the q LoRA rank (None: a plain linear_q_proj)
    dense_layers: int = 1       # deepseek_v3: first_k_dense_replace (layers >= it route to experts)
    replicated_down: bool = False  # deepseek_v3: down projections whole on every TP rank (ModelOpt's
    #                                `Linear`, as the Transformer Engine spec's duplicated TELinear)
    split: tuple = ()           # Megatron-LM's pipeline split args, (name, value) pairs (as `layoutc new
    #                             megatron --set` takes them; SPLIT_FIELDS names their TransformerConfig field)

    @property
    def qk_norm(self) -> bool:
        """Megatron's qk_layernorm: Qwen3's q/k norms, DeepSeek's q_a / kv_a LoRA norms. Without q LoRA,
        megatron-core 0.19 builds a kv norm only together with a norm fused into linear_q_proj (TE's
        LayerNormColumnParallelLinear, which HF lacks): that MLA runs without norms, and its HF engine
        with kv_a_layernorm an identity (`build_hf`)."""
        return self.family == "qwen3_moe" or (self.family == "deepseek_v3" and self.q_lora is not None)

    @property
    def as_layoutc_new(self) -> bool:
        """Built as `layoutc new megatron` writes it (local spec, column-parallel MLA with its LoRA norms)."""
        return not self.replicated_down and (self.family != "deepseek_v3" or self.qk_norm)

    def config_json(self) -> dict:
        """The HF config.json of the engine (what `layoutc new` reads too): the Megatron model's architecture."""
        common = {"vocab_size": V, "hidden_size": H, "intermediate_size": F, "num_hidden_layers": self.layers,
                  "num_attention_heads": Q, "num_key_value_heads": KV, "head_dim": D, "rms_norm_eps": EPS,
                  "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_BASE},
                  "tie_word_embeddings": self.tied, "dtype": "float32"}
        if self.family == "qwen3_moe":
            # q/k RMSNorm per head (Megatron qk_layernorm=True), softmax router, top-k renormalized
            # (Megatron's default: softmax over the top-k logits), every layer sparse
            return {"model_type": "qwen3_moe", **common, "moe_intermediate_size": I, "num_experts": E,
                    "num_experts_per_tok": TOPK, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "attention_bias": False}
        if self.family == "deepseek_v3":
            # MLA; sigmoid router with a score-correction bias, group-limited top-k, top-k renormalized and
            # scaled (Megatron: moe_router_score_function="sigmoid", enable_expert_bias, num_groups,
            # group_topk, topk_scaling_factor); shared experts of DS_SHARED x I; dense layers first
            del common["num_key_value_heads"], common["head_dim"]
            return {"model_type": "deepseek_v3", **common, "num_key_value_heads": Q, "q_lora_rank": self.q_lora,
                    "kv_lora_rank": KV_LORA, "qk_nope_head_dim": QK_NOPE, "qk_rope_head_dim": QK_ROPE,
                    "v_head_dim": V_HEAD, "rope_interleave": True, "attention_bias": False,
                    "moe_intermediate_size": I, "n_routed_experts": E, "n_shared_experts": DS_SHARED,
                    "num_experts_per_tok": TOPK, "n_group": DS_GROUPS, "topk_group": 1, "norm_topk_prob": True,
                    "routed_scaling_factor": DS_SCALE, "first_k_dense_replace": self.dense_layers}
        if self.family == "qwen2_moe":
            # q/k/v biases, top-k of the softmax not renormalized (Megatron moe_router_pre_softmax), shared
            # expert scaled by sigmoid(shared_expert_gate) (Megatron moe_shared_expert_gate), dense layers
            # where Megatron's moe_layer_freq has 0
            return {"model_type": "qwen2_moe", **common, "moe_intermediate_size": I,
                    "shared_expert_intermediate_size": FS, "num_experts": E, "num_experts_per_tok": TOPK,
                    "norm_topk_prob": False, "decoder_sparse_step": 1, "qkv_bias": True,
                    "mlp_only_layers": [l for l, m in enumerate(self.moe_layers) if not m]}
        return {"model_type": "llama", **common, "attention_bias": False, "mlp_bias": False}

    def sizes(self) -> dict:
        """The parallel sizes as `layoutc new megatron --set` takes them (ETP: Megatron's default, TP)."""
        out = {"TP": self.tp, "PP": self.pp, "DP": self.world // (self.tp * self.pp)}
        if any(self.moe_layers):
            out |= {"EP": self.ep, "ETP": self.tp}
        return out | dict(self.split)

    @property
    def padded_vocab(self) -> int:
        """Megatron's vocabulary: V padded to a multiple of make_vocab_size_divisible_by (128) x TP."""
        return -(-V // (128 * self.tp)) * 128 * self.tp

    @property
    def moe_layers(self) -> list[bool]:
        """Which layers route to experts: all for qwen3_moe, every second one (1, 3, ...) for qwen2_moe."""
        if self.family == "llama":
            return [False] * self.layers
        if self.family == "deepseek_v3":
            return [l >= self.dense_layers for l in range(self.layers)]
        return [self.family == "qwen3_moe" or l % 2 == 1 for l in range(self.layers)]


# Megatron-LM's pipeline split args -> TransformerConfig's fields
SPLIT_FIELDS = {"decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
                "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
                "account_for_embedding_in_pipeline_split": "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split": "account_for_loss_in_pipeline_split",
                "pipeline_model_parallel_layout": "pipeline_model_parallel_layout"}

SCENARIOS = {
    "gpt_tp2": Scenario(world=2, tp=2, pp=1, ep=1, family="llama", tied=True),
    "moe_ep2": Scenario(world=2, tp=1, pp=1, ep=2, family="qwen3_moe"),
    # Qwen2-MoE: dense and MoE layers alternate on each of 2 stages, q/k/v biases, a gated shared
    # expert, experts split over etp=2 (Megatron's default ETP = TP)
    "qwen2_moe_tp2_pp2": Scenario(world=4, tp=2, pp=2, ep=1, family="qwen2_moe", layers=4),
    # uneven stages (issue 49), in the same launch as the one above: DeepSeek-V3 (MLA, q LoRA) of 3 layers,
    # its dense layer 0 alone on the first stage (decoder_first_pipeline_num_layers=1), MoE layers 1 and 2
    # on the last: each stage holds one kind only; and Qwen2-MoE of 5 layers split 2 + 3 by a
    # pipeline_model_parallel_layout
    "deepseek_tp2_pp2_first1": Scenario(world=4, tp=2, pp=2, ep=1, family="deepseek_v3", layers=3,
                                        split=(("decoder_first_pipeline_num_layers", 1),)),
    "qwen2_moe_tp2_pp2_layout": Scenario(world=4, tp=2, pp=2, ep=1, family="qwen2_moe", layers=5,
                                         split=(("pipeline_model_parallel_layout", "Ett|t*3L"),)),
    # megatron-core 0.19 (tests/test_bridge_megatron_mla.py), one launch on 2 ranks:
    # DeepSeek-V3 MLA with q LoRA at TP2: a dense layer, then a MoE layer (grouped GEMM, experts over etp=2)
    "deepseek_mla_tp2": Scenario(world=2, tp=2, pp=1, ep=1, family="deepseek_v3", grouped_gemm=True),
    # MLA without q LoRA (linear_q_proj), dense layers only
    "deepseek_mla_no_q_lora_tp2": Scenario(world=2, tp=2, pp=1, ep=1, family="deepseek_v3", layers=1,
                                           q_lora=None),
    # MLA with its down projections replicated over TP (what the Transformer Engine spec stores)
    "deepseek_mla_replicated_down_tp2": Scenario(world=2, tp=2, pp=1, ep=1, family="deepseek_v3", layers=1,
                                                 replicated_down=True),
    # Qwen3-MoE with moe_grouped_gemm=True at EP2
    "moe_ep2_grouped_gemm": Scenario(world=2, tp=1, pp=1, ep=2, family="qwen3_moe", grouped_gemm=True),
}


class SDPAttention(torch.nn.Module):
    """Core attention for MLA on CPU: torch's scaled_dot_product_attention, causal.

    megatron-core's local DotProductAttention assumes one head size for keys and values;
    MLA's differ (QK_NOPE + QK_ROPE vs V_HEAD). Megatron builds `core_attention` with
    these keyword arguments and calls it with [s, b, heads, size] query, key and value.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))          # [b, heads, s, size]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)   # [s, b, heads * V_HEAD]


def build_megatron(s: Scenario):
    torch.cuda.current_device = lambda: "cpu"        # megatron asks for a device at build and forward
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    moe_utils.te_general_gemm = None                 # 0.16.1 calls TE's GEMM when it is not None
    ps.initialize_model_parallel(tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                                 expert_model_parallel_size=s.ep)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)                          # every rank the same replicated weights
    moe = {}
    if s.family != "llama":
        moe = dict(num_moe_experts=E, moe_router_topk=TOPK, moe_ffn_hidden_size=I,
                   moe_layer_freq=[int(m) for m in s.moe_layers],
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=s.grouped_gemm,
                   moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if s.family == "qwen2_moe":  # softmax over all experts, then top-k, not renormalized
        moe.update(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=FS, moe_shared_expert_gate=True)
    mla = {}
    if s.family == "deepseek_v3":  # HF DeepSeek-V3's router and attention (Scenario.config_json)
        if any(s.moe_layers):
            moe.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_num_groups=DS_GROUPS, moe_router_group_topk=1,
                       moe_router_topk_scaling_factor=DS_SCALE, moe_shared_expert_intermediate_size=DS_SHARED * I)
        # rope (not yarn): HF's default rope with rope_interleave; qk_layernorm: the q_a / kv_a RMSNorms
        mla = dict(q_lora_rank=s.q_lora, kv_lora_rank=KV_LORA, qk_head_dim=QK_NOPE, qk_pos_emb_head_dim=QK_ROPE,
                   v_head_dim=V_HEAD, rope_type="rope", rotary_base=ROPE_BASE,
                   transformer_impl="local")   # MLA resolves its norms and q_proj from this backend
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=s.layers, hidden_size=H, ffn_hidden_size=F, num_attention_heads=Q, num_query_groups=KV,
        kv_channels=D, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False,
        add_qkv_bias=s.family == "qwen2_moe", qk_layernorm=s.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp, expert_model_parallel_size=s.ep,
        init_method_std=0.05, **moe, **mla, **{SPLIT_FIELDS[k]: v for k, v in s.split})
    if s.family in ("qwen2_moe", "deepseek_v3"):  # layers of two kinds: the decoder block spec, this stage's
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        layer_specs = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), moe_grouped_gemm=s.grouped_gemm,
                                        qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
        layer_specs = [spec]
    if mla:
        for layer in layer_specs:
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = SDPAttention
            if s.replicated_down:  # ModelOpt's plain Linear (MLA accepts it only where TE is importable)
                from megatron.core.post_training.modelopt.layers import Linear
                from megatron.core.transformer import multi_latent_attention

                multi_latent_attention.Linear = Linear
                attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=s.padded_vocab, max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=s.tied, position_embedding_type="rope",
                     rotary_base=int(ROPE_BASE))    # MLA: the attention's own rotary embedding, not this one
    if any(s.moe_layers) and s.family == "deepseek_v3":  # a score-correction bias the refit must carry
        for name, b in model.named_buffers():
            if name.endswith("router.expert_bias"):
                layer = int(name.split(".")[2])
                b.copy_(torch.rand(E, generator=torch.Generator().manual_seed(500 + layer)) * 0.1)
    if s.ep > 1:  # the same seed made every EP rank's local experts alike: give each global expert its own
        assert ps.get_expert_tensor_parallel_world_size() == 1
        offset = ps.get_expert_model_parallel_rank() * (E // s.ep)
        for name, p in model.named_parameters():
            if ".local_experts." in name:
                layer, local = int(name.split(".")[2]), int(name.split(".local_experts.")[1].split(".")[0])
                g = torch.Generator().manual_seed(1000 + 37 * (offset + local) + 101 * layer + len(name))
                p.data.normal_(0.0, 0.05, generator=g)
    # eval mode (dropout is 0 anyway): MoE refuses to train with TP > 1 without sequence parallelism,
    # which the torch norms of the local spec do not support; gradients and steps work the same
    return model.eval()


def build_hf(s: Scenario):
    """The engine: an HF model of the same architecture, random weights (the refit must overwrite them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(99)
    fields = s.config_json()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if s.family == "deepseek_v3" and not s.qk_norm:   # the trainer's MLA without a kv norm (Scenario.qk_norm)
        for layer in model.model.layers:   # the weight stays (HF's layout holds it), the norm is skipped
            layer.self_attn.kv_a_layernorm.forward = lambda x: x
    return model


def megatron_logits(model, tokens, s: Scenario):
    """Full-vocabulary logits [B, S, V] on the last pipeline stage's ranks (None elsewhere)."""
    from megatron.core import parallel_state as ps

    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: not attended
    if s.pp > 1:  # a hand-made two-stage pipeline: stage 0 sends its hidden states to stage 1
        if ps.is_pipeline_first_stage():
            hidden = model(tokens, position_ids, mask)
            dist.send(hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None, hidden
        hidden = torch.empty(SEQ, BATCH, H)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_(True)
        model.set_input_tensor(hidden)
    local = model(tokens, position_ids, mask)        # [B, S, padded vocabulary / tp]
    parts = [torch.empty_like(local) for _ in range(s.tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :V], local


def sgd_step(model, out, lr=0.5):
    """One step on a toy loss; gradients averaged over the data-parallel replicas, as DDP would."""
    from megatron.core import parallel_state as ps

    model.zero_grad(set_to_none=True)
    out.float().pow(2).mean().backward() if out.requires_grad else None
    for p in model.parameters():
        if p.grad is None:
            continue
        expert = getattr(p, "allreduce", True) is False
        group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dist.get_world_size(group)
        tp = ps.get_tensor_model_parallel_group()
        if not expert and not getattr(p, "tensor_model_parallel", False) and dist.get_world_size(tp) > 1:
            # a weight whole on every TP rank: its replicas must stay equal (Megatron's finalize_model_grads);
            # MLA's replicated kv down projection gets a partial gradient per rank through the rope key
            dist.all_reduce(p.grad, group=tp)
            p.grad /= dist.get_world_size(tp)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def groups() -> dict:
    from megatron.core import parallel_state as ps

    def ranks(g):
        return dist.get_process_group_ranks(g)
    return {"tp": ranks(ps.get_tensor_model_parallel_group()), "pp": ranks(ps.get_pipeline_model_parallel_group()),
            "dp": ranks(ps.get_data_parallel_group()), "ep": ranks(ps.get_expert_model_parallel_group()),
            "etp": ranks(ps.get_expert_tensor_parallel_group()), "edp": ranks(ps.get_expert_data_parallel_group())}


def run(name: str) -> dict:
    from layoutlang.runtime import Refitter

    from layoutlang import compile_plan, loads
    from layoutlang.bridges import hf
    from layoutlang.bridges import megatron as bridge

    s = SCENARIOS[name]
    rank = dist.get_rank()
    model = build_megatron(s)
    text = bridge.describe(model, vocab_size=V)
    weights = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                            if n.endswith(".router.expert_bias"))]   # DeepSeek's routing bias
    result = {"text": text, "groups": groups(), "refits": [],
              "shapes": {n: list(p.shape) for n, p in weights},
              "tensors_are_views": all(t.data_ptr() == p.data_ptr() for t, p in
                                       zip(bridge.tensors(model).values(), model.parameters()))}
    # the engine sits on the rank that sees the full logits (the last pipeline stage's first rank)
    at = dist.get_world_size() - s.tp if s.pp > 1 else 0
    hf_model = build_hf(s)           # every rank describes it (same text); only rank `at` holds the engine
    engine = hf_model if rank == at else None
    engine_text = hf.describe(hf_model, at=at)
    if s.family == "deepseek_v3" and not s.qk_norm:   # skipped in the engine, absent in the trainer
        engine_text = "\n".join(line for line in engine_text.splitlines() if "kv_a_layernorm" not in line)
    plan = compile_plan(loads(text, path="<megatron>"), loads(engine_text, path="<hf>"))
    refitter = Refitter(plan, timeout=timedelta(seconds=60), verify=True)
    torch.manual_seed(7)
    tokens = torch.randint(0, V, (BATCH, SEQ))
    engine_tensors = hf.tensors(engine) if engine is not None else None
    out = None                       # Megatron's local output, what the next SGD step differentiates
    for step in range(STEPS):
        if step:
            sgd_step(model, out)
        with torch.no_grad():
            stale = engine(tokens).logits if engine is not None else None
        full, out = megatron_logits(model, tokens, s)
        refitter.refit(bridge.tensors(model), engine_tensors)
        if engine is not None:
            with torch.no_grad():
                fresh = engine(tokens).logits
            result["refits"].append({"max_diff": (fresh - full).abs().max().item(),
                                     "stale_diff": (stale - full).abs().max().item(),
                                     "logit_scale": full.abs().max().item()})
    dist.barrier()
    if name == "gpt_tp2":
        result["errors"] = probe_errors(model)
    if name == "deepseek_mla_tp2":
        result["errors"] = probe_mla_errors(model)
    return result


def _message(model, **kwargs) -> str:
    """What describe says: `BridgeError: message | help: ...`, another exception's text, or `no error`."""
    from layoutlang.bridges import megatron as bridge

    try:
        bridge.describe(model, **kwargs)
    except bridge.BridgeError as exc:
        return f"BridgeError: {exc.message} | help: {exc.help}"
    except Exception as exc:  # noqa: BLE001 - the test says which kind it expected
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def probe_mla_errors(model) -> dict:
    """What describe says about MLA models it cannot express (each probe undone before the next)."""
    message = lambda **kwargs: _message(model, vocab_size=V, **kwargs)  # noqa: E731
    out = {"wrong_family": message(family="qwen3_moe")}          # a family without MLA's HF names
    attention = model.decoder.layers[0].self_attention
    kv_down = attention.linear_kv_down_proj.weight
    kv_down.tensor_model_parallel = False                        # "replicated", but only its TP slice is here
    out["kv_down_not_split"] = message()
    kv_down.tensor_model_parallel = True
    q_up = attention.linear_q_up_proj.weight
    q_up.partition_dim = 1                                       # attributes that contradict the role
    out["q_up_wrong_dim"] = message()
    q_up.partition_dim = 0
    attention.linear_qkv_down_proj = torch.nn.Linear(H, Q_LORA + KV_LORA + QK_ROPE, bias=False)  # TE's fused one
    out["fused_down_proj"] = message()
    del attention.linear_qkv_down_proj
    out["after_probes"] = message()
    return out


def probe_errors(model) -> dict:
    """What describe says about models it cannot express (each probe undone before the next)."""
    message = lambda **kwargs: _message(model, **kwargs)  # noqa: E731

    out = {}
    mlp = model.decoder.layers[1].mlp
    mlp.extra_scale = torch.nn.Parameter(torch.ones(H))        # a parameter no HF key is known for
    out["unknown_parameter"] = message(vocab_size=V)
    del mlp.extra_scale
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    qkv.partition_dim = 1                                       # attributes that contradict the role
    out["wrong_partition_dim"] = message(vocab_size=V)
    qkv.partition_dim = 0
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    fc1.partition_stride = 3
    out["impossible_stride"] = message(vocab_size=V)
    fc1.partition_stride = 2
    out["vocab_too_large"] = message(vocab_size=model.vocab_size + 1)
    out["unknown_family"] = message(vocab_size=V, family="mixtrl")
    out["after_probes"] = message(vocab_size=V)                 # every probe undone: describes again
    return out


def main(names: str, out_dir: str) -> int:
    """Run each comma-separated scenario in turn; OUT_DIR/NAME.rank{R}.json per scenario (a failed
    scenario's file says why, and the ones after it do not run)."""
    warnings.filterwarnings("ignore")    # megatron-core warns about Apex, TE, ... at import
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    ok = True
    try:
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=120))
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        ok, failure = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    for name in names.split(","):
        result: dict = {"rank": rank, "scenario": name}
        if ok:
            try:
                start = time.monotonic()
                result.update(run(name))
                result.update(ok=True, seconds=round(time.monotonic() - start, 2))
            except Exception as exc:  # noqa: BLE001 - reported to the test as data
                ok, failure = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                result.update(ok=False, error=failure)
                failure = f"not run: scenario {name} failed before it"
            else:
                from megatron.core import parallel_state as ps
                ps.destroy_model_parallel()      # the next scenario initializes its own
        if "ok" not in result:
            result.update(ok=False, error=failure)
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    sys.stdout.flush()
    os._exit(0 if ok else 1)   # no waiting on process-group teardown


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
