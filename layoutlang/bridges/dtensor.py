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
- `_StridedShard(d, sf=S)` alone on a dim (TP's packed colwise: HF's
  `gate_up_proj`, gate and up each split over tp): `(gate: I | up: I) over tp`,
  torch's cut exactly when the dim is S equal parts that each split evenly (a
  plain dim is written as S unnamed parts; a form's parts are checked against
  torch's cut, coordinate by coordinate, before the text is returned);
- `Replicate()` (and a mesh dim the parameter's submesh lacks): a replica axis;
- a plain parameter that the caller names in `replicated=` (a framework that
  placed it says every rank holds it whole and equal: HF's `tp_plan` norms and
  routers): uncut, a replica over every axis;
- a flattened mesh dim (`root["dp_shard", "cp"]._flatten("dp_shard_cp")`) is the
  run of axes it enumerates, first one major: `over (dp_shard, cp) ragged`; the
  dims of meshes unflattened from one world (`_unflatten`: torchtitan's dense and
  expert meshes) are the axes their strides cut. Both are read from the ranks
  along each dim, never from names.

Anything else (`Partial`, three cuts of one dim, non-consecutive ranks, any
other plain tensor among DTensors, `chunk` over a dim that is several axes,
meshes whose strides do not nest, a packed cut that is not S equal parts split
evenly or that shares its dim with another cut) is a `BridgeError` naming the
parameter and the placement. torch.distributed.tensor is imported inside the
calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

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
             mesh_name: str | None = None, replicated: Collection[str] = ()) -> str:
    """The `.layout` text of `module`'s DTensor parameters (identical on every rank).

    `keys` maps a parameter name to its key (default: the name without wrapper
    prefixes); `forms(name, param)` may return a `Form` for parameters that hold
    several keys (a bridge for a framework supplies it: fused or stacked experts).
    `replicated` names the plain (non-DTensor) parameters that every rank holds
    whole and equal: a DTensor does not record that, the framework that placed
    them does (a HF `tp_plan` loads every parameter it does not shard whole on
    every rank). They are written uncut: a replica over every axis of the mesh.
    """
    params = list(module.named_parameters())
    if not params:
        raise BridgeError("the module has no parameters")
    return layout_text(params, keys=keys, forms=forms, name=name, mesh_name=mesh_name, replicated=replicated)


def tensors(module, *, replicated: Collection[str] = ()) -> dict[str, object]:
    """This rank's local storage of every parameter, by name: views, not copies.

    Writing into them (a refit's destination) writes the module's parameters.
    The plain parameters named in `replicated` (see `describe`) are the tensors
    themselves, detached.
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            if name in replicated:
                out[name] = p.detach()
                continue
            raise BridgeError(f"parameter `{name}` is a plain tensor, not a DTensor",
                              help="shard it (fully_shard / parallelize_module) or describe the module "
                                   "with the bridge of its framework")
        out[name] = p._local_tensor if p._local_tensor is not None else p.to_local()
    return out


def layout_text(params: Iterable[tuple[str, object]], *, keys=None, forms=None, name: str,
                mesh_name: str | None, replicated: Collection[str] = ()) -> str:
    from torch.distributed.tensor import DTensor

    root = None
    params = list(params)
    for pname, p in params:
        if not isinstance(p, DTensor):
            if pname in replicated:
                continue
            raise BridgeError(f"parameter `{pname}` is a plain tensor among DTensors: which ranks hold it, "
                              "and whether they agree, is not recorded",
                              help="shard every parameter (FSDP2 shards all of a module's parameters), pass "
                                   "it in `replicated=` if every rank holds it whole and equal, or describe "
                                   "this one by hand")
        mesh = p.device_mesh
        this_root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        if root is None:
            root = this_root
        elif not _same_mesh(root, this_root):
            raise BridgeError(f"parameter `{pname}` lives on another device mesh "
                              f"({_mesh_text(this_root)}) than the first parameter ({_mesh_text(root)})",
                              help="describe each mesh's parameters with their own `describe` call")
    if root is None:
        raise BridgeError(f"none of the module's {len(params)} parameters is a DTensor: there is no device mesh "
                          "to describe", help="describe a module held whole with the bridge of its framework")
    offset = _offset(root)
    axes = MeshAxes(root)
    sharded = [(pname, p) for pname, p in params if isinstance(p, DTensor)]
    for pname, p in sharded:
        axes.add(pname, p.device_mesh)
    axes.finish()
    statements = [_statement(pname, p, axes, keys, forms) for pname, p in params]
    names = [a for a, _ in axes.atoms]
    mesh_line = (f"mesh {mesh_name or '_'.join(names)} ("
                 + ", ".join(f"{a}={s}" for a, s in axes.atoms) + ")")
    if offset:
        mesh_line += f" at {offset}"
    header = [f"# Described by layoutlang.bridges.dtensor from the live module's DTensor placements.",
              f"layout {name}", "", mesh_line, ""]
    text = "\n".join(header + [st.text for st in statements]) + "\n"
    packed = [dim for st in statements for dim in st.packed]
    if packed:
        _check_packed(text, name, packed)
    return text


@dataclass(frozen=True)
class _Cut:
    """One mesh dim's cut of one tensor dim.

    `order` sorts the cuts of a dim (the first cuts the whole dim, the next each
    of its blocks); `axes` are the layout axes the mesh dim enumerates, `size` its
    ranks. `packed` is the split factor of a `_StridedShard` that cuts the dim
    alone (TP's packed colwise, HF's `gate_up_proj`): the dim is `packed` equal
    groups and each rank holds its block of every group, in group order; 1 for
    every other cut.
    """

    order: int
    axes: tuple[str, ...]
    size: int
    packed: int = 1


@dataclass(frozen=True)
class _PackedDim:
    """A dim of `param` that `cut` (packed) cuts and whose parts a form wrote: `_check_packed` checks it."""

    param: str
    dim: int
    cut: _Cut


@dataclass(frozen=True)
class _Statement:
    """One parameter's `tensor` line, and its packed dims that the whole text must confirm."""

    text: str
    packed: tuple[_PackedDim, ...]


