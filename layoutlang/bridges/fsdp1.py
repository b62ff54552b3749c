"""The FSDP1 bridge: the `.layout` of a torch `FullyShardedDataParallel` model, read from its flat parameters.

FSDP1 flattens the parameters of each wrapped unit, in registration order, into
one `FlatParameter`, pads it at the end to a multiple of the sharding group's
size W and keeps rank r's W-th piece (docs/language.md 14.9). Its bookkeeping
says all of it, so `describe` reads it and writes one flat dim per unit:

    tensor UNIT._fsdp_wrapped_module._flat_param
           [flat([3, 5] as 0.weight | [3] as 0.bias | ...) align A pad dp over dp] fp32

- the keys are the unit's `_fqns` with its module path in front (torch's wrapper
  prefixes `_fsdp_wrapped_module.` / `_checkpoint_wrapped_module.` dropped): the
  original parameter names, which for a transformers model of a dense family are
  its HF checkpoint names; shapes from `_shapes`, in the flat parameter's order,
  written for a transformers model of a family `layoutc new` knows as the ZeRO-3
  bridge writes them (`flat_layout.hf_flat_keys`): q/k rows as HF's rotary
  halves, `[(2, (re: 4/2 | im: 4/2)), 18]`, the same storage named so that it
  pairs with every convention (a flat key pairs strictly, docs/language.md 14.9);
- `align A` is FSDP1's own rule, read from the handle (`_aligned_numel`: 16 bytes
  of the forward dtype, with `use_orig_params=True` only), and checked against
  the padding torch inserted (`_numels_with_padding`, `_is_padding_mask`): a
  parameter that starts anywhere else than the rule says is refused;
- `pad dp over dp`: the tail padding and the split over the unit's process group,
  whose ranks must be consecutive (`mesh fsdp (dp=W) at FIRST`), one group for
  every unit (FULL_SHARD or SHARD_GRAD_OP; NO_SHARD and the hybrid strategies
  are refused);
- the tensor NAME is the flat parameter's name as `named_parameters()` lists it
  with `use_orig_params=False` (the unit's module path, then
  `_fsdp_wrapped_module._flat_param`), with either setting.

Before the text is returned it is loaded and checked against the live units: on
this rank, every local element the layout places must be the element torch's
`_shard_param_infos` says the shard holds there (which parameter, which flat
index, read through the key's storage order), the padding where torch has none,
and the local extent the shard's.

`tensors(model)` maps each NAME to the unit's local shard (`_local_shard`, which
is the flat parameter's data between forward passes), the very storage: a
refit into it writes the model's parameters (with `use_orig_params=True` the
original parameters are views into it, which is checked). torch is imported
inside the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..modes import PadM
from .dtensor import TORCH_DTYPES, key_of
from .families import BridgeError
from .flat_layout import flat_text_of, hf_flat_keys

FLAT_PARAM = "_flat_param"
WRAPPED = "_fsdp_wrapped_module"


@dataclass(frozen=True)
class Unit:
    """One FSDP1 unit with parameters: its flat parameter and what torch records of it."""

    name: str  # the flat parameter's NAME in the layout
    module_path: str  # the FSDP module's name in named_modules()
    keys: tuple[tuple[str, tuple[int, ...]], ...]  # (key, shape) in flat order
    align: int  # FSDP1's alignment in elements (1: none)
    shard_numel: int  # S: elements per rank, padding included
    dtype: str  # layout dtype
    handle: object

    @property
    def flat_param(self):
        return self.handle.flat_param


def describe(model, *, name: str = "fsdp1_model", mesh_name: str = "fsdp") -> str:
    """The `.layout` text of `model`'s FSDP1 units (identical on every rank of the sharding group)."""
    units, (ranks, rank) = _units(model)
    described = _flat_keys(model, units)
    offset = ranks[0]
    mesh = f"mesh {mesh_name} (dp={len(ranks)})" + (f" at {offset}" if offset else "")
    lines = ["# Described by layoutlang.bridges.fsdp1 from the live FSDP1 units' FlatParameter bookkeeping.",
             f"layout {name}", "", mesh, ""]
    for u in units:
        keys = " | ".join(flat_text_of(described[key]) for key, _ in u.keys)
        align = f" align {u.align}" if u.align > 1 else ""
        lines.append(f"tensor {u.name} [flat({keys}){align} pad dp over dp] {u.dtype}")
    text = "\n".join(lines) + "\n"
    _check(text, name, units, ranks.index(rank))
    return text


def tensors(model) -> dict:
    """This rank's local shard of every unit's flat parameter, by NAME: the live storage, not a copy."""
    units, _ = _units(model)
    out = {}
    for u in units:
        out[u.name] = _local_shard(u)
    return out


