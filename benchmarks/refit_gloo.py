"""Refit runtime on local gloo processes: layoutlang vs naive all-gather vs DTensor vs hand p2p.

One command, in one run, on 4 and on 8 local gloo processes (127.0.0.1, a free
port, a hard timeout; every worker process is killed when the run ends, however
it ends). Per world size W the tensor-parallel degrees scale with W (k = W/4):

    tp4-tp2-d0     TP4k -> TP2k, split on dim 0        (destination on the first 2k ranks)
    tp4-tp2-d1     TP4k -> TP2k, split on dim 1
    tp2-tp4        TP2k -> TP4k                         (source on the first 2k ranks only)
    tp2dp2-tp4     TP2k x DP2 replicas -> TP4k          (replicas share the sending)
    gtp            TP2k x GTP2 -> TP2k, Megatron fc1 `[(gate | up) over tp chunk gtp, C]`
    tp4-tp2dp2     TP4k -> TP2k x DP2 (a collocated engine with two replicas; DTensor can say it)

with N weights of [R, C] bf16 each (defaults: N = W, [4096, 4096]: 128 MiB of
weights at W=4, 256 MiB at W=8, so every rank holds the same bytes at both). The `.layout` texts are written to a temporary directory; every
worker compiles the same plan from them. Methods (benchmarks/refit_gloo_worker.py):
layoutlang `Refitter.refit`; naive all-gather + cat + slice (what RL frameworks
do); DTensor `redistribute` where one DeviceMesh and Shard/Replicate placements
express both layouts (the output says why not elsewhere); hand-written
isend/irecv of the plan's slices with buffers allocated before timing.

Steady state: one warm-up step, then K steps (`--steps`), each between two
barriers (so a step's time is the slowest rank's), the methods taking turns
step by step in a balanced order (`round_order`); the figure printed is the median of the K (`--steps` 25 for
layoutlang and hand p2p, `--slow-steps` 3 for naive and DTensor, which take
about a second each). "layoutlang" is `Refitter(plan, steady=True)`: no store meeting
after the first step, and from step 3 on a replay of step 2's recorded copies,
posts and waits (docs/runtime.md "Before a byte moves", items 4 and 5), the like
of the hand-written exchange, which checks nothing; "hand again" is a second
hand exchange, the same work in the same rotation: hand again / hand is what
this run's noise does to two equal methods; "meeting ll" is the default
`Refitter(plan)`, with an agreement and a fence (store meetings) every step, and
"(agree + fence)" the part of its step spent in `Refitter._agree` (pre-flight
plan/shape check) and `Refitter._meet` after the last bucket (the step's fence) on
the rank whose transfers took longest. Where a target is missed (naive/layoutlang >= 2x on the first
case, layoutlang/hand <= 1.0x everywhere, whatever the noise) the paired figures of layoutlang and
hand again with a 95 % interval of each one's median (order statistics, no assumption on how
steps spread: an interval that holds 1.0 is a miss this run cannot tell from noise), the
Refitter's phases and a cProfile of one step are printed, and at the default sizes the run exits 1 (as it does,
at any size, on a wrong result or a failed rank). Every method writes into the same destination
tensors (the same memory: where the allocator would place a method's own tensors is no difference
between the methods). Correctness (untimed, once per case): per method, one more step into NaN-filled
destinations, checked element by element with `layoutlang.runtime.fill.check_destination`.
The run's last line pools every round of every case: the median of all paired
ratios of layoutlang and of hand again to hand p2p, each with its 95 % interval.
"Net MiB" is network bytes summed over ranks per step (layoutlang: the plan's;
naive: all-gather and broadcast receipts). Local copies are not counted.

    .venv/bin/python benchmarks/refit_gloo.py                  # W=4 and W=8, ~9 min on 2 cores
    .venv/bin/python benchmarks/refit_gloo.py --worlds 4 --tensors 2 --rows 1024 --cols 1024   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "refit_gloo_worker.py"
MIB = 2**20
TARGET_NAIVE = 2.0    # naive / layoutlang on the first case, at least
TARGET_HAND = 1.0     # layoutlang / hand p2p, at most (issue 12)


# ---- cases ---------------------------------------------------------------------------

def _layout(name: str, mesh: str, dim: str, n: int, r: int, c: int) -> str:
    return (f"layout {name}\nconst R = {r}, C = {c}\nmesh {mesh}\n"
            f"for i in 0..{n} {{\n  tensor layers.{{i}}.weight [{dim}]\n}}\n")


def cases(world: int, n: int, r: int, c: int) -> list[dict]:
    """(name, label, source text, destination text, DTensor spec or why not) per case."""
    if world % 4:
        raise SystemExit(f"--worlds: {world} is not a multiple of 4 (the cases scale TP by world/4)")
    k = world // 4
    t2, t4 = 2 * k, 4 * k
    rows, cols = "R over tp, C", "R, C over tp"
    gtp_src, gtp_dst = "(gate: R/2 | up: R/2) over tp chunk gtp, C", "(gate: R/2 | up: R/2) over tp, C"
    other_mesh = (f"the source spans ranks 0-{t4 - 1} and the destination ranks 0-{t2 - 1}: two different "
                  "meshes; DTensor.redistribute only changes placements within one DeviceMesh")
    return [
        {"name": "tp4-tp2-d0", "label": f"TP{t4} -> TP{t2}, dim 0",
         "src": _layout("train", f"train (tp={t4})", rows, n, r, c),
         "dst": _layout("infer", f"infer (tp={t2})", rows, n, r, c), "dtensor": None, "why_not": other_mesh},
        {"name": "tp4-tp2-d1", "label": f"TP{t4} -> TP{t2}, dim 1",
         "src": _layout("train", f"train (tp={t4})", cols, n, r, c),
         "dst": _layout("infer", f"infer (tp={t2})", cols, n, r, c), "dtensor": None, "why_not": other_mesh},
        {"name": "tp2-tp4", "label": f"TP{t2} -> TP{t4}",
         "src": _layout("train", f"train (tp={t2})", rows, n, r, c),
         "dst": _layout("infer", f"infer (tp={t4})", rows, n, r, c), "dtensor": None,
         "why_not": f"the source lives on ranks 0-{t2 - 1} only, the destination on 0-{t4 - 1}: a DTensor "
                    "must have a local shard on every rank of its mesh, so the two are different meshes"},
        {"name": "tp2dp2-tp4", "label": f"TP{t2} x DP2 -> TP{t4}",
         "src": _layout("train", f"train (dp=2, tp={t2})", rows, n, r, c),
         "dst": _layout("infer", f"infer (tp={t4})", rows, n, r, c),
         "dtensor": {"mesh": [2, t2], "names": ["dp", "tp"], "src": ["R", "S0"], "dst": ["S0", "S0"]}},
        {"name": "gtp", "label": f"TP{t2} x GTP2 -> TP{t2}, (gate|up)",
         "src": _layout("train", f"train (gtp=2, tp={t2})", gtp_src, n, r, c),
         "dst": _layout("infer", f"infer (tp={t2})", gtp_dst, n, r, c), "dtensor": None,
         "why_not": "no DTensor placement says a strided `(gate | up) over tp` split (each rank holds a piece of "
                    "every part) nor GTP's `chunk gtp` of a rank's local storage; the destination is also a "
                    f"{t2}-rank mesh inside the {world}-rank source mesh"},
        {"name": "tp4-tp2dp2", "label": f"TP{t4} -> TP{t2} x DP2",
         "src": _layout("train", f"train (tp={t4})", rows, n, r, c),
         "dst": _layout("infer", f"infer (dp=2, tp={t2})", rows, n, r, c),
         "dtensor": {"mesh": [2, t2], "names": ["dp", "tp"], "src": ["S0", "S0"], "dst": ["R", "S0"]}},
    ]


# ---- the order of the methods in a round ---------------------------------------------------

def round_order(methods: list[str], i: int, before: str | None = None) -> list[str]:
    """The order of round `i` (from 0): row i of a Williams design over `methods`, so that over
    n rounds (2n for odd n) each method takes every position equally often and follows every
    other method equally often (a method warming the caches for the next, or a load drift
    within a round, favours none). Row 0 is 0, 1, n-1, 2, n-2, ...; row i adds i (mod n); for
    odd n rows n to 2n-1 are rows 0 to n-1 reversed. `before`: the method that ran last in
    the previous round, which never runs twice in a row (the row is turned by one if it would)."""
    n = len(methods)
    if n < 2:
        return list(methods)
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [(j + i) % n for j in first]
    if n % 2 and (i // n) % 2:
        row.reverse()
    order = [methods[j] for j in row]
    if order[0] == before:
        order = order[1:] + order[:1]
    return order


# ---- launching -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _Terminated()


def launch(job: dict, world: int, tmp: Path, timeout: float) -> tuple[list[dict | None], list[str], bool]:
    """Run the job on `world` local gloo workers; (results, stderr tails, timed out). No worker outlives it."""
    job_path = tmp / f"job{world}.json"
    job_path.write_text(json.dumps(job))
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                       GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
            err = open(tmp / f"stderr{world}-{rank}.txt", "w")
            procs.append((subprocess.Popen(
                [sys.executable, str(WORKER), str(job_path), str(tmp / f"out{world}-{rank}.json")],
                env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True), err))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                time.sleep(2.0)  # a rank failed: give the others a moment to write what they have
                break
            time.sleep(0.1)
        timed_out = any(p.poll() is None for p, _ in procs)
    finally:
        for p, err in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            err.close()
    results, errs = [], []
    for rank in range(world):
        out = tmp / f"out{world}-{rank}.json"
        results.append(json.loads(out.read_text()) if out.exists() else None)
        errs.append("\n".join((tmp / f"stderr{world}-{rank}.txt").read_text().strip().splitlines()[-5:]))
    return results, errs, timed_out


# ---- reporting -------------------------------------------------------------------------

def _steps(per_rank: list[list[float]]) -> list[float]:
    """Each step's time: the max over ranks."""
    return [max(ts) for ts in zip(*per_rank)]


