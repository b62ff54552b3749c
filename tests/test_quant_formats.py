"""The block-scaled formats of LANGUAGE.md 4.1 (fp8_b128, mxfp4, nvfp4), end to end.

Why: each format is a storage convention other programs read (DeepSeek-V3's
`weight_scale_inv` grid, gpt-oss / vLLM MXFP4 blocks, NVIDIA's two-level NVFP4),
so a wrong nibble order, scale grid or rounding step corrupts an engine without
any error. Every expected byte here comes from outside layoutlang/runtime/quant.py:

- storage bytes and diagnostics: counted by hand from the format rules;
- hand-worked blocks: the arithmetic is in the comments, and both the runtime and
  tests/reference_quant.py (exact fractions, no torch) must give those bytes;
- random and whole-range inputs: every data byte, scale byte and dequantized value
  of the runtime equals the reference's;
- refits on gloo: a bf16 trainer into a destination of each new dtype (the workers
  check every element against quantizing the expected tensor once, and every
  destination element arrives once, counted from the layouts), quantized sources of
  each dtype into bf16 and fp32 (what the workers check against is first compared
  here with the reference's dequantization of the key's fill), DeepSeek-V3's
  checkpoint format (fp8_b128, HF keys, one rank) into the Megatron trainer of
  examples/small/v2/mla_megatron.layout, and the shipped fp8_b128 / mxfp4 engines.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from math import prod
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layoutlang
import reference_quant as ref
from wire_rule import op_wire
from layoutlang.compiler import compile_plan
from layoutlang.ir import storage_bytes
from layoutlang.modes import Run
from layoutlang.runtime import Fp8BlockTensor, MXFP4Tensor, NVFP4Tensor, dequantize, quantize
from layoutlang.runtime.fill import check_destination, expected_destination, values
from layoutlang.runtime.launch import launch
from layoutlang.runtime.quant import as_quantized, quantize_into, storage_problem

SMALL_V2 = Path(__file__).parent.parent / "examples" / "small" / "v2"


def _bf16(values, shape) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64).to(torch.bfloat16).reshape(shape)
    assert t.to(torch.float64).reshape(-1).tolist() == [float(v) for v in values], "a case value is not bf16"
    return t


def _u8(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def _deq(q, dtype: str) -> list:
    return dequantize(q, dtype).to(torch.float64).tolist()


# ---------------------------------------------------------------------------
# Storage: bytes and diagnostics, by hand


@pytest.mark.parametrize("dtype, shape, nbytes", [
    ("fp8_b128", (300, 129), 300 * 129 + 3 * 2 * 4),     # cdiv(300, 128) x cdiv(129, 128) fp32 scales
    ("fp8_b128", (2, 128, 256), 2 * 128 * 256 + 2 * 1 * 2 * 4),  # a leading dim is a batch of grids
    ("mxfp4", (64, 64), 64 * 32 + 64 * 2),               # two elements per byte, one E8M0 per 32
    ("nvfp4", (64, 64), 64 * 32 + 64 * 4 + 4),           # one e4m3 per 16, one fp32 global
    ("nvfp4", (0, 16), 4),                                # an empty ragged shard still has its global
    ("mxfp8", (4096, 2048), 8650752),                     # unchanged: docs/language.md section 11
])
def test_storage_bytes_by_hand(dtype, shape, nbytes):
    assert storage_bytes(dtype, shape) == nbytes


def test_bytes_per_rank_of_a_layout():
    layout = layoutlang.loads("mesh m (tp=2)\ntensor a [64, 128 over tp] mxfp4\ntensor b [256 over tp, 130] fp8_b128\n"
                              "tensor c as c.{e} [e in 0..2, 16, 32 over tp] nvfp4")
    # a: [64, 64] -> 2048 + 128; b: [128, 130] -> 16640 + 1 x 2 x 4; c: [2, 16, 16] -> 256 + 32 + 4
    assert layout.bytes_per_rank() == [2176 + 16648 + 292] * 2


def _error(text: str) -> str:
    with pytest.raises(layoutlang.LayoutError) as e:
        layoutlang.loads(text, "bad.layout")
    return str(e.value)


@pytest.mark.parametrize("text, where, message, help_", [
    ("mesh m (tp=2)\ntensor w [64, 48 over tp] mxfp4", "2:15",
     "mxfp4 needs the local last dim to be a multiple of 32; here it is 24",
     "help: use another dtype, or a shape whose local last dim is a multiple of 32"),
    ("mesh m (tp=2)\ntensor w [64, 40 over tp] nvfp4", "2:15",
     "nvfp4 needs the local last dim to be a multiple of 16; here it is 20",
     "help: use another dtype, or a shape whose local last dim is a multiple of 16"),
    # ragged: cdiv(96, 5) = 20 on four ranks and 16 on the last; 20 is not whole blocks
    ("mesh m (tp=5)\ntensor w [4, 96 over tp ragged] nvfp4", "2:14",
     "nvfp4 needs the local last dim to be a multiple of 16; here it is 20", "multiple of 16"),
    ("mesh m (tp=2)\ntensor w [] mxfp4", "2:1",
     "mxfp4 needs the local last dim to be a multiple of 32; here it is absent (0-d tensor)", "multiple of 32"),
    ("mesh m (tp=2)\ntensor w [64 over tp] fp8_b128", "2:11",
     ("fp8_b128 needs at least 2 dims (one scale per 128 x 128 block of the local last 2 dims); "
      "here there is 1 dim"), "help: store 1-d tensors (norms, biases) in bf16 or fp32"),
    ("mesh m (tp=2)\ntensor w [] fp8_b128", "2:1",
     ("fp8_b128 needs at least 2 dims (one scale per 128 x 128 block of the local last 2 dims); "
      "here there are 0 dims"), "DeepSeek-V3"),
])
def test_diagnostics(text, where, message, help_):
    msg = _error(text)
    assert f"bad.layout:{where}: error: {message}" in msg
    assert help_ in msg


@pytest.mark.parametrize("text", [
    "mesh m (tp=2)\ntensor w [3, 10 over tp] fp8_b128",         # partial edge blocks are fine
    "mesh m (tp=2)\ntensor w as w.{e} [e in 0..2, 3, 5] fp8_b128",  # a stacked dim is a batch of grids
    "mesh m (tp=2)\ntensor w [2, 32 over tp] nvfp4",
    "mesh m (tp=3)\ntensor w [4, 96 over tp ragged] mxfp4",     # 32 each
    "mesh m (tp=2)\ntensor w [4, 32] mxfp4 transposed",         # blocks along the STORAGE last dim
])
def test_shapes_that_fit(text):
    layoutlang.loads(text)


# ---------------------------------------------------------------------------
# Hand-worked blocks: the runtime and the reference agree with the arithmetic


def _mx(block: list[float]) -> list[float]:
    return block + [0.0] * (32 - len(block))


MXFP4_CASES = {
    # amax 7: floor(log2 7) = 2, X = 2^(2 - 2) = 1, E8M0 code 127. Ties go to the even mantissa:
    # 0.75 (0.5|1) -> 1, 1.25 (1|1.5) -> 1, 1.75 (1.5|2) -> 2, 2.5 (2|3) -> 2, 3.5 (3|4) -> 4,
    # 5 (4|6) -> 4, 0.25 (0|0.5) -> 0; 7 saturates to 6. Codes (s.ee.m): 1 -> 0010 = 2,
    # -0.5 -> 1001 = 9, 2 -> 0100 = 4, 4 -> 0110 = 6, 6 -> 0111 = 7. Packed low nibble first:
    # (2, 9) -> 0x92, (2, 2) -> 0x22, (4, 4) -> 0x44, (6, 6) -> 0x66, (0, 7) -> 0x70.
    "ties and packing": (_mx([1.0, -0.5, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.25, 7.0]), 127,
                         [0x92, 0x22, 0x44, 0x66, 0x70], [1.0, -0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 6.0]),
    # amax 125: floor(log2 125) = 6, X = 2^4 = 16, code 131. 125 / 16 = 7.8 saturates to 6 -> 96
    # (OCP rounds X down: up to 25 % off); 1 / 16 = 0.0625 and 0.5 / 16 round to 0.
    "saturation": (_mx([125.0, -125.0, 1.0, 0.5]), 131, [0xF7, 0x00], [96.0, -96.0, 0.0, 0.0]),
    # amax 4: X = 1. -0.125 rounds to zero and keeps its sign: code 1000 = 8; (6, 8) -> 0x86.
    "negative zero": (_mx([4.0, -0.125]), 127, [0x86], [4.0, -0.0]),
    # the all-zero block: code 0 (X = 2^-127), as mxfp8
    "all zero": (_mx([]), 0, [0x00], [0.0, 0.0]),
    # amax 2^-126: exponent -128 is below E8M0's -127: clamped, code 0; 2^-126 / 2^-127 = 2 -> 0100.
    "clamped scale": (_mx([2.0 ** -126]), 0, [0x04], [2.0 ** -126]),
    # bf16 subnormals: amax 3 * 2^-128 (floor log2 = -127) -> clamped X = 2^-127: 1.5 -> 0011;
    # 2^-129 / 2^-127 = 0.25, a tie -> 0.
    "subnormal inputs": (_mx([3 * 2.0 ** -128, 2.0 ** -129]), 0, [0x03], [3 * 2.0 ** -128, 0.0]),
    # amax 2^100: X = 2^98, code 225: 4 -> 0110, 6 -> 0111: 0x76.
    "large": (_mx([2.0 ** 100, 3 * 2.0 ** 99]), 225, [0x76], [2.0 ** 100, 3 * 2.0 ** 99]),
}


@pytest.mark.parametrize("case", MXFP4_CASES)
def test_mxfp4_by_hand(case):
    block, scale, packed, back = MXFP4_CASES[case]
    q = quantize(_bf16(block, (1, 32)), "mxfp4")
    assert tuple(q.data.shape) == (1, 16) and tuple(q.scales.shape) == (1, 1)
    assert _u8(q.scales) == [[scale]]
    assert _u8(q.data)[0][:len(packed)] == packed and not any(_u8(q.data)[0][len(packed):])
    got = _deq(q, "mxfp4")[0][:len(back)]
    assert got == back and [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in back]
    r = ref.quantize_mxfp4([block])
    assert r.scales == [[scale]] and r.packed[0][:len(packed)] == packed and r.values[0][:len(back)] == back


def test_nvfp4_by_hand():
    """One [1, 64] tensor, four blocks of 16. amax 42: g = 42 / 2688 = 1/64 exactly, 6 g = 0.09375.
    Block 1, bamax 42: s = 42 / 0.09375 = 448 (e4m3 1.75 * 2^8: 0x7E), d = 448 / 64 = 7;
      42/7 = 6 -> 0111, 21/7 = 3 -> 0101, -10.5/7 = -1.5 -> 1011, 1.75/7 = 0.25 tie -> 0,
      5.25/7 = 0.75 tie -> 1 (0010, value 7). Bytes 0x57, 0x0B, 0x02.
    Block 2, bamax 3: s = 3 / 0.09375 = 32 = 2^5 (exp field 12: 0x60), d = 0.5;
      3/0.5 = 6 -> 0111, -1/0.5 = -2 -> 1100, 0.375/0.5 = 0.75 -> 1 (value 0.5). Bytes 0xC7, 0x02.
    Block 3, all zero: s = 0 -> 1 (0x38), codes 0.
    Block 4, bamax 2^-20: s = 2^-20 / 0.09375 < 2^-9 -> 2^-9 (the smallest e4m3 subnormal, 0x01),
      d = 2^-15; 2^-20 / 2^-15 = 1/32 rounds to 0."""
    blocks = [[42.0, 21.0, -10.5, 1.75, 5.25], [3.0, -1.0, 0.375], [], [2.0 ** -20]]
    row = [v for b in blocks for v in b + [0.0] * (16 - len(b))]
    packed = [0x57, 0x0B, 0x02] + [0] * 5 + [0xC7, 0x02] + [0] * 6 + [0] * 16
    back = [42.0, 21.0, -10.5, 0.0, 7.0] + [0.0] * 11 + [3.0, -1.0, 0.5] + [0.0] * 13 + [0.0] * 32
    q = quantize(_bf16(row, (1, 64)), "nvfp4")
    assert tuple(q.data.shape) == (1, 32) and tuple(q.scales.shape) == (1, 4) and q.global_scale.numel() == 1
    assert q.global_scale.item() == 1 / 64 and q.global_scale.dtype == torch.float32
    assert _u8(q.scales) == [[0x7E, 0x60, 0x38, 0x01]] and q.scales.dtype == torch.float8_e4m3fn
    assert _u8(q.data) == [packed]
    assert _deq(q, "nvfp4") == [back]
    r = ref.quantize_nvfp4([row])
    assert (r.global_scale, r.scales, r.packed, r.values) == (1 / 64, [[0x7E, 0x60, 0x38, 0x01]], [packed], [back])


def test_fp8_b128_by_hand():
    """[129, 130]: four blocks, three of them partial. Block (0,0) amax 448: scale 1, 448 -> 0x7E,
    -224 -> 0xF6. Block (0,1) amax 7: scale 7/448 = 1/64 (the fp32 multiplier, DeepSeek-V3's
    weight_scale_inv), 7 * 64 = 448 -> 0x7E, -3 * 64 = -192 -> 0xF4. Block (1,0) amax 7: 1/64;
    0.10009765625 * 64 = 6.40625, step 1/2: 12.8 -> 13 -> 6.5 (0x4D) -> 0.1015625. Block (1,1) zero:
    scale 1, codes 0."""
    x = torch.zeros(129, 130, dtype=torch.float64)
    cells = {(0, 0): (448.0, 0x7E, 448.0), (5, 7): (-224.0, 0xF6, -224.0), (0, 128): (7.0, 0x7E, 7.0),
             (3, 129): (-3.0, 0xF4, -3.0), (128, 0): (0.10009765625, 0x4D, 0.1015625), (128, 127): (7.0, 0x7E, 7.0)}
    for (i, j), (v, _, _) in cells.items():
        x[i, j] = v
    q = quantize(x.to(torch.bfloat16), "fp8_b128")
    assert q.scales.dtype == torch.float32 and q.scales.tolist() == [[1.0, 1 / 64], [1 / 64, 1.0]]
    codes, back = torch.tensor(_u8(q.data)), dequantize(q, "fp8_b128").to(torch.float64)
    for (i, j), (_, code, value) in cells.items():
        assert codes[i, j] == code and back[i, j] == value, (i, j)
    assert int((codes != 0).sum()) == len(cells) and int((back != 0).sum()) == len(cells)
    r = ref.quantize_fp8_b128(x.tolist())
    assert r.scales == [[1.0, 1 / 64], [1 / 64, 1.0]] and r.codes == codes.tolist() and r.values == back.tolist()


def test_fp8_b128_leading_dims_are_a_batch_of_grids():
    # [2, 1, 2]: batch 0 amax 14 -> scale 14/448 = 1/32: 14 -> 448 (0x7E), 3.5 -> 112 = 1.75 * 2^6 (0x6E);
    # batch 1 amax 0.875 -> 1/512: 0.875 -> 448 (0x7E), -0.4375 -> -224 (0xF6).
    q = quantize(_bf16([14.0, 3.5, 0.875, -0.4375], (2, 1, 2)), "fp8_b128")
    assert q.scales.tolist() == [[[1 / 32]], [[1 / 512]]]
    assert _u8(q.data) == [[[0x7E, 0x6E]], [[0x7E, 0xF6]]]
    assert _deq(q, "fp8_b128") == [[[14.0, 3.5]], [[0.875, -0.4375]]]


def test_packing_is_the_gpt_oss_checkpoint_convention():
    """transformers' convert_moe_packed_tensors (gpt-oss) decodes byte j as lut[b & 0x0F] at 2j and
    lut[b >> 4] at 2j + 1, with lut = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6]: written out here."""
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    data = torch.tensor([[(37 * j + 11) % 256 for j in range(32)]], dtype=torch.uint8)  # 32 different bytes
    exps = torch.tensor([[127 + 1, 127 - 3]], dtype=torch.uint8)                # X = 2, X = 1/8
    got = dequantize(MXFP4Tensor(data, exps), "mxfp4").to(torch.float64)[0].tolist()
    want = []
    for j, b in enumerate(data[0].tolist()):
        x = 2.0 if j < 16 else 1 / 8
        want += [lut[b & 0x0F] * x, lut[b >> 4] * x]
    assert got == want


# ---------------------------------------------------------------------------
# Random and whole-range inputs: every byte equals the reference's


def _any_bf16(rng: random.Random) -> float:
    while True:
        bits = rng.randint(0, 0xFFFF)
        if (bits >> 7) & 0xFF != 0xFF:  # not Inf / NaN
            return ref.to_float(*ref.decode(bits, ref.BF16))


def _blocky(rng: random.Random, n: int, block: int) -> list[float]:
    """n bf16 values as weights look: a random base binade, each block up to 30 binades below it
    (so block scales spread down to e4m3's subnormals and nvfp4's 2^-9 floor), elements within
    2^-12 of their block's magnitude; zeros of both signs and any finite bf16 here and there."""
    base = rng.randint(-140, 120)
    out: list[float] = []
    for b in range(0, n, block):
        offset = rng.choice([0, 0, rng.randint(0, 30)])
        for _ in range(min(block, n - b)):
            kind = rng.random()
            if kind < 0.1:
                out.append(rng.choice([0.0, -0.0]))
            elif kind < 0.15:
                out.append(_any_bf16(rng))
            else:
                a = Fraction(rng.randint(0, 255), 128) * Fraction(2) ** (base - offset - rng.randint(0, 12))
                out.append(ref.to_float(*ref.round_to(rng.randint(0, 1), a, ref.BF16)))
    return out


