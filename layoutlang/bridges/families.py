"""Layouts of the known model families, from a HF `config.json`, in a framework's convention.

`layoutc new vllm --config config.json --set TP=4` prints the `.layout` text of
the model that config describes, as vLLM stores it at TP4. Pure Python: no
framework is imported; the conventions are written down here from each
framework's source (transformers 5, Megatron-Core 0.16-0.19 local spec, vLLM,
SGLang) and checked against the live models by the bridges' tests.

Every key is the HF checkpoint name of the unfused, per-expert weight
(LANGUAGE.md 8), so any two layouts written here pair without edits:

>>> cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
...        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
...        "vocab_size": 500}
>>> text = render(model_from_config(cfg), "vllm", {"TP": 2})
>>> print(next(line for line in text.splitlines() if "tensor" in line and "qkv_proj" in line).strip())
tensor model.layers.{l}.self_attn.qkv_proj.weight [(q: (Q, (re: D/2 | im: D/2)) as model.layers.{l}.self_attn.q_proj.weight | k: (KV, (re: D/2 | im: D/2)) as model.layers.{l}.self_attn.k_proj.weight | v: (KV, D) as model.layers.{l}.self_attn.v_proj.weight) over tp, H]

Conventions (`CONVENTIONS`):
- `megatron`: Megatron-Core GPTModel state-dict names with the local layer spec
  (`get_gpt_layer_local_spec`: separate `input_layernorm` / `pre_mlp_layernorm`,
  SequentialMLP experts `mlp.experts.local_experts.{i}`), stage-local layer
  numbers under PP, local expert numbers under EP, grouped QKV and gate|up fc1
  with part keys, the vocabulary padded to a multiple of 128*TP; its pipeline stages as
  Megatron splits them (even, or uneven from its split args: megatron_layout.py).
- `hf`: the HF checkpoint, every weight whole on one rank (replicated over DP),
  experts one tensor each (gpt-oss: stacked, as its checkpoint stores them).
- `hf-memory`: a transformers 5 model in memory: the checkpoint's tensors, except
  MoE experts stacked (`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first,
  `mlp.experts.down_proj [E, H, I]`; gpt-oss `[E, H, 2I]` transposed and
  interleaved) and Mixtral's `block_sparse_moe` named `mlp`.
- `vllm`: fused `qkv_proj` (q|k|v), `gate_up_proj`, FusedMoE stacked
  `routed_experts.w13_weight` / `w2_weight` (vLLM 0.33's names), DeepSeek MLA `fused_qkv_a_proj`, the vocabulary
  padded to a multiple of 64.
- `sglang`: as vLLM, except DeepSeek's `fused_qkv_a_proj_with_mqa` and gpt-oss's
  names (`model.embed_tokens`, `self_attn`, `w13_weight_bias`); it shards experts
  within the TP group (vLLM across DP x TP).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..diagnostics import UsageError
from .megatron_layout import megatron_document
from .megatron_split import SPLIT_ARGS
from .model import (  # noqa: F401 (this module's API, as before bridges/model.py)
    FAMILIES, GQA, MLA, BridgeError, ConfigError, Document, Loop, Model, MoE, Stmt, Tensor, const_lines, header_lines,
    layer_key, model_from_config, parts_text, render_document, rotary_rows, statement_at, with_dtypes)
from .torchtitan_layout import torchtitan_document

CONVENTIONS = ("megatron", "hf", "hf-memory", "vllm", "sglang")
# Trainers whose convention lives in a module of its own (torchtitan_layout.py), for some families
# only (`layoutc new torchtitan` refuses the others): kept apart from CONVENTIONS, which every family
# has. Its Meta-order Llama3 pairs with every convention (they write the rotary halves: rotary_rows).
# The flat-shard trainers (DeepSpeed ZeRO-3, torch FSDP1) write what their live bridges' describe()
# writes: literal sizes, no args, so flat_layout.py renders their text from the hf-memory Document
# (`flat_layout.render`; it imports this module, not the other way round); their `--set` args here.
FLAT_CONVENTIONS = ("deepspeed", "fsdp1")
FLAT_ARGS = {"deepspeed": ("DP", "AT"), "fsdp1": ("DP", "AT", "ORIG")}  # ORIG: FSDP1's use_orig_params
TRAINER_CONVENTIONS = ("torchtitan", *FLAT_CONVENTIONS)


# ---- HF: the checkpoint, and a transformers model in memory ------------------------------------

def _hf_attention(m: Model) -> list[Tensor]:
    a = m.attention
    out = [Tensor(layer_key("input_layernorm.weight"), ("H",))]
    if isinstance(a, GQA):
        for proj, rows in (("q_proj", rotary_rows("Q")), ("k_proj", rotary_rows("KV")), ("v_proj", "KV*D")):
            out.append(Tensor(layer_key(f"self_attn.{proj}.weight"), (rows, "H")))
            if a.qkv_bias:
                out.append(Tensor(layer_key(f"self_attn.{proj}.bias"), (rows,)))
        out.append(Tensor(layer_key("self_attn.o_proj.weight"), ("H", "Q*D")))
        if a.o_bias:
            out.append(Tensor(layer_key("self_attn.o_proj.bias"), ("H",)))
        if a.qk_norm:
            out += [Tensor(layer_key("self_attn.q_norm.weight"), ("D",)), Tensor(layer_key("self_attn.k_norm.weight"), ("D",))]
        if a.sinks:
            out.append(Tensor(layer_key("self_attn.sinks"), ("Q",)))
    else:
        if a.q_lora:
            out += [Tensor(layer_key("self_attn.q_a_proj.weight"), ("Q_LORA", "H")),
                    Tensor(layer_key("self_attn.q_a_layernorm.weight"), ("Q_LORA",)),
                    Tensor(layer_key("self_attn.q_b_proj.weight"), ("NH*(QK_NOPE + QK_ROPE)", "Q_LORA"))]
        else:
            out.append(Tensor(layer_key("self_attn.q_proj.weight"), ("NH*(QK_NOPE + QK_ROPE)", "H")))
        out += [Tensor(layer_key("self_attn.kv_a_proj_with_mqa.weight"), ("KV_LORA + QK_ROPE", "H")),
                Tensor(layer_key("self_attn.kv_a_layernorm.weight"), ("KV_LORA",)),
                Tensor(layer_key("self_attn.kv_b_proj.weight"), ("NH*(QK_NOPE + V_HEAD)", "KV_LORA")),
                Tensor(layer_key("self_attn.o_proj.weight"), ("H", "NH*V_HEAD"))]
    out.append(Tensor(layer_key("post_attention_layernorm.weight"), ("H",)))
    return out


def _hf_dense(prefix: str, inter: str) -> list[Tensor]:
    return [Tensor(layer_key(f"{prefix}.gate_proj.weight"), (inter, "H")),
            Tensor(layer_key(f"{prefix}.up_proj.weight"), (inter, "H")),
            Tensor(layer_key(f"{prefix}.down_proj.weight"), ("H", inter))]


def _expert_key(moe: MoE, which: int, suffix: str = "weight") -> str:
    return layer_key(f"{moe.block}.experts.{{e}}.{moe.names[which]}.{suffix}")


def _router(m: Model, name: str) -> list[Tensor]:
    """The router weight (and bias) stored under the prefix `name`."""
    moe = m.moe
    key = layer_key(f"{moe.block}.{moe.router}")
    out = [Tensor(name + ".weight", ("E", "H"), key=key + ".weight")]
    if moe.router_bias:
        out.append(Tensor(name + ".bias", ("E",), key=key + ".bias"))
    return out


def _shared_hf(m: Model) -> list[Tensor]:
    moe = m.moe
    out = _hf_dense(f"mlp.{moe.shared_name}", "S") if moe.shared else []
    if moe.shared_gate:
        out.append(Tensor(layer_key("mlp.shared_expert_gate.weight"), ("1", "H")))
    return out


def _stacked_hf(moe: MoE, prefix: str, ep: str = "", etp: str = "", names=("gate_up_proj", "down_proj"),
                bias_names=("gate_up_proj_bias", "down_proj_bias"), mesh: str | None = None,
                hf_layout: bool = True) -> list[Tensor]:
    """Stacked experts: HF in memory (`hf_layout`: gpt-oss transposed) or an engine's FusedMoE."""
    stack = f"e in 0..E{ep}"
    if moe.interleaved:
        up_down = lambda s: (f"(I, (gate: 1 as {_expert_key(moe, 0, s)} | up: 1 as {_expert_key(moe, 1, s)}))"  # noqa: E731
                             + etp)
    else:
        up_down = lambda s: parts_text(("gate", "I", _expert_key(moe, 0, s)), ("up", "I", _expert_key(moe, 1, s))) + etp  # noqa: E731
    transposed = moe.interleaved and hf_layout  # gpt-oss in HF stores [E, H, 2I] and [E, I, H]
    if transposed:
        out = [Tensor(f"{prefix}.{names[0]}", (stack, "H", up_down("weight")), transposed=True, mesh=mesh),
               Tensor(f"{prefix}.{names[1]}", (stack, "I" + etp, "H"), key=_expert_key(moe, 2), transposed=True,
                      mesh=mesh)]
    else:
        out = [Tensor(f"{prefix}.{names[0]}", (stack, up_down("weight"), "H"), mesh=mesh),
               Tensor(f"{prefix}.{names[1]}", (stack, "H", "I" + etp), key=_expert_key(moe, 2), mesh=mesh)]
    if moe.expert_bias:
        out += [Tensor(f"{prefix}.{bias_names[0]}", (stack, up_down("bias")), mesh=mesh),
                Tensor(f"{prefix}.{bias_names[1]}", (stack, "H"), key=_expert_key(moe, 2, "bias"), mesh=mesh)]
    return out


