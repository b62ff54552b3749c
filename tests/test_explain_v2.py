"""`layoutc explain` by a stored tensor's NAME that only one of the two layouts has, and the
"did you mean" list (each key or name once).

Every expected line is worked out by hand from the layout text in the test (LANGUAGE.md 3:
`over` splits each part of a concatenation, `chunk` cuts the local storage; 7.3: an axis a
tensor does not use is a replica axis). Lines are compared with runs of 2+ spaces (rich's
column gaps) written as ` | `; the bar under a split dim has one cell per logical row here.
"""

import re
from pathlib import Path

import pytest

from layoutlang import compile_plan, load, loads
from layoutlang.cli import main
from layoutlang.diagnostics import UsageError
from layoutlang.report.explain import explain_text

ROOT = Path(__file__).parent.parent

FUSED = "mesh m (tp=2)\ntensor fc1 [(gate: 4 as g | up: 4 as u) over tp, 2]\n"
SPLIT = "mesh n (tp=1)\ntensor g [4, 2]\ntensor u [4, 2]\n"


def lines(text: str) -> list[str]:
    return [re.sub(r"\s{2,}", " | ", line.strip()) for line in text.splitlines() if line.strip()]


def op_rows(text: str) -> list[str]:
    """The op table's rows without the op id (ids are the plan's numbering)."""
    out = lines(text)
    head = out.index("op | from | to | source slice | destination slice | bytes")
    return sorted(row.split(" | ", 1)[1] for row in out[head + 1:] if not row.startswith("..."))


def pair(src_text: str, dst_text: str):
    src, dst = loads(src_text, "src.layout"), loads(dst_text, "dst.layout")
    return src, dst, compile_plan(src, dst)


# fc1 on tp=2: tp c stores gate rows 2c..2c+1, then up rows 4+2c..4+2c+1 (local [4, 2]).
FC1_SIDE = [
    "fc1 | bf16 on mesh m (tp=2) | local [4, 2] | replicas over none",
    "holds 2 keys: g [0:4, 0:2], u [4:8, 0:2]",
    "dim 0 [0, 8) 00110011",
    "shard | ranks | dim 0: local -> logical | dim 1: local -> logical",
    "0 | 0 | 0:2->0:2 2:4->4:6 | 0:2->0:2",
    "1 | 1 | 0:2->2:4 2:4->6:8 | 0:2->0:2",
]


def whole(name: str) -> list[str]:
    """g or u of SPLIT: whole on rank 0; tp (size 1) is unused, so a replica axis."""
    return [f"{name} | bf16 on mesh n (tp=1) | local [4, 2] | replicas over tp",
            "shard | ranks | dim 0: local -> logical | dim 1: local -> logical",
            "0 | 0 | 0:4->0:4 | 0:2->0:2"]


def test_source_only_name_shows_where_each_key_goes():
    src, dst, plan = pair(FUSED, SPLIT)
    got = lines(explain_text(src, "fc1", dst, plan, width=200))
    head = ["fc1 | logical [8, 2]", "dim 0 parts: gate [0, 4) | up [4, 8)"]
    side = [f"source src.layout: {FC1_SIDE[0]}", *FC1_SIDE[1:]]
    dst_g = ["key g in the destination:", f"destination dst.layout: {whole('g')[0]}", *whole("g")[1:]]
    dst_u = ["key u in the destination:", f"destination dst.layout: {whole('u')[0]}", *whole("u")[1:]]
    ops = ["4 ops", "op | from | to | source slice | destination slice | bytes"]
    assert got[:len(head + side + dst_g + dst_u + ops)] == head + side + dst_g + dst_u + ops
    # g rows 0:2 only on rank 0 (local rows 0:2), rows 2:4 only on rank 1; u likewise from local
    # rows 2:4. Each piece 2 x 2 bf16 = 8 bytes; rank 0 is in both layouts (a local copy).
    assert op_rows(explain_text(src, "fc1", dst, plan, width=200)) == sorted([
        "rank 0 | rank 0 (local) | [0:2, 0:2] | [0:2, 0:2] | 8",
        "rank 1 | rank 0 | [0:2, 0:2] | [2:4, 0:2] | 8",
        "rank 0 | rank 0 (local) | [2:4, 0:2] | [0:2, 0:2] | 8",
        "rank 1 | rank 0 | [2:4, 0:2] | [2:4, 0:2] | 8",
    ])