def _rows(values: list[float], width: int) -> list[list[float]]:
    return [values[i:i + width] for i in range(0, len(values), width)]


def _check_packed(dtype: str, values: list[float], rows: int, width: int) -> None:
    r = (ref.quantize_mxfp4 if dtype == "mxfp4" else ref.quantize_nvfp4)(_rows(values, width))
    q = quantize(_bf16(values, (rows, width)), dtype)
    assert _u8(q.scales) == r.scales
    assert _u8(q.data) == r.packed
    if dtype == "nvfp4":
        assert q.global_scale.item() == r.global_scale
    assert _deq(q, dtype) == r.values


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["mxfp4", "nvfp4"]), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2 ** 32 - 1))
def test_packed_formats_match_the_reference(dtype, rows, blocks, seed):
    block = 32 if dtype == "mxfp4" else 16
    width = block * blocks
    _check_packed(dtype, _blocky(random.Random(seed), rows * width, block), rows, width)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["mxfp4", "nvfp4"]), st.integers(0, 2 ** 32 - 1))
def test_packed_formats_match_the_reference_on_any_bf16(dtype, seed):
    """Whole-range bit patterns in one tensor: huge, tiny and subnormal values side by side."""
    rng = random.Random(seed)
    _check_packed(dtype, [_any_bf16(rng) for _ in range(64)], 2, 32)


