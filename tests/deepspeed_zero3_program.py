"""One worker of tests/test_bridge_deepspeed.py: a DeepSpeed ZeRO-3 HF Llama on W gloo ranks (4, or 2).

Run by `layoutlang.runtime.launch.launch(job, W + 2, program=__file__)` as
`python deepspeed_zero3_program.py JOB.json OUT.json`: the first W processes are the trainer's job
(their own world of W ranks), the other 2 a vLLM TP2 engine's job (tests/zero3_engine_program.py:
a world of its own); the two jobs meet only at the refit's store (docs/jobs.md). Every check:

1. describe / tensors of a live ZeRO-3 engine (`deepspeed.initialize` with torch's SGD, one
   step taken): the tensors are the `ds_tensor`s themselves (same data_ptr);
2. refit into vLLM's TP2 layout on ranks 0-1 (collocated) equals, element by element, vLLM's rules
   applied to the full parameters that `deepspeed.zero.GatheredParameters` gives; and a
   `TrainerJob` refit from the `ds_tensor`s into the engine job (which checks every element
   against the same gather, written for it to FULL.safetensors);
3. the reverse refits write every `ds_tensor`: from the collocated engine (the gathered parameters
   equal the engine's values; the padding keeps its bytes: a refit never writes a flat dim's
   padding, docs/language.md 14.9), then from the engine job (its values 1 - x: every
   `ds_tensor` is DeepSpeed's partition of 1 - the gathered weights), and a forward + training step
   runs on them (its loss equal to a plain transformers model's holding the same weights);
4. `checkpoint.save` from the ZeRO-3 shards (rank 0 also writes `save_pretrained` of the
   gathered model: the parent compares the files byte for byte), and `checkpoint.load` into a
   fresh ZeRO-3 model gives the same `ds_tensor`s;
5. a tiny Qwen3-MoE (stacked experts) under ZeRO-3 the same way: into the HF checkpoint layout
   whole on rank 0 and back, into the engine job (vLLM TP2, EP2) and back, then a training step.

Expected values come from vLLM's and DeepSpeed's rules applied to DeepSpeed's own gather,
never from the plan under test.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

V, H, F, Q, KV, D, L = 37, 6, 24, 2, 2, 4, 2  # V*H and H not multiples of 4: padded partitions
TP = 2  # vLLM TP2: on ranks 0-1 of the trainer (collocated), and as its own job of 2 ranks
SHARD = 2000  # bytes a checkpoint file holds: several files and an index
CONFIG = dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
              num_attention_heads=Q, num_key_value_heads=KV, head_dim=D, rms_norm_eps=1e-6,
              tie_word_embeddings=False, dtype="float32")
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
             "steps_per_print": 1 << 30}


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "dtype")},
                       torch_dtype=torch.float32)


def vllm_expected(full: dict, r: int) -> dict:
    """What vLLM's TP rank r stores, by its rules (q|k|v and gate|up packed per rank, vocabulary
    padded to 64 rows), from the full weights."""
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


def moe_vllm_expected(full: dict, r: int) -> dict:
    """What vLLM's TP rank r stores of the Qwen3-MoE at EP2, by its rules: attention and vocabulary
    as for the Llama, q/k norms and the router whole, each rank its E/2 experts whole (w13: an
    expert's gate rows then its up rows, as transformers stacks `gate_up_proj`; w2: `down_proj`)."""
    qd, kd, local = MOE["num_attention_heads"] // TP * D, MOE["num_key_value_heads"] // TP * D, MOE["num_experts"] // TP
    out = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.zeros(64, H)
        padded[:V] = full[name]
        out[name] = padded[r * 32:(r + 1) * 32]
    out["model.norm.weight"] = full["model.norm.weight"]
    for l in range(MOE["num_hidden_layers"]):
        p = f"model.layers.{l}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                     "self_attn.k_norm.weight", "mlp.gate.weight"):
            out[p + name] = full[p + name]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([full[p + "self_attn.q_proj.weight"][r * qd:(r + 1) * qd],
                                                          full[p + "self_attn.k_proj.weight"][r * kd:(r + 1) * kd],
                                                          full[p + "self_attn.v_proj.weight"][r * kd:(r + 1) * kd]])
        out[p + "self_attn.o_proj.weight"] = full[p + "self_attn.o_proj.weight"][:, r * qd:(r + 1) * qd]
        experts = slice(r * local, (r + 1) * local)
        out[p + "mlp.experts.routed_experts.w13_weight"] = full[p + "mlp.experts.gate_up_proj"][experts]
        out[p + "mlp.experts.routed_experts.w2_weight"] = full[p + "mlp.experts.down_proj"][experts]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (padding DeepSpeed left uninitialised may hold NaN, which equals nothing)."""
    return t.detach().clone().view(torch.uint8)


def gathered(module) -> dict:
    """The full parameters, through DeepSpeed's own gather."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def partition(full: torch.Tensor, rank: int, width: int) -> tuple[torch.Tensor, int]:
    """DeepSpeed's rule (`_partition_param`): rank's S elements of the flat vector padded to a
    multiple of width, and how many of them are data."""
    flat = full.reshape(-1)
    size = -(-flat.numel() // width)
    mine = flat[rank * size:(rank + 1) * size]
    return mine, mine.numel()


def job_store(job: dict, name: str):
    """The store one refit between the jobs meets in: the one the test hosts (docs/jobs.md: "or every
    rank passes `store=`, e.g. one the launcher hosts"), under a prefix of its own."""
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", job["store"], None, False, timedelta(seconds=60), wait_for_workers=False)
    return dist.PrefixStore(f"{name}/", client)


def to_engine_job(job: dict, rank: int, tag: str, text: str, local: dict, full: dict, config: dict,
                  sizes: dict) -> None:
    """The trainer's side of a refit into the engine job: a `TrainerJob` from the `ds_tensor`s. Rank 0
    first writes, for the engine's checks, the gathered parameters and this layout's text."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from layoutlang.bridges.families import layout_text
    from layoutlang.elaborate import loads
    from layoutlang.runtime import TrainerJob

    if rank == 0:  # each file whole before its name appears
        part = os.path.join(job["dir"], "part")
        save_file({n: t.contiguous() for n, t in full.items()}, part)
        os.replace(part, os.path.join(job["dir"], f"{tag}_full.safetensors"))
        Path(part).write_text(text)
        os.replace(part, os.path.join(job["dir"], f"{tag}.layout"))
    engine_layout = loads(layout_text(config, "vllm", {"TP": TP, "AT": 0, **sizes}), path=f"<vllm {tag}>")
    out = TrainerJob(loads(text, path=f"<zero3 {tag}>"), engine_layout, store=job_store(job, tag + "_out"),
                     rank=rank, world_size=dist.get_world_size(), timeout=timedelta(seconds=60),
                     expect_wait=timedelta(seconds=90), budget_bytes=1 << 14)
    report = out.refit(local, version=1, expect=("vllm",))
    out.close()
    assert list(report.replicas) == ["vllm"] and not report.missed, (report.replicas, report.reasons)


def from_engine_job(job: dict, rank: int, tag: str, text: str, local: dict) -> None:
    """The trainer's ranks as the replica the engine job refits back: `EngineJob.receive` into the
    `ds_tensor`s."""
    import torch.distributed as dist

    from layoutlang.elaborate import loads
    from layoutlang.runtime import EngineJob

    back = EngineJob(loads(text, path=f"<zero3 {tag}>"), store=job_store(job, tag + "_back"),
                     replica="zero3", rank=rank, world_size=dist.get_world_size(), timeout=timedelta(seconds=60),
                     connect_timeout=timedelta(seconds=30))
    version = back.receive(local)
    back.close()
    assert version == 2, version


def main(job: dict, rank: int) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    # DeepSpeed's one JIT op (its CPU shared-memory allreduce, built when its comm backend starts)
    # lives in the cache scripts/setup.sh warms: .venv/torch_extensions.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    import torch.distributed as dist

    import deepspeed
    from transformers import LlamaForCausalLM

    from layoutlang import checkpoint
    from layoutlang.bridges import deepspeed as ds
    from layoutlang.bridges.families import layout_text
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    deepspeed.init_distributed(dist_backend="gloo")
    W = job["world"]
    assert dist.get_world_size() == W
    report: dict = {"rank": rank, "checked": 0}
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        torch.manual_seed(0)
        model = LlamaForCausalLM(hf_config())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

    # 1. describe / tensors
    text = ds.describe(engine)
    report["text"] = text
    local = ds.tensors(engine)
    params = dict(engine.module.named_parameters())
    for name, p in params.items():
        assert local[name + ".ds_tensor"].data_ptr() == p.ds_tensor.data_ptr(), f"{name}: not the ds_tensor"
    report["local_numel"] = {n: t.numel() for n, t in local.items()}

    # 2. ZeRO-3 -> vLLM TP2 on the same ranks
    src = loads(text, path="<zero3>")
    vllm = loads(layout_text(CONFIG, "vllm", {"TP": TP, "AT": 0}), path="<vllm>")
    engine_tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in vllm.tensors
                      if t.holds(rank)}
    Refitter(compile_plan(src, vllm), budget_bytes=1 << 14, timeout=60).refit(local, engine_tensors or None)
    full = gathered(engine.module)
    assert all(torch.isfinite(t).all() for t in full.values())
    for name, want in (vllm_expected(full, rank) if rank < TP else {}).items():
        assert torch.equal(engine_tensors[name], want), f"engine {name} on rank {rank} differs"
        report["checked"] += want.numel()
    # ... and into the engine job (2 more ranks, its own world), which checks against `full`
    to_engine_job(job, rank, "llama", text, local, full, CONFIG, {})

    # 3. vLLM TP2 -> ZeRO-3: new values (the same on every rank, as replicas are), then a step
    with torch.no_grad():
        for t in engine_tensors.values():
            t.mul_(0.5).add_(0.25)
    for name, p in params.items():  # a value in the padding that a write of zero would change (never read)
        p.ds_tensor[partition(full[name], rank, W)[1]:].fill_(7.0)
    padding = {name: bits(p.ds_tensor[partition(full[name], rank, W)[1]:]) for name, p in params.items()}
    Refitter(compile_plan(vllm, src), budget_bytes=1 << 14, timeout=60).refit(engine_tensors or None, local)
    new_full = {n: t * 0.5 + 0.25 for n, t in full.items()}
    for name, p in params.items():
        want, data = partition(new_full[name], rank, W)
        got = p.ds_tensor
        assert torch.equal(got[:data], want), f"ds_tensor of {name} on rank {rank} differs after the reverse refit"
        assert torch.equal(bits(got[data:]), padding[name]), f"the refit wrote the padding of {name} on rank {rank}"
    back = gathered(engine.module)
    for name, want in new_full.items():
        assert torch.equal(back[name], want), f"{name}: DeepSpeed gathers other values than were written"
    # ... and from the engine job, which holds 1 - (what it got): every ds_tensor DeepSpeed's partition of that
    from_engine_job(job, rank, "llama", text, local)
    new_full = {n: 1.0 - t for n, t in full.items()}
    for name, p in params.items():
        want, data = partition(new_full[name], rank, W)
        assert torch.equal(p.ds_tensor[:data], want), f"ds_tensor of {name} on rank {rank} is not the engine job's"
    back = gathered(engine.module)
    for name, want in new_full.items():
        assert torch.equal(back[name], want), f"{name}: DeepSpeed gathers other values than the engine job wrote"
    plain = LlamaForCausalLM(hf_config())
    plain.load_state_dict(new_full)
    with torch.no_grad():
        want_loss = plain(input_ids=ids, labels=ids).loss
    loss = engine(input_ids=ids, labels=ids).loss
    report["loss_diff"] = float((loss.detach() - want_loss).abs())
    assert report["loss_diff"] <= 1e-6, f"the loss on the refit weights differs by {report['loss_diff']}"
    engine.backward(loss)
    engine.step()
    after = gathered(engine.module)
    assert all(torch.isfinite(t).all() for t in after.values())
    report["step_changed"] = any(not torch.equal(after[n], back[n]) for n in after)

    report["moe_text"] = moe(job, rank)
    if "ours" not in job:
        return report

    # 4. checkpoint.save from the shards; save_pretrained of the gathered model on rank 0
    dist.barrier()
    saved = {n: p.ds_tensor.clone() for n, p in params.items()}
    full = gathered(engine.module)
    # the config says the q/k rows are rotary halves (as the layout writes them): a flat key pairs strictly
    checkpoint.save(job["ours"], src, ds.tensors(engine), group=dist.group.WORLD,
                    config=engine.module.config.to_dict(), max_shard_size=SHARD)
    if rank == 0:
        plain = LlamaForCausalLM(hf_config())
        plain.load_state_dict(full)
        plain.save_pretrained(job["theirs"], max_shard_size=SHARD)
        engine.module.config.save_pretrained(job["ours"])  # config.json is the caller's (q/k rows: halves)
    dist.barrier()
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        torch.manual_seed(1)
        fresh = LlamaForCausalLM(hf_config())
    fresh_text = ds.describe(fresh)
    assert fresh_text == text, "a fresh ZeRO-3 model of the same config is described otherwise"
    for name, p in fresh.named_parameters():
        p.ds_tensor[partition(full[name], rank, W)[1]:].fill_(7.0)
    padding = {name: bits(p.ds_tensor[partition(full[name], rank, W)[1]:]) for name, p in fresh.named_parameters()}
    checkpoint.load(job["ours"], loads(fresh_text, path="<fresh>"), ds.tensors(fresh), group=dist.group.WORLD)
    for name, p in fresh.named_parameters():
        want, data = partition(full[name], rank, W)
        assert torch.equal(p.ds_tensor[:data], want), f"loaded ds_tensor of {name} on rank {rank} differs"
        assert torch.equal(p.ds_tensor[:data], saved[name][:data])
        assert torch.equal(bits(p.ds_tensor[data:]), padding[name]), f"the load wrote the padding of {name}"
    report["plain_text"] = plain_module(rank)
    return report


def plain_module(rank: int) -> str:
    """A module that is no transformers model (keys: the parameter names): ZeRO-3's
    `Sequential(Linear(5, 3), Linear(3, 7))` -> whole tensors on rank 0, equal to DeepSpeed's gather."""
    import deepspeed

    from layoutlang.bridges import deepspeed as ds
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        torch.manual_seed(4)
        module = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))
    text = ds.describe(module)
    whole = loads("mesh w (r=1)\ntensor 0.weight [3, 5] fp32\ntensor 0.bias [3] fp32\n"
                  "tensor 1.weight [7, 3] fp32\ntensor 1.bias [7] fp32\n", path="<whole>")
    dst = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in whole.tensors if t.holds(rank)}
    Refitter(compile_plan(loads(text, path="<zero3 plain>"), whole), timeout=60).refit(ds.tensors(module),
                                                                                         dst or None)
    full = gathered(module)
    for name, t in dst.items():
        assert torch.equal(t, full[name]), f"{name} differs from DeepSpeed's gather"
    return text