def _hf_doc(m: Model, sizes: Mapping[str, int], memory: bool) -> Document:
    moe = m.moe
    stacked_ckpt = moe is not None and moe.interleaved  # gpt-oss's checkpoint stacks its experts too
    body: list[Stmt] = [Tensor("model.embed_tokens.weight", ("V", "H")), Tensor("model.norm.weight", ("H",))]
    if not m.tied:
        body.append(Tensor("lm_head.weight", ("V", "H")))
    for start, stop, routed in m.runs:
        layer: list[Stmt] = _hf_attention(m) if len(m.runs) == 1 else []
        if not routed:
            layer += _hf_dense("mlp", "F")
        else:
            name = f"model.layers.{{l}}.{'mlp' if memory else moe.block}.{moe.router}"
            layer += _router(m, name)
            if moe.score_bias:
                layer.append(Tensor(layer_key("mlp.gate.e_score_correction_bias"), ("E",), dtype="fp32"))
            if memory or stacked_ckpt:
                layer += _stacked_hf(moe, layer_key("mlp.experts"))
            else:
                experts = [Tensor(_expert_key(moe, 0), ("I", "H")), Tensor(_expert_key(moe, 1), ("I", "H")),
                           Tensor(_expert_key(moe, 2), ("H", "I"))]
                layer.append(Loop("e", "0", "E", tuple(experts)))
            layer += _shared_hf(m)
        body.append(Loop("l", str(start), "L" if stop == m.layers else str(stop), tuple(layer),
                         comment=None if len(m.runs) == 1 else ("routed experts" if routed else "dense MLP")))
    if len(m.runs) > 1:
        body.insert(2 + (not m.tied), Loop("l", "0", "L", tuple(_hf_attention(m)), comment="attention, every layer"))
    if not memory:
        notes = ["The HF checkpoint: every weight whole, unfused, on one rank (DP replicas: a",
                 "DDP trainer, or any rank holding the whole model). Names are keys."]
    elif moe is None or stacked_ckpt:
        notes = ["A transformers 5 model in memory (named_parameters and persistent buffers):",
                 "the same tensors as its checkpoint."]
    else:
        notes = ["A transformers 5 model in memory: the checkpoint's tensors, except that every",
                 "layer's experts are stacked in one gate_up_proj [E, 2I, H] (gate rows first)",
                 "and one down_proj [E, H, I]; the keys stay the checkpoint's per-expert names."]
    if moe is not None and moe.block != "mlp" and memory:
        notes.append(f"Mixtral's `{moe.block}` is `mlp` in memory (transformers renames it at load).")
    if stacked_ckpt:
        notes += ["gpt-oss's checkpoint stores the experts stacked as in memory: gate_up_proj",
                  "[E, H, 2I] (transposed, gate and up interleaved), down_proj [E, I, H]",
                  "(transposed); keys name one expert's gate/up/down weight [out, in]."]
    if m.tied:
        notes.append("Tied embeddings: one tensor, model.embed_tokens.weight (lm_head is the same).")
    args = (("DP", sizes["DP"]), ("AT", sizes["AT"]))
    return Document(f"{m.model_type}_{'hf_memory' if memory else 'hf'}", header_lines(m, _conv(memory), notes),
                    args, const_lines(m), ("hf (dp=DP) at AT",), m.dtype, tuple(body))