def _check_b128(values: list[float], shape: tuple[int, ...]) -> None:
    q = quantize(_bf16(values, shape), "fp8_b128")
    m, n = shape[-2:]
    grids = [values[i:i + m * n] for i in range(0, len(values), m * n)]
    codes, scales, back = _u8(q.data), q.scales.tolist(), _deq(q, "fp8_b128")
    if len(shape) == 2:
        codes, scales, back = [codes], [scales], [back]
    for b, grid in enumerate(grids):
        r = ref.quantize_fp8_b128(_rows(grid, n))
        assert (codes[b], scales[b], back[b]) == (r.codes, r.scales, r.values), b


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9), st.booleans(), st.integers(0, 2 ** 32 - 1))
def test_fp8_b128_matches_the_reference(batch, m, n, whole_range, seed):
    rng = random.Random(seed)
    count = batch * m * n
    values = [_any_bf16(rng) for _ in range(count)] if whole_range else _blocky(rng, count, count)
    _check_b128(values, (batch, m, n) if batch > 1 else (m, n))


def test_fp8_b128_matches_the_reference_across_block_edges():
    """[130, 131]: four blocks, three partial, each with its own magnitude (blocks 0 to 30
    binades apart), so that a block read across an edge gets another scale."""
    rng = random.Random(20240612)
    x = [[0.0] * 131 for _ in range(130)]
    for bi, bj in ((0, 0), (0, 1), (1, 0), (1, 1)):
        rows, cols = range(128 * bi, min(128 * bi + 128, 130)), range(128 * bj, min(128 * bj + 128, 131))
        block = _blocky(rng, len(rows) * len(cols), len(rows) * len(cols))
        for k, (i, j) in enumerate((i, j) for i in rows for j in cols):
            x[i][j] = block[k]
    _check_b128([v for row in x for v in row], (130, 131))


