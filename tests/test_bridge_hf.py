"""The HF transformers bridge (layoutlang.bridges.hf) on real tiny models, and a refit through it.

Models are built from configs (random weights, no download). References:
the models' own parameters (names, shapes, storage), hand-written key boxes, and,
for the gloo refit, vLLM's sharding rules written out below (`_vllm_expected`)
and the model's logits.

The refit test runs this file as the worker program of
`layoutlang.runtime.launch.launch` on 3 local gloo processes (127.0.0.1, a free
port, a deadline, every process killed at the end).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if __name__ == "__main__":  # a worker of the refit test (see _worker)
    import torch
    import transformers
else:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

from layoutlang import loads  # noqa: E402
from layoutlang.bridges.families import BridgeError, layout_text  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=500, dtype="float32")
QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=500,
                 num_experts=4, num_experts_per_tok=2, dtype="float32")
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, vocab_size=500, num_local_experts=4,
               num_experts_per_tok=2, dtype="float32")
MODELS = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}


def build(config: dict, seed: int = 0):
    cfg = dict(config)
    conf = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(conf).eval()


def _stored(model) -> dict:
    """What the model stores, straight from torch: parameters (once each) and persistent buffers."""
    out = dict(model.named_parameters())
    sd = model.state_dict(keep_vars=True)
    out.update({n: b for n, b in model.named_buffers() if n in sd})
    return out


# ---- describe: every parameter, its shape, its keys ---------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("at", [0, 2])
def test_describe_covers_every_parameter_with_its_shape(family, at):
    from layoutlang.bridges import hf

    model = build(MODELS[family])
    layout = loads(hf.describe(model, at=at), "described")
    assert layout.ranks == at + 1
    held = {t.name: t for t in layout.tensors if t.holds(at)}
    assert len(held) == len(layout.tensors)  # one rank holds everything
    stored = _stored(model)
    assert set(held) == set(stored)
    for name, p in stored.items():
        assert held[name].local_shape == tuple(p.shape), name
        assert held[name].dtype == "fp32"
    tensors = hf.tensors(model)
    assert set(tensors) == set(stored)
    assert all(tensors[n].data_ptr() == p.data_ptr() for n, p in stored.items())  # in place: the model's storage


def test_stacked_experts_carry_per_expert_checkpoint_keys():
    """Qwen3-MoE in memory: gate_up_proj [E=4, 2I=64, H=64], gate rows first; down_proj [E, H, I]."""
    from layoutlang.bridges import hf

    layout = loads(hf.describe(build(QWEN3_MOE)))
    (w13,) = [t for t in layout.tensors if t.name == "model.layers.1.mlp.experts.gate_up_proj"]
    assert [(r.key, r.box) for r in w13.regions[2:4]] == [
        ("model.layers.1.mlp.experts.1.gate_proj.weight", ((1, 2), (0, 32), (0, 64))),
        ("model.layers.1.mlp.experts.1.up_proj.weight", ((1, 2), (32, 64), (0, 64)))]
    (w2,) = [t for t in layout.tensors if t.name == "model.layers.1.mlp.experts.down_proj"]
    assert [(r.key, r.key_shape) for r in w2.regions][3] == ("model.layers.1.mlp.experts.3.down_proj.weight", (64, 32))


def test_mixtral_keys_are_its_checkpoint_names():
    """Mixtral's checkpoint says block_sparse_moe and w1/w3/w2; transformers renames it `mlp` in memory."""
    from layoutlang.bridges import hf

    layout = loads(hf.describe(build(MIXTRAL)))
    keys = {k for k in layout.key_index if ".layers.0." in k and "experts" in k or k.endswith("gate.weight")}
    assert keys >= {"model.layers.0.block_sparse_moe.experts.2.w1.weight",
                    "model.layers.0.block_sparse_moe.experts.2.w3.weight",
                    "model.layers.0.block_sparse_moe.experts.2.w2.weight",
                    "model.layers.0.block_sparse_moe.gate.weight"}
    assert "model.layers.0.mlp.gate.weight" in {t.name for t in layout.tensors}


def test_tied_embeddings_are_one_tensor():
    from layoutlang.bridges import hf

    model = build({**LLAMA, "tie_word_embeddings": True})
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layout = loads(hf.describe(model))
    names = {t.name for t in layout.tensors}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert "lm_head.weight" not in hf.tensors(model)


