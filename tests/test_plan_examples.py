"""The shipped Llama-3-8B pairs, planned: balance, op counts worked out by hand, execution.

Why: examples/llama3_8b_train.layout (TP8 x GTP2 x DP4, 64 ranks) ->
examples/llama3_8b_infer.layout (TP2 x DP2, MXFP8, collocated on ranks 0-3)
and -> examples/llama3_8b_infer_offset.layout (the same on ranks 64-67) are
the refit DESIGN.md is about. Here:

- the real-size plans: busiest sender within 5 % of the floor, round-robin
  (Megatron's rule) worse than balanced, total bytes equal to what every
  destination rank must receive, and op counts derived by hand below;
- SMALL copies of the same files (the `const` statement rewritten, every other
  line as shipped, so they track the examples) executed element by element
  by tests/plan_simulator.py, with maps from `t.runs(rank)` (hand-written
  layouts have no reference spec);
- ops identical across interpreter runs with different hash seeds;
- the simulator itself rejects broken plans (a dropped, duplicated or shifted
  op, wrong bytes, a slice into padding, a rank that lacks the tensor).

Keys follow the HF-key convention (LANGUAGE.md 8): the trainer's fused
linear_qkv and linear_fc1 and the engine's qkv_proj and gate_up_proj carry part
keys (q_proj | k_proj | v_proj, gate_proj | up_proj), and one op never mixes
two keys, so the counts below are per HF key.

Op counts for the real pair (per layer, 4 destination ranks = dp 2 x tp 2):
    norms [H], replicated everywhere -> [H]          1 op per rank      4 each
    down_proj = linear_fc2 [H chunk gtp, F over tp] -> [H, F over tp]:
        a TP2 rank's F/2 columns are 4 source TP slices, its H rows 2 GTP
        chunks: 4 x 2 source shards, none mergeable   8 per rank       32
    o_proj = linear_proj [H chunk gtp, Q*D over tp]: the same           32
    linear_fc1 [(gate: F | up: F) over tp chunk gtp, H]: a source TP
        slice is (F/8 gate | F/8 up), chunk 0 = gate, chunk 1 = up; a
        TP2 rank needs 4 gate + 4 up pieces:
        gate_proj                                     4 per rank       16
        up_proj                                       4 per rank       16
    linear_qkv [(KV, (q: 512 | k: 128 | v: 128)) over tp chunk gtp
        align 16, H], KV = TP = 8: a source TP slice is one group (768
        rows, no align padding), chunk 0 = q[0:384], chunk 1 = q[384:512]
        | k | v; a TP2 rank needs 4 groups, each 2 q pieces (one per
        chunk, on two ranks), 1 k piece and 1 v piece:
        q_proj                                        8 per rank       32
        k_proj, v_proj                                4 per rank       16 each
                                                       per layer       168
    embed_tokens / lm_head [V pad 128*TP over tp, H] -> [V pad 64 over tp, H]:
        source TP slices of 16128 rows (the last 15360 data); TP2 halves
        of 64128 rows: rank 0 <- slices 0-3, rank 1 <- slices 3-7,
        9 pieces per dp replica, x 2                                   18 each
    final norm                                                          4
    total 32 x 168 + 2 x 18 + 4 = 5416
(With Megatron names as keys, as before the convention, linear_qkv was one key
of 64 ops and linear_fc1 one of 32: the same pieces, the same 5416 ops; the
per-key split changes no op, since no piece ever straddled a part boundary.)
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import layoutlang
from layoutlang.compiler import compile_plan
from plan_simulator import RunsView, check_plan_views, check_stats, simulate
from wire_rule import op_wire, slice_elements

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TRAIN = EXAMPLES / "llama3_8b_train.layout"
INFER = EXAMPLES / "llama3_8b_infer.layout"
OFFSET = EXAMPLES / "llama3_8b_infer_offset.layout"
DESTINATIONS = {"collocated": INFER, "offset": OFFSET}

# Small sizes with the same divisibility (MXFP8 local last dims stay multiples
# of 32: H = 32, Q*D/2 = 64, F/2 = 32; V = 1000 leaves padding on both sides).
SMALL = {"L": 2, "H": 32, "F": 64, "Q": 32, "KV": 8, "D": 4, "V": 1000}
REAL = {"L": 32, "H": 4096, "F": 14336, "Q": 32, "KV": 8, "D": 128, "V": 128_256}


def small_text(path: Path, consts: dict[str, int] = SMALL) -> str:
    """The shipped file with its `const` values replaced (every other line as shipped)."""
    text = path.read_text()
    for name, value in consts.items():
        text, n = re.subn(rf"(\bconst\b[^\n]*?\b{name}\s*=\s*)[0-9_]+", rf"\g<1>{value}", text)
        assert n == 1, f"{path.name}: expected one `const ... {name} = N`, found {n}"
    return text


def small_copy(path: Path, args: dict[str, int] | None = None) -> layoutlang.Layout:
    return layoutlang.loads(small_text(path), str(path), args)


@pytest.fixture(scope="module")
def real_plans():
    """{"collocated" | "offset": (balanced plan, round-robin plan)} at real size."""
    out = {}
    for name, dst in DESTINATIONS.items():
        out[name] = (compile_plan(TRAIN, dst), compile_plan(TRAIN, dst, selector="round_robin"))
    return out


def test_examples_use_the_sizes_assumed_here():
    """The hand-derived counts below assume the shipped constants and args."""
    for path in (TRAIN, INFER, OFFSET):
        layout = layoutlang.load(path)
        emb = next(t for t in layout.tensors if t.key == "model.embed_tokens.weight")
        assert emb.logical_shape == (REAL["V"], REAL["H"]), path.name
        # the HF checkpoint's keys: embed, lm_head, final norm + per layer 2 norms, q, k, v, o,
        # gate, up, down
        keys = set(layout.key_index)
        assert len(keys) == 3 + 9 * REAL["L"], path.name
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= keys
        assert {k for k in keys if k.startswith("model.layers.7.")} == {
            f"model.layers.7.{s}.weight" for s in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                                   "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert dict(layoutlang.load(TRAIN).args) == {"TP": 8, "GTP": 2, "DP": 4}
    assert layoutlang.load(TRAIN).ranks == 64
    assert [(a.name, a.size) for a in layoutlang.load(INFER).meshes[0].axes] == [("dp", 2), ("tp", 2)]
    assert (layoutlang.load(INFER).meshes[0].offset, layoutlang.load(OFFSET).meshes[0].offset) == (0, 64)


# ---------------------------------------------------------------------------
# Real size


def _expected_elements(dst: layoutlang.Layout) -> dict[int, int]:
    """Per destination rank: its logical (non-padding) elements."""
    out: dict[int, int] = {}
    for t in dst.tensors:
        for rank in t.ranks():
            data = math.prod(sum(r.length for r in runs if isinstance(r, layoutlang.Run))
                             for runs in t.runs(rank))
            out[rank] = out.get(rank, 0) + data
    return out


@pytest.mark.parametrize("name", DESTINATIONS)
def test_real_pair_is_balanced_and_complete(real_plans, name):
    plan, _ = real_plans[name]
    stats = plan.stats
    assert stats["send_balance"] <= 1.05, stats
    assert not plan.unused_keys
    check_stats(plan)
    check_plan_views(plan, range(plan.world))
    # every destination rank receives exactly its logical bytes
    got: dict[int, int] = {}
    dst = {t.name: t for t in plan.dst.tensors}
    for op in plan.ops:  # each op's bytes by the wire rule (tests/wire_rule.py)
        got[op.dst_rank] = got.get(op.dst_rank, 0) + slice_elements(op.dst_slice)
        t = dst[op.dst_name]
        assert (op.wire is not None, op.bytes) == op_wire(op.dst_slice, t.dtype, tuple(t.local_shape_at(op.dst_rank)))
    assert got == _expected_elements(plan.dst)
    assert stats["bytes"] == sum(op.bytes for op in plan.ops)
    assert {op.src_rank for op in plan.ops} <= set(range(64))
    if name == "offset":
        assert stats["local_bytes"] == 0 and {op.dst_rank for op in plan.ops} == {64, 65, 66, 67}
    else:
        assert stats["local_bytes"] > 0 and {op.dst_rank for op in plan.ops} == {0, 1, 2, 3}


@pytest.mark.parametrize("name", DESTINATIONS)
def test_round_robin_is_worse_than_balanced(real_plans, name):
    balanced, rr = real_plans[name]
    assert rr.stats["max_send_bytes"] > balanced.stats["max_send_bytes"]
    assert rr.stats["send_balance"] > balanced.stats["send_balance"]
    # the same transfers, only other senders
    strip = lambda plan: [(o.key, o.dst_rank, o.dst_slice, o.bytes) for o in plan.ops]
    assert strip(rr) == strip(balanced)
    check_stats(rr)


def _ops(plan, key: str):
    return [op for op in plan.ops if op.key == key]


@pytest.mark.parametrize("name", DESTINATIONS)
def test_real_op_counts(real_plans, name):
    plan, _ = real_plans[name]
    per_layer = {"input_layernorm.weight": 4, "post_attention_layernorm.weight": 4,
                 "self_attn.q_proj.weight": 32, "self_attn.k_proj.weight": 16, "self_attn.v_proj.weight": 16,
                 "self_attn.o_proj.weight": 32,
                 "mlp.gate_proj.weight": 16, "mlp.up_proj.weight": 16, "mlp.down_proj.weight": 32}
    assert sum(per_layer.values()) == 168
    for l in (0, 17, 31):
        for suffix, n in per_layer.items():
            assert len(_ops(plan, f"model.layers.{l}.{suffix}")) == n, (l, suffix)
    # a fused tensor's ops name it whole on both sides, each carrying one of its part keys
    qkv = [op for op in plan.ops if op.dst_name == "model.layers.3.self_attn.qkv_proj.weight"]
    assert len(qkv) == 64 and {op.src_name for op in qkv} == {"decoder.layers.3.self_attention.linear_qkv.weight"}
    assert len(_ops(plan, "model.embed_tokens.weight")) == 18
    assert len(_ops(plan, "lm_head.weight")) == 18
    assert len(plan.ops) == 32 * 168 + 2 * 18 + 4 == 5416


@pytest.mark.parametrize("name", DESTINATIONS)
@pytest.mark.parametrize("key", ["model.norm.weight", "model.layers.5.input_layernorm.weight"])
def test_replicated_norm_is_one_op_per_destination_rank(real_plans, name, key):
    plan, _ = real_plans[name]
    ops = _ops(plan, key)
    H = REAL["H"]
    assert sorted(op.dst_rank for op in ops) == sorted(set(op.dst_rank for op in ops))
    assert len(ops) == 4
    for op in ops:
        assert op.src_slice == op.dst_slice == ((0, H),)
        assert op.bytes == H * 2
        if name == "collocated":
            assert op.src_rank == op.dst_rank, "a collocated replica is a local copy"


@pytest.mark.parametrize("name", DESTINATIONS)
@pytest.mark.parametrize("weight, cols", [("mlp.down_proj.weight", REAL["F"]),
                                          ("self_attn.o_proj.weight", REAL["Q"] * REAL["D"])])
def test_gtp_tp8_to_tp2_plain_weight(real_plans, name, weight, cols):
    """[H chunk gtp, C over tp] (TP8 x GTP2) -> [H, C over tp] (TP2): 8 whole source shards per rank."""
    plan, _ = real_plans[name]
    H, offset = REAL["H"], 0 if name == "collocated" else 64
    ops = _ops(plan, f"model.layers.3.{weight}")
    assert len(ops) == 32
    rows, width = H // 2, cols // 8
    for dst_rank in range(offset, offset + 4):
        mine = sorted((op for op in ops if op.dst_rank == dst_rank), key=lambda o: o.dst_slice)
        tp2 = (dst_rank - offset) % 2
        grid = [((g * rows, (g + 1) * rows), (k * width, (k + 1) * width)) for g in range(2) for k in range(4)]
        assert [op.dst_slice for op in mine] == sorted(grid)
        for op in mine:
            (r0, _), (c0, _) = op.dst_slice
            gtp, tp8 = r0 // rows, 4 * tp2 + c0 // width
            assert op.src_slice == ((0, rows), (0, width)), "each source shard is sent whole"
            assert op.src_rank % 16 == gtp * 8 + tp8, f"rank {op.src_rank} holds another shard"
            # MXFP8 destination, whole 32-element blocks: e4m3 data and one E8M0 scale per 32 travel
            assert op.wire == "mxfp8" and op.bytes == rows * width + rows * (width // 32)


@pytest.mark.parametrize("path", [p for p in sorted(EXAMPLES.glob("*.layout"))
                                  if not p.name.startswith("deepseek")],  # deepseek: ~10 s each
                         ids=lambda p: p.name)
def test_example_planned_onto_itself_is_all_local(path):
    """Every rank already holds what it needs: no network byte, every data byte once."""
    plan = compile_plan(path, path)
    assert plan.stats["network_bytes"] == 0
    assert all(op.src_rank == op.dst_rank for op in plan.ops)
    got: dict[int, int] = {}
    for op in plan.ops:
        got[op.dst_rank] = got.get(op.dst_rank, 0) + slice_elements(op.dst_slice)
    assert got == _expected_elements(plan.dst)


# ---------------------------------------------------------------------------
# Small copies, executed element by element


@pytest.fixture(scope="module")
def small_train():
    return small_copy(TRAIN)


@pytest.mark.parametrize("selector", ["balanced", "round_robin"])
@pytest.mark.parametrize("name", DESTINATIONS)
def test_small_copy_executes_exactly_once(small_train, name, selector):
    dst = small_copy(DESTINATIONS[name])
    plan = compile_plan(small_train, dst, selector=selector)
    report = simulate(RunsView(small_train), RunsView(dst), plan)
    assert report.dst_pad_elements > 0 and report.src_pad_elements > 0, "the small copy keeps padding"
    assert report.elements == report.dst_data_elements
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
    # the small copy keeps the hand-derived structure of the plain GTP weight
    assert report.ops_per_key["model.layers.1.mlp.down_proj.weight"] == 32
    assert report.ops_per_key["model.norm.weight"] == 4


def test_small_copy_with_other_args():
    """TP4 x GTP2 x DP2 -> TP2 x DP1 on ranks 16-17 (args on both sides), node-aware senders."""
    src = small_copy(TRAIN, {"TP": 4, "DP": 2})
    dst = small_copy(INFER, {"AT": 16, "DP": 1})
    assert (src.ranks, dst.ranks) == (16, 18)
    plan = compile_plan(src, dst, ranks_per_node=4)
    report = simulate(RunsView(src), RunsView(dst), plan)
    check_stats(plan, report)
    assert report.local_bytes == 0


TP16 = EXAMPLES / "llama3_8b_infer_tp16.layout"
# TP16 with 8 KV heads: MXFP8 local last dims Q*D/16 and F/16 must stay multiples of 32.
SMALL_TP16 = {**SMALL, "D": 16, "F": 512}


@pytest.mark.skipif(not TP16.exists(), reason="no llama3_8b_infer_tp16.layout")
def test_small_copy_to_tp16_with_kv_replication():
    """GQA destination with TP > KV heads: each k/v head lands whole on 2 ranks, exactly once each."""
    src = layoutlang.loads(small_text(TRAIN, SMALL_TP16), str(TRAIN))
    dst = layoutlang.loads(small_text(TP16, SMALL_TP16), str(TP16))
    plan = compile_plan(src, dst)
    report = simulate(RunsView(src), RunsView(dst), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))


DEEPSEEK_TRAIN = EXAMPLES / "deepseek_v3_moe.layout"
DEEPSEEK_INFER = EXAMPLES / "deepseek_v3_infer.layout"
# MXFP8 local last dims stay multiples of 32 (H, Q_LORA, KV_LORA, NH*V_HEAD/TP, F/TP).
SMALL_DEEPSEEK = {"H": 32, "V": 1000, "NH": 4, "Q_LORA": 32, "KV_LORA": 32, "QK_NOPE": 4, "QK_ROPE": 2,
                  "V_HEAD": 16, "DENSE_F": 64, "MOE_F": 64, "SHARED_F": 64}


@pytest.mark.skipif(not DEEPSEEK_INFER.exists(), reason="no deepseek_v3_infer.layout")
@pytest.mark.parametrize("selector", ["balanced", "round_robin"])
@pytest.mark.parametrize("at", [0, 32])
def test_small_deepseek_pair_executes_exactly_once(at, selector):
    """Two meshes (dense and expert views), PP loops with `sizes` (one block empty), nested
    expert loops over ep with `{e.local}` names, PP8 x DP2 x TP2 / EP2 x ETP2 -> TP2 / EP4."""
    src = layoutlang.loads(small_text(DEEPSEEK_TRAIN, SMALL_DEEPSEEK), str(DEEPSEEK_TRAIN),
                           {"L": 10, "E": 8, "TP": 2, "DP": 2, "EP": 2, "ETP": 2})
    dst = layoutlang.loads(small_text(DEEPSEEK_INFER, SMALL_DEEPSEEK), str(DEEPSEEK_INFER),
                           {"L": 10, "E": 8, "ENGINE_TP": 2, "ENGINE_DP": 2, "ENGINE_EP": 4,
                            "ENGINE_ETP": 1, "AT": at})
    assert (src.ranks, dst.ranks) == (32, at + 4)
    plan = compile_plan(src, dst, selector=selector)
    report = simulate(RunsView(src), RunsView(dst), plan)
    check_stats(plan, report)
    check_plan_views(plan, range(plan.world))
    assert not plan.unused_keys


# ---------------------------------------------------------------------------
# Determinism across interpreters


_DIGEST = """
import hashlib, sys
from layoutlang.compiler import compile_plan
h = hashlib.sha256()
for dst in sys.argv[2:]:
    plan = compile_plan(sys.argv[1], dst)
    h.update(repr(plan.ops).encode())
    h.update(repr(sorted(plan.stats.items())).encode())