def _flat_keys(model, units: list[Unit]) -> dict[str, list[tuple[list[str], str]]]:
    """Each parameter's flat key, by its key: for a transformers model of a family `layoutc new`
    knows, its HF key and key dims (q/k rows as rotary halves), as the ZeRO-3 bridge and `layoutc
    new fsdp1` write them (`flat_layout.hf_flat_keys`); for any other module its shape, plain."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    module = model.module if isinstance(model, FSDP) else model
    # every=False: the parameters of ignored modules, or outside every unit, are not in a FlatParameter
    keys = hf_flat_keys(module, {key: shape for u in units for key, shape in u.keys}, error=BridgeError,
                        every=False)
    for key, found in keys.items():
        if len(found) != 1:
            raise BridgeError(f"parameter `{key}` holds {len(found)} checkpoint keys ({found[0][1]}, ...): a flat "
                              "key of a FlatParameter is one whole parameter",
                              help="describe this parameter by hand, or use a dense model")
    return keys


def _local_shard(u: Unit):
    fp = u.flat_param
    shard = getattr(fp, "_local_shard", None)
    shard = fp.data if shard is None else shard
    if fp.data.numel() != u.shard_numel or shard.numel() != u.shard_numel or fp.data.data_ptr() != shard.data_ptr():
        raise BridgeError(f"unit `{u.module_path or '<root>'}`: its flat parameter holds {fp.data.numel()} elements, "
                          f"not its shard of {u.shard_numel}: it is unsharded now",
                          help="call the bridge outside forward/backward and outside summon_full_params")
    if u.handle._use_orig_params:
        infos = fp._shard_param_infos
        base, size = shard.data_ptr(), shard.element_size()
        for (key, _), p, info in zip(u.keys, fp._params, infos):
            if info.in_shard and p.numel() and p.data_ptr() != base + info.offset_in_shard * size:
                raise BridgeError(f"parameter `{key}` is not a view of its unit's flat shard (it lies at "
                                  f"{p.data_ptr():#x}, the shard's elements {info.offset_in_shard}.. at "
                                  f"{base + info.offset_in_shard * size:#x})",
                                  help="a parameter replaced after wrapping (`param.data = ...`) is not what "
                                       "FSDP1 shards; write into it in place")
    return shard.detach()


def _units(model) -> tuple[list[Unit], tuple[list[int], int]]:
    """Every FSDP1 unit of `model` with parameters, in module order, and the sharding group's ranks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    units, group = [], None
    fsdp = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDP)]
    if not fsdp:
        raise BridgeError(f"{type(model).__name__} holds no FullyShardedDataParallel unit",
                          help="wrap the model with torch.distributed.fsdp.FullyShardedDataParallel first, or "
                               "describe an FSDP2 (`fully_shard`) model with layoutlang.bridges.dtensor")
    transformers = _is_transformers(model)
    for path, m in fsdp:
        handle = m._handle
        if handle is None:
            continue  # a unit whose parameters all belong to nested units
        where = f"unit `{path or '<root>'}`"
        strategy = handle._sharding_strategy
        if strategy not in (HandleShardingStrategy.FULL_SHARD, HandleShardingStrategy.SHARD_GRAD_OP):
            raise BridgeError(f"{where} uses {strategy.name}: only FULL_SHARD and SHARD_GRAD_OP are described",
                              help="NO_SHARD keeps whole parameters (describe the module whole) and the hybrid "
                                   "strategies replicate shards over a second group, which this bridge does "
                                   "not read yet")
        ranks = dist.get_process_group_ranks(m.process_group)
        if group is None:
            group = ranks
        elif ranks != group:
            raise BridgeError(f"{where} shards over ranks {ranks}, another unit over {group}",
                              help="describe the units of each process group with their own layout")
        fp = handle.flat_param
        dtype = TORCH_DTYPES.get(str(fp.dtype).removeprefix("torch."))
        if dtype is None:
            raise BridgeError(f"{where}: its flat parameter is {fp.dtype}, which no layout flat dim holds",
                              help="a flat dim holds bf16, fp16 or fp32")
        for fqn, p in zip(fp._fqns, fp._params or ()):
            if p.dtype != fp.dtype:
                raise BridgeError(f"parameter `{key_of(_join(path, fqn))}` is {p.dtype} in a FlatParameter of "
                                  f"{fp.dtype}: a flat dim holds one dtype",
                                  help="give every parameter of the unit one dtype, or wrap it as a unit of its own")
        prefix = key_of(path + ".") if path else ""
        keys = tuple((key_of(prefix + fqn), tuple(int(n) for n in shape)) for fqn, shape in zip(fp._fqns, fp._shapes))
        if transformers:
            for key, shape in keys:
                if ".experts." in key and len(shape) == 3:
                    raise BridgeError(f"parameter `{key}` {list(shape)} stacks experts, and its HF checkpoint "
                                      "names are per expert: a flat key is one whole tensor",
                                      help="describe the stacked experts by hand, or use a dense model")
        align = max(int(getattr(handle, "_aligned_numel", 0) or 0), 1)
        _check_offsets(where, keys, fp, align, len(ranks))
        name = _join(path, f"{WRAPPED}.{FLAT_PARAM}")
        units.append(Unit(name, path, keys, align, fp._sharded_size.numel(), dtype, handle))
    if not units:
        raise BridgeError(f"{type(model).__name__}'s FSDP units hold no parameters")
    return units, (group, dist.get_rank())


