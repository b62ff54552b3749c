"""Strided ops (issue 12, "Strided ops"): a regular, non-contiguous permutation is one op.

Why: Meta's Llama-2 checkpoints keep each head's rotary pairs interleaved,
`(NH, D/2, (re: 1 | im: 1))`, where HF splits them, `(NH, (re: D/2 | im: D/2))`;
one op per row made Llama-2-13B 410,000 ops. A piece's dim may now be strided
(layoutlang/compiler/strides.py, docs/compiler.md): `(start, stop, step)` is one element per
step, `(start, stop, step, block)` `block` elements from each step. What must hold,
against hand-computed cases and the slow simulator, never the code under test:

- the tiny pair NH=2, D=4 (rows written out below) plans one op per part, both ways;
  Meta MP=2 shards against HF one op per (shard, part); too few rows stay plain;
- the JSON plan keeps `[start, stop, step]` and adds `dst_block`/`src_block` only where
  a dim holds blocks; text reads `start:stop:step:block`;
- the exactly-once proof reads strided pieces (a gap and an overlap are found);
- the runtime's views (layoutlang/runtime/views.py) name the same elements as the index lists
  written from the spec, and writes land in the tensor;
- the simulator catches a strided op that lands in the wrong rows;
- the balance split cuts a strided piece along its plain dim, keeping the strides;
- a gloo refit of the small Meta -> HF pair (both ways) checked element by element.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from layoutlang import loads
from layoutlang.compiler import compile_plan
from layoutlang.compiler import strides
from layoutlang.compiler.verify import check_tiling
from layoutlang.modes import Run
from layoutlang.report.render import render_json
from layoutlang.runtime.launch import launch
from layoutlang.runtime.views import view
from plan_simulator import RunsView, check_stats, simulate

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "examples" / "small" / "v2"


def _meta(nh: int, d: int, mp: int = 1, h: int = 3) -> str:
    over = " over mp" if mp > 1 else ""
    return (f"layout meta\nmesh m (mp={mp})\n"
            f"tensor wq as q [({nh}, {d // 2}, (re: 1 | im: 1)){over}, {h}]\n")


def _hf(nh: int, d: int, h: int = 3) -> str:
    return f"layout hf\nmesh h (r=1)\ntensor q [({nh}, (re: {d // 2} | im: {d // 2})), {h}]\n"


def _ops(src: str, dst: str, **kw):
    plan = compile_plan(loads(src, "src.layout"), loads(dst, "dst.layout"), **kw)
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    assert report.elements == report.dst_data_elements
    check_stats(plan, report)
    return plan, [(op.src_rank, op.src_slice, op.dst_rank, op.dst_slice, op.bytes) for op in plan.ops]


def test_entry_forms_by_hand():
    assert strides.entry(4, 1, 9, 3) == (4, 7)            # one block: contiguous
    assert strides.entry(4, 3, 2, 2) == (4, 10)           # blocks that touch: contiguous
    assert strides.entry(0, 4, 2, 1) == (0, 7, 2)         # rows 0, 2, 4, 6
    assert strides.entry(0, 2, 4, 2) == (0, 5, 4, 2)      # rows 0, 1, 4, 5
    assert strides.blocks((0, 5, 4, 2)) == [(0, 2), (4, 6)]
    assert strides.extent((0, 7, 2)) == 4 and strides.extent((0, 5, 4, 2)) == 4
    assert strides.sub((0, 13, 4, 2), 2, 6) == (4, 9, 4, 2)  # blocks 1 and 2: rows 4, 5, 8, 9
    assert strides.sub((3, 10, 2), 1, 2) == (5, 6)


def test_tiny_rotary_pair_by_hand():
    """NH=2, D=4. Meta row of (head h, pair j, half p) = 4h + 2j + p; HF row = 4h + 2p + j;
    logical: all re (h, j) then all im. So re: Meta rows 0, 2, 4, 6 -> HF rows 0, 1, 4, 5;
    im: Meta rows 1, 3, 5, 7 -> HF rows 2, 3, 6, 7. Each part 4 rows x 3 columns x 2 B."""
    _, ops = _ops(_meta(2, 4), _hf(2, 4))
    assert ops == [(0, ((0, 7, 2), (0, 3)), 0, ((0, 5, 4, 2), (0, 3)), 24),
                   (0, ((1, 8, 2), (0, 3)), 0, ((2, 7, 4, 2), (0, 3)), 24)]
    _, back = _ops(_hf(2, 4), _meta(2, 4))
    assert back == [(0, ((0, 5, 4, 2), (0, 3)), 0, ((0, 7, 2), (0, 3)), 24),
                    (0, ((2, 7, 4, 2), (0, 3)), 0, ((1, 8, 2), (0, 3)), 24)]


def test_model_parallel_shards_are_one_op_per_part_by_hand():
    """NH=4, D=4, Meta MP=2: rank c holds heads 2c, 2c+1 (local rows 4h' + 2j + p); HF holds
    head h at rows 4h. re of rank c: local 0, 2, 4, 6 -> HF rows 8c + {0, 1, 4, 5}."""
    _, ops = _ops(_meta(4, 4, mp=2), _hf(4, 4))
    assert ops == [(0, ((0, 7, 2), (0, 3)), 0, ((0, 5, 4, 2), (0, 3)), 24),
                   (0, ((1, 8, 2), (0, 3)), 0, ((2, 7, 4, 2), (0, 3)), 24),
                   (1, ((0, 7, 2), (0, 3)), 0, ((8, 13, 4, 2), (0, 3)), 24),
                   (1, ((1, 8, 2), (0, 3)), 0, ((10, 15, 4, 2), (0, 3)), 24)]


def test_too_few_rows_stay_plain_pieces():
    """NH=1, D=4: two rows per part (fewer than STRIDE_MIN_RUNS = 4): one plain op per row,
    re: Meta 0 -> HF 0, Meta 2 -> HF 1; im: Meta 1 -> HF 2, Meta 3 -> HF 3."""
    _, ops = _ops(_meta(1, 4), _hf(1, 4))
    assert sorted((s[0], d[0]) for _, s, _, d, _ in ops) == [((0, 1), (0, 1)), ((1, 2), (2, 3)),
                                                             ((2, 3), (1, 2)), ((3, 4), (3, 4))]


def test_json_keeps_start_stop_step_and_adds_the_block():
    plan = compile_plan(loads(_meta(2, 4), "src.layout"), loads(_hf(2, 4), "dst.layout"))
    op = json.loads(render_json(plan))["ops"][0]
    assert op["src_slice"] == [[0, 7, 2], [0, 3]] and "src_block" not in op
    assert op["dst_slice"] == [[0, 5, 4], [0, 3]] and op["dst_block"] == [2, 1]
    assert str(plan.ops[0]).endswith("rank 0 wq[0:7:2, 0:3] -> rank 0 q[0:5:4:2, 0:3] (24 B)")


def test_the_proof_reads_strided_pieces():
    runs = ((Run(0, 0, 8),), (Run(0, 0, 3),))  # an [8, 3] shard
    re, im = ((0, 5, 4, 2), (0, 3)), ((2, 7, 4, 2), (0, 3))
    assert check_tiling([re, im], runs) is None
    gap = check_tiling([re], runs)
    assert gap.kind == "gap" and gap.local[0] == (2, 4)
    over = check_tiling([re, im, ((4, 6), (0, 3))], runs)
    assert over.kind == "overlap" and over.local[0] == (4, 6)  # rows 4, 5: re and the extra box


def _indices(e):  # from the spec: range(start, stop, step), `block` elements from each
    block = e[3] if len(e) == 4 else 1
    step = e[2] if len(e) > 2 else 1
    return [k + i for k in range(e[0], e[1], step) for i in range(block)]


@pytest.mark.parametrize("sl", [((1, 4), (0, 5)), ((0, 7, 2), (1, 5)), ((2, 7, 4, 2), (0, 5)),
                                ((1, 2), (0, 5, 2)), ((0, 5, 4, 2), (0, 4, 3, 2))])
def test_runtime_view_is_the_spec_elements(sl):
    base = torch.arange(9 * 7, dtype=torch.float32).reshape(9, 7)
    t = base[1:, 1:6]  # a view itself: offsets and strides of its own
    want = torch.tensor([[float(t[i, j]) for j in _indices(sl[1])] for i in _indices(sl[0])])
    v = view(t, sl)
    assert torch.equal(v.reshape(want.shape), want)
    v.fill_(-1)
    assert int((base == -1).sum()) == want.numel()
    assert all(t[i, j] == -1 for i in _indices(sl[0]) for j in _indices(sl[1]))


def test_the_simulator_catches_a_strided_op_in_the_wrong_rows():
    plan = compile_plan(loads(_meta(2, 4), "src.layout"), loads(_hf(2, 4), "dst.layout"))
    ops = list(plan.ops)
    ops[0] = dataclasses.replace(ops[0], dst_slice=((0, 7, 2), (0, 3)))  # rows 0, 2, 4, 6: wrong
    plan.__dict__["ops"] = tuple(ops)
    with pytest.raises(AssertionError, match="never written(.|\n)*more than once"):
        simulate(RunsView(plan.src), RunsView(plan.dst), plan)


def test_the_balance_split_cuts_a_strided_piece_along_its_plain_dim():
    """8 replicas of a Meta [32, 4096] bf16 q (NH=4, D=8) into one HF rank: each part is 16 rows
    (128 KiB), sent whole by one sender each (4x the floor of 32 KiB). Split, each part is cut
    along its columns (the rows are strided) into two halves of 64 KiB (SPLIT_MIN_BYTES):
    re = HF rows 8h + {0..3} = [0:25:8:4] from Meta rows [0:31:2]; im = [4:29:8:4] from [1:32:2]."""
    src = "layout meta\nmesh m (dp=8)\ntensor wq as q [(4, 4, (re: 1 | im: 1)), 4096]\n"
    dst = "layout hf\nmesh h (r=1) at 8\ntensor q [(4, (re: 4 | im: 4)), 4096]\n"
    plan, ops = _ops(src, dst)
    got = sorted((s, d, b) for _, s, _, d, b in ops)
    halves = ((0, 2048), (2048, 4096))
    assert got == sorted([(((0, 31, 2), c), ((0, 25, 8, 4), c), 65536) for c in halves] +
                         [(((1, 32, 2), c), ((4, 29, 8, 4), c), 65536) for c in halves])
    assert len({op.src_rank for op in plan.ops}) == 4
    assert plan.stats["max_send_bytes"] == 65536


@pytest.mark.timeout(180)
@pytest.mark.parametrize("src,dst", [("llama2_meta", "llama2_hf"), ("llama2_hf", "llama2_meta")])
def test_gloo_refit_of_the_small_llama2_pair(src, dst):
    """Two gloo workers (Meta MP=2 on ranks 0, 1; HF on rank 0) refit with checksums on, and
    every destination element is checked against the layouts (layoutlang/runtime/fill.py)."""
    plan = compile_plan(SMALL / f"{src}.layout", SMALL / f"{dst}.layout")
    assert any(strides.strided(op.dst_slice) or strides.strided(op.src_slice) for op in plan.ops)
    results = launch({"src": str(SMALL / f"{src}.layout"), "dst": str(SMALL / f"{dst}.layout"),
                      "verify": True, "steps": 2}, 2, timeout=150)
    assert all(r.ok for r in results), [r.error for r in results]


def test_a_strided_holder_is_an_alternative_source():
    """t0 `(4, (x: 1 | y: 1))` declared on ranks 0 and 1, planned onto itself: x is rows 0, 2, 4, 6
    (logical 0..3), y rows 1, 3, 5, 7 on both. Both storages continue, so each copy is one piece
    of all 8 rows (layoutlang/compiler/pieces.py: a span, its logical side the chain x0, y0, x1, ...); rank
    1's copy comes from its own tensor (a local op), found by walking that chain through rank 1's
    runs (each one row long). Into the parts written apart, `(x: 4 | y: 4)` on rank 1, each part
    is a strided read of either copy: rank 1's own, found the same way, feeds it locally."""
    text = ("mesh m (a=2)\ntensor t0 [(4, (x: 1 | y: 1))] at a=0\n"
            "tensor t0_1 as t0 [(4, (x: 1 | y: 1))] at a=1\n")
    _, ops = _ops(text, text)
    assert ops == [(0, ((0, 8),), 0, ((0, 8),), 16), (1, ((0, 8),), 1, ((0, 8),), 16)]
    _, ops = _ops(text, "mesh m (a=2)\ntensor d as t0 [(x: 4 | y: 4)] at a=1\n")
    assert ops == [(1, ((0, 7, 2),), 1, ((0, 4),), 8), (1, ((1, 8, 2),), 1, ((4, 8),), 8)]