print(h.hexdigest())
"""


def test_ops_do_not_depend_on_the_hash_seed():
    digests = set()
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", _DIGEST, str(TRAIN), str(INFER), str(OFFSET)],
                             capture_output=True, text=True, check=True, cwd=ROOT,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        digests.add(out.stdout.strip())
    assert len(digests) == 1


# ---------------------------------------------------------------------------
# The simulator rejects broken plans


def _fake(ops) -> types.SimpleNamespace:
    return types.SimpleNamespace(ops=tuple(dataclasses.replace(op, id=i) for i, op in enumerate(ops)))


@pytest.fixture(scope="module")
def small_pair(small_train):
    dst = small_copy(INFER)
    return RunsView(small_train), RunsView(dst), compile_plan(small_train, dst)


def _fails(src, dst, ops, needle: str) -> None:
    with pytest.raises(AssertionError, match=needle):
        simulate(src, dst, _fake(ops))


def test_simulator_rejects_broken_plans(small_pair):
    src, dst, plan = small_pair
    ops = list(plan.ops)
    simulate(src, dst, _fake(ops))
    _fails(src, dst, ops[1:], "never written")
    _fails(src, dst, ops + [ops[7]], "more than once")
    _fails(src, dst, [dataclasses.replace(ops[0], bytes=ops[0].bytes + 1)] + ops[1:], "bytes")
    _fails(src, dst, [dataclasses.replace(ops[0], src_rank=dst.layout.ranks + 70)] + ops[1:],
           "holds no tensor")
    # a shifted source slice copies the wrong elements
    i, op = next((i, o) for i, o in enumerate(ops) if o.src_slice[0][0] > 0)
    (a, b), *rest = op.src_slice
    shifted = dataclasses.replace(op, src_slice=((a - 1, b - 1), *rest))
    _fails(src, dst, ops[:i] + [shifted] + ops[i + 1:], "wrong value")
    # a slice reaching into padding on both sides: the vocabulary tail
    key = "model.embed_tokens.weight"
    i, op = next((i, o) for i, o in enumerate(ops) if o.key == key and o.dst_slice[0][1] == 488)
    (sa, sb), scols = op.src_slice
    (da, db), dcols = op.dst_slice
    assert sb == 104, "the source slice ends where tp 7's 104 data rows end"
    grown = dataclasses.replace(op, src_slice=((sa, sb + 24), scols), dst_slice=((da, db + 24), dcols))
    _fails(src, dst, ops[:i] + [grown] + ops[i + 1:], "covers padding")
    _fails(src, dst, ops[:i] + [grown] + ops[i + 1:], "padding element written")
    _fails(src, dst, [dataclasses.replace(ops[0], dst_slice=((0, 10**6),) * len(ops[0].dst_slice))] + ops[1:],
           "outside local shape")
