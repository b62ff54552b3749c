"""Bucket overlap on gloo: `Refitter(overlap=True)` against the same refit without it, same run.

N weights of [R, C] bf16, TP4 on ranks 0-3 -> TP2 MXFP8 on ranks 0-1 (collocated), with a
staging budget of about one weight's destination shard, so the refit walks many buckets.
With overlap, a bucket's last steps (quantize-once of the bf16 assembly, or unpacking the
quantized-wire blocks) run while the next bucket's transfers fly. Per configuration: the
median over steps of the slowest rank's refit (4 gloo processes), every destination element
checked by the workers. Printed: overlap / sequential per wire (bf16 wire: the receiver
quantizes whole tensors, the most work to hide; quantized wire: it unpacks blocks).

    .venv/bin/python benchmarks/overlap_gloo.py                 # N=8 of [2048, 2048], ~1 min
    .venv/bin/python benchmarks/overlap_gloo.py --tensors 4 --rows 512 --cols 512   # seconds

No target: on 2 shared cores the transfers and the quantization compete for the same CPUs
(on a GPU, NCCL and the quantize kernels would not). Exit 1 on a wrong result only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from layoutlang.runtime.launch import launch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=7)
    ns = ap.parse_args()
    n, r, c = ns.tensors, ns.rows, ns.cols
    budget = r * c  # about one destination shard in bf16 ([r/2, c] x 2 B), so many buckets
    wrong = False
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src.layout", Path(tmp) / "dst.layout"
        src.write_text("mesh m (tp=4)\n" + "".join(f"tensor w{i} [{r} over tp, {c}]\n" for i in range(n)))
        dst.write_text("mesh m (tp=2)\n" + "".join(f"tensor w{i} [{r} over tp, {c}] mxfp8\n" for i in range(n)))
        print(f"{n} x [{r}, {c}] bf16, TP4 -> TP2 mxfp8 (collocated), budget {budget} B, 4 gloo processes, "
              f"median of {ns.steps} steps (slowest rank)")
        for wire in ("bf16", "auto"):
            times = {}
            for overlap in (False, True):
                job = {"src": str(src), "dst": str(dst), "budget": budget, "steps": ns.steps, "wire": wire,
                       "overlap": overlap}
                results = launch(job, 4, timeout=600)
                bad = [f"rank {x.rank}: {x.error or x.result.get('check_errors')}" for x in results
                       if not x.ok or x.result.get("check_errors")]
                if bad:
                    print("WRONG: " + "; ".join(bad))
                    wrong = True
                    continue
                per_step = [max(x.result["seconds"][k] for x in results) for k in range(ns.steps)]
                times[overlap] = statistics.median(per_step)
            if len(times) == 2:
                print(f"  {wire:4} wire: sequential {times[False] * 1e3:7.1f} ms, overlap {times[True] * 1e3:7.1f} ms, "
                      f"overlap / sequential {times[True] / times[False]:.2f}x; every element checked: ok")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
