"""Parts on one side only (layoutlang/compiler/refine.py): a plain dim is read as the other side's parts.

Reference, independent of the compiler: storage order is the written order on both sides
(LANGUAGE.md 3), so a plain `[NH*D, H]` key and a side writing the same key's rows as
`(NH, (re: D/2 | im: D/2))` hold the same rows in the same stored order. Every expected
mapping below is written out from that and from how `over` cuts each side's storage:
which stored row of which rank lands where. The ops are executed row by row (strided
entries expanded), nothing is read from the plan's pieces.
"""

from __future__ import annotations

import pytest

from layoutlang import compile_plan, loads
from layoutlang.compiler import PlanError, strides

NH, KV, D, H = 4, 2, 8, 16


def moved(plan, key: str, cols: int = H) -> dict:
    """(dst rank, dst name, dst row) -> (src rank, src name, src row) for every row of `key`'s ops
    (whole rows: every op of these pairs carries all the columns)."""
    out = {}
    for op in plan.ops:
        if op.key != key:
            continue
        assert op.src_slice[1] == op.dst_slice[1] == (0, cols), op
        src = [x for lo, hi in strides.blocks(op.src_slice[0]) for x in range(lo, hi)]
        dst = [x for lo, hi in strides.blocks(op.dst_slice[0]) for x in range(lo, hi)]
        for d, s in zip(dst, src, strict=True):
            assert (op.dst_rank, op.dst_name, d) not in out, "a row written twice"
            out[op.dst_rank, op.dst_name, d] = (op.src_rank, op.src_name, s)
    return out


Q_KEY, K_KEY, V_KEY = (f"m.{p}_proj.weight" for p in "qkv")
# a checkpoint read without its config: one rank, every key plain and whole
PLAIN = f"""mesh ck (one=1)
tensor {Q_KEY} [{NH * D}, {H}]
tensor {K_KEY} [{KV * D}, {H}]
tensor {V_KEY} [{KV * D}, {H}]
"""
# vLLM at TP2: each rank's q heads, its k head, its v head, q/k rows as rotary halves
VLLM = f"""const NH = {NH}, KV = {KV}, D = {D}
mesh infer (tp=2)
tensor qkv [(q: (NH, (re: D/2 | im: D/2)) as {Q_KEY} | k: (KV, (re: D/2 | im: D/2)) as {K_KEY}
            | v: (KV, D) as {V_KEY}) over tp, {H}]
"""


def vllm_rows() -> dict:
    """(rank, local row of qkv) -> (key, stored row of that key in the plain checkpoint), by hand:
    rank t holds q heads 2t, 2t+1 (rows 16t .. 16t+15), k head t, v head t, in that order."""
    out = {}
    for t in range(2):
        rows = [(Q_KEY, 16 * t + r) for r in range(16)] + [(K_KEY, 8 * t + r) for r in range(8)]
        rows += [(V_KEY, 8 * t + r) for r in range(8)]
        out.update({(t, j): key_row for j, key_row in enumerate(rows)})
    return out


def test_a_plain_checkpoint_loads_into_rotary_halves_row_for_row():
    plan = compile_plan(loads(PLAIN, "plain"), loads(VLLM, "vllm"))
    want = vllm_rows()
    for key in (Q_KEY, K_KEY, V_KEY):
        got = moved(plan, key)
        assert got == {(t, "qkv", j): (0, k, r) for (t, j), (k, r) in want.items() if k == key}, key
    assert plan.stats["bytes"] == (NH + 2 * KV) * D * H * 2  # bf16, every row once


def test_rotary_halves_save_into_a_plain_checkpoint_row_for_row():
    plan = compile_plan(loads(VLLM, "vllm"), loads(PLAIN, "plain"))
    want = vllm_rows()
    for key in (Q_KEY, K_KEY):
        got = moved(plan, key)
        assert got == {(0, k, r): (t, "qkv", j) for (t, j), (k, r) in want.items() if k == key}, key


