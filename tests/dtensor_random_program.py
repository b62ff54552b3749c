"""One worker of tests/test_bridge_dtensor.py: the DTensor bridge on random meshes and placements.

Run on 8 gloo ranks by `launch({"seed": S, "cases": N}, 8, program=__file__)`. Every
rank draws the same N cases from the seed: a mesh (a root mesh of 8 ranks, a slice of
it, a flattened run of its dims, a slice concatenated with a flattened run, or an
unflattening of a 1-D world as torchtitan builds its meshes), a [rows, cols] fp32
tensor with extents 1..9 (so blocks are ragged and some ranks hold nothing), and per
mesh dim Shard(0), Shard(1) or Replicate(); in about 2 cases of 5 a second weight on
another mesh of the same root, so that one layout mesh must hold both. `distribute_tensor`
shards them; the bridge describes the module; the layout is refit into a whole copy on
rank 0, which must equal the weights exactly.

Whether the bridge must refuse a case is decided here from the language's rule,
not from the bridge: a tensor dim cut by more than two mesh dims, or whose second
cut (a `chunk`) is several axes of the layout's mesh (the axes counted from how the
meshes were built: `axes_per_dim`).
"""

from __future__ import annotations

import random

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program


def _meshes():
    """(root, label, mesh, modes per mesh dim) for every mesh a case may draw, and each root's
    own modes. A dim's modes are its (size, stride) runs over its root's rank index, major
    first, written from how the mesh is built (not read from it): the test's own account of
    what each dim enumerates."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = []
    r8 = init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
    out.append(("r8", "(x=8)", r8, [[(8, 1)]]))
    r24 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("p", "q"))
    pq = r24["p", "q"]._flatten("r24_pq")  # names are unique: torch finds a flattened name across roots
    out += [("r24", "(p=2, q=4)", r24, [[(2, 4)], [(4, 1)]]), ("r24", "q of (p, q)", r24["q"], [[(4, 1)]]),
            ("r24", "flat (p, q)", pq, [[(2, 4), (4, 1)]])]
    r42 = init_device_mesh("cpu", (4, 2), mesh_dim_names=("u", "v"))
    out += [("r42", "(u=4, v=2)", r42, [[(4, 2)], [(2, 1)]]), ("r42", "u of (u, v)", r42["u"], [[(4, 2)]]),
            ("r42", "flat (u, v)", r42["u", "v"]._flatten("r42_uv"), [[(4, 2), (2, 1)]])]
    r222 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    ab, bc = r222["a", "b"]._flatten("r222_ab"), r222["b", "c"]._flatten("r222_bc")
    out += [("r222", "(a=2, b=2, c=2)", r222, [[(2, 4)], [(2, 2)], [(2, 1)]]),
            ("r222", "(a, c) of (a, b, c)", r222["a", "c"], [[(2, 4)], [(2, 1)]]),
            ("r222", "flat (a, b)", ab, [[(2, 4), (2, 2)]]),
            ("r222", "flat (a, b, c)", r222["a", "b", "c"]._flatten("r222_abc"), [[(2, 4), (2, 2), (2, 1)]]),
            ("r222", "a + flat (b, c)", DeviceMesh._concatenate([r222["a"], bc]), [[(2, 4)], [(2, 2), (2, 1)]]),
            ("r222", "flat (a, b) + c", DeviceMesh._concatenate([ab, r222["c"]]), [[(2, 4), (2, 2)], [(2, 1)]])]
    # torchtitan's way: one 1-D world, unflattened into meshes that cut it differently
    w = init_device_mesh("cpu", (8,), mesh_dim_names=("w",))
    w24 = w._unflatten(0, (2, 4), ("w24_a", "w24_b"))
    w42 = w._unflatten(0, (4, 2), ("w42_a", "w42_b"))
    w222 = w._unflatten(0, (2, 2, 2), ("w222_a", "w222_b", "w222_c"))
    out += [("w", "(w=8)", w, [[(8, 1)]]), ("w", "unflat (2, 4)", w24, [[(2, 4)], [(4, 1)]]),
            ("w", "w24_b of unflat (2, 4)", w24["w24_b"], [[(4, 1)]]),
            ("w", "unflat (4, 2)", w42, [[(4, 2)], [(2, 1)]]),
            ("w", "unflat (2, 2, 2)", w222, [[(2, 4)], [(2, 2)], [(2, 1)]]),
            ("w", "(a, c) of unflat (2, 2, 2)", w222["w222_a", "w222_c"], [[(2, 4)], [(2, 1)]])]
    roots = {"r8": [(8, 1)], "r24": [(2, 4), (4, 1)], "r42": [(4, 2), (2, 1)],
             "r222": [(2, 4), (2, 2), (2, 1)], "w": [(8, 1)]}
    return out, roots


def axes_per_dim(dims_modes: list, all_modes: list) -> list[int]:
    """How many axes of the layout's mesh each dim is: the rank index is cut at every mode's
    stride and stride x size, over the root and every mesh in the layout (their finest common
    cut), and a mode of size s at stride t holds the cuts in [t, t s)."""
    cuts = {1, 8} | {t for s, t in all_modes} | {t * s for s, t in all_modes}
    return [sum(1 for s, t in modes for c in cuts if t <= c < t * s) for modes in dims_modes]


def must_refuse(placements, dim_axes) -> bool:
    """The language's limit, applied to the placements (see the module docstring)."""
    from torch.distributed.tensor import Shard

    for d in (0, 1):
        cuts = [n for p, n in zip(placements, dim_axes) if isinstance(p, Shard) and p.dim == d]
        if len(cuts) > 2 or (len(cuts) == 2 and cuts[1] > 1):
            return True
    return False


