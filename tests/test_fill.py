"""layoutlang/runtime/fill.py: the fill values and the destination check that every refit test relies on.

Why: the refit tests (tests/test_runtime*.py, `layoutc run`, benchmarks) trust
`check_destination` to notice a misplaced block; it can only notice what the
fill values make visible. Here: the values are exact in every plain dtype and
have no period (a block shifted by any number of rows differs), the check
rejects shifted, swapped and single wrong elements, and for quantized
SOURCES the expected values come from the layouts (each source shard's own
quantization, computed here with tests/reference_quant.py, which never calls
the runtime), not from a plan: the check gets only the source layout.
"""

from __future__ import annotations

import types

import pytest
import torch

import layoutlang
import reference_quant as ref
from layoutlang.runtime.fill import check_destination, empty_destination, expected_destination, source_tensor, values
from layoutlang.runtime.quant import MXFP8Tensor, quantize


def _layout(text: str) -> layoutlang.Layout:
    return layoutlang.loads(text, "<test>")


def _only_src(src: layoutlang.Layout):
    """What the check may see of a plan: its source layout, no ops."""
    return types.SimpleNamespace(src=src)


def _grid(key: str, shape: tuple[int, int]) -> torch.Tensor:
    """The fill of a 2-d key, from its definition: value of the row-major flat index."""
    return values(key, torch.arange(shape[0] * shape[1])).reshape(shape)


# ---------------------------------------------------------------------------
# The values


def test_values_are_exact_nonzero_and_spread():
    flat = torch.cat([torch.arange(1 << 16), torch.arange(1 << 33, (1 << 33) + 4096)])
    for key in ("w", "decoder.layers.0.mlp.linear_fc1.weight"):
        v = values(key, flat)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert torch.equal(v.to(dtype).to(torch.float32), v), dtype
        assert bool((v.abs() >= 16).all()) and bool((v.abs() < 256).all())
        assert len(set(v[:1 << 16].tolist())) == 1024  # every one of the 1024 values is used
        # neighbours are independent: about 1/1024 of adjacent pairs coincide, not all of them
        assert int((v[1:1 << 16] == v[:(1 << 16) - 1]).sum()) < 200
    assert not torch.equal(values("a", flat), values("b", flat))