def test_plain_parts_of_a_fused_tensor_and_under_a_product_are_refined_too():
    """Megatron's grouped qkv written plain, `(KV, (q: QG*D as q | k: D as k | v: D as v)) over tp`
    (per group: its 2 q heads, its k head, its v head), against the halves written once, one rank:
    group g's rows are q rows 16g.., k rows 8g.., v rows 8g.. of the keys, in stored order."""
    grouped = f"""const KV = {KV}, D = {D}
mesh train (tp=2)
tensor qkv [(KV, (q: 2*D as {Q_KEY} | k: D as {K_KEY} | v: D as {V_KEY})) over tp, {H}]
"""
    halves = f"""const NH = {NH}, KV = {KV}, D = {D}
mesh one (one=1)
tensor {Q_KEY} [(NH, (re: D/2 | im: D/2)), {H}]
tensor {K_KEY} [(KV, (re: D/2 | im: D/2)), {H}]
tensor {V_KEY} [KV*D, {H}]
"""
    for src, dst, flip in ((grouped, halves, False), (halves, grouped, True)):
        plan = compile_plan(loads(src, "src"), loads(dst, "dst"))
        for key, first, n in ((Q_KEY, 0, 16), (K_KEY, 16, 8), (V_KEY, 24, 8)):
            want = {(g, "qkv", first + r): (0, key, n * g + r) for g in range(2) for r in range(n)}
            if not flip:
                want = {(0, k, r): (g, name, row) for (g, name, row), (_, k, r) in want.items()}
            assert moved(plan, key) == want, (key, flip)


