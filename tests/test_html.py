"""The HTML report (layoutlang/report/html_*.py, `layoutc plan --format html`).

What it promises: one self-contained page (no network reference at all),
escaped input, bounded size and SVG element counts for a 1024-rank MoE, and
pictures that draw exactly the plan's ops: every destination block's
`data-logical` rectangle, receiver and sender are checked against
`Plan.ops`, mapped to logical coordinates through the destination's runs
(an independent path from the template pieces the report reads).
The browser check is tests/test_html_browser.py.
"""

from __future__ import annotations

import itertools
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from layoutlang.cli import main
from layoutlang.compiler import compile_plan
from layoutlang.modes import Run
from layoutlang.report.html_analysis import MAX_BLOCKS, MAX_CELLS, compact_name
from layoutlang.report.html_page import render_html, tensor_groups

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ("examples/llama3_8b_train.layout", "examples/llama3_8b_infer.layout")
MOE = ("examples/deepseek_v3_moe.layout", "examples/deepseek_v3_infer.layout")
MOE_1024 = {"DP": 64, "EP": 64, "AT": 1024}  # 1024 trainer ranks -> 256 engine ranks
SMALL = [("examples/small/llama_train.layout", "examples/small/llama_infer.layout"),
         ("examples/small/llama_train.layout", "examples/small/llama_infer_tp4.layout"),
         ("examples/small/moe_train.layout", "examples/small/moe_infer.layout"),
         ("examples/small/mamba_train.layout", "examples/small/mamba_infer.layout"),
         ("examples/small/pp_train.layout", "examples/small/pp_infer.layout")]
# The pictures are bounded (MAX_BLOCKS, MAX_CELLS); the tensor table lists every group (key
# pattern x template, ~0.85 KB each): DeepSeek-V3 with HF keys has 5489 of them (gate_proj and
# up_proj of every expert apart), 5.4 MB in all.
MAX_BYTES = 6_000_000  # 6 MB


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def llama():
    plan = compile_plan(*(ROOT / p for p in LLAMA))
    return plan, render_html(plan)


class Svgs(HTMLParser):
    """Every <svg>: its attributes, element count, and the attributes of its <rect>s and <text>s."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.svgs: list[dict] = []
        self.depth = 0
        self.open_text = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svgs.append({"attrs": a, "elements": 0, "rects": [], "texts": []})
            self.depth += 1
            return
        if self.depth:
            svg = self.svgs[-1]
            svg["elements"] += 1
            if tag == "rect":
                svg["rects"].append(a)
            if tag == "text":
                svg["texts"].append("")
                self.open_text = True

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "svg":
            self.depth -= 1

    def handle_data(self, data):
        if self.open_text:
            self.svgs[-1]["texts"][-1] += data

    def handle_endtag(self, tag):
        if tag == "svg":
            self.depth -= 1
        if tag == "text":
            self.open_text = False


def parse_svgs(html: str) -> list[dict]:
    p = Svgs()
    p.feed(html)
    return p.svgs


def pictures(html: str, side: str) -> dict[str, dict]:
    return {s["attrs"]["data-key"]: s for s in parse_svgs(html)
            if s["attrs"].get("class") == "tensor" and s["attrs"].get("data-side") == side}


def logical_of(plan, op) -> list[str]:
    """The op's destination rectangles in the logical coordinates of the STORED tensor (a part key
    inside a fused tensor is drawn where it lies in it), through the destination's runs: an op
    whose slice crosses runs (rotary halves of consecutive heads, contiguous in storage) is one
    rectangle per combination of the runs it crosses in each dim."""
    tensor = next(t for t, _ in plan.dst.key_index[op.key] if t.name == op.dst_name and t.holds(op.dst_rank))
    per_dim = []
    for runs, (a, b) in zip(tensor.runs(op.dst_rank), op.dst_slice):
        segments = []
        for r in runs:
            lo, hi = max(a, r.local_start), min(b, r.local_start + r.length)
            if isinstance(r, Run) and lo < hi:
                start = r.logical_start + lo - r.local_start
                segments.append(f"{start}:{start + hi - lo}")
        assert sum(int(x.split(":")[1]) - int(x.split(":")[0]) for x in segments) == b - a, (op, runs)
        per_dim.append(segments)
    return [",".join(box) for box in itertools.product(*per_dim)]


def drawn_ops(svg: dict) -> list[tuple[int, str, int]]:
    """(receiver, logical rectangle, sender) of every block drawn."""
    out = []
    for r in svg["rects"]:
        if "data-logical" not in r:
            continue
        dst = [int(x) for x in r["data-dst-rank"].split()]
        src = [int(x) for x in r["data-src-rank"].split()]
        assert len(dst) == len(src), r
        out.extend((d, r["data-logical"], s) for d, s in zip(dst, src))
    return out


def check_pictures(plan, html: str) -> int:
    """Every drawn destination picture is exactly its key's ops; returns how many were checked."""
    dst, src = pictures(html, "dst"), pictures(html, "src")
    assert dst and set(dst) == set(src)
    by_key: dict[str, list] = {}
    for op in plan.ops:
        by_key.setdefault(op.key, []).append(op)
    for key, svg in dst.items():
        expected = sorted((op.dst_rank, box, op.src_rank) for op in by_key[key] for box in logical_of(plan, op))
        assert sorted(drawn_ops(svg)) == expected, key
        # the source picture draws the same blocks; every sender holds its block
        src_blocks = {r["data-logical"]: r for r in src[key]["rects"] if "data-logical" in r}
        assert set(src_blocks) == {r["data-logical"] for r in svg["rects"] if "data-logical" in r}
        for r in src_blocks.values():
            holders = set(r["data-holders"].split())
            assert set(r["data-src-rank"].split()) <= holders, (key, r)
    return len(dst)


