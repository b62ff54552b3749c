"""Quantized bytes on the wire (LANGUAGE.md 4.1; the rule is layoutlang/compiler/wire.py).

An op whose destination slice covers whole scale blocks carries the
destination's own format: the sender quantizes the bf16 block the receiver
would have assembled (`pack`: the data bytes, then each block-scale grid's
bytes, row-major), the receiver copies them into its storage (`unpack_into`).
Per-tensor scales do not travel with the data: the receiver agrees the
tensor's amax first (Refitter's scale exchange) and both sides derive the
scale from it (`quant.tensor_scale`).
"""

from __future__ import annotations

from math import prod

import torch

from layoutlang.compiler.wire import data_slice, scale_slice
from layoutlang.vocabulary import DTYPE

from .quant import FORMATS, empty, quantize_into, tensor_scale


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (or copy, when it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _slices(sl) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


def _parts(value, dtype: str, dst_slice, local: tuple[int, ...]):
    """(storage tensor, its slice) for the data and each block-scale grid, in wire order."""
    _, parts = FORMATS[dtype]
    out = [(getattr(value, parts[0].name), data_slice(dst_slice, dtype))]
    for p in parts[1:]:
        if p.grid.block:
            out.append((getattr(value, p.name), scale_slice(dst_slice, local, p.grid)))
    return out


def wire_bytes(dtype: str, dst_slice, local: tuple[int, ...]) -> int:
    """Bytes of `pack`'s buffer: data and block scales (no per-tensor scale)."""
    n = prod(b - a for a, b in data_slice(dst_slice, dtype))
    for grid in DTYPE[dtype].scales:
        if grid.block:
            n += prod(b - a for a, b in scale_slice(dst_slice, local, grid)) * grid.bytes
    return n


def pack(block: torch.Tensor, dtype: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """`block` (bf16, whole scale blocks of the destination) quantized: one uint8 buffer of its
    data bytes then each block-scale grid's bytes. `amax`: the whole destination tensor's, for
    formats with a per-tensor scale."""
    value = empty(dtype, tuple(block.shape), block.device)
    quantize_into(block, value, dtype, amax)
    whole = tuple((0, n) for n in block.shape)
    return torch.cat([_raw(t) for t, _ in _parts(value, dtype, whole, tuple(block.shape))])


def forwarded(value, dtype: str, src_slice, local: tuple[int, ...]) -> torch.Tensor:
    """A same-format source's own bytes of `src_slice` (whole blocks; layoutlang/compiler/wire.py
    `forwards`), in `pack`'s order: what `pack` would give, without dequantizing."""
    return torch.cat([_raw(t[_slices(sl)]) for t, sl in _parts(value, dtype, src_slice, local)])


def unpack_into(buf: torch.Tensor, value, dtype: str, dst_slice, local: tuple[int, ...]) -> None:
    """Copy a packed buffer into the destination's data and block scales at `dst_slice`."""
    at = 0
    for t, sl in _parts(value, dtype, dst_slice, local):
        view = t[_slices(sl)]
        n = view.numel() * view.element_size()
        view.copy_(buf[at:at + n].view(view.dtype).reshape(view.shape))
        at += n


def landed(value, dtype: str, dst_slice, local: tuple[int, ...]) -> torch.Tensor:
    """The bytes a packed op left in the destination, in `pack`'s order (for verification)."""
    return torch.cat([_raw(t[_slices(sl)]) for t, sl in _parts(value, dtype, dst_slice, local)])


def write_tensor_scale(value, dtype: str, amax: torch.Tensor) -> None:
    """Store the per-tensor scale the agreed amax gives (fp8's `scale`, nvfp4's `global_scale`)."""
    _, parts = FORMATS[dtype]
    for p in parts[1:]:
        if not p.grid.block:
            t = getattr(value, p.name)
            t.copy_(tensor_scale(dtype, amax).to(t.dtype).reshape(t.shape))
