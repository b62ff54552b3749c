"""Steady refits never replay stale bytes (issue 49 item 0).

A steady Refitter records the actions of its first passing step and replays them while the
caller passes the same tensors (layoutlang/runtime/replay.py). Callers change those tensors IN PLACE (an
optimizer step), so every recorded action must refer to the caller's storage, never to a
tensor made while recording: a local copy whose block-strided source was reshaped (copied)
into the destination's shape replayed the recorded step's values forever after.

Four steps, every source written in place with new values each step, over every kind of source
storage the language has (tests/steady_inplace_program.py lists the layouts: a block-strided
GTP source, transposed storage, stacked experts, part keys, padding on both sides, quantized
destinations, relays), with caller tensors contiguous and strided, in one and several buckets;
every destination element is checked after every step against values computed from the layout
text by the reference enumerator (and tests/reference_quant.py for quantized ones). On gloo
(4 ranks, and 1 rank in one process, where every op is a local copy) and in the loopback
runtime (every rank in this process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layoutlang.compiler import compile_plan
from layoutlang.compiler.steps import schedule
from layoutlang.runtime.launch import launch
from layoutlang.runtime.loopback import LoopbackRefitter
from layoutlang.runtime.replay import replayable
from layoutlang.runtime.views import aligned, turned, view

import steady_inplace_program as prog

PROGRAM = str(Path(__file__).with_name("steady_inplace_program.py"))
STEPS = 4
REPLAYED = {"plain": STEPS - 2, "strided": STEPS - 2, "fallback": STEPS - 2, "quantized": 0}  # steps 3 and 4
FOUR = {"TP": 2, "GTP": 2, "DP": 2}
ONE = {"TP": 1, "GTP": 1, "DP": 1}


def _files(tmp_path) -> dict:
    files = {"train": prog.TRAIN, "engine": prog.ENGINE, "engine_q": prog.ENGINE_Q}
    for name, text in files.items():
        (tmp_path / f"{name}.layout").write_text(text)
    return {name: str(tmp_path / f"{name}.layout") for name in files}


def _plans(files: dict, args: dict):
    src_args, dst_args = {"TP": args["TP"], "GTP": args["GTP"]}, {"DP": args["DP"], "TP": args["TP"]}
    return (compile_plan(files["train"], files["engine"], src_args=src_args, dst_args=dst_args),
            compile_plan(files["train"], files["engine_q"], src_args=src_args, dst_args=dst_args))


def _blocked(sl) -> bool:
    return any(len(e) == 4 for e in sl)


def _held(tensors, mesh, rank: int) -> int:
    return sum(1 for t in tensors if prog.local_values(t, mesh, rank, 0, 0.0) is not None)


def _run(files: dict, args: dict, world: int) -> list:
    job = {**files, "args": args, "world": world, "steps": STEPS}
    results = launch(job, world, timeout=150, program=PROGRAM)
    for r in results:
        report = r.result or {}
        assert r.returncode == 0 and report.get("ok"), \
            f"rank {r.rank}: {report.get('error')} {report.get('trace')} {r.stderr[-1500:]}"
        assert r.result["problems"] == [], f"rank {r.rank}: {r.result['problems']}"
    return results


@pytest.mark.timeout(200)
def test_steady_steps_on_gloo_ranks_move_this_steps_values(tmp_path):
    """4 gloo ranks (trainer TP2 x GTP2, engine DP2 x TP2 on the same ranks). What the plans
    hold is asserted first, so the layouts keep covering what this is about: block-strided
    source blocks copied locally and sent, transposed keys, relays of bf16 copies and of packed
    quantized bytes. The bf16 pairs replay steps 3 and 4 on every rank; the quantized pair
    walks every step (quantizing is never replayed)."""
    files = _files(tmp_path)
    plain, quantized = _plans(files, FOUR)
    assert plain.world == quantized.world == 4
    assert any(op.local and _blocked(op.src_slice) for op in plain.ops)        # the stale-bytes case
    assert any(not op.local and _blocked(op.src_slice) for op in plain.ops)    # staged block-strided sends
    assert any(op.transpose for op in plain.ops) and any(op.after for op in plain.ops)
    assert any(op.after and op.wire for op in quantized.ops)
    assert all(replayable(schedule(plain, r, None)) for r in range(4))
    results = _run(files, FOUR, 4)
    dmesh = prog.mesh_of("dst", FOUR)
    for r in results:
        held = (3 * _held(prog.engine_tensors(2, False), dmesh, r.rank)
                + _held(prog.engine_tensors(2, True), dmesh, r.rank))
        assert r.result["checked"] == STEPS * held
        assert r.result["replayed"] == REPLAYED, r.result
        assert "reshape" in r.result["recorded"]["fallback"] and "reshape" not in r.result["recorded"]["plain"]


@pytest.mark.timeout(120)
def test_steady_steps_in_one_process_move_this_steps_values(tmp_path):
    """One gloo rank holding everything (every op a local copy: the blocked q rows, the turned
    gate|up blocks, stacked experts, padded rows), and the four-rank pairs in the loopback
    runtime, with the same sources changed in place and the same checks."""
    files = _files(tmp_path)
    plain, _ = _plans(files, ONE)
    assert all(op.local for op in plain.ops)
    assert any(_blocked(op.src_slice) for op in plain.ops) and any(op.transpose for op in plain.ops)
    (one,) = _run(files, ONE, 1)
    assert one.result["replayed"] == REPLAYED
    assert one.result["checked"] == STEPS * (3 * len(prog.engine_tensors(1, False)) + len(prog.engine_tensors(1, True)))

    from layoutlang.runtime.quant import empty
    smesh, dmesh = prog.mesh_of("src", FOUR), prog.mesh_of("dst", FOUR)
    for plan, quantized in zip(_plans(files, FOUR), (False, True)):
        loop = LoopbackRefitter(plan)
        sources = {r: [t for t in prog.train_tensors(2, 2) if prog.local_values(t, smesh, r, 0, 0.0) is not None]
                   for r in range(4)}
        src = {r: {t.name: torch.zeros(tuple(prog.local_values(t, smesh, r, 0, 0.0).shape), dtype=torch.bfloat16)
                   for t in sources[r]} for r in range(4)}
        engine = prog.engine_tensors(2, quantized)
        dst = {r: {t.name: (torch.full(tuple(v.shape), prog.DEST_GARBAGE, dtype=torch.bfloat16) if t.dtype == "bf16"
                            else empty(t.dtype, tuple(v.shape)))
                   for t in engine if (v := prog.local_values(t, dmesh, r, 0, 0.0)) is not None} for r in range(4)}
        for step in range(1, STEPS + 1):
            for r in range(4):
                for t in sources[r]:
                    src[r][t.name].copy_(prog.local_values(t, smesh, r, step, prog.SOURCE_PAD))
            loop.refit(src, dst)
            problems = [p for r in range(4) for t in engine
                        if (expected := prog.local_values(t, dmesh, r, step, 0.0)) is not None
                        for p in prog.destination_problems(t, dst[r][t.name], expected, f"step {step} rank {r}")]
            assert problems == []


def test_a_blocked_transposed_block_is_turned_without_a_copy():
    """x [32, 8]; rows 0-15 of columns 0-1, 4-5, 8-9, 12-13 as a (count, block) view
    [16, 4, 2]: the transposed key block [8, 16] (row i: column [0, 1, 4, 5, ...][i] of x),
    a view of x (a write through it lands in x)."""
    x = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)
    block = view(x, ((0, 16), (0, 13, 4, 2)))
    assert list(block.shape) == [16, 4, 2]
    t = turned(block, (16, 8))
    columns = [0, 1, 4, 5, 8, 9, 12, 13]
    assert t.reshape(8, 16).tolist() == [[x[r, c].item() for r in range(16)] for c in columns]
    assert t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    t[1, 0, 3] = -1.0  # key row 2 (column 4), key column 3 (row 3)
    assert x[3, 4].item() == -1.0
    with pytest.raises(ValueError):
        turned(block, (12, 8))  # 16 x 4 x 2 does not split into 12 rows first


def test_copies_are_viewed_in_one_shape_without_a_copy():
    """`aligned`: the same shapes as they are; an end that merges viewed in the other's shape;
    two ends that do not merge in their common refinement; None when they share none. Every
    view is of the caller's storage: a copy through it lands there."""
    src = torch.arange(4 * 12, dtype=torch.float32).reshape(4, 12)
    blocked = src[:, :8].view(4, 2, 4)[:, :, :2]  # blocks of 2 every 4: no view as [16] or [8, 2]
    assert aligned(blocked, blocked) == (blocked, blocked)
    whole = torch.zeros(16)
    a, b = aligned(whole, blocked)
    assert b is blocked and a.shape == b.shape and a.data_ptr() == whole.data_ptr()
    a.copy_(b)
    assert whole.tolist() == [src[i, 4 * j + k].item() for i in range(4) for j in range(2) for k in range(2)]
    wide = torch.zeros(8, 4)
    rows = src[:, :4]  # [4, 4] with rows 12 apart: no view as [8, 2]; [8, 2] of `wide`: none as [4, 4]
    a, b = aligned(wide[:, :2], rows)
    assert list(a.shape) == list(b.shape) == [4, 2, 2]  # the common refinement of [8, 2] and [4, 4]
    a.copy_(b)
    assert wide[:, :2].reshape(-1).tolist() == rows.reshape(-1).tolist() and wide[:, 2:].abs().sum() == 0
    # [6, 4] against [4, 6], neither mergeable: 4 does not divide 6, no common refinement
    assert aligned(torch.zeros(6, 8)[:, :4], torch.zeros(4, 12)[:, :6]) is None
