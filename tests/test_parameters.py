"""Parameters as they come (issue 26): `refit(dict(model.named_parameters()), ...)`.

Sources and destinations here are an nn.Module's own parameters (`requires_grad`),
called with autograd on, both ways between TP2 and TP1 on two gloo ranks: three
`steady=True` steps (the third replayed, layoutlang/runtime/replay.py), one step of a
Refitter with `overlap=True` (several buckets: the second staged ahead while the
first flies), and one with `overlap=True` and `verify=True` (checksums). After
every step every destination holds exactly the values computed here from the
layouts' shapes (not layoutlang/runtime/fill.py), is the same nn.Parameter (same object,
same storage: written in place), still a leaf that requires grad, with no `.grad`
and no autograd history; no source was written (its version counter is
unchanged). At the end each destination module still trains: a backward pass
fills its gradients.

Run as a program, this file is one rank (`launch(job, 2, program=THIS)`).
"""

from __future__ import annotations

import pytest

STEADY_STEPS = 3
# name -> (logical shape, the dim TP2 splits or None): two row-parallel Linears (a column block
# is a strided slice of the whole, so it is staged: several buckets under a small budget)
PARAMS = {"proj.weight": ((8, 6), 1), "proj.bias": ((8,), None), "head.weight": ((4, 8), 1),
          "head.bias": ((4,), None), "norm.weight": ((6,), None), "norm.bias": ((6,), None)}
TP2 = "mesh s (tp=2)\n" + "".join(
    f"tensor {n} [{', '.join(f'{e} over tp' if d == split else str(e) for d, e in enumerate(shape))}] fp32\n"
    for n, (shape, split) in PARAMS.items())
TP1 = "mesh d (tp=1)\n" + "".join(f"tensor {n} [{', '.join(map(str, shape))}] fp32\n"
                                  for n, (shape, _) in PARAMS.items())
DIRECTIONS = {"tp2-to-tp1": (TP2, TP1), "tp1-to-tp2": (TP1, TP2)}


def local(layout: str, rank: int, step: int) -> dict | None:
    """Rank `rank`'s parameters in `layout` at `step` (None where it holds none): each logical
    tensor is 1000 * step + 100 * (its position) + its flat index, exact in fp32; TP2 holds
    the split dim's `rank`-th half, TP1 lives on rank 0."""
    import torch

    if layout == TP1 and rank != 0:
        return None
    out = {}
    for i, (name, (shape, split)) in enumerate(PARAMS.items()):
        whole = (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 1000 * step + 100 * i).reshape(shape)
        if layout == TP2 and split is not None:
            whole = whole.narrow(split, rank * shape[split] // 2, shape[split] // 2).contiguous()
        out[name] = whole
    return out


def _module(layout: str, rank: int):
    """The model this rank holds of `layout`, shaped as its part (None if it has none)."""
    import torch.nn as nn

    if local(layout, rank, 0) is None:
        return None
    k = 2 if layout == TP2 else 1
    return nn.ModuleDict({"proj": nn.Linear(6 // k, 8), "head": nn.Linear(8 // k, 4), "norm": nn.LayerNorm(6)})


def _problems(params: dict, first: dict, want: dict, versions: dict, written: bool) -> list[str]:
    """What is wrong with these parameters after a step (`written`: destinations)."""
    import torch
    import torch.nn as nn

    bad = []
    for name, p in params.items():
        if p is not first[name]:
            bad.append(f"{name}: another object than before")
        if not isinstance(p, nn.Parameter) or not p.requires_grad or not p.is_leaf:
            bad.append(f"{name}: no longer a leaf nn.Parameter that requires grad")
        if p.grad is not None or p.grad_fn is not None:
            bad.append(f"{name}: has a .grad or autograd history")
        if p.data_ptr() != versions[name][1]:
            bad.append(f"{name}: other storage")
        # (a destination's version counter says nothing: a gloo receive writes its storage
        # without bumping it, a local copy bumps it; its storage and values say in place)
        if not written and p._version != versions[name][0]:
            bad.append(f"{name}: a source was written")
        if not torch.equal(p.detach(), want[name]):
            bad.append(f"{name}: values differ from the layout's")
    return bad


def body(job: dict, rank: int) -> dict:
    import torch
    from layoutlang import compile_plan, loads
    from layoutlang.runtime import Refitter

    assert torch.is_grad_enabled()
    report = {}
    for direction, (src_text, dst_text) in DIRECTIONS.items():
        plan = compile_plan(loads(src_text), loads(dst_text))
        src_mod, dst_mod = _module(src_text, rank), _module(dst_text, rank)
        src = dict(src_mod.named_parameters()) if src_mod is not None else None
        dst = dict(dst_mod.named_parameters()) if dst_mod is not None else None
        first_src, first_dst = dict(src or {}), dict(dst or {})
        steady = Refitter(plan, steady=True, timeout=30)
        ahead = Refitter(plan, overlap=True, budget_bytes=64, timeout=30)   # bucket 1 staged during bucket 0
        checked = Refitter(plan, overlap=True, verify=True, budget_bytes=64, timeout=30)  # (no staging ahead)
        problems = []
        steps = [(steady, step) for step in range(1, STEADY_STEPS + 1)] + [(ahead, STEADY_STEPS + 1),
                                                                           (checked, STEADY_STEPS + 2)]
        for refitter, step in steps:
            if src is not None:
                with torch.no_grad():  # the trainer's step, in place
                    for name, p in src.items():
                        p.copy_(local(src_text, rank, step)[name])
            before = [{name: (p._version, p.data_ptr()) for name, p in (side or {}).items()} for side in (src, dst)]
            refitter.refit(src, dst)
            now_src = dict(src_mod.named_parameters()) if src_mod is not None else {}
            now_dst = dict(dst_mod.named_parameters()) if dst_mod is not None else {}
            problems += [f"step {step}: source {p}" for p in _problems(
                now_src, first_src, local(src_text, rank, step) or {}, before[0], written=False)]
            problems += [f"step {step}: destination {p}" for p in _problems(
                now_dst, first_dst, local(dst_text, rank, step) or {}, before[1], written=True)]
        if dst_mod is not None:  # still a model: a backward pass fills every gradient
            x = torch.linspace(-1, 1, 12).reshape(2, 6)
            proj, head = dst_mod["proj"], dst_mod["head"]
            y = head(proj(x[:, :proj.in_features])[:, :head.in_features])
            (y.sum() + dst_mod["norm"](x).pow(2).sum()).backward()
            problems += [f"{n}: no gradient after backward" for n, p in dst_mod.named_parameters() if p.grad is None]
        report[direction] = {"problems": problems[:5], "replayed": steady.replayed, "buckets": len(checked.buckets),
                             "staged_ahead": ahead.staged_ahead, "holds_dst": dst is not None}
    return report


@pytest.mark.timeout(60)
def test_parameters_are_refitted_in_place_without_autograd_history():
    from layoutlang.runtime.launch import launch

    results = launch({}, 2, timeout=50, program=__file__)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {(r.result or {}).get('trace', '')[-2000:]}"
        for direction, said in ((d, r.result[d]) for d in DIRECTIONS):
            assert said["problems"] == [], (r.rank, direction, said)
            assert said["replayed"] == 1, (r.rank, direction, said)  # step 3 replayed step 2's record
            assert said["buckets"] > 1, (r.rank, direction, said)
    assert sum(r.result[d]["holds_dst"] for r in results for d in DIRECTIONS) == 3  # TP1: rank 0; TP2: both
    assert any(r.result[d]["staged_ahead"] > 0 for r in results for d in DIRECTIONS)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bridge_program import run

    run(body)
