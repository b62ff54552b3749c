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

A model whose parameters are DTensors (FSDP2 `fully_shard`, a TP plan applied
with `parallelize_module` or by `from_pretrained(..., tp_plan="auto")`) is
sharded: `describe` and `tensors` hand it to the DTensor bridge
(layoutlang.bridges.dtensor), which writes each parameter's placements; this
bridge supplies the keys and, for stacked experts, the part keys and stacked
dims of each parameter (`dtensor.Form`). Under transformers' own TP plan the
parameters the plan does not shard (norms, routers, q/k norms) stay plain
tensors, loaded whole on every rank: they are described as replicas.

transformers and torch are imported inside the calls: importing this module
needs neither.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from ..modes import PlainM
from .families import (BridgeError, ConfigError, document, model_from_config, render_document, statement_at,
                       with_dtypes)
from .model import layer_of

TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch.<name> -> layout dtype


def describe(model, *, at: int = 0) -> str:
    """The `.layout` text of `model`, held whole by rank `at` (one rank: `mesh hf (dp=DP) at AT`).

    A model whose parameters are DTensors (FSDP2, a TP plan applied) is sharded:
    the DTensor bridge writes its placements, with this bridge's keys (`at` is
    then the DeviceMesh's).
    """
    if _sharded(model):
        return _describe_dtensors(model)
    stored = _stored(model)
    kind = type(model).__name__
    doc = hf_document(model, tied="lm_head.weight" not in stored, at=at)
    doc = replace(doc, comments=(f"{doc.name.removesuffix('_hf_memory')} ({kind}) held whole on rank {at}, described by",
                                 "layoutlang.bridges.hf.describe: NAMEs are its in-memory names, keys the HF",
                                 "checkpoint names of the unfused, per-expert weights (LANGUAGE.md 8).") + doc.comments[4:])
    text, where = render_document(doc)
    dtypes = _check(text, where, stored, kind)
    common = Counter(dtypes.values()).most_common(1)[0][0] if dtypes else doc.dtype
    return render_document(with_dtypes(replace(doc, dtype=common), dtypes))[0]


def tensors(model) -> dict:
    """Name -> tensor for every tensor `describe(model)` lists (same storage as the model's)."""
    if _sharded(model):
        return _dtensor_module().tensors(model, replicated=_replicated(model))
    return _stored(model)


