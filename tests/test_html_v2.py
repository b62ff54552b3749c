"""The HTML report's tensor pictures for v2 keys: stacked, fused and transposed stored tensors.

A picture draws a stored tensor's logical tensor; with three dims or more every dim but the
last goes down (a stacked `w13_weight [E, 2I, H]` is E bands of 2I rows), so that each
block of the plan is ONE rectangle where its elements lie. Each side draws its own stored
tensor: the destination picture the destination's, the source picture the source's (a key of
HF gpt-oss's transposed `gate_up_proj [E, H, 2I]` is a band of columns there).

Checked against the plan's ops through an independent path (the tensors' runs, not the
report's pieces): every drawn destination block is exactly the ops of the group's first key
(receiver, logical rectangle of the destination stored tensor, sender), every drawn source
block the same ops seen from the sender (its rectangle of the source stored tensor); the
rectangles sit where the hand formula of the layout puts them and never overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from layoutlang.compiler import compile_plan
from test_html import drawn_ops, parse_svgs, pictures

from layoutlang.modes import Run
from layoutlang.report.html_page import render_html

SMALL_V2 = Path(__file__).resolve().parent.parent / "examples" / "small" / "v2"
PAIRS = [("moe_megatron", "moe_vllm"), ("moe_hf", "moe_vllm"), ("gptoss_hf", "gptoss_vllm"),
         ("gptoss_megatron", "gptoss_hf"), ("gptoss_hf", "gptoss_megatron"), ("mla_megatron", "mla_vllm")]


@pytest.fixture(scope="module")
def reports():
    cache = {}

    def get(src: str, dst: str):
        if (src, dst) not in cache:
            plan = compile_plan(SMALL_V2 / f"{src}.layout", SMALL_V2 / f"{dst}.layout")
            cache[src, dst] = plan, render_html(plan)
        return cache[src, dst]
    return get


def _stored_logical(layout, name: str, rank: int, local) -> str:
    """A local slice of a stored tensor as `lo:hi` per dim of its logical tensor, through its runs;
    a strided dim (LANGUAGE.md 6: `block` elements from each k in range(start, stop, step)) must
    map to one logical range (its blocks' logical ranges meet end to start)."""
    tensor = next(t for t in layout.tensors if t.name == name and t.holds(rank))
    out = []
    for runs, e in zip(tensor.runs(rank), local):
        step, block = (e[2], e[3] if len(e) == 4 else 1) if len(e) > 2 else (1, e[1] - e[0])
        spans = []
        for a in range(e[0], e[1], step) if len(e) > 2 else (e[0],):
            b = a + block
            run = next(r for r in runs if isinstance(r, Run) and r.local_start <= a and b <= r.local_start + r.length)
            lo = run.logical_start + a - run.local_start
            spans.append((lo, lo + b - a))
        spans.sort()
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:])), spans
        out.append(f"{spans[0][0]}:{spans[-1][1]}")
    return ",".join(out)


def _sent_ops(svg: dict) -> list[tuple[int, str]]:
    """(sender, rectangle) of every send a source picture draws (one per receiver)."""
    return [(int(s), r["data-logical"]) for r in svg["rects"] if "data-logical" in r
            for s in r["data-src-rank"].split()]


def _rects(svg: dict) -> list[tuple[str, float, float, float, float]]:
    return [(r["data-logical"], float(r["x"]), float(r["y"]), float(r["width"]), float(r["height"]))
            for r in svg["rects"] if "data-logical" in r]


def _frame(svg: dict) -> tuple[float, float, float, float]:
    f = next(r for r in svg["rects"] if r.get("class") == "frame")
    return float(f["x"]), float(f["y"]), float(f["width"]), float(f["height"])


@pytest.mark.parametrize("src,dst", PAIRS, ids=lambda x: x)
def test_pictures_are_the_plans_ops_on_both_sides(reports, src, dst):
    plan, html = reports(src, dst)
    dst_pics, src_pics = pictures(html, "dst"), pictures(html, "src")
    assert dst_pics and set(dst_pics) == set(src_pics)
    by_key: dict[str, list] = {}
    for op in plan.ops:
        by_key.setdefault(op.key, []).append(op)
    for key, svg in dst_pics.items():
        ops = by_key[key]
        want = sorted((op.dst_rank, _stored_logical(plan.dst, op.dst_name, op.dst_rank, op.dst_slice), op.src_rank)
                      for op in ops)
        assert sorted(drawn_ops(svg)) == want, key
        # the source picture draws what leaves source ranks; a relay (a replica forwarding) is drawn on the other
        sent = sorted((op.src_rank, _stored_logical(plan.src, op.src_name, op.src_rank, op.src_slice))
                      for op in ops if not op.after)
        assert sorted(_sent_ops(src_pics[key])) == sent, key


