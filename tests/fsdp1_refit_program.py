"""One worker of tests/test_bridge_fsdp1.py: a tiny HF Llama in torch FSDP1 (each decoder layer its
own unit inside the root unit) on gloo ranks 0-1 of a world of 4 (`process_group=` the trainer's
ranks, as a user who runs the engine in the same torch world does), `use_orig_params` False and
True, through the FSDP1 bridge: into vLLM's TP2 layout (`layoutc new vllm`, q/k rows as rotary
halves, as the bridge writes them) collocated on ranks 0-1 and into one on ranks 2-3 (not trainer
ranks), back from each, a training step, `checkpoint.save` from the
shards and `checkpoint.load` into a fresh FSDP1 model; and a one-unit FSDP1 model on ranks 2-3
(`mesh fsdp (dp=2) at 2`) into a whole copy on rank 0 and back.

Run by `layoutlang.runtime.launch.launch(job, 4, program=__file__)`. Every expectation comes
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
TRAINER = [0, 1]  # the FSDP1 ranks; ranks 2-3 are the separate engine's (AT = 2)
SEPARATE = 2

CONFIG = dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
              num_attention_heads=Q, num_key_value_heads=KV, head_dim=D, rms_norm_eps=1e-6,
              tie_word_embeddings=False, dtype="float32")


def engine_text(at: int) -> str:
    """vLLM's TP2 layout of the model, `at` its first rank: what `layoutc new vllm` prints (q|k|v and
    gate|up packed per rank, q/k rows as HF's rotary halves, the vocabulary padded to 64 rows)."""
    from layoutlang.bridges.families import layout_text

    return layout_text(CONFIG, "vllm", {"TP": TP, "AT": at})


def config():
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "dtype")},
                       torch_dtype=torch.float32)


def vllm_expected(full: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    """What vLLM's TP rank r stores, by its rules, from the unsharded weights: its heads' q, k and
    v rows, each in HF's row order (QKVParallelLinear's weight loader narrows the checkpoint's rows
    to the rank's heads and copies them as they are; the layout's rotary halves name that same
    order), then its gate rows and up rows; o_proj and down_proj split by columns."""
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


def build(use_orig_params: bool, seed: int, group):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config()).float()
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params, process_group=group,
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


def share_text(text: str | None, src: int) -> str:
    """The text rank `src` holds, on every rank of the world (a broadcast of its UTF-8 bytes): how
    the engine ranks learn the trainer's layout in this test."""
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if dist.get_rank() == src else None
    size = torch.tensor([0 if data is None else data.numel()])
    dist.broadcast(size, src)
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src)
    return data.numpy().tobytes().decode()