# ---- the Llama-3-8B pair ----------------------------------------------------------------

def test_llama_report_is_one_self_contained_page(llama):
    plan, html = llama
    assert html.startswith("<!DOCTYPE html>")
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=", html)
    assert "<link rel=\"stylesheet\"" not in html and "@import" not in html
    assert re.findall(r"url\(([^)]*)\)", html) and all(u.startswith("#") for u in re.findall(r"url\(([^)]*)\)", html))
    assert "Content-Security-Policy" in html  # the browser refuses any fetch
    for section in ("summary", "traffic", "ranks", "tensors", "sources"):
        assert f'<section id="{section}">' in html
    assert '<input type="search" id="tensor-search"' in html


def test_llama_summary_against_the_floor(llama):
    plan, html = llama
    s = plan.stats
    assert f"{s['send_balance']:.2f}&times; the floor" in html
    assert f"rank {s['busiest_sender']} sends" in html and f"rank {s['busiest_receiver']} receives" in html
    assert f"({s['bytes']} B)" in html
    assert "<th>buckets</th><td>1 with no staging budget (budget None)" in html
    assert "<th>network</th>" in html  # no --ranks-per-node: one network figure
    rpn = compile_plan(*(ROOT / p for p in LLAMA), ranks_per_node=8)
    text = render_html(rpn)
    assert "<th>intra-node</th>" in text and "<th>inter-node</th>" in text


def test_llama_heatmap_and_bars(llama):
    plan, html = llama
    svgs = parse_svgs(html)
    heat = next(s for s in svgs if s["attrs"].get("class") == "heatmap")
    cells = [r for r in heat["rects"] if r.get("fill", "").startswith("#")]
    pairs = {(op.src_rank, op.dst_rank) for op in plan.ops}
    assert len(cells) == len(pairs)  # 64 x 4 ranks: one cell per rank pair, none aggregated
    op = plan.ops[0]
    n = sum(1 for o in plan.ops if (o.src_rank, o.dst_rank) == (op.src_rank, op.dst_rank))
    assert re.search(rf"<title>rank {op.src_rank} -&gt; rank {op.dst_rank}: [0-9.]+ [KMG]iB in {n} ops", html)
    bars = [s for s in svgs if "per source rank" in s["attrs"].get("aria-label", "")
            or "per destination rank" in s["attrs"].get("aria-label", "")]
    assert len(bars) == 2
    sends = [r for r in bars[0]["rects"] if r.get("class") == "net"]
    assert len(sends) == 64


