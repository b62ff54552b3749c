"""A rank's steps (layoutlang/compiler/steps.py): what the runtime walks, written out by hand for small pairs.

Every expected step list below is derived from the two layouts and the rules in
LANGUAGE.md 4.1 / docs/runtime.md (which ops carry quantized bytes, which buffers exist,
which rounds per-tensor scales need), not from the code under test.
"""

import networkx as nx
import pytest

from layoutlang import loads
from layoutlang.cli import main
from layoutlang.compiler import compile_plan
from layoutlang.compiler.stepgraph import rank_graph
from layoutlang.compiler.steps import schedule


def _plan(src: str, dst: str, **kw):
    return compile_plan(loads(src, "src.layout"), loads(dst, "dst.layout"), **kw)


def _lines(plan, rank: int, budget=None) -> list[str]:
    (steps,) = schedule(plan, rank, budget).steps  # one bucket
    return [str(s) for s in steps]


MX_SRC = "mesh m (tp=4)\ntensor w [64 over tp, 32]"
MX_DST = "mesh m (tp=2) at 4\ntensor w [64 over tp, 32] mxfp8"


def test_mxfp8_blocks_are_packed_by_senders_and_unpacked_by_receivers():
    """Rank 4 holds rows 0-31: rows 0-15 from rank 0, 16-31 from rank 1, each [16, 32] = whole
    32-element blocks: 512 e4m3 bytes + 16 scales = 528 B, no bf16 assembly."""
    plan = _plan(MX_SRC, MX_DST)
    assert _lines(plan, 0) == ["pack op 0 w (528 B mxfp8)", "send op 0 -> rank 4 (528 B mxfp8, staged) round 0",
                               "post round 0", "wait round 0"]
    assert _lines(plan, 4) == ["recv op 0 <- rank 0 (528 B mxfp8, staged) round 0",
                               "recv op 1 <- rank 1 (528 B mxfp8, staged) round 0",
                               "post round 0", "wait round 0",
                               "unpack op 0 w (528 B mxfp8)", "unpack op 1 w (528 B mxfp8)"]


def test_bf16_wire_assembles_receives_in_place_and_quantizes_once():
    """The v1 path: each [16, 32] bf16 block is contiguous in the [32, 32] assembly: no staging."""
    plan = _plan(MX_SRC, MX_DST, wire="bf16")
    assert _lines(plan, 4) == ["assemble w (2048 B)",
                               "recv op 0 <- rank 0 (1024 B) round 0", "recv op 1 <- rank 1 (1024 B) round 0",
                               "post round 0", "wait round 0", "quantize w"]
    assert _lines(plan, 1) == ["send op 1 -> rank 4 (1024 B) round 0", "post round 0", "wait round 0"]


def test_per_tensor_scale_agrees_the_amax_in_three_rounds():
    """nvfp4's global scale is the whole local tensor's: rank 2 hears each sender's block amax
    (round 0), sends the tensor's back (round 1), then receives the blocks quantized with it
    (round 2). [16, 32] nvfp4 = 256 B of packed e2m1 + 32 e4m3 block scales + 8 B agreement."""
    plan = _plan("mesh m (tp=2)\ntensor w [32 over tp, 32]", "mesh m (r=1) at 2\ntensor w [32, 32] nvfp4")
    assert _lines(plan, 2) == [
        "amax op 0 <- rank 0 (4 B) round 0", "amax op 1 <- rank 1 (4 B) round 0",
        "post round 0", "wait round 0", "agree w",
        "reply op 0 -> rank 0 (4 B) round 1", "reply op 1 -> rank 1 (4 B) round 1",
        "post round 1", "wait round 1",
        "recv op 0 <- rank 0 (296 B nvfp4, staged) round 2", "recv op 1 <- rank 1 (296 B nvfp4, staged) round 2",
        "post round 2", "wait round 2", "scale w",
        "unpack op 0 w (296 B nvfp4)", "unpack op 1 w (296 B nvfp4)"]
    assert _lines(plan, 1) == [
        "amax op 1 -> rank 2 (4 B) round 0", "post round 0", "wait round 0",
        "reply op 1 <- rank 2 (4 B) round 1", "post round 1", "wait round 1",
        "pack op 1 w (296 B nvfp4)", "send op 1 -> rank 2 (296 B nvfp4, staged) round 2",
        "post round 2", "wait round 2"]
    for r in range(3):
        assert nx.is_directed_acyclic_graph(rank_graph(plan, r))


def test_a_cut_block_and_padding_go_through_the_assembly():
    """Columns cut at 8 (TP4 over 32 columns) split every 32-element block: bf16, staged (a
    [32, 8] column block is not contiguous in the [32, 32] assembly); rows padded 30 -> 32."""
    plan = _plan("mesh m (tp=4)\ntensor w [30, 32 over tp]", "mesh m (r=1) at 4\ntensor w [30 pad 32, 32] mxfp8")
    lines = _lines(plan, 4)
    assert lines[0] == "assemble w (2048 B)"
    assert lines[1:5] == [f"recv op {k} <- rank {k} (480 B, staged) round 0" for k in range(4)]
    assert lines[5] == "post round 0"
    # each lands as soon as its own message is in, while the others still fly; then the round's wait
    assert lines[6:10] == [f"land op {k} w (480 B)" for k in range(4)]
    assert lines[10:] == ["wait round 0", "quantize w"]


def test_cli_steps_needs_a_rank(tmp_path, capsys):
    (tmp_path / "s.layout").write_text(MX_SRC)
    (tmp_path / "d.layout").write_text(MX_DST)
    assert main(["plan", str(tmp_path / "s.layout"), str(tmp_path / "d.layout"), "--steps"]) == 2
    err = capsys.readouterr().err
    assert "error: --steps lists one rank's steps as text" in err and "help: add --rank R (and no --format)" in err
    assert main(["plan", str(tmp_path / "s.layout"), str(tmp_path / "d.layout"), "--steps", "--rank", "4",
                 "--budget", "0"]) == 2
    assert "error: --budget 0: expected a positive number of bytes" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "s.layout"), str(tmp_path / "d.layout"), "--steps", "--rank", "4",
                 "--budget", "600"]) == 0
    out = capsys.readouterr().out.splitlines()
    # one destination instance: one bucket whatever the budget (an instance is never cut); its 4 ops
    assert out[0] == "rank 4: 1 buckets (budget 600 B), 6 steps"
    assert out[1] == "bucket 0: destination instances 0..0, ops 0..3"
    assert out[2:] == ["  recv op 0 <- rank 0 (528 B mxfp8, staged) round 0",
                       "  recv op 1 <- rank 1 (528 B mxfp8, staged) round 0",
                       "  post round 0", "  wait round 0",
                       "  unpack op 0 w (528 B mxfp8)", "  unpack op 1 w (528 B mxfp8)"]
