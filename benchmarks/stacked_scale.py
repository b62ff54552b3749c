"""Planning a STACKED-experts engine at DeepSeek-V3 scale (issue 10), against the per-expert one.

Trainer `examples/deepseek_v3_moe.layout` (1024 ranks: pp8 x dp64 x tp2, experts pp8 x
ep64 x etp2, one tensor per expert) -> two engines on ranks 1024-1279 that store the
same weights differently:
- per-expert: `examples/deepseek_v3_infer.layout` (one w13/w2 tensor per local expert);
- stacked:    `examples/v2/deepseek_v3_infer_stacked.layout` (vLLM FusedMoE: one
  w13_weight [E_local, 2F, H] and one w2_weight per layer, 256 experts per layer as
  stacked keys, LANGUAGE.md 8.2).
Each figure is the fastest of `--repeat` fresh child processes: load + compile, then
`ops_for_rank(1024)` (one rank) or `plan.ops` (full plan), and the child's peak RSS.
The two plans must move the same bytes in the same number of ops with the same
busiest-sender balance (the engines hold the same data); the stacked one's time is
printed as a ratio of the per-expert one's, measured in the same run.

Targets (exit 1 when missed or when the plans disagree): stacked one rank < 2 s, full
plan < 60 s, peak RSS < 4 GiB.

    .venv/bin/python benchmarks/stacked_scale.py             # ~1 min
    .venv/bin/python benchmarks/stacked_scale.py --quick     # 10 layers x 16 experts, 64 -> 16 ranks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fresh_child import fastest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "examples" / "deepseek_v3_moe.layout"
ENGINES = {"per-expert": ROOT / "examples" / "deepseek_v3_infer.layout",
           "stacked": ROOT / "examples" / "v2" / "deepseek_v3_infer_stacked.layout"}
FULL = ({"L": 61, "E": 256, "TP": 2, "DP": 64, "EP": 64, "ETP": 2},
        {"L": 61, "E": 256, "ENGINE_TP": 8, "ENGINE_DP": 32, "ENGINE_EP": 256, "ENGINE_ETP": 1})
QUICK = ({"L": 10, "E": 16, "TP": 2, "DP": 4, "EP": 4, "ETP": 2},
         {"L": 10, "E": 16, "ENGINE_TP": 4, "ENGINE_DP": 4, "ENGINE_EP": 16, "ENGINE_ETP": 1})

CHILD = r"""
import json, resource, sys, time
from layoutlang.compiler import compile_plan
src, dst, mode, src_args, dst_args, rank = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6])
start = time.perf_counter()
plan = compile_plan(src, dst, src_args=src_args, dst_args=dst_args)
ops = plan.ops_for_rank(rank) if mode == "one" else plan.ops
seconds = time.perf_counter() - start
s = plan.stats
print(json.dumps({"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ops": s["ops"], "mine": len(ops), "bytes": s["bytes"], "balance": s["send_balance"],
                  "templates": s["templates"]}))
"""


def measure(engine: Path, mode: str, src_args: dict, dst_args: dict, rank: int, repeat: int) -> dict:
    return fastest(CHILD, [SRC, engine, mode, json.dumps(src_args), json.dumps(dst_args), rank],
                   f"{engine.name} {mode}", repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes; targets printed, not enforced")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per figure, fastest kept (default 3)")
    args = ap.parse_args(argv)
    src_args, dst_args = QUICK if args.quick else FULL
    at = 64 if args.quick else 1024
    dst_args = {**dst_args, "AT": at}
    rows = {(name, mode): measure(path, mode, src_args, dst_args, at, args.repeat)
            for name, path in ENGINES.items() for mode in ("one", "full")}
    failed = False
    print(f"DeepSeek-V3-style trainer {src_args} -> engine {dst_args}")
    for name in ENGINES:
        one, full = rows[(name, "one")], rows[(name, "full")]
        print(f"  {name:>10}: one rank {one['seconds']:.2f} s ({one['mine']} ops), full plan {full['seconds']:.2f} s "
              f"({full['ops']} ops, {full['templates']} templates), peak RSS {full['rss_mib']:.0f} MiB, busiest "
              f"sender {full['balance']:.3f}x floor, {full['bytes'] / 2**30:.1f} GiB")
    a, b = rows[("per-expert", "full")], rows[("stacked", "full")]
    for what in ("bytes", "ops"):
        if a[what] != b[what]:
            print(f"  WRONG: the engines hold the same data but the plans move {what} {a[what]} vs {b[what]}")
            failed = True
    if abs(a["balance"] - b["balance"]) > 1e-9:
        print(f"  WRONG: busiest sender {a['balance']:.4f}x vs {b['balance']:.4f}x the floor")
        failed = True
    for mode in ("one", "full"):
        ratio = rows[("stacked", mode)]["seconds"] / rows[("per-expert", mode)]["seconds"]
        print(f"  stacked / per-expert, {'one rank' if mode == 'one' else 'full plan'}: {ratio:.2f}x")
    s_one, s_full = rows[("stacked", "one")], rows[("stacked", "full")]
    targets = [(s_one["seconds"] < 2.0, f"stacked one rank {s_one['seconds']:.2f} s (< 2 s)"),
               (s_full["seconds"] < 60.0, f"stacked full plan {s_full['seconds']:.2f} s (< 60 s)"),
               (s_full["rss_mib"] < 4096, f"stacked peak RSS {s_full['rss_mib']:.0f} MiB (< 4 GiB)")]
    for ok, text in targets:
        print(f"  {'ok' if ok else ('MISSED' if not args.quick else 'missed (quick: not enforced)')}: {text}")
        failed |= not ok and not args.quick
    print("result: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