MOE = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=H, intermediate_size=12, moe_intermediate_size=5,
           num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
           head_dim=D, tie_word_embeddings=False, dtype="float32", decoder_sparse_step=1, mlp_only_layers=[],
           norm_topk_prob=True)


def hf_expected(full: dict, e_count: int, inter: int) -> dict:
    """The HF checkpoint's tensors (one per expert) from transformers' stacked experts, by its
    storage rule: `gate_up_proj [E, 2I, H]`, each expert's gate rows then its up rows."""
    out = {}
    for name, t in full.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for e in range(e_count):
                out[f"{stem}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{stem}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            stem = name.removesuffix("down_proj")
            for e in range(e_count):
                out[f"{stem}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def moe(job: dict, rank: int) -> str:
    """A tiny Qwen3-MoE under ZeRO-3 (stacked experts: one flat key per expert and part), through
    `deepspeed.initialize` with torch's SGD: -> the HF checkpoint layout whole on rank 0, and back
    with new values; -> the engine job (vLLM TP2 at EP2, which checks every element against the
    gather) and back from it; then a training step."""
    import deepspeed
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from layoutlang.bridges import deepspeed as ds
    from layoutlang.bridges.families import layout_text
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    config = Qwen3MoeConfig(**{k: v for k, v in MOE.items() if k not in ("model_type", "dtype")},
                            torch_dtype=torch.float32)
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
        torch.manual_seed(2)
        model = Qwen3MoeForCausalLM(config)
    # transformers leaves the stacked experts uninitialised under zero.Init (NaNs among them):
    # fill every parameter on rank 0, which DeepSpeed broadcasts and partitions again on exit
    g = torch.Generator().manual_seed(3)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        for p in model.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=DS_CONFIG)
    text = ds.describe(engine)
    local = ds.tensors(engine)
    src = loads(text, path="<zero3 moe>")
    whole = loads(layout_text(MOE, "hf", {"AT": 0}), path="<hf>")
    dst = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in whole.tensors if t.holds(rank)}
    Refitter(compile_plan(src, whole), timeout=60).refit(local, dst or None)
    full = gathered(model)
    assert all(torch.isfinite(t).all() for t in full.values())  # the fill above took
    want = hf_expected(full, MOE["num_experts"], MOE["moe_intermediate_size"])
    if rank == 0:
        assert sorted(dst) == sorted(want)
        for name, t in want.items():
            assert torch.equal(dst[name], t), f"HF {name} differs from the gathered experts"
        for t in dst.values():
            t.mul_(-1.0).add_(1.0)
    Refitter(compile_plan(whole, src), timeout=60).refit(dst or None, local)
    back = gathered(model)
    for name, t in full.items():
        assert torch.equal(back[name], 1.0 - t), f"{name}: not what rank 0's HF tensors say after the reverse refit"

    # the engine job: vLLM TP2, EP2 (2 experts whole on each rank), and back from 1 - x there
    to_engine_job(job, rank, "moe", text, local, back, MOE, {"EP": 2})
    from_engine_job(job, rank, "moe", text, local)
    width = dist.get_world_size()
    for name, p in model.named_parameters():
        want, data = partition(1.0 - back[name], rank, width)
        assert torch.equal(p.ds_tensor[:data], want), f"MoE ds_tensor of {name} on rank {rank} is not the engine job's"
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    model.config._experts_implementation = "eager"  # torch's grouped_mm wants 16-byte strides: I = 5 has none
    loss = engine(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss), loss
    engine.backward(loss)
    engine.step()
    after = gathered(model)
    assert any(not torch.equal(after[n], 1.0 - back[n]) for n in back), "the MoE step changed nothing"
    if "ours" in job:  # checkpoint.save from the partitions (per-expert keys) and save_pretrained of the gather
        from layoutlang import checkpoint

        ours, theirs = job["ours"] + "_moe", job["theirs"] + "_moe"
        checkpoint.save(ours, src, ds.tensors(engine), group=dist.group.WORLD, config=model.config.to_dict())
        if rank == 0:
            plain = Qwen3MoeForCausalLM(config)
            plain.load_state_dict(after)
            plain.save_pretrained(theirs)
            model.config.save_pretrained(ours)  # the load reads it (q/k rows: halves), as from_pretrained would
        dist.barrier()
        with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG):
            fresh = Qwen3MoeForCausalLM(config)
        assert ds.describe(fresh) == text
        for name, p in fresh.named_parameters():
            p.ds_tensor.fill_(7.0)
        checkpoint.load(ours, src, ds.tensors(fresh), group=dist.group.WORLD)
        for name, p in fresh.named_parameters():
            want, data = partition(after[name], rank, width)
            assert torch.equal(p.ds_tensor[:data], want), f"loaded MoE ds_tensor of {name} on rank {rank} differs"
            assert bool((p.ds_tensor[data:] == 7.0).all()), f"the load wrote the padding of {name}"
    return text


def own_world() -> str:
    """Which job this process is, and its own world: the launch's first W processes are the ZeRO-3
    trainer's world (ranks 0..W-1), the next TP the engine job's (ranks 0..TP-1), each world at a
    port of its own, as two separately launched jobs are."""
    import json

    with open(sys.argv[1]) as f:
        job = json.load(f)
    at, width = int(os.environ["RANK"]), job["world"]
    role = "trainer" if at < width else "engine"
    os.environ.update(RANK=str(at if at < width else at - width), WORLD_SIZE=str(width if at < width else TP),
                      MASTER_PORT=str(job["ports"][role]))
    return role


if __name__ == "__main__":
    if own_world() == "trainer":
        run(main)
    else:
        from zero3_engine_program import main as engine

        run(engine)