def _conv(memory: bool) -> str:
    return "hf-memory" if memory else "hf"


# ---- vLLM and SGLang ------------------------------------------------------------------------------

def _engine_attention(m: Model, engine: str) -> list[Tensor]:
    a = m.attention
    attn = "attn" if engine == "vllm" and m.model_type == "gpt_oss" else "self_attn"
    p = f"model.layers.{{l}}.{attn}"
    out = [Tensor(layer_key("input_layernorm.weight"), ("H",))]
    if isinstance(a, GQA):
        qkv = lambda s: parts_text(("q", rotary_rows("Q"), layer_key(f"self_attn.q_proj.{s}")),  # noqa: E731
                               ("k", rotary_rows("KV"), layer_key(f"self_attn.k_proj.{s}")),
                               ("v", "(KV, D)", layer_key(f"self_attn.v_proj.{s}"))) + " over tp"
        out.append(Tensor(f"{p}.qkv_proj.weight", (qkv("weight"), "H")))
        if a.qkv_bias:
            out.append(Tensor(f"{p}.qkv_proj.bias", (qkv("bias"),)))
        out.append(Tensor(f"{p}.o_proj.weight", ("H", "Q*D over tp"), key=layer_key("self_attn.o_proj.weight")))
        if a.o_bias:
            out.append(Tensor(f"{p}.o_proj.bias", ("H",), key=layer_key("self_attn.o_proj.bias")))
        if a.qk_norm:
            out += [Tensor(layer_key("self_attn.q_norm.weight"), ("D",)), Tensor(layer_key("self_attn.k_norm.weight"), ("D",))]
        if a.sinks:
            out.append(Tensor(f"{p}.sinks", ("Q over tp",), key=layer_key("self_attn.sinks")))
    else:
        if a.q_lora:
            fused = "fused_qkv_a_proj" if engine == "vllm" else "fused_qkv_a_proj_with_mqa"
            out += [Tensor(layer_key(f"self_attn.{fused}.weight"),
                           (parts_text(("q_a", "Q_LORA", layer_key("self_attn.q_a_proj.weight")),
                                   ("kv_a", "KV_LORA + QK_ROPE", layer_key("self_attn.kv_a_proj_with_mqa.weight"))), "H")),
                    Tensor(layer_key("self_attn.q_a_layernorm.weight"), ("Q_LORA",)),
                    Tensor(layer_key("self_attn.q_b_proj.weight"), ("(NH, QK_NOPE + QK_ROPE) over tp", "Q_LORA"))]
        else:
            out += [Tensor(layer_key("self_attn.q_proj.weight"), ("(NH, QK_NOPE + QK_ROPE) over tp", "H")),
                    Tensor(layer_key("self_attn.kv_a_proj_with_mqa.weight"), ("KV_LORA + QK_ROPE", "H"))]
        out += [Tensor(layer_key("self_attn.kv_a_layernorm.weight"), ("KV_LORA",)),
                Tensor(layer_key("self_attn.kv_b_proj.weight"), ("(NH, QK_NOPE + V_HEAD) over tp", "KV_LORA")),
                Tensor(layer_key("self_attn.o_proj.weight"), ("H", "NH*V_HEAD over tp"))]
    out.append(Tensor(layer_key("post_attention_layernorm.weight"), ("H",)))
    return out


