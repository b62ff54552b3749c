"""Plan renderers and `layoutc plan`: golden text/JSON/DOT, the JSON contract, exit codes.

Golden cases live in `tests/golden/`: a tiny layout pair (`tp4_train.layout`,
TP4 with a padded vocab, fp32 norms and three keys the destination lacks, and
`tp2_infer.layout`, TP2 with MXFP8 linears and `arg AT` to move it off the
trainer's ranks) and, per case in CASES, `NAME.txt` / `NAME.json` / `NAME.dot`:
the exact standard output of `layoutc plan tests/golden/tp4_train.layout
tests/golden/tp2_infer.layout ARGS...`. Paths are rendered relative to the
repository root, so these tests run there.

The goldens are not just snapshots of the compiler's output: every full-plan
JSON golden is replayed element by element through tests/plan_simulator.py
against the two layouts (every destination element written exactly once with
the right value, padding never sent, bytes right), a rank-filtered JSON golden
must be exactly the full plan's ops that touch that rank, and every number and
op line of the text and DOT goldens is recomputed from a proven JSON golden and
the layouts (byte counts, balance, top senders and receivers, per-key op
counts, unused keys, DOT edges). A golden that promises a wrong plan fails
even when the compiler prints it.

Regenerating: after an intended change of a renderer (or of the plan itself),

    REGEN_GOLDEN=1 .venv/bin/pytest tests/test_render.py

rewrites the goldens and FAILS (so a regenerating run can never pass by
accident); then READ `git diff tests/golden/`: every changed line is a changed
promise to users (the JSON is a machine contract, LANGUAGE.md 6), and rerun
without REGEN_GOLDEN.
"""

from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest

from layoutlang.cli import main
from layoutlang.compiler import compile_plan
from layoutlang.report.render import TEMPLATES, render_dot, render_json, render_text
from layoutlang.report.units import human_bytes, rank_ranges

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
    "offset_rpn2.txt": ["--set-dst", "AT=4", "--ranks-per-node", "2"],
    "offset.dot": ["--set-dst", "AT=4", "--format", "dot"],
    # full plans, so that every text/DOT golden above has a proven JSON twin
    "rpn2.json": ["--ranks-per-node", "2", "--format", "json"],
    "offset.json": ["--set-dst", "AT=4", "--format", "json"],
    "offset_rpn2.json": ["--set-dst", "AT=4", "--ranks-per-node", "2", "--format", "json"],
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
        pytest.fail(f"REGEN_GOLDEN: rewrote {GOLDEN / name}; read `git diff tests/golden/`, "
                    "then rerun without REGEN_GOLDEN", pytrace=False)
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


# ---- the goldens, proven against the layouts -------------------------------------------

def _case_args(name: str) -> tuple[dict[str, int], int | None, int | None]:
    """(--set / --set-dst args, --ranks-per-node, --rank) of a golden case (only the destination has AT)."""
    argv, args, rpn, rank = CASES[name], {}, None, None
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--set", "--set-dst"):
            k, v = value.split("=")
            args[k] = int(v)
        elif flag == "--ranks-per-node":
            rpn = int(value)
        elif flag == "--rank":
            rank = int(value)
    return args, rpn, rank


def _full_json(name: str) -> str:
    """The full-plan JSON golden with the same --set and --ranks-per-node as `name`."""
    args, rpn, _ = _case_args(name)
    twin = [n for n in CASES if n.endswith(".json") and _case_args(n) == (args, rpn, None)]
    assert len(twin) == 1, f"{name}: no full-plan JSON golden with the same arguments"
    return twin[0]


def _layouts(args: dict[str, int]):
    """The two golden layouts through the front end only (the args reach whichever has them)."""
    from layoutlang import load
    src = load(ROOT / SRC, args={k: v for k, v in args.items() if k == "TP"})
    dst = load(ROOT / DST, args=args)
    return src, dst


def _ops(doc: dict) -> tuple:
    return tuple(types.SimpleNamespace(**{**op, "src_slice": tuple(map(tuple, op["src_slice"])),
                                          "dst_slice": tuple(map(tuple, op["dst_slice"]))})
                 for op in doc["ops"])