def test_destination_only_name_shows_where_each_key_comes_from():
    src, dst, plan = pair(SPLIT, FUSED)
    text = explain_text(src, "fc1", dst, plan, width=200)
    src_g = ["key g in the source:", f"source src.layout: {whole('g')[0]}", *whole("g")[1:]]
    src_u = ["key u in the source:", f"source src.layout: {whole('u')[0]}", *whole("u")[1:]]
    side = [f"destination dst.layout: {FC1_SIDE[0]}", *FC1_SIDE[1:]]
    expected = ["fc1 | logical [8, 2]", "dim 0 parts: gate [0, 4) | up [4, 8)", *src_g, *src_u, *side, "4 ops"]
    assert lines(text)[:len(expected)] == expected
    # rank 0 holds g and u whole; tp c of fc1 wants rows 2c..2c+1 of each, at local 0:2 (g) and 2:4 (u)
    assert op_rows(text) == sorted([
        "rank 0 | rank 0 (local) | [0:2, 0:2] | [0:2, 0:2] | 8",
        "rank 0 | rank 1 | [2:4, 0:2] | [0:2, 0:2] | 8",
        "rank 0 | rank 0 (local) | [0:2, 0:2] | [2:4, 0:2] | 8",
        "rank 0 | rank 1 | [2:4, 0:2] | [2:4, 0:2] | 8",
    ])


def test_stage_local_name_is_every_instance_and_each_of_its_keys():
    # `layers.0.w` is declared on both stages: global layer 0 on pp 0 (rank 0), layer 1 on pp 1
    src, dst, plan = pair("mesh m (pp=2)\nfor l in 0..2 over pp {\n  tensor layers.{l.local}.w as model.layers.{l}.w [4]\n}\n",
                          "mesh n (tp=1)\nfor l in 0..2 {\n  tensor model.layers.{l}.w [4]\n}\n")
    text = explain_text(src, "layers.0.w", dst, plan, width=200)
    table = "shard | ranks | dim 0: local -> logical"

    def instance(title, path, name, mesh, replicas, rank):
        return [f"{title} {path}: {name} | bf16 on mesh {mesh} | local [4] | replicas over {replicas}",
                table, f"0 | {rank} | 0:4->0:4"]

    expected = ["layers.0.w | logical [4]",
                *instance("source", "src.layout", "layers.0.w", "m (pp=2)", "none", 0),
                *instance("source", "src.layout", "layers.0.w", "m (pp=2)", "none", 1)]
    for layer in (0, 1):
        expected += [f"key model.layers.{layer}.w in the destination:",
                     *instance("destination", "dst.layout", f"model.layers.{layer}.w", "n (tp=1)", "tp", 0)]
    expected.append("2 ops")
    assert lines(text)[:len(expected)] == expected
    assert op_rows(text) == ["rank 0 | rank 0 (local) | [0:4] | [0:4] | 8", "rank 1 | rank 0 | [0:4] | [0:4] | 8"]


