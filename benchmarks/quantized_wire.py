"""Quantized bytes on the wire: network bytes into quantized destinations, quantized wire vs bf16.

Two parts, both against the bf16 path (`compile_plan(..., wire="bf16")`, the v1 rule) in the
same run:

1. Plans at full size: the Llama-3-8B trainer (examples/llama3_8b_train.layout, TP8 x GTP2 x
   DP4, bf16, 64 ranks) -> the vLLM engine (examples/llama3_8b_infer.layout, TP2 x DP2, on ranks
   64-67 so every byte crosses the network) with its linear weights in each quantized format.
   Printed per format: network bytes into the quantized tensors with each wire and their ratio,
   against the target (LANGUAGE.md 4.1; issue 12): mxfp8 <= 0.55x, fp8_b128 <= 0.52x,
   mxfp4 and nvfp4 <= 0.30x. The floor a format allows is its bytes per element over bf16's 2
   (mxfp8 1 + 1/32, fp8_b128 1 + 4/16384, mxfp4 0.5 + 1/32, nvfp4 0.5 + 1/16), printed beside.
2. Refits on gloo, small size (examples/small/llama_train.layout -> llama_infer.layout in each
   format, 8 processes): with each wire, every worker checks every destination element
   (layoutlang/runtime/fill.py check_destination: the bytes equal quantizing the expected bf16 tensor
   once, scales included). Both wires passing is "bit-identical to quantizing the reference";
   the moved bytes are the runtime's own counters.

    .venv/bin/python benchmarks/quantized_wire.py            # ~2 min
    .venv/bin/python benchmarks/quantized_wire.py --no-gloo  # plans only, ~20 s

Exit 1 with MISSED / WRONG lines when a target is missed or a destination is wrong.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from layoutlang import loads
from layoutlang.compiler import compile_plan
from layoutlang.ir import QUANTIZED

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
TARGETS = {"mxfp8": 0.55, "fp8_b128": 0.52, "mxfp4": 0.30, "nvfp4": 0.30}
FLOOR = {"mxfp8": (1 + 1 / 32) / 2, "fp8_b128": (1 + 4 / 128 ** 2) / 2, "mxfp4": (0.5 + 1 / 32) / 2,
         "nvfp4": (0.5 + 1 / 16) / 2}


def _engine(path: Path, dtype: str, **args) -> object:
    text = path.read_text().replace("] mxfp8", f"] {dtype}")
    return loads(text, f"{path.stem}_{dtype}.layout", args=args)


def quantized_network_bytes(plan) -> int:
    quantized = {t.name for t in plan.dst.tensors if t.dtype in QUANTIZED}
    return sum(op.bytes for op in plan.ops if op.dst_name in quantized and op.src_rank != op.dst_rank)


def plans(problems: list[str]) -> None:
    src = loads((EX / "llama3_8b_train.layout").read_text(), "llama3_8b_train.layout")
    print("1. Llama-3-8B TP8xGTP2xDP4 bf16 -> TP2xDP2 engine on ranks 64-67, full size (network bytes into "
          "quantized tensors)")
    print(f"   {'format':9} {'bf16 wire':>14} {'quantized wire':>15} {'ratio':>7} {'floor':>7} {'target':>7}")
    for dtype, target in TARGETS.items():
        dst = _engine(EX / "llama3_8b_infer.layout", dtype, AT=64)
        auto, bf16 = compile_plan(src, dst), compile_plan(src, dst, wire="bf16")
        q, b = quantized_network_bytes(auto), quantized_network_bytes(bf16)
        ratio = q / b
        packed = sum(1 for op in auto.ops if op.wire) / max(1, sum(1 for op in auto.ops if op.dst_name in
                                                                  {t.name for t in dst.tensors if t.dtype in QUANTIZED}))
        verdict = "ok" if ratio <= target else "MISSED"
        print(f"   {dtype:9} {b:>14,} {q:>15,} {ratio:>6.3f}x {FLOOR[dtype]:>6.3f}x {target:>6.2f}x  {verdict} "
              f"({packed:.0%} of its ops quantized; whole plan {auto.stats['bytes'] / bf16.stats['bytes']:.3f}x)")
        if ratio > target:
            problems.append(f"MISSED: {dtype} quantized wire {ratio:.3f}x the bf16 path (target <= {target}x)")


def gloo(problems: list[str]) -> None:
    from layoutlang.runtime.launch import launch

    print("\n2. small Llama refit on 8 gloo processes, every destination element checked, per wire")
    print(f"   {'format':9} {'bf16 wire B':>12} {'quantized B':>12} {'ratio':>7}  result")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in TARGETS:
            path = Path(tmp) / f"llama_infer_{dtype}.layout"
            path.write_text((EX / "small" / "llama_infer.layout").read_text().replace("] mxfp8", f"] {dtype}"))
            moved, bad = {}, []
            for wire in ("bf16", "auto"):
                job = {"src": str(EX / "small" / "llama_train.layout"), "dst": str(path), "verify": True,
                       "wire": wire, "budget": 1 << 14, "steps": 2}
                results = launch(job, 8, timeout=300)
                bad += [f"{wire} wire, rank {r.rank}: {r.error or r.result.get('check_errors')}"
                        for r in results if not r.ok or r.result.get("check_errors")]
                moved[wire] = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results if r.ok)
            ratio = moved["auto"] / moved["bf16"] if moved["bf16"] else 0.0
            print(f"   {dtype:9} {moved['bf16']:>12,} {moved['auto']:>12,} {ratio:>6.3f}x  "
                  f"{'exact (both wires)' if not bad else 'WRONG'}")
            problems += [f"WRONG: {dtype}: {b}" for b in bad]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-gloo", action="store_true", help="plans only")
    args = parser.parse_args()
    problems: list[str] = []
    plans(problems)
    if not args.no_gloo:
        gloo(problems)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
