"""`layoutc explain`: every tensor of every example renders; pictures match the shards."""

from pathlib import Path

import pytest

from layoutlang import compile_plan, load
from layoutlang.cli import main
from layoutlang.compiler.explain import explain_text, rank_ranges
from layoutlang.compiler.shards import placement_of

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted(ROOT.glob("examples/**/*.layout"))
PAIRS = [("small/llama_train", "small/llama_infer"), ("small/moe_train", "small/moe_infer"),
         ("small/pp_train", "small/pp_infer"), ("small/mamba_train", "small/mamba_infer"),
         ("llama3_8b_train", "llama3_8b_infer_tp16")]


def representatives(layout):
    """One key per distinct placement (what explain's output depends on), or every key."""
    if len(layout.by_key) <= 2000:
        return list(layout.by_key)
    seen, keys = set(), []
    for t in layout.tensors:
        sig = placement_of(t)
        if sig not in seen:
            seen.add(sig)
            keys.append(t.key)
    return keys


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_tensor_of_every_example(path):
    layout = load(path)
    for key in representatives(layout):
        text = explain_text(layout, key)
        assert text.startswith(key) and "source " in text


@pytest.mark.parametrize("src, dst", PAIRS)
def test_pairs_show_ops(src, dst):
    s, d = load(ROOT / f"examples/{src}.layout"), load(ROOT / f"examples/{dst}.layout")
    plan = compile_plan(s, d)
    for key in list(d.by_key)[:40]:
        text = explain_text(s, key, d, plan)
        n_ops = sum(1 for op in plan.ops if op.key == key)
        assert f"{n_ops} ops" in text and "destination " in text


def test_shard_table_lists_ranks_and_runs():
    from layoutlang import loads
    s = loads("mesh m (dp=2, tp=2)\ntensor w [(gate: 4 | up: 4) over tp, 3]", "s.layout")
    text = explain_text(s, "w")
    assert "dim 0 parts: gate [0, 4)  up [4, 8)" in text
    assert "0:2->0:2 2:4->4:6" in text and "0,2" in text  # shard 0: tp 0 on ranks 0 and 2
    assert "0:2->2:4 2:4->6:8" in text and "1,3" in text


def test_rank_ranges():
    assert rank_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_cli(capsys):
    src, dst = str(ROOT / "examples/small/llama_train.layout"), str(ROOT / "examples/small/llama_infer.layout")
    key = load(src).tensors[0].key
    assert main(["explain", src, dst, key, "--rank", "0"]) == 0
    assert key in capsys.readouterr().out
    assert main(["explain", src, "no.such.key"]) == 2
    assert "is not in" in capsys.readouterr().err
    assert main(["explain", src]) == 2