def test_llama_pictures_are_the_plans_ops(llama):
    plan, html = llama
    groups = [g for p in tensor_groups(plan) for g in p.groups]
    assert check_pictures(plan, html) == len(groups)  # every group drawn


def test_llama_pictures_show_parts_and_padding(llama):
    plan, html = llama
    src, dst = pictures(html, "src"), pictures(html, "dst")
    # a part key is drawn inside its stored tensor, with that tensor's parts marked: q_proj lies in
    # the trainer's grouped linear_qkv and in the engine's qkv_proj, gate_proj in fc1 / gate_up_proj;
    # q and k rows are rotary halves in both (re: D/2 | im: D/2), marked as the nested parts
    qkv = {"q.re", "q.im", "k.re", "k.im", "v"}
    for key, parts in (("model.layers.0.self_attn.q_proj.weight", qkv),
                       ("model.layers.0.self_attn.v_proj.weight", qkv),
                       ("model.layers.0.mlp.gate_proj.weight", {"gate", "up"})):
        assert parts <= set(dst[key]["texts"]) and parts <= set(src[key]["texts"]), key
    # the trainer pads the vocabulary to 1024 (TP 8): 768 rows on the last TP rank's replicas
    emb = "model.embed_tokens.weight"
    pads = [r for r in src[emb]["rects"] if "data-pad" in r]
    assert len(pads) == 1 and pads[0]["data-pad"] == "0"
    assert "768 rows" in html and not [r for r in dst[emb]["rects"] if "data-pad" in r]


def test_llama_groups_by_layer_pattern(llama):
    plan, html = llama
    patterns = tensor_groups(plan)
    groups = [g for p in patterns for g in p.groups]
    keys = [k for g in groups for k in g.keys]
    assert sorted(keys) == sorted(t.key for t in plan.tensors)  # each key in exactly one group
    # one group per HF key pattern: embed, lm_head, final norm + 9 per-layer weights (the fused
    # linear_qkv / qkv_proj hold 3 keys, fc1 / gate_up_proj 2)
    assert len(groups) == 12 and html.count('<article class="group"') == 12
    # ops per layer from tests/test_plan_examples.py's hand count: q 32, k 16, v 16, gate 16, up 16
    for suffix, per_layer in (("self_attn.q_proj", 32), ("self_attn.k_proj", 16), ("self_attn.v_proj", 16),
                              ("mlp.gate_proj", 16), ("mlp.up_proj", 16), ("mlp.down_proj", 32)):
        group = next(g for g in groups if g.name.endswith(f".{suffix}.weight"))
        assert group.name == f"model.layers.{{0..31}}.{suffix}.weight"
        assert len(group.keys) == 32 and group.ops == 32 * per_layer, suffix
    assert compact_name(["a.1.b2", "a.3.b2"]) == "a.{1, 3}.b2"


@pytest.mark.parametrize("pair", SMALL, ids=lambda p: Path(p[1]).stem)
def test_small_pairs_draw_their_ops(pair):
    plan = compile_plan(*(ROOT / p for p in pair))
    html = render_html(plan)
    assert "http://" not in html and "https://" not in html
    assert check_pictures(plan, html) >= 1


# ---- the DeepSeek-V3 MoE pair ----------------------------------------------------------

@pytest.mark.parametrize("args", [{}, MOE_1024], ids=["256-ranks", "1024x256-ranks"])
def test_moe_report_stays_small(args):
    plan = compile_plan(*(ROOT / p for p in MOE), args=args)
    html = render_html(plan)
    assert len(html.encode("utf-8")) < MAX_BYTES
    assert "http://" not in html and "https://" not in html
    svgs = parse_svgs(html)
    heat = next(s for s in svgs if s["attrs"].get("class") == "heatmap")
    assert len(heat["rects"]) <= MAX_CELLS * MAX_CELLS + 1
    for s in svgs:  # every picture bounded: blocks (+ labels) and a few axes, parts, pads
        assert s["elements"] <= 2 * MAX_CELLS * MAX_CELLS + 200, s["attrs"]
        if s["attrs"].get("class") == "tensor":
            assert len([r for r in s["rects"] if "data-logical" in r]) <= MAX_BLOCKS
    groups = [g for p in tensor_groups(plan) for g in p.groups]
    assert html.count('<article class="group"') == len(groups)
    assert sum(len(g.keys) for g in groups) == len(plan.tensors)
    # every group is drawn or links to a drawn group cut alike
    drawn = {g.index for g in groups if g.pictures}
    assert all(g.index in drawn or g.like in drawn for g in groups)
    if args:
        assert "drawn in blocks of 16 &times; 4" in html  # 1024 x 256 ranks, aggregated
    else:
        assert check_pictures(plan, html) == len(drawn)


