"""Plan renderers and `layoutc plan`: golden text/JSON/DOT, the JSON contract, exit codes.

Golden cases live in `tests/golden/`: a tiny layout pair (`tp4_train.layout`,
TP4 with a padded vocab, fp32 norms and three keys the destination lacks, and
`tp2_infer.layout`, TP2 with MXFP8 linears and `arg AT` to move it off the
trainer's ranks) and, per case in CASES, `NAME.txt` / `NAME.json` / `NAME.dot`:
the exact standard output of `layoutc plan tests/golden/tp4_train.layout
tests/golden/tp2_infer.layout ARGS...`. Paths are rendered relative to the
repository root, so these tests run there.

Regenerating: after an intended change of a renderer (or of the plan itself),

    REGEN_GOLDEN=1 .venv/bin/pytest tests/test_render.py

then READ `git diff tests/golden/`: every changed line is a changed promise to
users (the JSON is a machine contract, LANGUAGE.md 6).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from layoutlang.cli import main
from layoutlang.compiler import compile_plan
from layoutlang.compiler.render import (TEMPLATES, human_bytes, rank_ranges, render_dot, render_json,
                                        render_text)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path("tests") / "golden"  # relative to ROOT: rendered paths stay stable
REGEN = bool(os.environ.get("REGEN_GOLDEN"))
SRC = (GOLDEN / "tp4_train.layout").as_posix()
DST = (GOLDEN / "tp2_infer.layout").as_posix()
WARNING = ("warning: 3 source keys are not in the destination: "
           "optimizer.step, layers.0.fc2.bias_grad, layers.1.fc2.bias_grad\n")

# golden file name -> extra `layoutc plan SRC DST` arguments
CASES = {
    "collocated.txt": [],
    "collocated.json": ["--format", "json"],
    "collocated.dot": ["--format", "dot"],
    "rpn2_rank1.txt": ["--ranks-per-node", "2", "--rank", "1"],
    "rpn2_rank1.json": ["--ranks-per-node", "2", "--rank", "1", "--format", "json"],
    "offset_rpn2.txt": ["--set", "AT=4", "--ranks-per-node", "2"],
    "offset.dot": ["--set", "AT=4", "--format", "dot"],
}

EXAMPLE_SRC, EXAMPLE_DST = "examples/llama3_8b_train.layout", "examples/llama3_8b_infer.layout"


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _golden(name: str) -> str:
    path = ROOT / GOLDEN / name
    if not path.exists():
        pytest.fail(f"{name} is missing; run REGEN_GOLDEN=1 pytest {__file__} -k {name}")
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def example_doc() -> dict:
    plan = compile_plan(ROOT / EXAMPLE_SRC, ROOT / EXAMPLE_DST)
    return json.loads(render_json(plan))


# ---- goldens ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name, capsys):
    code, out, err = _plan(capsys, SRC, DST, *CASES[name])
    assert code == 0, err
    assert err == WARNING
    if REGEN:
        with open(ROOT / GOLDEN / name, "w", encoding="utf-8", newline="") as fh:
            fh.write(out)
        return
    assert out == _golden(name)


def test_no_stray_goldens():
    outputs = {p.name for p in (ROOT / GOLDEN).iterdir() if p.suffix in (".txt", ".json", ".dot")}
    assert outputs == set(CASES)


def test_api_renders_the_goldens():
    plan = compile_plan(SRC, DST)
    assert render_text(plan) == _golden("collocated.txt")
    assert render_json(plan) == _golden("collocated.json")
    assert render_dot(plan) == _golden("collocated.dot")
    plan = compile_plan(SRC, DST, ranks_per_node=2)
    assert render_text(plan, rank=1) == _golden("rpn2_rank1.txt")
    assert render_json(plan, rank=1) == _golden("rpn2_rank1.json")


def test_output_file_gets_what_stdout_would(tmp_path, capsys):
    target = tmp_path / "plan.json"
    code, out, err = _plan(capsys, SRC, DST, "--format", "json", "-o", str(target))
    assert (code, out, err) == (0, "", WARNING)
    assert target.read_text("utf-8") == _golden("collocated.json")


# ---- the JSON contract (LANGUAGE.md 6) ------------------------------------------------

def _is_slice(value, dims: int) -> bool:
    return (isinstance(value, list) and len(value) == dims
            and all(isinstance(d, list) and len(d) == 2 and all(type(x) is int for x in d)
                    and 0 <= d[0] < d[1] for d in value))


def test_json_schema_on_the_llama_example(example_doc):
    doc = example_doc
    assert doc["format"] == "layoutlang.plan/1"
    assert list(doc)[0] == "format" and isinstance(doc["digest"], str)
    for side in ("src", "dst"):
        assert isinstance(doc[side]["layout"], str)
        ranks = doc[side]["ranks"]
        assert ranks == sorted(set(ranks)) and all(type(r) is int for r in ranks)
    assert doc["src"]["layout"].endswith("llama3_8b_train.layout")
    assert doc["src"]["ranks"] == list(range(64)) and doc["dst"]["ranks"] == list(range(4))
    dims = {}
    for t in doc["tensors"]:
        assert set(t) >= {"key", "shape", "src_dtype", "dst_dtype"}
        assert isinstance(t["key"], str) and all(type(n) is int and n > 0 for n in t["shape"])
        assert t["src_dtype"] in {"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "mxfp8"}
        assert t["dst_dtype"] in {"bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "mxfp8"}
        dims[t["key"]] = len(t["shape"])
    ops = doc["ops"]
    assert [op["id"] for op in ops] == list(range(len(ops)))
    src_ranks, dst_ranks = set(doc["src"]["ranks"]), set(doc["dst"]["ranks"])
    for op in ops:
        assert set(op) >= {"id", "key", "src_rank", "dst_rank", "src_name", "dst_name",
                           "src_slice", "dst_slice", "bytes"}
        assert op["src_rank"] in src_ranks and op["dst_rank"] in dst_ranks
        assert isinstance(op["src_name"], str) and isinstance(op["dst_name"], str)
        assert _is_slice(op["src_slice"], dims[op["key"]]) and _is_slice(op["dst_slice"], dims[op["key"]])
        assert type(op["bytes"]) is int and op["bytes"] > 0
    stats = doc["stats"]
    assert list(stats)[:4] == ["ops", "bytes", "max_send_bytes", "max_recv_bytes"]
    assert all(type(stats[k]) is int for k in ("ops", "bytes", "max_send_bytes", "max_recv_bytes"))
    assert stats["ops"] == len(ops)
    assert stats["bytes"] == sum(op["bytes"] for op in ops)
    assert 0 < stats["max_send_bytes"] <= stats["bytes"]
    assert 0 < stats["max_recv_bytes"] <= stats["bytes"]


def test_json_has_one_op_per_line():
    text = _golden("collocated.json")
    doc = json.loads(text)
    op_lines = [line for line in text.splitlines() if line.startswith('  {"id": ')]
    assert len(op_lines) == len(doc["ops"]) == doc["stats"]["ops"]
    assert [json.loads(line.rstrip(",")) for line in op_lines] == doc["ops"]


def test_set_reaches_both_layouts(capsys):
    code, out, _ = _plan(capsys, SRC, DST, "--set", "TP=2", "--format", "json")
    doc = json.loads(out)
    assert code == 0
    assert doc["src"]["args"]["TP"] == 2 and doc["dst"]["args"]["TP"] == 2
    assert doc["src"]["ranks"] == doc["dst"]["ranks"] == [0, 1]
    # the same split on both sides: only the differently padded vocabulary crosses ranks
    assert {op["key"] for op in doc["ops"] if op["src_rank"] != op["dst_rank"]} == {"embedding.weight"}


# ---- --rank -----------------------------------------------------------------------

def test_rank_filter_partitions_the_plan(capsys):
    full = json.loads(_golden("collocated.json"))["ops"]
    seen = set()
    for rank in range(4):
        code, out, _ = _plan(capsys, SRC, DST, "--format", "json", "--rank", str(rank))
        doc = json.loads(out)
        assert code == 0 and doc["rank"] == rank
        assert doc["ops"] == [op for op in full if rank in (op["src_rank"], op["dst_rank"])]
        assert doc["stats"]["ops"] == len(full)  # plan-wide stats stay plan-wide
        rs = doc["rank_stats"]
        assert rs["ops"] == len(doc["ops"]) == rs["sends"] + rs["receives"] + rs["local"]
        assert rs["send_bytes"] == sum(op["bytes"] for op in doc["ops"]
                                       if op["src_rank"] == rank != op["dst_rank"])
        seen.update(op["id"] for op in doc["ops"])
    assert seen == set(range(len(full)))


def test_rank_text_lists_that_ranks_ops():
    text = render_text(compile_plan(SRC, DST), rank=3, max_ops=2)
    section = text[text.index("rank 3: "):]
    assert section.splitlines()[0] == "rank 3: 7 ops"
    ops = [line for line in section.splitlines() if line.startswith("  op ")]
    assert len(ops) == 2 and all("rank 3 " in line for line in ops)
    assert section.endswith("  ... and 5 more ops\n")


@pytest.mark.parametrize("rank", ["4", "-1"])
def test_rank_out_of_range_is_a_usage_error(rank, capsys):
    code, out, err = _plan(capsys, SRC, DST, "--rank", rank)
    assert code == 2 and out == ""
    assert f"--rank {rank}: the plan has ranks 0..3" in err


# ---- exit codes ------------------------------------------------------------------------

def test_missing_destination_key_is_a_diagnostic_at_the_destination(tmp_path, capsys):
    src = tmp_path / "src.layout"
    src.write_text("mesh m (tp=2)\ntensor w [8 over tp]\n")
    dst = tmp_path / "dst.layout"
    dst.write_text("mesh m (tp=1)\ntensor w [8]\ntensor v [8]\n")
    code, out, err = _plan(capsys, str(src), str(dst))
    assert code == 1 and out == ""
    assert err.startswith(f"{dst}:3:1: error: key `v` is not in the source layout {src}\n")
    assert "Traceback" not in err


def test_shape_mismatch_is_a_diagnostic(tmp_path, capsys):
    src = tmp_path / "src.layout"
    src.write_text("mesh m (tp=2)\ntensor w [8 over tp]\n")
    dst = tmp_path / "dst.layout"
    dst.write_text("mesh m (tp=1)\ntensor w [6]\n")
    code, out, err = _plan(capsys, str(src), str(dst))
    assert code == 1 and out == ""
    assert err.startswith(f"{dst}:2:") and "Traceback" not in err


def test_a_complete_pair_has_no_warning(tmp_path, capsys):
    src = tmp_path / "src.layout"
    src.write_text("mesh m (tp=2)\ntensor w [8 over tp]\ntensor b [4]\n")
    dst = tmp_path / "dst.layout"
    dst.write_text("mesh m (tp=1)\ntensor w [8]\n")
    code, _, err = _plan(capsys, str(src), str(dst))
    assert code == 0 and err == "warning: 1 source key is not in the destination: b\n"
    dst.write_text("mesh m (tp=1)\ntensor w [8]\ntensor b [4]\n")
    code, out, err = _plan(capsys, str(src), str(dst))
    assert code == 0 and err == "" and "unused" not in out


@pytest.mark.parametrize("argv, message", [
    (["--set", "XX=2"], "--set XX: neither layout has an arg `XX`"),
    (["--set", "TP"], "expected NAME=VALUE"),
    (["--selector", "fastest"], "--selector fastest: expected one of"),
    (["--ranks-per-node", "0"], "--ranks-per-node 0: expected a positive integer"),
    (["--format", "dot", "--rank", "1"], "--rank filters ops in text and json output"),
    (["--format", "xml"], "invalid choice"),
    (["--rank", "one"], "invalid int value"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    code, out, err = _plan(capsys, SRC, DST, *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_unreadable_inputs_and_outputs_exit_2(tmp_path, capsys):
    code, _, err = _plan(capsys, SRC, str(tmp_path / "nope.layout"))
    assert code == 2 and "cannot read" in err
    code, _, err = _plan(capsys, SRC, DST, "-o", str(tmp_path / "no" / "dir" / "plan.txt"))
    assert code == 2 and "cannot write" in err
    assert main(["plan", SRC]) == 2


def test_help(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: layoutc plan" in out
    for flag in ("--set", "--format", "-o", "--rank", "--ranks-per-node", "--selector"):
        assert flag in out


# ---- DOT ----------------------------------------------------------------------------------

EDGE = re.compile(r'^  r(\d+) -> r(\d+) \[label="[^"]+", penwidth=(\d+\.\d\d), tooltip="(\d+) ops?, (\d+) B"\];$')


def test_dot_is_a_digraph_of_rank_traffic(capsys):
    code, out, _ = _plan(capsys, SRC, DST, "--format", "dot")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "digraph plan {" and lines[-1] == "}" and out.endswith("}\n")
    assert out.count("{") == out.count("}")
    doc = json.loads(_golden("collocated.json"))
    expected: dict[tuple[int, int], int] = {}
    for op in doc["ops"]:
        if op["src_rank"] != op["dst_rank"]:
            pair = (op["src_rank"], op["dst_rank"])
            expected[pair] = expected.get(pair, 0) + op["bytes"]
    edges = {}
    for line in lines:
        m = EDGE.match(line)
        if m:
            assert 1.0 <= float(m[3]) <= 5.0
            edges[int(m[1]), int(m[2])] = int(m[5])
    assert edges == expected  # one edge per pair, bytes summed, local copies left out
    assert "local copies (not drawn): 14 ops" in out


def test_dot_clusters_where_the_layouts_differ():
    same = render_dot(compile_plan(SRC, DST, args={"TP": 2}))
    assert "subgraph" not in same  # identical rank sets: no clusters
    offset = _golden("offset.dot")
    assert "subgraph cluster_src" in offset and "subgraph cluster_dst" in offset
    assert "cluster_both" not in offset
    collocated = _golden("collocated.dot")
    assert "subgraph cluster_src" in collocated and "subgraph cluster_both" in collocated


# ---- helpers and packaging ---------------------------------------------------------------------

def test_human_bytes_and_rank_ranges():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 2**20, 5 * 2**40)] == [
        "0 B", "1023 B", "1.00 KiB", "1.50 KiB", "1.00 MiB", "5.00 TiB"]
    assert human_bytes(56768.0) == "55.44 KiB"
    assert rank_ranges([]) == "none"
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0..2, 5, 7..8"


def test_templates_ship_with_the_package():
    assert {p.name for p in TEMPLATES.glob("*.j2")} >= {"plan.txt.j2", "plan.dot.j2"}
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    assert '"layoutlang.compiler" = ["templates/*.j2"]' in pyproject
