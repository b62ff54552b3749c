"""The DTensor bridge: the `.layout` of any module whose parameters are DTensors.

FSDP2 (`fully_shard`), `parallelize_module` and torchtitan keep every parameter
as a DTensor: a global shape, a DeviceMesh and one placement per mesh dim. That
is all a layout needs, so `describe` reads it and writes the text:

- the mesh is the DeviceMesh's root mesh (submeshes name some of its dims); its
  ranks must be consecutive, row-major (`mesh NAME (a=.., b=..) at OFFSET`);
- `Shard(d)` on one mesh dim cuts tensor dim d like torch.chunk: `over AXIS
  ragged` on a plain extent, `chunk AXIS ragged` on a fused one (DTensor cuts
  the stored rows, not each part: LANGUAGE.md 8.5);
- `Shard(d)` on two mesh dims (the second cuts what the first left), and
  FSDP2-over-TP's `_StridedShard(d, sf=S)` + `Shard(d)` (the later mesh dim
  cuts first, then the earlier one cuts each block): `over A ragged chunk B
  ragged`;
- `Replicate()` (and a mesh dim the parameter's submesh lacks): a replica axis;
- a flattened mesh dim (`mesh["dp_shard", "cp"]._flatten("dp_shard_cp")`, as
  torchtitan shards with FSDP2, also over one root dim when CP is off) is the
  root dims it enumerates, first one major: `over (dp_shard, cp) ragged`. It is
  read from the ranks themselves (which root coordinates vary along the dim, and
  in which order), not from its name.

Anything else (`Partial`, three cuts of one dim, non-consecutive ranks, a
plain tensor among DTensors, `chunk` over a flattened dim of several root dims,
a mesh dim that is only part of a root dim) is a `BridgeError` naming the
parameter and the placement. torch.distributed.tensor is imported inside the calls.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from .families import BridgeError  # the bridges' one error type

# Wrapper prefixes that torch inserts in parameter names; a key never has them.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Form:
    """How a parameter's key(s) are written, when not one plain tensor per key.

    `key`: the `as KEY` clause (None: no clause; the NAME is the key, or the
    dims carry part keys). `dims`: the text of each dim's MODE (`e in 0..8`,
    `(gate: 4 as K1 | up: 4 as K2)`), in tensor-dim order; the bridge appends
    each dim's `over`/`chunk`. `transposed`: the `transposed` clause.
    """

    key: str | None
    dims: tuple[str, ...]
    transposed: bool = False


def key_of(name: str) -> str:
    """The key of a parameter named `name`: the name without torch's wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def describe(module, *, keys: Mapping[str, str] | Callable[[str], str] | None = None,
             forms: Callable[[str, object], Form | None] | None = None, name: str = "dtensor_model",
             mesh_name: str | None = None) -> str:
    """The `.layout` text of `module`'s DTensor parameters (identical on every rank).

    `keys` maps a parameter name to its key (default: the name without wrapper
    prefixes); `forms(name, param)` may return a `Form` for parameters that hold
    several keys (a bridge for a framework supplies it: fused or stacked experts).
    """
    params = list(module.named_parameters())
    if not params:
        raise BridgeError("the module has no parameters")
    return layout_text(params, keys=keys, forms=forms, name=name, mesh_name=mesh_name)


