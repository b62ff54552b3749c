"""One engine replica that takes every refit it is a member of (docs/jobs.md).

Each replica is its own job and its own world:

    torchrun --nproc-per-node 2 --master-port 29600 examples/jobs/engine.py \
        --address 127.0.0.1:29400 --replica rollout-0

After every refit each rank checks every element of its tensors against the version it
reports (examples/jobs/weights.py). With --out DIR each rank writes one JSON line per
receive to DIR/engine-REPLICA-RANK.jsonl (what the tests read). It stops when the
trainer job closes, or after --receives receives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import DieInBucket  # noqa: E402
from weights import as_parameters, engine_tensors, problems, strided  # noqa: E402

from layoutlang import load  # noqa: E402
from layoutlang.runtime import EngineJob, RefitError  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--replica", required=True)
    ap.add_argument("--infer", default=str(HERE / "infer.layout"))
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--receives", type=int, default=0, help="stop after this many (0: until the trainer closes)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parameters", action="store_true", help="pass dict(module.named_parameters())")
    ap.add_argument("--strided", action="store_true", help="non-contiguous destinations (views of wider buffers)")
    ap.add_argument("--die-refit", type=int, default=0)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-bucket", type=int, default=1)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the replica's own world (untouched)
    layout = load(a.infer)
    tensors = engine_tensors(layout, rank)
    if a.strided:
        tensors = strided(tensors)
    if a.parameters:
        model, tensors = as_parameters(tensors)
    hooks = DieInBucket(a.die_refit, a.die_bucket) if rank == a.die_rank else None
    eng = EngineJob(a.infer, address=a.address, replica=a.replica, rank=rank, world_size=world,
                    timeout=timedelta(seconds=a.timeout), hooks=hooks, connect_timeout=timedelta(seconds=120))
    log = open(Path(a.out) / f"engine-{a.replica}-{rank}.jsonl", "a") if a.out else None
    calls = 0
    while not a.receives or calls < a.receives:
        calls += 1
        try:
            version = eng.receive(tensors)
            line = {"version": version, "problems": problems(layout, rank, {k: v.detach() for k, v in tensors.items()},
                                                             version)}
            if a.parameters:
                line["parameters"] = all(v.requires_grad and v.grad is None for v in tensors.values())
        except RefitError as exc:
            line = {"error": str(exc), "version": eng.version, "interrupted": eng.interrupted}
            if exc.phase == "waiting":  # the trainer job closed or is gone: nothing more will come
                line["gone"] = True
        line["at"] = time.time()
        print(json.dumps({"replica": a.replica, "rank": rank, **line}), flush=True)
        if log:
            log.write(json.dumps(line) + "\n")
            log.flush()
        if line.get("gone"):
            break
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
