"""Plan-compiler scale: DeepSeek-V3 (61 layers x 256 experts), 1024 trainer ranks -> 256 engine ranks.

Source `examples/deepseek_v3_moe.layout --set DP=64 --set EP=64` (pp8 x dp64 x tp2;
experts pp8 x ep64 x etp2), destination `examples/deepseek_v3_infer.layout` (TP8 x DP32,
experts EP256, MXFP8) on ranks 1024-1279 (`--at 1024`, the default: disjoint, so every
byte crosses the network and the busiest-sender ratio measures the sender choice alone;
`--at 0` collocates the engine with the trainer's first 256 ranks).

Printed, in one run, each figure measured in a fresh child process (cold caches, its
own peak RSS):
- templates planner (`compile_plan`, balanced selector): full plan (load + compile +
  building `plan.ops`), one rank's plan (load + compile + `ops_for_rank(r)` for the
  rank with the most ops), peak memory (ru_maxrss growth over the child's RSS after
  imports; and tracemalloc's peak in a separate traced run), op count, busiest sender
  / floor (DESIGN.md: busiest network sender / (total bytes / usable senders));
- the same with `selector="round_robin"` (Megatron-LM's refit rule);
- the naive per-(tensor, rank) planner (benchmarks/naive_planner.py), once, on every
  tensor (about 3 minutes at full size on 2 cores). `--naive-layers N` runs it on a
  deterministic subset instead, the non-layer tensors and layers 0..N-1 (N=5: the 3
  dense + 2 MoE layers), and ESTIMATES the full time: measured non-layer and dense-layer
  times + the mean MoE-layer time x the number of MoE layers (the MoE layers are
  identical in shape and in how many ranks hold them); the output says so. Its pieces
  (a digest of every (dst rank, name, slice)) are compared with the real planner's;
- a lower bound on the busiest sender computed from the two LAYOUTS alone
  (`layout_holders`: which source ranks hold each destination element, from the
  TensorIR's ranks and runs; never the planner's candidate sets), and the total bytes
  and usable senders the same way, which must equal the plan's.

Exit status 1 on a wrong result (pieces DIFFERENT from the naive planner's, a plan
below the lower bound, totals that disagree with the layouts) or, at full size, a
MISSED target (naive / templates >= 20x, one rank < 2 s, full plan < 60 s, memory
< 4 GiB); `--quick` prints the targets without enforcing them.

    .venv/bin/python benchmarks/plan_scale.py            # full size, ~4 min (most of it the naive planner)
    .venv/bin/python benchmarks/plan_scale.py --naive-layers 5   # ~1 min, naive estimated
    .venv/bin/python benchmarks/plan_scale.py --quick    # 10 layers x 16 experts, 64 -> 16 ranks, < 30 s
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "examples" / "deepseek_v3_moe.layout"
DST = ROOT / "examples" / "deepseek_v3_infer.layout"

FULL = {"common": {"L": 61, "E": 256},
        "src": {"TP": 2, "DP": 64, "EP": 64, "ETP": 2},  # 1024 ranks
        "dst": {"ENGINE_TP": 8, "ENGINE_DP": 32, "ENGINE_EP": 256, "ENGINE_ETP": 1}}  # 256 ranks
QUICK = {"common": {"L": 10, "E": 16},
         "src": {"TP": 2, "DP": 4, "EP": 4, "ETP": 2},  # 64 ranks
         "dst": {"ENGINE_TP": 8, "ENGINE_DP": 2, "ENGINE_EP": 16, "ENGINE_ETP": 1}}  # 16 ranks

LAYER = re.compile(r"model\.layers\.(\d+)\.")  # HF keys; the engine's names too
GIB = 2**30


# ---- in the child process ----------------------------------------------------------

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _in_subset(key: str, layers: int) -> bool:
    m = LAYER.match(key)
    return layers <= 0 or m is None or int(m.group(1)) < layers


def _digest(items) -> str:
    h = hashlib.sha256()
    for item in sorted(items):
        h.update(repr(item).encode())
    return h.hexdigest()[:16]


def _load(spec):
    from layoutlang import load
    src = load(SRC, {**spec["sizes"]["common"], **spec["sizes"]["src"]}, unknown_args="ignore")
    dst = load(DST, {**spec["sizes"]["common"], **spec["sizes"]["dst"], "AT": spec["at"]},
               unknown_args="ignore")
    return src, dst


def child(spec: dict) -> dict:
    import layoutlang.compiler  # noqa: F401 - imports are not part of the figures
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import naive_planner  # noqa: F401
    from layoutlang.compiler import compile_plan

    kind, out = spec["kind"], {}
    if kind == "traced":
        import tracemalloc
        tracemalloc.start()
    base = _rss_kib()
    c0, t0 = time.process_time(), time.perf_counter()
    src, dst = _load(spec)
    t1 = time.perf_counter()
    out["load_s"] = t1 - t0
    if kind in ("full", "traced", "rank"):
        # the bf16 wire: the naive planner and the lower bound count bf16 bytes (the quantized wire
        # changes bytes, not pieces: benchmarks/quantized_wire.py)
        plan = compile_plan(src, dst, selector=spec["selector"], wire="bf16")
        t2 = time.perf_counter()
        out["compile_s"] = t2 - t1
        if kind == "rank":
            ops = plan.ops_for_rank(spec["rank"])
            out["rank_ops"] = len(ops)
        else:
            ops = plan.ops
        t3 = time.perf_counter()
        out["ops_s"] = t3 - t2
        out["cpu_s"] = time.process_time() - c0
        out["rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        if kind == "traced":
            out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        stats = plan.stats
        out["stats_s"] = time.perf_counter() - t3
        out.update(ops=stats["ops"], templates=stats["templates"], tensors=stats["tensors"],
                   bytes=stats["bytes"], send_balance=stats["send_balance"],
                   max_send_bytes=stats["max_send_bytes"], usable=stats["usable_senders"],
                   busiest_sender=stats["busiest_sender"])
        if kind == "full":
            count = [0] * plan.world
            for op in ops:
                count[op.src_rank] += 1
                if op.dst_rank != op.src_rank:
                    count[op.dst_rank] += 1
            busiest = max(range(plan.world), key=lambda r: (count[r], -r))
            out["busy_rank"], out["busy_rank_ops"] = busiest, count[busiest]
            layers = spec["naive_layers"]
            sub = [(o.dst_rank, o.dst_name, o.dst_slice) for o in ops if _in_subset(o.key, layers)]
            out["subset_ops"], out["subset_digest"] = len(sub), _digest(sub)
            out["floor_bytes"] = stats["send_floor_bytes"]
    elif kind == "bound":
        held = layout_holders(src, dst)
        out["bound_bytes"] = send_lower_bound(held["by_set"])
        out["layout_bytes"], out["layout_usable"] = held["bytes"], len(held["usable"])
        out["bound_s"] = time.perf_counter() - t1
    elif kind == "naive":
        from naive_planner import NaivePlan
        layers = spec["naive_layers"]
        per_layer: dict[str, float] = {}

        def timer(t, seconds):
            m = LAYER.match(t.key)
            label = "global" if m is None else m.group(1)
            per_layer[label] = per_layer.get(label, 0.0) + seconds

        plan = NaivePlan(src, dst, selector=spec["selector"],
                         dst_filter=lambda t: _in_subset(t.key, layers), timer=timer)
        t2 = time.perf_counter()
        out["plan_s"] = t2 - t1
        out["cpu_s"] = time.process_time() - c0
        out["rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        s = plan.stats
        out.update(ops=s["ops"], bytes=s["bytes"], send_balance=s["send_balance"],
                   max_send_bytes=s["max_send_bytes"], usable=s["usable_senders"])
        out["subset_digest"] = _digest((o.dst_rank, o.dst_name, o.dst_slice) for o in plan.ops)
        out["per_layer_s"] = per_layer
        # which layers are MoE (hold routed experts), from the destination layout
        moe, all_layers = set(), set()
        for t in dst.tensors:
            m = LAYER.match(t.key)
            if m:
                all_layers.add(m.group(1))
                if ".mlp.experts." in t.key:
                    moe.add(m.group(1))
        out["moe_layers"], out["layers"] = sorted(moe, key=int), sorted(all_layers, key=int)
    return out


WIRE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # a quantized destination travels as bf16 (LANGUAGE.md 4)
QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "mxfp8", "fp8_b128", "mxfp4", "nvfp4")  # written out: independent of the vocabulary


def _intervals(runs) -> tuple[tuple[int, int], ...]:
    """The logical intervals one dim's runs hold (padding runs hold none)."""
    return tuple((r.logical_start, r.logical_start + r.length) for r in runs if hasattr(r, "logical_start"))


