"""One worker of tests/test_bridge_fsdp1.py: a tiny HF Llama in torch FSDP1 (each decoder layer its
own unit inside the root unit) on 2 gloo ranks, `use_orig_params` False and True, through the
FSDP1 bridge: into a vLLM-style TP2 engine collocated on the same 2 ranks and back, a training
step, `checkpoint.save` from the shards and `checkpoint.load` into a fresh FSDP1 model.

Run by `layoutlang.runtime.launch.launch(job, 2, program=__file__)`. Every expectation comes
from torch: the full parameters from `FSDP.summon_full_params`, the engine's by vLLM's rules
applied to them (`vllm_expected`), each rank's flat shard by FSDP1's own bookkeeping
(`_numels_with_padding`, `_is_padding_mask`, `_sharded_size`) applied to them
(`expected_shard`), and the checkpoint by `save_pretrained` of a whole model holding them.
H = 18 makes FSDP1 insert alignment padding with `use_orig_params=True`.
"""

from __future__ import annotations

import os

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

V, H, F, Q, KV, D, L = 37, 18, 24, 2, 2, 4, 2
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


def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
                       num_attention_heads=Q, num_key_value_heads=KV, head_dim=D, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, torch_dtype=torch.float32)


def vllm_expected(full: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """What vLLM's TP rank r stores, by its rules, from the unsharded weights."""
    def rows(t, n):
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


def clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def build(use_orig_params: bool, seed: int):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config()).float()
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))


def summoned(model) -> dict[str, torch.Tensor]:
    """torch's own gather of the full parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in model.named_parameters()}


def units(model):
    """(flat parameter NAME as named_parameters() says with use_orig_params=False, key prefix, flat param)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = []
    for path, m in model.named_modules():
        if isinstance(m, FSDP) and m._handle is not None:
            name = (path + "." if path else "") + "_fsdp_wrapped_module._flat_param"
            out.append((name, clean(path + ".") if path else "", m._handle.flat_param))
    return out


