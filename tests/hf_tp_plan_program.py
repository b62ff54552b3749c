"""One worker of tests/test_bridge_hf_tp_plan.py: HF `from_pretrained(..., tp_plan="auto")` on 2 gloo ranks.

Run by `launch(job, 2, program=__file__)` (job: {"dir": a scratch folder}). For a
tiny Llama and a tiny Qwen3-MoE built from a config (no download): rank 0 saves
it with `save_pretrained`, every rank loads it back with transformers' own TP
plan (DTensors `Shard(0)` / `Shard(1)`, stacked experts `_StridedShard(1, sf=2)`
and `Shard(2)`, plain norms and routers), `layoutlang.bridges.hf.describe`
writes its layout, and that layout is refit twice (an in-place update of every
local shard in between) into

- a whole HF model on rank 0, which must equal torch's own gather
  (`DTensor.full_tensor()`) element by element, and give the TP model's logits;
- vLLM TP2 as `layoutc new vllm` writes it, which must equal vLLM's rules
  (`vllm_expected`, written here from the full tensors: q|k|v fused with each
  rank's KV heads, gate|up fused, vocabulary padded to 64, each rank its rows);

and the engine is then refit back into the TP model itself (its shards and its
replicated plain parameters as destinations), whose `full_tensor()`s must come
back equal.

Every expected value comes from the full tensors and those rules, never from
the plan under test. The worker also records the placements transformers
chose, checks the packed `gate_up_proj` shard against its own reading of it
(`to_local()` = this rank's gate rows, then its up rows), and records what the
DTensor bridge does with `_StridedShard` alone outside transformers (described
and refit, or refused with the parameter named).
"""

from __future__ import annotations

import os

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

TP = 2
V = 101  # odd: HF's Shard(0) gives ranks 51 | 50 rows, vLLM pads to 128 and gives 64 | 64
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False, dtype="float32")
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=V,
                 num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, dtype="float32")
MODELS = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE}


