"""DeepSpeed ZeRO-3 bridge: the layout and the flat shards of a live ZeRO-3 model.

ZeRO stage 3 (`deepspeed.zero.Init`, `deepspeed.initialize` with
`zero_optimization.stage = 3`) keeps every parameter flattened on its own:
`param.ds_numel` elements of shape `param.ds_shape`, padded to a multiple of the
size W of its partition group `param.ds_process_group`
(`(W - ds_numel % W) % W` zeros' worth of room: DeepSpeed's `_padding_size`),
cut into W equal contiguous pieces of S elements; rank r of the group keeps
`param.ds_tensor`, elements `[r*S, (r+1)*S)` of that padded vector
(`_partition_param`); `param.data` is an empty placeholder between gathers.
That is the language's flat dim (docs/language.md 14.9), one per parameter:

    tensor model.layers.0.mlp.down_proj.weight.ds_tensor [flat([16, 24] as model.layers.0.mlp.down_proj.weight) pad dp over dp] fp32

- `describe(model)`: a `DeepSpeedEngine` or its module. The mesh is the
  partition group, `mesh zero (dp=W) at OFFSET` (its ranks must be consecutive);
  NAMEs are the parameter names with `.ds_tensor`; keys are the names without
  torch's wrapper prefixes, or, for a transformers model of a family in
  `families.FAMILIES`, the HF checkpoint keys as the HF bridge writes them (q/k
  rows as rotary halves; each layer's stacked experts as one key per expert,
  laid one after another in the flat dim, as they lie in the stacked tensor).
  The text depends on shapes, dtypes and the group size only: every rank gets
  the same.
- `tensors(model)`: NAME -> `param.ds_tensor`, this rank's partition itself (a
  Refitter reads it as a source or writes it in place as a destination).

Both check the live parameters first: every parameter a ZeRO-3 one (ZeRO-1/2
keep whole parameters: describe those with the HF bridge), one partition group,
`ds_shape` and the layout's key shape agreeing, each `ds_tensor` a 1-d
contiguous tensor of S elements in a layout dtype. Anything else is a
`BridgeError` naming the parameter. deepspeed and torch are imported inside the
calls (neither is needed to import this module).
"""

from __future__ import annotations

import math
import re

from .dtensor import TORCH_DTYPES, key_of
from .families import BridgeError
from .flat_layout import flat_text_of, hf_flat_keys

SUFFIX = ".ds_tensor"  # NAME = parameter name + SUFFIX (the examples' convention)


def describe(model, *, name: str | None = None) -> str:
    """The `.layout` text of a ZeRO-3 model (identical on every rank of its partition group)."""
    module = _module(model)
    params = _zero3_params(module)
    offset, width = _group(params)
    shapes = _shapes(module, params)
    dtype = {pname: _dtype(pname, p) for pname, p in params}
    common = max(set(dtype.values()), key=list(dtype.values()).count)
    kind = type(module).__name__
    lines = [f"# {kind} under DeepSpeed ZeRO-3, described by layoutlang.bridges.deepspeed: every parameter",
             f"# flattened on its own, padded to a multiple of dp={width}, rank r keeps `ds_tensor`, elements",
             "# [r*S, (r+1)*S) of that padded vector (docs/language.md 14.9).",
             f"layout {name or _layout_name(module)}", "",
             f"mesh zero (dp={width})" + (f" at {offset}" if offset else "")]
    if common != "bf16":
        lines.append(f"default dtype {common}")
    lines.append("")
    for pname, _ in params:
        line = f"tensor {pname}{SUFFIX} [flat({flat_text_of(shapes[pname])}) pad dp over dp]"
        lines.append(line + (f" {dtype[pname]}" if dtype[pname] != common else ""))
    text = "\n".join(lines) + "\n"
    _check(text, params, offset, kind)
    return text


def tensors(model) -> dict:
    """NAME -> `param.ds_tensor` (this rank's partition, the live storage) for every parameter."""
    module = _module(model)
    params = _zero3_params(module)
    _group(params)
    out = {}
    for pname, p in params:
        _dtype(pname, p)
        _partition(pname, p)
        out[pname + SUFFIX] = p.ds_tensor
    return out


def _module(model):
    """The module of a `DeepSpeedEngine` (its `.module`), or `model` itself."""
    inner = getattr(model, "module", None)
    if inner is not None and type(model).__name__.endswith("Engine"):
        return inner
    return model