def expected_shard(fp, prefix: str, full: dict, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of the unit's flat parameter built from `full` by FSDP1's bookkeeping:
    (values, is-data mask); padding, between parameters and at the tail, is zero here (torch fills
    its alignment padding with a marker value, `_FLAT_PARAM_PADDING_VALUE`, its tail padding with 0)."""
    pieces, mask, fqns = [], [], iter(fp._fqns)
    for numel, pad in zip(fp._numels_with_padding, fp._is_padding_mask):
        if pad:
            pieces.append(torch.zeros(numel))
        else:
            pieces.append(full[prefix + next(fqns)].reshape(-1))
        mask.append(torch.full((numel,), not pad))
    flat, data = torch.cat(pieces), torch.cat(mask)
    s = fp._sharded_size.numel()
    flat = torch.cat([flat, torch.zeros(s * world - flat.numel())])
    data = torch.cat([data, torch.zeros(s * world - data.numel(), dtype=torch.bool)])
    return flat[rank * s:(rank + 1) * s], data[rank * s:(rank + 1) * s]


def shards(model) -> dict[str, torch.Tensor]:
    """Each unit's local shard as torch keeps it (independent of the bridge)."""
    return {name: (getattr(fp, "_local_shard", None) if getattr(fp, "_local_shard", None) is not None
                   else fp.data) for name, _, fp in units(model)}


def one_case(uop: bool, rank: int, folder: str, report: dict) -> None:
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    from layoutlang import checkpoint
    from layoutlang.bridges import fsdp1
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    tag = "orig" if uop else "flat"
    trainer = build(uop, 0)
    text = fsdp1.describe(trainer, name=f"llama_fsdp1_{tag}")
    report[f"text_{tag}"] = text
    layout = loads(text, path="<fsdp1>")
    mine = fsdp1.tensors(trainer)
    live = shards(trainer)
    assert set(mine) == set(live), (sorted(mine), sorted(live))
    for n, t in mine.items():
        assert t.data_ptr() == live[n].data_ptr() and t.numel() == live[n].numel(), f"{n}: not the live shard"
    report[f"local_{tag}"] = {n: t.numel() for n, t in mine.items()}
    world = dist.get_world_size()

    # 1. FSDP1 shards -> vLLM TP2 on the same ranks: equal to summon_full_params by vLLM's rules.
    full = summoned(trainer)
    for name, prefix, fp in units(trainer):
        want, data = expected_shard(fp, prefix, full, rank, world)
        assert torch.equal(mine[name][data], want[data]), f"{tag}: torch's shard of {name} is not its bookkeeping's"
    engine_layout = loads(VLLM, path="<vllm>")
    engine = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in engine_layout.tensors
              if t.holds(rank)}
    Refitter(compile_plan(layout, engine_layout), budget_bytes=1 << 14, timeout=60).refit(mine, engine)
    checked = 0
    for name, want in vllm_expected(full, rank).items():
        assert torch.equal(engine[name], want), f"{tag}: engine {name} on rank {rank} differs"
        checked += want.numel()
    report[f"engine_checked_{tag}"] = checked

    # 2. vLLM -> FSDP1: other weights written into every shard; padding stays zero; summon agrees.
    new = {k: v * 0.5 + 0.25 for k, v in full.items()}
    engine = {n: t.clone() for n, t in vllm_expected(new, rank).items()}
    for name, prefix, fp in units(trainer):
        _, data = expected_shard(fp, prefix, full, rank, world)
        mine[name][data] = float("nan")
    Refitter(compile_plan(engine_layout, layout), budget_bytes=1 << 14, timeout=60).refit(engine, mine)
    for name, prefix, fp in units(trainer):
        want, data = expected_shard(fp, prefix, new, rank, world)
        assert torch.equal(mine[name][data], want[data]), f"{tag}: shard {name} on rank {rank} is not the weights"
        # padding is never sent; the refit sets a destination's padding to zero (docs/language.md 14.9),
        # where torch had its marker value: never read by FSDP1 (its gradient there is zero too)
        assert not mine[name][~data].any(), f"{tag}: padding of {name} is not zero after the refit"
        report[f"padding_{tag}"] = report.get(f"padding_{tag}", 0) + int((~data).sum())
    back = summoned(trainer)
    assert all(torch.equal(back[k], new[k]) for k in new), f"{tag}: summon_full_params after the reverse refit"
    # and the model trains on what was written
    optim = torch.optim.SGD(trainer.parameters(), lr=0.1)
    tokens = torch.tensor([[1, 5, 9, 33, 2, 7]])
    loss = trainer(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optim.step()
    assert torch.isfinite(loss), f"{tag}: loss {loss}"
    after = summoned(trainer)
    assert any(not torch.equal(after[k], new[k]) for k in new), f"{tag}: the step changed nothing"
    mine = fsdp1.tensors(trainer)  # still the live shards after a step
    assert all(mine[n].data_ptr() == t.data_ptr() for n, t in shards(trainer).items())

    # 3. checkpoint.save from the shards == save_pretrained of the summoned model, byte for byte.
    saved, ref = os.path.join(folder, f"saved_{tag}"), os.path.join(folder, f"ref_{tag}")
    checkpoint.save(saved, layout, mine, group=dist.group.WORLD)
    if rank == 0:
        whole = LlamaForCausalLM(config()).float()
        whole.load_state_dict(after)
        whole.save_pretrained(ref)
        files = sorted(f for f in os.listdir(saved) if f.endswith(".safetensors"))
        assert files == sorted(f for f in os.listdir(ref) if f.endswith(".safetensors")), files
        for f in files:
            with safe_open(os.path.join(saved, f), "pt") as a, safe_open(os.path.join(ref, f), "pt") as b:
                assert sorted(a.keys()) == sorted(b.keys()), f
                for k in a.keys():
                    x, y = a.get_tensor(k), b.get_tensor(k)
                    assert x.dtype == y.dtype and x.shape == y.shape, k
                    assert x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)), k
        report[f"same_file_bytes_{tag}"] = all(
            open(os.path.join(saved, f), "rb").read() == open(os.path.join(ref, f), "rb").read() for f in files)
    dist.barrier()

    # 4. checkpoint.load into a fresh FSDP1 model: its shards become the trainer's, padding zero.
    fresh = build(uop, 1)
    dst = fsdp1.tensors(fresh)
    masks = {}
    for name, prefix, fp in units(fresh):
        _, masks[name] = expected_shard(fp, prefix, full, rank, world)
        dst[name][masks[name]] = float("nan")
    checkpoint.load(saved, loads(fsdp1.describe(fresh), path="<fresh>"), dst, rank=rank, group=dist.group.WORLD)
    for name, t in shards(trainer).items():
        got, data = shards(fresh)[name], masks[name]
        assert torch.equal(got[data], t[data]), f"{tag}: loaded shard {name} on rank {rank} differs"
        report[f"load_padding_{tag}"] = sorted(set(got[~data].tolist()) | set(report.get(f"load_padding_{tag}", [])))
    loaded = summoned(fresh)
    assert all(torch.equal(loaded[k], after[k]) for k in after)


def refusals(rank: int, report: dict) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

    from layoutlang.bridges import fsdp1
    from layoutlang.bridges.families import BridgeError

    def error(call) -> str:
        try:
            call()
        except BridgeError as e:
            return str(e)
        raise AssertionError("not refused")

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)),
                 device_id=torch.device("cpu"), use_orig_params=True)
    report["linears"] = fsdp1.describe(model)
    with FSDP.summon_full_params(model):
        report["unsharded"] = error(lambda: fsdp1.tensors(model))
    flat = model._handle.flat_param
    flat._params[2].data = flat._params[2].data.to(torch.bfloat16)  # a parameter of another dtype
    report["mixed"] = error(lambda: fsdp1.describe(model))
    # bf16 forward over fp32 storage: FSDP1 aligns to 16 bytes of bf16, 8 fp32 elements
    mixed = FSDP(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)), device_id=torch.device("cpu"),
                 use_orig_params=True, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    report["bf16_forward"] = fsdp1.describe(mixed)
    report["bf16_forward_local"] = fsdp1.tensors(mixed)["_fsdp_wrapped_module._flat_param"].numel()
    # tied embeddings and torch's activation-checkpoint wrapper inside each layer unit
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    tied_config = config()
    tied_config.tie_word_embeddings = True
    tied = FSDP(LlamaForCausalLM(tied_config), device_id=torch.device("cpu"), use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    apply_activation_checkpointing(tied, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    report["tied"] = fsdp1.describe(tied)
    plain = FSDP(torch.nn.Linear(5, 3), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    report["no_shard"] = error(lambda: fsdp1.describe(plain))


def main(job: dict, rank: int) -> dict:
    report: dict = {"rank": rank}
    for uop in (False, True):
        one_case(uop, rank, job["dir"], report)
    refusals(rank, report)
    return report


if __name__ == "__main__":
    run(main)
