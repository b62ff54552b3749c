"""The torchtitan convention: how torchtitan 0.3.0 stores a model's live parameters.

torchtitan's `state_dict()` is not its storage: hooks split and rename on the
way out. A refit reads and writes the parameters themselves, so this convention
writes what `named_parameters()` (and the persistent `expert_bias_E` buffer)
hold, read from torchtitan's source (models/common/attention.py, moe.py,
feed_forward.py and each model's state_dict_adapter.py):

- `attention.qkv_linear.wqkv.weight` fuses q, k and v per kv group, Megatron's
  grouped order: `(KV, (q: QG*D | k: D | v: D))` (FusedQKVLinear,
  `_split_qkv_on_save`);
- Llama3 rotates with ComplexRoPE, so its q/k rows keep each head's rotary pairs
  interleaved (Meta's order, undone by `Llama3StateDictAdapter._permute`):
  `(QG, D/2, (re: 1 | im: 1))`; Qwen3 (CosSinRoPE) keeps HF's order, each head's
  halves `(QG, (re: D/2 | im: D/2))` as every HF-order convention writes them
  (families.py `rotary_rows`); DeepSeek-V3 keeps interleaved rope dims exactly as
  HF does, plain rows;
- dense MLPs are `feed_forward.w1` / `w3` / `w2` (gate / up / down), MoE experts
  stacked `moe.routed_experts.inner_experts.w1_EFD [E, I, H]`, `w3_EFD`,
  `w2_EDF [E, H, I]` (no `.weight`), the router `moe.router.gate.weight`, shared
  experts `moe.shared_experts.w1/w2/w3.weight`;
- `moe.expert_bias_E` (a persistent fp32 buffer) is DeepSeek-V3's
  `e_score_correction_bias`; Qwen3's HF checkpoint has no such tensor (its
  adapter drops it), so for Qwen3 it is torchtitan's own state, not described.

Keys are HF checkpoint names (LANGUAGE.md 8). The whole-model document (`DP`
replicas) is what `layoutc new torchtitan` would print; the live bridge
(layoutlang.bridges.torchtitan) adds FSDP2's cuts from the DTensor placements.

>>> from layoutlang.bridges.families import model_from_config, render
>>> cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
...        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256}
>>> print(next(s for s in render(model_from_config(cfg), "torchtitan").splitlines() if "tensor" in s and "wqkv" in s).strip())
tensor layers.{l}.attention.qkv_linear.wqkv.weight [(KV, (q: (QG, D/2, (re: 1 | im: 1)) as model.layers.{l}.self_attn.q_proj.weight | k: (D/2, (re: 1 | im: 1)) as model.layers.{l}.self_attn.k_proj.weight | v: D as model.layers.{l}.self_attn.v_proj.weight)), H]
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from .model import (GQA, ConfigError, Document, Loop, Model, Stmt, Tensor, const_lines, header_lines, layer_key,
                    parts_text, rotary_rows)

FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")  # torchtitan 0.3.0's Llama3, Qwen3, DeepSeek-V3
INTERLEAVED = ("llama",)  # ComplexRoPE on GQA rows: Meta's order (DeepSeek-V3's MLA rows are HF's own)


def torchtitan_document(m: Model, sizes: Mapping[str, int]) -> Document:
    """The Document of `m` as torchtitan stores it, whole on every rank of `dp=DP` at `AT`."""
    if m.model_type not in FAMILIES:
        raise ConfigError(f"torchtitan 0.3.0 has no model of family `{m.model_type}`",
                          help=f"its families here: {', '.join(FAMILIES)}")
    if isinstance(m.attention, GQA) and (m.attention.qkv_bias or m.attention.o_bias or m.attention.sinks):
        raise ConfigError(f"{m.model_type}: attention biases or sinks are not in torchtitan's models",
                          help="torchtitan's Llama3 / Qwen3 attention has no biases")
    body: list[Stmt] = [Tensor("tok_embeddings.weight", ("V", "H"), key="model.embed_tokens.weight"),
                        Tensor("norm.weight", ("H",), key="model.norm.weight")]
    if not m.tied:
        body.append(Tensor("lm_head.weight", ("V", "H")))
    for start, stop, routed in m.runs:
        layer = _attention(m) if len(m.runs) == 1 else []
        layer += _moe(m) if routed else _ffn("feed_forward", "F", layer_key("mlp"))
        body.append(Loop("l", str(start), "L" if stop == m.layers else str(stop), tuple(layer),
                         comment=None if len(m.runs) == 1 else ("routed experts" if routed else "dense MLP")))
    if len(m.runs) > 1:
        body.insert(2 + (not m.tied), Loop("l", "0", "L", tuple(_attention(m)), comment="attention, every layer"))
    notes = ["torchtitan 0.3.0's live parameters (named_parameters; not its state_dict, whose",
             "hooks split and rename): " + ("fused wqkv in grouped order (per kv group: its q heads,"
                                            if isinstance(m.attention, GQA) else "MLA as HF stores it,"),
             ("one k head, one v head), " if isinstance(m.attention, GQA) else "")
             + "feed_forward.w1/w3/w2" + (", stacked experts *_EFD / *_EDF." if m.moe else ".")]
    if m.model_type in INTERLEAVED:
        notes += ["Llama3 rotates with ComplexRoPE: q/k rows keep each head's rotary pairs",
                  "interleaved (Meta's order); every HF-order convention writes HF's halves,",
                  "(Q, (re: D/2 | im: D/2)), so the two pair without edits (LANGUAGE.md 3)."]
    if m.moe is not None and m.moe.score_bias:
        notes.append("moe.expert_bias_E is a persistent buffer (fp32): HF's e_score_correction_bias.")
    elif m.moe is not None:
        notes.append("moe.expert_bias_E (load balancing) has no HF tensor: not described.")
    args = (("DP", sizes["DP"]), ("AT", sizes["AT"]))
    return Document(f"{m.model_type}_torchtitan", header_lines(m, "torchtitan", notes), args,
                    const_lines(m, megatron=True), ("train (dp=DP) at AT",), m.dtype, tuple(body))


def _attention(m: Model) -> list[Tensor]:
    a = m.attention
    p = "layers.{l}.attention"
    out = [Tensor("layers.{l}.attention_norm.weight", ("H",), key=layer_key("input_layernorm.weight"))]
    if isinstance(a, GQA):
        meta = m.model_type in INTERLEAVED
        q, k = (("(QG, D/2, (re: 1 | im: 1))", "(D/2, (re: 1 | im: 1))") if meta
                else (rotary_rows("QG"), rotary_rows(None)))
        qkv = parts_text(("q", q, layer_key("self_attn.q_proj.weight")), ("k", k, layer_key("self_attn.k_proj.weight")),
                     ("v", "D", layer_key("self_attn.v_proj.weight")))
        out += [Tensor(f"{p}.qkv_linear.wqkv.weight", (f"(KV, {qkv})", "H")),
                Tensor(f"{p}.wo.weight", ("H", "Q*D"), key=layer_key("self_attn.o_proj.weight"))]
        if a.qk_norm:
            out += [Tensor(f"{p}.q_norm.weight", ("D",), key=layer_key("self_attn.q_norm.weight")),
                    Tensor(f"{p}.k_norm.weight", ("D",), key=layer_key("self_attn.k_norm.weight"))]
    else:
        if a.q_lora:
            out += [Tensor(f"{p}.wq_a.weight", ("Q_LORA", "H"), key=layer_key("self_attn.q_a_proj.weight")),
                    Tensor(f"{p}.q_norm.weight", ("Q_LORA",), key=layer_key("self_attn.q_a_layernorm.weight")),
                    Tensor(f"{p}.wq_b.weight", ("NH*(QK_NOPE + QK_ROPE)", "Q_LORA"),
                           key=layer_key("self_attn.q_b_proj.weight"))]
        else:
            out.append(Tensor(f"{p}.wq.weight", ("NH*(QK_NOPE + QK_ROPE)", "H"), key=layer_key("self_attn.q_proj.weight")))
        out += [Tensor(f"{p}.wkv_a.weight", ("KV_LORA + QK_ROPE", "H"), key=layer_key("self_attn.kv_a_proj_with_mqa.weight")),
                Tensor(f"{p}.kv_norm.weight", ("KV_LORA",), key=layer_key("self_attn.kv_a_layernorm.weight")),
                Tensor(f"{p}.wkv_b.weight", ("NH*(QK_NOPE + V_HEAD)", "KV_LORA"),
                       key=layer_key("self_attn.kv_b_proj.weight")),
                Tensor(f"{p}.wo.weight", ("H", "NH*V_HEAD"), key=layer_key("self_attn.o_proj.weight"))]
    out.append(Tensor("layers.{l}.ffn_norm.weight", ("H",), key=layer_key("post_attention_layernorm.weight")))
    return out


def _ffn(prefix: str, inter: str, key_prefix: str) -> list[Tensor]:
    """torchtitan's FeedForward: w1 = gate, w3 = up, w2 = down."""
    p = f"layers.{{l}}.{prefix}"
    return [Tensor(f"{p}.w1.weight", (inter, "H"), key=f"{key_prefix}.gate_proj.weight"),
            Tensor(f"{p}.w2.weight", ("H", inter), key=f"{key_prefix}.down_proj.weight"),
            Tensor(f"{p}.w3.weight", (inter, "H"), key=f"{key_prefix}.up_proj.weight")]


