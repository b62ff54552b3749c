"""One worker of tests/test_bridge_dtensor.py: the DTensor bridge on random meshes and placements.

Run on 8 gloo ranks by `launch({"seed": S, "cases": N}, 8, program=__file__)`. Every
rank draws the same N cases from the seed: a mesh (a root mesh of 8 ranks, a slice of
it, a flattened run of its dims, or a slice concatenated with a flattened run), a
[rows, cols] fp32 tensor with extents 1..9 (so blocks are ragged and some ranks hold
nothing), and per mesh dim Shard(0), Shard(1) or Replicate(). `distribute_tensor`
shards it; the bridge describes it; the layout is refit into a whole copy on rank 0,
which must equal the tensor exactly.

Whether the bridge must refuse a case is decided here from the language's rule,
not from the bridge: a tensor dim cut by more than two mesh dims, or whose second
cut (a `chunk`) is a flattened run of several root dims.
"""

from __future__ import annotations

import json
import random
import sys
import traceback

import torch
import torch.distributed as dist


def _meshes():
    """(label, mesh, root dims per mesh dim) for every mesh a case may draw."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = []
    r8 = init_device_mesh("cpu", (8,), mesh_dim_names=("x",))
    out.append(("(x=8)", r8, (1,)))
    r24 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("p", "q"))
    pq = r24["p", "q"]._flatten("r24_pq")  # flattened names are unique: torch finds them by name
    out += [("(p=2, q=4)", r24, (1, 1)), ("q of (p, q)", r24["q"], (1,)), ("flat (p, q)", pq, (2,))]
    r42 = init_device_mesh("cpu", (4, 2), mesh_dim_names=("u", "v"))
    out += [("(u=4, v=2)", r42, (1, 1)), ("u of (u, v)", r42["u"], (1,)),
            ("flat (u, v)", r42["u", "v"]._flatten("r42_uv"), (2,))]
    r222 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    ab, bc = r222["a", "b"]._flatten("r222_ab"), r222["b", "c"]._flatten("r222_bc")
    out += [("(a=2, b=2, c=2)", r222, (1, 1, 1)), ("(a, c) of (a, b, c)", r222["a", "c"], (1, 1)),
            ("flat (a, b)", ab, (2,)), ("flat (a, b, c)", r222["a", "b", "c"]._flatten("r222_abc"), (3,)),
            ("a + flat (b, c)", DeviceMesh._concatenate([r222["a"], bc]), (1, 2)),
            ("flat (a, b) + c", DeviceMesh._concatenate([ab, r222["c"]]), (2, 1))]
    return out


def must_refuse(placements, spans) -> bool:
    """The language's limit, applied to the placements (see the module docstring)."""
    from torch.distributed.tensor import Shard

    for d in (0, 1):
        cuts = [s for p, s in zip(placements, spans) if isinstance(p, Shard) and p.dim == d]
        if len(cuts) > 2 or (len(cuts) == 2 and cuts[1] > 1):
            return True
    return False


def main(job_path: str, out_path: str) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from layoutlang.bridges import dtensor
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    with open(job_path) as f:
        job = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = _meshes()
    rng = random.Random(job["seed"])
    report: dict = {"rank": rank, "checked": 0, "refused": 0, "wrong": [], "texts": []}
    for k in range(job["cases"]):
        label, mesh, spans = rng.choice(meshes)
        rows, cols = rng.randint(1, 9), rng.randint(1, 9)
        placements = [rng.choice((Shard(0), Shard(1), Replicate())) for _ in spans]
        case = f"case {k}: [{rows}, {cols}] on {label} as {placements}"
        full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 100 * k
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, placements))
        try:
            text = dtensor.describe(module, name="random")
        except dtensor.BridgeError as e:
            if not must_refuse(placements, spans):
                report["wrong"].append(f"{case}: refused: {e}")
            report["refused"] += 1
            continue
        if must_refuse(placements, spans):
            report["wrong"].append(f"{case}: described, but the language cannot say it:\n{text}")
            continue
        report["texts"].append(f"{case}: {text.splitlines()[-1]}")
        plan = compile_plan(loads(text, path="<random>"), loads(f"mesh one (r=1)\ntensor w [{rows}, {cols}] fp32\n",
                                                                path="<whole>"))
        dst = {"w": torch.full((rows, cols), float("nan"))} if rank == 0 else {}
        Refitter(plan, timeout=60).refit(dtensor.tensors(module), dst)
        if rank == 0 and not torch.equal(dst["w"], full):
            report["wrong"].append(f"{case}: refit differs from the tensor\n{text}")
        report["checked"] += 1
    dist.barrier()
    report["ok"] = True
    with open(out_path, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except BaseException as e:
        with open(sys.argv[2], "w") as f:
            json.dump({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, f)
        sys.exit(1)