# ---------------------------------------------------------------------------
# NaN policy, empty shards, storage in place, what a caller passes


def test_nan_and_inf_poison_their_scale_block():
    """docs/runtime.md: a block holding NaN or +-Inf gets the NaN scale and zero codes, so it
    dequantizes to NaN; other blocks are untouched (nvfp4: its block is the whole local tensor)."""
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[0, 3], x[1, 40] = float("nan"), float("-inf")
    q = quantize(x, "mxfp4")  # blocks (0, 0) and (1, 1) are poisoned; the others: X = 2^(0 - 2), 1 -> 4 (0110)
    assert _u8(q.scales) == [[255, 125], [125, 255]]
    assert _u8(q.data)[0][:16] == [0] * 16 and _u8(q.data)[0][16:] == [0x66] * 16
    back = dequantize(q, "mxfp4")
    assert bool(back[0, :32].isnan().all()) and bool((back[0, 32:] == 1).all()) and bool(back[1, 32:].isnan().all())
    r = ref.quantize_mxfp4(x.to(torch.float64).tolist())
    assert r.scales == _u8(q.scales) and r.packed == _u8(q.data)

    q = quantize(x, "nvfp4")
    assert math.isnan(q.global_scale.item()) and _u8(q.scales) == [[0x7F] * 4] * 2 and not q.data.view(torch.uint8).any()
    assert bool(dequantize(q, "nvfp4").isnan().all())
    r = ref.quantize_nvfp4(x.to(torch.float64).tolist())
    assert math.isnan(r.global_scale) and r.scales == _u8(q.scales) and r.packed == _u8(q.data)

    y = torch.ones(130, 2, dtype=torch.bfloat16)
    y[129, 0] = float("nan")  # block row 1 only
    q = quantize(y, "fp8_b128")
    r = ref.quantize_fp8_b128(y.to(torch.float64).tolist())
    assert q.scales[0, 0].item() == r.scales[0][0] == ref.to_float(*ref.round_to(0, Fraction(1, 448), ref.FP32))
    assert math.isnan(q.scales[1, 0].item()) and math.isnan(r.scales[1][0])
    assert _u8(q.data) == r.codes and not q.data.view(torch.uint8)[128:].any()
    assert bool((dequantize(q, "fp8_b128")[:128] == 1).all()) and bool(dequantize(q, "fp8_b128")[128:].isnan().all())