def test_dtypes_are_read_from_the_tensors():
    """A bf16 model whose router stays fp32 (as DeepSeek keeps its router): the statement says so."""
    from layoutlang.bridges import hf

    model = build(QWEN3_MOE).to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.float()
    text = hf.describe(model)
    assert "tensor model.layers.{l}.mlp.gate.weight [E, H] fp32\n" in text
    assert "default dtype" not in text  # bf16, the language's default
    layout = loads(text)
    assert {t.dtype for t in layout.tensors if t.name.endswith("mlp.gate.weight")} == {"fp32"}
    assert {t.dtype for t in layout.tensors if not t.name.endswith("mlp.gate.weight")} == {"bf16"}


def test_a_statement_whose_tensors_differ_in_dtype_is_named():
    from layoutlang.bridges import hf

    model = build(LLAMA)
    model.model.layers[1].mlp.up_proj.weight.data = model.model.layers[1].mlp.up_proj.weight.data.half()
    with pytest.raises(BridgeError) as info:
        hf.describe(model)
    assert info.value.message == ("LlamaForCausalLM stores `model.layers.0.mlp.up_proj.weight` as fp32 but "
                                  "`model.layers.1.mlp.up_proj.weight` as fp16: one statement of the layout "
                                  "cannot say both")


def test_a_parameter_the_layout_does_not_describe_is_named():
    from layoutlang.bridges import hf

    model = build(LLAMA)
    model.model.layers[0].mlp.extra = torch.nn.Linear(4, 3)
    with pytest.raises(BridgeError) as info:
        hf.describe(model)
    assert info.value.message == ("LlamaForCausalLM stores `model.layers.0.mlp.extra.weight` [3, 4], which the "
                                  "llama_hf_memory layout does not describe")
    assert "FAMILIES" in info.value.help


def test_a_shape_that_disagrees_with_the_config_is_named():
    from layoutlang.bridges import hf

    model = build(LLAMA)
    model.model.layers[1].self_attn.k_proj = torch.nn.Linear(64, 24, bias=False)
    with pytest.raises(BridgeError) as info:
        hf.describe(model)
    assert info.value.message == ("LlamaForCausalLM stores `model.layers.1.self_attn.k_proj.weight` with shape "
                                  "[24, 64], the layout says [16, 64]")


def test_a_missing_parameter_is_named():
    from layoutlang.bridges import hf

    model = build(LLAMA)
    del model.model.layers[1].post_attention_layernorm.weight
    model.model.layers[1].post_attention_layernorm.weight = None
    with pytest.raises(BridgeError) as info:
        hf.describe(model)
    assert info.value.message == ("the layout describes `model.layers.1.post_attention_layernorm.weight` but "
                                  "LlamaForCausalLM stores no such tensor")


def test_an_unknown_family_is_named():
    from layoutlang.bridges import hf

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(BridgeError) as info:
        hf.describe(model)
    assert info.value.message == "GPT2LMHeadModel.config: model_type `gpt2` is not a family `layoutc new` knows"


def _runs_by_key(layout, rank: int) -> dict:
    """Per key: the stored tensor's name, the key's box, stacked dims and transposition, and the runs
    the rank holds: what a layout says about one rank, however its dims are written."""
    out = {}
    for t in layout.tensors:
        if not t.holds(rank):
            continue
        regions = t.regions or ()
        out[t.name] = (tuple((r.key, r.box, r.stacked, r.transposed) for r in regions) or (t.key,),
                       t.logical_shape, t.local_shape, t.runs(rank), t.dtype)
    return out


