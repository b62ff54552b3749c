"""Unit tests of elaboration and the IR's per-rank answers, on hand-worked layouts."""

import gc
import tracemalloc
import weakref

import pytest

from layoutlang import LayoutError, PadRun, Run, load, loads


def one(text, **args):
    layout = loads(text, args=args or None)
    assert len(layout.tensors) == 1
    return layout, layout.tensors[0]


def test_plain_split_contiguous():
    _, t = one("mesh m (dp=2, tp=4)\ntensor w [16 over tp, 3]")
    assert t.local_shape == (4, 3) and t.logical_shape == (16, 3)
    # rank 6 = dp 1, tp 2 (tp fastest)
    assert t.runs(6) == ((Run(0, 8, 4),), (Run(0, 0, 3),))
    assert t.replica_axes == ("dp",)


def test_strided_concat_split_each_part():
    _, t = one("mesh m (tp=2)\ntensor w [(gate: 4 | up: 4) over tp]")
    assert t.runs(1) == ((Run(0, 2, 2), Run(2, 6, 2)),)


def test_grouped_qkv_hoists_to_q_then_k_then_v():
    # (KV=2, (q: 2 | k: 1 | v: 1)): storage q0 q0 k0 v0 q1 q1 k1 v1
    # logical: q0 q0 q1 q1 | k0 k1 | v0 v1
    _, t = one("mesh m (tp=1)\ntensor w [(2, (q: 2 | k: 1 | v: 1))]")
    (dim,) = t.runs(0)
    expanded = [r.logical_start + i for r in dim for i in range(r.length)]
    assert expanded == [0, 1, 4, 6, 2, 3, 5, 7]


def test_product_replicated_when_axis_exceeds_count():
    layout, t = one("mesh m (tp=8)\ntensor kv [(2, 4) over tp]")
    assert t.local_shape == (4,)
    assert [t.runs(r)[0][0].logical_start for r in range(8)] == [0, 0, 0, 0, 4, 4, 4, 4]


def test_pad_over_puts_padding_on_tail_coordinates():
    _, t = one("mesh m (tp=4)\ntensor e [10 pad 8 over tp]")
    assert t.local_shape == (4,)
    assert t.runs(2) == ((Run(0, 8, 2), PadRun(2, 2)),)
    assert t.runs(3) == ((PadRun(0, 4),),)


def test_chunk_align_pads_local_tail():
    _, t = one("mesh m (gtp=2, tp=2)\ntensor w [12 over tp chunk gtp align 4]")
    # local extent 6 -> padded to 8 -> chunks of 4
    assert t.local_shape == (4,)
    assert t.runs(0) == ((Run(0, 0, 4),),)          # gtp 0, tp 0
    assert t.runs(2) == ((Run(0, 4, 2), PadRun(2, 2)),)  # gtp 1, tp 0


def test_tuple_over_first_axis_major():
    _, t = one("mesh m (a=2, b=3)\ntensor w [12 over (b, a)]")
    # combined coordinate = b * 2 + a; rank 1 is a=0, b=1 -> 2
    assert t.runs(1) == ((Run(0, 4, 2),),)


def test_loop_over_places_and_local_names():
    layout = loads("mesh m (pp=2, tp=1)\nfor l in 0..5 over pp sizes [2, 3] { tensor x.{l.local}.w [4] }")
    names = [(t.key, t.name, t.holds(0), t.holds(1)) for t in layout.tensors]
    assert names == [("x.0.w", "x.0.w", True, False), ("x.1.w", "x.1.w", True, False),
                     ("x.2.w", "x.0.w", False, True), ("x.3.w", "x.1.w", False, True),
                     ("x.4.w", "x.2.w", False, True)]


def test_at_places_on_one_coordinate_and_axis_size_in_arithmetic():
    layout = loads("mesh m (pp=4, tp=2)\ntensor out [8] at pp=pp-1")
    t = layout.tensors[0]
    assert [r for r in range(layout.ranks) if t.holds(r)] == [6, 7]


def test_second_mesh_with_offset_and_on():
    layout = loads("mesh a (tp=2)\nmesh b (tp=4) at 2\ntensor w [8 over tp] on b\ntensor v [8]")
    w, v = layout.tensors
    assert layout.ranks == 6
    assert [r for r in range(6) if w.holds(r)] == [2, 3, 4, 5]
    assert [r for r in range(6) if v.holds(r)] == [0, 1]


