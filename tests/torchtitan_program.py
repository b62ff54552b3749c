"""One worker of tests/test_bridge_torchtitan.py: live torchtitan models under FSDP2 on 2 gloo ranks.

Run by `launch(job, 2, program=__file__)`. For each tiny model (Llama3 with GQA,
Qwen3-MoE, DeepSeek-V3 with q LoRA), built by torchtitan 0.3.0's own builders and
sharded by its own `apply_fsdp_to_decoder`:

1. `layoutlang.bridges.torchtitan.describe` the live model; refit it into the HF
   checkpoint layout held whole on rank 1;
2. expected: torchtitan's `StateDictAdapter.to_hf` of the unsharded model (a copy
   made before sharding), element by element;
3. the refit tensors, saved as a checkpoint and loaded by transformers'
   `from_pretrained`, give the logits of torchtitan's own forward of the copy;
4. the reverse refit (HF on rank 1 -> a fresh FSDP2 torchtitan model) equals
   `from_hf` of the same HF tensors, compared through the fresh model's own
   `state_dict()` gathered by torch (`full_tensor`);
5. Llama3 at TP2 with torchtitan's own TP plan: the refit into HF equals `to_hf`.

torchtitan's grouped experts compute in bf16 (`GroupedExperts.forward` casts), so
for the MoE models the forward of both sides runs with the experts' weights and
inputs in bf16 as well: HF's experts are wrapped to cast the same way (written
here, from torchtitan's code), and the tolerance stays 1e-5.
"""

from __future__ import annotations

import copy
import tempfile

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

V, H = 256, 64


def _sdpa(cfg):
    """Causal SDPA instead of FlexAttention (torch.compile): torchtitan's maskless backend, same math."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def llama3():
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from transformers import LlamaConfig

    cfg = L.Llama3Model.Config(
        dim=H, vocab_size=V,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=H, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=L._output_linear_init(H)),
        layers=L._build_llama3_layers(n_layers=2, dim=H, n_heads=8, n_kv_heads=2, hidden_dim=96, attn_backend="flex",
                                      rope=ComplexRoPE.Config(dim=H // 8, max_seq_len=64, theta=500000.0)))
    hf = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False, max_position_embeddings=64)
    return _sdpa(cfg), L.Llama3StateDictAdapter, hf


def qwen3_moe():
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from transformers import Qwen3MoeConfig

    cfg = Q.Qwen3Model.Config(
        vocab_size=V, dim=H, norm=Q._qwen3_norm(H),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=Q._LINEAR_INIT),
        layers=Q._build_qwen3_moe_layers(n_layers=2, dim=H, n_heads=8, n_kv_heads=2, head_dim=16, moe_hidden_dim=32,
                                         num_experts=4, top_k=2, attn_backend="flex", moe_comm_backend="standard",
                                         rope=CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0)))
    hf = Qwen3MoeConfig(vocab_size=V, hidden_size=H, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=4,
                        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                        max_position_embeddings=64)
    return _sdpa(cfg), Q.Qwen3StateDictAdapter, hf


def deepseek_v3():
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from transformers import DeepseekV3Config

    layers = D._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=H, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=96, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="sigmoid", router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0))
    cfg = D.DeepSeekV3Model.Config(
        vocab_size=V, dim=H, layers=layers, mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=H, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=H, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=H, out_features=V, param_init=D._output_linear_init(H)))
    hf = DeepseekV3Config(vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32,
                          kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
                          topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, rope_theta=10000.0,
                          rms_norm_eps=1e-5, rope_interleave=True, tie_word_embeddings=False,
                          max_position_embeddings=64)
    return _sdpa(cfg), D.DeepSeekV3StateDictAdapter, hf


MODELS = {"llama3": llama3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


def build(name: str, seed: int):
    cfg, adapter, hf = MODELS[name]()
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    with torch.no_grad():  # DeepSeek-V3's routing bias (HF's e_score_correction_bias) not all zeros, equal
        for layer in model.layers.values():  # on every rank; Qwen3's stays torchtitan's zeros (HF has none)
            if name == "deepseek_v3" and getattr(layer, "moe", None) is not None:
                layer.moe.expert_bias_E.copy_(torch.linspace(-0.02, 0.03, layer.moe.expert_bias_E.numel()) * (seed + 1))
    return model, cfg, adapter, hf


def shard(model, mesh):
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    return model


def tensor_parallel(name: str, seed: int):
    """`name` built and parallelized by torchtitan's own TP plan (`Module.parallelize`) at TP2.

    torchtitan 0.3.0 takes its device type from the accelerator it finds and falls back to
    "cuda" (torchtitan.tools.utils.device_type); on a CPU-only machine the mesh is built on
    "cpu" by setting that module attribute, nothing else changes."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg, adapter, hf = MODELS[name]()
    set_llama3_sharding_config(cfg, enable_sp=False)
    parallel_dims.device_type = "cpu"
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_states()
    reference = copy.deepcopy(model)
    model.parallelize(dims)
    return model, reference, cfg, adapter


