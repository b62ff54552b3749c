"""Planning Meta's Llama-2-13B checkpoint into HF's layout: strided ops against one op per row.

`examples/v2/llama2_13b_meta.layout` (model parallel 2: q/k/v/w1/w3 and the output
head split on rows, wo/w2 on columns, the token embedding on the hidden dim; wq/wk
rows with each head's rotary pairs interleaved, `(NH, D/2, (re: 1 | im: 1))`) ->
`examples/v2/llama2_13b_hf.layout` (every weight whole on rank 0, rotary halves
split per head, `(NH, (re: D/2 | im: D/2))`). Each figure is the fastest of
`--repeat` fresh child processes: load + compile + `plan.ops` + the JSON plan
(`render_json`). The per-row baseline is the same compiler with strided pieces
off (`layoutlang/compiler/pieces.py` STRIDE_MIN_RUNS set beyond any run count: every segment
its own piece, as before issue 12), measured in the same run; both plans must move
the same bytes into the same destination ranks.

Targets (exit 1 when missed or when the plans disagree): strided <= 2,000 ops and
< 2 s (load + compile + ops + JSON).

    .venv/bin/python benchmarks/strided_scale.py            # ~30 s
    .venv/bin/python benchmarks/strided_scale.py --quick    # the small pair (examples/small/v2/llama2_*)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fresh_child import fastest

ROOT = Path(__file__).resolve().parent.parent
FULL = (ROOT / "examples" / "v2" / "llama2_13b_meta.layout", ROOT / "examples" / "v2" / "llama2_13b_hf.layout")
QUICK = (ROOT / "examples" / "small" / "v2" / "llama2_meta.layout",
         ROOT / "examples" / "small" / "v2" / "llama2_hf.layout")
MAX_OPS, MAX_SECONDS = 2000, 2.0

CHILD = r"""
import json, sys, time
from layoutlang.compiler import compile_plan, pieces
from layoutlang.report.render import render_json
src, dst, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "per-row":
    pieces.STRIDE_MIN_RUNS = 1 << 62  # no strided group: one piece per segment, as before
start = time.perf_counter()
plan = compile_plan(src, dst)
ops = plan.ops
planned = time.perf_counter() - start
text = render_json(plan)
seconds = time.perf_counter() - start
per_rank = {}
for op in ops:
    per_rank[op.dst_rank] = per_rank.get(op.dst_rank, 0) + op.bytes
print(json.dumps({"planned": planned, "seconds": seconds, "ops": len(ops), "json_bytes": len(text),
                  "bytes": plan.stats["bytes"], "per_rank": sorted(per_rank.items()),
                  "strided": sum(any(len(e) > 2 for e in op.src_slice + op.dst_slice) for op in ops)}))
"""


def measure(src: Path, dst: Path, mode: str, repeat: int) -> dict:
    return fastest(CHILD, [src, dst, mode], mode, repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small pair; targets printed, not enforced")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per figure, fastest kept (default 3)")
    args = ap.parse_args(argv)
    src, dst = QUICK if args.quick else FULL
    rows = {mode: measure(src, dst, mode, args.repeat) for mode in ("per-row", "strided")}
    print(f"{src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}")
    for mode, r in rows.items():
        print(f"  {mode:>8}: {r['ops']} ops ({r['strided']} strided), JSON {r['json_bytes'] / 1e6:.2f} MB, "
              f"load + compile + ops {r['planned']:.2f} s, + JSON {r['seconds']:.2f} s")
    a, b = rows["per-row"], rows["strided"]
    failed = False
    for what in ("bytes", "per_rank"):
        if a[what] != b[what]:
            print(f"  WRONG: the plans move different {what}: {a[what]} vs {b[what]}")
            failed = True
    print(f"  strided / per-row: ops {b['ops'] / a['ops']:.4f}x, JSON {b['json_bytes'] / a['json_bytes']:.4f}x, "
          f"time {b['seconds'] / a['seconds']:.3f}x")
    targets = [(b["ops"] <= MAX_OPS, f"strided plan {b['ops']} ops (<= {MAX_OPS})"),
               (b["seconds"] < MAX_SECONDS, f"strided plan {b['seconds']:.2f} s (< {MAX_SECONDS:.0f} s)")]
    for ok, text in targets:
        print(f"  {'ok' if ok else ('MISSED' if not args.quick else 'missed (quick: not enforced)')}: {text}")
        failed |= not ok and not args.quick
    print("result: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