def _human(n: float) -> str:
    """Binary units, two decimals, exact below 1 KiB (written here, not imported)."""
    n = int(round(n))
    if n < 1024:
        return f"{n} B"
    size, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while size >= 1024:
        size, units = size / 1024, units[1:]
    return f"{size:.2f} {units[0]}"


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.endswith(".json") and _case_args(n)[2] is None))
def test_full_json_golden_executes_exactly_once(name):
    """Replay the golden's ops through the simulator against the layouts; its stats from its ops."""
    import plan_simulator as sim

    args, rpn, _ = _case_args(name)
    doc = json.loads(_golden(name))
    src, dst = _layouts(args)
    assert doc["src"]["args"] == dict(src.args) and doc["dst"]["args"] == dict(dst.args)
    assert doc["ranks_per_node"] == rpn
    ops = _ops(doc)
    report = sim.simulate(sim.RunsView(src), sim.RunsView(dst), types.SimpleNamespace(ops=ops))
    assert report.elements == report.dst_data_elements and report.dst_locals > 0
    sim.check_stats(types.SimpleNamespace(ops=ops, stats=doc["stats"], ranks_per_node=rpn), report)
    sim.check_plan_views(types.SimpleNamespace(ops=ops, ops_for_rank=lambda r: [o for o in ops if r in (
        o.src_rank, o.dst_rank)]), [])
    # the floor: every byte over every source rank that holds data of a destination key
    keys = {t.key for t in dst.tensors}
    usable = {r for t in src.tensors if t.key in keys for r in t.ranks()
              if all(any(hasattr(run, "logical_start") for run in runs) for runs in t.runs(r))}
    stats = doc["stats"]
    assert stats["usable_senders"] == len(usable)
    assert stats["send_floor_bytes"] == stats["bytes"] / len(usable)
    assert stats["send_balance"] == stats["max_send_bytes"] / stats["send_floor_bytes"]
    assert doc["unused_keys"] == [k for k in dict.fromkeys(t.key for t in src.tensors) if k not in keys]
    shapes = {t.key: list(t.logical_shape) for t in dst.tensors}
    assert [(t["key"], t["shape"], t["dst_dtype"]) for t in doc["tensors"]] == [
        (k, shapes[k], next(t.dtype for t in dst.tensors if t.key == k)) for k in dict.fromkeys(
            t.key for t in dst.tensors)]


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.endswith(".json") and _case_args(n)[2] is not None))
def test_rank_json_golden_is_the_full_plan_filtered(name):
    rank = _case_args(name)[2]
    doc, full = json.loads(_golden(name)), json.loads(_golden(_full_json(name)))
    assert doc["ops"] == [op for op in full["ops"] if rank in (op["src_rank"], op["dst_rank"])]
    assert doc["stats"] == full["stats"] and doc["rank"] == rank
    mine = doc["ops"]
    assert doc["rank_stats"] == {
        "rank": rank, "ops": len(mine),
        "sends": sum(op["src_rank"] == rank != op["dst_rank"] for op in mine),
        "send_bytes": sum(op["bytes"] for op in mine if op["src_rank"] == rank != op["dst_rank"]),
        "receives": sum(op["dst_rank"] == rank != op["src_rank"] for op in mine),
        "recv_bytes": sum(op["bytes"] for op in mine if op["dst_rank"] == rank != op["src_rank"]),
        "local": sum(op["src_rank"] == op["dst_rank"] == rank for op in mine),
        "local_bytes": sum(op["bytes"] for op in mine if op["src_rank"] == op["dst_rank"] == rank)}


