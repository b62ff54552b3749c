"""The megatron convention: Megatron-Core GPTModel's state dict, as `layoutc new megatron` writes it.

Local layer spec (`get_gpt_layer_local_spec`): separate `input_layernorm` /
`pre_mlp_layernorm`, SequentialMLP experts `mlp.experts.local_experts.{i}`,
stage-local layer numbers under PP, local expert numbers under EP, grouped QKV
and gate|up fc1 with part keys, the vocabulary padded to a multiple of 128*TP
(families.py's module docstring lists every convention).

Pipeline stages: the layers split evenly over `PP` (an arg), or, where Megatron
splits them unevenly (megatron_split.py: its first/last stage sizes, embedding /
loss accounting or pipeline_model_parallel_layout, from `--set`), each stage's
layers written out: `for l in 0..L over pp sizes [15, 16, 16, 14]`, and where
dense and routed layers alternate one loop per run of a kind on each stage,
`at pp=S`, its NAMEs numbered from that stage's first layer (`{l - 15}`).

>>> from layoutlang.bridges.families import model_from_config, render
>>> cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 5,
...        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 500, "num_experts": 4}
>>> text = render(model_from_config(cfg), "megatron", {"PP": 2})
>>> print(next(line for line in text.splitlines() if line.startswith("for l")))
for l in 0..L over pp sizes [3, 2] {
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from .megatron_split import LAYOUT, PipelineSplit, pipeline_split
from .model import (GQA, MLA, Document, Loop, Model, Stmt, Tensor, const_lines, header_lines, layer_key,
                    parts_text, rotary_rows)

def _megatron_attention(m: Model, n: str) -> list[Tensor]:
    """Attention of layer `n` (its stage-local number as written in a NAME)."""
    a = m.attention
    p = f"decoder.layers.{{{n}}}.self_attention"
    out = [Tensor(f"decoder.layers.{{{n}}}.input_layernorm.weight", ("H",), key=layer_key("input_layernorm.weight"))]
    if isinstance(a, GQA):
        qkv = lambda s: ("(KV, " + parts_text(("q", rotary_rows("QG"), layer_key(f"self_attn.q_proj.{s}")),  # noqa: E731
                                          ("k", rotary_rows(None), layer_key(f"self_attn.k_proj.{s}")),
                                          ("v", "D", layer_key(f"self_attn.v_proj.{s}"))) + ") over tp")
        out.append(Tensor(f"{p}.linear_qkv.weight", (qkv("weight"), "H")))
        if a.qkv_bias:
            out.append(Tensor(f"{p}.linear_qkv.bias", (qkv("bias"),)))
        out.append(Tensor(f"{p}.linear_proj.weight", ("H", "Q*D over tp"), key=layer_key("self_attn.o_proj.weight")))
        if a.o_bias:
            out.append(Tensor(f"{p}.linear_proj.bias", ("H",), key=layer_key("self_attn.o_proj.bias")))
        if a.qk_norm:
            out += [Tensor(f"{p}.q_layernorm.weight", ("D",), key=layer_key("self_attn.q_norm.weight")),
                    Tensor(f"{p}.k_layernorm.weight", ("D",), key=layer_key("self_attn.k_norm.weight"))]
        if a.sinks:
            out.append(Tensor(f"{p}.core_attention.softmax_offset", ("Q over tp",), key=layer_key("self_attn.sinks")))
    else:
        if a.q_lora:
            out += [Tensor(f"{p}.linear_q_down_proj.weight", ("Q_LORA over tp", "H"),
                           key=layer_key("self_attn.q_a_proj.weight")),
                    Tensor(f"{p}.q_layernorm.weight", ("Q_LORA",), key=layer_key("self_attn.q_a_layernorm.weight")),
                    Tensor(f"{p}.linear_q_up_proj.weight", ("(NH, QK_NOPE + QK_ROPE) over tp", "Q_LORA"),
                           key=layer_key("self_attn.q_b_proj.weight"))]
        else:
            out.append(Tensor(f"{p}.linear_q_proj.weight", ("(NH, QK_NOPE + QK_ROPE) over tp", "H"),
                              key=layer_key("self_attn.q_proj.weight")))
        out += [Tensor(f"{p}.linear_kv_down_proj.weight", ("KV_LORA + QK_ROPE over tp", "H"),
                       key=layer_key("self_attn.kv_a_proj_with_mqa.weight")),
                Tensor(f"{p}.kv_layernorm.weight", ("KV_LORA",), key=layer_key("self_attn.kv_a_layernorm.weight")),
                Tensor(f"{p}.linear_kv_up_proj.weight", ("(NH, QK_NOPE + V_HEAD) over tp", "KV_LORA"),
                       key=layer_key("self_attn.kv_b_proj.weight")),
                Tensor(f"{p}.linear_proj.weight", ("H", "NH*V_HEAD over tp"), key=layer_key("self_attn.o_proj.weight"))]
    out.append(Tensor(f"decoder.layers.{{{n}}}.pre_mlp_layernorm.weight", ("H",),
                      key=layer_key("post_attention_layernorm.weight")))
    return out


def _megatron_fc(prefix: str, inter: str, key_prefix: str, etp: str = "tp", mesh: str | None = None,
                 names=("gate_proj", "up_proj", "down_proj"), bias: bool = False) -> list[Tensor]:
    k = lambda i, s="weight": f"{key_prefix}.{names[i]}.{s}"  # noqa: E731
    fc1 = lambda s: parts_text(("gate", inter, k(0, s)), ("up", inter, k(1, s))) + f" over {etp}"  # noqa: E731
    out = [Tensor(f"{prefix}.linear_fc1.weight", (fc1("weight"), "H"), mesh=mesh)]
    if bias:
        out.append(Tensor(f"{prefix}.linear_fc1.bias", (fc1("bias"),), mesh=mesh))
    out.append(Tensor(f"{prefix}.linear_fc2.weight", ("H", f"{inter} over {etp}"), key=k(2), mesh=mesh))
    if bias:
        out.append(Tensor(f"{prefix}.linear_fc2.bias", ("H",), key=k(2, "bias"), mesh=mesh))
    return out


def _megatron_mlp(m: Model, n: str, routed: bool) -> list[Stmt]:
    moe = m.moe
    p = f"decoder.layers.{{{n}}}.mlp"
    if not routed:
        return list(_megatron_fc(p, "F", layer_key("mlp")))
    out: list[Stmt] = [Tensor(f"{p}.router.weight", ("E", "H"), key=layer_key(f"{moe.block}.{moe.router}.weight"))]
    if moe.router_bias:
        out.append(Tensor(f"{p}.router.bias", ("E",), key=layer_key(f"{moe.block}.{moe.router}.bias")))
    if moe.score_bias:
        out.append(Tensor(f"{p}.router.expert_bias", ("E",), key=layer_key("mlp.gate.e_score_correction_bias"),
                          dtype="fp32"))
    experts = _megatron_fc(f"{p}.experts.local_experts.{{e.local}}", "I", layer_key(f"{moe.block}.experts.{{e}}"),
                           etp="etp", mesh="experts", names=moe.names, bias=moe.expert_bias)
    out.append(Loop("e", "0", "E", tuple(experts), over="ep"))
    if moe.shared:
        out += _megatron_fc(f"{p}.shared_experts", "S", layer_key(f"mlp.{moe.shared_name}"))
    if moe.shared_gate:
        out.append(Tensor(f"{p}.shared_experts.gate_weight", ("1", "H"), key=layer_key("mlp.shared_expert_gate.weight")))
    return out


def _at(stmts: list[Stmt], at: str) -> tuple[Stmt, ...]:
    """Every tensor of `stmts` (loops included) placed `at` one coordinate."""
    return tuple(replace(s, at=at) if isinstance(s, Tensor) else replace(s, body=_at(list(s.body), at))
                 for s in stmts)


def megatron_document(m: Model, sizes: Mapping[str, int], options: Mapping[str, object]) -> Document:
    """The Document of `m` in Megatron's convention at `sizes` (TP, PP, DP, EP, ETP, AT); `options`
    are Megatron's pipeline split args (megatron_split.SPLIT_ARGS), a UsageError where Megatron
    refuses them."""
    split = pipeline_split(m.layers, sizes["PP"], options)
    moe = m.moe
    padded = "V pad 128*TP over tp"
    body: list[Stmt] = [
        Tensor("embedding.word_embeddings.weight", (padded, "H"), key="model.embed_tokens.weight", at="pp=0"),
        Tensor("decoder.final_layernorm.weight", ("H",), key="model.norm.weight", at="pp=pp - 1")]
    if not m.tied:
        body.append(Tensor("output_layer.weight", (padded, "H"), key="lm_head.weight", at="pp=pp - 1"))
    elif sizes["PP"] > 1:
        body.append(Tensor("output_layer.weight", (padded, "H"), key="model.embed_tokens.weight", at="pp=pp - 1"))
    consts = list(const_lines(m, megatron=True))
    if split.even:
        body += _even_layers(m, consts)
    else:
        consts.insert(0, f"PP = {sizes['PP']}")
        body += _staged_layers(m, split)
    args = [("TP", sizes["TP"]), *([("PP", sizes["PP"])] if split.even else []), ("DP", sizes["DP"])]
    meshes = ["train (pp=PP, dp=DP, tp=TP) at AT"]
    notes = ["Megatron-Core GPTModel, local layer spec (get_gpt_layer_local_spec): stage-local",
             "layer numbers under PP (keys are global), grouped QKV (per query group: its q",
             "heads, one k head, one v head) and fc1 = gate | up, both split over tp with",
             "part keys; the vocabulary padded to a multiple of 128*TP (make-vocab-size-",
             "divisible-by 128). Rank order: pp outermost, tp fastest."]
    if isinstance(m.attention, MLA):
        notes += ["MLA (local spec): the down projections are column parallel (split over tp),",
                  "the LoRA norms are q_layernorm / kv_layernorm (the Transformer Engine spec",
                  "instead replicates the down projections and fuses the norms)."]
    if moe is not None:
        args += [("EP", sizes["EP"]), ("ETP", sizes["ETP"])]
        meshes.append("experts (pp=PP, edp=DP*TP/(EP*ETP), ep=EP, etp=ETP) at AT")
        notes += ["Routed experts: SequentialMLP (local spec, moe_grouped_gemm on or off), local expert",
                  "numbers under EP, fc1 gate | up split over etp; rank order etp fastest, ep, edp."]
    if split.even and len(m.runs) > 1:
        notes += ["Dense and routed layers alternate: each MLP is placed on its layer's stage",
                  "(L/PP layers per stage, so PP must divide L)."]
    if not split.even:
        notes += _split_notes(m, sizes["PP"], split)
    if m.tied:
        notes.append("Tied embeddings: with PP > 1 the last stage holds a copy in output_layer.weight"
                     if sizes["PP"] > 1 else "Tied embeddings: no output_layer.weight at PP=1")
        notes.append("(regenerate this file when PP changes between 1 and more).")
    args.append(("AT", sizes["AT"]))
    return Document(f"{m.model_type}_megatron", header_lines(m, "megatron", notes), tuple(args), tuple(consts),
                    tuple(meshes), m.dtype, tuple(body))


def _even_layers(m: Model, consts: list[str]) -> list[Stmt]:
    """L/PP layers on every stage, PP an arg: one loop over pp, or each MLP run placed by arithmetic."""
    if len(m.runs) == 1:
        routed = m.runs[0][2]
        return [Loop("l", "0", "L", tuple(_megatron_attention(m, "l.local") + _megatron_mlp(m, "l.local", routed)),
                     over="pp")]
    consts.append("LPS = L/PP")   # layers of two kinds: each MLP run placed on its layers' stages
    out: list[Stmt] = [Loop("l", "0", "L", tuple(_megatron_attention(m, "l.local")), over="pp",
                            comment="attention, every layer")]
    for start, stop, routed in m.runs:
        out.append(Loop("l", str(start), "L" if stop == m.layers else str(stop),
                        _at(_megatron_mlp(m, "l%LPS", routed), "pp=l//LPS"),
                        comment="routed experts" if routed else "dense MLP"))
    return out


def _staged_layers(m: Model, split: PipelineSplit) -> list[Stmt]:
    """Uneven stages written out: `over pp sizes [...]`; where kinds alternate, one loop per run of
    a kind on each stage, `at pp=S`, NAMEs counted from the stage's first layer."""
    sizes = tuple(str(n) for n in split.stages)
    if len(m.runs) == 1:
        routed = m.runs[0][2]
        return [Loop("l", "0", "L", tuple(_megatron_attention(m, "l.local") + _megatron_mlp(m, "l.local", routed)),
                     over="pp", sizes=sizes, comment="one `sizes` entry per pipeline stage (Megatron's split)")]
    out: list[Stmt] = [Loop("l", "0", "L", tuple(_megatron_attention(m, "l.local")), over="pp", sizes=sizes,
                            comment="attention, every layer (one `sizes` entry per stage: Megatron's split)")]
    for start, stop, routed in m.runs:
        for stage, (first, count) in enumerate(zip(split.offsets, split.stages)):
            lo, hi = max(start, first), min(stop, first + count)
            if lo >= hi:
                continue
            local = "l" if first == 0 else f"l - {first}"
            kind = "routed experts" if routed else "dense MLP"
            out.append(Loop("l", str(lo), "L" if hi == m.layers else str(hi),
                            _at(_megatron_mlp(m, local, routed), f"pp={stage}"),
                            comment=f"{kind} on stage {stage} (its decoder.layers.0 is layer {first})"))
    return out


def _split_notes(m: Model, pp: int, split: PipelineSplit) -> list[str]:
    notes = ["Pipeline stages of " + ", ".join(map(str, split.stages)) + " layers: Megatron-LM's split with",
             "  " + " ".join(split.flags)]
    if split.chosen:
        notes += [f"layoutc new chose this split (PP={pp} does not divide the {m.layers} layers): run the",
                  "trainer with these flags, or choose another with --set decoder_first_pipeline_num_layers=N,",
                  f"--set decoder_last_pipeline_num_layers=N or --set {LAYOUT}=..."]
    if split.mtp:
        notes.append(f"The layout's {split.mtp} MTP layer(s) (m) are not described.")
    notes.append("PP is a const here (the stages are written out): regenerate this file to change PP.")
    return notes