def _cover_classes(dst_iv, shard_ivs) -> dict[frozenset, int]:
    """One dim: {set of shards holding a stretch: elements of the destination's intervals in such stretches}."""
    cuts = sorted({x for a, b in dst_iv for x in (a, b)} | {x for ivs in shard_ivs for a, b in ivs for x in (a, b)})
    out: dict[frozenset, int] = {}
    for lo, hi in zip(cuts, cuts[1:]):
        if not any(a <= lo and hi <= b for a, b in dst_iv):
            continue
        who = frozenset(j for j, ivs in enumerate(shard_ivs) if any(a <= lo and hi <= b for a, b in ivs))
        out[who] = out.get(who, 0) + hi - lo
    return out


def layout_holders(src, dst) -> dict:
    """From the two layouts only (TensorIR ranks and runs, no planner): network bytes per set of
    source ranks that hold them, and the totals the plan must show.

    For every destination instance and rank, the logical box it holds is cut, dim by dim,
    at every source shard's run boundaries; a cell is held by the source shards that cover
    it in every dim, i.e. by the union of their ranks. A cell the receiver holds itself
    can be a local copy (no link); any other cell must leave one of its holders.
    Returns {"by_set": {frozenset(ranks): bytes}, "bytes": all bytes (local included),
    "usable": source ranks holding any data of a destination key}.
    """
    from naive_planner import key_runs  # a key's runs inside its stored tensor (LANGUAGE.md 8)

    by_key = src.key_index  # key -> ((stored instance, region or None), ...)
    by_set: dict[frozenset, int] = {}
    total, usable, memo = 0, set(), {}
    for t, region in ((t, r) for t in dst.tensors for r in ((None,) if t.regions is None else t.regions)):
        key = t.key if region is None else region.key
        shards: dict[tuple, list[int]] = {}  # (instance, runs) -> ranks: replicas share one entry
        for i, (s, s_region) in enumerate(by_key[key]):
            for q in s.ranks():
                held = key_runs(s, s_region, q)
                if held is not None:
                    shards.setdefault((i, held[0]), []).append(q)
        shard_list = list(shards.items())
        for (_, runs), ranks in shard_list:
            if all(_intervals(d) for d in runs):
                usable.update(ranks)
        wire = 2 if t.dtype in QUANTIZED else WIRE_BYTES[t.dtype]
        for r in t.ranks():
            held = key_runs(t, region, r)
            if held is None:
                continue
            druns = held[0]
            key = (druns, tuple(runs for (_, runs), _ in shard_list))
            cells = memo.get(key)
            if cells is None:
                per_dim = [_cover_classes(_intervals(d), [_intervals(runs[k]) for (_, runs), _ in shard_list])
                           for k, d in enumerate(druns)]
                cells = {}
                for combo in itertools.product(*(c.items() for c in per_dim)):
                    who = frozenset.intersection(*(w for w, _ in combo)) if combo else frozenset(range(len(shard_list)))
                    n = math.prod(length for _, length in combo)
                    if not who:
                        raise SystemExit(f"{key}: destination rank {r} holds elements no source rank holds")
                    cells[who] = cells.get(who, 0) + n
                memo[key] = cells
            for who, n in cells.items():
                holders = frozenset(q for j in who for q in shard_list[j][1])
                total += n * wire
                if r not in holders:
                    by_set[holders] = by_set.get(holders, 0) + n * wire
    return {"by_set": by_set, "bytes": total, "usable": sorted(usable)}