@pytest.mark.parametrize("dtype, shape", [("mxfp4", (0, 64)), ("nvfp4", (3, 0)), ("fp8_b128", (0, 5)),
                                          ("fp8_b128", (4, 0))])
def test_empty_ragged_shards_quantize(dtype, shape):
    q = quantize(torch.zeros(shape, dtype=torch.bfloat16), dtype)
    assert tuple(dequantize(q, dtype).shape) == shape
    if dtype == "nvfp4":
        assert q.global_scale.item() == 1.0


@pytest.mark.parametrize("dtype", ["fp8_b128", "mxfp4", "nvfp4"])
def test_quantize_into_writes_the_existing_storage(dtype):
    x = _bf16(_blocky(random.Random(7), 4 * 64, 16), (4, 64))
    fresh = quantize(x, dtype)
    target = quantize(torch.full((4, 64), 3.0, dtype=torch.bfloat16), dtype)
    pointers = [t.data_ptr() for t in target.__dict__.values()]
    quantize_into(x, target, dtype)
    assert [t.data_ptr() for t in target.__dict__.values()] == pointers
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(target.__dict__.values(), fresh.__dict__.values()))


def test_what_a_caller_passes():
    """Shapes and dtypes from docs/runtime.md; tuples and torch's own fp4 / e8m0 dtypes accepted."""
    assert storage_problem(as_quantized((torch.zeros(4, 32, dtype=torch.uint8),
                                         torch.zeros(4, 2, dtype=torch.float8_e8m0fnu)), "mxfp4"), "mxfp4", (4, 64)) is None
    assert storage_problem(MXFP4Tensor(torch.zeros(4, 32, dtype=torch.float4_e2m1fn_x2),
                                       torch.zeros(4, 2, dtype=torch.uint8)), "mxfp4", (4, 64)) is None
    nv = as_quantized((torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
                       torch.ones(1)), "nvfp4")
    assert isinstance(nv, NVFP4Tensor) and storage_problem(nv, "nvfp4", (4, 64)) is None
    assert storage_problem(Fp8BlockTensor(torch.zeros(300, 129, dtype=torch.float8_e4m3fn), torch.ones(3, 2)),
                           "fp8_b128", (300, 129)) is None
    assert storage_problem(MXFP4Tensor(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)),
                           "mxfp4", (4, 64)) == ("expected mxfp4 data [4, 32] torch.uint8 or torch.float4_e2m1fn_x2, "
                                                 "got [4, 64] torch.uint8")
    assert storage_problem(Fp8BlockTensor(torch.zeros(300, 129, dtype=torch.float8_e4m3fn), torch.ones(2, 2)),
                           "fp8_b128", (300, 129)) == "expected fp8_b128 scales [3, 2] torch.float32, got [2, 2] torch.float32"
    assert storage_problem(NVFP4Tensor(nv.data, nv.scales, torch.ones(2)), "nvfp4", (4, 64)) == \
        "expected a one-element torch.float32 global_scale, got [2] torch.float32"
    assert storage_problem(torch.zeros(4, 64), "nvfp4", (4, 64)) == \
        "expected a quantized nvfp4 tensor (NVFP4Tensor(data, scales, global_scale) or a tuple of them), got Tensor"


