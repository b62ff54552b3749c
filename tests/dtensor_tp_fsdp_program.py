"""One worker of tests/test_bridge_dtensor.py: TP (parallelize_module) + FSDP2 on a (dp=2, tp=2) mesh.

Run on 4 gloo ranks by `launch(job, 4, program=__file__)`. The layout the
DTensor bridge writes is refit into a whole copy on rank 0 and compared with
torch's own gather (`full_tensor`); the bridge's refusals are recorded for the
test to check their wording.
"""

from __future__ import annotations

import torch

from bridge_program import run  # tests/bridge_program.py: the frame of a launched program


def main(job: dict, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from layoutlang.bridges import dtensor
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    report: dict = {"rank": rank}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7, bias=True), torch.nn.Linear(7, 3, bias=False))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    text = dtensor.describe(model, name="tp_fsdp")
    report["text"] = text
    src = loads(text, path="<tp_fsdp>")
    whole = loads("mesh one (r=1)\ntensor 0.weight [7, 5] fp32\ntensor 0.bias [7] fp32\n"
                  "tensor 1.weight [3, 7] fp32\n", path="<whole>")
    plan = compile_plan(src, whole)
    dst = {n: torch.full(tuple(p.shape), float("nan")) for n, p in model.named_parameters()} if rank == 0 else {}
    local = dtensor.tensors(model)
    report["local_shapes"] = {n: list(t.shape) for n, t in local.items()}
    Refitter(plan, timeout=60).refit(local, dst)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        for n, want in full.items():
            assert torch.equal(dst[n], want), f"{n} differs"
    # What the bridge refuses, with the parameter named.
    partial = torch.nn.Module()
    partial.w = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Partial(), Partial()]))
    plain = torch.nn.Module()
    plain.a = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh["tp"], [torch.distributed.tensor.Shard(0)]))
    plain.b = torch.nn.Parameter(torch.ones(3))
    for case, module in (("partial", partial), ("plain", plain)):
        try:
            dtensor.describe(module)
        except dtensor.BridgeError as e:
            report[case] = e.render() if hasattr(e, "render") else str(e)
    return report


if __name__ == "__main__":
    run(main)