def _engine_dense(prefix: str, inter: str, key_prefix: str | None = None) -> list[Tensor]:
    kp = key_prefix or prefix
    return [Tensor(layer_key(f"{prefix}.gate_up_proj.weight"),
                   (parts_text(("gate", inter, layer_key(f"{kp}.gate_proj.weight")), ("up", inter, layer_key(f"{kp}.up_proj.weight")))
                    + " over tp", "H")),
            Tensor(layer_key(f"{prefix}.down_proj.weight"), ("H", f"{inter} over tp"), key=layer_key(f"{kp}.down_proj.weight"))]


# vLLM's `expert_placement_strategy` -> the placement word of its stacked experts' `over ep`
VLLM_EXPERT_PLACEMENTS = {"linear": "balanced", "round_robin": "cyclic"}


def _engine_doc(m: Model, sizes: Mapping[str, int], engine: str, placement: str = "linear",
                redundant: int = 0) -> Document:
    moe = m.moe
    gptoss = m.model_type == "gpt_oss"
    embed = "model.embedding.weight" if engine == "vllm" and gptoss else "model.embed_tokens.weight"
    body: list[Stmt] = [Tensor(embed, ("V pad 64 over tp", "H"), key="model.embed_tokens.weight"),
                        Tensor("model.norm.weight", ("H",))]
    if not m.tied:
        body.append(Tensor("lm_head.weight", ("V pad 64 over tp", "H")))
    for start, stop, routed in m.runs:
        layer: list[Stmt] = _engine_attention(m, engine) if len(m.runs) == 1 else []
        if not routed:
            layer += _engine_dense("mlp", "F")
        else:
            layer += _router(m, f"model.layers.{{l}}.{moe.block}.{moe.router}")
            if moe.score_bias:
                layer.append(Tensor(layer_key("mlp.gate.e_score_correction_bias"), ("E",), dtype="fp32"))
            biases = ("w13_bias", "w2_bias") if engine == "vllm" else ("w13_weight_bias", "w2_weight_bias")
            # vLLM 0.33: FusedMoE keeps its weights in a `routed_experts` submodule
            experts = f"{moe.block}.experts" + (".routed_experts" if engine == "vllm" else "")
            # vLLM's expert map (docs/language.md 14.8): `linear` gives the first E mod EP ranks one
            # more expert (balanced), `round_robin` deals them out (cyclic)
            placed = f" over ep {VLLM_EXPERT_PLACEMENTS[placement]}" if engine == "vllm" else " over ep"
            stacked = _stacked_hf(moe, layer_key(experts), placed, " over etp",
                                  names=("w13_weight", "w2_weight"), bias_names=biases, mesh="experts",
                                  hf_layout=False)
            if redundant:  # EPLB: physical slots, each the logical expert the table names
                stacked = [_physical(t, f"{{EPLB[{'l' if start == 0 else f'l - {start}'}][p]}}") for t in stacked]
            layer += stacked
            if moe.shared:
                layer += _engine_dense(f"mlp.{moe.shared_name}", "S")
            if moe.shared_gate:
                layer.append(Tensor(layer_key("mlp.shared_expert_gate.weight"), ("1", "H")))
        body.append(Loop("l", str(start), "L" if stop == m.layers else str(stop), tuple(layer),
                         comment=None if len(m.runs) == 1 else ("routed experts" if routed else "dense MLP")))
    if len(m.runs) > 1:
        body.insert(2 + (not m.tied), Loop("l", "0", "L", tuple(_engine_attention(m, engine)),
                                           comment="attention, every layer"))
    meshes = ["infer (dp=DP, tp=TP) at AT"]
    args = [("TP", sizes["TP"]), ("DP", sizes["DP"])]
    notes = ["vLLM" if engine == "vllm" else "SGLang"]
    notes[0] += (": fused qkv_proj (each rank's q heads, then its k, then its v heads; k/v heads"
                 if isinstance(m.attention, GQA) else ": MLA with the two down projections fused in one")
    if isinstance(m.attention, GQA):
        notes += ["replicated when TP exceeds their count), gate_up_proj (gate | up, each split",
                  "over tp), the vocabulary padded to a multiple of 64 and split over tp."]
    else:
        fused = "fused_qkv_a_proj" if engine == "vllm" else "fused_qkv_a_proj_with_mqa"
        notes += [f"replicated `{fused}` (q_a_proj rows, then kv_a_proj_with_mqa rows); q_b_proj and",
                  "kv_b_proj split by head over tp; the vocabulary padded to a multiple of 64.",
                  "The engine derives its absorbed MLA matrices from kv_b_proj after loading."]
    consts = const_lines(m)
    if moe is not None:
        args.append(("EP", sizes["EP"]))
        if redundant:
            moe_layers = [stop - start for start, stop, routed in m.runs if routed]
            physical = list(vllm_initial_eplb_map(moe.experts, redundant))
            args.append(("EPLB", [physical] * moe_layers[0]))
            consts += ("P = len(EPLB[0])",)
        if engine == "vllm":
            meshes.append("experts (ep=EP, etp=DP*TP/EP) at AT")
            notes += ["FusedMoE stacks each layer's local experts in routed_experts.w13_weight",
                      "[E/ep, 2I/etp, H] (gate | up, as loaded: a backend that repacks after loading is",
                      "written through vLLM's reload, docs/engines.md) and routed_experts.w2_weight",
                      "[E/ep, H, I/etp] (vLLM 0.33 names). vLLM shards experts over all DP x TP ranks: EP=1",
                      "splits every expert over them (etp), --enable-expert-parallel is EP=DP*TP.",
                      f"Experts placed as vLLM's `{placement}` expert map places them (`over ep "
                      f"{VLLM_EXPERT_PLACEMENTS[placement]}`):",
                      "the first E mod EP ranks hold one more." if placement == "linear" else
                      "rank r holds experts r, r + EP, r + 2*EP, ..."]
            if redundant:
                notes += [f"EPLB with {redundant} redundant experts: the stacked dims hold P = E + {redundant} "
                          "physical slots, slot p of",
                          "MoE layer i a copy of logical expert EPLB[i][p] (vLLM's physical_to_logical_map; the",
                          "default is vLLM's initial map, p mod E). Placed as above over the P slots. Pass the",
                          "live map with --set EPLB=@map.json; layoutlang/compiler/tables.py re-plans a new one."]
        else:
            meshes.append("experts (edp=DP, ep=EP, etp=TP/EP) at AT")
            notes += ["FusedMoE stacks each layer's local experts in w13_weight [E/ep, 2I/etp, H] and",
                      "w2_weight [E/ep, H, I/etp], within the TP group: --ep-size EP (1: every",
                      "expert split over tp)."]
        if gptoss:
            notes += ["gpt-oss keeps the checkpoint's gate/up interleaving in w13 and its biases; with",
                      "etp > 1 the engine holds w2's bias on one etp rank only (zeros elsewhere),",
                      "which this file does not say: use EP for gpt-oss refits."]
    args.append(("AT", sizes["AT"]))
    if engine == "sglang" and not (gptoss or isinstance(m.attention, MLA)):
        notes.append("SGLang stores this family exactly as vLLM does (names and sharding).")
    if m.tied:
        notes.append("Tied embeddings: the engine ties lm_head to model.embed_tokens.weight (one tensor).")
    return Document(f"{m.model_type}_{engine}", header_lines(m, engine, notes), tuple(args), consts,
                    tuple(meshes), m.dtype, tuple(body))