def test_caps_say_what_they_leave_out(monkeypatch):
    from layoutlang.report import html_analysis as report

    plan = compile_plan(*(ROOT / p for p in LLAMA))
    monkeypatch.setattr(report, "MAX_BLOCKS", 3)
    monkeypatch.setattr(report, "MAX_PICTURES", 2)
    html = render_html(plan)
    dst = pictures(html, "dst")
    assert len(dst) == 2 and all(len([r for r in s["rects"] if "data-logical" in r]) <= 3 for s in dst.values())
    assert "more blocks not drawn" in html
    assert "2 of 12 groups are drawn" in html and "Not drawn (the report draws at most 2 groups" in html


# ---- escaping and the command line ------------------------------------------------------

def test_input_is_escaped(tmp_path):
    folder = tmp_path / "<script>alert(1)"  # a file name cannot hold `/`
    folder.mkdir()
    src = folder / "a<b>train.layout"
    src.write_text("layout esc\n# </pre><script>alert(2)</script> <b>bold</b>\nmesh m (tp=2)\n"
                   "tensor w [8 over tp, 4]\n")
    dst = tmp_path / "infer.layout"
    dst.write_text("mesh m (tp=1)\ntensor w [8, 4]\n")
    html = render_html(compile_plan(src, dst))
    assert html.count("<script") == 1  # the report's own
    assert "<b>" not in html and "<script>alert" not in html
    assert "&lt;script&gt;alert(1)/a&lt;b&gt;train.layout" in html
    assert "&lt;/pre&gt;&lt;script&gt;alert(2)" in html  # the source listing, escaped by pygments


def test_cli_writes_the_report(tmp_path, capsys):
    src, dst = SMALL[2]
    out = tmp_path / "plan.html"
    assert main(["plan", src, dst, "--format", "html", "-o", str(out)]) == 0
    text = out.read_text("utf-8")
    assert text.startswith("<!DOCTYPE html>") and "moe_train" in text
    assert main(["plan", src, dst, "--format", "html"]) == 0
    assert capsys.readouterr().out == text
    assert main(["plan", src, dst, "--format", "html", "--rank", "1"]) == 2
    assert "html shows the whole plan" in capsys.readouterr().err


# ---- the sources shown are the sources compiled --------------------------------------------

def test_sources_are_the_text_that_was_compiled(tmp_path):
    """Editing a layout after compiling does not change the report: it shows `Layout.source_text`."""
    src, dst = tmp_path / "train.layout", tmp_path / "infer.layout"
    src.write_text("layout before\nmesh m (tp=2)\ntensor w [8 over tp, 4]\n")
    dst.write_text("mesh m (tp=1)\ntensor w [8, 4]\n")
    plan = compile_plan(src, dst)
    before = render_html(plan)
    src.write_text("layout edited_after_compiling\nmesh m (tp=2)\ntensor w [8 over tp, 4]\n")
    dst.unlink()
    after = render_html(plan)
    assert after == before and "edited_after_compiling" not in after


def test_source_text_prefers_the_layouts_text(tmp_path):
    from types import SimpleNamespace

    from layoutlang.report.html_page import source_text

    path = tmp_path / "a.layout"
    path.write_text("on disk\n")
    assert source_text(SimpleNamespace(path=str(path), source_text="compiled\n")) == "compiled\n"
    assert source_text(SimpleNamespace(path=str(path))) == "on disk\n"  # a Layout without its text
    assert source_text(SimpleNamespace(path=str(tmp_path / "gone.layout"))) is None