# ---------------------------------------------------------------------------
# The destination check catches a wrong nibble and a wrong scale


CHECK_DST = "mesh d (tp=2)\ntensor a as w.a [40, 64 over tp] DTYPE\n"


@pytest.mark.parametrize("dtype", ["fp8_b128", "mxfp4", "nvfp4"])
def test_check_destination_catches_one_wrong_nibble_or_scale(dtype):
    t = layoutlang.loads(CHECK_DST.replace("DTYPE", dtype)).tensors[0]
    right = quantize(expected_destination(t, 1).values, dtype)
    assert check_destination(t, 1, right) is None
    wrong = quantize(expected_destination(t, 1).values, dtype)
    wrong.data.view(torch.uint8)[7, 5] ^= 0x10  # the high nibble: element 11 when packed, else bit 4 of 5
    col = 10 if dtype != "fp8_b128" else 5       # a packed byte is reported at its even element
    assert check_destination(t, 1, wrong) == f"`a` on rank 1: quantized data differs at [7, {col}]"
    wrong = quantize(expected_destination(t, 1).values, dtype)
    wrong.scales.view(torch.uint8).reshape(-1)[0] ^= 1
    assert check_destination(t, 1, wrong) == "`a` on rank 1: quantization scales differ"


# ---------------------------------------------------------------------------
# Refits on gloo


TRAIN = """
mesh train (dp=2, tp=2)
tensor dense as w.dense [300 over tp, 272]
tensor fc1 [(gate: 64 as w.gate | up: 64 as w.up) over tp chunk dp, 96]
tensor fc2 as w.fc2 [128, 64 over tp]
for e in 0..4 over tp {
  tensor experts.{e.local} as w.experts.{e} [40, 64]
}
tensor emb as w.emb [100 over tp, 64]
tensor norm as w.norm [64]
"""

ENGINE = """
arg AT = 0
mesh infer (tp=2) at AT
tensor dense as w.dense [300 pad 64, 272 over tp] fp8_b128
tensor fc1 [(gate: 64 as w.gate | up: 64 as w.up) over tp, 96] mxfp4
tensor fc2t as w.fc2 [64, 128 over tp] mxfp4 transposed
tensor experts as w.experts.{e} [e in 0..4 over tp, 40, 64] nvfp4
tensor emb as w.emb [100 pad 64 over tp, 64] nvfp4
tensor norm as w.norm [64] fp32
"""


def _write(tmp_path, **texts) -> dict[str, str]:
    out = {}
    for name, text in texts.items():
        (tmp_path / f"{name}.layout").write_text(text)
        out[name] = str(tmp_path / f"{name}.layout")
    return out


def _data_elements(t, rank: int) -> int:
    """From the layout: the rank's data (non-padding) elements of `t`."""
    return prod(sum(r.length for r in runs if isinstance(r, Run)) for runs in t.runs(rank))


def _launch_and_check(job: dict, nproc: int, plan) -> list:
    results = launch({**job, "args": {}, "verify": True, "budget": None}, nproc, timeout=200)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')}"
    for r in results:  # every destination tensor a rank holds was checked element by element
        held = sum(1 for t in plan.dst.tensors if r.rank < plan.dst.ranks and t.holds(r.rank))
        assert r.result["checked_tensors"] == held
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("at, strided, wire", [(0, False, "auto"), (2, True, "auto"), (0, False, "bf16")],
                         ids=["collocated", "at2-strided-views", "collocated-bf16-wire"])
