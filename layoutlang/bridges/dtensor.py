"""The DTensor bridge: the `.layout` of any module whose parameters are DTensors.

FSDP2 (`fully_shard`), `parallelize_module` and torchtitan keep every parameter
as a DTensor: a global shape, a DeviceMesh and one placement per mesh dim. That
is all a layout needs, so `describe` reads it and writes the text:

- the mesh covers the DeviceMesh's root mesh, whose ranks must be consecutive,
  row-major (`mesh NAME (a=.., b=..) at OFFSET`); its axes are the digits of the
  rank index that the parameters' mesh dims cut (`MeshAxes`): the root's dims
  where every parameter lives on them or on slices of them;
- `Shard(d)` on one mesh dim cuts tensor dim d like torch.chunk: `over AXIS
  ragged` on a plain extent, `chunk AXIS ragged` on a fused one (DTensor cuts
  the stored rows, not each part: LANGUAGE.md 8.5);
- `Shard(d)` on two mesh dims (the second cuts what the first left), and
  FSDP2-over-TP's `_StridedShard(d, sf=S)` + `Shard(d)` (the later mesh dim
  cuts first, then the earlier one cuts each block): `over A ragged chunk B
  ragged`;
- `Replicate()` (and a mesh dim the parameter's submesh lacks): a replica axis;
- a flattened mesh dim (`root["dp_shard", "cp"]._flatten("dp_shard_cp")`) is the
  run of axes it enumerates, first one major: `over (dp_shard, cp) ragged`; the
  dims of meshes unflattened from one world (`_unflatten`: torchtitan's dense and
  expert meshes) are the axes their strides cut. Both are read from the ranks
  along each dim, never from names.

Anything else (`Partial`, three cuts of one dim, non-consecutive ranks, a
plain tensor among DTensors, `chunk` over a dim that is several axes, meshes
whose strides do not nest) is a `BridgeError` naming the parameter and the
placement. torch.distributed.tensor is imported inside the calls.
"""

from __future__ import annotations

import math
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
    params = list(params)
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
    offset = _offset(root)
    axes = MeshAxes(root)
    for pname, p in params:
        axes.add(pname, p.device_mesh)
    axes.finish()
    lines = [_tensor_line(pname, p, axes, keys, forms) for pname, p in params]
    names = [a for a, _ in axes.atoms]
    mesh_line = (f"mesh {mesh_name or '_'.join(names)} ("
                 + ", ".join(f"{a}={s}" for a, s in axes.atoms) + ")")
    if offset:
        mesh_line += f" at {offset}"
    header = [f"# Described by layoutlang.bridges.dtensor from the live module's DTensor placements.",
              f"layout {name}", "", mesh_line, ""]
    return "\n".join(header + lines) + "\n"


def _tensor_line(pname: str, p, axes: "MeshAxes", keys, forms) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    sub = p.device_mesh
    sub_names = _axis_names(sub)
    cuts: dict[int, list[tuple[int, tuple[str, ...]]]] = {}  # tensor dim -> [(order, mesh axes)], in order
    for i, (name, placement) in enumerate(zip(sub_names, p.placements)):
        axis = axes.of(sub, i)
        if not axis and isinstance(placement, Shard):
            continue  # a mesh dim of one rank (not a root dim): its one block is the whole dim
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
        cut_axes = [run for _, run in sorted(cuts.get(d, []))]
        order = [_axes_text(run) for run in cut_axes]
        chunked = cut_axes[-1] if cut_axes and (len(cut_axes) == 2 or not plain) else ()  # `chunk`'s axes
        if len(order) > 2:
            raise BridgeError(f"parameter `{pname}`: dim {d} is cut over {len(order)} mesh dims "
                              f"({', '.join(order)}); a layout expresses at most two")
        if len(chunked) > 1:
            raise BridgeError(f"parameter `{pname}`: dim {d} would be `chunk {order[-1]}`, and `chunk` takes one "
                              "mesh axis (LANGUAGE.md 3): the mesh dim enumerates several axes of the mesh",
                              help="FSDP2 over TP on a mesh dim that is several axes (a flattened run, or a "
                                   "dim that another parameter's mesh splits) is not expressible yet")
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


