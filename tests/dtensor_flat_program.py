"""One worker of tests/test_bridge_dtensor.py: FSDP2 on flattened mesh dims, as torchtitan shards.

Run on 8 gloo ranks by `launch({"part": "flat" or "titan"}, 8, program=__file__)`, one
launch per part (torch 2.13 finds a mesh dim by name across roots, so two roots in one
process must not share a dim name); part "nest" runs on 6 (see `_nest`). Part "flat": on a root mesh
(dp_shard=2, cp=2, tp=2) it shards three tiny models the way torchtitan does and
describes each with the DTensor bridge:

- `fsdp_flat`: FSDP2 over `dp_shard_cp`, the flattened (dp_shard, cp);
- `hsdp`: HSDP, replicated over dp_shard and sharded over `cp_tp`, the flattened (cp, tp);
- `refused`: TP over tp, then FSDP2 over `dp_shard_cp` (a chunk over two root dims);

and on a second root mesh (dp_shard=4, tp=2), torchtitan with CP off:
- `tp_fsdp_one`: TP over tp, then FSDP2 over `dp_shard_flat` flattened from dp_shard alone;

Part "titan": as torchtitan builds its meshes now, two meshes unflattened from a 1-D world of 8
(`_unflatten`): dense (dp_shard_cp=4, tp=2) and expert (dp_shard_in_ep=2, ep=4):
- `titan`: FSDP2 over dense `dp_shard_cp`, plus an expert weight on the expert mesh;
- `titan_refused`: TP over dense `tp`, then FSDP2 over dense `dp_shard_cp`, which the
  expert mesh cuts in two (a chunk over two axes).

Each layout that is written is refit into a whole copy on rank 0 and compared
with torch's own gather (`full_tensor`).
"""

from __future__ import annotations

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program

WHOLE = ("mesh one (r=1)\ntensor 0.weight [7, 5] fp32\ntensor 0.bias [7] fp32\n"
         "tensor 1.weight [3, 7] fp32\n")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7, bias=True), torch.nn.Linear(7, 3, bias=False))


def _refit_whole(model, text: str, rank: int, extra: str = "") -> dict[str, list[int]]:
    """Refit the described model into a whole copy on rank 0; assert it equals `full_tensor`."""
    from layoutlang.bridges import dtensor
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    plan = compile_plan(loads(text, path="<described>"), loads(WHOLE + extra, path="<whole>"))
    dst = {n: torch.full(tuple(p.shape), float("nan")) for n, p in model.named_parameters()} if rank == 0 else {}
    local = dtensor.tensors(model)
    Refitter(plan, timeout=60).refit(local, dst)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        for n, want in full.items():
            assert torch.equal(dst[n], want), f"{n} differs"
    return {n: list(t.shape) for n, t in local.items()}


def _refusal(module) -> str:
    from layoutlang.bridges import dtensor

    try:
        dtensor.describe(module)
    except dtensor.BridgeError as e:
        return e.render() if hasattr(e, "render") else str(e)
    return "not refused"


def main(job: dict, rank: int) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    part = job["part"]
    report: dict = {"rank": rank, "texts": {}, "local_shapes": {}}
    tp_plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    if part == "titan":
        _titan(report, rank, tp_plan)
    elif part == "nest":
        _nest(report, rank)
    else:
        _flat(report, rank, tp_plan)
    return report


def _flat(report: dict, rank: int, tp_plan: dict) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from layoutlang.bridges import dtensor

    # The flattened meshes are used as `_flatten` returns them (slicing a root by a flattened
    # name finds a mesh by name across roots: torch deprecates it).
    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
    dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    cp_tp = root["cp", "tp"]._flatten("cp_tp")
    flat = _model()
    fully_shard(flat, mesh=dp_shard_cp)
    hsdp = _model()
    fully_shard(hsdp, mesh=DeviceMesh._concatenate([root["dp_shard"], cp_tp]))
    for label, model in (("fsdp_flat", flat), ("hsdp", hsdp)):
        text = dtensor.describe(model, name=label)
        report["texts"][label] = text
        report["local_shapes"][label] = _refit_whole(model, text, rank)
    refused = _model()
    parallelize_module(refused, root["tp"], tp_plan)
    fully_shard(refused, mesh=dp_shard_cp)
    report["refused"] = _refusal(refused)

    other = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    one = _model()
    parallelize_module(one, other["tp"], tp_plan)
    # (its own name: FSDP2 slices the root by the flattened dim's name, and torch 2.13 finds a
    # flattened name across roots, so the first root's `dp_shard_cp` would be taken)
    fully_shard(one, mesh=other["dp_shard"]._flatten("dp_shard_flat"))
    text = dtensor.describe(one, name="tp_fsdp_one")
    report["texts"]["tp_fsdp_one"] = text
    report["local_shapes"]["tp_fsdp_one"] = _refit_whole(one, text, rank)


def _titan(report: dict, rank: int, tp_plan: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from layoutlang.bridges import dtensor

    world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (4, 2), ("dp_shard_cp", "tp"))
    expert = world._unflatten(0, (2, 4), ("dp_shard_in_ep", "ep"))
    torch.manual_seed(1)
    experts = torch.randn(4, 6)  # 4 experts over ep, each expert's 6 columns over dp_shard_in_ep
    titan = _model()
    fully_shard(titan, mesh=dense["dp_shard_cp"])
    titan.register_parameter("expert_w", torch.nn.Parameter(
        distribute_tensor(experts.clone(), expert, [Shard(1), Shard(0)])))
    text = dtensor.describe(titan, name="titan")
    report["texts"]["titan"] = text
    report["local_shapes"]["titan"] = _refit_whole(titan, text, rank, extra="tensor expert_w [4, 6] fp32\n")
    titan_refused = _model()
    parallelize_module(titan_refused, dense["tp"], tp_plan)
    fully_shard(titan_refused, mesh=dense["dp_shard_cp"])
    titan_refused.register_parameter("expert_w", torch.nn.Parameter(
        distribute_tensor(experts.clone(), expert, [Shard(1), Shard(0)])))
    report["titan_refused"] = _refusal(titan_refused)



def _nest(report: dict, rank: int) -> None:
    """Part "nest", on 6 ranks: a world unflattened as (2, 3) and as (3, 2). One weight on
    the 3 of the first is its own layout; beside a weight on the 2 of the second, the two
    cut the rank index at 1, 2, 3 and 6, and 2 does not divide 3: no one mesh holds both."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from layoutlang.bridges import dtensor

    world = init_device_mesh("cpu", (6,), mesh_dim_names=("world",))
    twos, threes = world._unflatten(0, (2, 3), ("a2", "a3")), world._unflatten(0, (3, 2), ("b3", "b2"))
    alone = torch.nn.Module()
    alone.w = torch.nn.Parameter(distribute_tensor(torch.arange(10.0).reshape(5, 2), twos["a3"], [Shard(0)]))
    report["texts"]["alone"] = dtensor.describe(alone, name="alone")
    both = torch.nn.Module()
    both.w = alone.w
    both.v = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), threes["b2"], [Shard(0)]))
    report["not_nested"] = _refusal(both)


if __name__ == "__main__":
    run(main)
