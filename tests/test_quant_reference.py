"""layoutlang/runtime/quant.py against tests/reference_quant.py: hand-worked cases, random inputs, error bounds.

Why: the runtime's quantize() is what fill.py and the refit checks compare
against, so it must be right by itself. The expected codes below are worked
out by hand from the format rules (the arithmetic is in the comments), and
the random cases compare every data byte, every scale byte and every
dequantized value with the reference, which never calls torch.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reference_quant as ref
from layoutlang.runtime.quant import dequantize, quantize

# ---------------------------------------------------------------------------
# The reference encoder itself, on hand-worked codes


@pytest.mark.parametrize("value, fmt, code", [
    (448.0, ref.E4M3, 0x7E),        # 1.75 * 2^8: exp field 8+7 = 15 (1111), mantissa 110
    (-448.0, ref.E4M3, 0xFE),
    (500.0, ref.E4M3, 0x7E),        # beyond 448: saturates (480 would be 1111.111 = NaN)
    (1.0, ref.E4M3, 0x38),          # exp field 0+7 = 7 (0111), mantissa 000
    (4.0, ref.E4M3, 0x48),          # 2^2: exp field 9 (1001)
    (17.0, ref.E4M3, 0x58),         # 17 = 2^4 * 1.0625; step 2^(4-3) = 2: 8.5 steps -> tie -> 8 (even) -> 16
    (19.0, ref.E4M3, 0x5A),         # 9.5 steps -> 10 -> 20 = 2^4 * 1.25: exp 11, mantissa 010
    (2.0 ** -7, ref.E4M3, 0x04),    # below 2^-6: subnormal, step 2^-9: 4 steps -> mantissa 100
    (2.0 ** -10, ref.E4M3, 0x00),   # half a step: tie -> 0 (even)
    (3 * 2.0 ** -10, ref.E4M3, 0x02),  # 1.5 steps -> 2 (even)
    (15 * 2.0 ** -10, ref.E4M3, 0x08),  # 7.5 steps -> 8 = 2^3 steps: carries into the smallest normal 2^-6
    (-0.0, ref.E4M3, 0x80),
    (57344.0, ref.E5M2, 0x7B),      # 1.75 * 2^15: exp field 30 (11110), mantissa 11
    (1e9, ref.E5M2, 0x7B),          # saturates (11111.00 would be Inf)
    (3.0, ref.E5M2, 0x42),          # 1.5 * 2^1: exp 16 (10000), mantissa 10
    (9.0, ref.E5M2, 0x48),          # step 2^(3-2) = 2: 4.5 -> 4 (even) -> 8: exp 18, mantissa 00
    (11.0, ref.E5M2, 0x4A),         # 5.5 -> 6 (even) -> 12 = 1.5 * 2^3: exp 18, mantissa 10
    (2.0 ** -16, ref.E5M2, 0x01),   # the smallest subnormal
    # e2m1 (s.ee.m, bias 1): 0.5 is the one subnormal (exp 00, mantissa 1), 6 = 1.5 * 2^2 the max
    (0.5, ref.E2M1, 0x1),
    (6.0, ref.E2M1, 0x7),           # exp 11, mantissa 1
    (7.0, ref.E2M1, 0x7),           # saturates (no Inf, no NaN)
    (0.25, ref.E2M1, 0x0),          # half a step: tie -> 0 (even)
    (0.75, ref.E2M1, 0x2),          # between 0.5 (mantissa 1) and 1 (mantissa 0): tie -> 1
    (1.25, ref.E2M1, 0x2),          # 1 | 1.5: tie -> 1 (0010)
    (1.75, ref.E2M1, 0x4),          # 1.5 | 2: tie -> 2 (0100), carrying into the next binade
    (2.5, ref.E2M1, 0x4),           # 2 | 3: tie -> 2
    (3.5, ref.E2M1, 0x6),           # 3 | 4: tie -> 4 (0110)
    (5.0, ref.E2M1, 0x6),           # 4 | 6: tie -> 4
    (5.5, ref.E2M1, 0x7),           # nearer 6
    (-0.5, ref.E2M1, 0x9),
    (-0.0, ref.E2M1, 0x8),
])
def test_reference_codes_by_hand(value, fmt, code):
    assert ref.encode(*ref.exact(value), fmt) == code


def test_reference_decodes_every_finite_code():
    """Every finite code decodes and re-encodes to itself (NaN codes are skipped)."""
    for fmt, nans in ((ref.E4M3, {0x7F, 0xFF}), (ref.E5M2, set(range(0x7C, 0x80)) | set(range(0xFC, 0x100)))):
        for code in set(range(256)) - nans:
            assert ref.encode(*ref.decode(code, fmt), fmt) == code, (fmt.name, hex(code))
    assert ref.E4M3.max_finite == 448 and ref.E5M2.max_finite == 57344
    e2m1 = [ref.to_float(*ref.decode(code, ref.E2M1)) for code in range(16)]
    assert e2m1 == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]  # the published table
    assert all(ref.encode(*ref.decode(code, ref.E2M1), ref.E2M1) == code for code in range(16))


def test_reference_codes_agree_with_torch_on_every_code():
    """A cross-check of the reference, not of the runtime: torch's fp8 dtypes decode the same."""
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt, dtype in ((ref.E4M3, torch.float8_e4m3fn), (ref.E5M2, torch.float8_e5m2)):
        values = codes.view(dtype).to(torch.float64).tolist()
        for code, v in enumerate(values):
            if v == v and abs(v) != float("inf"):
                assert ref.to_float(*ref.decode(code, fmt)) == v, (fmt.name, hex(code))


