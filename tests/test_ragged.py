"""Ragged splits (LANGUAGE.md 8.5): `over AXIS ragged` and `chunk AXIS ragged` cut like torch.chunk.

The reference for what each rank stores is torch.chunk itself, applied to an
arange of the logical extent (and, for nested splits, to the chunk it holds):
exactly what DTensor `Shard(d)` and FSDP2 `fully_shard` store.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layoutlang import compile_plan
from layoutlang.diagnostics import LayoutError
from layoutlang.elaborate import loads
from layoutlang.fmt import format_text
from layoutlang.modes import Run

from plan_simulator import RunsView, check_plan_views, simulate


def _chunk(n: int, s: int, c: int) -> list[int]:
    """Logical indices coordinate c of s holds when n elements are torch.chunk'ed (empty past the chunks)."""
    parts = torch.arange(n).chunk(s)
    return parts[c].tolist() if c < len(parts) else []


def _held(runs) -> list[int]:
    out = []
    for r in runs:
        assert isinstance(r, Run), "a ragged split has no padding"
        out.extend(range(r.logical_start, r.logical_start + r.length))
    return out


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), s=st.integers(1, 8))
def test_over_ragged_holds_what_torch_chunk_gives(n, s):
    layout = loads(f"mesh m (dp={s})\ntensor w [{n} over dp ragged, 3]")
    t = layout.tensors[0]
    for rank in range(s):
        want = _chunk(n, s, rank)
        assert _held(t.runs(rank)[0]) == want
        assert t.local_shape_at(rank) == (len(want), 3)
    assert t.local_shape == (len(_chunk(n, s, 0)), 3)  # the largest


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), tp=st.integers(1, 4), dp=st.integers(1, 4))
def test_chunk_ragged_cuts_the_tp_shard_like_fsdp2_on_top_of_tp(n, tp, dp):
    """FSDP2 over a TP plan: Shard(0) on tp, then the tp-local block torch.chunk'ed over dp
    (DTensor's `_StridedShard(0, split_factor=tp), Shard(0)` on mesh (dp, tp))."""
    layout = loads(f"mesh m (dp={dp}, tp={tp})\ntensor w [{n} over tp ragged chunk dp ragged]")
    t = layout.tensors[0]
    for d in range(dp):
        for p in range(tp):
            tp_block = torch.arange(n).chunk(tp)
            mine = tp_block[p] if p < len(tp_block) else torch.arange(0)
            parts = mine.chunk(dp) if mine.numel() else ()
            want = parts[d].tolist() if d < len(parts) else []
            rank = d * tp + p
            assert _held(t.runs(rank)[0]) == want, (rank, want)
            assert t.local_shape_at(rank) == (len(want),)


def test_products_cut_their_copies_and_concatenations_each_part():
    # (3, 4) over 4 ragged: copies 0, 1, 2 on coordinates 0..2, nothing on 3.
    t = loads("mesh m (dp=4)\ntensor v [(3, 4) over dp ragged, 2]").tensors[0]
    assert [_held(t.runs(r)[0]) for r in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], []]
    assert [t.local_shape_at(r) for r in range(4)] == [(4, 2), (4, 2), (4, 2), (0, 2)]
    # (a: 3 | b: 5) over 2 ragged: a -> [0, 1] | [2]; b (logical 3..7) -> [3, 4, 5] | [6, 7].
    t = loads("mesh m (dp=2)\ntensor u [(a: 3 | b: 5) over dp ragged]").tensors[0]
    assert [_held(t.runs(r)[0]) for r in range(2)] == [[0, 1, 3, 4, 5], [2, 6, 7]]


def test_fmt_round_trips_ragged():
    text = "mesh m (dp=2, tp=2)\ntensor w [5 over dp ragged, 6 over tp ragged chunk dp ragged]\n" \
           "tensor v [(3, 4) over (dp, tp) ragged]\n"
    assert format_text(text) == text
    assert format_text(format_text(text)) == text


def _error(text: str) -> str:
    with pytest.raises(LayoutError) as e:
        loads(text, path="bad.layout")
    return str(e.value)


def test_equal_chunks_of_a_ragged_split_are_a_diagnostic_at_the_chunk():
    msg = _error("mesh m (dp=2, tp=2)\ntensor w [5 over tp ragged chunk dp, 4]")
    assert "bad.layout:2:28: error: `chunk dp` cuts equal chunks" in msg
    assert "help: write `chunk dp ragged`" in msg


def test_mxfp8_needs_whole_blocks_on_every_ragged_rank():
    # 96 over 2 ragged: 48 and 48 -> 48 is not a multiple of 32.
    msg = _error("mesh m (tp=2)\ntensor w [4, 96 over tp ragged] mxfp8")
    assert "bad.layout:2:14: error: mxfp8 needs the local last dim to be a multiple of 32; here it is 48" in msg
    loads("mesh m (tp=2)\ntensor w [4, 96 over tp ragged] bf16")  # fine unquantized
    loads("mesh m (tp=3)\ntensor w [4, 96 over tp ragged] mxfp8")  # 32 each