def test_a_name_with_many_keys_shows_the_first_eight():
    # 10 stacked experts, 5 per ep coordinate; every key's op is listed, the pictures stop at 8
    src, dst, plan = pair("mesh m (ep=2)\ntensor experts.w as experts.{e}.w [e in 0..10 over ep, 2]\n",
                          "mesh n (tp=1)\nfor e in 0..10 {\n  tensor experts.{e}.w [2]\n}\n")
    got = lines(explain_text(src, "experts.w", dst, plan, width=200))
    shown = [line for line in got if line.endswith(" in the destination:")]
    assert shown == [f"key experts.{e}.w in the destination:" for e in range(8)]
    assert got[got.index("10 ops") - 1] == "... 2 more keys (explain one by its key)"
    assert sorted(op_rows("\n".join(got))) == sorted(
        f"rank {e // 5} | rank 0{' (local)' if e < 5 else ''} | [{e % 5}:{e % 5 + 1}, 0:2] | [0:2] | 4"
        for e in range(10))


def test_llama3_8b_trainer_name_into_the_engine(monkeypatch):
    """The reported case: a Megatron NAME that only the trainer has. linear_fc1 is
    [(gate: F | up: F) over tp chunk gtp, H] at TP8 x GTP2 x DP4 (rank = 16 dp + 8 gtp + tp):
    tp t holds gate rows 1792t.. and up rows 1792t..; gtp 0 keeps the gate piece, gtp 1 the up
    piece, 1792 rows each. The engine's gate_up_proj [(gate: F | up: F) over tp, H] at TP2 x DP2
    (rank = 2 dp + t) holds on tp t gate rows 7168t.. at local 0:7168, up rows at 7168:14336."""
    monkeypatch.chdir(ROOT)  # paths print as given
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    src, dst = load("examples/llama3_8b_train.layout"), load("examples/llama3_8b_infer.layout")
    plan = compile_plan(src, dst)
    text = explain_text(src, name, dst, plan, width=200)
    got = lines(text)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert got[:4] == [
        f"{name} | logical [28672, 4096]", "dim 0 parts: gate [0, 14336) | up [14336, 28672)",
        f"source examples/llama3_8b_train.layout: {name} | bf16 on mesh train (dp=4, gtp=2, tp=8) "
        "| local [1792, 4096] | replicas over dp",
        f"holds 2 keys: {gate} [0:14336, 0:4096], {up} [14336:28672, 0:4096]"]
    engine = ("destination examples/llama3_8b_infer.layout: model.layers.0.mlp.gate_up_proj.weight "
              "| mxfp8 on mesh infer (dp=2, tp=2) | local [14336, 4096] | replicas over dp")
    for key, at, local in ((gate, "0:14336", "0:7168"), (up, "14336:28672", "7168:14336")):
        i = got.index(f"key {key} in the destination:")
        assert got[i + 1:i + 7] == [
            engine, f"holds this key at [{at}, 0:4096] of its logical tensor; below, in the key's dims",
            "dim 0 [0, 14336) " + "0" * 32 + "1" * 32,
            "shard | ranks | dim 0: local -> logical | dim 1: local -> logical",
            f"0 | 0, 2 | {local}->0:7168 | 0:4096->0:4096", f"1 | 1, 3 | {local}->7168:14336 | 0:4096->0:4096"]
    # every engine rank gets 4 gate pieces and 4 up pieces of 1792 rows, whole 32-element blocks of
    # the mxfp8 destination: 1792 x 4096 e4m3 bytes + 1792 x 4096 / 32 E8M0 scales = 7569408 B
    # (bf16 would be 1792 x 4096 x 2 = 14680064 B):
    # gate piece i of engine tp t from trainer tp 4t + i, gtp 0; up piece i from gtp 1
    assert "32 ops" in got
    rows = [row.split(" | ") for row in op_rows(text)]
    assert len(rows) == 32 and {r[2] for r in rows} == {"[0:1792, 0:4096]"} and {r[4] for r in rows} == {"7569408"}
    got_pieces = sorted((int(r[1].split()[1]), r[3], int(r[0].split()[1]) % 16) for r in rows)
    want = sorted((d, f"[{7168 * part + 1792 * i}:{7168 * part + 1792 * (i + 1)}, 0:4096]", 8 * part + 4 * (d % 2) + i)
                  for d in range(4) for part in (0, 1) for i in range(4))
    assert got_pieces == want


