"""HF transformers bridge: the layout and the tensors of a model held whole on one rank.

`describe(model, at=R)` is the `.layout` text of a transformers model (a
`*ForCausalLM` of a family in `families.FAMILIES`) that rank R holds whole:
NAMEs are the names it stores its tensors under in memory (`named_parameters()`,
then the persistent buffers such as DeepSeek-V3's `e_score_correction_bias`),
keys are the HF checkpoint names of the unfused, per-expert weights
(LANGUAGE.md 8), so the layout pairs with any layout written to that convention
(`layoutc new vllm ...`, the Megatron bridge). In memory, transformers 5 stacks
each layer's experts (`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first;
`mlp.experts.down_proj [E, H, I]`); the keys stay per expert.

The text comes from the model's config (`families.document(..., "hf-memory")`)
and is then checked against the model itself: every stored tensor must be
described, under its name, with its shape; every described tensor must exist;
dtypes are read from the tensors. Anything else is a `BridgeError` naming the
parameter. Tied embeddings are one tensor (`model.embed_tokens.weight`), as
stored.

`tensors(model)` maps the same names to the tensors a `Refitter` reads (as a
source) or writes in place (as a destination): parameters detached (same
storage), persistent buffers as they are.

transformers and torch are imported inside the calls: importing this module
needs neither.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from .families import BridgeError, ConfigError, document, model_from_config, render_document, with_dtypes

TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch.<name> -> layout dtype


def describe(model, *, at: int = 0) -> str:
    """The `.layout` text of `model`, held whole by rank `at` (one rank: `mesh hf (dp=DP) at AT`)."""
    sharded = _dtensor_bridge(model, "describe")
    if sharded is not None:
        return sharded
    stored = _stored(model)
    kind = type(model).__name__
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    try:
        spec = model_from_config(config, source=f"{kind}.config")
    except ConfigError as e:
        raise BridgeError(e.message, help=e.help) from None
    # what is actually stored: tied embeddings are one parameter (named_parameters drops the alias)
    spec = replace(spec, tied="lm_head.weight" not in stored)
    doc = document(spec, "hf-memory", {"AT": at})
    doc = replace(doc, comments=(f"{spec.model_type} ({kind}) held whole on rank {at}, described by",
                                 "layoutlang.bridges.hf.describe: NAMEs are its in-memory names, keys the HF",
                                 "checkpoint names of the unfused, per-expert weights (LANGUAGE.md 8).") + doc.comments[4:])
    text, where = render_document(doc)
    dtypes = _check(text, where, stored, kind)
    common = Counter(dtypes.values()).most_common(1)[0][0] if dtypes else doc.dtype
    return render_document(with_dtypes(replace(doc, dtype=common), dtypes))[0]


def tensors(model) -> dict:
    """Name -> tensor for every tensor `describe(model)` lists (same storage as the model's)."""
    sharded = _dtensor_bridge(model, "tensors")
    if sharded is not None:
        return sharded
    return _stored(model)


def _stored(model) -> dict:
    """What the model stores, by in-memory name: parameters (a tied one once), then persistent buffers."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    persistent = model.state_dict(keep_vars=True).keys()
    for name, b in model.named_buffers():
        if name in persistent and name not in out:
            out[name] = b
    return out


def _check(text: str, where: dict, stored: dict, kind: str) -> dict[tuple[int, ...], str]:
    """Every stored tensor described with its shape, every described tensor stored; the
    dtype of each tensor statement (by its path in the document), read from the tensors."""
    from layoutlang import loads

    layout = loads(text, f"<describe {kind}>")
    described = {t.name: t for t in layout.tensors}
    for name, tensor in stored.items():
        t = described.get(name)
        if t is None:
            raise BridgeError(f"{kind} stores `{name}` {list(tensor.shape)}, which the "
                              f"{layout.name or 'layout'} layout does not describe",
                              help="describe() knows the *ForCausalLM models of the families in "
                                   "layoutlang.bridges.families.FAMILIES as transformers 5 builds them")
        if tuple(tensor.shape) != t.local_shape:
            raise BridgeError(f"{kind} stores `{name}` with shape {list(tensor.shape)}, the layout says "
                              f"{list(t.local_shape)}",
                              help="the model's config does not match its parameters")
        if _layout_dtype(name, tensor) is None:
            raise BridgeError(f"{kind} stores `{name}` as {tensor.dtype}, which no layout dtype describes",
                              help=f"cast it to one of {', '.join('torch.' + d for d in TORCH_DTYPES)}")
    missing = [name for name in described if name not in stored]
    if missing:
        raise BridgeError(f"the layout describes `{missing[0]}` but {kind} stores no such tensor"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                          help="the model's config does not match its parameters")
    found: dict[tuple[int, ...], dict[str, str]] = {}
    for t in layout.tensors:
        path = where[t.span.line]
        found.setdefault(path, {})[t.name] = _layout_dtype(t.name, stored[t.name])
    out = {}
    for path, by_name in found.items():
        kinds = sorted(set(by_name.values()))
        if len(kinds) > 1:
            first = {d: n for n, d in by_name.items()}
            raise BridgeError(f"{kind} stores `{first[kinds[0]]}` as {kinds[0]} but `{first[kinds[1]]}` as "
                              f"{kinds[1]}: one statement of the layout cannot say both",
                              help="cast the model to one dtype per kind of weight")
        out[path] = kinds[0]
    return out


def _layout_dtype(name: str, tensor) -> str | None:
    return TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))


def _dtensor_bridge(model, what: str):
    """A model whose parameters are DTensors is sharded: the DTensor bridge describes it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has none to find
        return None
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            try:
                from . import dtensor
            except ImportError:
                raise BridgeError(
                    f"`{name}` is a DTensor ({', '.join(map(str, p.placements))} on {p.device_mesh}): the model is "
                    "sharded, and the HF bridge describes a model held whole on one rank",
                    help="the DTensor bridge (layoutlang.bridges.dtensor) describes sharded models; gather "
                         "the model onto one rank (full_tensor()) to use this one") from None
            return getattr(dtensor, what)(model)
    return None


__all__ = ["describe", "tensors", "BridgeError"]