def hf_document(model, *, tied: bool, at: int = 0):
    """The hf-memory Document of `model` from its config; tiedness as stored (named_parameters
    lists a tied lm_head once, under the embedding's name)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    try:
        spec = model_from_config(config, source=f"{type(model).__name__}.config")
    except ConfigError as e:
        raise BridgeError(e.message, help=e.help) from None
    return document(replace(spec, tied=tied), "hf-memory", {"AT": at})


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
    for path, by_name in found.items():  # instances in file order
        (first, dtype), *rest = by_name.items()
        other = next(((n, d) for n, d in rest if d != dtype), None)
        if other is not None:
            raise BridgeError(f"{kind} stores `{first}` as {dtype} but `{other[0]}` as {other[1]}: one "
                              "statement of the layout cannot say both",
                              help="cast the model to one dtype per kind of weight")
        out[path] = dtype
    return out


def _layout_dtype(name: str, tensor) -> str | None:
    return TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))


def _replicated(model) -> frozenset[str]:
    """The plain parameters of a model that transformers loaded with a TP plan: replicas.

    `from_pretrained(..., tp_plan="auto")` makes a DTensor of every parameter
    its plan shards and loads every other one (norms, the router, q/k norms)
    whole on every rank, from the same checkpoint; the plan's styles keep them
    equal while training (`replicated_with_grad_allreduce`). transformers
    records the plan's degree as `model.tp_size`. A model sharded any other way
    (FSDP2 by hand) makes no such promise: its plain parameters stay refused.
    """
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return frozenset()
    from torch.distributed.tensor import DTensor

    return frozenset(n for n, p in model.named_parameters() if not isinstance(p, DTensor))


def _sharded(model) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has none to find
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _dtensor_module():
    """layoutlang.bridges.dtensor, which describes sharded models (a BridgeError where it is missing)."""
    try:
        from . import dtensor
    except ImportError:
        raise BridgeError("the model's parameters are DTensors: it is sharded, and the HF bridge describes a "
                          "model held whole on one rank",
                          help="the DTensor bridge (layoutlang.bridges.dtensor) describes sharded models; gather "
                               "the model onto one rank (full_tensor()) to use this one") from None
    return dtensor


def _describe_dtensors(model) -> str:
    """A sharded HF model through the DTensor bridge: its placements, this bridge's keys and forms.

    The hf-memory Document says, per parameter, its key, or (stacked experts,
    part keys, transposed storage, a dim with parts or products) the form of its
    dims; the DTensor bridge adds each dim's cut from the placements. A model
    loaded with a TP plan keeps its unsharded parameters as plain tensors: they
    are replicas over the mesh (`_replicated`). Persistent buffers are not
    DTensors and are not described.
    """
    dtensor = _dtensor_module()
    kind = type(model).__name__
    params = dict(model.named_parameters())
    plain = {dtensor.key_of(n): n for n in params}
    doc = hf_document(model, tied="lm_head.weight" not in plain)
    text, where = render_document(doc)
    from layoutlang import loads

    layout = loads(text, f"<describe {kind}>")
    described = {t.name: t for t in layout.tensors}
    consts = const_values(doc.consts)
    keys: dict[str, str] = {}
    forms: dict[str, object] = {}
    for name, pname in plain.items():
        t = described.get(name)
        p = params[pname]
        if t is None:
            raise BridgeError(f"{kind} stores `{pname}` {list(p.shape)}, which the {layout.name} layout does not "
                              "describe", help="describe() knows the *ForCausalLM models of the families in "
                                               "layoutlang.bridges.families.FAMILIES as transformers 5 builds them")
        if tuple(p.shape) != t.logical_shape:
            raise BridgeError(f"{kind} stores `{pname}` with global shape {list(p.shape)}, the layout says "
                              f"{list(t.logical_shape)}", help="the model's config does not match its parameters")
        structured = [not isinstance(dim.mode, PlainM) for dim in t.dims]  # parts, products, pads
        if t.regions is None and not any(structured):
            keys[pname] = t.key
            continue
        stmt = statement_at(doc, where[t.span.line])
        layer = layer_of(stmt.name, name)
        dims = tuple(concrete(d, consts, layer) if (structured[i] or " in " in d) else str(p.shape[i])
                     for i, d in enumerate(stmt.dims))
        if t.regions is None:
            key = t.key
        else:
            key = concrete(stmt.key, consts, layer) if stmt.key is not None and stmt.key != stmt.name else None
        forms[pname] = dtensor.Form(key, dims, stmt.transposed)
    missing = [n for n in described if n not in plain]
    if missing:
        if missing[0] in {dtensor.key_of(n) for n, _ in model.named_buffers()}:
            raise BridgeError(f"{kind} keeps `{missing[0]}` as a buffer: the layout of a sharded model describes "
                              "its parameters, and which ranks hold a plain buffer, and whether they agree, is "
                              "not recorded", help="describe the model gathered onto one rank, or add the buffer "
                                                   "to the layout by hand")
        raise BridgeError(f"the layout describes `{missing[0]}` but {kind} has no such parameter",
                          help="the model's config does not match its parameters")
    return dtensor.describe(model, keys=keys, forms=lambda pname, p: forms.get(pname), name=layout.name,
                            replicated=_replicated(model))


def const_values(consts: tuple[str, ...]) -> dict[str, str]:
    """`("L = 2, H = 64", ...)` -> {"L": "2", "H": "64"} (the Document's consts are integers)."""
    out = {}
    for line in consts:
        for binding in line.split(", "):
            name, _, value = binding.partition(" = ")
            out[name] = value.replace("_", "")
    return out


def concrete(text: str, consts: dict[str, str], layer: int | None) -> str:
    """A dim or key of a statement for one layer: `{l}` and the consts replaced by their values."""
    if layer is not None:
        text = text.replace("{l}", str(layer))
    return re.sub(r"\b[A-Z][A-Z0-9_]*\b", lambda m: consts.get(m.group(), m.group()), text)


__all__ = ["describe", "tensors", "BridgeError"]
