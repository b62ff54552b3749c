"""Quantized tensors as callers pass them, and quantize-once in place.

How a caller passes a quantized tensor (LANGUAGE.md sections 4 and 4.1; the
shapes follow from `layoutlang.vocabulary.DTYPE`, the storage convention is
written out in docs/runtime.md):

- ``fp8_e4m3`` / ``fp8_e5m2``: ``Fp8Tensor(data, scale)`` — ``data`` has the
  layout's local shape and dtype ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``;
  ``scale`` is a one-element fp32 tensor; value = data * scale.
- ``mxfp8``: ``MXFP8Tensor(data, scales)`` — ``data`` is ``float8_e4m3fn`` with
  the local shape; ``scales`` has the local shape with the last dim divided by
  32, dtype ``uint8`` (or ``float8_e8m0fnu``), each an E8M0 power of two
  2**(s - 127) shared by 32 consecutive elements of the last dim.
- ``fp8_b128``: ``Fp8BlockTensor(data, scales)`` — ``data`` is ``float8_e4m3fn``
  with the local shape [..., M, N]; ``scales`` is fp32 [..., cdiv(M, 128),
  cdiv(N, 128)], one per 128 x 128 block (edge blocks partial); value = data *
  scale (DeepSeek-V3's ``weight_scale_inv``: despite the name, the multiplier).
- ``mxfp4``: ``MXFP4Tensor(data, scales)`` — ``data`` is ``uint8`` (or
  ``float4_e2m1fn_x2``) [..., N/2], two e2m1 codes per byte along the last dim,
  element 2j in the low nibble and 2j+1 in the high one; ``scales`` as mxfp8's.
- ``nvfp4``: ``NVFP4Tensor(data, scales, global_scale)`` — ``data`` packed as
  mxfp4's; ``scales`` is ``float8_e4m3fn`` [..., N/16], one per 16 elements;
  ``global_scale`` one fp32 element; value = e2m1 * (scale * global_scale).

A plain tuple of the same tensors in the same order is accepted for each.
Quantizing writes into the existing storage, so pointers captured by CUDA
graphs stay valid. The rounding rules are in docs/runtime.md and, bit by bit,
in tests/reference_quant.py, which tests/test_quant_*.py compare with.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from layoutlang.vocabulary import DTYPE, FP8_B128_BLOCK, NVFP4_BLOCK, ScaleGrid

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "mxfp8": torch.float8_e4m3fn,
              "fp8_b128": torch.float8_e4m3fn}
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_EMAX = 2           # floor(log2(6)): OCP MX's emax of the e2m1 element
E4M3_MIN_SUBNORMAL = 2.0 ** -9
NVFP4_GLOBAL = E4M3_MAX * E2M1_MAX  # 2688: the global scale maps the tensor's amax to 448 * 6
# the magnitudes of e2m1 codes 0..7 (code 8 + i is -E2M1[i])
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class Fp8Tensor:
    data: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class MXFP8Tensor:
    data: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class Fp8BlockTensor:
    """fp8_b128: e4m3 data and one fp32 scale per 128 x 128 block of the last two dims."""

    data: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class MXFP4Tensor:
    """mxfp4: e2m1 codes packed two per byte (even element low) and one E8M0 scale per 32."""

    data: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class NVFP4Tensor:
    """nvfp4: e2m1 codes packed as mxfp4's, one e4m3 scale per 16, one fp32 global scale."""

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor


@dataclass(frozen=True)
class Part:
    """One tensor of a quantized value: its field, the torch dtypes accepted (the first is
    what `quantize` allocates) and its scale grid (None for the data)."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    grid: ScaleGrid | None = None

    def shape(self, dtype: str, local: tuple[int, ...]) -> tuple[int, ...]:
        return DTYPE[dtype].data_shape(local) if self.grid is None else self.grid.shape(local)


_E8M0 = (torch.uint8, torch.float8_e8m0fnu)
_PACKED = (torch.uint8, torch.float4_e2m1fn_x2)
_SCALE_DTYPES = {"fp32": (torch.float32,), "e8m0": _E8M0, "e4m3": (torch.float8_e4m3fn,)}


def _format(cls: type, dtype: str, data: tuple[torch.dtype, ...]) -> tuple[type, tuple[Part, ...]]:
    """The class a caller passes for `dtype` and its parts: the data, then one per scale grid."""
    names = [f.name for f in fields(cls)]
    grids = DTYPE[dtype].scales
    return cls, (Part(names[0], data),) + tuple(Part(n, _SCALE_DTYPES[g.code], g) for n, g in zip(names[1:], grids))


FORMATS = {
    "fp8_e4m3": _format(Fp8Tensor, "fp8_e4m3", (torch.float8_e4m3fn,)),
    "fp8_e5m2": _format(Fp8Tensor, "fp8_e5m2", (torch.float8_e5m2,)),
    "mxfp8": _format(MXFP8Tensor, "mxfp8", (torch.float8_e4m3fn,)),
    "fp8_b128": _format(Fp8BlockTensor, "fp8_b128", (torch.float8_e4m3fn,)),
    "mxfp4": _format(MXFP4Tensor, "mxfp4", _PACKED),
    "nvfp4": _format(NVFP4Tensor, "nvfp4", _PACKED),
}
assert set(FORMATS) == {d.name for d in DTYPE.values() if d.quantized}


def as_quantized(value, dtype: str):
    """Normalize what a caller passed for a quantized tensor: a tuple becomes the format's
    class; anything else (a plain dtype's tensor, any object with the fields) is returned as it is."""
    if dtype in FORMATS and isinstance(value, tuple) and len(value) == len(FORMATS[dtype][1]):
        return FORMATS[dtype][0](*value)
    return value


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors a quantized value holds (data first), whatever its format or class."""
    names = dict.fromkeys(p.name for _, parts in FORMATS.values() for p in parts)
    return [t for t in (getattr(value, n, None) for n in names) if isinstance(t, torch.Tensor)]


def storage_problem(value, dtype: str, local: tuple[int, ...]) -> str | None:
    """None if `value` (as `as_quantized` returns it) stores `dtype` for local shape `local`;
    else what is wrong (shapes and dtypes of the data and of every scale)."""
    cls, parts = FORMATS[dtype]
    if not all(isinstance(getattr(value, p.name, None), torch.Tensor) for p in parts):
        names = ", ".join(p.name for p in parts)
        return f"expected a quantized {dtype} tensor ({cls.__name__}({names}) or a tuple of them), " \
               f"got {type(value).__name__}"
    for p in parts:
        t = getattr(value, p.name)
        want = p.shape(dtype, local)
        if p.grid is not None and not p.grid.block:  # one scale for the whole tensor
            if t.numel() != 1 or t.dtype not in p.dtypes:
                return f"expected a one-element {p.dtypes[0]} {p.name}, got {list(t.shape)} {t.dtype}"
        elif tuple(t.shape) != want or t.dtype not in p.dtypes:
            return (f"expected {dtype} {p.name} {list(want)} {' or '.join(map(str, p.dtypes))}, "
                    f"got {list(t.shape)} {t.dtype}")
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a one-byte tensor (uint8 codes of e8m0, e4m3 or packed e2m1)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


_scale_bytes = _bytes  # the E8M0 codes of an MX tensor's scales


# ---------------------------------------------------------------------------
# e2m1: round to nearest even, saturating; packing two codes per byte


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) of finite fp32 `v`: round to nearest, ties to even, saturate at 6.

    The grid has steps 0.5 below 2, 1 in [2, 4), 2 from 4: dividing by the step is exact and
    torch.round ties to even, which is e2m1's even mantissa (a carry lands on the next binade).
    """
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    m = (torch.round(a / step) * step).clamp(max=E2M1_MAX)
    index = torch.bucketize(m, torch.tensor(E2M1, device=v.device))
    return (index | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8 0..15)."""
    table = torch.tensor(E2M1 + tuple(-x for x in E2M1), dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: element 2j low nibble, 2j+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(data: torch.Tensor) -> torch.Tensor:
    b = _bytes(data)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


# ---------------------------------------------------------------------------
# dequantize


def _e8m0_scale(scales: torch.Tensor) -> torch.Tensor:
    codes = _bytes(scales).to(torch.int32)
    return torch.where(codes == E8M0_NAN, torch.nan, torch.pow(2.0, (codes - E8M0_BIAS).to(torch.float32)))


def _per_block(scale: torch.Tensor, block: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """`scale` (one per block of the trailing dims) repeated over each block, cut to `shape`."""
    out = scale
    for i, b in enumerate(block):
        d = len(shape) - len(block) + i
        out = out.repeat_interleave(b, dim=d).narrow(d, 0, shape[d])
    return out


def dequantize(value, dtype: str) -> torch.Tensor:
    """bf16 copy of a quantized tensor's values (what travels on the wire)."""
    if dtype == "mxfp8":
        scale = _e8m0_scale(value.scales).repeat_interleave(MX_BLOCK, dim=-1)
        return (value.data.to(torch.float32) * scale).to(torch.bfloat16)
    if dtype == "fp8_b128":
        shape = tuple(value.data.shape)
        scale = _per_block(value.scales.to(torch.float32), (FP8_B128_BLOCK, FP8_B128_BLOCK), shape)
        return (value.data.to(torch.float32) * scale).to(torch.bfloat16)
    if dtype == "mxfp4":
        scale = _e8m0_scale(value.scales).repeat_interleave(MX_BLOCK, dim=-1)
        return (_e2m1_values(_unpack(value.data)) * scale).to(torch.bfloat16)
    if dtype == "nvfp4":
        # (scale * global) in fp32, then times the element in fp32, then bf16 (NVIDIA ModelOpt's order)
        block = value.scales.to(torch.float32) * value.global_scale.to(torch.float32).reshape(())
        return (_e2m1_values(_unpack(value.data)) * block.repeat_interleave(NVFP4_BLOCK, dim=-1)).to(torch.bfloat16)
    return (value.data.to(torch.float32) * value.scale.to(torch.float32)).to(torch.bfloat16)


# ---------------------------------------------------------------------------
# quantize


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of positive finite fp32 values, exactly (frexp: a = m * 2^e, m in [0.5, 1))."""
    return torch.frexp(a).exponent - 1


def _quantize_mxfp4(x: torch.Tensor, value: MXFP4Tensor) -> None:
    """OCP MX v1.0: X = 2^(floor(log2(amax)) - 2) per 32 (clamped to E8M0's [-127, 127]; an all-zero
    block gets code 0), each element RNE_e2m1(V / X) saturated; a block holding NaN or +-Inf gets
    the NaN scale (code 255) and zero codes."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(finite, blocks.abs().amax(dim=-1), 0.0)
    exp = torch.where(amax > 0, _floor_log2(amax.clamp_min(torch.finfo(torch.float32).tiny)) - E2M1_EMAX,
                      -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks / torch.pow(2.0, exp.to(torch.float32)).unsqueeze(-1)  # exact: X is a power of two
    codes = torch.where(finite.unsqueeze(-1), _e2m1_codes(torch.where(finite.unsqueeze(-1), scaled, 0.0)), 0)
    _bytes(value.data).copy_(_pack(codes.reshape(x.shape)))
    _bytes(value.scales).copy_(torch.where(finite, exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8))


def _quantize_nvfp4(x: torch.Tensor, value: NVFP4Tensor, amax: torch.Tensor | None = None) -> None:
    """NVIDIA's two-level scheme, in fp32 step by step (ModelOpt's NVFP4QTensor order):
    g = amax / 2688 (1 for an all-zero tensor); per 16, s = e4m3(bamax / (6 g)), 0 -> 1, at least
    2^-9; element RNE_e2m1(V / (s g)) saturated (0 of V's sign where s g underflows to 0). A tensor
    holding NaN or +-Inf gets a NaN global scale, NaN block scales (0x7F) and zero codes. `amax`: the
    whole tensor's, agreed beforehand when `x` is only a block of it (quantized wire)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    finite = torch.isfinite(x).all() if x.numel() else torch.tensor(True, device=x.device)
    clean = torch.where(finite, blocks, 0.0)
    if amax is None:
        amax = clean.abs().amax() if x.numel() else torch.tensor(0.0, device=x.device)
    g = tensor_scale("nvfp4", amax)
    raw = clean.abs().amax(dim=-1) / (6.0 * g) if x.numel() else torch.zeros(blocks.shape[:-1], device=x.device)
    raw = torch.where(raw == 0, 1.0, raw).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    s = raw.to(torch.float8_e4m3fn)
    denom = (s.to(torch.float32) * g).unsqueeze(-1)
    scaled = torch.where(denom > 0, clean / torch.where(denom > 0, denom, 1.0), clean * 0.0)
    codes = torch.where(finite, _e2m1_codes(scaled), 0)
    _bytes(value.data).copy_(_pack(codes.reshape(x.shape)))
    _bytes(value.scales).copy_(torch.where(finite, _bytes(s), 0x7F))
    value.global_scale.copy_(torch.where(finite, g, torch.nan).to(value.global_scale.dtype)
                             .reshape(value.global_scale.shape))


def _quantize_fp8_b128(x: torch.Tensor, value: Fp8BlockTensor) -> None:
    """Per 128 x 128 block of the last two dims (edge blocks partial), exactly fp8_e4m3's per-tensor
    rule: scale = amax / 448 in fp32 (1 for an all-zero block), element saturate(RNE_e4m3(V / scale));
    a block holding NaN or +-Inf gets a NaN scale and zero codes."""
    b = FP8_B128_BLOCK
    *lead, m, n = x.shape
    mb, nb = -(-m // b), -(-n // b)
    padded = F.pad(x, (0, nb * b - n, 0, mb * b - m))  # zeros change no amax
    blocks = padded.reshape(*lead, mb, b, nb, b)
    finite = torch.isfinite(blocks).all(dim=-1).all(dim=-2)
    clean = torch.where(finite[..., :, None, :, None], blocks, 0.0)
    amax = clean.abs().amax(dim=-1).amax(dim=-2) if clean.numel() else torch.zeros(finite.shape, device=x.device)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (clean / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(padded.shape)[..., :m, :n]
    value.data.copy_(q)
    value.scales.copy_(torch.where(finite, scale, torch.nan).to(value.scales.dtype))


def tensor_scale(dtype: str, amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale (fp32) a format derives from the local tensor's amax (fp32 of bf16 values):
    fp8_e4m3/e5m2's multiplier amax / max, nvfp4's global scale amax / 2688; 1 for an all-zero tensor."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    top = NVFP4_GLOBAL if dtype == "nvfp4" else torch.finfo(FP8_DTYPES[dtype]).max
    return torch.where(amax > 0, amax / top, 1.0)


def has_tensor_scale(dtype: str) -> bool:
    """Does the format keep one scale for the whole local tensor (its amax must be agreed first
    when senders quantize blocks of it)?"""
    return any(not g.block for g in DTYPE[dtype].scales)


def quantize_into(src: torch.Tensor, value, dtype: str, amax: torch.Tensor | None = None) -> None:
    """Quantize `src` (bf16) once into value's storage, in place.

    `src` is the whole local tensor, or (quantized wire) whole scale blocks of it with
    `amax` the whole tensor's, agreed beforehand, for formats with a per-tensor scale:
    quantization is then block-local, so the bytes equal quantizing the whole tensor's.
    """
    x = src.to(torch.float32)
    if dtype == "mxfp4":
        return _quantize_mxfp4(x, value)
    if dtype == "nvfp4":
        return _quantize_nvfp4(x, value, amax)
    if dtype == "fp8_b128":
        return _quantize_fp8_b128(x, value)
    fp8 = FP8_DTYPES[dtype]
    fmax = torch.finfo(fp8).max
    if dtype == "mxfp8":
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        # OCP MX: shared exponent floor(log2(amax)) - emax(e4m3) = - 8
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 8,
                          torch.full_like(amax, -E8M0_BIAS))
        exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
        scaled = blocks / torch.pow(2.0, exp).unsqueeze(-1)
        value.data.copy_(scaled.clamp(-fmax, fmax).reshape(x.shape).to(fp8))
        _scale_bytes(value.scales).copy_((exp + E8M0_BIAS).to(torch.uint8))
        return
    if amax is None:
        amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = tensor_scale(dtype, amax).to(x.device)
    value.data.copy_((x / scale).clamp(-fmax, fmax).to(fp8))
    value.scale.copy_(scale.to(value.scale.dtype).reshape(value.scale.shape))


def empty(dtype: str, shape: tuple[int, ...], device=None):
    """Uninitialized storage of a quantized local tensor of `shape`, in the format's first dtypes
    (a per-tensor scale is a one-element tensor)."""
    cls, parts = FORMATS[dtype]
    return cls(*(torch.empty(p.shape(dtype, tuple(shape)) if p.grid is None or p.grid.block else (1,),
                             dtype=p.dtypes[0], device=device) for p in parts))


def quantize(src: torch.Tensor, dtype: str):
    """A fresh quantized tensor of `src` (the reference a test compares against)."""
    out = empty(dtype, tuple(src.shape), src.device)
    if dtype in ("fp8_e4m3", "fp8_e5m2"):
        out.scale.fill_(1.0)
    quantize_into(src, out, dtype)
    return out


__all__ = ["tensor_scale", "has_tensor_scale", "Fp8Tensor", "MXFP8Tensor", "Fp8BlockTensor", "MXFP4Tensor", "NVFP4Tensor", "FORMATS", "as_quantized",
           "tensors_of", "storage_problem", "dequantize", "quantize_into", "quantize", "empty"]