def test_a_plain_side_whose_split_would_move_rows_is_refused_with_the_reason():
    """`over` cuts plain rows contiguously: a strided `(gate | up) over tp` or a product whose
    copies are replicated (tp 8 > 4 heads) stores other rows per rank, so the plain side cannot
    be read as those parts; the error names the split, at the plain side's line."""
    strided = "mesh m (tp=2)\ntensor w [(gate: 8 | up: 8) over tp, 4]\n"
    plain = "mesh m (tp=2)\ntensor w [16 over tp, 4]\n"
    with pytest.raises(PlanError) as e:
        compile_plan(loads(strided, "strided"), loads(plain, "plain.layout"))
    assert e.value.message == ("`w` dim 0: parts on one side only: 16 in `w`, (gate: 8 | up: 8) in the source; "
                               "the plain rows cannot be read as those parts: `over tp` cuts plain rows "
                               "contiguously but would cut those parts otherwise (each part of a concatenation, "
                               "whole copies of a product)")
    assert (e.value.file, e.value.line, e.value.col) == ("plain.layout", 2, 1)
    assert e.value.notes[0].message == "the source declaration" and e.value.notes[0].span.source.path == "strided"
    heads = "mesh m (tp=8)\ntensor w [(4, (re: 4 | im: 4)) over tp, 4]\n"
    rows = "mesh m (tp=8)\ntensor w [32 over tp, 4]\n"
    with pytest.raises(PlanError) as e:
        compile_plan(loads(rows, "rows"), loads(heads, "heads"))
    assert "in `w`, (re: 16 | im: 16) in the destination; the plain rows cannot be read" in e.value.message
    assert e.value.file == "rows"
    # whole on one rank, the same strided parts pair: gate rows then up rows, as stored
    one = "mesh m (one=1)\ntensor w [16, 4]\n"
    plan = compile_plan(loads(strided, "strided"), loads(one, "one"))
    # stored row r of the plain side: gate row r (r < 8) or up row r - 8; tp rank c holds gate rows
    # 4c..4c+3 at local 0..3 and up rows 4c..4c+3 at local 4..7
    want = {(0, "w", r): ((r % 8) // 4, "w", (r // 8) * 4 + r % 4) for r in range(16)}
    assert moved(plan, "w", cols=4) == want


def test_pairs_that_plan_without_refinement_keep_their_layouts():
    """Nothing refined: the plan's layouts are the caller's objects."""
    src, dst = loads(VLLM, "a"), loads(VLLM.replace("tp=2", "tp=1"), "b")
    plan = compile_plan(src, dst)
    assert plan.src is src and plan.dst is dst
    plain = loads(PLAIN, "plain")
    plan = compile_plan(plain, dst)
    assert plan.src is not plain and plan.dst is dst  # the plain side is refined, not the halves
    assert [(t.name, t.local_shape) for t in plan.src.tensors] == [(t.name, t.local_shape) for t in plain.tensors]


def test_a_plain_side_keeps_its_padding_and_chunks_when_refined():
    """Plain `30 pad 32 over tp` (rank t: stored rows 16t.., rank 1's last 2 rows padding) and plain
    `32 over tp chunk g` (rank (t, g): rows 16t + 8g ..) against the same rows written as
    `(3, (re: 5 | im: 5))` / `(4, (re: 4 | im: 4))` on one rank: stored row r of the one-rank side
    is stored row r of the plain side's whole dim, never a padding row."""
    padded = "mesh m (tp=2)\ntensor w [30 pad 32 over tp, 4]\n"
    halves = "mesh o (one=1)\ntensor w [(3, (re: 5 | im: 5)), 4]\n"
    plan = compile_plan(loads(padded, "padded"), loads(halves, "halves"))
    assert moved(plan, "w", cols=4) == {(0, "w", r): (r // 16, "w", r % 16) for r in range(30)}
    plan = compile_plan(loads(halves, "halves"), loads(padded, "padded"))
    assert moved(plan, "w", cols=4) == {(r // 16, "w", r % 16): (0, "w", r) for r in range(30)}
    chunked = "mesh m (tp=2, g=2)\ntensor w [32 over tp chunk g, 4]\n"
    heads = "mesh o (one=1)\ntensor w [(4, (re: 4 | im: 4)), 4]\n"
    plan = compile_plan(loads(chunked, "chunked"), loads(heads, "heads"))
    # rank (t, g) is rank 2t + g (row-major mesh coordinates)
    assert moved(plan, "w", cols=4) == {(0, "w", r): (2 * (r // 16) + (r % 16) // 8, "w", r % 8) for r in range(32)}


# ---- halves refine a plain side, Meta's interleaved pairs do not -------------------------------
# An HF checkpoint read without its config.json: plain q/k rows, HF's order by the key convention
# (each head's re half, then its im half), but nothing in the layout says so. HF keeps
# `(NH, (re: D/2 | im: D/2))` (stored order = that same order: plain row r is halves row r);
# Meta / torchtitan's Llama3 keep `(NH, D/2, (re: 1 | im: 1))`: HF row h*D + j*D/2 + i is Meta
# row h*D + 2i + j (convert_llama_weights_to_hf.py's permute), another order of the same rows.
HQ, HK = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qk")
HF_PLAIN = f"mesh ck (one=1)\ntensor {HQ} [64, 32]\ntensor {HK} [32, 32]\n"  # NH 4, KV 2, D 16, H 32
ROPE = "const NH = 4, KV = 2, D = 16\nmesh {mesh} ({axis}=2)\n" + "".join(
    f"tensor {key} [({n}, {{rows}}) over {{axis}}, 32]\n" for key, n in ((HQ, "NH"), (HK, "KV")))
HALVES = ROPE.format(mesh="infer", axis="tp", rows="(re: D/2 | im: D/2)")
META = ROPE.format(mesh="meta", axis="mp", rows="D/2, (re: 1 | im: 1)")


def test_a_config_less_hf_side_is_refined_by_halves_row_for_row():
    """Plain row r of a key is stored row r of the halves side at TP2: rank r // (rows / 2),
    local row r % (rows / 2); both ways."""
    plan = compile_plan(loads(HF_PLAIN, "plain"), loads(HALVES, "halves"))
    q = moved(plan, HQ, cols=32)
    # by hand: head 0's first re row, its first im row, head 1's im rows, head 2's re row, the last row
    for r, want in ((0, (0, 0)), (8, (0, 8)), (24, (0, 24)), (32, (1, 0)), (63, (1, 31))):
        assert q[want[0], HQ, want[1]] == (0, HQ, r), r
    assert q == {(r // 32, HQ, r % 32): (0, HQ, r) for r in range(64)}
    assert moved(plan, HK, cols=32) == {(r // 16, HK, r % 16): (0, HK, r) for r in range(32)}
    back = compile_plan(loads(HALVES, "halves"), loads(HF_PLAIN, "plain"))
    assert moved(back, HQ, cols=32) == {(0, HQ, r): (r // 32, HQ, r % 32) for r in range(64)}


def test_a_config_less_hf_side_against_meta_order_is_refused_at_the_plain_side():
    """Reading plain rows as Meta's pairs would load HF's halves in Meta's order: refused, both
    ways, at the plain declaration (line 2: q_proj), naming the interleaved parts."""
    for src, dst, side in ((META, HF_PLAIN, "source"), (HF_PLAIN, META, "destination")):
        with pytest.raises(PlanError) as e:
            compile_plan(loads(src, "meta.layout" if src is META else "hf.layout"),
                         loads(dst, "meta.layout" if dst is META else "hf.layout"))
        err = e.value
        assert err.message == (f"`{HQ}` dim 0: parts on one side only: 64 in `{HQ}`, (re: 32 | im: 32) in the "
                               f"{side}, which interleaves them row by row, `(8, (re: 1 | im: 1))`; plain rows do "
                               "not say whether they are stored in that order or in runs of each part (Meta's "
                               "interleaved rotary pairs against HF's halves)")
        assert (err.file, err.line, err.col) == ("hf.layout", 2, 1)
        assert err.help == ("write the parts on this side too (LANGUAGE.md 3); for a checkpoint, give it its "
                            "config.json: beside the files (`layoutc new checkpoint DIR` reads it), `describe(dir, "
                            "config=...)` or `save(..., config=...)`, which write HF's rotary halves")
        assert err.notes[0].message == f"the {side} declaration" and err.notes[0].span.source.path == "meta.layout"
        text = str(err).splitlines()
        assert text[0].startswith("hf.layout:2:1: error: ") and text[1].endswith(f"tensor {HQ} [64, 32]")
        assert text[2].strip(" |").startswith("^")


def test_meta_order_against_halves_pairs_when_both_write_the_parts():
    """Meta (MP2: rank h // 2 holds heads 2(h // 2), +1) -> the halves on one rank: head h's HF row
    h*D + j*D/2 + i is Meta's row 2i + j of head h, local row (h % 2)*16 + 2i + j on rank h // 2."""
    one = HALVES.replace("(tp=2)", "(tp=1)")
    plan = compile_plan(loads(META, "meta"), loads(one, "halves"))
    q = moved(plan, HQ, cols=32)
    head1 = {(0, HQ, 16 + 8 * j + i): (0, HQ, 16 + 2 * i + j) for i in range(8) for j in range(2)}
    assert {k: q[k] for k in head1} == head1  # head 1, written out: HF 16..23 <- Meta 16, 18, ..., 30
    assert q[0, HQ, 17] == (0, HQ, 18) and q[0, HQ, 24] == (0, HQ, 17)
    assert q == {(0, HQ, 16 * h + 8 * j + i): (h // 2, HQ, 16 * (h % 2) + 2 * i + j)
                 for h in range(4) for i in range(8) for j in range(2)}


def test_a_checkpoint_without_config_json_is_refused_against_torchtitans_llama3(tmp_path, capsys):
    """End to end: save_file of an HF Llama's keys (no config.json) -> `layoutc plan` / `convert`
    into `layoutc new torchtitan` (Meta's order): exit 1, the diagnostic at the checkpoint's q_proj
    line, nothing written; `save` of torchtitan's tensors without a config likewise; with the
    config.json beside the files the q/k rows are halves and it plans."""
    import json

    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from layoutlang.bridges.families import model_from_config, render
    from layoutlang.checkpoint import describe
    from layoutlang.cli import main

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32}
    model = model_from_config(config)
    ck = tmp_path / "ck"
    ck.mkdir()
    save_file({t.key: torch.zeros(t.local_shape, dtype=torch.bfloat16)
               for t in loads(render(model, "hf", {"DP": 1}), "hf").tensors}, str(ck / "model.safetensors"))
    line = next(i for i, text in enumerate(describe(ck).text.splitlines(), 1) if f"tensor {HQ} " in text)
    titan = tmp_path / "titan.layout"
    titan.write_text(render(model, "torchtitan", {"DP": 1}))
    for argv in (["plan", str(ck), str(titan)], ["convert", str(ck), "-o", str(tmp_path / "out"), "--to", str(titan)]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith(f"<checkpoint {ck}>:{line}:1: error: `{HQ}` dim 0: parts on one side only"), err
        assert "`(4, (re: 1 | im: 1))`" in err and "help: write the parts on this side too" in err
        assert not (tmp_path / "out").exists()
    # save: torchtitan's tensors into an empty directory, no config -> the same refusal, nothing written
    from layoutlang.checkpoint import save

    source = loads(titan.read_text(), "titan.layout")
    tensors = {t.name: torch.zeros(t.local_shape, dtype=torch.bfloat16) for t in source.tensors}
    with pytest.raises(PlanError) as e:
        save(str(tmp_path / "saved"), source, tensors)
    # (the files list their tensors by name, as safetensors writes them: k_proj's rows are met first)
    assert e.value.message.startswith(f"`{HQ.replace('q_proj', 'k_proj')}` dim 0: parts on one side only")
    assert "config=" in e.value.help
    assert e.value.file == f"<checkpoint {tmp_path / 'saved'}>" and not (tmp_path / "saved").exists()
    (ck / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(ck), str(titan)]) == 0