def vllm_initial_eplb_map(experts: int, redundant: int) -> tuple[int, ...]:
    """vLLM's first physical -> logical map (EplbState): the E routed experts in order, then
    redundant slot i a copy of expert i mod E. So slot p holds expert p mod E."""
    return tuple(range(experts)) + tuple(i % experts for i in range(redundant))


def _physical(t: Tensor, entry: str) -> Tensor:
    """A stacked expert tensor over physical slots `p in 0..P` instead of experts `e in 0..E`,
    its keys reading the expert of slot p from the table (`entry`, e.g. `{EPLB[l][p]}`)."""
    dims = (t.dims[0].replace("e in 0..E", "p in 0..P", 1),) + tuple(d.replace("{e}", entry) for d in t.dims[1:])
    assert dims[0] != t.dims[0], t.dims  # (the stacked dim is first: _stacked_hf's engine form)
    return dataclasses.replace(t, dims=dims, key=None if t.key is None else t.key.replace("{e}", entry))


# ---- entry points ------------------------------------------------------------------------------------

SIZE_DEFAULTS = {"TP": 1, "PP": 1, "DP": 1, "EP": 1, "AT": 0}


def arg_names(model: Model, convention: str) -> tuple[str, ...]:
    """The args a convention's layout of `model` declares (what `--set` may change)."""
    if convention in FLAT_CONVENTIONS:
        return FLAT_ARGS[convention]
    if convention in ("hf", "hf-memory", *TRAINER_CONVENTIONS):
        return ("DP", "AT")
    moe = ("EP",) if model.moe is not None else ()
    if convention == "megatron":
        return ("TP", "PP", "DP", *(moe and ("EP", "ETP")), "AT")
    return ("TP", "DP", *moe, "AT")


