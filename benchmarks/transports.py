"""Transports against the one-copy floor and against each other (issue 50).

    .venv/bin/python benchmarks/transports.py            # 1 GiB a refit, 15 rounds, ~2-4 min on 2 cores
    .venv/bin/python benchmarks/transports.py --small    # 64 MiB, 9 rounds: seconds, targets printed only
    .venv/bin/python benchmarks/transports.py --methods floor,memory,group,nixl --rounds 21
    .venv/bin/python benchmarks/transports.py --jobs     # between jobs: a trainer job + 2 replicas

4 local processes, one gloo world on 127.0.0.1 (benchmarks/workers.py: a free port, a hard
timeout, no worker outlives the run): 2 trainer ranks hold N weights `[(gate: R/2 | up: R/2)
over tp, C]` (Megatron's strided TP2: each rank its gate rows, then its up rows) and 2 engine
ranks hold the same weights `[(gate: R/2 | up: R/2) chunk tp, C]` (engine rank 0 every gate
row, rank 1 every up row): each engine rank receives half of every weight from each trainer
rank, every piece one contiguous byte range on both sides. bf16; by default N = 8 weights of
[8192, 8192], 1 GiB moved per refit. Methods (benchmarks/transports_worker.py):

  floor    each engine rank copies its pieces out of the trainer ranks' memory with one
           `process_vm_readv` per piece, hand-written in the benchmark: one kernel copy per
           byte and nothing else, the least a same-host refit can do
  memory   `Refitter(plan, transport="memory", steady=True)`
  group    `Refitter(plan, transport="group", steady=True)`: gloo over loopback TCP
  nixl     `Refitter(plan, transport="nixl", steady=True)` (UCX), where nixl is installed

One warm-up round, then `--rounds` rounds, each timing every method once in a balanced
order (refit_gloo.round_order); a step's time is the slowest rank's, between two barriers.
Ratios are paired per round (two methods in one round meet the same load) and pooled as the
median with a distribution-free 95 % interval (refit_gloo._median_interval). Targets
(issue 50): memory / floor <= 1.25, group / memory >= 2.0; PASS when the whole interval is
within the target, MISS when it is wholly beyond, inconclusive otherwise; nixl / group is
printed. `--jobs`: the same weights between separately launched jobs
(benchmarks/transports_jobs_worker.py: a trainer job of the 2 trainer ranks, 2 engine
replicas of 2 ranks each, 6 processes, each engine rank receiving what the one engine rank
did above), `TrainerJob`/`EngineJob` on "memory" and on "group" (two pairs of jobs, each on
its own store), against the same floor; the same two targets. After the timed rounds each method runs once more into NaN-filled destinations:
the floor's result checked element by element against the layout, every other method's
bit for bit against it; a wrong result exits 1, as does a MISS at the default size.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from refit_gloo import _median_interval  # noqa: E402
from refit_gloo import _free_port  # noqa: E402
from workers import Terminated, launch, on_sigterm  # noqa: E402

WORKER = HERE / "transports_worker.py"
JOBS_WORKER = HERE / "transports_jobs_worker.py"
TARGETS = {("memory", "floor"): ("<=", 1.25), ("group", "memory"): (">=", 2.0)}
SHOWN = [("memory", "floor"), ("group", "memory"), ("nixl", "group"), ("nixl", "floor"), ("group", "floor")]
JOBS_TARGETS = {("jobs_memory", "floor"): ("<=", 1.25), ("jobs_group", "jobs_memory"): (">=", 2.0)}
JOBS_SHOWN = [("jobs_memory", "floor"), ("jobs_group", "jobs_memory"), ("jobs_group", "floor"),
              ("jobs_nixl", "jobs_memory"), ("jobs_nixl", "jobs_group")]


def layouts(n: int, r: int, c: int, jobs: bool = False) -> tuple[str, str]:
    head = f"const N = {n}, R = {r}, C = {c}\n"
    body = "for i in 0..N {{\n  tensor layers.{{i}}.weight [(gate: R/2 | up: R/2) {split} tp, C]\n}}\n"
    at = "" if jobs else " at 2"   # (an engine job's layout spans its own ranks)
    return (f"layout train\n{head}mesh train (tp=2)\n" + body.format(split="over"),
            f"layout infer\n{head}mesh infer (tp=2){at}\n" + body.format(split="chunk"))


def paired(per_rank: list[dict], a: str, b: str) -> list[float]:
    """Round by round: a's step / b's step, a step being the slowest rank's."""
    steps = {m: [max(ts) for ts in zip(*(r["methods"][m]["seconds"] for r in per_rank))] for m in (a, b)}
    return [x / y for x, y in zip(steps[a], steps[b]) if y]


