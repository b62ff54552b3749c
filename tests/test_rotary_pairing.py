"""Rotary pairing (issue 29): what a Meta-order source needs, and what every shipped pair costs.

Meta's checkpoints and torchtitan's Llama3 keep each head's rotary pairs interleaved,
`(NH, D/2, (re: 1 | im: 1))`; HF, vLLM, SGLang and Megatron keep them split per head,
`(NH, (re: D/2 | im: D/2))`. The two name the same logical rows only when BOTH sides
write the parts (a plain side is read as the halves it meets, never as Meta's interleaved
pairs: layoutlang/compiler/refine.py), so the conventions that store HF order must say so for a
Meta-order source to pair without edits.

Whatever the conventions say, the ops and bytes of every shipped pair are guarded
here against the numbers main planned before this work (tests/golden/pairs/ops.json):
the `layoutc new` conventions of every family at tests/test_layoutc_new.py's sizes,
and the example groups of tests/test_example_pairs.py. The full-size groups (Llama-3-8B,
DeepSeek-V3: about 80 s of planning on a 2-core machine) run with `python
tests/test_rotary_pairing.py`, which prints and checks every pair; pytest checks the rest
(a few seconds).

The conventions now write the halves (families.py `_rotary_rows`), so a Meta-order source
pairs with `layoutc new hf` / `new vllm` without edits: checked element by element below
against the permutation HF's converter applies (Meta row 2i + j of head h is HF row
h*D + j*D/2 + i), written out by hand, never read from the compiler. The pairs between
HF-order conventions keep their ops because pieces that continue in both storages are one
piece (layoutlang/compiler/pieces.py, tests/test_pieces_merge.py).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

import pytest

from layoutlang import compile_plan, load, loads
from layoutlang.bridges.families import CONVENTIONS, layout_text

sys.path.insert(0, str(Path(__file__).parent))
import test_example_pairs as pairs  # noqa: E402  (the groups of shipped examples)
import test_layoutc_new as new  # noqa: E402  (the families' configs and the sizes of their pairs)

GOLDEN = json.loads((Path(__file__).parent / "golden" / "pairs" / "ops.json").read_text())["pairs"]
FULL_SIZE = ("Llama-3-8B", "DeepSeek-V3")
EXAMPLES = Path(__file__).parent.parent / "examples"


@functools.cache
def convention_layout(family: str, convention: str):
    sizes = {k: v for k, v in new.SIZES[convention].items() if k in new._args(family, convention)}
    return loads(layout_text(new.CONFIGS[family], convention, sizes), f"{family}_{convention}")


def convention_pairs() -> list[str]:
    return [f"new:{f}:{a}->{b}" for f in new.CONFIGS for a, b in itertools.permutations(CONVENTIONS, 2)]


def example_pairs(full_size: bool) -> list[str]:
    return [f"ex:{a}->{b}" for model, names in pairs.FILES.items() if (model in FULL_SIZE) == full_size
            for a, b in itertools.permutations(names, 2)]


def planned(pair: str) -> dict[str, int]:
    kind, _, rest = pair.partition(":")
    if kind == "new":
        family, _, route = rest.partition(":")
        src, dst = (convention_layout(family, c) for c in route.split("->"))
    else:
        src, dst = (pairs.layout(name) for name in rest.split("->"))
    plan = compile_plan(src, dst)
    return {"ops": plan.stats["ops"], "bytes": plan.stats["bytes"]}


def test_the_golden_file_lists_every_shipped_pair():
    """A pair added later (a family, a convention, an example) gets its numbers recorded here."""
    assert set(GOLDEN) == set(convention_pairs() + example_pairs(False) + example_pairs(True))


@pytest.mark.timeout(120)
def test_every_convention_pair_keeps_its_ops_and_bytes():
    got = {pair: planned(pair) for pair in convention_pairs()}
    moved = {pair: (GOLDEN[pair], n) for pair, n in got.items() if n != GOLDEN[pair]}
    assert not moved, f"{len(moved)} pairs moved, first: {next(iter(moved.items()))}"


@pytest.mark.timeout(120)
def test_every_small_example_pair_keeps_its_ops_and_bytes():
    got = {pair: planned(pair) for pair in example_pairs(False)}
    moved = {pair: (GOLDEN[pair], n) for pair, n in got.items() if n != GOLDEN[pair]}
    assert not moved, f"{len(moved)} pairs moved, first: {next(iter(moved.items()))}"


def test_a_meta_order_source_pairs_only_with_rotary_parts():
    """The rule the conventions meet: the Meta file pairs with the HF file that writes the
    halves (the rows permuted, its golden ops). A plain `[NH*D, H]` q_proj (HF order by the
    key convention, but nothing says so) against Meta's interleaved pairs is refused at the
    plain declaration (layoutlang/compiler/refine.py: plain rows are refined only by runs of rows),
    naming the interleaved parts; tests/test_refine_parts.py checks the whole diagnostic."""
    meta = load(str(EXAMPLES / "small/v2/llama2_meta.layout"))
    hf = load(str(EXAMPLES / "small/v2/llama2_hf.layout"))
    assert compile_plan(meta, hf).stats["ops"] == GOLDEN["ex:small/v2/llama2_meta->small/v2/llama2_hf"]["ops"]
    plain = (EXAMPLES / "small/v2/llama2_hf.layout").read_text().replace("[(NH, (re: D/2 | im: D/2)), H]",
                                                                       "[NH*D, H]")
    assert plain.count("[NH*D, H]") == 3  # q, k (rewritten) and v
    from layoutlang.compiler import PlanError

    for src, dst in ((meta, loads(plain, "plain_hf")), (loads(plain, "plain_hf"), meta)):
        with pytest.raises(PlanError) as e:
            compile_plan(src, dst)
        assert "parts on one side only" in e.value.message and "`(8, (re: 1 | im: 1))`" in e.value.message
        assert e.value.file == "plain_hf" and "config.json" in e.value.help


# ---- a Meta-order source against the conventions, element by element --------------------------
# torchtitan's Llama3 (layoutlang/bridges/torchtitan_layout.py) stores wqkv per kv group g: its QG
# q heads, one k head, one v head, each q/k head's rows interleaved, Meta's order: row 2i + j of a
# head is pair i's re (j = 0) or im (j = 1) value. HF's checkpoint (convert_llama_weights_to_hf.py's
# permute) stores that row at h*D + j*D/2 + i. Written out here from those two facts alone.
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256}
Q, KV, D = 8, 2, 8
QG = Q // KV


def titan_row(part: str, head: int, r: int) -> int:
    """wqkv's storage row of `part`'s head `head` (a q head, or a kv head), HF row r of that head."""
    g, qh = (head // QG, head % QG) if part == "q" else (head, 0)
    base = g * (QG + 2) * D + {"q": qh * D, "k": QG * D, "v": (QG + 1) * D}[part]
    if part == "v":
        return base + r
    j, i = divmod(r, D // 2)  # HF row h*D + j*D/2 + i is Meta row 2i + j of the head
    return base + 2 * i + j


def fill(name: str, shape: tuple[int, ...]):
    """Element [r, c] of a stored tensor: 1000 * r + c plus the tensor's own offset (a code)."""
    import numpy as np

    code = sum(map(ord, name)) % 997
    grid = np.indices(shape)
    return (code * 10**6 + 1000 * grid[0] + (grid[1] if len(shape) > 1 else 0)).astype(np.int64)


