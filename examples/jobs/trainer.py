"""A trainer job that refits engine replicas every step (docs/jobs.md).

Launch it like any torchrun job; it keeps its own world, and trainer rank 0 hosts the
refit's store at --address:

    torchrun --nproc-per-node 4 --master-port 29500 examples/jobs/trainer.py --address 127.0.0.1:29400

Each step changes every weight (a new version) and refits whichever replicas are
waiting (examples/jobs/engine.py), printing who got it and who was dropped. With
--out DIR, rank 0 writes each step's report there as JSON (what the tests read);
--gate DIR makes step n wait for a file DIR/refit-n (the tests start steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import DieInBucket  # noqa: E402
from weights import as_parameters, trainer_tensors  # noqa: E402

from layoutlang import load  # noqa: E402
from layoutlang.runtime import RefitError, TrainerJob  # noqa: E402

HERE = Path(__file__).resolve().parent


def write_whole(path: Path, record: dict) -> None:
    """`record` as JSON at `path`, whole or absent to a reader polling for it: written beside
    it, then renamed into place."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(record))
    part.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True, help="HOST:PORT of the refit's store (rank 0 hosts it)")
    ap.add_argument("--train", default=str(HERE / "train.layout"))
    ap.add_argument("--infer", default=str(HERE / "infer.layout"))
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--budget", type=int, default=None, help="staging budget in bytes (buckets)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gate", default=None)
    ap.add_argument("--parameters", action="store_true", help="pass dict(module.named_parameters())")
    ap.add_argument("--die-refit", type=int, default=0)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-bucket", type=int, default=1)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the trainer's own world (untouched)
    layout = load(a.train)
    hooks = DieInBucket(a.die_refit, a.die_bucket) if rank == a.die_rank else None
    job = TrainerJob(a.train, a.infer, address=a.address, rank=rank, world_size=world,
                     timeout=timedelta(seconds=a.timeout), budget_bytes=a.budget, hooks=hooks)
    out = Path(a.out) if a.out else None
    for n in range(1, a.refits + 1):
        if a.gate:
            while not (Path(a.gate) / f"refit-{n}").exists():
                time.sleep(0.01)
        version = 10 * n
        tensors = trainer_tensors(layout, rank, version)
        if a.parameters:
            model, tensors = as_parameters(tensors)
        began = time.time()
        try:
            report = job.refit(tensors, version=version)
        except RefitError as exc:
            if out:
                write_whole(out / f"trainer-{rank}-error-{n}.json",
                            {"error": str(exc), "at": time.time(), "began": began})
            print(f"trainer rank {rank}: {exc}", file=sys.stderr)
            return 3
        if rank == 0:
            line = {"refit": n, "version": version, "replicas": list(report.replicas), "missed": list(report.missed),
                    "reasons": report.reasons, "seconds": report.seconds, "began": began, "at": time.time()}
            print(json.dumps(line), flush=True)
            if out:
                write_whole(out / f"trainer-report-{n}.json", line)
        dist.all_reduce(torch.ones(1))  # the trainer's own world still works
    job.close()
    return 0  # rank 0 leaves at once: its store may go (close waited for every reader)


if __name__ == "__main__":
    sys.exit(main())
