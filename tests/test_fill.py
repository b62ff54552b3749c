"""runtime/fill.py: the fill values and the destination check that every refit test relies on.

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