def test_trainer_into_each_new_dtype(tmp_path, at, strided, wire):
    """bf16 trainer (dp2 x tp2) -> an engine with fp8_b128 (padded rows, 3 x 2 partial blocks per
    rank), mxfp4 (part keys; a transposed key: blocks along the storage last dim), nvfp4 (stacked
    experts sharing a global scale; padded rows). The workers check every element: padding zero,
    the bytes equal quantizing the expected tensor once, storage written in place; with strided
    views, data and scales are every other element of bigger buffers whose other elements must
    keep their guard values. With the quantized wire (default) and with `wire="bf16"`: the same
    bytes land either way, and the bytes moved follow the rule (bf16 path: 2 per element)."""
    paths = _write(tmp_path, train=TRAIN, engine=ENGINE)
    plan = compile_plan(paths["train"], paths["engine"], dst_args={"AT": at}, wire=wire)
    assert {t.dtype for t in plan.dst.tensors} == {"fp8_b128", "mxfp4", "nvfp4", "fp32"}
    assert tuple(next(t for t in plan.dst.tensors if t.name == "dense").local_shape) == (320, 136)
    results = _launch_and_check({"src": paths["train"], "dst": paths["engine"], "dst_args": {"AT": at},
                                 "strided": strided, "wire": wire}, 4, plan)
    moved = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results)
    if wire == "bf16":  # every destination data element arrived once, in bf16 (quantized) or fp32
        want = sum(_data_elements(t, r) * (4 if t.dtype == "fp32" else 2) for t in plan.dst.tensors
                   for r in t.ranks())
        assert moved == want
        return
    dst = {t.name: t for t in plan.dst.tensors}
    rule = [op_wire(op.dst_slice, dst[op.dst_name].dtype, tuple(dst[op.dst_name].local_shape_at(op.dst_rank)))
            for op in plan.ops]
    assert [op.wire is not None for op in plan.ops] == [packed for packed, _ in rule]
    assert moved == sum(n for _, n in rule) == plan.stats["bytes"]
    # by hand: dense's rows arrive cut at 150 (the trainer's tp), not on 128-row blocks: bf16;
    # mxfp4's and nvfp4's blocks run along whole last dims: every op of theirs is quantized
    assert {dst[op.dst_name].dtype for op in plan.ops if op.wire} == {"mxfp4", "nvfp4"}
    assert all(op.wire for op in plan.ops if dst[op.dst_name].dtype in ("mxfp4", "nvfp4"))


QUANTIZED_SRC = """
mesh s (r=1)
tensor dense as w.dense [160, 144] fp8_b128
tensor fc1 as w.fc1 [64, 96] mxfp4
tensor ex as w.ex.{e} [e in 0..2, 40, 64] nvfp4
"""

PLAIN_DST = """
mesh d (tp=2) at 1
tensor dense as w.dense [160 over tp, 144]
tensor fc1 as w.fc1 [64, 96 over tp] fp32
for e in 0..2 {
  tensor ex.{e} as w.ex.{e} [40 over tp, 64]
}
"""


def _key_grid(key: str, shape: tuple[int, int]) -> list[list[float]]:
    """The fill of a 2-d key (values by row-major index in the key), as the source holds it."""
    return values(key, torch.arange(shape[0] * shape[1])).reshape(shape).tolist()


def _local(t, rank: int, full: torch.Tensor) -> torch.Tensor:
    """The rank's local storage of `t` (a v1 tensor: one key, all of it) read from the key's full
    logical tensor through the layout's runs; padding 0."""
    index = []
    for n, runs in zip(t.local_shape_at(rank), t.runs(rank)):
        i = torch.full((n,), -1, dtype=torch.int64)
        for r in runs:
            if isinstance(r, Run):
                i[r.local_start:r.local_start + r.length] = torch.arange(r.logical_start, r.logical_start + r.length)
        index.append(i)
    rows, cols = index
    out = full[rows.clamp_min(0)][:, cols.clamp_min(0)]
    return torch.where((rows >= 0)[:, None] & (cols >= 0)[None, :], out, 0.0)


@pytest.mark.timeout(300)
def test_quantized_sources_of_each_new_dtype_into_bf16(tmp_path):
    """One rank holds every key whole in fp8_b128 (2 x 2 blocks, partial), mxfp4 and nvfp4 (two
    experts stacked: ONE global scale for both); the engine-side ranks receive them dequantized.
    What the workers check against (layoutlang.runtime.fill) is compared first with the reference's
    dequantization of each key's fill, on every rank; then the refit checks every element."""
    paths = _write(tmp_path, src=QUANTIZED_SRC, dst=PLAIN_DST)
    plan = compile_plan(paths["src"], paths["dst"])
    dense = torch.tensor(ref.quantize_fp8_b128(_key_grid("w.dense", (160, 144))).values)
    fc1 = torch.tensor(ref.quantize_mxfp4(_key_grid("w.fc1", (64, 96))).values)
    stacked = ref.quantize_nvfp4(_key_grid("w.ex.0", (40, 64)) + _key_grid("w.ex.1", (40, 64))).values
    want = {"w.dense": dense, "w.fc1": fc1, "w.ex.0": torch.tensor(stacked[:40]), "w.ex.1": torch.tensor(stacked[40:])}
    for key, full in want.items():  # the quantization shows (not the exact fill)
        assert not torch.equal(full, torch.tensor(_key_grid(key, tuple(full.shape)))), key
    for t in plan.dst.tensors:
        for rank in t.ranks():
            got = expected_destination(t, rank, plan).values.to(torch.float64)
            assert torch.equal(got, _local(t, rank, want[t.key]).to(torch.float64)), (t.name, rank)
    _launch_and_check({"src": paths["src"], "dst": paths["dst"]}, 3, plan)