def _check_offsets(where: str, keys, fp, align: int, world: int) -> None:
    """The flat offsets torch chose are the uniform rule's (`align A`: each key starts at the end
    of the previous one rounded up to a multiple of A), and what follows the last key is `pad dp`:
    up to the next multiple of the world size (with alignment, torch records that padding in
    `_numels_with_padding`; without, it pads each rank's piece when it shards)."""
    torch_offsets, at = [], 0
    for numel, pad in zip(fp._numels_with_padding, fp._is_padding_mask):
        if not pad:
            torch_offsets.append(at)
        at += numel
    if at != fp._unpadded_unsharded_size.numel():
        raise BridgeError(f"{where}: its parameters and alignment padding hold {at} elements, the flat parameter "
                          f"{fp._unpadded_unsharded_size.numel()}")
    rule, at = [], 0
    for _, shape in keys:
        at = -(-at // align) * align
        rule.append(at)
        n = 1
        for e in shape:
            n *= e
        at += n
    for (key, _), got, want in zip(keys, torch_offsets, rule):
        if got != want:
            raise BridgeError(f"parameter `{key}` starts at flat element {got} of its unit's FlatParameter; the "
                              f"uniform rule `align {align}` places it at {want}",
                              help="FSDP1 padded this unit irregularly: describe it by hand (a flat dim per run "
                                   "of regularly placed parameters)")
    padded = fp._sharded_size.numel() * world
    if padded != -(-at // world) * world:
        raise BridgeError(f"{where}: its parameters end at flat element {at}, and its {world} shards hold "
                          f"{padded}: not `pad dp` (the next multiple of {world})")


def _check(text: str, name: str, units: list[Unit], coordinate: int) -> None:
    """Each local element the layout places on this rank is the one `_shard_param_infos` records."""
    from layoutlang import loads

    from .dtensor import dim_elements

    layout = loads(text, f"<describe {name}>")
    by_name = {t.name: t for t in layout.tensors}
    for u in units:
        t = by_name[u.name]
        dim = t.dims[0]
        flat = dim.mode.inner if isinstance(dim.mode, PadM) else dim.mode
        got = dim_elements(dim.runs_at(coordinate, 0))
        want: list[int | None] = [None] * u.shard_numel
        logical = 0
        for (key, shape), key_mode, info in zip(u.keys, flat.keys, u.flat_param._shard_param_infos):
            n = 1
            for e in shape:
                n *= e
            if info.in_shard:
                order = _logical_index(key_mode)
                for j in range(info.numel_in_shard):
                    want[info.offset_in_shard + j] = logical + order(info.intra_param_start_idx + j)
            logical += n
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise BridgeError(f"unit `{u.module_path or '<root>'}`: the layout places logical element "
                              f"{got[first] if first < len(got) else None} at local element {first} of its shard, "
                              f"torch's _shard_param_infos {want[first] if first < len(want) else None}")


def _logical_index(key_mode):
    """Element j of a parameter as torch flattens it (row-major in memory: the flat key's storage
    order) -> the key's logical row-major index: itself, unless a key dim is written with parts
    (rotary halves: each head's re rows, then its im rows, are logically all re rows first)."""
    from .dtensor import dim_elements

    if key_mode.identity:
        return lambda j: j
    tables = [dim_elements(runs) for runs in key_mode.dim_runs]  # per dim: stored index -> logical

    def index(j: int) -> int:
        out = 0
        for table, stride in reversed(list(zip(tables, key_mode.strides))):
            j, i = divmod(j, len(table))
            out += table[i] * stride
        return out
    return index


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_transformers(model) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__) or any(
        type(m).__module__.startswith("transformers.") for m in model.children())