def test_ragged_is_a_keyword():
    msg = _error("const ragged = 2\nmesh m (tp=2)\ntensor w [4]")
    assert "bad.layout:1:7: error" in msg


RAGGED = """
mesh m (dp=2, tp=2)
tensor w [5 over dp ragged, 4 over tp]
tensor v [(3, 4) over (dp, tp) ragged, 2]
tensor u [(a: 3 | b: 5) over dp ragged]
tensor x [6 over tp ragged chunk dp ragged]
tensor y [1 over tp ragged]
tensor z as k.{e} [e in 0..3 over dp ragged, 2]
"""
EVEN = """
mesh m (tp=3) at 1
tensor w [5, 4 over tp ragged]
tensor v [12 over tp, 2]
tensor u [(a: 3 | b: 5)]
tensor x [6 over tp]
tensor y [1]
for e in 0..3 {
  tensor k.{e} [2 over tp ragged]
}
"""


@pytest.mark.parametrize("src,dst", [("ragged", "even"), ("even", "ragged"), ("ragged", "ragged")])
def test_ragged_pairs_plan_every_element_exactly_once(tmp_path, src, dst):
    files = {"ragged": RAGGED, "even": EVEN}
    for name, text in files.items():
        (tmp_path / f"{name}.layout").write_text(text)
    plan = compile_plan(str(tmp_path / f"{src}.layout"), str(tmp_path / f"{dst}.layout"))
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_plan_views(plan, range(plan.world))
    # Every destination element once per rank holding it, counted from the layouts by hand:
    # ragged (dp=2 x tp=2): w 20, v 24, u 8 x 2 tp replicas, x 6, y 1 x 2 dp replicas, z 6 x 2 tp replicas;
    # even (tp=3): w 20, v 24, u 8 x 3, x 6, y 1 x 3, k.e [2 over tp ragged] = 2 each, all 3 ranks.
    want = {"ragged": 20 + 24 + 16 + 6 + 2 + 12, "even": 20 + 24 + 24 + 6 + 3 + 6}
    assert report.dst_data_elements == want[dst]
    if src == dst:
        assert report.network_bytes == 0


SMALL_V2 = __import__("pathlib").Path(__file__).parents[1] / "examples" / "small" / "v2"


@pytest.mark.parametrize("other", ["llama_hf", "llama_vllm", "llama_megatron"])
@pytest.mark.parametrize("direction", ["from_fsdp2", "to_fsdp2"])
def test_the_fsdp2_example_pairs_with_every_llama_layout(other, direction):
    fsdp2, peer = str(SMALL_V2 / "llama_fsdp2.layout"), str(SMALL_V2 / f"{other}.layout")
    src, dst = (fsdp2, peer) if direction == "from_fsdp2" else (peer, fsdp2)
    plan = compile_plan(src, dst)
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_plan_views(plan, range(plan.world))
    if direction == "to_fsdp2":
        # Every element of the model once over the 3 FSDP2 ranks (no replicas): 501,376 elements
        # (V*H*2 + L*(2*Q*D*H + 2*KV*D*H + 3*F*H) + (2*L + 1)*H, by hand from the layout).
        assert report.dst_data_elements == 900 * 128 * 2 + 2 * (2 * 128 * 128 + 2 * 16 * 128 + 3 * 256 * 128) + 5 * 128


def test_fsdp2_example_local_shapes_are_torch_chunk():
    from layoutlang import load

    layout = load(str(SMALL_V2 / "llama_fsdp2.layout"))
    k = next(t for t in layout.tensors if t.name == "model.layers.0.self_attn.k_proj.weight")
    assert [k.local_shape_at(r)[0] for r in range(3)] == [len(c) for c in torch.arange(16).chunk(3)]  # 6, 6, 4
    o = next(t for t in layout.tensors if t.name == "model.layers.0.self_attn.o_proj.weight")
    assert [o.local_shape_at(r) for r in range(3)] == [(43, 128), (43, 128), (42, 128)]


@pytest.mark.parametrize("src,dst", [("llama_fsdp2", "llama_vllm"), ("llama_vllm", "llama_fsdp2")])
def test_fsdp2_example_refits_on_gloo_with_every_element_checked(src, dst):
    from layoutlang.runtime.launch import launch

    job = {"src": str(SMALL_V2 / f"{src}.layout"), "dst": str(SMALL_V2 / f"{dst}.layout"), "args": {},
           "verify": True, "budget": None}
    results = launch(job, 4, timeout=150)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