def test_a_sharded_model_goes_through_the_dtensor_bridge_with_these_keys(tmp_path):
    """FSDP2 on a one-process gloo group: every parameter a DTensor (Shard(0) over dp=1). The HF bridge
    hands it to the DTensor bridge with its keys and the forms of the stacked experts; on that one rank
    the layout holds the same keys, boxes and runs as the whole model's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from layoutlang.bridges import hf

    pytest.importorskip("layoutlang.bridges.dtensor")
    whole = loads(hf.describe(build(QWEN3_MOE)))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build(QWEN3_MOE)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        text = hf.describe(model)
        assert text.startswith("# Described by layoutlang.bridges.dtensor")
        # FSDP2's Shard(0) cuts the stacked expert dim (a stack of keys: `chunk`, LANGUAGE.md 8.5)
        assert ("tensor model.layers.1.mlp.experts.gate_up_proj [e in 0..4 chunk d0 ragged, (gate: 32 as "
                "model.layers.1.mlp.experts.{e}.gate_proj.weight | up: 32 as model.layers.1.mlp.experts.{e}."
                "up_proj.weight), 64] fp32\n") in text
        assert ("tensor model.layers.0.mlp.experts.down_proj as model.layers.0.mlp.experts.{e}.down_proj.weight "
                "[e in 0..4 chunk d0 ragged, 64, 32] fp32\n") in text
        # k_proj's rows are each head's rotary halves (issue 29): Shard(0) cuts the stored rows, `chunk`
        assert ("tensor model.layers.0.self_attn.k_proj.weight [(2, (re: 16/2 | im: 16/2)) chunk d0 ragged, 64] "
                "fp32\n") in text
        sharded = loads(text)
        assert _runs_by_key(sharded, 0) == _runs_by_key(whole, 0)
        local = hf.tensors(model)
        assert set(local) == {t.name for t in sharded.tensors}
        assert all(tuple(local[t.name].shape) == t.local_shape for t in sharded.tensors)
    finally:
        dist.destroy_process_group()


def test_importing_the_bridge_needs_no_framework():
    code = ("import sys; import layoutlang.bridges.hf, layoutlang.bridges.families; "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


# ---- a refit on gloo: HF on rank 0 -> vLLM TP2 (collocated and not) -> back into a fresh HF model ----------

WORLD = 3
TP = 2


def _padded_rows(t, multiple: int):
    rows = math.ceil(t.shape[0] / multiple) * multiple
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _vllm_expected(name: str, hf_state: dict, tp: int, family: str, experts: int):
    """vLLM's local tensor `name` on tensor-parallel rank `tp` (of TP), from the HF model's tensors, by
    vLLM's rules: embeddings padded to 64 rows then split by rows; qkv_proj = this rank's q rows, then
    k, then v; gate_up_proj = gate rows, then up rows; o_proj / down_proj split by columns; FusedMoE
    w13 [local experts, gate | up, H] and w2 with experts split over EP = TP ranks (EP2: etp 1)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _padded_rows(hf_state[name], 64).chunk(TP)[tp]
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    p = f"model.layers.{layer}."
    split = lambda t, dim=0: t.chunk(TP, dim)[tp]  # noqa: E731
    if name.endswith("self_attn.qkv_proj.weight"):
        return torch.cat([split(hf_state[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
    if name.endswith("self_attn.o_proj.weight"):
        return split(hf_state[name], 1)
    if name.endswith("mlp.gate_up_proj.weight"):
        return torch.cat([split(hf_state[p + "mlp.gate_proj.weight"]), split(hf_state[p + "mlp.up_proj.weight"])])
    if name.endswith("mlp.down_proj.weight"):
        return split(hf_state[name], 1)
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    local = slice(tp * experts // TP, (tp + 1) * experts // TP)
    if name.endswith("experts.w13_weight"):
        return hf_state[p + "mlp.experts.gate_up_proj"][local]  # HF stacks gate rows then up rows, as w13
    if name.endswith("experts.w2_weight"):
        return hf_state[p + "mlp.experts.down_proj"][local]
    if name == p + f"{moe}.gate.weight":
        return hf_state[p + "mlp.gate.weight"]
    return hf_state[name]  # norms, q_norm / k_norm: whole on every rank


def _train_step(model, vocab: int) -> None:
    """One AdamW step on fixed data: deterministic on CPU, so every rank that runs it on the same
    weights gets the same new weights (the engines' reference after the trainer's step)."""
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _worker(job_path: str, out_path: str) -> int:
    """One rank: for each model and engine position, refit HF (rank 0) -> vLLM TP2 twice, with a
    training step on the trainer in between, then the engine -> a fresh HF model on rank 0."""
    from datetime import timedelta

    import torch.distributed as dist

    from layoutlang import compile_plan
    from layoutlang.bridges import hf
    from layoutlang.runtime import Refitter

    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ["RANK"])
    result = {"rank": rank, "ok": False, "errors": [], "checked_elements": 0, "refits": 0}
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=120))
    if job.get("fsdp"):
        return _fsdp_worker(job, rank, result, out_path)

    def check_engine(engine, original, tag):
        hf_state = {n: t.detach() for n, t in hf.tensors(original).items()}
        for name, got in engine.items():
            want = _vllm_expected(name, hf_state, rank - at, family, experts)
            if not torch.equal(got, want):
                result["errors"].append(f"{tag}: engine `{name}` on rank {rank} differs")
            result["checked_elements"] += got.numel()

    try:
        for family in job["families"]:
            cfg = MODELS[family]
            experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
            ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
            for at in job["engine_at"]:
                tag = f"{family} AT={at}"
                # every rank builds the same weights: rank 0 trains them, the engines check against them
                original = build(cfg, seed=1)
                src_layout = loads(hf.describe(original, at=0), f"{family}_hf")
                sizes = {"TP": TP, "AT": at, **({"EP": TP} if experts else {})}
                dst_layout = loads(layout_text(cfg, "vllm", sizes), f"{family}_vllm")
                forward = Refitter(compile_plan(src_layout, dst_layout), timeout=60, verify=True)
                engine = {t.name: torch.full(t.local_shape, float("nan")) for t in dst_layout.tensors
                          if t.holds(rank)}
                for step in range(2):
                    if step:
                        _train_step(original, cfg["vocab_size"])  # the trainer's step (every rank's copy)
                    forward.refit(hf.tensors(original) if rank == 0 else None, engine or None)
                    result["refits"] += 1
                    check_engine(engine, original, f"{tag} step {step}")
                fresh = build(cfg, seed=2) if rank == 0 else None
                backward = Refitter(compile_plan(dst_layout, src_layout), timeout=60, verify=True)
                backward.refit(engine or None, hf.tensors(fresh) if rank == 0 else None)
                result["refits"] += 1
                if rank == 0:
                    trained = hf.tensors(original)
                    for name, t in hf.tensors(fresh).items():
                        if not torch.equal(t, trained[name]):
                            result["errors"].append(f"{tag}: `{name}` differs after the round trip")
                        result["checked_elements"] += t.numel()
                    with torch.no_grad():
                        if not torch.equal(fresh.eval()(ids).logits, original.eval()(ids).logits):
                            result["errors"].append(f"{tag}: logits differ after the round trip")
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        result["errors"].append(f"{type(exc).__name__}: {exc}")
    result["ok"] = not result["errors"]
    Path(out_path).write_text(json.dumps(result))
    if result["errors"]:
        os._exit(1)  # transfers may be in flight: do not wait on the process group
    dist.destroy_process_group()
    return 0


def _fsdp_worker(job: dict, rank: int, result: dict, out_path: str) -> int:
    """Two ranks: Qwen3-MoE under FSDP2 (every parameter Shard(0) over dp=2, the stacked experts too)
    described by the HF bridge through the DTensor bridge -> vLLM TP2 x EP2 on both ranks -> a whole
    HF model on rank 1; twice, with an update of every local shard in between. References: torch's own
    gather (full_tensor) of the trainer's weights, vLLM's rules, the logits of the gathered weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layoutlang import compile_plan
    from layoutlang.bridges import hf
    from layoutlang.runtime import Refitter

    try:
        cfg = QWEN3_MOE
        trainer = build(cfg, seed=1)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for layer in trainer.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(trainer, mesh=mesh)
        src = loads(hf.describe(trainer), "fsdp2")
        result["src_text"] = src.source_text
        engine_layout = loads(layout_text(cfg, "vllm", {"TP": TP, "EP": TP, "AT": 0}), "vllm")
        whole = build(cfg, seed=2)  # rank 1 holds it; every rank describes it
        whole_layout = loads(hf.describe(whole, at=1), "whole")
        to_engine = Refitter(compile_plan(src, engine_layout), timeout=60, verify=True)
        to_whole = Refitter(compile_plan(engine_layout, whole_layout), timeout=60, verify=True)
        engine = {t.name: torch.full(t.local_shape, float("nan")) for t in engine_layout.tensors if t.holds(rank)}
        ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
        for step in range(2):
            if step:  # the trainer's update: every local shard changes in place
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.to_local().mul_(0.5).add_(0.01 * (rank + 1))
            full = {n: p.full_tensor() for n, p in trainer.named_parameters()}  # torch's own gather
            to_engine.refit(hf.tensors(trainer), engine)
            to_whole.refit(engine, hf.tensors(whole) if rank == 1 else None)
            result["refits"] += 2
            for name, got in engine.items():
                if not torch.equal(got, _vllm_expected(name, full, rank, "qwen3_moe", cfg["num_experts"])):
                    result["errors"].append(f"step {step}: engine `{name}` on rank {rank} differs")
                result["checked_elements"] += got.numel()
            if rank == 1:
                reference = build(cfg, seed=0)
                reference.load_state_dict(full)
                for name, t in hf.tensors(whole).items():
                    if not torch.equal(t, full[name]):
                        result["errors"].append(f"step {step}: `{name}` differs in the whole model")
                    result["checked_elements"] += t.numel()
                with torch.no_grad():
                    if not torch.equal(whole(ids).logits, reference(ids).logits):
                        result["errors"].append(f"step {step}: logits differ")
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        import traceback

        result["errors"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    result["ok"] = not result["errors"]
    Path(out_path).write_text(json.dumps(result))
    if result["errors"]:
        os._exit(1)
    dist.destroy_process_group()
    return 0


@pytest.mark.timeout(300)
def test_fsdp2_moe_through_the_dtensor_bridge_to_vllm_ep2_and_back():
    from layoutlang.runtime.launch import launch

    results = launch({"fsdp": True}, 2, timeout=240, program=__file__)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result['errors']}\n{r.stderr[-3000:]}"
    text = results[0].result["src_text"]
    assert text == results[1].result["src_text"]  # every rank describes the same trainer
    # FSDP2 cuts the 4 stacked experts over dp=2 (2 | 2): a stack of keys is cut by `chunk`
    assert ("tensor model.layers.0.mlp.experts.down_proj as model.layers.0.mlp.experts.{e}.down_proj.weight "
            "[e in 0..4 chunk dp ragged, 64, 32] fp32\n") in text
    assert "tensor model.embed_tokens.weight [500 over dp ragged, 64] fp32\n" in text
    assert all(r.result["refits"] == 4 for r in results)
    engine = sum(math.prod(t.local_shape) for t in loads(layout_text(QWEN3_MOE, "vllm", {"TP": TP, "EP": TP}))
                 .tensors for _ in t.ranks())
    whole = sum(p.numel() for p in build(QWEN3_MOE).parameters())
    assert sum(r.result["checked_elements"] for r in results) == 2 * (engine + whole)


@pytest.mark.timeout(300)
def test_refit_hf_to_vllm_tp2_follows_a_training_step_and_comes_back_exactly():
    """Llama and Qwen3-MoE (stacked experts in memory -> FusedMoE w13/w2 at EP2), the engine on ranks
    0-1 (collocated with the HF rank) and on ranks 1-2 (apart from it): two refits with an AdamW step
    on the trainer in between, every engine element equal to vLLM's rule applied to the trainer's
    weights of that step; then the engine refitted into a fresh HF model equals the trained one element
    by element and in its logits."""
    from layoutlang.runtime.launch import launch

    results = launch({"families": ["llama", "qwen3_moe"], "engine_at": [0, 1]}, WORLD, timeout=240,
                     program=__file__)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result['errors']}\n{r.stderr[-3000:]}"
    results = [r.result for r in results]
    assert all(r["refits"] == 2 * 2 * 3 for r in results)  # 2 models x 2 engine positions x 3 refits
    # every element of every engine tensor was compared after both steps, and the HF model once per run
    engine = 0
    for cfg in (LLAMA, QWEN3_MOE):
        for at in (0, 1):
            sizes = {"TP": TP, "AT": at, **({"EP": TP} if cfg.get("num_experts") else {})}
            layout = loads(layout_text(cfg, "vllm", sizes))
            engine += 2 * sum(math.prod(t.local_shape) * len(list(t.ranks())) for t in layout.tensors)
    hf_elements = 2 * sum(p.numel() for cfg in (LLAMA, QWEN3_MOE) for p in build(cfg).parameters())
    assert sum(r["checked_elements"] for r in results) == engine + hf_elements


def test_the_trainer_loop_of_docs_bridges_runs_collocated_and_not(tmp_path):
    """docs/bridges.md's torchrun program, as written, on 3 gloo processes: engine on ranks 1-2, then
    on ranks 0-1 (launch sets what torchrun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    from layoutlang.runtime.launch import launch

    doc = (Path(__file__).parent.parent / "docs" / "bridges.md").read_text()
    program = doc.split("```python\n# refit_loop.py")[1].split("```")[0]
    path = tmp_path / "refit_loop.py"
    path.write_text("# refit_loop.py" + program + "\nimport json, sys\n"
                    "json.dump({'ok': True, 'engine': sorted(engine_tensors)}, open(sys.argv[2], 'w'))\n")
    for at in (1, 0):
        results = launch({}, WORLD, timeout=120, env={"ENGINE_AT": str(at)}, program=str(path))
        for r in results:
            assert r.ok, f"ENGINE_AT={at} rank {r.rank}: {r.error}\n{r.stderr[-3000:]}"
        holders = [r.rank for r in results if r.result["engine"]]
        assert holders == [at, at + 1]


if __name__ == "__main__":  # launch(job, WORLD, program=__file__): python test_bridge_hf.py JOB OUT
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
