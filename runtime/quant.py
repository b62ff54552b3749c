"""FP8 and MXFP8 tensors as callers pass them, and quantize-once in place.

How a caller passes a quantized tensor (LANGUAGE.md section 4):

- ``fp8_e4m3`` / ``fp8_e5m2``: ``Fp8Tensor(data, scale)`` — ``data`` has the
  layout's local shape and dtype ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``;
  ``scale`` is a one-element fp32 tensor; value = data * scale.
- ``mxfp8``: ``MXFP8Tensor(data, scales)`` — ``data`` is ``float8_e4m3fn`` with
  the local shape; ``scales`` has the local shape with the last dim divided by
  32, dtype ``uint8`` (or ``float8_e8m0fnu``), each an E8M0 power of two
  2**(s - 127) shared by 32 consecutive elements of the last dim.

A plain tuple ``(data, scale)`` is accepted for either. Quantizing writes into
the existing ``data`` and ``scale(s)`` storage, so pointers captured by CUDA
graphs stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "mxfp8": torch.float8_e4m3fn}
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MX_BLOCK = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class Fp8Tensor:
    data: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class MXFP8Tensor:
    data: torch.Tensor
    scales: torch.Tensor


def as_quantized(value, dtype: str):
    """Normalize what a caller passed for a quantized tensor (tuples allowed)."""
    if isinstance(value, (Fp8Tensor, MXFP8Tensor)):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return MXFP8Tensor(*value) if dtype == "mxfp8" else Fp8Tensor(*value)
    return value


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def dequantize(value, dtype: str) -> torch.Tensor:
    """bf16 copy of a quantized tensor's values (what travels on the wire)."""
    if dtype == "mxfp8":
        exps = _scale_bytes(value.scales).to(torch.int32) - E8M0_BIAS
        scale = torch.pow(2.0, exps.to(torch.float32)).repeat_interleave(MX_BLOCK, dim=-1)
        return (value.data.to(torch.float32) * scale).to(torch.bfloat16)
    return (value.data.to(torch.float32) * value.scale.to(torch.float32)).to(torch.bfloat16)


def quantize_into(src: torch.Tensor, value, dtype: str) -> None:
    """Quantize `src` (bf16, the whole local tensor) once into value's storage, in place."""
    x = src.to(torch.float32)
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
    amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = (amax / fmax) if amax > 0 else torch.tensor(1.0)
    value.data.copy_((x / scale).clamp(-fmax, fmax).to(fp8))
    value.scale.copy_(scale.to(value.scale.dtype).reshape(value.scale.shape))


def quantize(src: torch.Tensor, dtype: str):
    """A fresh quantized tensor of `src` (the reference a test compares against)."""
    if dtype == "mxfp8":
        out = MXFP8Tensor(torch.empty(src.shape, dtype=torch.float8_e4m3fn),
                          torch.empty(*src.shape[:-1], src.shape[-1] // MX_BLOCK, dtype=torch.uint8))
    else:
        out = Fp8Tensor(torch.empty(src.shape, dtype=FP8_DTYPES[dtype]), torch.ones(1, dtype=torch.float32))
    quantize_into(src, out, dtype)
    return out
