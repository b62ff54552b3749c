"""One rank of a local refit job (see launch.py). Usage: python -m layoutlang.runtime.worker JOB OUT

The job (JSON) names the two layouts and their args, and optionally a
budget, `verify`, a number of `steps`, and test faults: `die` (a rank exits
at the start of a bucket), `stall` (a rank sleeps there), `corrupt` (a rank
changes one element of a send buffer), `wrong_shape` (a rank passes a
truncated source tensor), `odd_args` (a rank compiles another plan).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main(job_path: str, out_path: str) -> int:
    job = json.loads(open(job_path).read())
    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank, "ok": False}
    try:
        timeout = timedelta(seconds=job.get("timeout", 60))
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        result.update(run(job, rank, timeout))
        result["ok"] = not result.get("check_errors")
    except Exception as exc:  # noqa: BLE001 - reported to the launcher as data
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    if dist.is_initialized() and result["ok"]:
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


def run(job: dict, rank: int, timeout: timedelta) -> dict:
    from layoutlang.compiler import compile_plan
    from . import refit as refit_module
    from .fill import check_destination, empty_destination, source_tensor
    from .refit import Refitter

    dst_args = job.get("dst_args")
    odd = job.get("odd_args")  # test fault: one rank compiles with other args
    if odd and odd["rank"] == rank:
        dst_args = {**(dst_args or {}), **odd["dst_args"]}
    plan = compile_plan(job["src"], job["dst"], args=job.get("args"), src_args=job.get("src_args"),
                        dst_args=dst_args, ranks_per_node=job.get("ranks_per_node"))
    _install_faults(job, rank, refit_module)
    refitter = Refitter(plan, budget_bytes=job.get("budget"), timeout=timeout, verify=job.get("verify", False))
    src = {t.name: source_tensor(t, rank) for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
    dst = {t.name: empty_destination(t) for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)}
    wrong = job.get("wrong_shape")  # test fault: one rank passes a tensor of another shape
    if wrong and wrong["rank"] == rank and src:
        name = sorted(src)[0]
        src[name] = src[name][:1] if isinstance(src[name], torch.Tensor) else src[name]
    storage = {name: (v.data_ptr() if isinstance(v, torch.Tensor) else v.data.data_ptr()) for name, v in dst.items()}
    times = []
    for _ in range(job.get("steps", 1)):
        dist.barrier()
        start = time.perf_counter()
        refitter.refit(src or None, dst or None)
        dist.barrier()
        times.append(time.perf_counter() - start)
    errors = [e for t in plan.dst.tensors if t.name in dst and t.holds(rank)
              for e in [check_destination(t, rank, dst[t.name], plan)] if e]
    moved = [name for name, v in dst.items()
             if (v.data_ptr() if isinstance(v, torch.Tensor) else v.data.data_ptr()) != storage[name]]
    if moved:
        errors.append(f"destination storage was replaced, not updated in place: {moved[:3]}")
    return {"seconds": times, "sent_bytes": refitter.sent_bytes // len(times),
            "received_bytes": refitter.received_bytes // len(times), "local_bytes": refitter.local_bytes // len(times),
            "staging_peak": refitter.meter.peak, "checked_tensors": len(dst), "check_errors": errors[:5],
            "largest_tensor_bytes": max((_nbytes(v) for v in list(dst.values()) + list(src.values())), default=0)}


def _nbytes(v) -> int:
    t = v if isinstance(v, torch.Tensor) else v.data
    return t.numel() * 2 if not isinstance(v, torch.Tensor) else t.numel() * t.element_size()


def _install_faults(job: dict, rank: int, refit_module) -> None:
    die, stall, corrupt = job.get("die"), job.get("stall"), job.get("corrupt")
    original = refit_module.Refitter._bucket

    def bucket(self, b, *args):
        if die and die["rank"] == rank and die.get("bucket", 0) == b:
            os._exit(3)
        if stall and stall["rank"] == rank and stall.get("bucket", 0) == b:
            time.sleep(stall.get("seconds", 3600))
        return original(self, b, *args)

    refit_module.Refitter._bucket = bucket
    if corrupt and corrupt["rank"] == rank:
        def corrupt_buffer(buf, op):
            if op.id == corrupt.get("op", op.id):
                buf = buf.clone()
                buf.reshape(-1)[0] += 1
            return buf
        refit_module._corrupt_hook = corrupt_buffer


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