# ---------------------------------------------------------------------------
# The runtime against hand-worked cases


def _bf16(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)
    assert t.to(torch.float64).tolist() == list(values), "a case value is not exact in bf16"
    return t


def _mx(block: list[float]) -> list[float]:
    return block + [0.0] * (32 - len(block))


MX_CASES = {
    # amax 125: floor(log2 125) = 6 (64 <= 125 < 128), X = 2^(6-8) = 1/4, E8M0 code 127-2 = 125.
    # 125 / (1/4) = 500 > 448 saturates (0x7E) -> 448/4 = 112; -125 -> -112 (0xFE);
    # 1 / (1/4) = 4 = 2^2 (0x48) -> 1; 0.5 -> 2 = 2^1 (exp 8: 0x40) -> 0.5.
    "saturation": (_mx([125.0, -125.0, 1.0, 0.5]), 125,
                   [0x7E, 0xFE, 0x48, 0x40], [112.0, -112.0, 1.0, 0.5]),
    # amax 1: X = 2^(0-8) = 2^-8, code 119. 1 -> 256 = 2^8 (exp 15, mantissa 0: 0x78).
    # 0.30078125 (bf16 of 0.3, = 77/256) -> 77 = 2^6 * 1.203; step 2^(6-3) = 8: 9.625 -> 10 -> 80
    # (exp 13, mantissa 010: 0x6A) -> 80/256 = 0.3125.
    "rounding": (_mx([1.0, 0.30078125]), 119, [0x78, 0x6A], [1.0, 0.3125]),
    # amax 256: X = 2^(8-8) = 1, code 127. 17 -> tie -> 16 (0x58); 19 -> 20 (0x5A);
    # 2^-7 -> subnormal 4 steps of 2^-9 (0x04); 2^-10 -> half a step -> 0; 3 * 2^-10 -> 2 steps (0x02).
    "ties and subnormals": (_mx([256.0, 17.0, 19.0, 2.0 ** -7, 2.0 ** -10, 3 * 2.0 ** -10]), 127,
                            [0x78, 0x58, 0x5A, 0x04, 0x00, 0x02], [256.0, 16.0, 20.0, 2.0 ** -7, 0.0, 2.0 ** -8]),
    # the all-zero block: by convention the smallest scale (code 0), every element +0
    "all zero": (_mx([]), 0, [0x00], [0.0]),
    # amax 2^-130 (a bf16 subnormal): floor(log2) - 8 = -138 is below E8M0's 2^-127: clamped, code 0.
    # 2^-130 / 2^-127 = 2^-3 (exp 4: 0x20) -> 2^-130 again.
    "clamped scale": (_mx([2.0 ** -130]), 0, [0x20], [2.0 ** -130]),
    # amax 2^100: X = 2^92, code 219. 3 * 2^99 / 2^92 = 384 = 1.5 * 2^8 (exp 15, mantissa 100: 0x7C).
    "large": (_mx([2.0 ** 100, 3 * 2.0 ** 99]), 219, [0x78, 0x7C], [2.0 ** 100, 3 * 2.0 ** 99]),
}


