"""Relays: a 4-rank trainer feeding 16 single-rank engine replicas, busiest link vs the direct plan.

Plan (Llama-3-8B): examples/llama3_8b_train.layout at TP=4, GTP=1, DP=1 (ranks
0-3) -> examples/llama3_8b_infer.layout at TP=1, DP=16 (16 unsharded replicas,
MXFP8 linear weights travelling as bf16), disjoint (AT=4: engine ranks 4-19)
and collocated (AT=0: trainer ranks 0-3 are replicas 0-3). Per case: the
busiest link (per rank the larger of network bytes sent and received) of the
direct plan (`relay=False`: every byte leaves a trainer rank once per replica)
and of the relay plan, its floor (the most bytes one rank must receive), the
relay ops and the deepest relay chain. Target (exit 1 with a MISSED line):
relay / direct <= 0.35 in both cases.

EPLB copies (plan only): DeepSeek-V3 (examples/deepseek_v3_moe.layout at TP=DP=EP=ETP=1:
8 pipeline ranks) -> replan_eplb.py's EPLB engine (TP8 x DP4, EP32 over 256 + 32 physical
experts per MoE layer, a random map), disjoint: the trainer's 8 links carry everything, and
each redundant expert would leave them twice. Printed: direct and relay busiest link, the
relays that forward another slot's copy (copy relays: their `after` op writes another
instance), the tree relays. Target: relay / direct <= 0.9 (the relay stage's own bar).

Gloo (smaller model, same shape): examples/small/llama_train.layout TP=4 ->
examples/small/llama_infer.layout TP=1, DP=16, collocated (16 local processes;
`--gloo-disjoint`: AT=4, 20 processes), refit with and without relays in the same
run; every destination element is checked on every rank (layoutlang/runtime/fill.py
check_destination, through layoutlang/runtime/worker.py), and the busiest link is measured
from the runtime's own byte counters (sent/received per rank). Target: the
refit exact, measured relay / direct <= 0.35. Step times are printed, not
targeted (gloo on 2 shared cores).

    .venv/bin/python benchmarks/relay_scale.py               # ~2 min on 2 cores (16 gloo processes x 2)
    .venv/bin/python benchmarks/relay_scale.py --no-gloo     # the plans only, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.35
GiB = 1 << 30


def plan_case(name: str, at: int) -> bool:
    from layoutlang.compiler import compile_plan

    kw = dict(src_args={"TP": 4, "GTP": 1, "DP": 1}, dst_args={"TP": 1, "DP": 16, "AT": at})
    src, dst = str(ROOT / "examples/llama3_8b_train.layout"), str(ROOT / "examples/llama3_8b_infer.layout")
    direct = compile_plan(src, dst, relay=False, **kw)
    start = time.perf_counter()
    plan = compile_plan(src, dst, **kw)
    stats = plan.stats
    seconds = time.perf_counter() - start
    was = direct.stats["busiest_link_bytes"]
    link, floor = stats["busiest_link_bytes"], stats["link_floor_bytes"]
    ratio = link / was
    depth = max(plan.relay_depths.values(), default=0)
    print(f"plan {name:10s} direct {was / GiB:6.2f} GiB  relay {link / GiB:6.2f} GiB  floor {floor / GiB:6.2f} GiB  "
          f"relay/direct {ratio:.3f}  relay/floor {link / floor:.3f}  relays {stats['relays']}/{stats['ops']} ops, "
          f"depth {depth}, compile {seconds:.2f} s")
    if ratio > TARGET:
        print(f"MISSED: plan {name}: busiest link {ratio:.3f}x the direct plan > {TARGET}")
        return False
    return True


def eplb_case() -> bool:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from replan_eplb import DENSE, SRC, eplb_engine_text, eplb_map

    from layoutlang import load, loads
    from layoutlang.compiler import compile_plan

    sizes = {"L": 61, "E": 256}
    src = load(SRC, {**sizes, "TP": 1, "DP": 1, "EP": 1, "ETP": 1})
    dst = loads(eplb_engine_text(), "eplb.layout", {**sizes, "ENGINE_TP": 8, "ENGINE_DP": 4, "ENGINE_EP": 32,
                                                    "ENGINE_ETP": 1, "AT": src.ranks,
                                                    "EPLB": eplb_map(0, 61 - DENSE, 256, 32)})
    was = compile_plan(src, dst, relay=False).stats["busiest_link_bytes"]
    start = time.perf_counter()
    plan = compile_plan(src, dst)
    seconds = time.perf_counter() - start
    instance = {t.op_id: t.instance for t in plan.transfers()}
    copies = sum(1 for t in plan.transfers() if t.after and instance[t.after[0]] != t.instance)
    link = plan.stats["busiest_link_bytes"]
    ratio = link / was
    print(f"plan eplb       direct {was / GiB:6.2f} GiB  relay {link / GiB:6.2f} GiB  relay/direct {ratio:.3f}  "
          f"copy relays {copies}, tree relays {plan.stats['relays'] - copies} of {plan.stats['ops']} ops, "
          f"compile {seconds:.2f} s")
    if ratio > 0.9:
        print(f"MISSED: plan eplb: busiest link {ratio:.3f}x the direct plan > 0.9")
        return False
    return True


def gloo_case(at: int, steps: int) -> bool:
    from layoutlang.compiler import compile_plan
    from layoutlang.runtime.launch import launch

    src, dst = str(ROOT / "examples/small/llama_train.layout"), str(ROOT / "examples/small/llama_infer.layout")
    src_args, dst_args = {"TP": 4, "GTP": 1, "DP": 1}, {"TP": 1, "DP": 16, "AT": at}
    nproc = compile_plan(src, dst, src_args=src_args, dst_args=dst_args).world
    name = "collocated" if at == 0 else "disjoint"
    links, ok = {}, True
    for relay in (False, True):
        job = {"src": src, "dst": dst, "src_args": src_args, "dst_args": dst_args, "relay": relay,
               "steps": steps}
        results = launch(job, nproc, timeout=300)
        bad = [f"rank {r.rank}: {r.error or r.result.get('check_errors')}" for r in results
               if not r.ok or r.result.get("check_errors")]
        if bad:
            print(f"MISSED: gloo {name} relay={relay}: not exact: {'; '.join(bad[:4])}")
            return False
        links[relay] = max(max(r.result["sent_bytes"], r.result["received_bytes"]) for r in results)
        step = max(statistics.median(r.result["seconds"]) for r in results)
        print(f"gloo {name:10s} relay={str(relay):5s} {nproc} processes: exact on every rank, busiest link "
              f"{links[relay] / (1 << 20):.2f} MiB (measured), step {step * 1000:.0f} ms (median of {steps})")
    ratio = links[True] / links[False]
    print(f"gloo {name:10s} relay/direct busiest link {ratio:.3f} (measured, same run)")
    if ratio > TARGET:
        print(f"MISSED: gloo {name}: busiest link {ratio:.3f}x the direct plan > {TARGET}")
        ok = False
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-gloo", action="store_true", help="plans only")
    ap.add_argument("--gloo-disjoint", action="store_true", help="gloo on 20 processes (engine on ranks 4-19)")
    ap.add_argument("--steps", type=int, default=3, help="refit steps per gloo run")
    args = ap.parse_args(argv)
    ok = plan_case("disjoint", 4) & plan_case("collocated", 0) & eplb_case()
    if not args.no_gloo:
        ok &= gloo_case(4 if args.gloo_disjoint else 0, args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
