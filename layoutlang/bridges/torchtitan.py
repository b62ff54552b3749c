"""The torchtitan bridge: the `.layout` of a live torchtitan 0.3.0 model, and its tensors.

torchtitan's `state_dict()` runs hooks (FusedQKVLinear splits `wqkv` into
`wq`/`wk`/`wv`) and its adapter renames and permutes; a refit must read and write
the parameters themselves. `describe(model)` writes them as the torchtitan
convention says (layoutlang.bridges.torchtitan_layout: fused grouped wqkv, Meta's
interleaved rotary rows for Llama3, stacked `*_EFD` experts, the `expert_bias_E`
buffer), with HF checkpoint names as keys, so the result pairs with the hf, vLLM
and Megatron layouts of the same model:

- the model's sizes come from its own config (`model.config`: the Decoder.Config
  torchtitan built it from), its family from its class (Llama3Model, Qwen3Model,
  DeepSeekV3Model), and the rotary order from its RoPE config: ComplexRoPE on GQA
  rows is Meta's interleaved order, CosSinRoPE HF's (a Llama3 built with CosSinRoPE
  is refused rather than described in the wrong order);
- under FSDP2 / TP (parameters are DTensors) the cuts come from the placements,
  read by layoutlang.bridges.dtensor; the described buffer (`expert_bias_E`, which
  FSDP2 leaves whole on every rank and torchtitan updates identically on all of
  them) is a replica over the whole mesh;
- a model held whole (no DTensor) is described on rank `at`.

Every parameter must be described with its (global) shape, and every described
tensor stored: anything else is a BridgeError naming the parameter. torch and
torchtitan are imported inside the calls.
"""

from __future__ import annotations

import re

from ..modes import PlainM
from .families import GQA, MLA, BridgeError, Model, MoE, render_document, statement_at
from .model import layer_of
from .torchtitan_layout import INTERLEAVED, torchtitan_document

_CLASSES = {"Llama3Model": "llama", "Qwen3Model": "qwen3", "DeepSeekV3Model": "deepseek_v3"}
_TORCH_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def model_of(model) -> Model:
    """The families.Model a live torchtitan model is, from its config (see the module docstring)."""
    kind = type(model).__name__
    # FSDP2's fully_shard swaps the class for a subclass (FSDPLlama3Model): the model's class is in the MRO
    family = next((_CLASSES[c.__name__] for c in type(model).__mro__ if c.__name__ in _CLASSES), None)
    config = getattr(model, "config", None)
    if family is None or config is None:
        raise BridgeError(f"`{kind}` is not a torchtitan model this bridge knows",
                          help=f"describe() knows torchtitan 0.3.0's {', '.join(_CLASSES)}")
    layers = list(config.layers)
    first = layers[0].attention
    routed = tuple(getattr(layer, "moe", None) is not None for layer in layers)
    if family == "qwen3" and any(routed):
        family = "qwen3_moe"
    if family == "deepseek_v3":
        attention: GQA | MLA = MLA(first.n_heads, first.q_lora_rank or None, first.kv_lora_rank,
                                   first.qk_nope_head_dim, first.qk_rope_head_dim, first.v_head_dim)
    else:
        heads = first.n_heads
        attention = GQA(heads, first.n_kv_heads or heads, first.head_dim or config.dim // heads,
                        qk_norm=first.qk_norm is not None)
        rope = type(first.rope).__qualname__.split(".")[0]  # ComplexRoPE / CosSinRoPE (their Config class)
        want = "ComplexRoPE" if family in INTERLEAVED else "CosSinRoPE"
        if rope != want:
            raise BridgeError(f"{kind} layer 0 rotates with {rope}, but the torchtitan convention writes "
                              f"{family}'s q/k rows in {want}'s order",
                              help="describe the model as torchtitan's model registry builds it")
    dense = next((layer.feed_forward.w1.out_features for layer in layers
                  if getattr(layer, "feed_forward", None) is not None), None)
    moe = None
    if any(routed):
        spec = next(layer.moe for layer in layers if getattr(layer, "moe", None) is not None)
        shared = spec.shared_experts.w1.out_features if spec.shared_experts is not None else None
        moe = MoE(spec.num_experts, spec.routed_experts.inner_experts.hidden_dim, shared=shared,
                  score_bias=family == "deepseek_v3" and spec.load_balance_coeff is not None)
    dtype = _TORCH_DTYPES.get(str(next(model.parameters()).dtype), "fp32")
    return Model(family, len(layers), config.dim, config.vocab_size, bool(config.enable_weight_tying), dtype,
                 attention, dense, moe, routed)


