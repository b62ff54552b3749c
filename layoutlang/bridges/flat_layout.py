"""ZeRO-3 and FSDP1 layouts of a known family from its config.json (`layoutc new deepspeed|fsdp1`),
and the flat keys both live bridges write (`hf_flat_keys`).

The flat-shard bridges (deepspeed.py, fsdp1.py) read a live model's bookkeeping;
everything they write for a transformers model of a family `layoutc new` knows
follows from its config and three rules, so the same text is written here
without the model (docs/bridges.md, "ZeRO-3 and FSDP1 trainers"; `render` is
what `layoutc new` calls for every framework):

- the tensors, their HF keys and key dims: the `hf-memory` Document of the config
  (families.py), each tensor's flat keys by one rule (`document_flat_keys`; the
  bridges reach it through `hf_flat_keys`, the Document of the live model's
  config): q/k rows as rotary halves, and (deepspeed) stacked experts one flat
  key per expert and part in storage order (fsdp1: a dense family only);
- the order: transformers' registration order, which is `named_parameters()`'s
  (`registration_order`: the embedding, then each decoder layer's `self_attn`,
  `mlp`, `input_layernorm`, `post_attention_layernorm`, then the final norm and
  `lm_head`);
- the framework's rule: ZeRO-3 flattens every parameter on its own, `pad dp`
  over its partition group (`mesh zero (dp=W)`); FSDP1 with the usual wrap policy
  (each decoder layer a unit, `ModuleWrapPolicy({DecoderLayer})`, inside the root
  unit) flattens each unit's parameters one after another, `align` 16 bytes of
  the dtype with `use_orig_params=True`.

>>> from layoutlang.bridges.model import model_from_config
>>> cfg = {"model_type": "llama", "hidden_size": 6, "intermediate_size": 24, "num_hidden_layers": 1,
...        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, "vocab_size": 37,
...        "dtype": "float32", "architectures": ["LlamaForCausalLM"]}
>>> text = render(model_from_config(cfg), "deepspeed", {"DP": 4})
>>> print(next(s for s in text.splitlines() if "k_proj" in s))
tensor model.layers.0.self_attn.k_proj.weight.ds_tensor [flat([(2, (re: 4/2 | im: 4/2)), 6] as model.layers.0.self_attn.k_proj.weight) pad dp over dp]
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from ..diagnostics import LayoutError
from ..modes import ConcatM, PlainM
from . import families
from .families import FAMILIES, FLAT_CONVENTIONS, document
from .hf import concrete, const_values, hf_document
from .model import BridgeError, ConfigError, Document, Model, layer_of, render_document, statement_at

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
ZERO3_SUFFIX = ".ds_tensor"  # deepspeed.SUFFIX: NAME = parameter name + it
FSDP1_FLAT = "_fsdp_wrapped_module._flat_param"  # fsdp1.WRAPPED + "." + fsdp1.FLAT_PARAM


def render(m: Model, convention: str, sizes: Mapping[str, int] | None = None, expert_placement: str = "linear",
           redundant_experts: int = 0) -> str:
    """`families.render`, and for the flat conventions (deepspeed, fsdp1) `flat_text`: what `layoutc new` prints."""
    if convention not in FLAT_CONVENTIONS:
        return families.render(m, convention, sizes, expert_placement, redundant_experts)
    given, _ = families.checked_args(m, convention, sizes, expert_placement, redundant_experts)
    return flat_text(m, convention, given)


def flat_text(m: Model, convention: str, sizes: Mapping[str, int]) -> str:
    """The `.layout` text the `convention` bridge's `describe` writes for a model of `m`'s config
    (`sizes`: DP the group size W, AT its first rank, fsdp1's ORIG 1 for `use_orig_params=True`)."""
    width, offset = sizes.get("DP", 1), sizes.get("AT", 0)
    if convention == "deepspeed":
        return _zero3(m, width, offset)
    return _fsdp1(m, width, offset, bool(sizes.get("ORIG", 0)))


def _zero3(m: Model, width: int, offset: int) -> str:
    """deepspeed.describe: one flat dim per parameter, `named_parameters()` order, HF keys and key dims."""
    if m.moe is not None and m.moe.score_bias:
        raise ConfigError(f"{m.model_type}: `mlp.gate.e_score_correction_bias` is a buffer, not a parameter "
                          "ZeRO-3 partitions, and layoutlang.bridges.deepspeed refuses a model whose layout "
                          "describes it", help="describe DeepSeek-V3 under ZeRO-3 by hand (the buffer whole on "
                                               "every rank), or write it with `layoutc new hf-memory`")
    keys = document_flat_keys(document(m, "hf-memory"))
    kind = m.architecture or m.model_type
    name = re.sub(r"[^A-Za-z0-9_]", "_", kind.lower()) + "_zero3"
    lines = [f"# {kind} under DeepSpeed ZeRO-3, written by `layoutc new deepspeed` from its config.json: every",
             f"# parameter flattened on its own, padded to a multiple of dp={width}, rank r keeps `ds_tensor`,",
             "# elements [r*S, (r+1)*S) of that padded vector (docs/language.md 14.9).",
             f"layout {name}", "", f"mesh zero (dp={width})" + (f" at {offset}" if offset else "")]
    if m.dtype != "bf16":
        lines.append(f"default dtype {m.dtype}")
    lines.append("")
    for pname in registration_order(m, list(keys)):
        lines.append(f"tensor {pname}{ZERO3_SUFFIX} [flat({flat_text_of(keys[pname])}) pad dp over dp]")
    return "\n".join(lines) + "\n"


def _fsdp1(m: Model, width: int, offset: int, orig: bool) -> str:
    """fsdp1.describe of the usual wrap policy: the root unit, then a unit per decoder layer."""
    if m.moe is not None:
        raise ConfigError(f"{m.model_type}: transformers stacks each layer's experts (`mlp.experts.gate_up_proj`), "
                          "and their HF checkpoint names are per expert: layoutlang.bridges.fsdp1 refuses a "
                          "stacked-experts parameter (a flat key is one whole tensor)",
                          help="`layoutc new fsdp1` writes the dense families (llama, mistral, qwen2, qwen3); "
                               "describe the stacked experts by hand")
    keys = document_flat_keys(document(m, "hf-memory"))
    units: dict[int | None, list[str]] = {None: []}
    for pname in registration_order(m, list(keys)):
        layer = int(pname.split(".")[2]) if pname.startswith("model.layers.") else None
        units.setdefault(layer, []).append(pname)
    align = 16 // ITEMSIZE[m.dtype] if orig else 1
    lines = [f"# {m.model_type} in torch FSDP1, written by `layoutc new fsdp1` from its config.json as",
             "# layoutlang.bridges.fsdp1 describes it: each decoder layer a unit inside the root unit, each",
             "# unit's parameters flattened in registration order" +
             (f", use_orig_params=True (align {align})." if orig else ", use_orig_params=False."),
             "layout fsdp1_model", "", f"mesh fsdp (dp={width})" + (f" at {offset}" if offset else ""), ""]
    for layer, members in units.items():
        name = FSDP1_FLAT if layer is None else f"_fsdp_wrapped_module.model.layers.{layer}.{FSDP1_FLAT}"
        flat = " | ".join(flat_text_of(keys[pname]) for pname in members)
        lines.append(f"tensor {name} [flat({flat}){f' align {align}' if align > 1 else ''} pad dp over dp] "
                     f"{m.dtype}")
    return "\n".join(lines) + "\n"


def flat_text_of(keys: list[tuple[list[str], str]]) -> str:
    """Flat keys as a flat dim lists them: `[D, D] as KEY | ...`."""
    return " | ".join(f"[{', '.join(dims)}] as {key}" for dims, key in keys)


def hf_flat_keys(module, shapes: Mapping[str, tuple[int, ...]], *, error: type[LayoutError] = BridgeError,
                 every: bool = True) -> dict[str, list[tuple[list[str], str]]]:
    """Each parameter of a live `module` as the flat keys deepspeed.describe and fsdp1.describe write:
    name -> [(SHAPE dims as text, KEY), ...] in storage order.

    `shapes`: each parameter's name (torch's wrapper prefixes dropped; a tied one once) -> its
    full shape; every parameter the model's config says, unless `every` is false (FSDP1 flattens
    the parameters of its units, not those of ignored modules). A transformers model of a family
    in FAMILIES (its `config.model_type`) gets the HF checkpoint keys and key dims of its
    hf-memory Document (`document_flat_keys`: q/k rows as rotary halves, stacked experts one key
    per expert and part); any other module one plain key per parameter, its name.
    """
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict") or config.to_dict().get("model_type") not in FAMILIES:
        return {name: [([str(n) for n in shape], name)] for name, shape in shapes.items()}
    doc = hf_document(module, tied="lm_head.weight" not in shapes)
    return document_flat_keys(doc, shapes, error=error, kind=type(module).__name__, every=every)


def document_flat_keys(doc: Document, shapes: Mapping[str, tuple[int, ...]] | None = None, *,
                       error: type[LayoutError] = ConfigError, kind: str = "the model",
                       every: bool = True) -> dict[str, list[tuple[list[str], str]]]:
    """Each tensor of an hf-memory Document as flat keys: name -> [(SHAPE dims as text, KEY), ...]
    in storage order (what `layoutc new deepspeed|fsdp1` and the flat bridges write).

    A tensor that is one key keeps its statement's dims as written, its consts replaced
    (`(2, (re: 4/2 | im: 4/2))`: a flat key's storage order is its own, so the parts are
    written, docs/language.md 14.9); a tensor holding several keys lists them by `_regions`.
    With `shapes` (a live model's parameters: name -> shape) exactly those, each checked against
    the Document, and (`every`) every tensor of the Document among them (`error` names a
    mismatch: BridgeError from a bridge); without, every tensor in the Document's order.
    """
    from layoutlang import loads

    text, where = render_document(doc)
    layout = loads(text, f"<describe {kind}>" if shapes is not None else f"<{doc.name}>")
    consts = const_values(doc.consts)
    described = {t.name: t for t in layout.tensors}
    if shapes is None:
        shapes = {name: t.logical_shape for name, t in described.items()}
    for name, shape in shapes.items():
        t = described.get(name)
        if t is None:
            raise error(f"{kind} stores `{name}` {list(shape)}, which the {layout.name} layout does not describe",
                        help="describe() knows the *ForCausalLM models of the families in "
                             "layoutlang.bridges.families.FAMILIES as transformers 5 builds them")
        if tuple(shape) != t.logical_shape:
            raise error(f"{kind} stores `{name}` with shape {list(shape)}, the layout says {list(t.logical_shape)}",
                        help="the model's config does not match its parameters")
    missing = [n for n in described if n not in shapes] if every else []
    if missing:
        raise error(f"the layout describes `{missing[0]}` but {kind} has no such parameter",
                    help="the model's config does not match its parameters")
    out = {}
    for name in shapes:
        t = described[name]
        stmt = statement_at(doc, where[t.span.line])
        if t.regions is None and not stmt.transposed:
            layer = layer_of(stmt.name, name)
            dims = [concrete(d, consts, layer) if not isinstance(dim.mode, PlainM) else str(n)
                    for d, dim, n in zip(stmt.dims, t.dims, t.logical_shape)]
            out[name] = [(dims, t.key)]
        else:
            out[name] = _regions(t, error)
    return out


def registration_order(m: Model, tensors) -> list:
    """`tensors` (hf-memory tensor names, or anything with a `.name`) in the order a transformers
    5 `*ForCausalLM` of `m`'s config registers them, which `named_parameters()` lists.

    transformers builds `model.embed_tokens`, `model.layers`, `model.norm`, then `lm_head`; each
    decoder layer `self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`; gpt-oss's
    attention its `sinks` before its projections; an MoE block its router (`gate` / `router`) before
    its experts, except where it builds the experts first (`MoE.router_last`: Qwen3-MoE,
    DeepSeek-V3), then its shared expert(s); stacked experts each weight then its bias. Inside
    those, the hf-memory Document's order is transformers' own (tests/test_layoutc_new.py
    compares the result with `named_parameters()` of every family built on the meta device).
    """
    top = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 2, "lm_head": 3}
    sub = {"self_attn": 0, "mlp": 1, "input_layernorm": 2, "post_attention_layernorm": 3}
    router = m.moe.router if m.moe is not None else None
    router_last = m.moe is not None and m.moe.router_last

    def key(item):
        index, t = item
        parts = (t if isinstance(t, str) else t.name).split(".")
        if parts[:2] != ["model", "layers"]:
            return (top[".".join(parts[:2]) if parts[0] == "model" else parts[0]], 0, 0, 0, index)
        part, inner = parts[3], 0
        if part == "self_attn" and parts[4] == "sinks":
            inner = -1
        elif part == "mlp" and parts[4] == router:
            inner = 1 if router_last else 0
        elif part == "mlp" and parts[4] == "experts":
            inner = (0 if router_last else 1, "down_proj" in parts[5])
        elif part == "mlp":
            inner = 2
        inner = inner if isinstance(inner, tuple) else (inner, False)
        return (top["model.layers"], int(parts[2]), sub[part], inner, index)

    return [t for _, t in sorted(enumerate(tensors), key=key)]