def _step_time(per_rank: list[list[float]]) -> tuple[float, float]:
    """(median, best) over steps of the max over ranks."""
    steps = _steps(per_rank)
    return statistics.median(steps), min(steps)


def _paired(steps: list[float], base: list[float]) -> float | None:
    """The median over rounds of one method's step / the base's step of the same round: two
    methods timed turn by turn meet the same load in a round, so a drift of the machine's load
    during the case cancels here, where the ratio of the two medians keeps it."""
    ratios = _paired_ratios(steps, base)
    return statistics.median(ratios) if ratios else None


def _median_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of `values` (order statistics): with n
    values sorted, [x_k, x_(n+1-k)] (1-based) for the largest k with P(Binomial(n, 1/2) < k)
    <= (1 - level) / 2. It assumes nothing of how a step's time spreads; None when n is too
    small for the level (n < 6 at 95 %)."""
    n, tail = len(values), (1.0 - level) / 2.0
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2.0**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def _paired_ratios(steps: list[float], base: list[float]) -> list[float]:
    return [a / b for a, b in zip(steps, base) if b]


def summarize(world: int, specs: list[dict], results: list[dict | None]) -> list[dict]:
    rows = []
    done = [r for r in results if r is not None]
    n_cases = min((len(r["cases"]) for r in done), default=0) if len(done) == len(results) else 0
    rate = next((r.get("link_bytes_per_s") for r in done if r.get("link_bytes_per_s")), None)
    for i in range(n_cases):
        spec, per_rank = specs[i], [r["cases"][i] for r in results]
        row = {"case": spec["name"], "label": spec["label"], "world": world,
               "plan_ms": 1e3 * max(c["plan_seconds"] for c in per_rank),
               "ll_net_mib": per_rank[0]["plan_stats"]["network_bytes"] / MIB,
               "ll_local_mib": per_rank[0]["plan_stats"]["local_bytes"] / MIB,
               "naive_net_mib": sum(c["methods"]["naive"]["recv_bytes"] for c in per_rank) / MIB,
               "why_not": spec.get("why_not"), "errors": [], "ms": {}, "best_ms": {},
               # the one-way byte floor: the busiest link's bytes (per rank the larger of network bytes
               # sent and received) at the measured rate of one link (rank 0 -> 1, 64 MiB)
               "floor_ms": (1e3 * per_rank[0]["plan_stats"]["busiest_link_bytes"] / rate) if rate else None}
        for m in ("layoutlang", "layoutlang_meet", "naive", "dtensor", "hand_p2p", "hand_again"):
            if m not in per_rank[0]["methods"]:
                continue
            med, best = _step_time([c["methods"][m]["seconds"] for c in per_rank])
            row["ms"][m], row["best_ms"][m] = 1e3 * med, 1e3 * best
            row["errors"] += [f"{m}: {e}" for c in per_rank for e in c["methods"][m]["errors"]]
        hand = _steps([c["methods"]["hand_p2p"]["seconds"] for c in per_rank])
        row["paired"], row["paired_ratios"], row["paired_interval"] = {}, {}, {}
        for m in ("layoutlang", "hand_again"):
            steps = _steps([c["methods"][m]["seconds"] for c in per_rank])
            row["paired"][m] = _paired(steps, hand)
            row["paired_ratios"][m] = _paired_ratios(steps, hand)
            row["paired_interval"][m] = _median_interval(row["paired_ratios"][m])
        row["phases"] = {k: max(c["phases"].get(k, 0.0) for c in per_rank) for k in per_rank[0]["phases"]}
        busiest = per_rank[0]["plan_stats"]["busiest_receiver"]
        row["profile_rank"] = busiest
        row["profile"] = per_rank[busiest]["methods"]["layoutlang"]["profile"]
        parts = [c["methods"]["layoutlang"]["parts"] for c in per_rank]
        # The rank on the critical path: the one whose transfers took longest. Its
        # fence is pure overhead (nobody is left to wait for); other ranks' fences
        # also hold their wait for it.
        slowest = max(range(len(parts)), key=lambda i: parts[i]["bucket"])
        row["parts_ms"] = {k: 1e3 * v for k, v in parts[slowest].items()}
        row["parts_rank"] = slowest
        rows.append(row)
    return rows


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}x" if a and b else "-"


def _against_hand(r: dict, m: str) -> str:
    """`m` / hand p2p to three digits (the target's resolution), and paired (`_paired`)."""
    paired = r.get("paired", {}).get(m)
    return _ratio(r["ms"][m], r["ms"]["hand_p2p"], 3) + (f" ({paired:.3f})" if paired else "")


def table(world: int, rows: list[dict], steps: int, slow_steps: int) -> str:
    head = (f"| case (W={world}) | net MiB ll / naive | plan ms | layoutlang ms | meeting ll ms (agree + fence) | "
            f"naive ms | DTensor ms | hand p2p ms | floor ms | naive/ll | ll/hand (paired) | meeting ll/hand | "
            f"hand again/hand (paired) | hand/floor | ll/floor | check |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        ms = r["ms"]
        dt = f"{ms['dtensor']:.1f}" if "dtensor" in ms else "n/a*"
        lines.append(
            f"| {r['label']} | {r['ll_net_mib']:.0f} / {r['naive_net_mib']:.0f} | {r['plan_ms']:.0f} | "
            f"{ms['layoutlang']:.1f} | {ms['layoutlang_meet']:.1f} "
            f"({r['parts_ms']['agree'] + r['parts_ms']['fence']:.1f}) | "
            f"{ms['naive']:.1f} | {dt} | {ms['hand_p2p']:.1f} | "
            + (f"{r['floor_ms']:.1f} | " if r["floor_ms"] else "- | ")
            + f"{_ratio(ms['naive'], ms['layoutlang'])} | {_against_hand(r, 'layoutlang')} | "
            f"{_ratio(ms['layoutlang_meet'], ms['hand_p2p'])} | {_against_hand(r, 'hand_again')} | "
            f"{_ratio(ms['hand_p2p'], r['floor_ms'])} | {_ratio(ms['layoutlang'], r['floor_ms'])} | "
            f"{'ok' if not r['errors'] else 'FAIL'} |")
    lines.append(f"(per method: median over steps of the max over ranks of one step between two barriers; "
                 f"{steps} steps for both layoutlangs and both hand p2ps, {slow_steps} for naive and DTensor, "
                 "after 1 warm-up step; the methods take turns step by step, in a balanced order (each in every "
                 "position, each after every other, equally often). "
                 "layoutlang: Refitter(steady=True), no store meeting after step 1; meeting ll: the default "
                 "Refitter, an agreement and a fence every step, (agree + fence) the part of its step spent in "
                 "Refitter._agree and ._meet on the rank whose transfers took longest, median of 3 more steps; "
                 "hand again: a second hand p2p, the same work: its ratio to hand p2p is this run's noise; "
                 "(paired): the median over rounds of the two methods' step ratio in the same round; "
                 "floor: the busiest link's bytes, per rank the larger of network bytes "
                 "sent and received, at one link's measured one-way rate, rank 0 -> 1, 64 MiB, best of 3)")
    return "\n".join(lines)


def missed_targets(row: dict) -> list[str]:
    """The targets this row misses (naive/layoutlang >= 2x on the first case, layoutlang/hand <= 1.0x)."""
    ms, missed = row["ms"], []
    if row["case"] == "tp4-tp2-d0" and ms["naive"] / ms["layoutlang"] < TARGET_NAIVE:
        missed.append(f"naive/layoutlang {ms['naive'] / ms['layoutlang']:.2f}x < {TARGET_NAIVE}x")
    if ms["layoutlang"] / ms["hand_p2p"] > TARGET_HAND:
        missed.append(f"layoutlang/hand {ms['layoutlang'] / ms['hand_p2p']:.3f}x > {TARGET_HAND}x"
                      + "".join(f"; {_interval_text(row, m, name)}" for m, name in
                                (("layoutlang", "layoutlang/hand"), ("hand_again", "hand again/hand"))
                                if row.get("paired_interval", {}).get(m)))
    return missed


def _interval_text(row: dict, m: str, name: str) -> str:
    lo, hi = row["paired_interval"][m]
    return f"{name} paired {row['paired'][m]:.3f}, 95 % interval of its median {lo:.3f}-{hi:.3f}"


def pooled(rows: list[dict]) -> str | None:
    """Every round of every case in one line: the median of all the rounds' paired ratios of
    layoutlang and of hand again to hand p2p, each with its 95 % interval (`_median_interval`).
    One case's rounds leave an interval several per cent wide; all cases' rounds together give
    a narrower one: whether layoutlang's steady step costs more than the hand exchange at all,
    with hand again/hand beside it as what equal work reads."""
    parts = []
    for m, name in (("layoutlang", "layoutlang/hand"), ("hand_again", "hand again/hand")):
        ratios = [x for r in rows for x in r.get("paired_ratios", {}).get(m, [])]
        interval = _median_interval(ratios)
        if interval is None:
            return None
        parts.append(f"{name} {statistics.median(ratios):.3f} (95 % interval {interval[0]:.3f}-{interval[1]:.3f})")
    n = sum(len(r["paired_ratios"]["layoutlang"]) for r in rows)
    return f"all {len(rows)} cases pooled, {n} rounds, median of the paired ratios: " + "; ".join(parts)


def notes(world: int, rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r["why_not"]:
            out.append(f"  * DTensor, {r['label']}: cannot: {r['why_not']}.")
    for r in rows:
        for e in r["errors"][:3]:
            out.append(f"  ! {r['label']}: {e}")
    for r in rows:
        ms, missed = r["ms"], missed_targets(r)
        if missed:
            out.append(f"  - target missed on {r['label']} (W={world}): {'; '.join(missed)}.")
            p = r["parts_ms"]
            out.append(f"      default Refitter's phases on rank {r['parts_rank']} (longest bucket; median of 3 more "
                       "steps): "
                       f"pre-flight agree "
                       f"{p['agree']:.1f} ms, bucket (post, wait, copies) {p['bucket']:.1f} ms, fence "
                       f"{p['fence']:.1f} ms, whole refit {p['total']:.1f} ms; hand p2p step {ms['hand_p2p']:.1f} ms")
            out.append(f"      cProfile of one layoutlang step on rank {r['profile_rank']} (the busiest receiver), "
                       "top by own time:")
            for where, nc, tt, ct in r["profile"][:8]:
                out.append(f"      {tt * 1e3:8.1f} ms own {ct * 1e3:8.1f} ms cum {nc:>6} calls  {where}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="4,8", help="comma-separated process counts, multiples of 4 (default 4,8)")
    ap.add_argument("--tensors", type=int, default=None,
                    help="weights per case (default: the world size, so every rank holds the same bytes at W=4 and W=8)")
    ap.add_argument("--rows", type=int, default=4096, help="rows of each weight (default 4096)")
    ap.add_argument("--cols", type=int, default=4096, help="columns of each weight (default 4096)")
    ap.add_argument("--steps", type=int, default=25,
                    help="timed steps of layoutlang and hand p2p after one warm-up (default 25; a median "
                    "of 9 moved by +-5 %% between runs)")
    ap.add_argument("--slow-steps", type=int, default=3,
                    help="timed steps of naive and DTensor (about 1 s each) after one warm-up (default 3)")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit per world size, seconds (default 600)")
    ap.add_argument("--layouts", type=Path, default=None,
                    help="write the .layout files here and keep them (default: a temporary directory)")
    ap.add_argument("-v", "--verbose", action="store_true", help="also print where each case's wall time went")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)

    worlds = [int(w) for w in args.worlds.split(",")]
    enforce = (args.rows, args.cols, args.tensors) == (4096, 4096, None)  # the sizes the targets are for
    all_rows, failed = [], False
    count = (lambda w: args.tensors) if args.tensors else (lambda w: w)
    print(f"refit on local gloo: per world W, {'W' if not args.tensors else args.tensors} weights of "
          f"[{args.rows}, {args.cols}] bf16 ({args.rows * args.cols * 2 / MIB:.0f} MiB each), worlds {worlds}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="layoutlang-refit-gloo-") as tmp_name:
        tmp = Path(tmp_name)
        for world in worlds:
            specs = cases(world, count(world), args.rows, args.cols)
            if args.cases:
                wanted = args.cases.split(",")
                unknown = sorted(set(wanted) - {s["name"] for s in specs})
                if unknown:
                    raise SystemExit(f"--cases: unknown {', '.join(unknown)}; expected some of "
                                     f"{', '.join(s['name'] for s in specs)}")
                specs = [s for s in specs if s["name"] in wanted]
            job_cases = []
            for s in specs:
                where = args.layouts or tmp
                where.mkdir(parents=True, exist_ok=True)
                src, dst = where / f"{s['name']}-w{world}-src.layout", where / f"{s['name']}-w{world}-dst.layout"
                src.write_text(s["src"])
                dst.write_text(s["dst"])
                job_cases.append({"name": s["name"], "src": str(src), "dst": str(dst), "dtensor": s["dtensor"]})
            job = {"cases": job_cases, "steps": args.steps, "slow_steps": args.slow_steps, "collective_timeout": max(30.0, args.timeout / 2)}
            start = time.monotonic()
            try:
                results, errs, timed_out = launch(job, world, tmp, args.timeout)
            except (KeyboardInterrupt, _Terminated):
                print("interrupted: every worker was killed", file=sys.stderr)
                return 130
            rows = summarize(world, specs, results)
            print(f"\nW={world}: {count(world)} weights ({count(world) * args.rows * args.cols * 2 / MIB:.0f} MiB), "
                  f"{time.monotonic() - start:.0f} s wall, load average now {os.getloadavg()[0]:.1f}\n" + table(world, rows, args.steps, args.slow_steps), flush=True)
            if args.verbose:
                for r in rows:
                    print(f"  {r['case']}: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items()))
            text = notes(world, rows)
            if text:
                print(text, flush=True)
            bad = [(rank, r, e) for rank, (r, e) in enumerate(zip(results, errs)) if r is None or not r.get("ok")]
            if timed_out or bad:
                failed = True
                print(f"W={world}: {'hard timeout hit; ' if timed_out else ''}"
                      f"{len(bad)} rank(s) failed", file=sys.stderr)
                for rank, r, e in bad[:4]:
                    print(f"  rank {rank}: {(r or {}).get('error') or e or 'no output'}", file=sys.stderr)
            if any(r["errors"] for r in rows):
                failed = True
            if enforce and any(missed_targets(r) for r in rows):
                failed = True  # a stated target missed is a failing run too
            elif any(missed_targets(r) for r in rows):
                print("  (targets are stated for the default sizes, [4096, 4096] x W weights: "
                      "not enforced in this run)")
            if len(rows) != len(specs) and not (timed_out or bad):
                failed = True
                print(f"W={world}: {len(rows)} of {len(specs)} cases reported", file=sys.stderr)
            all_rows += rows
    summary = pooled(all_rows)
    if summary:
        print("\n" + summary)
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=1))
    print("result: " + ("ok" if not failed else "FAILED (a wrong result, a failed rank or a missed target: see above)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