@pytest.mark.parametrize("case", MX_CASES)
def test_mxfp8_by_hand(case):
    block, scale, codes, values = MX_CASES[case]
    q = quantize(_bf16(block).reshape(1, 32), "mxfp8")
    assert q.scales.view(torch.uint8).flatten().tolist() == [scale]
    assert q.data.view(torch.uint8).flatten().tolist()[:len(codes)] == codes
    assert dequantize(q, "mxfp8").to(torch.float64).flatten().tolist()[:len(values)] == values
    # and the reference, written from the rule, agrees with the hand arithmetic
    r = ref.quantize_mxfp8([block])
    assert r.scales == [[scale]] and r.codes[0][:len(codes)] == codes and r.values[0][:len(values)] == values


def test_mxfp8_minus_125_becomes_minus_112():
    """OCP MX v1.0 rounds the block max DOWN to a power of two (X = 2^(floor(log2 amax) - 8)),
    so the block max scales into [256, 512) and anything above 448 saturates: intended, 10.4 % here.
    In a block whose amax is 128, X = 1/2, -125 / (1/2) = -250: step 16 -> 15.625 -> 16 -> -256 -> -128."""
    q = quantize(_bf16(_mx([-125.0, 3.0])).reshape(1, 32), "mxfp8")
    assert dequantize(q, "mxfp8")[0, 0].item() == -112.0
    q = quantize(_bf16(_mx([-125.0, 128.0])).reshape(1, 32), "mxfp8")
    assert dequantize(q, "mxfp8")[0, 0].item() == -128.0


FP8_CASES = {
    # amax 448: scale = 448/448 = 1. 448 -> 0x7E; -224 = -1.75 * 2^7 (exp 14, mantissa 110: 0xF6);
    # 1 -> 0x38; 0 -> 0x00.
    "e4m3 unit scale": ("fp8_e4m3", [448.0, -224.0, 1.0, 0.0], 1.0, [0x7E, 0xF6, 0x38, 0x00],
                        [448.0, -224.0, 1.0, 0.0]),
    # amax 7: scale = 7/448 = 1/64 exactly. 7 * 64 = 448 (0x7E); -3 * 64 = -192 = -1.5 * 2^7
    # (exp 14, mantissa 100: 0xF4); 0.10009765625 (bf16 of 0.1) * 64 = 6.40625 = 2^2 * 1.6015625,
    # step 2^(2-3) = 1/2: 12.8125 -> 13 -> 6.5 (exp 9, mantissa 101: 0x4D) -> 6.5/64 = 0.1015625.
    "e4m3 scale 1/64": ("fp8_e4m3", [7.0, -3.0, 0.10009765625], 1 / 64, [0x7E, 0xF4, 0x4D],
                        [7.0, -3.0, 0.1015625]),
    # amax 57344: scale 1. 3 -> 0x42; 9 -> tie -> 8 (0x48); 11 -> 12 (0x4A); 2^-16 -> 0x01.
    "e5m2 unit scale": ("fp8_e5m2", [57344.0, 3.0, 9.0, 11.0, 2.0 ** -16], 1.0, [0x7B, 0x42, 0x48, 0x4A, 0x01],
                        [57344.0, 3.0, 8.0, 12.0, 2.0 ** -16]),
    # all zero: scale 1 by convention
    "e4m3 all zero": ("fp8_e4m3", [0.0, 0.0], 1.0, [0x00, 0x00], [0.0, 0.0]),
}


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_by_hand(case):
    dtype, values, scale, codes, back = FP8_CASES[case]
    q = quantize(_bf16(values), dtype)
    assert q.scale.item() == scale
    assert q.data.view(torch.uint8).tolist() == codes
    assert dequantize(q, dtype).to(torch.float64).tolist() == back
    r = ref.quantize_fp8(values, dtype)
    assert (r.scale, r.codes, r.values) == (scale, codes, back)


# ---------------------------------------------------------------------------
# The runtime against the reference on random bf16 inputs


def _bf16_of_bits(bits: int) -> float:
    """A finite bf16 value from its 16 bits (exponent field 255, Inf/NaN, excluded by the strategy)."""
    return ref.to_float(*ref.decode(bits, ref.BF16))


any_bf16 = st.integers(0, 0xFFFF).filter(lambda b: (b >> 7) & 0xFF != 0xFF).map(_bf16_of_bits)