def execute(plan, src, dst, wanted: str) -> dict:
    """Run the ops of keys containing `wanted` on numpy arrays: (rank, name) -> the destination's
    local tensor. Source tensors hold `fill`; a strided dim reads its blocks in order (strides.py);
    a relay reads the sender's destination tensor once the op it waits for has run."""
    import numpy as np

    from layoutlang.compiler import strides

    shapes = {t.name: t.local_shape for t in dst.tensors}
    src_shapes = {t.name: t.local_shape for t in src.tensors}
    out: dict = {}
    ops = [op for op in plan.ops if wanted in op.key]
    done: set[int] = set()

    def index(sl):
        return np.ix_(*[[x for lo, hi in strides.blocks(e) for x in range(lo, hi)] for e in sl])

    while len(done) < len(ops):
        for op in ops:
            if op.id in done or any(a not in done for a in op.after):
                continue
            assert op.transpose is None
            if op.after:
                block = out[op.src_rank, op.src_name][index(op.src_slice)]
            else:
                block = fill(op.src_name, src_shapes[op.src_name])[index(op.src_slice)]
            here = out.setdefault((op.dst_rank, op.dst_name), np.full(shapes[op.dst_name], -1, np.int64))
            here[index(op.dst_slice)] = block
            done.add(op.id)
    return out


def titan_value(layer: int, part: str, head: int, r: int, col: int) -> int:
    name = f"layers.{layer}.attention.qkv_linear.wqkv.weight"
    return fill(name, ((QG + 2) * D * KV, 64))[titan_row(part, head, r), col]


def convention(name: str, **sizes):
    from layoutlang.bridges.families import model_from_config, render

    return loads(render(model_from_config(LLAMA), name, sizes), name)


