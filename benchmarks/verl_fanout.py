"""The busiest trainer actor's bytes under verl: layoutlang's checkpoint engine against verl's `nccl` path.

    .venv/bin/python benchmarks/verl_fanout.py        # ~1-2 min on 2 cores (Ray actors start)

Runs tests/verl_program.py's deployment once (one Ray session on this machine: 2 FSDP2 trainer
actors on gloo, 2 rollout replicas of TP2; a tiny Qwen3 and a tiny Qwen3-MoE, 3 updates each
through verl 0.9.1's own CheckpointEngineManager) with `--bench`, and prints, per model, each
trainer actor's bytes sent per update against its fair share (all trainer bytes / actors):

  layoutlang   measured at the wire: every buffer a trainer rank's refit sends (RefitHooks.on_send)
               in the last update; each actor sends its own FSDP2 shards to both replicas
  nccl-style   a hand-written stand-in of verl's `nccl` backend (cupy, which it imports, does not
               install here): every full tensor gathered over the actor group (`full_tensor()`,
               run for real) and sent by actor rank 0, counted once (what NCCL's broadcast puts on
               rank 0's link; the rollout workers all receive it whole)

and the peak bytes a refit allocated on a trainer actor (a TorchDispatchMode over the refit's
thread): layoutlang's within its budget (1 MiB, verl's `update_weights_bucket_megabytes`),
the stand-in's holding the largest full tensor. Exits 1 when the deployment fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="lvb-", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "verl_program.py"), tmp, "--bench"], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines or lines[-1].get("ok") is not True:
        print(proc.stdout[-4000:] + proc.stderr[-4000:])
        return 1
    print(f"{'model':<10} {'engine':<11} {'busiest B':>10} {'fair B':>10} {'busiest/fair':>12} {'peak alloc B':>13}")
    for b in (x for x in lines if x.get("bench")):
        print(f"{b['arch']:<10} {'layoutlang':<11} {b['layoutlang_busiest']:>10} {b['layoutlang_fair']:>10.0f} "
              f"{b['layoutlang_ratio']:>12.3f} {b['layoutlang_peak']:>13}")
        print(f"{b['arch']:<10} {'nccl-style':<11} {b['standin_busiest']:>10} {b['standin_fair']:>10.0f} "
              f"{b['standin_ratio']:>12.3f} {b['standin_peak']:>13}")
        print(f"{b['arch']:<10} ratio nccl-style / layoutlang busiest-over-fair: "
              f"{b['standin_ratio'] / b['layoutlang_ratio']:.3f}")
    updates = [x for x in lines if "step" in x]
    print(f"{len(updates)} updates, every rollout rank exact: "
          f"{all(not c['bad'] for x in updates for c in x['checks'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