def _sl(sl) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in sl) + "]"


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.endswith(".txt")))
def test_text_golden_says_what_the_proven_plan_does(name):
    """Every number of the text report, recomputed from the proven JSON twin and the layouts."""
    args, rpn, rank = _case_args(name)
    text = _golden(name)
    doc = json.loads(_golden(_full_json(name)))
    ops, stats = doc["ops"], doc["stats"]
    src, dst = _layouts(args)
    total = sum(op["bytes"] for op in ops)
    local = sum(op["bytes"] for op in ops if op["src_rank"] == op["dst_rank"])
    sent, received, every = {}, {}, {}
    for op in ops:
        every[op["dst_rank"]] = every.get(op["dst_rank"], 0) + op["bytes"]
        if op["src_rank"] != op["dst_rank"]:
            sent[op["src_rank"]] = sent.get(op["src_rank"], 0) + op["bytes"]
            received[op["dst_rank"]] = received.get(op["dst_rank"], 0) + op["bytes"]
    want = [f"  ops          {len(ops)}\n", f"  bytes        {_human(total)} ({total} B)\n",
            f"  local        {_human(local)} (copies on the same rank)\n",
            f"  destination  ranks {min(every)}..{max(every)}\n"]
    if rpn:
        inter = sum(op["bytes"] for op in ops if op["src_rank"] // rpn != op["dst_rank"] // rpn)
        want += [f"  inter-node   {_human(inter)}\n", f"  intra-node   {_human(total - local - inter)}\n"]
    else:
        want.append(f"  network      {_human(total - local)}\n")
    busiest = min(sent, key=lambda r: (-sent[r], r))
    floor = total / stats["usable_senders"]
    want.append(f"  busiest sender    rank {busiest} sends {_human(sent[busiest])}: "
                f"{sent[busiest] / floor:.2f}x the floor of {_human(floor)} "
                f"(all bytes over {stats['usable_senders']} usable senders)\n")
    receiver = min(received, key=lambda r: (-received[r], r))
    want.append(f"  busiest receiver  rank {receiver} receives {_human(received[receiver])}: "
                f"{received[receiver] / (total / len(every)):.2f}x an even share\n")
    top = "".join(f"  rank {r:<6d} {_human(b).rjust(11)}\n" for r, b in sorted(sent.items(), key=lambda rb: (-rb[1], rb[0])))
    want.append(f"top senders (network bytes; {len(sent)} of {len(sent)} sending ranks)\n" + top)
    # (the receivers list counts every byte a rank gets, local copies included)
    top = "".join(f"  rank {r:<6d} {_human(b).rjust(11)}\n" for r, b in sorted(every.items(), key=lambda rb: (-rb[1], rb[0])))
    want.append(f"top receivers ({len(every)} of {len(every)} receiving ranks)\n" + top)
    for key in dict.fromkeys(t.key for t in dst.tensors):
        mine = [op for op in ops if op["key"] == key]
        s = next(t for t in src.tensors if t.key == key)
        d = next(t for t in dst.tensors if t.key == key)
        want.append(f"  {len(mine):7d}  {_human(sum(op['bytes'] for op in mine)).rjust(11)}  {key} "
                    f"{list(d.logical_shape)} {s.dtype} -> {d.dtype}\n")
    unused = [k for k in dict.fromkeys(t.key for t in src.tensors) if k not in {t.key for t in dst.tensors}]
    want.append(f"unused source keys ({len(unused)}, not in the destination)\n" + "".join(f"  {k}\n" for k in unused))
    if rank is not None:
        mine = [op for op in ops if rank in (op["src_rank"], op["dst_rank"])]
        want.append(f"rank {rank}: {len(mine)} ops\n")
        want += [f"  op {op['id']} {op['key']}: rank {op['src_rank']} {op['src_name']}{_sl(op['src_slice'])} -> "
                 f"rank {op['dst_rank']} {op['dst_name']}{_sl(op['dst_slice'])} ({op['bytes']} B{' ' + op['wire'] if 'wire' in op else ''})\n" for op in mine]
    missing = [w for w in want if w not in text]
    assert not missing, "the golden does not say:\n" + "".join(missing)


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.endswith(".dot")))
def test_dot_golden_draws_the_proven_plan(name):
    doc = json.loads(_golden(_full_json(name)))
    expected: dict[tuple[int, int], tuple[int, int]] = {}
    for op in doc["ops"]:
        if op["src_rank"] != op["dst_rank"]:
            n, b = expected.get((op["src_rank"], op["dst_rank"]), (0, 0))
            expected[op["src_rank"], op["dst_rank"]] = (n + 1, b + op["bytes"])
    edges = {(int(m[1]), int(m[2])): (int(m[4]), int(m[5]))
             for m in map(EDGE.match, _golden(name).splitlines()) if m}
    assert edges == expected
    local = sum(op["src_rank"] == op["dst_rank"] for op in doc["ops"])
    assert f"local copies (not drawn): {local} op" in _golden(name)


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
    assert '"layoutlang.report" = ["templates/*.j2"]' in pyproject