def tensors(module) -> dict[str, object]:
    """This rank's local storage of every parameter, by name: views, not copies.

    Writing into them (a refit's destination) writes the module's parameters.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            raise BridgeError(f"parameter `{name}` is a plain tensor, not a DTensor",
                              help="shard it (fully_shard / parallelize_module) or describe the module "
                                   "with the bridge of its framework")
        out[name] = p._local_tensor if p._local_tensor is not None else p.to_local()
    return out


def layout_text(params: Iterable[tuple[str, object]], *, keys=None, forms=None, name: str,
                mesh_name: str | None) -> str:
    from torch.distributed.tensor import DTensor

    root = None
    lines: list[str] = []
    spans: dict = {}  # (id of a mesh, dim) -> the root dims it enumerates, for this call
    for pname, p in params:
        if not isinstance(p, DTensor):
            raise BridgeError(f"parameter `{pname}` is a plain tensor among DTensors: which ranks hold it, "
                              "and whether they agree, is not recorded",
                              help="shard every parameter (FSDP2 shards all of a module's parameters), or "
                                   "describe this one by hand")
        mesh = p.device_mesh
        this_root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if root is None:
            root = this_root
        elif not _same_mesh(root, this_root):
            raise BridgeError(f"parameter `{pname}` lives on another device mesh "
                              f"({_mesh_text(this_root)}) than the first parameter ({_mesh_text(root)})",
                              help="describe each mesh's parameters with their own `describe` call")
        lines.append(_tensor_line(pname, p, root, keys, forms, spans))
    axes = _axis_names(root)
    sizes = tuple(root.mesh.shape)
    offset = _offset(root)
    mesh_line = f"mesh {mesh_name or '_'.join(axes)} (" + ", ".join(f"{a}={s}" for a, s in zip(axes, sizes)) + ")"
    if offset:
        mesh_line += f" at {offset}"
    header = [f"# Described by layoutlang.bridges.dtensor from the live module's DTensor placements.",
              f"layout {name}", "", mesh_line, ""]
    return "\n".join(header + lines) + "\n"


def _tensor_line(pname: str, p, root, keys, forms, spans: dict) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    sub = p.device_mesh
    sub_names = _axis_names(sub)
    cuts: dict[int, list[tuple[int, tuple[str, ...]]]] = {}  # tensor dim -> [(order, root axes)], in order
    for i, (name, placement) in enumerate(zip(sub_names, p.placements)):
        if (id(sub), i) not in spans:
            spans[(id(sub), i)] = _root_axes(pname, sub, i, name, root)
        axis = spans[(id(sub), i)]
        if not axis and isinstance(placement, Shard):
            continue  # a flattened dim of one rank: its one block is the whole dim
        if isinstance(placement, _StridedShard):
            sf = placement.split_factor
            later = [j for j in range(i + 1, len(p.placements))
                     if isinstance(p.placements[j], Shard) and not isinstance(p.placements[j], _StridedShard)
                     and p.placements[j].dim == placement.dim]
            if len(later) != 1 or sub.mesh.shape[later[0]] != sf:
                raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` is not the "
                                  "FSDP-over-TP pattern (a later Shard of the same dim, of size sf)",
                                  help="only `_StridedShard(d, sf=S)` followed by `Shard(d)` on a mesh dim of "
                                       "size S can be expressed")
            cuts.setdefault(placement.dim, []).append((1, axis))  # cuts after the later Shard
        elif isinstance(placement, Shard):
            strided_before = any(isinstance(q, _StridedShard) and q.dim == placement.dim
                                 for q in p.placements[:i])
            cuts.setdefault(placement.dim, []).append((0 if strided_before else i * 2, axis))
        elif isinstance(placement, Replicate):
            continue
        elif isinstance(placement, Partial):
            raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` holds partial "
                              "sums, not a cut of the weight", help="reduce it (redistribute to Replicate) first")
        else:
            raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` is not known "
                              "to the bridge")
    form = forms(pname, p) if forms is not None else None
    shape = tuple(p.shape)
    if form is not None and len(form.dims) != len(shape):
        raise BridgeError(f"parameter `{pname}`: its form has {len(form.dims)} dims, the parameter {len(shape)}")
    dims = []
    for d, extent in enumerate(shape):
        mode = form.dims[d] if form is not None else str(extent)
        plain = form is None or mode.strip().isdigit()
        cut_axes = [axes for _, axes in sorted(cuts.get(d, []))]
        order = [_axes_text(axes) for axes in cut_axes]
        chunked = cut_axes[-1] if cut_axes and (len(cut_axes) == 2 or not plain) else ()  # `chunk`'s axes
        if len(order) > 2:
            raise BridgeError(f"parameter `{pname}`: dim {d} is cut over {len(order)} mesh dims "
                              f"({', '.join(order)}); a layout expresses at most two")
        if len(chunked) > 1:
            raise BridgeError(f"parameter `{pname}`: dim {d} would be `chunk {order[-1]}`, and `chunk` takes one "
                              "mesh axis (LANGUAGE.md 3): the flattened mesh dim enumerates several root dims",
                              help="FSDP2 over TP on a flattened dim of several root dims (CP > 1) is not "
                                   "expressible yet; shard over one root dim, or describe this tensor by hand")
        if len(order) == 1:
            mode += f" over {order[0]} ragged" if plain else f" chunk {order[0]} ragged"
        elif len(order) == 2:
            if not plain:
                raise BridgeError(f"parameter `{pname}`: dim {d} holds several keys and is cut twice "
                                  f"({', '.join(order)}); not expressible yet")
            mode += f" over {order[0]} ragged chunk {order[1]} ragged"
        dims.append(mode)
    dtype = TORCH_DTYPES.get(str(p.dtype).removeprefix("torch."))
    if dtype is None:
        raise BridgeError(f"parameter `{pname}`: dtype {p.dtype} has no layout dtype",
                          help="layout dtypes: " + ", ".join(TORCH_DTYPES.values()))
    if form is not None:
        key = form.key
    else:
        key = keys(pname) if callable(keys) else (keys or {}).get(pname, key_of(pname))
    clause = f" as {key}" if key is not None and key != pname else ""
    tail = " transposed" if form is not None and form.transposed else ""
    return f"tensor {pname}{clause} [{', '.join(dims)}] {dtype}{tail}"


def _root_axes(pname: str, sub, i: int, name: str, root) -> tuple[str, ...]:
    """The root mesh dims that dim `i` of `sub` enumerates, first one major: a root dim is
    itself, a flattened dim the root dims whose coordinates vary along it (row-major in root
    order, as `_flatten` lays them out), a flattened dim of one rank (). Read from this rank's
    group of ranks along the dim, so a flattened dim's name (`dp_shard_cp`) says nothing here."""
    names = _axis_names(root)
    if sub is root or _same_mesh(sub, root):
        return (names[i],)
    coordinate = sub.get_coordinate()
    index = tuple(slice(None) if d == i else c for d, c in enumerate(coordinate))
    group = sub.mesh[index].flatten().tolist()  # the ranks along dim i through this rank
    shape = tuple(root.mesh.shape)
    where = dict(zip(root.mesh.flatten().tolist(), itertools.product(*map(range, shape))))
    coords = [where[r] for r in group if r in where]
    varying = [d for d in range(len(shape)) if len({c[d] for c in coords}) > 1]
    row_major = list(itertools.product(*(range(shape[d]) for d in varying)))
    if len(coords) != len(group) or [tuple(c[d] for d in varying) for c in coords] != row_major:
        raise BridgeError(f"parameter `{pname}`: mesh dim `{name}` ({len(group)} ranks) is not a row-major "
                          f"enumeration of whole dims of the root mesh ({_mesh_text(root)})",
                          help="a layout axis is a root mesh dim or a flattened run of them; a mesh dim "
                               "that splits a root dim is not expressible yet")
    if not varying and name in names and root.mesh.shape[names.index(name)] == 1:
        return (name,)  # a root dim of one rank, sliced: itself (its cut is the whole dim)
    return tuple(names[d] for d in varying)


def _axes_text(axes: tuple[str, ...]) -> str:
    return axes[0] if len(axes) == 1 else f"({', '.join(axes)})"


def _axis_names(mesh) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    if names is None:
        return tuple(f"d{i}" for i in range(mesh.mesh.dim()))
    return tuple(names)


def _offset(mesh) -> int:
    flat = mesh.mesh.flatten().tolist()
    start = flat[0]
    if flat != list(range(start, start + len(flat))):
        raise BridgeError(f"device mesh {_mesh_text(mesh)} does not hold consecutive ranks in row-major "
                          "order", help="a layout mesh covers ranks OFFSET .. OFFSET+size-1, last axis fastest")
    return start


def _same_mesh(a, b) -> bool:
    return a is b or (a.mesh.tolist() == b.mesh.tolist() and a.mesh_dim_names == b.mesh_dim_names)


def _mesh_text(mesh) -> str:
    return f"{list(_axis_names(mesh))} ranks {mesh.mesh.tolist()}"
