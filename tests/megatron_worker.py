"""One rank of a Megatron-Core bridge test (tests/test_bridge_megatron.py).

Usage: python tests/megatron_worker.py SCENARIO OUT_DIR, with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment (one gloo process per rank).

Each scenario builds a tiny megatron-core model on CPU (the test-side patches
of issue 11: `torch.cuda.current_device` returns "cpu", the inference RNG
tracker, MoE through the allgather dispatcher without grouped GEMM and
without TE's GEMM, every fusion off), describes it with
`layoutlang.bridges.megatron.describe`, refits an HF transformers model held
on one rank (described by `layoutlang.bridges.hf.describe`) through
`compile_plan` + `Refitter`, and compares the HF logits
with Megatron's (gathered over TP) after every refit. Between refits the
trainer takes an SGD step, so each refit must carry new weights.

The worker writes OUT_DIR/rank{R}.json: the described text, this rank's
parallel_state groups (global ranks, Megatron's own view), and per refit the
largest |HF - Megatron| logit difference and how far the engine was from the
trainer just before that refit. Errors are reported as data.
"""

from __future__ import annotations

import json
import os
import sys
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
STEPS = 3                      # refits; an optimizer step before each but the first


@dataclass(frozen=True)
class Scenario:
    """A trainer (parallel sizes, model family, layers) and the HF engine it refits."""

    world: int                  # processes
    tp: int
    pp: int
    ep: int
    family: str                 # llama | qwen3_moe | qwen2_moe
    layers: int = 2
    tied: bool = False          # embedding and output layer share one weight (PP=1 only: with PP > 1
    #                             Megatron copies it to the last stage with `.cuda()`, which CPU torch lacks)

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
        if self.family != "llama":
            out |= {"EP": self.ep, "ETP": self.tp}
        return out

    @property
    def padded_vocab(self) -> int:
        """Megatron's vocabulary: V padded to a multiple of make_vocab_size_divisible_by (128) x TP."""
        return -(-V // (128 * self.tp)) * 128 * self.tp

    @property
    def moe_layers(self) -> list[bool]:
        """Which layers route to experts: all for qwen3_moe, every second one (1, 3, ...) for qwen2_moe."""
        if self.family == "llama":
            return [False] * self.layers
        return [self.family == "qwen3_moe" or l % 2 == 1 for l in range(self.layers)]


SCENARIOS = {
    "gpt_tp2": Scenario(world=2, tp=2, pp=1, ep=1, family="llama", tied=True),
    "moe_ep2": Scenario(world=2, tp=1, pp=1, ep=2, family="qwen3_moe"),
    # Qwen2-MoE: dense and MoE layers alternate on each of 2 stages, q/k/v biases, a gated shared
    # expert, experts split over etp=2 (Megatron's default ETP = TP)
    "qwen2_moe_tp2_pp2": Scenario(world=4, tp=2, pp=2, ep=1, family="qwen2_moe", layers=4),
}


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
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None                 # 0.16.1 calls TE's GEMM when it is not None
    ps.initialize_model_parallel(tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                                 expert_model_parallel_size=s.ep)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    torch.manual_seed(1234)                          # every rank the same replicated weights
    moe = {}
    if s.family != "llama":
        moe = dict(num_moe_experts=E, moe_router_topk=TOPK, moe_ffn_hidden_size=I,
                   moe_layer_freq=[int(m) for m in s.moe_layers],
                   moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                   moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if s.family == "qwen2_moe":  # softmax over all experts, then top-k, not renormalized
        moe.update(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=FS, moe_shared_expert_gate=True)
    config = TransformerConfig(
        num_layers=s.layers, hidden_size=H, ffn_hidden_size=F, num_attention_heads=Q, num_query_groups=KV,
        kv_channels=D, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=EPS, add_bias_linear=False,
        add_qkv_bias=s.family == "qwen2_moe", qk_layernorm=s.family == "qwen3_moe",
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp, expert_model_parallel_size=s.ep,
        init_method_std=0.05, **moe)
    if s.family == "qwen2_moe":  # layers of two kinds: the decoder block spec, sliced to this stage
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(num_experts=moe.get("num_moe_experts"), qk_layernorm=config.qk_layernorm,
                                        normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=s.padded_vocab, max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=s.tied, position_embedding_type="rope",
                     rotary_base=int(ROPE_BASE))
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
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


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
    result = {"text": text, "groups": groups(), "refits": [],
              "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
              "tensors_are_views": all(t.data_ptr() == p.data_ptr() for t, p in
                                       zip(bridge.tensors(model).values(), model.parameters()))}
    # the engine sits on the rank that sees the full logits (the last pipeline stage's first rank)
    at = dist.get_world_size() - s.tp if s.pp > 1 else 0
    hf_model = build_hf(s)           # every rank describes it (same text); only rank `at` holds the engine
    engine = hf_model if rank == at else None
    plan = compile_plan(loads(text, path="<megatron>"), loads(hf.describe(hf_model, at=at), path="<hf>"))
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
    return result


def probe_errors(model) -> dict:
    """What describe says about models it cannot express (each probe undone before the next)."""
    from layoutlang.bridges import megatron as bridge

    def message(**kwargs) -> str:
        try:
            bridge.describe(model, **kwargs)
        except bridge.BridgeError as exc:
            return f"BridgeError: {exc.message} | help: {exc.help}"
        except Exception as exc:  # noqa: BLE001 - the test says which kind it expected
            return f"{type(exc).__name__}: {exc}"
        return "no error"

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


def main(name: str, out_dir: str) -> int:
    warnings.filterwarnings("ignore")    # megatron-core warns about Apex, TE, ... at import
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result: dict = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=120))
        result.update(run(name))
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)   # no waiting on process-group teardown


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