@pytest.mark.parametrize("src,dst", PAIRS, ids=lambda x: x)
def test_blocks_never_overlap_and_stay_in_the_frame(reports, src, dst):
    """The bug this file exists for: w2 [E, H, I] halves cut along I were drawn as two
    overlapping bounding ranges of the flattened H x I columns."""
    _, html = reports(src, dst)
    for svg in parse_svgs(html):
        if svg["attrs"].get("class") != "tensor":
            continue
        fx, fy, fw, fh = _frame(svg)
        rects = _rects(svg)
        for name, x, y, w, h in rects:
            assert fx - 0.1 <= x and x + w <= fx + fw + 0.2 and fy - 0.1 <= y and y + h <= fy + fh + 0.2, name
        for i, (a, ax, ay, aw, ah) in enumerate(rects):
            for b, bx, by, bw, bh in rects[i + 1:]:
                inside_x = min(ax + aw, bx + bw) - max(ax, bx)
                inside_y = min(ay + ah, by + bh) - max(ay, by)
                assert inside_x <= 0.15 or inside_y <= 0.15, (svg["attrs"]["data-key"], a, b)


def test_stacked_w13_blocks_by_hand(reports):
    """vLLM w13_weight [E=8, 2I=64, H=64]: 8 bands of 64 rows, gate rows 0..32 then up rows 32..64.
    Megatron (etp 2) sends expert 2's gate rows 0..16 and 16..32: two blocks of band 2, whole
    width, at rows 2*64 + 0 and 2*64 + 16 of 512."""
    _, html = reports("moe_megatron", "moe_vllm")
    svg = pictures(html, "dst")["model.layers.0.mlp.experts.2.gate_proj.weight"]
    fx, fy, fw, fh = _frame(svg)
    sy = fh / 512
    got = sorted(_rects(svg))
    assert [g[0] for g in got] == ["2:3,0:16,0:64", "2:3,16:32,0:64"]
    for (_, x, y, w, h), row in zip(got, (128, 144)):
        assert (x, w) == (fx, fw)
        assert abs(y - (fy + row * sy)) <= 0.1 and abs(h - 16 * sy) <= 0.1
    assert {"0 gate", "0 up", "2 gate", "7 up"} <= set(svg["texts"])  # expert index and part per band


def test_stacked_w2_halves_by_hand(reports):
    """w2_weight [E=8, H=64, I=32]: expert 2's key arrives in two etp halves of I, the left and right
    half of band 2 (rows 128..192 of 512), side by side."""
    _, html = reports("moe_megatron", "moe_vllm")
    svg = pictures(html, "dst")["model.layers.0.mlp.experts.2.down_proj.weight"]
    fx, fy, fw, fh = _frame(svg)
    got = sorted(_rects(svg))
    assert [g[0] for g in got] == ["2:3,0:64,0:16", "2:3,0:64,16:32"]
    for (_, x, y, w, h), left in zip(got, (fx, fx + fw / 2)):
        assert abs(x - left) <= 0.1 and abs(w - fw / 2) <= 0.1
        assert abs(y - (fy + fh * 128 / 512)) <= 0.1 and abs(h - fh * 64 / 512) <= 0.1


def test_transposed_interleaved_key_is_a_band_of_columns(reports):
    """Megatron -> HF gpt-oss: the key gate_proj [I=64, H=64] of expert 1 lies in HF's
    gate_up_proj [E=4, H=64, 2I=128] (transposed, gate|up interleaved in storage, hoisted in the
    logical tensor) as columns 0..64 of band 1: key row j is the stored column j; the 64
    interleaved columns (stored 0, 2, ..., 126) come in one strided op (docs/compiler.md) per
    Megatron etp half (gate rows 0..32 on etp 0, 32..64 on etp 1): two blocks 32 columns wide,
    over the 64 rows of expert 1 (rows 64..128 of 256)."""
    _, html = reports("gptoss_megatron", "gptoss_hf")
    svg = pictures(html, "dst")["model.layers.0.mlp.experts.1.gate_proj.weight"]
    fx, fy, fw, fh = _frame(svg)
    sx = fw / 128
    got = sorted(_rects(svg), key=lambda r: r[1])
    assert [g[0] for g in got] == ["1:2,0:64,0:32", "1:2,0:64,32:64"]
    for k, (_, x, y, w, h) in enumerate(got):
        assert abs(x - (fx + 32 * k * sx)) <= 0.1 and abs(w - 32 * sx) <= 0.1
        assert abs(y - (fy + fh / 4)) <= 0.1 and abs(h - fh / 4) <= 0.1
    assert {"gate", "up", "0", "3"} <= set(svg["texts"])
    # the source picture is Megatron's fc1 [2I, H] of local expert 1: the key's 64 gate rows
    src = pictures(html, "src")["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert "linear_fc1.weight1 [64, 64] local" in src["attrs"]["aria-label"]
    assert {r[0] for r in _rects(src)} == {"0:32,0:64", "32:64,0:64"}