def test_no_row_shift_leaves_a_row_unchanged():
    """The old fill repeated every 251 elements; now no shift of whole rows maps any row onto another."""
    v = _grid("embedding.weight", (1000, 64))
    for k in range(1, 1000):
        assert not bool((v[:-k] == v[k:]).all(dim=1).any()), f"a row equals the row {k} below it"
    # not even half-rows of 32 (an MXFP8 block), over any flat shift up to 4 rows
    flat = v.reshape(-1)
    for s in range(1, 4 * 64):
        assert not bool((flat[:-s] == flat[s:]).reshape(-1)[: (flat.numel() - s) // 32 * 32]
                        .reshape(-1, 32).all(dim=1).any()), s


# ---------------------------------------------------------------------------
# The check, plain destination

PLAIN_SRC = "mesh s (tp=2)\ntensor w [512 over tp, 64]\n"
PLAIN_DST = "mesh d (tp=1) at 2\ntensor w [512, 64]\n"


def test_check_accepts_the_fill_and_rejects_misplaced_blocks():
    src, dst = _layout(PLAIN_SRC), _layout(PLAIN_DST)
    t = dst.tensors[0]
    good = _grid("w", (512, 64))
    assert check_destination(t, 2, good.clone(), _only_src(src)) is None
    assert check_destination(t, 2, good.clone()) is None
    shifted = good.clone()
    shifted[0:100] = good[251:351]  # the shift the old period-251 fill could not see
    assert "element [0, " in check_destination(t, 2, shifted, _only_src(src))
    swapped = good.clone()
    swapped[10:12], swapped[300:302] = good[300:302], good[10:12]
    assert check_destination(t, 2, swapped, _only_src(src)) is not None
    transposed = good.clone()
    transposed[:64] = good[:64].T
    assert check_destination(t, 2, transposed, _only_src(src)) is not None
    one = good.clone()
    one[77, 5] = good[77, 6]
    assert "element [77, 5]" in check_destination(t, 2, one, _only_src(src))
    assert check_destination(t, 2, empty_destination(t), _only_src(src)) is not None  # never written


def test_source_padding_is_nan_and_destination_padding_must_be_zero():
    src = _layout("mesh s (tp=2)\ntensor w [5 pad 2 over tp, 32]\n")
    s = src.tensors[0]
    assert bool(torch.isnan(source_tensor(s, 1)[-1]).all()) and not torch.isnan(source_tensor(s, 1)[:-1]).any()
    dst = _layout("mesh d (tp=1) at 2\ntensor w [5 pad 8, 32]\n")
    t = dst.tensors[0]
    good = torch.cat([_grid("w", (5, 32)), torch.zeros(3, 32)])
    assert check_destination(t, 2, good, _only_src(src)) is None
    bad = good.clone()
    bad[6, 0] = 1.0
    assert check_destination(t, 2, bad, _only_src(src)) is not None


# ---------------------------------------------------------------------------
# Quantized sources: expected values from the layouts, computed with the reference


def test_fp8_source_expected_from_each_shards_own_scale():
    """[64 over tp, 32] fp8_e4m3 on tp=2 (dp=2 replicas): rows 0-31 carry rank 0's scale, 32-63 rank 1's."""
    src = _layout("mesh s (dp=2, tp=2)\ntensor w [64 over tp, 32] fp8_e4m3\n")
    dst = _layout("mesh d (tp=1) at 4\ntensor w [64, 32] fp32\n")
    t = dst.tensors[0]
    grid = _grid("w", (64, 32))
    want = []
    for half in (grid[:32], grid[32:]):
        r = ref.quantize_fp8(half.reshape(-1).tolist(), "fp8_e4m3")
        want += r.values
    want = torch.tensor(want).reshape(64, 32)
    assert not torch.equal(want, grid), "fp8 changes some values"
    got = expected_destination(t, 4, _only_src(src))
    assert torch.equal(got.values, want) and got.choices == ()
    assert check_destination(t, 4, want.clone(), _only_src(src)) is None
    assert check_destination(t, 4, grid.clone(), _only_src(src)) is not None  # unquantized is wrong
    swapped = torch.cat([want[32:], want[:32]])
    assert check_destination(t, 4, swapped, _only_src(src)) is not None


def test_mxfp8_source_to_mxfp8_destination():
    """[64, 64 over tp] mxfp8 -> [64 over tp, 64] mxfp8: each source shard's 32-wide blocks, then the
    destination quantizes its assembled rows once."""
    src = _layout("mesh s (tp=2)\ntensor b [64, 64 over tp] mxfp8\n")
    dst = _layout("mesh d (tp=2) at 2\ntensor b [64 over tp, 64] mxfp8\n")
    grid = _grid("b", (64, 64))
    # a source shard on tp c holds columns [32c, 32c + 32): exactly one MXFP8 block per row
    sent = torch.cat([torch.tensor(ref.quantize_mxfp8(grid[:, 32 * c:32 * c + 32].tolist()).values)
                      for c in (0, 1)], dim=1)
    for rank, rows in ((2, slice(0, 32)), (3, slice(32, 64))):
        t = next(x for x in dst.tensors if x.holds(rank))
        assert torch.equal(expected_destination(t, rank, _only_src(src)).values.to(torch.float32), sent[rows])
        mine = ref.quantize_mxfp8(sent[rows].tolist())
        value = MXFP8Tensor(torch.tensor(mine.codes, dtype=torch.uint8).view(torch.float8_e4m3fn),
                            torch.tensor(mine.scales, dtype=torch.uint8))
        assert check_destination(t, rank, value, _only_src(src)) is None
        wrong = MXFP8Tensor(value.data.clone(), value.scales.clone())
        wrong.data[0, :32] = value.data[1, :32]
        assert "quantized data differs at [0, " in check_destination(t, rank, wrong, _only_src(src))


OVERLAP_SRC = "mesh s (tp=4)\ntensor w [(q: (4, 2) | k: (2, 2)) over tp, 32] {dtype}\n"
OVERLAP_DST = "mesh d (tp=1) at 4\ntensor w [(q: (4, 2) | k: (2, 2)), 32] {dtype}\n"


def _overlap_sent():
    """Per source rank of OVERLAP_SRC (fp8_e4m3): (logical rows, its values after its own scale).

    tp c holds q head c (logical rows 2c, 2c+1) and k head c // 2 (rows 8 + 2(c // 2), +1),
    the k head whole on two ranks (LANGUAGE.md 3: s > N replicates copies)."""
    grid = _grid("w", (12, 32))
    out = {}
    for c in range(4):
        rows = [2 * c, 2 * c + 1, 8 + 2 * (c // 2), 9 + 2 * (c // 2)]
        r = ref.quantize_fp8(grid[rows].reshape(-1).tolist(), "fp8_e4m3")
        out[c] = (rows, torch.tensor(r.values).reshape(4, 32))
    return out


def test_overlapping_quantized_shards_accept_any_holder():
    """k head 0 lives on tp 0 and tp 1 with different per-tensor scales: either sender is right,
    a value from neither is wrong; the plan's choice is not consulted (it is not even given)."""
    src = _layout(OVERLAP_SRC.format(dtype="fp8_e4m3"))
    dst = _layout(OVERLAP_DST.format(dtype="bf16"))
    t = dst.tensors[0]
    sent = _overlap_sent()
    assert not torch.equal(sent[0][1][2:], sent[1][1][2:]), "the two holders disagree"
    assert not torch.equal(sent[2][1][2:], sent[3][1][2:]), "the two holders disagree"
    base = torch.zeros(12, 32)
    for c in (0, 2, 1, 3):  # k heads from tp 1 and tp 3
        rows, v = sent[c]
        base[rows] = v
    exp = expected_destination(t, 4, _only_src(src))
    assert len(exp.choices) == 4
    assert check_destination(t, 4, base.to(torch.bfloat16), _only_src(src)) is None
    other = base.clone()
    other[8:10] = sent[0][1][2:]  # k head 0 from tp 0 instead: also right
    other[10] = sent[2][1][2]  # half of k head 1 from tp 2: also right, element by element
    assert check_destination(t, 4, other.to(torch.bfloat16), _only_src(src)) is None
    wrong = base.clone()
    wrong[8] = sent[0][1][3]  # a row of k head 0 from the wrong row
    assert "element [8, " in check_destination(t, 4, wrong.to(torch.bfloat16), _only_src(src))


def test_overlapping_quantized_shards_into_a_quantized_destination():
    src = _layout(OVERLAP_SRC.format(dtype="fp8_e4m3"))
    dst = _layout(OVERLAP_DST.format(dtype="mxfp8"))
    t = dst.tensors[0]
    sent = _overlap_sent()
    for pick in ((0, 2, 1, 3), (1, 3, 0, 2)):
        assembled = torch.zeros(12, 32)
        for c in pick:
            rows, v = sent[c]
            assembled[rows] = v
        value = quantize(assembled.to(torch.bfloat16), "mxfp8")
        assert check_destination(t, 4, value, _only_src(src)) is None, pick
    wrong = quantize(torch.flip(assembled, [0]).to(torch.bfloat16), "mxfp8")
    assert check_destination(t, 4, wrong, _only_src(src)) is not None


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "mxfp8"])
def test_quantized_source_every_source_rank_consistent(dtype):
    """A source layout without overlap gives one value per element whatever the source dtype."""
    src = _layout(f"mesh s (tp=2)\ntensor w [64 over tp, 64] {dtype}\n")
    dst = _layout("mesh d (tp=2)\ntensor w [64, 64 over tp] bf16\n")
    for rank in (0, 1):
        exp = expected_destination(dst.tensors[0], rank, _only_src(src))
        assert exp.choices == () and not torch.isnan(exp.values.float()).any()


# ---------------------------------------------------------------------------
# Quantized v2 sources (LANGUAGE.md 8): keys inside stored tensors. The source shard's
# storage is built here by hand from the rule of each form (where each key element lies),
# quantized with the reference as STORED, and read back per key.


def _mx(rows: torch.Tensor) -> torch.Tensor:
    """Dequantized MXFP8 of a 2-d tensor, blocks of 32 along its last dim (tests/reference_quant.py)."""
    return torch.tensor(ref.quantize_mxfp8(rows.tolist()).values)


def _mx_value(x: torch.Tensor) -> MXFP8Tensor:
    """`x` quantized by the reference, as a caller would pass an MXFP8 tensor (any rank >= 1)."""
    r = ref.quantize_mxfp8(x.reshape(-1, x.shape[-1]).tolist())
    return MXFP8Tensor(torch.tensor(r.codes, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(x.shape),
                       torch.tensor(r.scales, dtype=torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 32))


def test_transposed_mxfp8_source_blocks_run_along_the_keys_first_dim():
    """Conv1D-style `c105 [64 over tp, 32] mxfp8 transposed` holds key c105 [32, 64] as [in, out]:
    its MXFP8 blocks are 32 consecutive STORED elements (LANGUAGE.md 8.3), i.e. a whole key
    COLUMN, not 32 elements of a key row. The key name is one whose column 55 is a block
    below 128 (smaller scale): the two readings then differ, so the test can tell them apart."""
    src = _layout("mesh s (tp=2)\ntensor c as c105 [64 over tp, 32] mxfp8 transposed\n")
    dst = _layout("mesh d (r=1) at 2\ntensor c105 [32, 64] bf16\n")
    key = _grid("c105", (32, 64))
    storage = key.T  # [in, out]; tp c holds stored rows [32c, 32c + 32), whole blocks each
    right = _mx(storage).T
    wrong = _mx(key)  # blocks along the key's last dim
    assert not torch.equal(right, wrong), "precondition: a column block with a smaller scale"
    exp = expected_destination(dst.tensors[0], 2, _only_src(src))
    assert torch.equal(exp.values.to(torch.float32), right) and exp.choices == ()
    assert check_destination(dst.tensors[0], 2, right.to(torch.bfloat16), _only_src(src)) is None
    assert check_destination(dst.tensors[0], 2, wrong.to(torch.bfloat16), _only_src(src)) is not None


GPT_OSS_SRC = ("mesh s (ep=2)\n"
               "tensor gate_up [e in 0..2 over ep, 32, (32, (gate: 1 as m42.{e}.gate | up: 1 as m42.{e}.up))]"
               " mxfp8 transposed\n")
GPT_OSS_DST = "mesh d (r=1) at 2\nfor e in 0..2 {\n  tensor m42.{e}.gate [32, 32] DTYPE\n  tensor m42.{e}.up [32, 32] DTYPE\n}\n"


def _gpt_oss_expected() -> dict[str, torch.Tensor]:
    """gpt-oss interleaved experts, stored [E, H, 2I] for keys [I, H] (8.2 and 8.3): expert e's
    storage row h is gate[0, h], up[0, h], gate[1, h], up[1, h], ...; a 32-wide block holds 16
    gate and 16 up elements, so a gate value's scale depends on up values beside it. Expert e is
    alone on ep rank e."""
    out = {}
    for e in (0, 1):
        gate, up = _grid(f"m42.{e}.gate", (32, 32)), _grid(f"m42.{e}.up", (32, 32))
        storage = torch.stack([gate.T, up.T], dim=-1).reshape(32, 64)
        sent = _mx(storage).reshape(32, 32, 2)
        out[f"m42.{e}.gate"], out[f"m42.{e}.up"] = sent[..., 0].T, sent[..., 1].T
        if e == 0:
            assert not torch.equal(out["m42.0.gate"], _mx(gate.T).T), "precondition: blocks mixing keys matter"
    return out


def test_stacked_interleaved_transposed_mxfp8_source_into_per_expert_keys():
    src, dst = _layout(GPT_OSS_SRC), _layout(GPT_OSS_DST.replace("DTYPE", "bf16"))
    want = _gpt_oss_expected()
    for t in dst.tensors:
        exp = expected_destination(t, 2, _only_src(src))
        assert torch.equal(exp.values.to(torch.float32), want[t.key]), t.key
        assert check_destination(t, 2, want[t.key].to(torch.bfloat16), _only_src(src)) is None
    other = {"m42.0.gate": "m42.1.gate", "m42.0.up": "m42.0.gate"}  # another expert's, another part's
    for key, wrong in other.items():
        t = next(x for x in dst.tensors if x.key == key)
        assert check_destination(t, 2, want[wrong].to(torch.bfloat16), _only_src(src)) is not None


def test_stacked_quantized_source_into_a_quantized_destination():
    """Each expert key is dequantized from the stacked source, then the mxfp8 destination quantizes
    what it assembled once: the expected bytes are the reference's, of the reference's values."""
    src, dst = _layout(GPT_OSS_SRC), _layout(GPT_OSS_DST.replace("DTYPE", "mxfp8"))
    want = _gpt_oss_expected()
    for t in dst.tensors:
        assert check_destination(t, 2, _mx_value(want[t.key]), _only_src(src)) is None, t.key
    t = next(x for x in dst.tensors if x.key == "m42.1.up")
    assert check_destination(t, 2, _mx_value(want["m42.1.gate"]), _only_src(src)) is not None


def test_stacked_fp8_source_scale_covers_every_local_expert():
    """`[e in 0..4 over ep, (gate | up) as part keys, 8] fp8_e4m3`: one per-tensor scale per LOCAL
    tensor (LANGUAGE.md 4), so ep rank c's scale is the amax of experts 2c and 2c + 1, gate and up
    together; an expert's values depend on its neighbour's."""
    src = _layout("mesh s (ep=2)\ntensor w13 [e in 0..4 over ep, (gate: 4 as x.{e}.gate | up: 4 as x.{e}.up), 8]"
                  " fp8_e4m3\n")
    dst = _layout("mesh d (r=1) at 2\nfor e in 0..4 {\n  tensor x.{e}.gate [4, 8]\n  tensor x.{e}.up [4, 8]\n}\n")
    want = {}
    for c in (0, 1):
        experts = (2 * c, 2 * c + 1)
        storage = torch.stack([torch.cat([_grid(f"x.{e}.gate", (4, 8)), _grid(f"x.{e}.up", (4, 8))])
                               for e in experts])  # [2, 8, 8]: local expert, gate rows then up rows, H
        sent = torch.tensor(ref.quantize_fp8(storage.reshape(-1).tolist(), "fp8_e4m3").values).reshape(2, 8, 8)
        for i, e in enumerate(experts):
            want[f"x.{e}.gate"], want[f"x.{e}.up"] = sent[i, :4], sent[i, 4:]
    alone = torch.tensor(ref.quantize_fp8(torch.cat([_grid("x.0.gate", (4, 8)), _grid("x.0.up", (4, 8))])
                                          .reshape(-1).tolist(), "fp8_e4m3").values).reshape(8, 8)
    assert not torch.equal(alone, torch.cat([want["x.0.gate"], want["x.0.up"]])), \
        "precondition: expert 1 changes expert 0's scale"
    for t in dst.tensors:
        exp = expected_destination(t, 2, _only_src(src))
        assert torch.equal(exp.values.to(torch.float32), want[t.key]) and exp.choices == (), t.key
        assert check_destination(t, 2, want[t.key].clone(), _only_src(src)) is None
    t = dst.tensors[0]
    assert check_destination(t, 2, alone[:4].clone(), _only_src(src)) is not None


def test_per_expert_fp8_sources_into_a_stacked_destination():
    """The other way: per-expert fp8 tensors (each its own scale) -> a stacked bf16 `w2` over ep."""
    src = _layout("mesh s (r=1)\nfor e in 0..4 {\n  tensor y.{e}.down [8, 4] fp8_e5m2\n}\n")
    dst = _layout("mesh d (ep=2) at 1\ntensor w2 as y.{e}.down [e in 0..4 over ep, 8, 4]\n")
    sent = {e: torch.tensor(ref.quantize_fp8(_grid(f"y.{e}.down", (8, 4)).reshape(-1).tolist(), "fp8_e5m2")
                            .values).reshape(8, 4) for e in range(4)}
    t = dst.tensors[0]
    for rank, experts in ((1, (0, 1)), (2, (2, 3))):
        want = torch.stack([sent[e] for e in experts])
        exp = expected_destination(t, rank, _only_src(src))
        assert torch.equal(exp.values.to(torch.float32), want), rank
        assert check_destination(t, rank, want.to(torch.bfloat16), _only_src(src)) is None
        assert check_destination(t, rank, want.flip(0).to(torch.bfloat16), _only_src(src)) is not None


def test_part_key_shards_replicated_with_different_scales_accept_either_holder():
    """`(q: (4, 2) as Q0 | k: (2, 2) as K0) over tp` on tp=4: k head h lives whole on tp 2h and
    2h + 1 (LANGUAGE.md 3), each quantized with its own per-tensor scale: either is right."""
    src = _layout(OVERLAP_SRC.replace("tensor w [(q: (4, 2) | k: (2, 2))", "tensor w [(q: (4, 2) as Q0 | k: (2, 2) as K0)")
                  .format(dtype="fp8_e4m3"))
    dst = _layout("mesh d (tp=1) at 4\ntensor K0 [4, 32] bf16\n")
    sent = _overlap_sent_keys()
    assert not torch.equal(sent[0], sent[1]) and not torch.equal(sent[2], sent[3]), "the two holders disagree"
    t = dst.tensors[0]
    exp = expected_destination(t, 4, _only_src(src))
    assert len(exp.choices) == 4 and exp.values.shape == (4, 32)
    for pick in ((0, 2), (1, 3), (0, 3)):
        got = torch.cat([sent[c] for c in pick]).to(torch.bfloat16)
        assert check_destination(t, 4, got, _only_src(src)) is None, pick
    wrong = torch.cat([sent[2], sent[0]]).to(torch.bfloat16)
    assert check_destination(t, 4, wrong, _only_src(src)) is not None


def _overlap_sent_keys() -> dict[int, torch.Tensor]:
    """Per tp rank c of the keyed OVERLAP_SRC (fp8_e4m3): the two rows of key K0 it holds (head
    c // 2), after its own scale; its storage is Q rows 2c, 2c + 1, then those K rows."""
    q, k = _grid("Q0", (8, 32)), _grid("K0", (4, 32))
    out = {}
    for c in range(4):
        h = c // 2
        storage = torch.cat([q[2 * c:2 * c + 2], k[2 * h:2 * h + 2]])
        sent = torch.tensor(ref.quantize_fp8(storage.reshape(-1).tolist(), "fp8_e4m3").values).reshape(4, 32)
        out[c] = sent[2:]
    return out