def one_tp_model(name: str, rank: int, report: dict) -> None:
    """TP2 (torchtitan's plan): the refit into HF equals to_hf of the unsharded copy."""
    from layoutlang import loads
    from layoutlang.bridges import torchtitan
    from layoutlang.compiler import compile_plan
    from layoutlang.runtime import Refitter

    model, reference, cfg, adapter_cls = tensor_parallel(name, seed=2)
    src_text = torchtitan.describe(model)
    dst = loads(hf_layout(model, at=1), f"<{name} hf>")
    plan = compile_plan(loads(src_text, f"<{name} tp2>"), dst)
    hf_tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in dst.tensors if t.holds(rank)}
    Refitter(plan, timeout=60).refit(torchtitan.tensors(model), hf_tensors)
    out = {"ops": plan.stats["ops"], "text": src_text, "checked": 0}
    if rank == 1:
        for key, want in adapter_cls(cfg, None).to_hf(reference.state_dict()).items():
            assert torch.equal(hf_tensors[key], want.contiguous()), f"{name} TP2: {key} differs from to_hf"
            out["checked"] += want.numel()
    report[name + "_tp2"] = out


def hf_layout(model, at: int) -> str:
    """The HF checkpoint layout on rank `at` (Llama3: with the rotary halves its Meta rows pair with)."""
    from layoutlang.bridges.families import document, render_document
    from layoutlang.bridges.torchtitan import model_of
    from layoutlang.bridges.torchtitan_layout import INTERLEAVED, with_rotary_halves

    spec = model_of(model)
    doc = document(spec, "hf", {"AT": at})
    return render_document(with_rotary_halves(doc) if spec.model_type in INTERLEAVED else doc)[0]


def bf16_experts(hf_model) -> None:
    """HF's routed experts computing as torchtitan's GroupedExperts do: weights and inputs cast to
    bf16 for the three matmuls, silu(x w1) * (x w3) in bf16, the result cast back."""
    import torch.nn.functional as F

    for module in hf_model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            def forward(hidden, top_k_index, top_k_weights, m=module):
                out = torch.zeros_like(hidden)
                for e in range(m.gate_up_proj.shape[0]):
                    rows, slot = torch.where(top_k_index == e)
                    if rows.numel() == 0:
                        continue
                    x = hidden[rows].bfloat16()
                    gate, up = m.gate_up_proj[e].bfloat16().chunk(2, dim=0)
                    h = F.silu(x @ gate.T) * (x @ up.T)
                    y = (h @ m.down_proj[e].bfloat16().T).type_as(hidden)
                    out.index_add_(0, rows, y * top_k_weights[rows, slot, None])
                return out

            module.forward = forward


def one_model(name: str, rank: int, mesh, report: dict) -> None:
    from layoutlang import loads
    from layoutlang.bridges import torchtitan
    from layoutlang.compiler import compile_plan
    from layoutlang.runtime import Refitter

    model, cfg, adapter_cls, hf_config = build(name, seed=0)
    reference = copy.deepcopy(model)  # unsharded: torchtitan's own conversions and forward run on it
    shard(model, mesh)
    src_text = torchtitan.describe(model)
    dst_text = hf_layout(model, at=1)
    src, dst = loads(src_text, f"<{name} fsdp2>"), loads(dst_text, f"<{name} hf>")
    plan = compile_plan(src, dst)
    out = {"ops": plan.stats["ops"], "text": src_text, "checked": 0}
    hf_tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in dst.tensors if t.holds(rank)}
    Refitter(plan, timeout=60).refit(torchtitan.tensors(model), hf_tensors)
    adapter = adapter_cls(cfg, None)
    want_hf = adapter.to_hf(reference.state_dict())
    tokens = torch.tensor([[3, 17, 91, 5, 250, 64, 8, 1]])
    if rank == 1:
        assert set(hf_tensors) == set(want_hf), sorted(set(hf_tensors) ^ set(want_hf))[:4]
        for key, want in want_hf.items():
            assert torch.equal(hf_tensors[key], want.contiguous()), f"{name}: {key} differs from to_hf"
            out["checked"] += want.numel()
        out["logit_diff"] = _logits_diff(name, hf_tensors, hf_config, reference, tokens)
    # reverse: the HF tensors on rank 1 into a fresh FSDP2 model, against from_hf of the same tensors
    fresh, *_ = build(name, seed=1)
    shard(fresh, mesh)
    back = compile_plan(dst, loads(torchtitan.describe(fresh), f"<{name} fresh>"))
    Refitter(back, timeout=60).refit(hf_tensors, torchtitan.tensors(fresh))
    want_titan = adapter_cls(cfg, None).from_hf({k: v.clone() for k, v in want_hf.items()})
    got_titan = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in fresh.state_dict().items()}
    assert set(want_titan) <= set(got_titan), sorted(set(want_titan) - set(got_titan))[:4]
    for key, want in want_titan.items():
        assert torch.equal(got_titan[key], want), f"{name}: {key} differs from from_hf after the reverse refit"
        out["reverse_checked"] = out.get("reverse_checked", 0) + want.numel()
    out["reverse_ops"] = back.stats["ops"]
    report[name] = out


def _logits_diff(name: str, hf_tensors: dict, hf_config, reference, tokens) -> float:
    """transformers' from_pretrained of the refit tensors, against torchtitan's forward."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        hf_config.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in hf_tensors.items()}, f"{folder}/model.safetensors")
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if name != "llama3":
        bf16_experts(hf_model)
    with torch.no_grad():
        got = hf_model(tokens).logits
        want = reference(tokens)
    return float((got - want).abs().max())


def main(job: dict, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    report: dict = {"rank": rank}
    for name in job["models"]:
        one_model(name, rank, mesh, report)
    for name in job.get("tp", ()):
        one_tp_model(name, rank, report)
    return report


if __name__ == "__main__":
    run(main)
