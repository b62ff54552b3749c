"""One worker of tests/test_bridge_dtensor.py: FSDP2 HF Llama -> vLLM-style TP2 -> whole HF model.

Run by `layoutlang.runtime.launch.launch(job, 2, program=__file__)` as
`python fsdp2_refit_program.py JOB.json OUT.json` on 2 gloo ranks. Every
expected value is written here from the formats' rules (vLLM packs q|k|v and
gate|up per TP rank, pads the vocabulary to 64) applied to the unsharded model,
or read back through torch's own DTensor gather (`full_tensor`), never from
the plan under test.
"""

from __future__ import annotations

import copy

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

V, H, F, Q, KV, D, L = 37, 16, 24, 4, 2, 4, 2
TP = 2

VLLM = f"""
layout tiny_llama_vllm
const L = {L}, H = {H}, F = {F}, Q = {Q}, KV = {KV}, D = {D}, V = {V}
mesh infer (tp={TP})
tensor model.embed_tokens.weight [V pad 64 over tp, H] fp32
tensor lm_head.weight [V pad 64 over tp, H] fp32
tensor model.norm.weight [H] fp32
for l in 0..L {{
  tensor model.layers.{{l}}.input_layernorm.weight [H] fp32
  tensor model.layers.{{l}}.self_attn.qkv_proj.weight [(q: (Q, D) as model.layers.{{l}}.self_attn.q_proj.weight | k: (KV, D) as model.layers.{{l}}.self_attn.k_proj.weight | v: (KV, D) as model.layers.{{l}}.self_attn.v_proj.weight) over tp, H] fp32
  tensor model.layers.{{l}}.self_attn.o_proj.weight [H, Q*D over tp] fp32
  tensor model.layers.{{l}}.post_attention_layernorm.weight [H] fp32
  tensor model.layers.{{l}}.mlp.gate_up_proj.weight [(gate: F as model.layers.{{l}}.mlp.gate_proj.weight | up: F as model.layers.{{l}}.mlp.up_proj.weight) over tp, H] fp32
  tensor model.layers.{{l}}.mlp.down_proj.weight [H, F over tp] fp32
}}
"""


HF_WHOLE = f"""
layout tiny_llama_hf
const L = {L}, H = {H}, F = {F}, Q = {Q}, KV = {KV}, D = {D}, V = {V}
mesh hf (r=1) at 1
tensor model.embed_tokens.weight [V, H] fp32
tensor lm_head.weight [V, H] fp32
tensor model.norm.weight [H] fp32
for l in 0..L {{
  tensor model.layers.{{l}}.input_layernorm.weight [H] fp32
  tensor model.layers.{{l}}.self_attn.q_proj.weight [Q*D, H] fp32
  tensor model.layers.{{l}}.self_attn.k_proj.weight [KV*D, H] fp32
  tensor model.layers.{{l}}.self_attn.v_proj.weight [KV*D, H] fp32
  tensor model.layers.{{l}}.self_attn.o_proj.weight [H, Q*D] fp32
  tensor model.layers.{{l}}.post_attention_layernorm.weight [H] fp32
  tensor model.layers.{{l}}.mlp.gate_proj.weight [F, H] fp32
  tensor model.layers.{{l}}.mlp.up_proj.weight [F, H] fp32
  tensor model.layers.{{l}}.mlp.down_proj.weight [H, F] fp32
}}
"""


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
                       num_attention_heads=Q, num_key_value_heads=KV, head_dim=D, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, torch_dtype=torch.float32)


def vllm_expected(full: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """What vLLM's TP rank r stores, by its rules, from the unsharded weights."""
    def rows(t, n):  # rank r's block of n rows per rank
        return t[r * n:(r + 1) * n]

    out = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.zeros(64, H)
        padded[:V] = full[name]
        out[name] = padded[r * 32:(r + 1) * 32]
    out["model.norm.weight"] = full["model.norm.weight"]
    qd, kd, fd = Q // TP * D, KV // TP * D, F // TP
    for l in range(L):
        p = f"model.layers.{l}."
        out[p + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([rows(full[p + "self_attn.q_proj.weight"], qd),
                                                          rows(full[p + "self_attn.k_proj.weight"], kd),
                                                          rows(full[p + "self_attn.v_proj.weight"], kd)])
        out[p + "self_attn.o_proj.weight"] = full[p + "self_attn.o_proj.weight"][:, r * qd:(r + 1) * qd]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(full[p + "mlp.gate_proj.weight"], fd),
                                                        rows(full[p + "mlp.up_proj.weight"], fd)])
        out[p + "mlp.down_proj.weight"] = full[p + "mlp.down_proj.weight"][:, r * fd:(r + 1) * fd]
    return out


def main(job: dict, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from layoutlang.bridges import dtensor
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    report: dict = {"rank": rank, "checked": 0}
    torch.manual_seed(0)
    trainer = LlamaForCausalLM(config()).float()
    reference = copy.deepcopy(trainer)  # the unsharded model, for expectations only
    tokens = torch.tensor([[1, 5, 9, 33, 2, 7]])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)

    src_text = dtensor.describe(trainer, name="tiny_llama_fsdp2")
    report["src_text"] = src_text
    src = loads(src_text, path="<fsdp2>")
    engine_layout = loads(VLLM, path="<vllm>")
    to_engine = compile_plan(src, engine_layout)
    engine = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in engine_layout.tensors
              if t.holds(rank)}
    # The whole HF model comes back on rank 1 (which also holds an engine shard: collocated).
    torch.manual_seed(1)
    whole = LlamaForCausalLM(config()).float() if rank == 1 else None
    whole_layout = loads(HF_WHOLE, path="<hf>")
    to_whole = compile_plan(engine_layout, whole_layout)
    dst_whole = {n: p.data for n, p in whole.named_parameters()} if rank == 1 else {}

    refit_in = Refitter(to_engine, budget_bytes=1 << 16, timeout=60)
    refit_out = Refitter(to_whole, budget_bytes=1 << 16, timeout=60)
    for step in range(2):
        if step == 1:  # an update on the trainer: every local shard changes in place
            with torch.no_grad():
                for p in trainer.parameters():
                    p.to_local().mul_(0.5).add_(0.25 * (rank + 1))
        full = {n: p.full_tensor() for n, p in trainer.named_parameters()}  # torch's own gather
        refit_in.refit(dtensor.tensors(trainer), engine)
        for name, want in vllm_expected(full, rank).items():
            got = engine[name]
            assert torch.equal(got, want), f"step {step}: engine {name} on rank {rank} differs"
            report["checked"] += got.numel()
        refit_out.refit(engine, dst_whole)
        if rank == 1:
            for name, p in whole.named_parameters():
                assert torch.equal(p.detach(), full[name]), f"step {step}: whole model {name} differs"
            with torch.no_grad():
                reference.load_state_dict(full)
                want_logits = reference(tokens).logits
                got_logits = whole(tokens).logits
            report[f"max_logit_diff_{step}"] = float((want_logits - got_logits).abs().max())
            assert torch.equal(want_logits, got_logits), f"step {step}: logits differ"
    return report


if __name__ == "__main__":
    run(main)