def _regions(t, error: type[LayoutError]) -> list[tuple[list[str], str]]:
    """A tensor holding several keys (stacked experts, fused parts) as flat keys in storage order.

    Each key must be a row-major contiguous range of the stored tensor (a stacked
    expert's gate rows, its up rows) and stored as it is read (no transposed key,
    no structure inside a part), and together they must fill it: then the flat dim
    lists them one after another. Anything else is an `error` naming the tensor.
    """
    for dim in t.dims:
        mode = dim.mode
        ok = isinstance(mode, PlainM) or (isinstance(mode, ConcatM)
                                          and all(isinstance(part.mode, PlainM) for part in mode.parts))
        if not ok:
            raise error(f"parameter `{t.name}` stores its keys in a dim of structure `{mode}`, which a flat dim of "
                        "whole keys cannot list", help="describe this parameter by hand")
    shape = t.logical_shape
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    spans = []
    for r in t.regions:
        if r.transposed:
            raise error(f"parameter `{t.name}` stores key `{r.key}` transposed: a flat key is row-major",
                        help="describe this parameter by hand")
        extents = [hi - lo for lo, hi in r.box]
        inner = next((i for i, e in enumerate(extents) if e != 1), len(extents))
        if any(extents[i] != shape[i] for i in range(inner + 1, len(shape))):
            raise error(f"parameter `{t.name}`: key `{r.key}` is not one contiguous run of its storage",
                        help="describe this parameter by hand")
        start = sum(lo * s for (lo, _), s in zip(r.box, strides))
        spans.append((start, math.prod(extents), [str(n) for n in r.key_shape], r.key))
    spans.sort()
    at = 0
    for start, numel, _, key in spans:
        if start != at:
            raise error(f"parameter `{t.name}`: its keys leave elements {at}..{start} unnamed before `{key}`")
        at += numel
    return [(dims, key) for _, _, dims, key in spans]


__all__ = ["render", "flat_text", "flat_text_of", "hf_flat_keys", "document_flat_keys", "registration_order"]