def describe(model, *, at: int = 0, name: str | None = None) -> str:
    """The `.layout` text of `model` (identical on every rank): FSDP2 / TP cuts from its
    DTensors, or the whole model on rank `at`."""
    spec = model_of(model)
    doc = torchtitan_document(spec, {"DP": 1, "AT": at})
    text, where = render_document(doc)
    from layoutlang import loads

    layout = loads(text, f"<describe {type(model).__name__}>")
    described = {t.name: t for t in layout.tensors}
    stored = _stored(model, described)
    _check(stored, described, type(model).__name__)
    if not _sharded(stored):
        for pname, p in stored.items():
            if _TORCH_DTYPES.get(str(p.dtype)) != described[pname].dtype:
                raise BridgeError(f"`{pname}` is {p.dtype}, the layout says {described[pname].dtype}",
                                  help="cast the model to one dtype (expert_bias_E stays fp32)")
        return text
    from . import dtensor

    consts = _const_values(doc.consts)
    forms = {}
    for pname, p in stored.items():
        t = described[pname]
        stmt = statement_at(doc, where[t.span.line])
        layer = layer_of(stmt.name, pname)
        dims = tuple(_concrete(d, consts, layer) if (not isinstance(t.dims[i].mode, PlainM) or " in " in d)
                     else str(p.shape[i]) for i, d in enumerate(stmt.dims))
        key = t.key if t.regions is None else (_concrete(stmt.key, consts, layer) if stmt.key else None)
        forms[pname] = dtensor.Form(key, dims, stmt.transposed)
    buffers = {n for n, p in stored.items() if not _is_dtensor(p)}
    return dtensor.layout_text(list(stored.items()), forms=lambda pname, p: forms[pname],
                               name=name or doc.name, mesh_name=None, replicated=buffers)


def tensors(model) -> dict:
    """Name -> this rank's local storage of every tensor `describe(model)` lists: views of the
    parameters (and the described buffers), so writing into them writes the model."""
    spec = model_of(model)
    from layoutlang import loads

    layout = loads(render_document(torchtitan_document(spec, {"DP": 1, "AT": 0}))[0], "<tensors>")
    out = {}
    for pname, p in _stored(model, {t.name: t for t in layout.tensors}).items():
        if _is_dtensor(p):
            p = p._local_tensor if p._local_tensor is not None else p.to_local()
        out[pname] = p.detach()
    return out


def _stored(model, described: dict) -> dict:
    """Parameters by name (torch's wrapper prefixes removed), then the persistent buffers the
    layout describes (torchtitan's other buffers are caches and counters: rope.cache,
    tokens_per_expert_E)."""
    from .dtensor import key_of

    out = {key_of(n): p for n, p in model.named_parameters()}
    persistent = {key_of(n) for n in model.state_dict(keep_vars=True)}
    for n, b in model.named_buffers():
        n = key_of(n)
        if n in described and n in persistent and n not in out:
            out[n] = b
    return out


def _check(stored: dict, described: dict, kind: str) -> None:
    for pname, p in stored.items():
        t = described.get(pname)
        if t is None:
            raise BridgeError(f"{kind} stores `{pname}` {list(p.shape)}, which the torchtitan layout does not describe",
                              help="describe() knows torchtitan 0.3.0's models as its registry builds them "
                                   "(fused wqkv, grouped experts); a non-fused QKV (wq/wk/wv) is not written yet")
        if tuple(p.shape) != t.logical_shape:
            raise BridgeError(f"{kind} stores `{pname}` with global shape {list(p.shape)}, the layout says "
                              f"{list(t.logical_shape)}", help="the model's config does not match its parameters")
    missing = [n for n in described if n not in stored]
    if missing:
        raise BridgeError(f"the torchtitan layout describes `{missing[0]}` but {kind} stores no such tensor",
                          help="the model's config does not match its parameters")


def _is_dtensor(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _sharded(stored: dict) -> bool:
    return any(_is_dtensor(p) for p in stored.values())


def _const_values(consts: tuple[str, ...]) -> dict[str, str]:
    """`("L = 2, H = 64", "QG = Q/KV")` -> {"L": "2", "H": "64", "QG": "(Q/KV)"} (expressions kept)."""
    out = {}
    for line in consts:
        for binding in line.split(", "):
            name, _, value = binding.partition(" = ")
            out[name] = value.replace("_", "") if value.replace("_", "").isdigit() else f"({value})"
    return out


def _concrete(text: str, consts: dict[str, str], layer: int | None) -> str:
    """A dim or key of a statement for one layer: `{l}` and the consts replaced (twice: QG = Q/KV)."""
    if layer is not None:
        text = text.replace("{l}", str(layer))
    for _ in range(2):
        text = re.sub(r"\b[A-Z][A-Z0-9_]*\b", lambda m: consts.get(m.group(), m.group()), text)
    return text


__all__ = ["describe", "tensors", "model_of", "BridgeError"]