def verdict(ratios: list[float], sign: str, target: float) -> str:
    iv = _median_interval(ratios)
    if iv is None:
        return "inconclusive (too few rounds)"
    lo, hi = iv
    inside = hi <= target if sign == "<=" else lo >= target
    beyond = lo > target if sign == "<=" else hi < target
    return "PASS" if inside else "MISS" if beyond else f"inconclusive (the interval holds {target})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="64 MiB a refit, 9 rounds; targets not enforced")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int)
    ap.add_argument("--cols", type=int)
    ap.add_argument("--methods", default="floor,memory,group,nixl")
    ap.add_argument("--timeout", type=float, default=900.0, help="the whole run's limit (s)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (benchmarks/gpu_transports.py)")
    ap.add_argument("--jobs", action="store_true",
                    help="a refit between jobs: a trainer job of 2 ranks and 2 engine replicas of 2 (6 processes)")
    args = ap.parse_args(argv)
    rows = args.rows or (2048 if args.small else 8192)
    cols = args.cols or (2048 if args.small else 8192)
    rounds = args.rounds or (9 if args.small else 15)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "floor" not in methods:
        methods.insert(0, "floor")
    signal.signal(signal.SIGTERM, on_sigterm)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ll-transports-") as tmp_name:
        tmp = Path(tmp_name)
        src, dst = layouts(args.tensors, rows, cols, args.jobs)
        (tmp / "train.layout").write_text(src)
        (tmp / "infer.layout").write_text(dst)
        job = {"src": str(tmp / "train.layout"), "dst": str(tmp / "infer.layout"), "methods": methods,
               "rounds": rounds, "timeout": max(60.0, args.timeout / 4), "device": args.device,
               "addresses": [f"127.0.0.1:{_free_port()}" for _ in range(3)]}
        try:
            results, tails, timed_out = launch(JOBS_WORKER if args.jobs else WORKER, job, 6 if args.jobs else 4,
                                               tmp, args.timeout)
        except Terminated:
            print("terminated", file=sys.stderr)
            return 1
    if timed_out or any(r is None or not r.get("ok") for r in results):
        print("FAILED: a worker did not finish" + (" (timed out)" if timed_out else ""))
        for rank, (r, tail) in enumerate(zip(results, tails)):
            if r is not None and r.get("error"):
                print(f"rank {rank}:\n{r['error']}")
            elif tail:
                print(f"rank {rank} stderr:\n{tail}")
        return 1
    ran = list(results[0]["methods"])
    gib = results[0]["bytes"] / 2**30
    engines = "2 engine replicas of 2 ranks (chunked), separate jobs" if args.jobs else "2 engine ranks (chunked)"
    print(f"transports{' between jobs' if args.jobs else ''}: 2 trainer ranks TP2 (strided gate|up) -> {engines}, "
          f"{args.tensors} x [{rows}, {cols}] bf16, {gib:.2f} GiB a refit, {rounds} paired rounds, "
          f"{6 if args.jobs else 4} local processes on {results[0]['device']} "
          f"({time.perf_counter() - start:.0f} s)")
    if args.jobs:
        print(f"  the jobs' reports: {results[0].get('transports')}")
    for name, why in results[0]["skipped"].items():
        print(f"  {name:11s} not run: {why}")
    failed = False
    for m in ran:
        steps = [max(ts) for ts in zip(*(r["methods"][m]["seconds"] for r in results))]
        errors = [e for r in results for e in r["methods"][m]["errors"]]
        med = statistics.median(steps)
        print(f"  {m:11s} median {med * 1e3:8.1f} ms  {gib / med:6.2f} GiB/s  check: "
              + ("exact" if not errors else "WRONG: " + "; ".join(errors[:2])))
        failed |= bool(errors)
    missed = False
    shown, targets = (JOBS_SHOWN, JOBS_TARGETS) if args.jobs else (SHOWN, TARGETS)
    for a, b in shown:
        if a not in ran or b not in ran:
            continue
        ratios = paired(results, a, b)
        iv = _median_interval(ratios)
        text = f"{statistics.median(ratios):.3f}" + (f" (95 % interval {iv[0]:.3f}-{iv[1]:.3f})" if iv else "")
        target = targets.get((a, b)) if args.device == "cpu" else None
        judged = ""
        if target:
            judged = f"  target {target[0]} {target[1]}: {verdict(ratios, *target)}"
            missed |= judged.endswith("MISS")
        print(f"  {a} / {b}: {text}{judged}")
    for (a, b) in targets if args.device == "cpu" else ():
        if a not in ran or b not in ran:
            print(f"  {a} / {b}: not measured ({a if a not in ran else b} did not run)")
    if failed:
        return 1
    return 1 if missed and not args.small else 0


if __name__ == "__main__":
    sys.exit(main())