def document(model: Model, convention: str, sizes: Mapping[str, int] | None = None,
             expert_placement: str = "linear", redundant_experts: int = 0) -> Document:
    """The Document of `model` in `convention`; `sizes` give the args' values (TP, PP, ...) and,
    for megatron, Megatron's pipeline split args (megatron_split.SPLIT_ARGS: where PP does not divide
    the layers, the stages are written out, megatron_layout.py);
    `expert_placement` is vLLM's `expert_placement_strategy` and `redundant_experts` its EPLB
    `num_redundant_experts` (the vllm convention only: the experts then placed by a table,
    docs/language.md 14.8)."""
    given, split = checked_args(model, convention, sizes, expert_placement, redundant_experts)
    if convention in FLAT_CONVENTIONS:
        raise UsageError(f"the {convention} layout is written as text (flat_layout.render), not as a Document")
    full = {**SIZE_DEFAULTS, "ETP": given.get("TP", 1), **given}  # Megatron's default expert TP is TP
    if convention == "megatron":
        return megatron_document(model, full, split)
    if convention == "torchtitan":
        return torchtitan_document(model, full)
    if convention in ("hf", "hf-memory"):
        return _hf_doc(model, full, memory=convention == "hf-memory")
    return _engine_doc(model, full, convention, expert_placement, redundant_experts)