def build(cfg: dict, seed: int):
    import transformers

    c = dict(cfg)
    config = transformers.CONFIG_MAPPING[c.pop("model_type")](**c)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def vllm_expected(name: str, full: dict, cfg: dict, r: int) -> torch.Tensor:
    """vLLM's TP rank r's local `name`, by vLLM's rules, from the unsharded HF tensors `full`."""
    def rows(t, dim=0):  # rank r's block of an even split
        n = t.shape[dim] // TP
        return t.narrow(dim, r * n, n)

    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.zeros(-(-V // 64) * 64, cfg["hidden_size"])
        padded[:V] = full[name]
        return rows(padded)
    p = ".".join(name.split(".")[:3]) + "."  # model.layers.L.
    if name.endswith("self_attn.qkv_proj.weight"):  # this rank's q heads, then its k heads, then its v heads
        return torch.cat([rows(full[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
    if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
        return rows(full[name], 1)
    if name.endswith("mlp.gate_up_proj.weight"):
        return torch.cat([rows(full[p + "mlp.gate_proj.weight"]), rows(full[p + "mlp.up_proj.weight"])])
    stacked = full.get(p + "mlp.experts.gate_up_proj")  # HF in memory: [E, gate rows | up rows, H]
    if name.endswith("routed_experts.w13_weight"):  # EP=1: every expert, this rank's gate rows then up rows
        i = stacked.shape[1] // 2
        return torch.cat([rows(stacked[:, :i], 1), rows(stacked[:, i:], 1)], 1)
    if name.endswith("routed_experts.w2_weight"):
        return rows(full[p + "mlp.experts.down_proj"], 2)
    return full[name]  # norms, q/k norms, the router: whole on every rank


def _placements(model) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    return {n: (", ".join(repr(x) for x in p.placements) if isinstance(p, DTensor) else "plain")
            for n, p in model.named_parameters()}


def _full(model) -> dict[str, torch.Tensor]:
    """torch's own gather of every parameter (plain ones as they are)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()) for n, p in model.named_parameters()}


def _update(model, rank: int) -> None:
    """A trainer's step stand-in: every local shard changes in place; plain (replicated) ones equally."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            if isinstance(p, DTensor):
                p.to_local().mul_(0.5).add_(0.01 * (rank + 1))
            else:
                p.mul_(0.5).add_(0.03)


def _family(family: str, job: dict, rank: int, report: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from layoutlang import compile_plan, loads
    from layoutlang.bridges import hf
    from layoutlang.bridges.families import layout_text
    from layoutlang.runtime import Refitter

    cfg = MODELS[family]
    folder = os.path.join(job["dir"], family)
    if rank == 0:
        build(cfg, seed=1).save_pretrained(folder)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
    out: dict = {"placements": _placements(model), "checked": 0, "tp_size": model.tp_size}
    report[family] = out
    text = out["text"] = hf.describe(model)
    src = loads(text, f"<{family} tp_plan>")
    local = hf.tensors(model)
    out["local_shapes"] = {n: list(t.shape) for n, t in local.items()}
    for t in src.tensors:
        assert tuple(local[t.name].shape) == t.local_shape_at(rank), (t.name, local[t.name].shape)
    full = _full(model)
    if family == "qwen3_moe":  # the packed shard, read independently: this rank's gate rows, then its up rows
        gate_up = model.model.layers[0].mlp.experts.gate_up_proj
        whole, i = full["model.layers.0.mlp.experts.gate_up_proj"], cfg["moe_intermediate_size"]
        b = i // TP
        want = torch.cat([whole[:, rank * b:(rank + 1) * b], whole[:, i + rank * b:i + (rank + 1) * b]], 1)
        out["packed_local_is_gate_then_up"] = torch.equal(gate_up.to_local(), want)

    copy = build(cfg, seed=2)  # the whole model on rank 0; every rank describes it
    out["whole_elements"] = sum(p.numel() for p in copy.parameters())
    copy_layout = loads(hf.describe(copy, at=0), f"<{family} whole>")
    sizes = {"TP": TP, **({"EP": 1} if "num_experts" in cfg else {})}
    engine_layout = loads(layout_text(cfg, "vllm", sizes), f"<{family} vllm>")
    to_copy = Refitter(compile_plan(src, copy_layout), timeout=60, verify=True)
    to_engine = Refitter(compile_plan(src, engine_layout), timeout=60, verify=True)
    engine = {t.name: torch.full(t.local_shape_at(rank), float("nan")) for t in engine_layout.tensors
              if t.holds(rank)}
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    for step in range(2):
        if step:
            _update(model, rank)
            full = _full(model)
        dst = hf.tensors(copy) if rank == 0 else None
        if dst is not None:
            for t in dst.values():
                t.fill_(float("nan"))
        to_copy.refit(hf.tensors(model), dst)
        to_engine.refit(hf.tensors(model), engine)
        if rank == 0:
            for n, t in dst.items():
                assert torch.equal(t, full[n]), f"step {step}: whole `{n}` differs from full_tensor()"
                out["checked"] += t.numel()
        for n, t in engine.items():
            assert torch.equal(t, vllm_expected(n, full, cfg, rank)), f"step {step}: engine `{n}` differs"
            out["checked"] += t.numel()
        with torch.no_grad():
            tp_logits = model(ids).logits  # every rank takes part in the TP forward
            if rank == 0:
                diff = float((copy(ids).logits - tp_logits).abs().max())
                out[f"max_logit_diff_{step}"] = diff
                assert diff < 1e-5, f"step {step}: logits differ by {diff}"
    # and back: the engine into the TP model itself (every shard and every replica a destination)
    with torch.no_grad():
        for t in hf.tensors(model).values():
            t.fill_(float("nan"))
    Refitter(compile_plan(engine_layout, src), timeout=60, verify=True).refit(engine, hf.tensors(model))
    back = _full(model)
    out["back_equal"] = all(torch.equal(back[n], full[n]) for n in full)


def _packed_outside_transformers(rank: int, report: dict) -> None:
    """`_StridedShard(0, sf=2)` alone on a 1-D mesh, with no form: described as two unnamed parts and refit
    into a whole copy equal to full_tensor(); an extent that does not split evenly, and a form whose parts
    do not line up with torch's pieces, are refused with the parameter named."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from layoutlang import compile_plan, loads
    from layoutlang.bridges import dtensor
    from layoutlang.runtime import Refitter

    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    packed = [_StridedShard(0, split_factor=2)]
    weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, packed))
    out = report["generic"] = {"local": module.w.to_local().tolist()}
    text = out["text"] = dtensor.describe(module, name="packed")
    whole = loads("mesh one (r=1)\ntensor w [(4 | 4), 3] fp32\n", "<whole>")
    dst = {"w": torch.full((8, 3), float("nan"))} if rank == 0 else None
    Refitter(compile_plan(loads(text, "<packed>"), whole), timeout=60).refit(dtensor.tensors(module), dst)
    gathered = module.w.full_tensor()  # a collective: every rank
    if rank == 0:
        assert torch.equal(dst["w"], gathered), "the packed weight's whole copy differs"
    uneven = torch.nn.Module()
    uneven.u = torch.nn.Parameter(DTensor.from_local(torch.zeros(3 if rank == 0 else 1, 3), mesh, packed,
                                                     run_check=False, shape=torch.Size((6, 3)), stride=(3, 1)))
    misaligned = dict(forms=lambda name, p: dtensor.Form(None, ("(a: 2 as wa | b: 6 as wb)", "3")))
    for case, mod, kwargs in (("uneven", uneven, {}), ("misaligned", module, misaligned)):
        try:
            out[case] = "described:\n" + dtensor.describe(mod, **kwargs)
        except dtensor.BridgeError as e:
            out[case] = e.render() if hasattr(e, "render") else str(e)


def main(job: dict, rank: int) -> dict:
    report: dict = {"rank": rank}
    for family in MODELS:
        _family(family, job, rank, report)
    _packed_outside_transformers(rank, report)
    return report


if __name__ == "__main__":
    run(main)