class MeshAxes:
    """The axes of the layout's one mesh, from every parameter's DeviceMesh over one root.

    A mesh dim steps through ranks with one or more (size, stride) modes: a root dim is one
    mode, a flattened dim (`_flatten`) several, a dim of an unflattened mesh (`_unflatten`,
    torchtitan's staggered dense and expert meshes over a 1-D world) part of a root dim. The
    layout's axes are the finest common cut of all of them: every mode's strides `t` and
    `t * size` cut the rank index into digits, and each digit is an axis; a mesh dim is then
    the run of axes its modes cover, first one major (`over (a, b)`). An axis takes the name of
    the dim that is exactly it (root dims first), else `DIM_k` (the k-th axis of the first dim
    holding it). The modes are read from the ranks along each dim, never from names.
    """

    def __init__(self, root):
        self.root, self.size = root, root.mesh.numel()
        self.dims: dict = {}  # (id(mesh), dim) -> (name, modes major first)
        self.meshes: dict = {}  # id -> mesh: held, so that an id stays its mesh's
        shape, names = tuple(root.mesh.shape), _axis_names(root)
        self.root_dims = [(names[j], [(shape[j], math.prod(shape[j + 1:]))] if shape[j] > 1 else [])
                          for j in range(len(shape))]
        self.atoms: list[tuple[str, int]] = []  # (name, size), major first
        self._of: dict = {}

    def add(self, pname: str, mesh) -> None:
        if id(mesh) in self.meshes:
            return
        self.meshes[id(mesh)] = mesh
        names, coordinate = _axis_names(mesh), mesh.get_coordinate()
        for i in range(mesh.mesh.dim()):
            index = tuple(slice(None) if d == i else c for d, c in enumerate(coordinate))
            group = mesh.mesh[index].flatten().tolist()  # the ranks along dim i through this rank
            modes = _modes(group)
            if modes is None:
                raise BridgeError(f"parameter `{pname}`: mesh dim `{names[i]}` steps through ranks {group}, "
                                  "not in (size, stride) runs of the rank index",
                                  help="a layout axis is a digit of the rank index: a mesh dim must step "
                                       "through ranks at fixed strides")
            self.dims[(id(mesh), i)] = (names[i], modes)

    def finish(self) -> None:
        modes = [m for _, ms in self.root_dims for m in ms] + [m for _, ms in self.dims.values() for m in ms]
        cuts = sorted({1, self.size} | {t for _, t in modes} | {t * s for s, t in modes})
        if any(b % a for a, b in zip(cuts, cuts[1:])):
            raise BridgeError(f"the parameters' device meshes cut the rank index at strides {cuts}, which do not "
                              "nest (each must divide the next): no one mesh holds them all",
                              help="describe the parameters of each mesh with their own `describe` call")
        digits = [(b // a, a) for a, b in zip(cuts, cuts[1:])][::-1]  # (size, stride), major first

        def covered(ms):
            return [k for s, t in ms for k, (_, stride) in enumerate(digits) if t <= stride < t * s]

        named: dict[int, str] = {}
        candidates = list(self.root_dims) + list(self.dims.values())
        for dim, ms in candidates:
            ks = covered(ms)
            if len(ks) == 1 and ks[0] not in named and dim not in named.values():
                named[ks[0]] = dim
        for dim, ms in list(self.dims.values()) + list(self.root_dims):
            for j, k in enumerate(covered(ms)):
                if k not in named:
                    base, n = f"{dim}_{j}", 0
                    while (base if not n else f"{base}_{n}") in named.values():
                        n += 1
                    named[k] = base if not n else f"{base}_{n}"
        atoms = [(named[k], s, t) for k, (s, t) in enumerate(digits)]
        # a root dim of one rank is an axis of its own (its cut is the whole dim), where the root has it
        for j, (dim, ms) in enumerate(self.root_dims):
            if not ms:
                stride = math.prod(tuple(self.root.mesh.shape)[j + 1:])
                at = next((k for k, (_, _, t) in enumerate(atoms) if t < stride), len(atoms))
                atoms.insert(at, (dim, 1, stride))
        self.atoms = [(a, s) for a, s, _ in atoms]
        for key, (dim, ms) in self.dims.items():
            axes = tuple(named[k] for k in covered(ms))
            if not axes and any(d == dim and not rms for d, rms in self.root_dims):
                axes = (dim,)
            self._of[key] = axes

    def of(self, mesh, i: int) -> tuple[str, ...]:
        """The axes that dim `i` of `mesh` enumerates, first one major (() for a dim of one rank)."""
        return self._of[(id(mesh), i)]


def _modes(group: list[int]) -> list[tuple[int, int]] | None:
    """The (size, stride) modes, major first, of ranks a mesh dim enumerates row-major (None if
    they are not a mixed-radix run: e.g. a stride that is not positive). Two modes that are
    contiguous (stride = the faster one's size x stride) read as one, which is the same cut."""
    d = [r - group[0] for r in group]
    modes = []
    while len(d) > 1:
        t, s = d[1], 2
        while s < len(d) and d[s] == s * t:
            s += 1
        if t <= 0 or len(d) % s:
            return None
        blocks = [d[k:k + s] for k in range(0, len(d), s)]
        if any(b != [b[0] + j * t for j in range(s)] for b in blocks):
            return None
        modes.append((s, t))
        d = [b[0] for b in blocks]
    return modes[::-1]


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
