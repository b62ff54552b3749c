"""What a refit's store meetings cost: N clients meeting through ONE TCPStore server.

A refit step meets in the process group's store (layoutlang/runtime/rendezvous.py): once to
agree and once after its last bucket (the step's fence; a rank that fails in
any bucket gives up the fence with its reason, so every rank is released at
once). It used to meet after every bucket. A meeting costs each rank 4 store
requests (set its reused seat, add `count` with its marks, wait for `gate`,
read the count), all on one server thread, plus rank 0 deleting the meeting's
count and gate two steps later: per step 2 x (4 W + 2) requests, where
per-bucket fences cost (buckets + 1) x (4 W + 2). This benchmark measures the server: C clients
(P processes x T threads, each with its own TCPStore connection, the way ranks
connect) run the real `Rendezvous.meet` M times, and it prints meetings per
second and requests per second against C. The baseline, measured in the same
run, is C = 4 (a single node's worth of clients); the model at 1,024 and 8,192
ranks extrapolates from the largest C measured (requests are served one at a
time by the server, so time per meeting ~ (4 W + 2) / throughput).

    .venv/bin/python benchmarks/store_scale.py            # ~1 minute
    .venv/bin/python benchmarks/store_scale.py --quick    # C = 4, 16 (CI)

Exit status 1 if a meeting fails (every client must pass every meeting).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

CLIENT = r"""
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from layoutlang.runtime.rendezvous import Rendezvous
port, first, threads, world, meetings = map(int, sys.argv[1:6])
errors, spans = [], []
def run(rank):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    rv = Rendezvous(store, rank, world, "bench")
    try:
        rv.meet(rv.key("start"), timedelta(seconds=120), what="start")  # every client connected
        t0 = time.perf_counter()
        for m in range(meetings):
            rv.meet(rv.key("m", m), timedelta(seconds=120), what=f"meeting {m}", seat=rv.key("seat"))
            if rank == 0 and m >= 2:  # the cleanup a refit does two steps later (rank 0: count, gate)
                rv.delete(rv.key("m", m - 2, "count"))
                rv.delete(rv.key("m", m - 2, "gate"))
        spans.append(time.perf_counter() - t0)
    except Exception as e:
        errors.append(f"rank {rank}: {e}")
ts = [threading.Thread(target=run, args=(first + i,)) for i in range(threads)]
[t.start() for t in ts]
[t.join() for t in ts]
print("ERR " + "; ".join(errors) if errors else f"OK {max(spans)}")
"""

REQUESTS_PER_MEETING = 4  # per rank: set seat, add count, wait gate, read count (rank 0: 2 deletes more)


def measure(clients: int, meetings: int, processes: int) -> tuple[float, bool]:
    """Seconds for `clients` ranks to pass `meetings` meetings together."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    port = server.port
    per = -(-clients // processes)
    procs = []
    for p in range(processes):
        first = p * per
        n = min(per, clients - first)
        if n <= 0:
            break
        procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(first), str(n), str(clients),
                                       str(meetings)], stdout=subprocess.PIPE, text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1")))
    ok, seconds = True, 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        last = out.strip().splitlines()[-1] if out.strip() else "ERR no output"
        ok &= last.startswith("OK")
        if last.startswith("OK"):
            seconds = max(seconds, float(last.split()[1]))
    del server
    return seconds, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="C = 4 and 16, few meetings (CI)")
    ap.add_argument("--meetings", type=int, default=None)
    args = ap.parse_args()
    sizes = [4, 16] if args.quick else [4, 16, 64, 256]
    meetings = args.meetings or (20 if args.quick else 60)
    processes = 2  # this machine has 2 cores; threads release the GIL inside store calls
    rows, ok_all = [], True
    print(f"{'clients':>8} {'meetings/s':>11} {'requests/s':>11} {'ms/meeting':>11}  vs C=4")
    first = None
    for c in sizes:
        seconds, ok = measure(c, meetings, processes)
        ok_all &= ok
        spent = max(seconds, 1e-9)
        per_meeting = spent / meetings
        rps = (REQUESTS_PER_MEETING * c + 2) * meetings / spent
        first = first or per_meeting
        rows.append((c, per_meeting, rps))
        print(f"{c:>8} {meetings / spent:>11.1f} {rps:>11.0f} {per_meeting * 1e3:>11.2f}  "
              f"{per_meeting / first:.2f}x time for {c / sizes[0]:.0f}x clients{'' if ok else '  FAILED'}")
    c, per_meeting, rps = rows[-1]
    print(f"\nmodel (one server thread, {rps:.0f} requests/s as measured at C = {c}); a step meets to agree and "
          "once after its buckets (one fence per step), where it used to meet after every bucket:")
    for world in (1024, 8192):
        meeting = (REQUESTS_PER_MEETING * world + 2) / rps
        for buckets in (4, 32):
            fenced, per_bucket = 2 * meeting, (buckets + 1) * meeting
            print(f"  {world:>5} ranks, {buckets:>2} buckets: {meeting * 1e3:7.1f} ms per meeting; "
                  f"{fenced:6.2f} s of meetings per step ({2 * (REQUESTS_PER_MEETING * world + 2):,} requests), "
                  f"per-bucket fences {per_bucket:6.2f} s ({per_bucket / fenced:.1f}x)")
    if not ok_all:
        print("a meeting FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