def _zero3_params(module) -> list[tuple[str, object]]:
    params = list(module.named_parameters())
    if not params:
        raise BridgeError("the module has no parameters")
    for pname, p in params:
        if getattr(p, "ds_tensor", None) is None or not hasattr(p, "ds_shape"):
            raise BridgeError(f"parameter `{pname}` is not partitioned by ZeRO-3 (it has no `ds_tensor`)",
                              help="ZeRO stage 1 and 2 keep every parameter whole on every rank: describe the "
                                   "module with layoutlang.bridges.hf (or write it whole); this bridge describes "
                                   "`zero_optimization.stage = 3` models (built under `deepspeed.zero.Init` or "
                                   "partitioned by `deepspeed.initialize`)")
    return params


def _group(params) -> tuple[int, int]:
    """(first rank, size) of the partition group every parameter shares; its ranks consecutive."""
    import torch.distributed as dist

    first_name, first = params[0]
    ranks = tuple(dist.get_process_group_ranks(first.ds_process_group))
    for pname, p in params[1:]:
        if p.ds_process_group is first.ds_process_group:
            continue
        other = tuple(dist.get_process_group_ranks(p.ds_process_group))
        if other != ranks:
            raise BridgeError(f"parameter `{pname}` is partitioned over ranks {list(other)}, `{first_name}` over "
                              f"{list(ranks)}: one layout mesh cannot say both",
                              help="describe the parameters of each partition group with their own layout")
    if list(ranks) != list(range(ranks[0], ranks[0] + len(ranks))):
        raise BridgeError(f"parameter `{first_name}` is partitioned over ranks {list(ranks)}, which are not "
                          "consecutive: a layout mesh is a run of consecutive ranks",
                          help="partition over consecutive ranks (ZeRO's default group is the whole world)")
    # hpZ's `ds_secondary_tensor` is a second copy within a node; `ds_tensor` stays the primary
    # partition over `ds_process_group`, which is what is described
    return ranks[0], len(ranks)


def _dtype(pname: str, p) -> str:
    dtype = TORCH_DTYPES.get(str(p.ds_tensor.dtype).removeprefix("torch."))
    if dtype is None:
        raise BridgeError(f"parameter `{pname}` keeps its partition as {p.ds_tensor.dtype}, which no layout "
                          "dtype describes", help="ZeRO-3 partitions in fp32, bf16 or fp16 are described")
    return dtype


def _partition(pname: str, p) -> int:
    """S, the partition's element count, after checking `ds_tensor` holds exactly that."""
    import torch.distributed as dist

    width = dist.get_world_size(p.ds_process_group)
    numel = math.prod(p.ds_shape)
    if numel != p.ds_numel:
        raise BridgeError(f"parameter `{pname}`: ds_shape {list(p.ds_shape)} has {numel} elements, ds_numel says "
                          f"{p.ds_numel}")
    size = -(-numel // width)
    t = p.ds_tensor
    if t.dim() != 1 or t.numel() != size or not t.is_contiguous():
        raise BridgeError(f"parameter `{pname}` keeps a partition of shape {list(t.shape)}; ZeRO-3 over "
                          f"{width} ranks keeps {size} contiguous elements of its {numel}",
                          help="a partition swapped out (NVMe offload) or quantized is not described")
    return size


def _shapes(module, params) -> dict[str, list[tuple[list[str], str]]]:
    """Parameter name -> its flat keys: [(SHAPE dims as text, KEY), ...] in storage order
    (`flat_layout.hf_flat_keys`, the rule `layoutc new deepspeed` and the FSDP1 bridge share)."""
    keys = hf_flat_keys(module, {key_of(pname): tuple(p.ds_shape) for pname, p in params}, error=BridgeError)
    return {pname: keys[key_of(pname)] for pname, _ in params}


def _check(text: str, params, offset: int, kind: str) -> None:
    """The text's tensors against the live partitions: shapes, local sizes, dtypes, on every rank."""
    import torch.distributed as dist

    from layoutlang import loads

    layout = loads(text, f"<describe {kind}>")
    described = {t.name: t for t in layout.tensors}
    rank = dist.get_rank()
    for pname, p in params:
        t = described[pname + SUFFIX]
        size = _partition(pname, p)
        if t.local_shape_at(rank) != (size,):
            raise BridgeError(f"parameter `{pname}`: the layout gives rank {rank} {list(t.local_shape_at(rank))} "
                              f"elements, its ds_tensor holds {size}")
        keys = sum(math.prod(r.key_shape) for r in t.regions) if t.regions else math.prod(t.logical_shape)
        if keys != p.ds_numel:
            raise BridgeError(f"parameter `{pname}`: the layout's keys hold {keys} elements, ds_numel is "
                              f"{p.ds_numel}")


def _layout_name(module) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", type(module).__name__.lower()) + "_zero3"


__all__ = ["describe", "tensors", "BridgeError"]