def _cuts(pname: str, p, axes: "MeshAxes") -> dict[int, list[_Cut]]:
    """Tensor dim -> its cuts, from the placements (none for a plain, replicated parameter)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(p, DTensor):
        return {}
    sub = p.device_mesh
    sub_names = _axis_names(sub)
    cuts: dict[int, list[_Cut]] = {}
    for i, (name, placement) in enumerate(zip(sub_names, p.placements)):
        axis, size = axes.of(sub, i), sub.mesh.shape[i]
        if not axis and isinstance(placement, (Shard, _StridedShard)):
            continue  # a mesh dim of one rank (not a root dim): its one block is the whole dim
        if isinstance(placement, _StridedShard):
            sf = placement.split_factor
            later = [j for j in range(i + 1, len(p.placements))
                     if isinstance(p.placements[j], Shard) and not isinstance(p.placements[j], _StridedShard)
                     and p.placements[j].dim == placement.dim]
            if not later:  # alone: torch.chunk into sf x size pieces, rank c takes pieces c, c + size, ...
                cuts.setdefault(placement.dim, []).append(_Cut(i * 2, axis, size, packed=sf))
                continue
            if len(later) != 1 or sub.mesh.shape[later[0]] != sf:
                raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` is neither "
                                  "the FSDP-over-TP pattern (a later Shard of the same dim, of size sf) nor a "
                                  "packed cut (no later Shard of that dim)",
                                  help="`_StridedShard(d, sf=S)` followed by `Shard(d)` on a mesh dim of size "
                                       "S, or `_StridedShard(d, sf=S)` alone, can be expressed")
            cuts.setdefault(placement.dim, []).append(_Cut(1, axis, size))  # cuts after the later Shard
        elif isinstance(placement, Shard):
            strided_before = any(isinstance(q, _StridedShard) and q.dim == placement.dim
                                 for q in p.placements[:i])
            cuts.setdefault(placement.dim, []).append(_Cut(0 if strided_before else i * 2, axis, size))
        elif isinstance(placement, Replicate):
            continue
        elif isinstance(placement, Partial):
            raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` holds partial "
                              "sums, not a cut of the weight", help="reduce it (redistribute to Replicate) first")
        else:
            raise BridgeError(f"parameter `{pname}`: placement {placement!r} on mesh dim `{name}` is not known "
                              "to the bridge")
    return cuts


def _statement(pname: str, p, axes: "MeshAxes", keys, forms) -> _Statement:
    """The `tensor` line of parameter `pname`: its key or form, each dim's mode and cuts, its dtype."""
    cuts = _cuts(pname, p, axes)
    form = forms(pname, p) if forms is not None else None
    shape = tuple(p.shape)
    if form is not None and len(form.dims) != len(shape):
        raise BridgeError(f"parameter `{pname}`: its form has {len(form.dims)} dims, the parameter {len(shape)}")
    dims, packed = [], []
    for d, extent in enumerate(shape):
        mode = form.dims[d] if form is not None else str(extent)
        plain = form is None or mode.strip().isdigit()
        dim_cuts = sorted(cuts.get(d, []), key=lambda c: c.order)
        if any(c.packed > 1 for c in dim_cuts):
            dims.append(_packed_dim(pname, d, extent, mode, plain, dim_cuts))
            if not plain:
                packed.append(_PackedDim(pname, d, dim_cuts[0]))
            continue
        cut_axes = [c.axes for c in dim_cuts]
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
    return _Statement(f"tensor {pname}{clause} [{', '.join(dims)}] {dtype}{tail}", tuple(packed))