DSV3_CHECKPOINT = """
# DeepSeek-V3's checkpoint format at the size of examples/small/v2/mla_megatron.layout:
# HF keys, every linear weight fp8_b128 (weight + weight_scale_inv), the rest bf16, one rank.
layout dsv3_checkpoint
const L = 2, H = 64, V = 500, NH = 8, Q_LORA = 32, KV_LORA = 32, QK_NOPE = 8, QK_ROPE = 4, V_HEAD = 8
mesh ckpt (r=1)
tensor model.embed_tokens.weight [V, H]
tensor model.norm.weight [H]
tensor lm_head.weight [V, H]
for l in 0..L {
  tensor model.layers.{l}.input_layernorm.weight [H]
  tensor model.layers.{l}.self_attn.q_a_proj.weight [Q_LORA, H] fp8_b128
  tensor model.layers.{l}.self_attn.q_a_layernorm.weight [Q_LORA]
  tensor model.layers.{l}.self_attn.q_b_proj.weight [(NH, QK_NOPE + QK_ROPE), Q_LORA] fp8_b128
  tensor model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight [KV_LORA + QK_ROPE, H] fp8_b128
  tensor model.layers.{l}.self_attn.kv_a_layernorm.weight [KV_LORA]
  tensor model.layers.{l}.self_attn.kv_b_proj.weight [(NH, QK_NOPE + V_HEAD), KV_LORA] fp8_b128
  tensor model.layers.{l}.self_attn.o_proj.weight [H, NH*V_HEAD] fp8_b128
}
"""


@pytest.mark.timeout(300)
def test_deepseek_v3_fp8_checkpoint_into_the_megatron_trainer(tmp_path):
    """fp8_b128 checkpoint (one rank) -> mla_megatron.layout at PP2 x TP2 in bf16: every fp8 weight
    on every rank equals the reference's fp8_b128 dequantization of the key (read through the
    destination's runs: head-split q_b/kv_b, column-split o_proj, PP stages), the rest exact."""
    paths = _write(tmp_path, ckpt=DSV3_CHECKPOINT)
    dst, dst_args = str(SMALL_V2 / "mla_megatron.layout"), {"TP": 2, "DP": 1, "PP": 2}
    plan = compile_plan(paths["ckpt"], dst, dst_args=dst_args)
    fp8 = {k for k, holders in plan.src.key_index.items() if holders[0][0].dtype == "fp8_b128"}
    assert len(fp8) == 10  # q_a, q_b, kv_a, kv_b, o x 2 layers
    checked = set()
    for t in plan.dst.tensors:
        if t.key not in fp8 or len(t.logical_shape) != 2:
            continue
        grid = _key_grid(t.key, t.logical_shape)
        full = torch.tensor(ref.quantize_fp8_b128(grid).values, dtype=torch.float64)
        assert not torch.equal(full, torch.tensor(grid, dtype=torch.float64))
        for rank in t.ranks():
            got = expected_destination(t, rank, plan).values.to(torch.float64)
            assert torch.equal(got, _local(t, rank, full)), (t.name, rank)
        checked.add(t.key)
    assert checked == fp8
    _launch_and_check({"src": paths["ckpt"], "dst": dst, "dst_args": dst_args}, 4, plan)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("src, dst, src_args, dst_args", [
    ("mla_megatron", "dsv3_fp8_b128", {"TP": 2, "DP": 1, "PP": 1}, {"TP": 2, "DP": 1}),
    ("gptoss_hf", "gptoss_vllm_mxfp4", {}, {"EP": 2}),
    ("gptoss_hf", "gptoss_vllm_mxfp4", {}, {"EP": 1, "TP": 2}),  # vLLM's expert TP: interleaved pairs cut
], ids=["megatron-to-dsv3-fp8-b128", "hf-to-vllm-mxfp4-ep2", "hf-to-vllm-mxfp4-tp2"])
def test_shipped_block_scaled_engines(src, dst, src_args, dst_args):
    s, d = str(SMALL_V2 / f"{src}.layout"), str(SMALL_V2 / f"{dst}.layout")
    plan = compile_plan(s, d, src_args=src_args, dst_args=dst_args)
    quantized = {t.dtype for t in plan.dst.tensors} - {"bf16", "fp32"}
    assert quantized == {"fp8_b128" if "dsv3" in dst else "mxfp4"}
    _launch_and_check({"src": s, "dst": d, "src_args": src_args, "dst_args": dst_args}, 2, plan)
