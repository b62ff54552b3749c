"""`layoutc explain`: every tensor of every example renders; pictures match the shards.

Golden pictures (tests/golden/explain/NAME.txt, exact output of `explain_text`
at width 160) for a few keys, each checked BY HAND against its layout before it
was written; the reasoning is in GOLDEN below. The bar under a split dim has
min(64, extent) cells; cell c covers logical [c*E/cells, (c+1)*E/cells) and a
run [a, b) claims cells floor(a*cells/E) .. floor(b*cells/E) - 1 (at least
one), first shard first. Regenerate with REGEN_GOLDEN=1 (the run fails after
writing; check the pictures by hand again before committing).
"""

import os
import re
from pathlib import Path

import pytest

from layoutlang import compile_plan, load
from layoutlang.cli import main
from layoutlang.compiler.shards import placement_of
from layoutlang.report.explain import explain_text
from layoutlang.report.units import rank_ranges

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted(ROOT.glob("examples/**/*.layout"))
PAIRS = [("small/llama_train", "small/llama_infer"), ("small/moe_train", "small/moe_infer"),
         ("small/pp_train", "small/pp_infer"), ("small/mamba_train", "small/mamba_infer"),
         ("llama3_8b_train", "llama3_8b_infer_tp16")]


GOLDEN_DIR = ROOT / "tests" / "golden" / "explain"
PAIR = ("tests/golden/tp4_train.layout", "tests/golden/tp2_infer.layout")
QKV = "mesh m (gtp=2, tp=2)\ntensor w [(2, (q: 4 | k: 2 | v: 2)) over tp chunk gtp align 3, 8]\n"

# name -> (key, with the destination and plan?); the hand check of each picture:
GOLDEN = {
    # QKV: logical dim 0 = q (2 groups x 4) [0, 8) | k (2 x 2) [8, 12) | v [12, 16). `over tp` on
    # (2, ...) gives tp c group c whole: storage q_c(4) k_c(2) v_c(2) = 8 rows; `chunk gtp align 3`:
    # pad (3*2 - 8 mod 6) mod 6 = 4 -> 12 rows, 6 per gtp. rank = 2*gtp + tp:
    #   rank 0 (gtp 0, tp 0): q0 = 0:4, k0 = 8:10        rank 1 (gtp 0, tp 1): q1 = 4:8, k1 = 10:12
    #   rank 2 (gtp 1, tp 0): v0 = 12:14, then 4 pad     rank 3 (gtp 1, tp 1): v1 = 14:16, then 4 pad
    # bar: 16 cells, one per row: 0000 1111 00 11 22 33.
    "qkv_chunk_align": ("w", False),
    # [1000 pad 64 over tp, 64], TP4: stored 1024, 256 rows per rank, rank 3 holds 768:1000 + 24
    # pad. Bar (64 cells of 15.625 rows): rank 0 cells 0..15 (floor(256*64/1000) = 16), rank 1
    # 16..31 (floor(512*0.064) = 32), rank 2 32..48 (49), rank 3 49..63: 16, 16, 17, 15 glyphs.
    # Destination [1000 pad 8 over tp], TP2: 500 rows each, no padding: 32 + 32 glyphs.
    # Ops (one holder per row, so forced): dst 0 <- rank 0 [0:256] (local) and rank 1 [0:244]
    # (logical 256:500) into [256:500]; dst 1 <- rank 1 [244:256] (logical 500:512, local) into
    # [0:12], rank 2 [0:256] into [12:268], rank 3 [0:232] into [268:500]. Bytes = rows x 64 x 2.
    "embedding": ("embedding.weight", True),
    # [(gate: 128 | up: 128) over tp, 64]: each part split over tp. TP4 rank c: local 0:32 ->
    # gate 32c, local 32:64 -> up 128 + 32c (bar: 8 cells per 32 rows: 0-3 twice). TP2 rank d:
    # 0:64 -> 64d, 64:128 -> 128 + 64d. dst 0 = gate 0:64 (ranks 0, 1) then up 128:192 (ranks 0, 1),
    # each a 32-row piece, 32 x 64 x 2 = 4096 B (an mxfp8 destination travels as bf16).
    "fc1": ("layers.0.fc1.weight", True),
    # [64] fp32 replicated over tp (one shard, ranks 0..3) -> [64] bf16 on ranks 0..1: no bar (one
    # shard), each destination copies locally (DESIGN: local copy first), 64 x 2 = 128 B.
    "final_norm": ("final_norm.weight", True),
}


def _golden_text(name: str) -> str:
    key, with_plan = GOLDEN[name]
    if name == "qkv_chunk_align":
        from layoutlang import loads
        return explain_text(loads(QKV, "qkv.layout"), key, width=160)
    src, dst = load(PAIR[0]), load(PAIR[1])
    return explain_text(src, key, dst, compile_plan(src, dst) if with_plan else None, width=160)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_pictures(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # layout paths print relative to the repository root
    got = _golden_text(name)
    path = GOLDEN_DIR / f"{name}.txt"
    if os.environ.get("REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got, "utf-8")
        pytest.fail(f"REGEN_GOLDEN: rewrote {path.relative_to(ROOT)}; check it by hand against the layout",
                    pytrace=False)
    assert got == path.read_text("utf-8")


def test_no_stray_golden_pictures():
    assert {p.stem for p in GOLDEN_DIR.glob("*.txt")} == set(GOLDEN)


def representatives(layout):
    """One key per kind of tensor and placement: numbers (layer, expert, rank) read as N, in the
    key and in its placement, so layers and experts that differ only there are explained once
    (DeepSeek-V3's 256 ranks gave 527 keys, 80 s)."""
    seen, keys = set(), []
    for t in layout.tensors:
        sig = (re.sub(r"\d+", "N", t.key), re.sub(r"\d+", "N", repr(placement_of(t))))
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
    for key in list(d.key_index)[:40]:  # keys, part keys inside fused tensors included
        text = explain_text(s, key, d, plan)
        n_ops = sum(1 for op in plan.ops if op.key == key)
        assert f"{n_ops} ops" in text and "destination " in text


def test_shard_table_lists_ranks_and_runs():
    from layoutlang import loads
    s = loads("mesh m (dp=2, tp=2)\ntensor w [(gate: 4 | up: 4) over tp, 3]", "s.layout")
    text = explain_text(s, "w")
    assert "dim 0 parts: gate [0, 4)  up [4, 8)" in text
    assert "0:2->0:2 2:4->4:6" in text and "0, 2" in text  # shard 0: tp 0 on ranks 0 and 2
    assert "0:2->2:4 2:4->6:8" in text and "1, 3" in text


def test_rank_ranges():
    """A shard's ranks in the notation of every other report (units.rank_ranges), cut at 48 characters."""
    assert rank_ranges([0, 1, 2, 3, 8, 10, 11]) == "0..3, 8, 10..11"
    from layoutlang import loads
    text = explain_text(loads("mesh m (dp=64, tp=2)\ntensor w [8 over tp, 4]", "s.layout"), "w")
    assert "0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, ... (64 ranks)" in text


def test_cli(capsys):
    src, dst = str(ROOT / "examples/small/llama_train.layout"), str(ROOT / "examples/small/llama_infer.layout")
    key = load(src).tensors[0].key
    assert main(["explain", src, dst, key, "--rank", "0"]) == 0
    assert key in capsys.readouterr().out
    assert main(["explain", src, "no.such.key"]) == 2
    assert "is not in" in capsys.readouterr().err
    assert main(["explain", src]) == 2
