"""A slow, independent reference for FP8 / MXFP8 / FP8-b128 / MXFP4 / NVFP4 quantization, from the rules.

Why: layoutlang/runtime/quant.py is the code under test; a test that builds its expected
bytes with `quantize()` can only show that the runtime agrees with itself. This
module never calls torch: every value is an exact `Fraction`, every rounding is
written out, every code is assembled from its sign, exponent and mantissa bits.

Formats (OCP 8-bit Floating Point Specification (OFP8) v1.0; OCP Microscaling
Formats (MX) Specification v1.0)::

    format   exp bits  bias  mantissa bits  min normal  min subnormal  max finite      NaN / Inf
    e4m3     4         7     3              2^-6        2^-9           1.75 * 2^8 = 448    S.1111.111 / none
    e5m2     5         15    2              2^-14       2^-16          1.75 * 2^15 = 57344 S.11111.xx (xx != 0) / S.11111.00
    e2m1     2         1     1              2^0         2^-1           1.5 * 2^2 = 6       none / none
    bf16     8         127   7              2^-126      2^-133         (overflow never happens here)
    fp32     8         127   23             2^-126      2^-149
    E8M0     8         127   0              2^-127 (code 0) .. 2^127 (code 254); code 255 is NaN

Rounding: round to nearest, ties to even (on the mantissa's last bit), with
gradual underflow (subnormals); a result beyond the max finite magnitude
SATURATES to +-max (the runtime's convention: `.clamp(-fmax, fmax)` before the
cast; OFP8 calls it "saturating" conversion). The sign of a zero result is the
sign of the input (IEEE 754: -tiny rounds to -0).

mxfp8 (OCP MX v1.0 section 6.3, per block of 32 consecutive elements of the
last dim)::

    X      = 2^(floor(log2(amax)) - emax(e4m3)),  emax(e4m3) = 8
             the shared exponent is clamped to E8M0's range [-127, 127]
    P_i    = saturate(RNE_e4m3(V_i / X))           V_i / X is exact (X is a power of two)
    scale  = E8M0 code (exponent + 127)
    all-zero block (amax = 0; log2 is undefined, the spec leaves X free):
             the convention here is the smallest scale, code 0 (X = 2^-127), all elements +0 / -0

Because X rounds the block max DOWN to a power of two, amax / X lies in
[256, 512): a scaled element in (448, 512) saturates to 448. So -125 in a block
whose amax is 125 (X = 2^(6 - 8) = 1/4, -125 / (1/4) = -500) becomes -448 * 1/4
= -112: a 10.4 % error, and up to 12.5 % (just under 512 -> 448) is allowed by
the rule. This is what OCP MX v1.0 specifies, not a bug (docs/runtime.md).

fp8_e4m3 / fp8_e5m2 (one scale per LOCAL tensor, LANGUAGE.md section 4)::

    scale  = RNE_fp32(amax / fmax)        (fmax = 448 or 57344; computed in fp32)
             amax = 0 (or an empty tensor): scale = 1
    P_i    = saturate(RNE_fp8(RNE_fp32(V_i / scale)))   the quotient is an fp32 division
    value  = P_i * scale

fp8_b128 (LANGUAGE.md 4.1; DeepSeek-V3's `weight_scale_inv` grid): every 128 x 128
block of the local last two dims (edge blocks partial; leading dims are a batch) is
quantized exactly as a per-tensor fp8_e4m3 tensor above: scale = RNE_fp32(amax / 448)
(1 for an all-zero block), P_i = saturate(RNE_e4m3(RNE_fp32(V_i / scale))). The stored
scale is the multiplier (value = P * scale), as DeepSeek-V3's weight_dequant uses it.

mxfp4 (OCP MX v1.0, e2m1 elements, per block of 32 of the last dim)::

    X      = 2^(floor(log2(amax)) - emax(e2m1)),  emax(e2m1) = floor(log2 6) = 2, clamped to [-127, 127]
    P_i    = saturate(RNE_e2m1(V_i / X))           grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even
                                                   mantissa bit (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
                                                   1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
    all-zero block: code 0 (X = 2^-127), as mxfp8
    packing: byte j of a row = code(2j) | code(2j + 1) << 4  (the even element in the low nibble:
             the gpt-oss checkpoint / transformers' convert_moe_packed_tensors, NVIDIA ModelOpt)

amax / X lies in [4, 8): elements scaling into (6, 8) saturate to 6 (up to 25 % off).

nvfp4 (NVIDIA's two-level scheme, ModelOpt's NVFP4QTensor order of fp32 operations;
blocks of 16 of the last dim)::

    g      = RNE_fp32(amax / 2688)                  2688 = 448 * 6; amax over the LOCAL tensor;
                                                    amax = 0 (or an empty tensor): g = 1
    s_raw  = RNE_fp32(bamax / RNE_fp32(6 * g))      bamax: the block's max |V|
             s_raw = 0 -> 1; s_raw < 2^-9 -> 2^-9   (ModelOpt's rules: no zero block scale)
    s      = saturate(RNE_e4m3(s_raw))              stored as its e4m3 code
    d      = RNE_fp32(s * g)
    P_i    = saturate(RNE_e2m1(RNE_fp32(V_i / d)))  d = 0 (underflow, only for amax < 2^-120 or so):
                                                    P_i = 0 with V_i's sign
    value  = RNE_bf16(RNE_fp32(P_i * d))

Zero signs: every rounding keeps the input's sign (-tiny -> -0, code 0x8 in e2m1);
ModelOpt writes +0 for an input of exactly -0.0 (its sign is `V < 0`), the only
difference from its bytes.

NaN policy (mxfp4, nvfp4, fp8_b128; inputs are finite in a refit, since every
value sent is a finite bf16 or a dequantized finite code): a scale block holding
NaN or +-Inf gets a NaN scale (E8M0 code 255; fp32 NaN for fp8_b128) and zero
codes, so every element of the block dequantizes to NaN (OCP MX: a NaN scale makes
the block NaN whatever its elements); for nvfp4 the block is the whole local
tensor: NaN global scale, every block scale 0x7F (e4m3 NaN), zero codes.

Dequantization (what travels on the wire, LANGUAGE.md section 4): the product
code value * scale computed in fp32, then rounded to bf16 (nvfp4: P * d above).

Error bounds (per element, V a bf16 input, D = dequantize(quantize(V))), each
checked by tests/test_quant_reference.py on random inputs::

    mxfp8, |V| <= 448 X:  |D - V| <= 2^-4 |V| + 2^-10 X   (half an e4m3 ulp: 3 mantissa bits;
                                                          2^-10 X is half the subnormal step)
    mxfp8, |V| >  448 X:  |D - V| = |V| - 448 X < |V| / 8 (saturation; only elements with
                                                          |V| / X in (448, 512))
    fp8_e4m3:             |D - V| <= 2^-4 |V| + 2^-10 scale + 2^-8 |V|  (e4m3 half ulp, bf16 of the
                                                          product, and the fp32 steps)
    fp8_e5m2:             |D - V| <= 2^-3 |V| + 2^-17 scale + 2^-8 |V|
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

MX_BLOCK = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class BinaryFormat:
    """A binary floating-point format: fields and the finite range."""

    name: str
    exp_bits: int
    mant_bits: int
    bias: int
    max_exp_field: int   # the largest exponent field of a finite value
    max_mant_at_max: int  # the largest mantissa field at that exponent

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max_finite(self) -> Fraction:
        return (1 + Fraction(self.max_mant_at_max, 2 ** self.mant_bits)) * Fraction(2) ** (self.max_exp_field - self.bias)


# e4m3 ("fn": no infinities; only S.1111.111 is NaN, so 1111.110 = 448 is finite)
E4M3 = BinaryFormat("e4m3", 4, 3, 7, 15, 6)
# e5m2 (IEEE-like: exponent field 31 is Inf/NaN)
E5M2 = BinaryFormat("e5m2", 5, 2, 15, 30, 3)
BF16 = BinaryFormat("bf16", 8, 7, 127, 254, 127)
FP32 = BinaryFormat("fp32", 8, 23, 127, 254, 2 ** 23 - 1)
E2M1 = BinaryFormat("e2m1", 2, 1, 1, 3, 1)  # no Inf, no NaN: every code is finite
FP8 = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "mxfp8": E4M3}
NVFP4_BLOCK = 16
B128 = 128
E8M0_NAN = 255
E4M3_NAN = 0x7F


# ---------------------------------------------------------------------------
# Exact helpers


def floor_log2(a: Fraction) -> int:
    """floor(log2(a)) for a > 0, exactly."""
    assert a > 0
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return e


def round_half_even(r: Fraction) -> int:
    """The integer nearest to r; a tie goes to the even integer."""
    n = math.floor(r)
    rest = r - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        return n + 1
    return n


def exact(x: float) -> tuple[int, Fraction]:
    """(sign bit, magnitude) of a finite float (keeps the sign of -0.0)."""
    assert math.isfinite(x), x
    return (1 if math.copysign(1.0, x) < 0 else 0), abs(Fraction(x))


# ---------------------------------------------------------------------------
# Encoding: sign, exponent field, mantissa field


def encode(sign: int, a: Fraction, fmt: BinaryFormat) -> int:
    """The code of magnitude `a` (with `sign`) in `fmt`: RNE, subnormals, saturation."""
    m = fmt.mant_bits
    if a == 0:
        exp_field, mant = 0, 0
    elif floor_log2(a) < fmt.emin:
        # subnormal range: a multiple of the subnormal step 2^(emin - m)
        steps = round_half_even(a / Fraction(2) ** (fmt.emin - m))
        if steps == 2 ** m:          # rounded up to the smallest normal number
            exp_field, mant = 1, 0
        else:
            exp_field, mant = 0, steps
    else:
        e = floor_log2(a)
        # significand in [2^m, 2^(m+1)) units of 2^(e - m)
        sig = round_half_even(a / Fraction(2) ** (e - m))
        if sig == 2 ** (m + 1):      # rounding carried into the next binade
            e, sig = e + 1, 2 ** m
        exp_field, mant = e + fmt.bias, sig - 2 ** m
    # saturate: beyond the largest finite value -> the largest finite value
    if exp_field > fmt.max_exp_field or (exp_field == fmt.max_exp_field and mant > fmt.max_mant_at_max):
        exp_field, mant = fmt.max_exp_field, fmt.max_mant_at_max
    return (sign << (fmt.exp_bits + m)) | (exp_field << m) | mant


def decode(code: int, fmt: BinaryFormat) -> tuple[int, Fraction]:
    """(sign bit, magnitude) of a finite code."""
    m = fmt.mant_bits
    sign = code >> (fmt.exp_bits + m)
    exp_field = (code >> m) & (2 ** fmt.exp_bits - 1)
    mant = code & (2 ** m - 1)
    assert exp_field < fmt.max_exp_field or (exp_field == fmt.max_exp_field and mant <= fmt.max_mant_at_max), \
        f"{code:#x} is not a finite {fmt.name} code"
    if exp_field == 0:
        return sign, Fraction(mant, 2 ** m) * Fraction(2) ** fmt.emin
    return sign, (1 + Fraction(mant, 2 ** m)) * Fraction(2) ** (exp_field - fmt.bias)


def round_to(sign: int, a: Fraction, fmt: BinaryFormat) -> tuple[int, Fraction]:
    """Round (sign, a) to `fmt` (RNE, saturating) and return the exact result."""
    return decode(encode(sign, a, fmt), fmt)


def to_float(sign: int, a: Fraction) -> float:
    return -float(a) if sign else float(a)


# ---------------------------------------------------------------------------
# Quantization


@dataclass(frozen=True)
class MXFP8Ref:
    codes: list[list[int]]   # per row, e4m3 codes
    scales: list[list[int]]  # per row, per block of 32: E8M0 codes
    values: list[list[float]]  # per row, dequantized to bf16


@dataclass(frozen=True)
class Fp8Ref:
    codes: list[int]    # flat e4m3/e5m2 codes
    scale: float        # fp32
    values: list[float]  # flat, dequantized to bf16


def mx_shared_exponent(block: list[float]) -> int:
    """E8M0 exponent (unbiased) of one 32-element block, OCP MX v1.0 section 6.3."""
    amax = max((abs(Fraction(v)) for v in block), default=Fraction(0))
    if amax == 0:
        return -E8M0_BIAS  # all-zero block: the smallest scale, code 0
    emax_e4m3 = floor_log2(E4M3.max_finite)  # 448 = 1.75 * 2^8 -> 8
    return max(-E8M0_BIAS, min(E8M0_BIAS, floor_log2(amax) - emax_e4m3))


def quantize_mxfp8(rows: list[list[float]]) -> MXFP8Ref:
    """Rows of bf16 values (the last dim a multiple of 32) -> codes, E8M0 scales, dequantized values."""
    codes, scales, values = [], [], []
    for row in rows:
        assert len(row) % MX_BLOCK == 0, len(row)
        rc, rs, rv = [], [], []
        for b in range(0, len(row), MX_BLOCK):
            block = row[b:b + MX_BLOCK]
            x = mx_shared_exponent(block)
            X = Fraction(2) ** x
            rs.append(x + E8M0_BIAS)
            for v in block:
                sign, a = exact(v)
                code = encode(sign, a / X, E4M3)
                rc.append(code)
                s, p = decode(code, E4M3)
                # the product is exact in fp32 for these exponents; kept for the convention
                rv.append(to_float(*round_to(*round_to(s, p * X, FP32), BF16)))
        codes.append(rc)
        scales.append(rs)
        values.append(rv)
    return MXFP8Ref(codes, scales, values)


def quantize_fp8(flat: list[float], dtype: str) -> Fp8Ref:
    """Per-tensor fp8 of a flat list of bf16 values -> codes, fp32 scale, dequantized values."""
    fmt = FP8[dtype]
    amax = max((abs(Fraction(v)) for v in flat), default=Fraction(0))
    scale = round_to(0, amax / fmt.max_finite, FP32)[1] if amax > 0 else Fraction(1)
    codes, values = [], []
    for v in flat:
        sign, a = exact(v)
        qs, q = round_to(sign, a / scale, FP32)  # fp32 division
        code = encode(qs, q, fmt)
        codes.append(code)
        s, p = decode(code, fmt)
        values.append(to_float(*round_to(*round_to(s, p * scale, FP32), BF16)))
    return Fp8Ref(codes, float(scale), values)


# ---------------------------------------------------------------------------
# Block-scaled formats of LANGUAGE.md 4.1: fp8_b128, mxfp4, nvfp4


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


def pack_e2m1(codes: list[int]) -> list[int]:
    """Two e2m1 codes per byte: element 2j in the low nibble, 2j + 1 in the high nibble."""
    assert len(codes) % 2 == 0
    return [codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2)]


@dataclass(frozen=True)
class PackedRef:
    codes: list[list[int]]    # per row, per element: e2m1 codes (0..15)
    packed: list[list[int]]   # per row: bytes, two codes each
    scales: list[list[int]]   # per row, per block: E8M0 (mxfp4) or e4m3 (nvfp4) codes
    global_scale: float       # nvfp4's fp32 global scale (1.0 for mxfp4, unused)
    values: list[list[float]]  # per row, dequantized to bf16


def quantize_mxfp4(rows: list[list[float]]) -> PackedRef:
    """Rows of bf16 values (the last dim a multiple of 32) -> e2m1 codes, packed bytes, E8M0 scales, values."""
    codes, scales, values = [], [], []
    for row in rows:
        assert len(row) % MX_BLOCK == 0, len(row)
        rc, rs, rv = [], [], []
        for b in range(0, len(row), MX_BLOCK):
            block = row[b:b + MX_BLOCK]
            if not _finite(block):  # NaN policy: NaN scale, zero codes
                rs.append(E8M0_NAN)
                rc += [0] * MX_BLOCK
                rv += [math.nan] * MX_BLOCK
                continue
            amax = max(abs(Fraction(v)) for v in block)
            emax_e2m1 = floor_log2(E2M1.max_finite)  # 6 = 1.5 * 2^2 -> 2
            x = -E8M0_BIAS if amax == 0 else max(-E8M0_BIAS, min(E8M0_BIAS, floor_log2(amax) - emax_e2m1))
            X = Fraction(2) ** x
            rs.append(x + E8M0_BIAS)
            for v in block:
                sign, a = exact(v)
                code = encode(sign, a / X, E2M1)  # V / X is exact: X is a power of two
                rc.append(code)
                s, p = decode(code, E2M1)
                rv.append(to_float(*round_to(*round_to(s, p * X, FP32), BF16)))
        codes.append(rc)
        scales.append(rs)
        values.append(rv)
    return PackedRef(codes, [pack_e2m1(r) for r in codes], scales, 1.0, values)


def quantize_nvfp4(rows: list[list[float]]) -> PackedRef:
    """The rows of ONE local tensor (the global scale is the tensor's; the last dim a multiple
    of 16) -> e2m1 codes, packed bytes, e4m3 block scale codes, fp32 global scale, values."""
    flat = [v for row in rows for v in row]
    if not _finite(flat):  # NaN policy: the whole tensor
        return PackedRef([[0] * len(r) for r in rows], [pack_e2m1([0] * len(r)) for r in rows],
                         [[E4M3_NAN] * (len(r) // NVFP4_BLOCK) for r in rows], math.nan,
                         [[math.nan] * len(r) for r in rows])
    amax = max((abs(Fraction(v)) for v in flat), default=Fraction(0))
    g = round_to(0, amax / (E4M3.max_finite * E2M1.max_finite), FP32)[1] if amax > 0 else Fraction(1)
    six_g = round_to(0, 6 * g, FP32)[1]
    codes, scales, values = [], [], []
    for row in rows:
        assert len(row) % NVFP4_BLOCK == 0, len(row)
        rc, rs, rv = [], [], []
        for b in range(0, len(row), NVFP4_BLOCK):
            block = row[b:b + NVFP4_BLOCK]
            bamax = max(abs(Fraction(v)) for v in block)
            raw = round_to(0, bamax / six_g, FP32)[1]
            if raw == 0:
                raw = Fraction(1)
            raw = max(raw, Fraction(1, 2 ** 9))  # e4m3's smallest subnormal
            s_code = encode(0, raw, E4M3)
            rs.append(s_code)
            d = round_to(0, decode(s_code, E4M3)[1] * g, FP32)[1]
            for v in block:
                sign, a = exact(v)
                if d == 0:
                    code = encode(sign, Fraction(0), E2M1)
                else:
                    code = encode(*round_to(sign, a / d, FP32), E2M1)
                rc.append(code)
                s, p = decode(code, E2M1)
                rv.append(to_float(*round_to(*round_to(s, p * d, FP32), BF16)))
        codes.append(rc)
        scales.append(rs)
        values.append(rv)
    return PackedRef(codes, [pack_e2m1(r) for r in codes], scales, float(g), values)


@dataclass(frozen=True)
class Fp8B128Ref:
    codes: list[list[int]]      # per row, e4m3 codes
    scales: list[list[float]]   # per block row, per block column: fp32 scales
    values: list[list[float]]   # per row, dequantized to bf16


def quantize_fp8_b128(matrix: list[list[float]]) -> Fp8B128Ref:
    """One [M, N] matrix of bf16 values -> e4m3 codes, one fp32 scale per 128 x 128 block, values.
    Each block (edge blocks partial) is quantized exactly as a per-tensor fp8_e4m3 tensor."""
    m, n = len(matrix), len(matrix[0]) if matrix else 0
    codes = [[0] * n for _ in range(m)]
    values = [[0.0] * n for _ in range(m)]
    scales = []
    for bi in range(0, m, B128):
        srow = []
        for bj in range(0, n, B128):
            cells = [(i, j) for i in range(bi, min(bi + B128, m)) for j in range(bj, min(bj + B128, n))]
            block = [matrix[i][j] for i, j in cells]
            if not _finite(block):  # NaN policy: NaN scale, zero codes
                srow.append(math.nan)
                for i, j in cells:
                    codes[i][j], values[i][j] = 0, math.nan
                continue
            r = quantize_fp8(block, "fp8_e4m3")
            srow.append(r.scale)
            for (i, j), c, v in zip(cells, r.codes, r.values):
                codes[i][j], values[i][j] = c, v
        scales.append(srow)
    return Fp8B128Ref(codes, scales, values)