def collect(layout, tensors: dict | None, checker: int) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's tensors of `layout`, sent to `checker` (the test's own plumbing, not a refit):
    {rank: {name: tensor}} there, {} elsewhere."""
    import torch.distributed as dist

    me, out = dist.get_rank(), {}
    for r in range(layout.ranks):
        names = sorted(t.name for t in layout.tensors if t.holds(r))
        if not names or r == checker:
            continue
        if me == r:
            for name in names:
                dist.send(tensors[name].contiguous(), checker)
        elif me == checker:
            by_name = {t.name: t for t in layout.tensors}
            out[r] = {}
            for name in names:
                out[r][name] = torch.empty(by_name[name].local_shape_at(r))
                dist.recv(out[r][name], r)
    return out


def one_case(uop: bool, rank: int, folder: str, report: dict, group) -> None:
    import torch.distributed as dist

    from layoutlang import checkpoint
    from layoutlang.bridges import fsdp1
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    tag = "orig" if uop else "flat"
    training = rank in TRAINER
    world = len(TRAINER)
    text = trainer = mine = full = None
    if training:
        trainer = build(uop, 0, group)
        text = fsdp1.describe(trainer, name=f"llama_fsdp1_{tag}")
        report[f"text_{tag}"] = text
        mine = fsdp1.tensors(trainer)
        live = shards(trainer)
        assert set(mine) == set(live), (sorted(mine), sorted(live))
        for n, t in mine.items():
            assert t.data_ptr() == live[n].data_ptr() and t.numel() == live[n].numel(), f"{n}: not the live shard"
        report[f"local_{tag}"] = {n: t.numel() for n, t in mine.items()}
        full = summoned(trainer)
        for name, prefix, fp in units(trainer):
            want, data = expected_shard(fp, prefix, full, rank, world)
            assert torch.equal(mine[name][data], want[data]), f"{tag}: torch's shard of {name} is not its bookkeeping's"
    layout = loads(share_text(text, TRAINER[0]), path="<fsdp1>")  # the engine ranks' copy of the trainer's layout
    engine_layout = loads(engine_text(0), path="<vllm>")  # `layoutc new vllm`: the trainer's text pairs with it
    separate = loads(engine_text(SEPARATE), path="<vllm at 2>")

    # 1. FSDP1 shards -> vLLM TP2 on the same ranks (their group alone): equal to summon_full_params
    # by vLLM's rules.
    if training:
        engine = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in engine_layout.tensors
                  if t.holds(rank)}
        Refitter(compile_plan(layout, engine_layout), group=group, budget_bytes=1 << 14,
                 timeout=60).refit(mine, engine)
        checked = 0
        for name, want in vllm_expected(full, rank).items():
            assert torch.equal(engine[name], want), f"{tag}: engine {name} on rank {rank} differs"
            checked += want.numel()
        report[f"engine_checked_{tag}"] = checked

    # 1b. -> vLLM TP2 on ranks 2-3, which hold no trainer shard (the whole world's refit): each engine
    # rank's tensors, sent to rank 0, equal vLLM's rules applied to summon_full_params.
    far = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in separate.tensors if t.holds(rank)}
    Refitter(compile_plan(layout, separate), budget_bytes=1 << 14, timeout=60).refit(mine, far or None)
    got = collect(separate, far, TRAINER[0])
    if rank == TRAINER[0]:
        checked = 0
        for r, tensors in sorted(got.items()):
            want = vllm_expected(full, r - SEPARATE)
            assert sorted(tensors) == sorted(want), (r, sorted(tensors))
            for name, t in want.items():
                assert torch.equal(tensors[name], t), f"{tag}: separate engine {name} on rank {r} differs"
                checked += t.numel()
        report[f"separate_checked_{tag}"] = checked
        report[f"separate_ranks_{tag}"] = sorted(got)

    # 2. vLLM (collocated) -> FSDP1: other weights written into every shard; padding stays zero; summon agrees.
    if training:
        new = {k: v * 0.5 + 0.25 for k, v in full.items()}
        engine = {n: t.clone() for n, t in vllm_expected(new, rank).items()}
        padding = {}
        for name, prefix, fp in units(trainer):
            _, data = expected_shard(fp, prefix, full, rank, world)
            mine[name][data] = float("nan")
            mine[name][~data] = 7.0  # (FSDP1 never reads it: a value a write of zero would change)
            padding[name] = mine[name][~data].clone()
        Refitter(compile_plan(engine_layout, layout), group=group, budget_bytes=1 << 14,
                 timeout=60).refit(engine, mine)
        for name, prefix, fp in units(trainer):
            want, data = expected_shard(fp, prefix, new, rank, world)
            assert torch.equal(mine[name][data], want[data]), f"{tag}: shard {name} on rank {rank} is not the weights"
            # padding is never sent, and a refit never writes a flat dim's padding (docs/language.md 14.9)
            assert torch.equal(mine[name][~data], padding[name]), f"{tag}: the refit wrote the padding of {name}"
            report[f"padding_{tag}"] = report.get(f"padding_{tag}", 0) + int((~data).sum())
        back = summoned(trainer)
        assert all(torch.equal(back[k], new[k]) for k in new), f"{tag}: summon_full_params after the reverse refit"

    # 2b. vLLM on ranks 2-3 -> FSDP1: the engine's values turned into 1 - x there, written into every
    # trainer shard exactly as FSDP1's bookkeeping places 1 - (the weights summoned before)
    with torch.no_grad():
        for t in far.values():
            t.neg_().add_(1.0)
    if training:
        for name, prefix, fp in units(trainer):
            _, data = expected_shard(fp, prefix, full, rank, world)
            mine[name][data] = float("nan")
    Refitter(compile_plan(separate, layout), budget_bytes=1 << 14, timeout=60).refit(far or None, mine)
    if not training:
        return
    new = {k: 1.0 - v for k, v in full.items()}
    for name, prefix, fp in units(trainer):
        want, data = expected_shard(fp, prefix, new, rank, world)
        assert torch.equal(mine[name][data], want[data]), f"{tag}: shard {name} on rank {rank} is not the far engine's"
    back = summoned(trainer)
    assert all(torch.equal(back[k], new[k]) for k in new), f"{tag}: summon_full_params after the far reverse refit"
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
    # with the model's config, the checkpoint's q/k rows are the rotary halves the flat keys write: a flat
    # key pairs strictly (docs/language.md 14.9)
    saved, ref = os.path.join(folder, f"saved_{tag}"), os.path.join(folder, f"ref_{tag}")
    checkpoint.save(saved, layout, mine, group=group, config=trainer.module.config.to_dict())
    if rank == 0:
        from safetensors import safe_open
        from transformers import LlamaForCausalLM

        whole = LlamaForCausalLM(config()).float()
        whole.load_state_dict(after)
        whole.save_pretrained(ref)
        whole.config.save_pretrained(saved)  # config.json is the caller's (save writes weights only)
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
    dist.barrier(group=group)

    # 4. checkpoint.load into a fresh FSDP1 model: its shards become the trainer's, padding untouched.
    fresh = build(uop, 1, group)
    dst = fsdp1.tensors(fresh)
    masks = {}
    before = {}
    for name, prefix, fp in units(fresh):
        _, masks[name] = expected_shard(fp, prefix, full, rank, world)
        dst[name][masks[name]] = float("nan")
        before[name] = dst[name][~masks[name]].clone()
    checkpoint.load(saved, loads(fsdp1.describe(fresh), path="<fresh>"), dst, rank=rank, group=group)
    for name, t in shards(trainer).items():
        got, data = shards(fresh)[name], masks[name]
        assert torch.equal(got[data], t[data]), f"{tag}: loaded shard {name} on rank {rank} differs"
        assert torch.equal(got[~data], before[name]), f"{tag}: the load wrote the padding of {name}"
        report[f"load_padding_{tag}"] = sorted(set(got[~data].tolist()) | set(report.get(f"load_padding_{tag}", [])))
    loaded = summoned(fresh)
    assert all(torch.equal(loaded[k], after[k]) for k in after)


def refusals(rank: int, report: dict, group) -> None:
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
                 device_id=torch.device("cpu"), use_orig_params=True, process_group=group)
    report["linears"] = fsdp1.describe(model)
    with FSDP.summon_full_params(model):
        report["unsharded"] = error(lambda: fsdp1.tensors(model))
    flat = model._handle.flat_param
    flat._params[2].data = flat._params[2].data.to(torch.bfloat16)  # a parameter of another dtype
    report["mixed"] = error(lambda: fsdp1.describe(model))
    # bf16 forward over fp32 storage: FSDP1 aligns to 16 bytes of bf16, 8 fp32 elements
    mixed = FSDP(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)), device_id=torch.device("cpu"),
                 use_orig_params=True, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                 process_group=group)
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
                process_group=group, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    apply_activation_checkpointing(tied, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    report["tied"] = fsdp1.describe(tied)
    plain = FSDP(torch.nn.Linear(5, 3), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD,
                 process_group=group)
    report["no_shard"] = error(lambda: fsdp1.describe(plain))


LINEARS = ("mesh w (r=1)\ntensor 0.weight [3, 5] fp32\ntensor 0.bias [3] fp32\n"
           "tensor 1.weight [7, 3] fp32\ntensor 1.bias [7] fp32\n")


def offset_unit(rank: int, report: dict, group) -> None:
    """One FSDP1 unit on ranks 2-3 of the world (`mesh fsdp (dp=2) at 2`) into a whole copy on rank 0,
    equal to its summon_full_params (sent from rank 2), and back: 2x + 1 written there."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from layoutlang.bridges import fsdp1
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    model = text = full = None
    if rank in (2, 3):
        torch.manual_seed(0)
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)), device_id=torch.device("cpu"),
                     use_orig_params=True, process_group=group)
        text = fsdp1.describe(model, name="linears_at_2")
        full = summoned(model)
    layout, whole = loads(share_text(text, 2), path="<at 2>"), loads(LINEARS, path="<whole>")
    report["offset_text"] = layout.source_text
    dst = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in whole.tensors if t.holds(rank)}
    Refitter(compile_plan(layout, whole), timeout=60).refit(fsdp1.tensors(model) if model else None, dst or None)
    for name in sorted(t.name for t in whole.tensors):  # rank 2 sends what torch summoned to rank 0
        if rank == 2:
            dist.send(full[name].contiguous(), 0)
        elif rank == 0:
            want = torch.empty_like(dst[name])
            dist.recv(want, 2)
            assert torch.equal(dst[name], want), f"whole {name} on rank 0 differs from summon_full_params"
            report["offset_checked"] = report.get("offset_checked", 0) + want.numel()
    with torch.no_grad():
        for t in dst.values():
            t.mul_(2.0).add_(1.0)
    Refitter(compile_plan(whole, layout), timeout=60).refit(dst or None, fsdp1.tensors(model) if model else None)
    if model is not None:
        back = summoned(model)
        assert all(torch.equal(back[k], full[k] * 2.0 + 1.0) for k in full), "the unit at 2 after the reverse refit"


def main(job: dict, rank: int) -> dict:
    import torch.distributed as dist

    assert dist.get_world_size() == 4
    report: dict = {"rank": rank}
    trainer, offset = dist.new_group(TRAINER), dist.new_group([2, 3])
    for uop in (False, True):
        one_case(uop, rank, job["dir"], report, trainer)
    if rank in TRAINER:
        refusals(rank, report, trainer)
    offset_unit(rank, report, offset)
    return report


if __name__ == "__main__":
    run(main)
