"""One-device refit data path: every rank's tensors on one accelerator, every op as a copy.

For a session that is lent a GPU (no multi-GPU machine is available here): compiles
the Llama-3-8B trainer (TP8 x GTP2 x DP4, bf16) -> engine (TP2 x DP2, MXFP8) plan,
places every source and destination rank's tensors on ONE device, executes every op
as a device-to-device slice copy (what `Refitter` does for a local copy; NCCL
transfers need one rank per GPU), quantizes every MXFP8 destination once in place,
checks a sample of destinations element by element (exit 1 if one is wrong), and
prints GB/s of the copy phase and of the whole step (no target is stated: no
number has been measured on a GPU yet). That first phase is a raw copy loop of the
bf16 wire without relays (`wire="bf16", relay=False`), the baseline; the second runs
the default plan's steps (quantized wire, relays) with the Refitter's own handlers
for every rank in one process (layoutlang/runtime/loopback.py) and prints its step time
against the raw loop's, then checks a sample again; `--small` adds a relay plan
(the small Llama into 6 unsharded replicas). On CPU with small layouts it checks itself:

    .venv/bin/python benchmarks/gpu_refit.py --device cuda          # on a GPU (~100 GB)
    .venv/bin/python benchmarks/gpu_refit.py --device cpu --small   # anywhere, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from layoutlang import compile_plan
from layoutlang.ir import QUANTIZED
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor
from layoutlang.runtime.quant import dequantize, quantize_into
from layoutlang.runtime.bucket import padding as _padding

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="examples/small/llama_* instead of 8B")
    parser.add_argument("--steps", type=int, default=3)
    ns = parser.parse_args()
    src_path, dst_path = ((ROOT / "examples/small/llama_train.layout", ROOT / "examples/small/llama_infer.layout")
                          if ns.small else
                          (ROOT / "examples/llama3_8b_train.layout", ROOT / "examples/llama3_8b_infer_offset.layout"))
    dev = torch.device(ns.device)
    # the v1 data path this script models: bf16 on the "wire" and no relays (each op is a copy from a
    # source tensor). The quantized wire and relays run in the Refitter (tests on gloo), not here yet.
    plan = compile_plan(src_path, dst_path, wire="bf16", relay=False)
    print(plan.one_line())
    src = {}
    for t in plan.src.tensors:
        for r in t.ranks():
            value = source_tensor(t, r)
            src[(r, t.name)] = (dequantize(value, t.dtype) if t.dtype in QUANTIZED else value).to(dev)
    dst = {(r, t.name): (t, empty_destination(t, dev)) for t in plan.dst.tensors for r in t.ranks()}
    assembly = {k: torch.zeros(t.local_shape, dtype=torch.bfloat16, device=dev)
                for k, (t, _) in dst.items() if t.dtype in QUANTIZED}
    ops = plan.ops
    sl = lambda s: tuple(slice(a, b) for a, b in s)  # noqa: E731
    best_copy = best_step = float("inf")
    for _ in range(ns.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for op in ops:
            key = (op.dst_rank, op.dst_name)
            target = assembly[key] if key in assembly else dst[key][1]
            target[sl(op.dst_slice)].copy_(src[(op.src_rank, op.src_name)][sl(op.src_slice)])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        for key, (t, value) in dst.items():
            if t.dtype not in QUANTIZED:
                for pad in _padding(value, t, key[0]):
                    pad.zero_()
        copied = time.perf_counter()
        for key, buf in assembly.items():
            t, value = dst[key]
            quantize_into(buf, value, t.dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        best_copy, best_step = min(best_copy, copied - start), min(best_step, done - start)
    total = plan.stats["bytes"]
    print(f"{len(ops)} ops, {total / 1e9:.2f} GB in the wire dtype on {dev}")
    print(f"copy phase (incl. zeroing padding) {best_copy * 1e3:.1f} ms = {total / best_copy / 1e9:.1f} GB/s; "
          f"whole step with MXFP8 quantization {best_step * 1e3:.1f} ms = {total / best_step / 1e9:.1f} GB/s "
          f"(best of {ns.steps})")
    checked, errors = 0, []
    for (rank, name), (t, value) in list(dst.items())[:: max(1, len(dst) // 16)]:
        if isinstance(value, torch.Tensor):
            host = value.cpu()
        else:
            host = dataclasses.replace(value, **{f.name: getattr(value, f.name).cpu()
                                                 for f in dataclasses.fields(value)})
        error = check_destination(t, rank, host, plan)
        if error:
            errors.append(error)
        checked += 1
    for error in errors[:5]:
        print(f"WRONG: {error}", file=sys.stderr)
    print(f"checked {checked} destination tensors element by element: "
          + ("ok" if not errors else f"{len(errors)} WRONG"))
    wrong = bool(errors)
    # the Refitter's own steps (quantized wire, relays, staging) with every rank in this process
    wrong |= steps_phase(src_path, dst_path, dev, ns.steps, best_step)
    if ns.small:  # and a plan with relays (a replica forwards what it received), at CPU size
        relay_src = ROOT / "examples/small/llama_train.layout"
        wrong |= steps_phase(relay_src, ROOT / "examples/small/llama_infer.layout", dev, ns.steps, None,
                             dst_args={"TP": 1, "DP": 6, "AT": 8}, src_args={"GTP": 1, "DP": 1})
    return 1 if wrong else 0


def _host(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return dataclasses.replace(value, **{f.name: getattr(value, f.name).cpu() for f in dataclasses.fields(value)})


def steps_phase(src_path, dst_path, dev, steps: int, raw_step: float | None, **args) -> bool:
    """Run the default plan's steps (layoutlang/compiler/steps.py) for every rank on one device through
    layoutlang/runtime/loopback.py; print the step time against the raw copy loop above (same run) and check
    a sample of destinations. Returns whether a destination is wrong."""
    from layoutlang.runtime import loopback

    plan = compile_plan(src_path, dst_path, **args)
    packed = sum(1 for op in plan.ops if op.wire)
    print(f"\nsteps (the Refitter's handlers, every rank in one process): {plan.one_line()}; "
          f"{packed} ops on the quantized wire, {plan.stats.get('relays', 0)} relays")
    src = {r: {t.name: source_tensor(t, r, dev) for t in plan.src.tensors if r < plan.src.ranks and t.holds(r)}
           for r in range(plan.world)}
    dst = {r: {t.name: empty_destination(t, dev, r) for t in plan.dst.tensors if r < plan.dst.ranks and t.holds(r)}
           for r in range(plan.world)}
    refitter = loopback.LoopbackRefitter(plan, device=dev)  # schedules made once, as the Refitter's
    best = float("inf")
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        refitter.refit(src, dst)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    total = plan.stats["bytes"]
    line = f"whole step {best * 1e3:.1f} ms = {total / best / 1e9:.1f} GB/s of plan bytes (best of {steps})"
    if raw_step:
        line += f"; {best / raw_step:.2f}x the raw copy loop's step above"
    print(line)
    held = [(r, t) for r in dst for t in plan.dst.tensors if r < plan.dst.ranks and t.holds(r)]
    errors = [e for e in (check_destination(t, r, _host(dst[r][t.name]), plan)
                          for r, t in held[:: max(1, len(held) // 16)]) if e]
    for error in errors[:5]:
        print(f"WRONG: {error}", file=sys.stderr)
    print(f"checked {len(held[:: max(1, len(held) // 16)])} destination tensors element by element: "
          + ("ok" if not errors else f"{len(errors)} WRONG"))
    return bool(errors)


if __name__ == "__main__":
    sys.exit(main())