def _moe(m: Model) -> list[Tensor]:
    moe = m.moe
    p = "layers.{l}.moe"
    expert = lambda name: layer_key(f"mlp.experts.{{e}}.{name}.weight")  # noqa: E731
    out = [Tensor(f"{p}.router.gate.weight", ("E", "H"), key=layer_key("mlp.gate.weight"))]
    if moe.score_bias:
        out.append(Tensor(f"{p}.expert_bias_E", ("E",), key=layer_key("mlp.gate.e_score_correction_bias"), dtype="fp32"))
    inner = f"{p}.routed_experts.inner_experts"
    out += [Tensor(f"{inner}.w1_EFD", ("e in 0..E", "I", "H"), key=expert("gate_proj")),
            Tensor(f"{inner}.w2_EDF", ("e in 0..E", "H", "I"), key=expert("down_proj")),
            Tensor(f"{inner}.w3_EFD", ("e in 0..E", "I", "H"), key=expert("up_proj"))]
    if moe.shared:
        out += _ffn("moe.shared_experts", "S", layer_key(f"mlp.{moe.shared_name}"))
    return out


def with_rotary_halves(doc: Document) -> Document:
    """`doc` (an hf / hf-memory Document of a GQA model) with q_proj / k_proj rows written as
    HF stores them under rotary: each head's halves, `(Q, (re: D/2 | im: D/2))`.

    The hf and hf-memory conventions write them themselves now (families.py
    `rotary_rows`, issue 29), so this returns such a Document unchanged; kept for
    callers that built a partner for a Meta-order source (torchtitan's Llama3) by hand.
    """
    rows = {"self_attn.q_proj.weight": "(Q, (re: D/2 | im: D/2))",
            "self_attn.k_proj.weight": "(KV, (re: D/2 | im: D/2))"}

    def block(stmts: tuple[Stmt, ...]) -> tuple[Stmt, ...]:
        out = []
        for s in stmts:
            if isinstance(s, Loop):
                out.append(replace(s, body=block(s.body)))
                continue
            tail = next((r for suffix, r in rows.items() if (s.key or s.name).endswith(suffix)), None)
            out.append(replace(s, dims=(tail, *s.dims[1:])) if tail else s)
        return tuple(out)

    return replace(doc, body=block(doc.body))


__all__ = ["FAMILIES", "torchtitan_document", "with_rotary_halves"]
