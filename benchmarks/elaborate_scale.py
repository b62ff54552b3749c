"""Parse + elaborate the DeepSeek-V3-style MoE example at 1024 ranks.

Prints wall time and peak traced memory of `layoutlang.load` (and of the
per-rank byte summary `layoutc check` prints) for the example scaled to 1024
ranks with 61 layers x 256 experts, next to the SAME model on 64 ranks measured
in the same run. The IR is symbolic in ranks, so the ratio should stay near 1
however many ranks there are: cost follows tensors, not tensors x ranks.

Targets (16x the ranks): time ratio <= 2x and peak-memory ratio <= 1.5x (a
cost per (tensor, rank) would show ~16x); both models must have the same
tensor instances. The run exits 1 when a target is missed or the models differ.

    .venv/bin/python benchmarks/elaborate_scale.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path

from layoutlang import load

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "deepseek_v3_moe.layout"
# 1024 ranks: pp=8 x dp=64 x tp=2; experts: ep=64 x etp=2 (edp=1)
LARGE = {"L": 61, "E": 256, "TP": 2, "DP": 64, "EP": 64, "ETP": 2}
# the same model on 64 ranks: pp=8 x dp=4 x tp=2; experts: ep=4 x etp=2
SMALL = {"L": 61, "E": 256, "TP": 2, "DP": 4, "EP": 4, "ETP": 2}
TARGET_TIME, TARGET_MEMORY = 2.0, 1.5  # 1024-rank / 64-rank ratios, at most


def measure(args: dict[str, int], repeat: int) -> dict[str, float]:
    best_time, best_summary = float("inf"), float("inf")
    for _ in range(repeat):  # timing passes, without tracing overhead
        gc.collect()
        start = time.perf_counter()
        layout = load(EXAMPLE, args)
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        per_rank = layout.bytes_per_rank()
        summary = time.perf_counter() - start
        best_time, best_summary = min(best_time, elapsed), min(best_summary, summary)
    del layout
    gc.collect()
    tracemalloc.start()  # one memory pass: peak of everything load and the summary allocate
    layout = load(EXAMPLE, args)
    layout.bytes_per_rank()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"ranks": layout.ranks, "tensors": len(layout.tensors), "seconds": best_time,
            "summary_seconds": best_summary, "peak_mib": peak / 2**20,
            "max_rank_gib": max(per_rank) / 2**30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    ns = parser.parse_args()
    load(EXAMPLE, SMALL)  # warm-up: builds the parser once
    small = measure(SMALL, ns.repeat)
    large = measure(LARGE, ns.repeat)
    for label, r in (("64 ranks", small), ("1024 ranks", large)):
        print(f"{label:>11}: {r['tensors']} tensor instances, parse+elaborate {r['seconds']:.2f} s, "
              f"per-rank summary {r['summary_seconds']:.3f} s, peak {r['peak_mib']:.1f} MiB "
              f"(busiest rank stores {r['max_rank_gib']:.2f} GiB)")
    time_ratio, memory_ratio = large["seconds"] / small["seconds"], large["peak_mib"] / small["peak_mib"]
    print(f"ratio 1024/64 ranks: time {time_ratio:.2f}x, peak memory {memory_ratio:.2f}x "
          f"(16x the ranks; 1.0x means cost follows tensors, not ranks)")
    problems = []
    if large["tensors"] != small["tensors"]:
        problems.append(f"the same model has {small['tensors']} tensor instances at 64 ranks, "
                        f"{large['tensors']} at 1024")
    if time_ratio > TARGET_TIME:
        problems.append(f"time ratio {time_ratio:.2f}x > {TARGET_TIME}x")
    if memory_ratio > TARGET_MEMORY:
        problems.append(f"peak memory ratio {memory_ratio:.2f}x > {TARGET_MEMORY}x")
    for p in problems:
        print(f"MISSED: {p}", file=sys.stderr)
    print(f"targets (time <= {TARGET_TIME}x, memory <= {TARGET_MEMORY}x, same tensors): "
          + ("ok" if not problems else "MISSED"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