@st.composite
def blocky_bf16(draw, n: int) -> list[float]:
    """n bf16 values around one magnitude (as real weights are): exponents within 2^-12 of a
    random base, so that blocks mix saturation, normal rounding and subnormals."""
    base = draw(st.integers(-140, 120))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["near", "near", "near", "zero", "any"]))
        if kind == "zero":
            out.append(draw(st.sampled_from([0.0, -0.0])))
        elif kind == "any":
            out.append(draw(any_bf16))
        else:
            mant, shift, sign = draw(st.integers(0, 255)), draw(st.integers(0, 12)), draw(st.integers(0, 1))
            a = Fraction(mant, 128) * Fraction(2) ** (base - shift)
            out.append(ref.to_float(*ref.round_to(sign, a, ref.BF16)))
    return out


def _rows(values: list[float], width: int) -> list[list[float]]:
    return [values[i:i + width] for i in range(0, len(values), width)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3).flatmap(lambda rows: st.integers(1, 2).flatmap(
    lambda blocks: st.tuples(st.just((rows, 32 * blocks)), blocky_bf16(rows * 32 * blocks)))))
def test_mxfp8_matches_the_reference(case):
    (rows, width), values = case
    r = ref.quantize_mxfp8(_rows(values, width))
    q = quantize(_bf16(values).reshape(rows, width), "mxfp8")
    assert q.scales.view(torch.uint8).tolist() == r.scales
    assert q.data.view(torch.uint8).tolist() == r.codes
    assert dequantize(q, "mxfp8").to(torch.float64).tolist() == r.values
    # the error bounds of reference_quant's docstring
    for row, got, exps in zip(_rows(values, width), r.values, r.scales):
        for i, (v, d) in enumerate(zip(row, got)):
            X = Fraction(2) ** (exps[i // 32] - 127)
            v, d = Fraction(v), Fraction(d)
            if abs(v) <= 448 * X:  # (+ half of bf16's subnormal spacing: r.values are bf16, see fp8 below)
                assert abs(d - v) <= abs(v) / 16 + X / 1024 + Fraction(1, 2 ** 134), (v, d, X)
            else:
                assert abs(d) == 448 * X and abs(v) < 512 * X and abs(d - v) < abs(v) / 8


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fp8_e4m3", "fp8_e5m2"]), st.integers(1, 64).flatmap(blocky_bf16))
# bf16 subnormals (a CI run found it): 11 * 2**-133 -> code 288 of scale 2633 * 2**-149 -> 11.57 * 2**-133,
# which bf16 holds as 12 * 2**-133
@example("fp8_e4m3", [0.0] * 7 + [18 * 2.0 ** -133, 0.0, 0.0, 11 * 2.0 ** -133])
def test_fp8_matches_the_reference(dtype, values):
    r = ref.quantize_fp8(values, dtype)
    q = quantize(_bf16(values), dtype)
    assert q.scale.item() == r.scale
    assert q.data.view(torch.uint8).tolist() == r.codes
    assert dequantize(q, dtype).to(torch.float64).tolist() == r.values
    rel, sub = (Fraction(1, 16), Fraction(1, 1024)) if dtype == "fp8_e4m3" else (Fraction(1, 8), Fraction(1, 2 ** 17))
    s = Fraction(r.scale)
    for v, d in zip(values, r.values):
        v, d = Fraction(v), Fraction(d)
        # r.values are bf16: 1/256 of |v| for its rounding, and below 2**-126 its spacing is
        # 2**-133 (subnormals), so rounding there adds up to half of that
        assert abs(d - v) <= (rel + Fraction(1, 256)) * abs(v) + sub * s + Fraction(1, 2 ** 134), (dtype, v, d, s)


@settings(max_examples=40, deadline=None)
@given(st.lists(any_bf16, min_size=32, max_size=32))
def test_mxfp8_matches_the_reference_on_any_bf16(values):
    """Whole-range bf16 bit patterns: huge and tiny values in one block."""
    r = ref.quantize_mxfp8([values])
    q = quantize(_bf16(values).reshape(1, 32), "mxfp8")
    assert q.scales.view(torch.uint8).tolist() == r.scales
    assert q.data.view(torch.uint8).tolist() == r.codes
    assert dequantize(q, "mxfp8").to(torch.float64).tolist() == r.values