def checked_args(model: Model, convention: str, sizes: Mapping[str, int] | None, expert_placement: str,
                  redundant_experts: int) -> tuple[dict, dict]:
    """`document`'s options and `--set` args checked (UsageErrors): (the sizes, Megatron's split args)."""
    if redundant_experts:
        if isinstance(redundant_experts, bool) or not isinstance(redundant_experts, int) or redundant_experts < 0:
            raise UsageError(f"redundant experts {redundant_experts}: expected an integer >= 0")
        if convention != "vllm":
            raise UsageError(f"redundant experts are vLLM's EPLB; the {convention} layout has none")
        if model.moe is None:
            raise UsageError(f"redundant experts: {model.model_type} has no routed experts")
        if sum(routed for _, _, routed in model.runs) != 1:
            raise UsageError("redundant experts: the routed layers are not one run (one EPLB table row per "
                             "MoE layer is written for a contiguous run only)")
    if expert_placement not in VLLM_EXPERT_PLACEMENTS:
        raise UsageError(f"expert placement `{expert_placement}`: expected one of {', '.join(VLLM_EXPERT_PLACEMENTS)}")
    if expert_placement != "linear" and convention != "vllm":
        raise UsageError(f"expert placement `{expert_placement}` is vLLM's; the {convention} layout places "
                         "experts in blocks")
    if convention not in CONVENTIONS + TRAINER_CONVENTIONS:
        raise UsageError(f"unknown convention `{convention}`",
                         help=f"use one of {', '.join(CONVENTIONS + TRAINER_CONVENTIONS)}")
    given = dict(sizes or {})
    split = {name: given.pop(name) for name in SPLIT_ARGS if name in given}  # Megatron's pipeline split
    if split and convention != "megatron":
        raise UsageError(f"--set {next(iter(split))}=...: Megatron's pipeline split; the {convention} layout has "
                         "no pipeline stages", help="it goes with `layoutc new megatron`")
    check_sizes(model, convention, given)
    return given, split


