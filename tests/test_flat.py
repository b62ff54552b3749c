"""Flat dims (docs/language.md 14.9): DeepSpeed ZeRO-3 and torch FSDP1 flat shards.

Expected values are written down by hand from the rule (and, for FSDP1, from what torch 2.13's
`FullyShardedDataParallel` reports on 2 gloo ranks for `Sequential(Linear(5, 3), Linear(3, 7))`:
`_flat_param.numel()`, `_numels_with_padding` and `_shard_param_infos`, quoted below); random
layouts are checked against tests/reference_enumerator.py (`Flat`, written from the rule) and
plans against the element-by-element simulator on the test's own model of every tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from layoutlang import compile_plan, loads
from layoutlang.compiler.flat import boxes
from layoutlang.diagnostics import LayoutError
from layoutlang.modes import PadRun, Run
from layout_strategies import ModelSide, flat_key_shapes, flat_pairs, flat_sides
from plan_simulator import ModelInstance, ModelRegion, ModelView, check_plan_views, check_stats, simulate
from reference_enumerator import dim_local

LINEARS = "[3, 5] as 0.weight | [3] as 0.bias | [7, 3] as 1.weight | [7] as 1.bias"


def _runs(text: str) -> dict[int, tuple]:
    (t,) = loads(text, "flat.layout").tensors
    return {r: t.runs(r)[0] for r in t.ranks()}


def test_fsdp1_without_use_orig_params_holds_what_torch_holds():
    # torch: numels_with_padding (15, 3, 21, 7), 23 elements per rank; rank 0 holds 0.weight at 0,
    # 0.bias at 15, 1.weight[0:5] at 18; rank 1 1.weight[5:21] at 0, 1.bias at 16
    runs = _runs(f"mesh m (dp=2)\ntensor p [flat({LINEARS}) pad dp over dp] fp32\n")
    assert runs == {0: (Run(0, 0, 23),), 1: (Run(0, 23, 23),)}


def test_fsdp1_with_use_orig_params_aligns_each_parameter():
    # torch: numels_with_padding (15, 1, 3, 1, 21, 3, 7, 1), 26 per rank: 0.weight at 0, 0.bias
    # at 16, 1.weight at 20 (rank 0: elements 0..5 at 20; rank 1: 6..20 at 0), 1.bias at 18 on
    # rank 1, its local 25 padding
    runs = _runs(f"mesh m (dp=2)\ntensor p [flat({LINEARS}) align 4 pad dp over dp] fp32\n")
    assert runs[0] == (Run(0, 0, 15), PadRun(15, 1), Run(16, 15, 3), PadRun(19, 1), Run(20, 18, 6))
    assert runs[1] == (Run(0, 24, 15), PadRun(15, 3), Run(18, 39, 7), PadRun(25, 1))


def test_the_formatter_writes_a_flat_dim_back_as_it_parses():
    from layoutlang.fmt import format_text

    text = ("mesh m (dp=2)\n"
            "tensor p [flat([(2, (re: 1 | im: 2)), 2*2] as q | [] as s | [3] as b) align 4 pad dp over dp ragged] bf16\n")
    once = format_text(text)
    assert "flat([(2, (re: 1 | im: 2)), 2*2] as q | [] as s | [3] as b) align 4 pad dp over dp ragged" in once
    assert format_text(once) == once
    assert [r.key for r in loads(once, "f.layout").tensors[0].regions] == ["q", "s", "b"]


def test_a_flat_key_is_never_read_as_the_other_sides_parts():
    # a plain v1 tensor would be read as the halves (refine.py); a flat key's dims are what its SHAPE
    # writes: refused at the pair, naming both sides, until the SHAPE writes the halves too
    import pytest

    from layoutlang.compiler.match import PlanError

    hf = loads("mesh h (r=1)\ntensor q [(2, (re: 2 | im: 2)), 3]\n", "h.layout")
    plain = loads("mesh z (dp=2)\ntensor f [flat([8, 3] as q) pad dp over dp]\n", "z.layout")
    for src, dst in ((plain, hf), (hf, plain)):
        with pytest.raises(PlanError, match=r"`q` dim 0: parts on one side only"):
            compile_plan(src, dst)
    halves = loads("mesh z (dp=2)\ntensor f [flat([(2, (re: 2 | im: 2)), 3] as q) pad dp over dp]\n", "z.layout")
    ops = compile_plan(halves, hf).ops
    # storage row r of the flat key is storage row r of HF's: every element where it was
    assert sorted((op.src_rank, op.src_slice, op.dst_slice) for op in ops) == [
        (0, ((0, 12),), ((0, 4), (0, 3))), (1, ((0, 12),), ((4, 8), (0, 3)))]


def test_a_range_of_a_key_is_at_most_2n_minus_1_boxes():
    assert boxes((3, 5), 8, 15) == [((1, 2), (3, 5)), ((2, 3), (0, 5))]   # ZeRO-3 rank 1's [3, 5]
    assert boxes((7, 3), 0, 5) == [((0, 1), (0, 3)), ((1, 2), (0, 2))]    # FSDP1 rank 0's 1.weight
    assert boxes((4, 4, 4), 1, 63) == [((0, 1), (0, 1), (1, 4)), ((0, 1), (1, 4), (0, 4)), ((1, 3), (0, 4), (0, 4)),
                                       ((3, 4), (0, 3), (0, 4)), ((3, 4), (3, 4), (0, 3))]
    assert boxes((4,), 1, 3) == [((1, 3),)] and boxes((), 0, 1) == [()]


def test_zero3_shard_into_one_rank_by_hand():
    # ZeRO-3, W = 2, a [3, 5] parameter: 15 elements padded to 16; rank 0 holds flat 0..7 (row 0,
    # row 1 columns 0..2), rank 1 flat 8..14 (row 1 columns 3..4, row 2) and one padding element
    src = loads("mesh z (dp=2)\ntensor w.ds [flat([3, 5] as w) pad dp over dp] fp32\n", "z.layout")
    dst = loads("mesh e (tp=1) at 2\ntensor w [3, 5] fp32\n", "e.layout")
    plan = compile_plan(src, dst)
    got = sorted((op.src_rank, op.src_slice, op.dst_slice) for op in plan.ops)
    assert got == [(0, ((0, 5),), ((0, 1), (0, 5))), (0, ((5, 8),), ((1, 2), (0, 3))),
                   (1, ((0, 2),), ((1, 2), (3, 5))), (1, ((2, 7),), ((2, 3), (0, 5)))]
    back = compile_plan(dst, src)  # and back: the padding element (rank 1's local 7) is never written
    assert sorted((op.dst_rank, op.dst_slice) for op in back.ops) == [
        (0, ((0, 5),)), (0, ((5, 8),)), (1, ((0, 2),)), (1, ((2, 7),))]


def test_fsdp1_into_tp2_columns_by_hand():
    # 1.weight [7, 3] (flat 18..38, no alignment) into TP2 over its columns (`3 pad 2`: tp 0 holds
    # columns 0..1, tp 1 column 2): rank 1's rows 2..6 are every third element from local 1
    src = loads(f"mesh m (dp=2)\ntensor p [flat({LINEARS}) pad dp over dp] fp32\n", "f.layout")
    dst = loads("mesh e (tp=2) at 2\ntensor w as 1.weight [7, 3 pad 2 over tp] fp32\n", "e.layout")
    got = sorted((op.dst_rank, op.dst_slice, op.src_rank, op.src_slice) for op in compile_plan(src, dst).ops)
    assert got == [
        (2, ((0, 1), (0, 2)), 0, ((18, 20),)), (2, ((1, 2), (0, 2)), 0, ((21, 23),)),
        (2, ((2, 7), (0, 2)), 1, ((1, 14, 3, 2),)),                  # rows 2..6, columns 0..1
        (3, ((0, 1), (0, 1)), 0, ((20, 21),)), (3, ((1, 2), (0, 1)), 1, ((0, 1),)),
        (3, ((2, 7), (0, 1)), 1, ((3, 16, 3),)),                     # rows 2..6, column 2
    ]


def test_a_flat_key_cut_on_two_inner_dims_is_cut_into_entries():
    # a [2, 4, 4] key, whole on one rank, against a layout that cuts both inner dims: each
    # destination block is two strided levels of the flat storage, so it moves row by row
    src = loads("mesh z (dp=1)\ntensor f [flat([2, 4, 4] as w)]\n", "z.layout")
    dst = loads("mesh e (a=2, b=2) at 1\ntensor w [2, 4 over a, 4 over b]\n", "e.layout")
    plan = compile_plan(src, dst)
    assert all(len(op.src_slice) == 1 for op in plan.ops)
    rank1 = sorted((op.dst_slice, op.src_slice) for op in plan.ops if op.dst_rank == 1)
    assert rank1 == [(((0, 1), (0, 2), (0, 2)), ((0, 5, 4, 2),)), (((1, 2), (0, 2), (0, 2)), ((16, 21, 4, 2),))]


def test_every_other_row_of_a_flat_key_is_one_strided_entry():
    # an [8, 3] key whole on one rank against `8 over tp cyclic` (tp = 2): tp 0 holds rows 0, 2, 4, 6,
    # flat elements 0..2, 6..8, 12..14, 18..20 (blocks of 3 every 6), tp 1 the same from 3
    src = loads("mesh z (dp=1)\ntensor u [flat([8, 3] as k)]\n", "z.layout")
    dst = loads("mesh e (tp=2) at 1\ntensor t as k [8 over tp cyclic, 3]\n", "e.layout")
    got = sorted((op.dst_rank, op.src_slice, op.dst_slice) for op in compile_plan(src, dst).ops)
    assert got == [(1, ((0, 19, 6, 3),), ((0, 4), (0, 3))), (2, ((3, 22, 6, 3),), ((0, 4), (0, 3)))]


# ---------------------------------------------------------------------------
# Random flat layouts against the reference enumerator and the simulator


def _model(side: ModelSide) -> list[ModelInstance]:
    return [ModelInstance(t.name, t.key, side.mesh, t.dim_specs, t.holders,
                          None if t.regions is None else
                          tuple(ModelRegion(k, (rng,), shape=shape) for k, rng, shape in t.regions))
            for t in side.tensors]


@settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_flat_dims_hold_what_the_rule_says(data):
    shapes = data.draw(flat_key_shapes())
    side = data.draw(flat_sides(shapes))
    try:
        layout = loads(side.text, "flat.layout")
    except LayoutError:
        assert not side.valid, side
        return
    assert side.valid, side
    by_name = {t.name: t for t in layout.tensors}
    for m in side.tensors:
        t = by_name[m.name]
        assert [(r.key, r.box, r.shape) for r in t.regions] == [(k, (rng,), shape) for k, rng, shape in m.regions]
        for rank in m.holders:
            expanded = []
            for run in t.runs(rank)[0]:
                assert run.local_start == len(expanded)
                expanded += (list(range(run.logical_start, run.logical_start + run.length))
                             if isinstance(run, Run) else [None] * run.length)
            assert expanded == dim_local(m.dim_specs[0], side.mesh.sizes, side.mesh.coords(rank)), (side, rank)
            if all(x is None for x in expanded):
                event("a rank holds only padding")


@settings(max_examples=int(os.environ.get("PLAN_EXAMPLES", 120)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(flat_pairs())
def test_random_flat_pairs_plan_exactly(pair):
    src_side, dst_side = pair
    event(" -> ".join(side.kind.split(" W=")[0] for side in pair))
    if "x:" in src_side.text:
        event("keys with structured dims (products, parts)")
    try:
        src, dst = loads(src_side.text, "src.layout"), loads(dst_side.text, "dst.layout")
    except LayoutError:
        assert not (src_side.valid and dst_side.valid), pair
        event("an indivisible split: refused")
        return
    assert src_side.valid and dst_side.valid, pair
    plan = compile_plan(src, dst)
    if any(len(e) > 2 for op in plan.ops for e in op.src_slice + op.dst_slice):
        event("strided flat entries")
    report = simulate(ModelView(src, _model(src_side)), ModelView(dst, _model(dst_side)), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))


# ---------------------------------------------------------------------------
# On gloo: two processes, torch FSDP1's flat parameter (use_orig_params=True, fp32: `align 4`)
# into a TP2 engine layout on the same two ranks and back; every destination element checked
# by the worker against the fill rule (value by key and row-major index in the key): a flat dim's
# padding untouched (still the NaN it was given), an engine's padding zero

FSDP1_TEXT = f"mesh train (dp=2)\ntensor _fsdp_wrapped_module._flat_param [flat({LINEARS}) align 4 pad dp over dp] fp32\n"
TP2_TEXT = ("mesh infer (tp=2)\n"
            "tensor 0.weight [3 pad 2 over tp, 5] fp32\n"         # rows of the first Linear, tp 1 one padding row
            "tensor 0.bias [3 pad 2 over tp] fp32\n"
            "tensor 1.weight [7, 3 pad 2 over tp] fp32\n"         # columns of the second: strided flat entries
            "tensor 1.bias [7] fp32\n")


def test_fsdp1_flat_parameter_refits_into_tp2_and_back_on_gloo(tmp_path):
    from layoutlang.runtime.launch import launch

    (tmp_path / "fsdp1.layout").write_text(FSDP1_TEXT)
    (tmp_path / "tp2.layout").write_text(TP2_TEXT)
    # and from a quantized engine (mxfp8, dequantized by the sender) into a flat destination: the
    # worker locates each flat element's key coordinate in the source shard that sent it
    (tmp_path / "mx.layout").write_text("mesh infer (tp=2)\ntensor w [7, 64 over tp] mxfp8\n")
    # (448 elements padded to 450: rank 1 ends in 2 padding elements, which the refit leaves alone)
    (tmp_path / "zero3.layout").write_text("mesh train (dp=2)\ntensor w.ds [flat([7, 64] as w) pad 3 over dp] fp32\n")
    # and into a key stored transposed ([in, out], HF Conv1D): the sender turns each flat block
    (tmp_path / "conv.layout").write_text("mesh e (tp=2)\ntensor w [4, 5 pad 2 over tp] transposed\n")
    (tmp_path / "flat.layout").write_text("mesh train (dp=2)\ntensor f [flat([5, 4] as w) pad dp over dp] fp32\n")
    for src, dst in (("fsdp1", "tp2"), ("tp2", "fsdp1"), ("mx", "zero3"), ("flat", "conv"), ("conv", "flat")):
        job = {"src": str(tmp_path / f"{src}.layout"), "dst": str(tmp_path / f"{dst}.layout"), "args": {},
               "verify": True, "budget": None}
        results = launch(job, 2, timeout=120)
        for r in results:
            assert r.ok, f"{src} -> {dst}, rank {r.rank}: {r.error}"


def test_checkpoint_save_and_load_of_flat_shards_on_gloo(tmp_path):
    """Each byte of an HF checkpoint written from the flat shards of 2 ranks (no gather), equal
    to the fill rule on whole tensors; loaded back into the shards, their padding untouched."""
    from safetensors.torch import load_file

    from layoutlang.runtime.fill import source_tensor
    from layoutlang.runtime.launch import launch

    text = (f"mesh train (dp=2)\ntensor p [flat({LINEARS}) align 4 pad dp over dp] fp32\n"
            "tensor q.ds [flat([6, 4] as q.weight) pad dp over dp] fp32\n")
    job = {"text": text, "dir": str(tmp_path / "ckpt")}
    for r in launch(job, 2, timeout=120, program=str(Path(__file__).parent / "flat_checkpoint_program.py")):
        assert r.ok, f"rank {r.rank}: {r.result}"
    files = {}
    for f in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        files.update(load_file(str(f)))
    whole = loads("mesh h (r=1)\ntensor 0.weight [3, 5] fp32\ntensor 0.bias [3] fp32\ntensor 1.weight [7, 3] fp32\n"
                  "tensor 1.bias [7] fp32\ntensor q.weight [6, 4] fp32\n", "whole.layout")
    assert sorted(files) == sorted(t.name for t in whole.tensors)
    for t in whole.tensors:
        assert torch.equal(files[t.name], source_tensor(t, 0)), t.name


def test_flat_rotary_keys_save_and_load_without_a_config(tmp_path):
    """ZeRO-3 shards whose q/k keys are HF's rotary halves (as the bridges write them) save into an
    empty directory and load back without the model's config: the files' q/k rows are read as
    the halves the flat keys write (a flat key pairs strictly). The halves name HF's own storage
    order, so each saved tensor is the flat storage's range of its key, row-major, as it is; and
    the load gives the storage back, padding untouched."""
    from safetensors.torch import load_file

    from layoutlang import checkpoint

    text = ("mesh z (dp=1)\n"
            "tensor q.ds [flat([(2, (re: 4/2 | im: 4/2)), 6] as model.layers.0.self_attn.q_proj.weight) pad 5 over dp] fp32\n"
            "tensor k.ds [flat([(1, (re: 4/2 | im: 4/2)), 6] as model.layers.0.self_attn.k_proj.weight) pad 5 over dp] fp32\n")
    layout = loads(text, "z3.layout")
    mine = {"q.ds": torch.arange(50, dtype=torch.float32), "k.ds": torch.arange(25, dtype=torch.float32) + 100}
    checkpoint.save(tmp_path / "ckpt", layout, mine, rank=0)
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert torch.equal(saved["model.layers.0.self_attn.q_proj.weight"], torch.arange(48.0).reshape(8, 6))
    assert torch.equal(saved["model.layers.0.self_attn.k_proj.weight"], (torch.arange(24.0) + 100).reshape(4, 6))
    back = {"q.ds": torch.full((50,), 7.0), "k.ds": torch.full((25,), 7.0)}
    checkpoint.load(tmp_path / "ckpt", layout, back, rank=0)
    assert torch.equal(back["q.ds"][:48], mine["q.ds"][:48]) and back["q.ds"][48:].tolist() == [7.0, 7.0]
    assert torch.equal(back["k.ds"][:24], mine["k.ds"][:24]) and back["k.ds"][24:].tolist() == [7.0]