def send_lower_bound(by_set: dict[frozenset, int]) -> float:
    """A lower bound on the busiest sender's network bytes: for a group of ranks C, the
    bytes that only ranks of C hold must leave through C, so some rank sends at least
    bytes(C) / |C|. Checked for every distinct holder set (with the sets inside it)
    and every connected group of overlapping sets (a pipeline stage's replicas)."""
    bound = 0.0
    sets = sorted(by_set, key=len)
    for c in sets:
        inside = sum(b for d, b in by_set.items() if len(d) <= len(c) and d <= c)
        bound = max(bound, inside / len(c))
    parent: dict[int, int] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for c in sets:
        first = min(c)
        for r in c:
            parent[find(r)] = find(first)
    groups: dict[int, list] = {}
    for c, b in by_set.items():
        g = groups.setdefault(find(min(c)), [set(), 0])
        g[0] |= c
        g[1] += b
    for ranks, b in groups.values():
        bound = max(bound, b / len(ranks))
    return bound


# ---- the driver ---------------------------------------------------------------------

def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"child {spec['kind']} ({spec['selector']}) failed with {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate_naive(r: dict) -> tuple[float, str]:
    """Full naive planning time from a subset run, and how it was obtained."""
    per, moe, layers = r["per_layer_s"], r["moe_layers"], r["layers"]
    measured = [l for l in layers if l in per]
    if len(measured) == len(layers):
        return r["plan_s"], "measured on every tensor"
    moe_measured = [l for l in measured if l in moe]
    if not moe_measured:
        raise SystemExit("the naive subset holds no MoE layer: raise --naive-layers")
    dense_missing = [l for l in layers if l not in per and l not in moe]
    if dense_missing:
        raise SystemExit(f"the naive subset misses dense layers {dense_missing}: raise --naive-layers")
    moe_mean = sum(per[l] for l in moe_measured) / len(moe_measured)
    fixed = sum(v for k, v in per.items() if k == "global" or k not in moe)
    estimate = fixed + moe_mean * len(moe)
    how = (f"ESTIMATED from a subset: non-layer tensors + layers 0..{int(measured[-1])} measured "
           f"({r['plan_s']:.1f} s); mean MoE layer {moe_mean:.2f} s x {len(moe)} MoE layers "
           f"+ {fixed:.1f} s non-layer and dense")
    return estimate, how


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke), < 30 s")
    parser.add_argument("--at", type=int, default=None,
                        help="first engine rank (default: right after the trainer's ranks)")
    parser.add_argument("--naive-layers", type=int, default=None,
                        help="naive planner on the non-layer tensors and the first N layers only, "
                             "its full time estimated from them (e.g. 5: 3 dense + 2 MoE layers, "
                             "~20 s instead of ~4 min); default 0: every tensor, measured")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive planner")
    parser.add_argument("--repeat", type=int, default=3,
                        help="fresh processes per templates-planner figure; the fastest is shown")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        print(json.dumps(child(json.loads(ns.child))))
        return 0

    sizes = QUICK if ns.quick else FULL
    src_ranks = 8 * sizes["src"]["DP"] * sizes["src"]["TP"]
    dst_ranks = sizes["dst"]["ENGINE_DP"] * sizes["dst"]["ENGINE_TP"]
    at = src_ranks if ns.at is None else ns.at
    layers = ns.naive_layers if ns.naive_layers is not None else 0
    base = {"sizes": sizes, "at": at, "naive_layers": layers}
    started = time.perf_counter()
    print(f"DeepSeek-V3-style MoE, {sizes['common']['L']} layers x {sizes['common']['E']} experts: "
          f"trainer {src_ranks} ranks {sizes['src']} -> engine {dst_ranks} ranks {sizes['dst']} "
          f"at {at} ({'disjoint' if at >= src_ranks else 'collocated'})")

    def best(spec):  # the fastest of --repeat fresh processes (the machine is shared)
        runs = [run_child(spec) for _ in range(ns.repeat)]
        return min(runs, key=lambda r: r["load_s"] + r["compile_s"] + r["ops_s"])

    res = {}
    for sel in ("balanced", "round_robin"):
        full = best({**base, "kind": "full", "selector": sel})
        rank = best({**base, "kind": "rank", "selector": sel, "rank": full["busy_rank"]})
        res[sel] = (full, rank)
    traced = run_child({**base, "kind": "traced", "selector": "balanced"})
    naive = None if ns.no_naive else run_child({**base, "kind": "naive", "selector": "balanced"})

    print(f"\n{res['balanced'][0]['tensors']} destination tensors, {res['balanced'][0]['templates']} "
          f"templates, {res['balanced'][0]['ops']} ops, {res['balanced'][0]['bytes'] / GIB:.1f} GiB, "
          f"{res['balanced'][0]['usable']} usable senders")
    print(f"{'planner':<26}{'full plan':>11}{'(load':>8}{'compile':>9}{'ops)':>7}{'cpu':>8}"
          f"{'one rank':>10}{'cpu':>8}{'RSS +':>10}{'ops':>9}{'busiest':>9}")
    for sel, label in (("balanced", "templates, balanced"), ("round_robin", "templates, round robin")):
        f, r = res[sel]
        total = f["load_s"] + f["compile_s"] + f["ops_s"]
        one = r["load_s"] + r["compile_s"] + r["ops_s"]
        print(f"{label:<26}{total:>10.2f}s{f['load_s']:>8.2f}{f['compile_s']:>9.2f}{f['ops_s']:>7.2f}"
              f"{f['cpu_s']:>7.2f}s{one:>9.2f}s{r['cpu_s']:>7.2f}s{f['rss_mib']:>7.0f} MiB{f['ops']:>9}"
              f"{f['send_balance']:>8.3f}x")
    f, r = res["balanced"]
    print(f"one rank = rank {f['busy_rank']} (most ops: {r['rank_ops']} sent or received): "
          f"load {r['load_s']:.2f} s + compile {r['compile_s']:.2f} s + ops_for_rank {r['ops_s']:.3f} s "
          f"-> {'load + compile' if r['ops_s'] < r['load_s'] + r['compile_s'] else 'ops_for_rank'} dominates")
    wrong: list[str] = []  # a result that is wrong: always a failure
    missed: list[str] = []  # a stated target missed: a failure at full size
    bound = run_child({**base, "kind": "bound", "selector": "balanced"})
    if (bound["layout_bytes"], bound["layout_usable"]) != (f["bytes"], f["usable"]):
        wrong.append(f"the layouts say {bound['layout_bytes']} B from {bound['layout_usable']} usable senders, "
                     f"the plan {f['bytes']} B from {f['usable']}")
    floor = bound["layout_bytes"] / bound["layout_usable"]
    # disjoint: every byte crosses the network, so the even spread is a bound too
    lower = max(floor, bound["bound_bytes"]) if at >= src_ranks else bound["bound_bytes"]
    print(f"busiest sender lower bound, from the layouts alone: {lower / floor:.3f}x floor (bytes that only "
          f"a group of ranks holds / its size, best group; floor {floor / GIB:.2f} GiB; "
          f"{bound['bound_s']:.1f} s): balanced is {f['max_send_bytes'] / lower:.3f}x the bound, round robin "
          f"{res['round_robin'][0]['max_send_bytes'] / lower:.3f}x")
    for sel in ("balanced", "round_robin"):
        if res[sel][0]["max_send_bytes"] < lower * (1 - 1e-9):
            wrong.append(f"{sel}: busiest sender {res[sel][0]['max_send_bytes']} B is below the lower bound "
                         f"{lower:.0f} B (the plan or the bound is wrong)")
    print(f"memory: ru_maxrss growth over the child's RSS after imports {f['rss_mib']:.0f} MiB "
          f"(full plan, ops built); tracemalloc peak {traced['traced_peak_mib']:.0f} MiB "
          f"(separate traced run, Python allocations only)")
    if naive:
        est, how = estimate_naive(naive)
        planning = f["compile_s"] + f["ops_s"]
        print(f"{'naive per-(tensor, rank)':<26}{naive['load_s'] + est:>10.2f}s{naive['load_s']:>8.2f}"
              f"{est:>16.2f}{naive['cpu_s']:>7.2f}s{'':>18}{naive['rss_mib']:>7.0f} MiB{naive['ops']:>9}"
              f"{naive['send_balance']:>8.3f}x")
        print(f"naive: {how}")
        if naive["ops"] != f["ops"]:
            print(f"naive: its op count, memory and busiest sender are for the subset only "
                  f"({naive['ops']} ops; the templates planner has {f['subset_ops']} on the same subset); "
                  f"it has no per-rank shortcut (a balanced choice depends on every earlier request)")
        same = naive["subset_digest"] == f["subset_digest"]
        where = "on every tensor" if layers <= 0 else f"on the subset (non-layer tensors, layers 0..{layers - 1})"
        print(f"naive vs templates pieces (dst rank, name, slice) {where}: "
              f"{'IDENTICAL' if same else 'DIFFERENT'} (digest {naive['subset_digest']} / {f['subset_digest']})")
        if not same:
            wrong.append("the naive planner's pieces differ from the templates planner's")

    def target(ok: bool, what: str) -> str:
        if ok:
            return "ok"
        if ns.quick:
            return "(not enforced: --quick)"
        missed.append(what)
        return "MISSED"

    print("\nratios (target" + ("s are for the full size; --quick is a smoke run" if ns.quick else "s") + "):")
    if naive:
        speedup = est / planning
        print(f"  naive / templates, planning time (compile + ops, load excluded): "
              f"{speedup:.0f}x (>= 20x){'' if naive['ops'] == f['ops'] else ' [naive estimated]'} "
              f"{target(speedup >= 20, 'naive / templates planning time >= 20x')}")
        print(f"  naive / templates, with load: {(naive['load_s'] + est) / (f['load_s'] + planning):.0f}x"
              + (f"; in CPU time (load included): {naive['cpu_s'] / f['cpu_s']:.0f}x" if naive["ops"] == f["ops"] else ""))
    one = r["load_s"] + r["compile_s"] + r["ops_s"]
    total = f["load_s"] + f["compile_s"] + f["ops_s"]
    print(f"  one rank's plan: {one:.2f} s wall, {r['cpu_s']:.2f} s CPU (< 2 s) {target(one < 2, 'one rank < 2 s')}")
    print(f"  full plan: {total:.2f} s wall, {f['cpu_s']:.2f} s CPU (< 60 s) {target(total < 60, 'full plan < 60 s')}")
    peak = max(f["rss_mib"], traced["traced_peak_mib"])
    print(f"  memory: {peak / 1024:.2f} GiB (< 4 GiB) {target(peak < 4096, 'memory < 4 GiB')}")
    rr = res["round_robin"][0]
    print(f"  round robin busiest sender / balanced: {rr['send_balance']:.2f}x / "
          f"{f['send_balance']:.3f}x floor = {rr['max_send_bytes'] / max(1, f['max_send_bytes']):.1f}x "
          f"the bytes on the busiest link ({rr['max_send_bytes'] / GIB:.2f} vs "
          f"{f['max_send_bytes'] / GIB:.2f} GiB)")
    load = os.getloadavg()[0]
    print(f"\nwall time of this benchmark: {time.perf_counter() - started:.0f} s; load average now "
          f"{load:.1f} on {os.cpu_count()} CPUs" + (" (a busy machine: wall times are inflated, "
                                                    "see the CPU times)" if load > (os.cpu_count() or 1) else ""))
    for w in wrong:
        print(f"WRONG: {w}", file=sys.stderr)
    for m in missed:
        print(f"MISSED: {m}", file=sys.stderr)
    print("result: " + ("ok" if not (wrong or missed) else
                        f"{len(wrong)} wrong result(s), {len(missed)} missed target(s)"))
    return 1 if wrong or missed else 0

if __name__ == "__main__":
    sys.exit(main())