def check_sizes(model: Model, convention: str, given: Mapping[str, int]) -> None:
    """Each `--set` NAME=VALUE one of the convention's args, with a value it takes (a UsageError)."""
    allowed = arg_names(model, convention)
    for name, value in given.items():
        if name not in allowed:
            raise UsageError(f"--set {name}={value}: the {convention} layout of {model.model_type} has no arg {name}",
                             help=f"its args: {', '.join(allowed)}" + (
                                 f" (and Megatron's pipeline split: {', '.join(SPLIT_ARGS)})"
                                 if convention == "megatron" else ""))
        if name == "ORIG":  # fsdp1's use_orig_params
            if isinstance(value, bool) or value not in (0, 1):
                raise UsageError(f"--set ORIG={value}: expected 1 (use_orig_params=True) or 0 (False)")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "AT" else 1):
            raise UsageError(f"--set {name}={value}: expected " + ("an integer >= 0" if name == "AT" else
                                                                     "a positive integer"))


def render(model: Model, convention: str, sizes: Mapping[str, int] | None = None,
           expert_placement: str = "linear", redundant_experts: int = 0) -> str:
    """The `.layout` text of `model` in `convention` (canonical: `layoutc fmt --check` passes)."""
    return render_document(document(model, convention, sizes, expert_placement, redundant_experts))[0]


def layout_text(config: Mapping, convention: str, sizes: Mapping[str, int] | None = None,
                expert_placement: str = "linear", redundant_experts: int = 0) -> str:
    """`render(model_from_config(config), ...)`: what `layoutc new` prints."""
    return render(model_from_config(config), convention, sizes, expert_placement, redundant_experts)


__all__ = ["CONVENTIONS", "FAMILIES", "ConfigError", "BridgeError", "Model", "GQA", "MLA", "MoE", "Document",
           "Tensor", "Loop", "model_from_config", "document", "render", "render_document", "layout_text",
           "arg_names", "statement_at", "with_dtypes", "VLLM_EXPERT_PLACEMENTS"]