def _packed_dim(pname: str, d: int, extent: int, mode: str, plain: bool, dim_cuts: list[_Cut]) -> str:
    """A dim that a `_StridedShard` cuts alone: `(g1 | g2 | ...) over AXIS`, each group split evenly.

    LANGUAGE.md 3 splits each part of a concatenation over the axis, which is
    torch's cut exactly when the dim is `sf` equal groups that each split evenly:
    `extent % (sf * size) == 0`. A plain dim is written as `sf` unnamed parts; a
    form's own concatenation (`(gate: I as .. | up: I as ..)`) is kept and
    checked against torch's cut once the text is whole (`_check_packed`).
    """
    cut = dim_cuts[0]
    what = f"parameter `{pname}`: dim {d} (extent {extent}) is cut by _StridedShard(dim={d}, sf={cut.packed})"
    if len(dim_cuts) > 1:
        raise BridgeError(f"{what} and by {len(dim_cuts) - 1} more mesh dim(s); a packed cut is expressible "
                          "only alone", help="the FSDP-over-TP pattern is `_StridedShard(d, sf=S)` on the earlier "
                                             "mesh dim, then `Shard(d)` on a later one of size S")
    if extent % (cut.packed * cut.size):
        raise BridgeError(f"{what} over {cut.size} ranks: {extent} is not a multiple of {cut.packed} x "
                          f"{cut.size}, so torch's pieces straddle the {cut.packed} packed parts, which no "
                          "layout says", help=f"give dim {d} an extent that is a multiple of "
                                              f"{cut.packed * cut.size} (each packed part then splits evenly)")
    if plain:
        mode = "(" + " | ".join([str(extent // cut.packed)] * cut.packed) + ")"
    return f"{mode} over {_axes_text(cut.axes)}"


def _check_packed(text: str, name: str, packed: list[_PackedDim]) -> None:
    """Every form-given packed dim stores, on every coordinate, the elements torch's cut gives it.

    torch's `_StridedShard(d, sf)` alone over n ranks: torch.chunk the dim's
    global storage into sf x n pieces; coordinate c holds pieces c, c + n, ...,
    in that order. The layout's own runs (the elaborated text) must give each
    coordinate the same logical elements in the same order.
    """
    from layoutlang import loads
    from layoutlang.modes import runs

    layout = loads(text, f"<describe {name}>")
    by_name = {t.name: t for t in layout.tensors}
    for one in packed:
        pname, d, cut = one.param, one.dim, one.cut
        dim = by_name[pname].dims[d]
        extent, pieces = dim.mode.stored, cut.packed * cut.size
        whole = dim_elements(runs(dim.mode, [(0, extent)], 0))  # global storage index -> logical index
        block = extent // pieces
        for c in range(cut.size):
            want = [whole[i] for k in range(c, pieces, cut.size) for i in range(k * block, (k + 1) * block)]
            if dim_elements(dim.runs_at(c, 0)) != want:
                raise BridgeError(f"parameter `{pname}`: dim {d} is cut by _StridedShard(dim={d}, "
                                  f"sf={cut.packed}) over {cut.size} ranks, but the parts its form gives the dim "
                                  f"do not line up with torch's pieces: split over `{_axes_text(cut.axes)}`, "
                                  f"coordinate {c} would hold other elements than torch gives it",
                                  help=f"the dim must be {cut.packed} equal parts that each split evenly "
                                       "(rank c holds block c of every part, in part order)")


def dim_elements(dim_runs) -> list[int | None]:
    """Per local element, in storage order, its logical index (None: padding)."""
    from layoutlang.modes import Run

    out: list[int | None] = []
    for r in dim_runs:
        out.extend(range(r.logical_start, r.logical_start + r.length) if isinstance(r, Run)
                   else [None] * r.length)
    return out


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
