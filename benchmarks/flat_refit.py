"""ZeRO-3 flat shards -> a vLLM TP2 engine: layoutlang from `ds_tensor` against TRL's gather path (issue 52).

    .venv/bin/python benchmarks/flat_refit.py                 # Llama 4 layers, hidden 1024, bf16 (0.21 GiB), 15 rounds
    .venv/bin/python benchmarks/flat_refit.py --size tiny     # a few kB, 6 rounds: the CI smoke run
    .venv/bin/python benchmarks/flat_refit.py --layers 8 --dtype fp32 --rounds 21 --methods layoutlang,trl

6 local processes, one gloo world on 127.0.0.1 (layoutlang.runtime.launch: free port, hard
timeout, no worker outlives the run). Ranks 0-3: a transformers `LlamaForCausalLM` under
DeepSpeed ZeRO-3 (`deepspeed.zero.Init` over their own group, DeepSpeed 0.19.8 with
DS_BUILD_OPS=0): each rank keeps its `ds_tensor` of every parameter. Ranks 4-5: vLLM's TP2
layout of the same model (q|k|v, gate|up packed per rank, vocabulary padded to 64). Methods
(benchmarks/flat_refit_worker.py):

  layoutlang       the ZeRO-3 bridge (`describe` / `tensors`: the `ds_tensor`s as they are, no
                   gather) planned into the vLLM layout, one `Refitter.refit` (steady, "auto"
                   transport: shared memory on one host) a round, `--budget` bytes of staging
  layoutlang_gloo  the same on transport "group" (gloo: the wire the TRL path has here)
  trl              TRL's path written in the benchmark: per parameter `GatheredParameters([p])`
                   on every ZeRO-3 rank, rank 0 broadcasts the whole tensor to the engine ranks
                   (a group of rank 0 and the engine ranks), each engine rank keeps its slice
                   by vLLM's weight-loader rules

One warm-up round, then `--rounds` rounds, each timing every method once in a balanced order
(refit_gloo.round_order); a step's time is the slowest rank's, between two barriers of all 6.
Ratios are paired per round and pooled as the median with a distribution-free 95 % interval
(refit_gloo._median_interval, as benchmarks/transports.py). Every step of every round writes
into NaN-filled engine tensors and must equal, bit for bit, vLLM's rules applied to the full
parameters `GatheredParameters` gives (built once, untimed): a wrong result exits 1.
Bytes a rank allocates beyond its own shards are accounted (not sampled): layoutlang, the
Refitter's staging meter (`meter.peak`, every staging buffer a step allocates); TRL, DeepSpeed's
gathered storage of the parameter on each ZeRO-3 rank (rank 0 sends all of it) and the whole
tensor an engine rank receives into. layoutlang's above the budget exits 1 (the budget is
exceeded only where one tensor's own staging is larger: docs/runtime.md), as does a step that
is not faster than TRL's at the default size.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from refit_gloo import _median_interval  # noqa: E402
from workers import Terminated, on_sigterm  # noqa: E402

WORKER = HERE / "flat_refit_worker.py"
SIZES = {  # Llama shapes: vocabulary, hidden, intermediate, q heads, kv heads, head dim, layers
    "tiny": dict(V=37, H=16, F=24, Q=4, KV=2, D=4, L=1),
    "small": dict(V=8000, H=512, F=1408, Q=8, KV=4, D=64, L=2),
    "default": dict(V=32000, H=1024, F=2816, Q=16, KV=8, D=64, L=4),
}
SHOWN = [("layoutlang", "trl"), ("layoutlang_gloo", "trl"), ("layoutlang", "layoutlang_gloo")]


def paired(per_rank: list[dict], a: str, b: str) -> list[float]:
    """Round by round: a's step / b's step, a step being the slowest rank's."""
    steps = {k: [max(ts) for ts in zip(*(r["methods"][k]["seconds"] for r in per_rank))] for k in (a, b)}
    return [x / y for x, y in zip(steps[a], steps[b]) if y]


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="default")
    ap.add_argument("--layers", type=int, help="decoder layers (the size's by default)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--budget", type=int, help="layoutlang's staging budget in bytes (default 64 MiB; tiny: 256)")
    ap.add_argument("--methods", default="layoutlang,layoutlang_gloo,trl")
    ap.add_argument("--timeout", type=float, default=900.0, help="the whole run's limit (s)")
    args = ap.parse_args(argv)
    model = dict(SIZES[args.size])
    if args.layers:
        model["L"] = args.layers
    rounds = args.rounds or (6 if args.size == "tiny" else 15)
    budget = args.budget or (256 if args.size == "tiny" else 64 << 20)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "trl" not in methods or not any(m.startswith("layoutlang") for m in methods):
        ap.error("--methods needs trl and layoutlang or layoutlang_gloo")
    signal.signal(signal.SIGTERM, on_sigterm)
    from layoutlang.runtime.launch import launch

    job = {"model": model, "dtype": args.dtype, "zero_ranks": 4, "methods": methods, "rounds": rounds,
           "budget": budget, "timeout": max(60.0, args.timeout / 4)}
    start = time.perf_counter()
    try:
        results = launch(job, 6, timeout=args.timeout, program=str(WORKER))
    except Terminated:
        print("terminated", file=sys.stderr)
        return 1
    if not all(r.ok for r in results):
        print("FAILED: a worker did not finish")
        for r in results:
            if not r.ok:
                trace = (r.result or {}).get("trace", "")
                print(f"rank {r.rank}: {r.error}\n{trace}{r.stderr[-2000:] if not trace else ''}")
        return 1
    reports = [r.result for r in results]
    gib = reports[0]["bytes"] / 2**30
    m = model
    print(f"flat_refit: 4 ZeRO-3 ranks (DeepSpeed {reports[0]['deepspeed']}, zero.Init, gloo) -> 2 engine ranks "
          f"(vLLM TP2 layout), Llama V={m['V']} H={m['H']} F={m['F']} heads {m['Q']}/{m['KV']}x{m['D']} "
          f"L={m['L']} {args.dtype}, {gib:.3f} GiB a refit, {rounds} paired rounds, 6 local processes "
          f"({time.perf_counter() - start:.0f} s; setup {max(r['setup_seconds'] for r in reports):.1f} s, of which "
          f"{max(r.get('model_seconds', 0) for r in reports):.1f} s importing DeepSpeed and transformers and "
          "building the model under zero.Init)")
    print(f"  layoutlang's transports: {reports[0]['transports']}")
    failed = False
    for k in methods:
        steps = [max(ts) for ts in zip(*(r["methods"][k]["seconds"] for r in reports))]
        errors = [e for r in reports for e in r["methods"][k]["errors"]]
        med = statistics.median(steps)
        print(f"  {k:15s} median {med * 1e3:9.1f} ms  {gib / med:6.2f} GiB/s  check: "
              + ("exact, every round (bit for bit: vLLM's rule on the gathered parameters)" if not errors
                 else "WRONG: " + "; ".join(errors[:2])))
        failed |= bool(errors)
    slower = False
    for a, b in SHOWN:
        if a not in methods or b not in methods:
            continue
        ratios = paired(reports, a, b)
        iv = _median_interval(ratios)
        print(f"  {a} / {b}: {statistics.median(ratios):.3f}"
              + (f" (95 % interval {iv[0]:.3f}-{iv[1]:.3f})" if iv else " (too few rounds for an interval)"))
        if a == "layoutlang" and b == "trl" and iv and iv[0] >= 1.0:
            slower = True
    zero, engines = reports[:4], reports[4:]
    shards = max(r["shard_bytes"] for r in zero), max(r["shard_bytes"] for r in engines)
    print(f"  peak bytes a rank allocates beyond its own shards (ZeRO-3 ranks hold {mib(shards[0])}, "
          f"engine ranks {mib(shards[1])}):")
    over = False
    for k in methods:
        if k.startswith("layoutlang"):
            per = [r["methods"][k]["peak_bytes"] for r in reports]
            over |= max(per) > budget
            print(f"    {k:15s} staging peak {mib(max(per))} (budget {mib(budget)}; per rank "
                  f"{', '.join(mib(p) for p in per)})")
    per = [r["methods"]["trl"]["peak_bytes"] for r in reports]
    print(f"    {'trl':15s} {mib(max(r['methods']['trl']['peak_bytes'] for r in zero))} on every ZeRO-3 rank "
          f"(the largest parameter, gathered; rank 0 sends all of it), "
          f"{mib(max(r['methods']['trl']['peak_bytes'] for r in engines))} on each engine rank (received whole) "
          f"[per rank {', '.join(mib(p) for p in per)}]")
    if over:
        print("MISSED: layoutlang staged more than its budget")
    if slower and args.size == "default" and not args.layers:
        print("MISSED: layoutlang is not faster than TRL's path")
    ok = not failed and not over and not (slower and args.size == "default" and not args.layers)
    print("result: " + ("ok" if ok else "WRONG" if failed else "MISSED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