def test_args_override_and_default_dtype():
    layout = loads("arg TP = 2\nmesh m (tp=TP)\ndefault dtype fp32\ntensor w [8 over tp]", args={"TP": 4})
    t = layout.tensors[0]
    assert t.local_shape == (2,) and t.dtype == "fp32" and layout.args == (("TP", 4),)


def test_as_key_and_replica_statements_share_a_key():
    layout = loads("mesh m (pp=2)\ntensor emb [8, 4] at pp=0\ntensor out as emb [8, 4] at pp=pp-1")
    assert [t.key for t in layout.tensors] == ["emb", "emb"]
    assert len(layout.by_key["emb"]) == 2


def test_bytes_per_rank_counts_storage_and_scales():
    layout = loads("mesh m (tp=2)\ntensor a [64 over tp, 32] mxfp8\ntensor b [4] fp8_e4m3\ntensor c [3] bf16")
    # a: 32*32 + 32*32/32 = 1056; b: 4 + 4; c: 6
    assert layout.bytes_per_rank() == [1070, 1070]


def test_exact_division_reports_both_operands():
    with pytest.raises(LayoutError) as e:
        loads("const Q = 32, KV = 6\nmesh m (tp=1)\ntensor w [Q/KV]")
    assert "32 / 6 leaves remainder 2" in e.value.message
    assert (e.value.line, e.value.col) == (3, 11)


def test_ir_memory_is_independent_of_rank_count():
    # The same 512 tensor instances on 8 and on 8192 ranks.
    text = ("arg DP = 1\nmesh d (dp=DP, tp=8)\nmesh e (dp=DP, ep=8)\nfor l in 0..8 {\n"
            "  for x in 0..64 over ep { tensor l{l}.e{x.local} [64, 1024 over dp] on e }\n}")

    def peak(dp):
        tracemalloc.start()
        layout = loads(text, args={"DP": dp})
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(layout.tensors) == 512
        return top

    peak(1)  # warm the parser so that neither measurement pays for building it
    small, large = peak(1), peak(1024)
    assert large < 1.2 * small, (small, large)


def test_exact_division_shows_the_operands_parentheses():
    with pytest.raises(LayoutError) as e:
        loads("const A = 8, B = 2\nconst C = 2*(A - B)/(A - 3)")
    assert e.value.message == "`2*(A - B)/(A - 3)` is not exact: 12 / 5 leaves remainder 2"


def test_a_layout_carries_the_texts_it_was_compiled_from(tmp_path):
    (tmp_path / "common.layout").write_text("const H = 8\n")
    main = tmp_path / "main.layout"
    main.write_text('include "common.layout"\nmesh m (tp=2)\ntensor w [H over tp]\n')
    layout = load(main)
    assert layout.source_text == main.read_text()
    assert [(s.path, s.text) for s in layout.sources] == [
        (str(main), main.read_text()), (str(tmp_path / "common.layout"), "const H = 8\n")]
    main.write_text("mesh m (tp=1)\n")  # an edit after compiling changes nothing
    assert layout.source_text.endswith("tensor w [H over tp]\n")
    # held once: the text the spans point at, not a copy
    assert layout.tensors[0].span.source is layout.sources[0]
    assert loads("mesh m (tp=1)").source_text == "mesh m (tp=1)"


def test_what_is_computed_about_a_layout_is_dropped_with_it():
    """No process-wide memo keeps a dim, a source or a shape alive (caches belong to their objects)."""
    layout = loads("mesh m (dp=2, tp=4)\nfor l in 0..4 {\n  tensor w.{l} [(a: 16 | b: 8) over tp, 4 chunk dp]\n}")
    for t in layout.tensors:
        for r in t.ranks():
            t.runs(r)
    dim, source = weakref.ref(layout.tensors[0].dims[0]), weakref.ref(layout.sources[0])
    assert {id(t.local_shape) for t in layout.tensors} == {id(layout.tensors[0].local_shape)}
    del layout, t
    gc.collect()
    assert dim() is None and source() is None