def test_cli_explains_a_source_only_name(capsys):
    src, dst = str(ROOT / "examples/small/llama_train.layout"), str(ROOT / "examples/small/llama_infer.layout")
    assert main(["explain", src, dst, "decoder.layers.0.mlp.linear_fc1.weight"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "key model.layers.0.mlp.gate_proj.weight in the destination:" in out
    assert "key model.layers.0.mlp.up_proj.weight in the destination:" in out


def test_rank_that_holds_the_tensor_but_not_the_key():
    # chunk g cuts the 8 stored rows (gate 0..3, up 4..7) in two: g 0 keeps gate, g 1 keeps up
    src = loads("mesh m (g=2)\ntensor fc1 [(gate: 4 as gk | up: 4 as uk) chunk g, 2]\n", "src.layout")
    head = ["uk | logical [4, 2]",
            "source src.layout: fc1 | bf16 on mesh m (g=2) | local [4, 2] | replicas over none",
            "holds this key at [4:8, 0:2] of its logical tensor; below, in the key's dims"]
    assert lines(explain_text(src, "uk", rank=0)) == head + ["rank 0 holds no part of it"]
    assert lines(explain_text(src, "uk", rank=1)) == head + [
        "shard | ranks | dim 0: local -> logical | dim 1: local -> logical", "0 | 1 | 0:4->0:4 | 0:2->0:2"]


# -- errors ---------------------------------------------------------------------------------------

def usage_error(*args) -> UsageError:
    with pytest.raises(UsageError) as e:
        explain_text(*args)
    return e.value


def test_suggestions_name_a_key_that_is_also_a_name_once():
    # in SPLIT, g is a tensor's NAME and its key; `gg` is close to g only (u shares nothing)
    e = usage_error(loads(SPLIT, "dst.layout"), "gg")
    assert e.message == "key `gg` is not in dst.layout (nor is a stored tensor of that name)"
    assert e.help == "did you mean: `g`"


def test_suggestions_in_a_shipped_layout_are_distinct(capsys):
    # vLLM's down_proj NAME is its key: it used to be suggested twice
    path = "examples/small/llama_infer.layout"
    assert main(["explain", str(ROOT / path), "model.layers.0.mlp.down_proj"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: key `model.layers.0.mlp.down_proj` is not in ")
    assert f"{path} (nor is a stored tensor of that name)" in err
    help_ = err[err.index("help: did you mean: "):].removeprefix("help: did you mean: ")
    names = [n.strip("`") for n in help_.split(", ")]
    assert names[0] == "model.layers.0.mlp.down_proj.weight" and len(names) == len(set(names)) == 3


def test_a_name_in_neither_layout_is_reported_in_the_source():
    src, dst, plan = pair(FUSED, SPLIT)
    e = usage_error(src, "fc", dst, plan)
    assert e.message == "key `fc` is not in src.layout (nor is a stored tensor of that name)"
    assert e.help == "did you mean: `fc1`"


def test_a_source_key_the_destination_lacks_is_reported_in_the_destination():
    src = loads("mesh m (tp=1)\ntensor x [2]\ntensor y [2]\n", "src.layout")
    dst = loads("mesh m (tp=1)\ntensor x [2]\n", "dst.layout")
    e = usage_error(src, "y", dst)
    assert e.message == "key `y` is not in dst.layout (nor is a stored tensor of that name)"
    assert e.help == "`layoutc plan --format json` lists every key"


def test_a_destination_key_is_not_a_name():
    # `g` is a key (not a stored NAME) of the destination's fused tensor and not in the source:
    # nothing to show per key, so the source reports it
    src = loads("mesh m (tp=1)\ntensor x [2]\n", "src.layout")
    e = usage_error(src, "g", loads(FUSED, "dst.layout"))
    assert e.message == "key `g` is not in src.layout (nor is a stored tensor of that name)"