def test_a_meta_order_source_fills_layoutc_new_hf_as_hf_permutes():
    """torchtitan's Llama3 -> `layoutc new hf`, no edits: HF row h*D + j*D/2 + i of q_proj / k_proj
    is Meta row 2i + j of head h; v_proj rows are copied as they are."""
    titan, hf = convention("torchtitan", DP=1), convention("hf", DP=1)
    plan = compile_plan(titan, hf)
    got = execute(plan, titan, hf, "self_attn.")
    for layer in range(2):
        for part, heads in (("q", Q), ("k", KV), ("v", KV)):
            t = got[0, f"model.layers.{layer}.self_attn.{part}_proj.weight"]
            for h in range(heads):
                for r in range(D):
                    assert [int(x) for x in t[h * D + r]] == [titan_value(layer, part, h, r, c) for c in range(64)], \
                        (layer, part, h, r)


def test_a_meta_order_source_fills_layoutc_new_vllm_per_tp_rank():
    """torchtitan's Llama3 -> `layoutc new vllm` at TP2: rank t's qkv_proj holds its 4 q heads, its
    k head, its v head, each in HF's row order (h_local*D + j*D/2 + i)."""
    titan, vllm = convention("torchtitan", DP=1), convention("vllm", TP=2, DP=1)
    plan = compile_plan(titan, vllm)
    got = execute(plan, titan, vllm, "self_attn.")
    for layer in range(2):
        for t in range(2):
            local = got[t, f"model.layers.{layer}.self_attn.qkv_proj.weight"]
            rows = [("q", t * Q // 2 + h, r) for h in range(Q // 2) for r in range(D)]
            rows += [("k", t, r) for r in range(D)] + [("v", t, r) for r in range(D)]
            for k, (part, head, r) in enumerate(rows):
                assert [int(x) for x in local[k]] == [titan_value(layer, part, head, r, c) for c in range(64)], \
                    (layer, t, part, head, r)


def test_hf_back_into_a_meta_order_layout_is_the_inverse_permutation():
    """`layoutc new hf` -> torchtitan's Llama3: wqkv row titan_row(part, h, r) holds HF row h*D + r."""
    hf, titan = convention("hf", DP=1), convention("torchtitan", DP=1)
    got = execute(compile_plan(hf, titan), hf, titan, "self_attn.")
    for layer in range(2):
        wqkv = got[0, f"layers.{layer}.attention.qkv_linear.wqkv.weight"]
        for part, heads in (("q", Q), ("k", KV), ("v", KV)):
            src = fill(f"model.layers.{layer}.self_attn.{part}_proj.weight", (heads * D, 64))
            for h in range(heads):
                for r in range(D):
                    assert (wqkv[titan_row(part, h, r)] == src[h * D + r]).all(), (layer, part, h, r)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_layoutc_new_torchtitan_pairs_with_every_convention(family, tmp_path, capsys):
    """`layoutc new torchtitan` (Llama3 in Meta's order, Qwen3 in HF's): its output plans into and
    from each convention's output of the same config, no edits, every element written once."""
    from layoutlang.cli import main
    from plan_simulator import RunsView, check_stats, simulate

    config = tmp_path / "config.json"
    config.write_text(json.dumps(new.CONFIGS[family]))
    assert main(["new", "torchtitan", "--config", str(config), "--set", "DP=2", "-o", str(tmp_path / "t.layout")]) == 0
    capsys.readouterr()
    titan = load(str(tmp_path / "t.layout"))
    for name in CONVENTIONS:
        other = convention_layout(family, name)
        for src, dst in ((titan, other), (other, titan)):
            plan = compile_plan(src, dst)
            check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))


LLAMA2_13B = {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
              "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000}


@pytest.mark.timeout(120)
def test_meta_llama2_13b_pairs_with_layoutc_new_without_edits():
    """examples/v2/llama2_13b_meta.layout (Meta's MP2 checkpoint) against `layoutc new hf` of the
    same config: the plan of the hand-written HF example, op for op (its file says the same thing:
    one rank, every weight whole, q/k rows in HF's halves); and against `layoutc new vllm` it plans."""
    meta = load(str(EXAMPLES / "v2/llama2_13b_meta.layout"))
    hf = loads(layout_text(LLAMA2_13B, "hf", {"DP": 1}), "llama2_13b_new_hf")
    want = GOLDEN["ex:v2/llama2_13b_meta->v2/llama2_13b_hf"]
    assert {k: compile_plan(meta, hf).stats[k] for k in ("ops", "bytes")} == want
    vllm = loads(layout_text(LLAMA2_13B, "vllm", {"TP": 2}), "llama2_13b_new_vllm")
    assert compile_plan(meta, vllm).stats["ops"] > 0


if __name__ == "__main__":  # every pair, full-size ones included: print and check
    bad = 0
    for pair in convention_pairs() + example_pairs(False) + example_pairs(True):
        n, want = planned(pair), GOLDEN[pair]
        bad += n != want
        print(f"{'ok  ' if n == want else 'MOVED'} {pair}: {n['ops']} ops {n['bytes']} bytes"
              + ("" if n == want else f" (was {want['ops']} ops {want['bytes']} bytes)"))
    sys.exit(1 if bad else 0)