def main(job: dict, rank: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from layoutlang.bridges import dtensor
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    meshes, roots = _meshes()
    rng = random.Random(job["seed"])
    report: dict = {"rank": rank, "checked": 0, "refused": 0, "pairs": 0, "wrong": [], "texts": []}
    for k in range(job["cases"]):
        first = rng.choice(meshes)
        # one weight, or two on two meshes of one root (a dense and an expert mesh, say)
        drawn = [first] + ([rng.choice([m for m in meshes if m[0] == first[0]])] if rng.random() < 0.4 else [])
        all_modes = roots[first[0]] + [m for _, _, _, dims in drawn for ms in dims for m in ms]
        module, whole, weights, refuse, what = torch.nn.Module(), "mesh one (r=1)\n", {}, False, []
        for j, (_, label, mesh, dims) in enumerate(drawn):
            rows, cols = rng.randint(1, 9), rng.randint(1, 9)
            placements = [rng.choice((Shard(0), Shard(1), Replicate())) for _ in dims]
            name = f"w{j}"
            weights[name] = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 100 * k + 50 * j
            module.register_parameter(name, torch.nn.Parameter(
                distribute_tensor(weights[name].clone(), mesh, placements)))
            whole += f"tensor {name} [{rows}, {cols}] fp32\n"
            refuse = refuse or must_refuse(placements, axes_per_dim(dims, all_modes))
            what.append(f"{name} [{rows}, {cols}] on {label} as {placements}")
        case = f"case {k}: " + "; ".join(what)
        report["pairs"] += len(drawn) == 2
        try:
            text = dtensor.describe(module, name="random")
        except dtensor.BridgeError as e:
            if not refuse:
                report["wrong"].append(f"{case}: refused: {e}")
            report["refused"] += 1
            continue
        if refuse:
            report["wrong"].append(f"{case}: described, but the language cannot say it:\n{text}")
            continue
        report["texts"].append(f"{case}:\n{text}")
        plan = compile_plan(loads(text, path="<random>"), loads(whole, path="<whole>"))
        dst = {n: torch.full(tuple(w.shape), float("nan")) for n, w in weights.items()} if rank == 0 else {}
        Refitter(plan, timeout=60).refit(dtensor.tensors(module), dst)
        for n, want in weights.items():
            if rank == 0 and not torch.equal(dst[n], want):
                report["wrong"].append(f"{case}: {n} refit differs from the tensor\n{text}")
        report["checked"] += 1
    return report


if __name__ == "__main__":
    run(main)
